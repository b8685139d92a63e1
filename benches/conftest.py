"""Benchmarks import rtxdsl first so that, without a GPU, Triton's interpreter is set up."""

from __future__ import annotations

import rtxdsl  # noqa: F401
