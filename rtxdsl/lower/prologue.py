"""The traffic model's choice of a GEMM prologue: recompute an operand's elementwise producer at
load time, once per output tile that reads it, or write the operand and read it back.

Recomputing saves the operand's write (when nothing else needs it written) and one read per GEMM
that recomputes it; it costs the producer's ops again for every tile that loads each element
(the tiles along the product's other dim, times the batches that share the operand). The two are
compared on the GPU target the plan is made for (the interpreter runs the same plan): an H200
does about ``OPS_PER_BYTE`` fp32 ops on its CUDA cores in the time its memory moves one byte, and
a prologue's math runs on those cores inside the GEMM's main loop.

The decision is made once per plan, at its sizes; ``explain()`` prints it with its figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .target import GPU

#: fp32 ops per byte of memory traffic on sm_90: 132 SMs x 128 lanes x 2 (FMA) x 1.98 GHz over
#: 4.8 TB/s of HBM3e
OPS_PER_BYTE = 14


@dataclass(frozen=True)
class Operand:
    """One GEMM reading the operand: the tiles that load each of its elements."""

    side: str  # "A" or "B"
    reloads: int


def reloads(side: str, product: tuple[int, ...], operand: tuple[int, ...], sum_batch: bool) -> int:
    """How many output tiles load each element of an operand (GPU tile): the tiles along the
    product's other matrix dim, times the product's batches that share one batch of the operand."""
    block_m, block_n = GPU.gemm[:2]
    m, n = product[-2:]
    tiles = -(-n // block_n) if side == "A" else -(-m // block_m)
    if sum_batch:  # the batch dims are contracted: each batch of the operand is read once
        return max(1, tiles)
    shared = max(1, math.prod(product[:-2]) // max(1, math.prod(operand[:-2])))
    return max(1, tiles * shared)


@dataclass(frozen=True)
class Choice:
    fuse: bool
    note: str


def choose(
    name: str,
    ops: int,
    numel: int,
    itemsize: int,
    readers: list[Operand],
    computed_anyway: bool,
    written_anyway: bool,
    row_bytes: int = 0,
) -> Choice:
    """Recompute ``name`` (``ops`` elementwise ops per element, ``numel`` elements of ``itemsize``
    bytes) in each GEMM of ``readers``? ``computed_anyway``: its home kernel computes it all the
    same (another value there needs it); ``written_anyway``: it is written all the same (requested,
    or read by a kernel that is not a GEMM); ``row_bytes``: the per-row values it reads from its
    row kernel (RMSNorm's ``rstd``), written instead and read by each GEMM."""
    nbytes = numel * itemsize
    saved = nbytes * (len(readers) + (0 if written_anyway else 1)) - row_bytes * (len(readers) + 1)
    loads = sum(r.reloads for r in readers) - (0 if computed_anyway else 1)
    extra = ops * numel * loads
    budget = OPS_PER_BYTE * saved
    fuse = extra <= budget
    where = ", ".join(f"{r.side} of a GEMM, loaded by {r.reloads} tile(s)" for r in readers)
    verdict = "recomputed at load" if fuse else "written and read back"
    why = f"{ops} op(s) x {numel} elements x {loads} extra load(s) = {extra} {'<=' if fuse else '>'} {budget}"
    return Choice(fuse, f"prologue {name} as {where}: {verdict} ({why} = {OPS_PER_BYTE} ops/B x {saved} B saved)")
