"""The generated module for a KernelSpec: flat kernels (``source``) or coordinate kernels (``coords``)."""

from __future__ import annotations

from ..lower.spec import KernelSpec
from .coords import CoordWriter
from .source import MODULE, Writer
from .template import render


def kernel_source(spec: KernelSpec, name: str, signature: str, summary: str) -> str:
    """The whole generated module: imports and one ``@triton.jit`` kernel called ``name``."""
    w = Writer(spec) if spec.domain is None else CoordWriter(spec)
    kernel = w.row_kernel(name) if spec.kind == "row" else w.pointwise(name)
    helpers = "".join(f"{src}\n\n" for src in w.helpers.values())
    return render(MODULE, signature=signature, summary=summary.replace("\n", " "), helpers=helpers, kernel=kernel)
