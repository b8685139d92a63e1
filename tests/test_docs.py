"""Every docstring example in the package runs and prints what it shows (docs that cannot rot)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import rtxdsl

MODULES = sorted(m.name for m in pkgutil.walk_packages(rtxdsl.__path__, "rtxdsl.") if not m.name.endswith("__main__"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} fail (run python -m doctest)"
