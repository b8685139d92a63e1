"""Where a value lives in a kernel: its role, shared by the analyzer's groups and the kernel specs."""

from __future__ import annotations

from ..registry import Word


class Role(Word):
    """A value's place in its kernel (``f"{Role.A}"`` is ``a``)."""

    FULL = "full"  # one value per element of the kernel's domain
    KEEP = "keep"  # one value per row, its reduced dims kept (size 1)
    DROP = "drop"  # one value per row, its reduced dims dropped
    #: a GEMM's prologue: recomputed at the tiles of its left (A) or right (B) operand
    A = "a"
    B = "b"
    FREE = "free"  # coordinate kernels: evaluated only where a movement op asks for it
    SCALAR = "scalar"  # math on scalar inputs, computed once in the kernel
    #: a row kernel's column reduction (over the rows, a weight gradient's): each program merges its
    #: rows' lanes and stores the partial states another kernel merges (``Split.MERGE``)
    COLUMN = "column"
