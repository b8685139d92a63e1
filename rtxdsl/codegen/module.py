"""The generated module for a KernelSpec: flat kernels (``source``) or coordinate kernels (``coords``)."""

from __future__ import annotations

from ..lower.spec import KernelSpec
from ..recursion import deep
from .coords import CoordWriter
from .gemm import GemmWriter
from .names import user_names
from .source import MODULE, Writer
from .template import render


def _writer(spec: KernelSpec) -> Writer:
    if spec.kind == "gemm":
        return GemmWriter(spec)
    return CoordWriter(spec)


@deep
def kernel_source(spec: KernelSpec, name: str, signature: str, summary: str) -> str:
    """The whole generated module: imports and one ``@triton.jit`` kernel called ``name`` (and the
    function its last program runs, ``<name>_tail``, when the spec has a tail)."""
    w = _writer(spec)
    helpers = dict(w.helpers)
    if spec.tail is not None:
        t = _writer(spec.tail)
        t.program = "0"  # called by the head's last program: it is program 0 of one
        helpers[f"{name}_tail"] = t.row_kernel(f"{name}_tail").rstrip("\n")
        helpers.update(t.helpers)
        w.tail = (f"{name}_tail", t.params)
    if isinstance(w, GemmWriter):
        kernel = w.gemm(name)
    else:
        kernel = w.row_kernel(name) if spec.kind == "row" else w.pointwise(name)
    helpers.update(w.helpers)
    module = render(
        MODULE,
        signature=signature,
        summary=summary.replace("\n", " "),
        helpers="".join(f"{src}\n\n" for src in helpers.values()),
        kernel=kernel,
    )
    return user_names(module, spec, name)
