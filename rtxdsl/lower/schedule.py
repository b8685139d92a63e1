"""Scheduling: a fusion group + the layouts of what it reads -> its KernelSpec and launch arguments.

Each step is one function: the kernel body (nodes, deduplicated loads, scalar slots), every
operand's strides over the group's domain, coalescing of dims all operands walk together,
the int64-indexing choice, stride classes, argument packing, scalar encoding, and the launch
configuration from the heuristics table of the kernel's family.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch

from ..dtypes import compute_dtype
from ..expr import Expr, walk
from ..ops import REGISTRY, AxisRule, DtypeRule, OpKind
from .analyze import Group, Role, broadcasts, positions_only
from .expand import Graph, float_dtype_of
from .names import io_names, scalar_names
from .params import (
    inner_products,
    input_name,
    launch_ints,
    load_names,
    output_name,
    stride_name,
    strided,
    tile_loads,
    transposed_operands,
)
from .passes import levels
from .sparsity import NEUTRAL, kept_fraction, vanishing_guard
from .spec import BCAST, STRIDED, UNIT, GemmTile, KernelSpec, LoadSpec, NodeSpec, OutSpec, Split, Src, Stride
from .target import GPU, Target

INT32_LIMIT = 2**31


@dataclass(frozen=True)
class Layout:
    """Shape and strides of a tensor a kernel reads or writes."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Launch:
    """Sizes, strides and scalars in parameter order, the grid, the constexprs and launch options,
    and whether there is nothing to do.

    ``scalar_inputs`` says which arguments come from the call: (argument position, input index, kind).
    """

    ints: tuple[int, ...]
    scalars: tuple[Any, ...]
    grid: tuple[int, ...]
    meta: tuple[tuple[str, int], ...]
    empty: bool
    scalar_inputs: tuple[tuple[int, int, str], ...] = ()
    checks: tuple[IndexCheck, ...] = ()  # per index-check flag: the error it means
    split: int = 1  # programs per row of a split reduction (1: not split)
    rows: int = 0  # rows of a split reduction (its partial buffers hold split * rows states)
    kept: float = 1.0  # block sparsity: the fraction of the loop's tiles that run (``lower.sparsity``)


#: an operand of a host step: an earlier step's number, ("in", the call's input position) or ("const", value)
HostRef = int | tuple[str, Any]


@dataclass(frozen=True)
class IndexCheck:
    """What one index-check flag means, read after the launch that sets it: the error, in which
    ``{index}`` stands for the first index out of ``[0, size)``, and how the host finds that index
    on the error path only (never on the hot path): the index's cone as ``steps``, each
    ``(op, attributes, operands)`` run with the op's torch reference on the call's inputs, and
    ``index``, the step (or input) holding it; no steps and ``index`` None where the cone reads
    something that is no input. Plain data, as a Program is."""

    message: str
    size: int
    steps: tuple[tuple[str, tuple[tuple[str, Any], ...], tuple[HostRef, ...]], ...] = ()
    index: HostRef | None = None


@dataclass(frozen=True)
class DivisorCheck:
    """An integer division (``//``, ``%``) whose divisor torch checks for zeros on CPU (it raises
    ZeroDivisionError; a GPU divides without a check): the divisor's cone as host ``steps`` over the
    call's inputs (as :class:`IndexCheck`'s), run with torch references before a CPU launch."""

    message: str
    steps: tuple[tuple[str, tuple[tuple[str, Any], ...], tuple[HostRef, ...]], ...]
    divisor: HostRef


def divisor_checks(graph: Graph) -> tuple[DivisorCheck, ...]:
    """One check per integer division with elements whose divisor is not a nonzero constant."""
    out = []
    for n in graph.nodes:
        k = REGISTRY[n.op].divisor_operand
        info = graph.of(n)
        if k is None or info.dtype.is_floating_point or info.is_scalar or not math.prod(info.shape):
            continue
        d = n.srcs[k]
        if d.is_const and d.attr("value") != 0:
            continue
        steps, divisor = _host_steps(d, graph)
        if divisor is not None:
            text = f"{n.op}: integer division by zero in {n!r} (torch: 'ZeroDivisionError', on CPU)"
            out.append(DivisorCheck(text, steps, divisor))
    return tuple(out)


# ---- launch configurations: one table per kernel family ---------------------------------------
@dataclass(frozen=True)
class Config:
    block: int
    rows_per_program: int
    looped: bool
    num_warps: int


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _warps(tile: int) -> int:
    return 4 if tile <= 2048 else 8 if tile <= 8192 else 16


def pointwise_config(numel: int, target: Target) -> Config:
    block = min(target.pointwise_block, max(GPU.pointwise_block, _pow2(numel)))
    return Config(block, 1, False, _warps(min(block, GPU.pointwise_block)))


#: full-size tiles (loads varying along the row, outputs of the row's shape; per-row and 0-dim loads
#: are none) a kernel may hold to keep a row up to
#: ``Target.wide_row_block`` whole: at 32K and 32 warps a thread has 64 registers, a tile takes 32
#: (a softmax, 55 registers, and a cross-entropy, 48, compile for sm_90 without a spill)
WIDE_TILES = 2


def row_config(n_rows: int, n_cols: int, target: Target, column: bool = False, tiles: int = WIDE_TILES + 1) -> Config:
    """A row kernel's tile. ``column``: the reduced axis is strided and a kept axis is contiguous
    (a column reduction, a bias gradient), so a program takes ``col_rows`` neighbouring kept
    elements and loops over the reduced axis in blocks: every load runs along the contiguous axis.
    ``tiles``: the kernel's full-size tiles; with at most ``WIDE_TILES`` a row up to
    ``wide_row_block`` is kept whole, in one block of ``wide_warps`` warps, where its rows fill the
    target's waves, and a longer one is looped in blocks that wide (fewer rows are looped in
    ``loop_block`` blocks, which a split may spread across the SMs)."""
    if column:
        warps = _warps(min(target.row_tile, GPU.row_tile))
        if n_cols * target.col_rows <= target.row_tile:  # the reduced extent fits: kept whole, read once
            block = _pow2(max(n_cols, 1))
            return Config(block, target.row_tile // block, False, warps)
        return Config(target.row_tile // target.col_rows, target.col_rows, True, warps)
    wide = n_cols > target.max_row_block and tiles <= WIDE_TILES and n_rows >= target.waves
    if wide and n_cols <= target.wide_row_block:  # fewer rows: loop in blocks, so the row may split across SMs
        return Config(_pow2(n_cols), 1, False, target.wide_warps)
    if wide:  # longer still (a 128K vocabulary): looped in blocks that wide, as Liger-Kernel loops
        return Config(target.wide_row_block, 1, True, target.wide_warps)
    looped = n_cols > target.max_row_block
    block = target.loop_block if looped else _pow2(max(n_cols, 1))
    rows = 1 if looped else max(1, target.row_tile // block)  # never from the row count: one compile serves all
    return Config(block, rows, looped, _warps(min(block * rows, GPU.row_tile)))


def column_programs(target: Target) -> int:
    """The programs of a row kernel with column reductions (a norm's backward with its weight
    gradients): two waves, as many as a launch wants, each looping over its share of the row
    blocks; every one of them stores a partial state per column, so no more (Liger-Kernel's
    RMSNorm backward runs one program per SM)."""
    return target.waves


def merge_config(target: Target) -> Config:
    """A merge of column reductions' partial states (``Split.MERGE``): ``block`` lanes, every
    program a column kernel may have stored (``column_programs``), by ``row_tile // block`` rows,
    whatever the sizes (one compile per target)."""
    lanes = _pow2(column_programs(target))
    rows = max(1, target.row_tile // lanes)
    return Config(lanes, rows, False, _warps(min(rows * lanes, GPU.row_tile)))


def split_count(programs: int, n_rows: int, n_cols: int, block: int, target: Target) -> tuple[int, int]:
    """(programs per row, reduced elements each) for a reduction of ``n_cols`` per row that would
    run on ``programs`` programs of ``rows`` rows each: split when that is under two waves, each
    row spans two loop blocks or more, and the whole reduction is big enough to pay a second launch."""
    big = target.split_min and n_rows * n_cols >= target.split_min
    if not big or n_cols < 2 * block or programs >= target.waves:
        return 1, n_cols
    want = min(-(-target.waves // programs), n_cols // block)
    chunk = -(-n_cols // want)
    chunk = -(-chunk // block) * block  # whole blocks per program
    return -(-n_cols // chunk), chunk


def family(spec: KernelSpec) -> str:
    """A kernel's family: which heuristics shaped its launch and which options autotune may try."""
    if spec.kind in ("pointwise", "gemm"):
        return spec.kind
    if spec.split:
        return "tile" if spec.split is Split.TILE else "split"
    return "looped" if spec.looped else "row"


#: per family, the launch options autotune times on first use (the heuristic's own choice is
#: always a candidate too). Only options that leave the generated source as it is: the warps and
#: pipeline stages, a pointwise kernel's block, a GEMM's tile (their grids follow). The GEMM's
#: are Triton tutorial 03's Hopper-sized tiles for 16-bit operands (BLOCK_K halves for 4-byte
#: ones, as the heuristic's does; tiles narrow to small products).
TUNABLE: Mapping[str, tuple[Mapping[str, int], ...]] = MappingProxyType(
    {
        "pointwise": tuple({"BLOCK_SIZE": bl, "num_warps": w} for bl, w in ((512, 4), (1024, 4), (2048, 8), (4096, 8))),
        "row": tuple({"num_warps": w} for w in (2, 4, 8, 16)),
        "looped": tuple({"num_warps": w, "num_stages": st} for w in (4, 8, 16) for st in (2, 3)),
        "split": tuple({"num_warps": w, "num_stages": st} for w in (4, 8) for st in (2, 3)),
        "tile": tuple({"num_warps": w} for w in (2, 4, 8)),
        "gemm": tuple(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": w, "num_stages": st}
            for bm, bn, bk, w, st in (
                (128, 256, 64, 8, 3),
                (256, 128, 64, 8, 3),
                (128, 128, 64, 4, 4),
                (128, 64, 64, 4, 4),
                (64, 128, 64, 4, 4),
                (128, 128, 32, 8, 4),
                (64, 64, 64, 4, 5),
            )
        ),
    }
)


def candidates(spec: KernelSpec, meta: tuple[tuple[str, int], ...], grid: tuple[int, ...], args: tuple) -> list:
    """(meta, grid) pairs autotune may launch ``spec`` with (``args``: the launch's arguments, whose
    sizes a new block or tile resizes the grid by): the heuristic's first."""
    base = dict(meta)
    out = [(base, grid)]
    # an operand's tile is a recomputed one's, transposed: its columns stay one block of the slice
    columns = {"BLOCK_N": base["BLOCK_N"]} if spec.kind == "gemm" and transposed_operands(spec) else {}
    for opts in TUNABLE[family(spec)]:
        m = {**base, **opts, **columns}
        if spec.kind == "pointwise":
            g = (max(1, -(-args[0] // m["BLOCK_SIZE"])),)
        elif spec.kind == "gemm":
            m, g = _gemm_candidate(spec, m, args[0], args[1], grid)
        else:
            g = grid
        if (m, g) not in out:
            out.append((m, g))
    return out


def _gemm_candidate(spec: KernelSpec, m: dict, rows: int, cols: int, grid: tuple[int, ...]) -> tuple[dict, tuple]:
    """A GEMM tile candidate for an ``rows x cols`` product, narrowed as the heuristic's tile is
    (its rows halved where a prologue recomputes a product of its own, or a wide epilogue holds
    many tiles: ``gemm.gemm_tile``)."""
    dtype = next(nd.cdt for nd in spec.nodes if REGISTRY[nd.op].kind is OpKind.CONTRACTION)
    inner = len(inner_products(spec.nodes)) + wide_epilogue(spec.nodes, spec.loads, spec.outputs)
    block_m = inner_rows(m["BLOCK_M"], dtype, inner, spec.gemm.whole_k if spec.gemm is not None else ())
    bm, bn, bk = gemm_block(block_m, m["BLOCK_N"], m["BLOCK_K"], rows, cols, dtype)
    m = {**m, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
    return m, (max(1, -(-rows // bm) * -(-cols // bn)), *grid[1:])


WHOLE_ROWS = 128  # the most rows beside one product taken whole (tutorial 06's; autotune tries no more)

#: warps beside one product taken whole with 16-bit operands, by its slice (attention's head dim),
#: as tutorial 06 chooses on an H100; other slices keep the target's. Compiled for sm_90 (python -m
#: benches.attention_sass), causal bf16 attention at head dim 64: 4 warps issue 0.459 warp
#: instructions per score in the key loop, 8 warps 0.518 (243 and 155 registers, no spills); at
#: 128, 4 warps spill 96 bytes
WHOLE_K_WARPS = {16: 4, 32: 4, 64: 4}

#: the most full tiles (loads at the product's tile and outputs) a GEMM's epilogue holds beside its
#: accumulator at the target's rows: a gated MLP's backward ``dy @ wd`` reading the gate and the up
#: product and writing ``dg``, ``du`` and ``silu(g) * u`` (2 + 3) spilled 716 bytes at 128 x 128
#: bf16 on sm_90 (255 registers); more rows than this hold them as a second product would
EPILOGUE_TILES = 4


def wide_epilogue(nodes: tuple[NodeSpec, ...], loads: tuple[LoadSpec, ...], outputs: tuple[OutSpec, ...]) -> int:
    """1 where a GEMM epilogue's full tiles (its loads at the product's tile, a broadcast row or
    column not counted, and its outputs there) exceed :data:`EPILOGUE_TILES`: its rows are narrowed
    as for one more product (``inner_rows``), else 0."""
    at_tiles = tile_loads(nodes)
    tiles = [ld for k, ld in enumerate(loads) if ld.role is Role.FULL and k in at_tiles]
    full = sum(BCAST not in (*ld.rows, *ld.cols) for ld in tiles)
    return int(full + sum(o.role is Role.FULL for o in outputs) > EPILOGUE_TILES)


def inner_rows(bm: int, dtype: torch.dtype, inner: int, whole_k: tuple[tuple[int, int], ...]) -> int:
    """A GEMM's rows where its prologues recompute ``inner`` products of their own, each an fp32
    accumulator tile beside the kernel's (``whole_k``: those in one slice, ``GemmTile.whole_k``):
    16-bit operands keep the target's rows (at most ``WHOLE_ROWS``) for one taken whole with its
    fixed operand held (attention's forward at head dims up to 128, as Triton's tutorial 06 takes
    128 rows: 155 and 181 registers on sm_90 at head dims 64 and 128, no spills) and halve them
    otherwise (attention's backward, two products; linear cross-entropy's logits recomputed over
    the hidden dim spilled 176 bytes at 128 rows); 4-byte operands take a quarter (no 16-bit
    tensor-core tiles: at head dim 128 attention's fp32 ``P @ v`` spilled 712 bytes at 64 rows)."""
    if not inner:
        return bm
    if dtype.itemsize >= 4:
        return bm // 4
    return min(bm, WHOLE_ROWS) if inner == 1 and whole_k else bm // 2


#: the most fp32 tile elements a GEMM of 16-bit operands recomputing two products or more keeps at
#: 4 warps (128 registers a thread): its accumulators and the products at its output tile (``BLOCK_M
#: x BLOCK_N`` each), the products its prologues recompute at an operand's (``BLOCK_M x BLOCK_K``).
#: Attention's backward, compiled for sm_90 (``python -m benches.attention_sass``, causal bf16, 64 x
#: 64 tiles), 8 -> 4 warps: dQ 0.924 -> 0.688 warp instructions per score at head dim 64 (194
#: registers), 0.955 -> 0.715 at 128 (224); dK + dV 1.09 -> 0.821 at 64 (250). dK + dV at 128 and
#: q, k and v's three accumulators at 64 x 128 (24,576 elements) spill at 4 warps: they keep 8
FOUR_WARP_ELEMENTS = 128 * 128


def inner_warps(
    warps: int,
    dtype: torch.dtype,
    inner: int,
    whole_k: tuple[tuple[int, int], ...],
    block: tuple[int, int, int] = (0, 0, 0),
    at_output: int = 0,
) -> int:
    """A GEMM's warps: :data:`WHOLE_K_WARPS` beside the one product its prologue recomputes in
    one slice (attention's forward), with 16-bit operands; 4 beside two or more whose tiles fit
    :data:`FOUR_WARP_ELEMENTS` (attention's backward; ``at_output`` of the ``inner`` products are
    at the output tile); the target's otherwise."""
    if dtype.itemsize != 2:
        return warps
    bm, bn, bk = block
    if inner >= 2 and (1 + at_output) * bm * bn + (inner - at_output) * bm * bk <= FOUR_WARP_ELEMENTS:
        return min(warps, 4)
    if inner != 1 or len(whole_k) != 1:
        return warps
    return min(warps, WHOLE_K_WARPS.get(whole_k[0][1], warps))


#: the most a GEMM's prologues may compute per score (``params.prologue_cost``) for the choices
#: that take registers from them: a 4-warp GEMM with two accumulators running its guarded K loop
#: split (``GemmWriter._roomy``), an 8-warp one at the target's rows (:func:`inner_slices`). On
#: sm_90 attention's dK + dV costs 20 (causal), 23 (a sliding window), 39 (softcapped: a tanh and
#: its derivative's exp), which spilled both ways: 4 bytes split at head dim 64, 20 at 128 rows
#: at head dim 128 (at 80 it took 255 registers)
CHEAP_SCORE_COST = 24

#: the most fp32 tile elements an 8-warp GEMM of 16-bit operands recomputing two products or more
#: keeps at the target's rows with its K slice halved, as tutorial 06's dK + dV takes 128 keys x 32
#: queries: its accumulators and products at the output tile (``BLOCK_M x BLOCK_N`` each) and the
#: products at an operand's (``BLOCK_M x BLOCK_K``). Attention's dK + dV at head dim 128, compiled
#: for sm_90 (causal bf16 32 x 4096), 64 x 128 x 64 -> 128 x 128 x 32: warp instructions per score
#: below the diagonal 0.961 -> 0.812, 210 -> 238 registers, no spill (128 x 128 x 64 spilled 172
#: bytes; 128 x 128 x 16: 0.996)
EIGHT_WARP_ELEMENTS = 2 * 128 * 128 + 2 * 128 * 32


def inner_slices(
    block: tuple[int, int, int], bm: int, dtype: torch.dtype, inner: int, at_output: int, warps: int, cost: int
) -> tuple[int, int, int]:
    """An 8-warp GEMM's tile beside ``inner`` >= 2 products its prologues recompute (``at_output``
    of them at the output tile; ``cost`` their math per score): the target's rows ``bm`` with half
    the K slice where the tiles fit :data:`EIGHT_WARP_ELEMENTS` and the math is cheap
    (:data:`CHEAP_SCORE_COST`), as rows halved by :func:`inner_rows` recompute each product over
    twice the programs; ``block`` otherwise."""
    rows, cols, k = block
    if inner < 2 or warps < 8 or dtype.itemsize != 2 or rows >= bm or k < 32 or cost > CHEAP_SCORE_COST:
        return block
    wide = (bm, cols, k // 2)
    fits = (1 + at_output) * bm * cols + (inner - at_output) * bm * wide[2] <= EIGHT_WARP_ELEMENTS
    return wide if fits else block


def gemm_block(bm: int, bn: int, bk: int, rows: int, cols: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """A GEMM tile for 16-bit operands adapted to ``dtype`` (4- and 8-byte elements halve BLOCK_K:
    the same bytes per K slice) and narrowed to a small ``rows x cols`` product (a power of two
    >= 16: ``tl.dot``'s minimum)."""
    if dtype.itemsize >= 4:
        bk //= 2
    return min(bm, _pow2(max(rows, 16))), min(bn, _pow2(max(cols, 16))), bk


# ---- layouts ----------------------------------------------------------------------------------
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


def expand_strides(layout: Layout, target: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of ``layout`` broadcast to ``target`` (0 where broadcast)."""
    pad = len(target) - len(layout.shape)
    out = []
    for d, size in enumerate(target):
        sd = d - pad
        if sd < 0 or (layout.shape[sd] == 1 and size != 1):
            out.append(0)
        else:
            out.append(layout.strides[sd])
    return tuple(out)


def coalesce(sizes: list[int], strides: list[tuple[int, ...]]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours that every operand walks contiguously."""
    keep = [d for d, s in enumerate(sizes) if s != 1]
    if not keep and sizes:  # one element along these dims: keep the last so its classes match longer extents
        keep = [len(sizes) - 1]
    sz = [sizes[d] for d in keep]
    st = [[s[d] for d in keep] for s in strides]
    d = len(sz) - 2
    while d >= 0:
        if all(s[d] == s[d + 1] * sz[d + 1] for s in st):
            sz[d] *= sz[d + 1]
            for s in st:
                s[d] = s[d + 1]
                del s[d + 1]
            del sz[d + 1]
        d -= 1
    if not sz:
        sz, st = [1], [[0] for _ in st]
    return sz, st


def stride_class(stride: int) -> Stride:
    return BCAST if stride == 0 else UNIT if stride == 1 else STRIDED


# ---- the kernel body ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Body:
    nodes: tuple[NodeSpec, ...]
    index: Mapping[Expr, int]  # node -> its position in ``nodes``
    loads: tuple[tuple[int, Role, tuple[int, ...] | None], ...]  # (input index, role, unsqueezed axes)
    slots: tuple[Expr, ...]  # constants and scalar inputs, passed as scalar arguments


def body(group: Group, graph: Graph) -> Body:
    """Node specs with operands as references; each (input, role, view) loaded once; constants and
    scalar inputs as slots; math on scalar inputs computed in the kernel (role "scalar")."""
    index: dict[Expr, int] = {}
    inputs = {n: i for i, n in enumerate(group.inputs)}
    # a row kernel's per-row shape (its reduced dims of size 1); a GEMM's tiles load as they are
    per_row = group.keep_shape() if group.is_row and group.contraction is None else ()
    per_row = per_row if per_row != group.shape else ()  # (nothing reduced: every value is per row)
    slots: list[Expr] = []
    loads: list[tuple[int, Role, tuple[int, ...] | None]] = []
    specs: list[NodeSpec] = []

    def ref(s: Expr, consumer_role: Role, view: tuple[int, ...] | None) -> tuple:
        if s in index:
            return (Src.NODE, index[s])
        info = graph.of(s)
        if info.is_scalar and not (s.is_var or s.is_const):
            srcs = tuple(ref(x, Role.FULL, None) for x in s.srcs)
            return add(s, srcs, Role.SCALAR)
        if info.is_scalar:
            k = next((i for i, o in enumerate(slots) if o is s), None)
            if k is None:
                slots.append(s)
                k = len(slots) - 1
            return (Src.SLOT, k)
        if consumer_role is Role.FULL and per_row and view is None and broadcasts(info.shape, per_row):
            consumer_role = Role.KEEP  # one value per row (a saved statistic): loaded once per row, not per element
        key = (inputs[s], consumer_role, view)
        if key not in loads:
            loads.append(key)
        return (Src.LOAD, loads.index(key))

    def add(n: Expr, srcs: tuple, role: str) -> tuple:
        op = REGISTRY[n.op]
        # positions (a movement op reading nothing) are indices at the tile: which dims have size 1
        ones = tuple(d == 1 for d in graph.of(n).shape) if op.kind is OpKind.MOVEMENT and not op.view else ()
        specs.append(NodeSpec(n.op, n.attrs, srcs, graph.of(n).dtype, _compute_dtype(n, graph), role, ones))
        index[n] = len(specs) - 1
        return (Src.NODE, index[n])

    for n in group.nodes:
        role = group.role(n)
        kind = REGISTRY[n.op].kind
        # a reduction reads its input over the whole domain; one in a GEMM's K loop (role a / b)
        # reads it at the operand's tile, as the rest of that prologue does
        load_role = Role.FULL if kind is OpKind.REDUCTION and role not in (Role.A, Role.B) else role
        op = REGISTRY[n.op]
        view = tuple(sorted(n.attr("axes"))) if op.view else None
        # positions take only a shape from their operand: nothing is read (or loaded) for it
        srcs = tuple((Src.SHAPE, 0) if k in op.shape_only else ref(s, load_role, view) for k, s in enumerate(n.srcs))
        add(n, srcs, role)
    return Body(tuple(specs), MappingProxyType(index), tuple(loads), tuple(slots))


def printed_names(group: Group, graph: Graph, notes: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """What the printed kernel calls its inputs and outputs (the user's names), and its nodes'
    notes (``notes_of``): ``KernelSpec`` fields."""
    names, out_names = io_names(group, graph)
    return {"names": names, "out_names": out_names, "notes": notes}


def notes_of(index: Mapping[Expr, int], nodes: Iterable[Expr], graph: Graph, n: int) -> tuple[str, ...]:
    """Per node spec (``index``: node -> its position): the composite op it came from, "" for
    the user's own ops (``Graph.origin``); the printed kernel marks where each composite's lines start."""
    notes = [""] * n
    for e in nodes:
        if (i := index.get(e)) is not None:
            notes[i] = graph.origin.get(e, "")
    return tuple(notes)


def _compute_dtype(n: Expr, graph: Graph) -> torch.dtype:
    """The dtype ``n``'s operands are computed in (a product's: the dtype they multiply in, which
    its result has unless it keeps its accumulator's, ``contract(..., dtype=)``)."""
    if REGISTRY[n.op].kind is OpKind.CONTRACTION:
        return graph.of(n.srcs[0]).dtype
    rule = REGISTRY[n.op].rule
    if rule is DtypeRule.CAST:
        return compute_dtype(graph.of(n.srcs[0]).dtype)
    if rule is DtypeRule.COMPARE:
        a, b = (graph.of(s).like() for s in n.srcs)
        if not isinstance(a, torch.Tensor):
            a = torch.tensor(a)
        return compute_dtype(torch.result_type(a, b))
    return compute_dtype(graph.of(n).dtype)


# ---- operands over the domain ----------------------------------------------------------------------
def viewed(lay: Layout, view: tuple[int, ...] | None) -> Layout:
    """A load's layout through the view it is read by: an unsqueezed operand is the same memory
    with size-1 dims inserted at ``view``'s axes."""
    if view is None:
        return lay
    shape, strides = list(lay.shape), list(lay.strides)
    for ax in view:
        shape.insert(ax, 1)
        strides.insert(ax, 0)
    return Layout(tuple(shape), tuple(strides), lay.dtype)


def operand_strides(group: Group, graph: Graph, layouts: Mapping[Expr, Layout], b: Body) -> list[tuple[int, ...]]:
    """Strides of every load and then every output over the group's domain (0 on reduced dims
    for per-row operands, 0 where broadcast)."""
    domain = group.shape

    def over_domain(strides: tuple[int, ...], role: Role) -> tuple[int, ...]:
        if role is Role.DROP:  # strides over drop_shape -> strides over domain (0 on reduced dims)
            it = iter(strides)
            return tuple(0 if d in group.axes else next(it) for d in range(len(domain)))
        if role is Role.KEEP:  # over keep_shape: its reduced dims (size 1) are not walked
            return tuple(0 if d in group.axes else s for d, s in enumerate(strides))
        return strides

    target = {Role.FULL: domain, Role.KEEP: group.keep_shape(), Role.DROP: group.drop_shape()}
    out: list[tuple[int, ...]] = []
    for j, role, view in b.loads:
        lay = viewed(layouts[group.inputs[j]], view)
        out.append(over_domain(expand_strides(lay, target[role]), role))
    for o in group.outputs:
        role = group.role(o)
        if role is Role.KEEP:
            out.append(over_domain(contiguous_strides(group.drop_shape()), Role.DROP))
        else:
            out.append(over_domain(contiguous_strides(graph.of(o).shape), role))
    return out


def _int64_needed(numel: int, sizes: list[list[int]], strides: list[list[list[int]]]) -> bool:
    """Offsets reach 2**31 somewhere: the element count or the farthest element of an operand."""
    reach = numel
    for per_operand in zip(*strides):
        far = sum(abs(st) * (sz - 1) for dims, szs in zip(per_operand, sizes) for st, sz in zip(dims, szs))
        reach = max(reach, far)
    return reach >= INT32_LIMIT


def scalar_kind(v: Any, kernel_float: torch.dtype) -> str:
    if isinstance(v, bool):
        return "b"
    if isinstance(v, int):
        return "i"
    return "f64" if kernel_float is torch.float64 else "f32"


def encode_scalar(v: Any, kind: str) -> Any:
    """A python number as the kernel argument of its kind: bools as ints, fp64 as its bits (exact)."""
    if kind == "b":
        return int(v)
    if kind == "i":
        return int(v)
    if kind == "f64":
        return struct.unpack("<q", struct.pack("<d", float(v)))[0]
    return float(v)


def scalar_args(slots: tuple[Expr, ...], graph: Graph, kernel_float: torch.dtype) -> tuple[list[str], list[Any]]:
    """Constant values (and scalar inputs' placeholders) as kernel arguments."""
    kinds = [scalar_kind(graph.of(s).value, kernel_float) for s in slots]
    return kinds, [encode_scalar(graph.of(s).value, k) for s, k in zip(slots, kinds)]


# ---- the whole spec ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Walk:
    """How a kernel walks its group, before any launch choice: its body, every operand's stride
    classes, the sizes of the dims it indexes (a flat kernel's coalesced ones, a coordinate
    kernel's every domain dim) and the integer arguments the layouts give, by parameter name
    (strides of strided dims, movement ops' offsets and sizes)."""

    nodes: tuple[NodeSpec, ...]
    slots: tuple[Expr, ...]  # constants and scalar inputs, passed as scalar arguments
    loads: tuple[LoadSpec, ...]
    outputs: tuple[OutSpec, ...]
    rows: tuple[int, ...]  # the kept dims' sizes (a pointwise kernel's every dim)
    cols: tuple[int, ...]  # the reduced dims' sizes
    ints: Mapping[str, int]
    big: bool  # offsets reach 2**31: int64 indexing
    row: bool  # a row kernel (rows by reduced columns; a 2-D tile's too)
    column: bool = False  # its biggest operand runs along a kept axis (see ``row_config``)
    tiled: bool = False  # a pointwise group in 2-D tiles (``_tile_axis``)
    domain: tuple[bool, ...] | None = None  # a coordinate kernel's: per domain dim, is it reduced?
    flags: tuple[int, ...] = ()  # nodes that report an out-of-range index
    checks: tuple[IndexCheck, ...] = ()  # per flag: what an out-of-range index there means
    index: Mapping[Expr, int] = field(default_factory=dict)  # a coordinate kernel's: node -> its spec
    notes: tuple[str, ...] = ()  # per node: the composite op it came from ("" for the user's own)


def kernel_spec(
    group: Group,
    graph: Graph,
    layouts: Mapping[Expr, Layout],
    target: Target = GPU,
    tf32: bool = False,
    merge_of: int = 0,
) -> tuple[KernelSpec, Launch]:
    """Spec and launch arguments for ``group`` on ``target``; ``layouts`` maps input node -> its
    layout; ``tf32``: a product computed in the kernel multiplies fp32 operands in TF32;
    ``merge_of``: the group's reductions were computed by that many programs of a row kernel, as
    its column reductions: the kernel merges their partial states (``Split.MERGE``).

    A group without movement ops is walked flat (:func:`flat_walk`: dims every operand walks
    together coalesced), one with them by coordinates (:func:`coordinate_walk`); the rest (the
    tile, how rows are cut across programs, the launch) is the same for both. A row kernel with
    column reductions (role "column") runs on at most ``COLUMN_PROGRAMS`` programs, each looping
    over blocks of rows."""
    remaps = group.remaps or _read_two_ways(group, graph)
    if remaps and _tiles_coordinates(group, graph, target):  # a 2-D tile: a row kernel's code
        w = replace(coordinate_walk(_as_rows(group, graph), graph, layouts), tiled=True)
    else:
        w = coordinate_walk(group, graph, layouts) if remaps else flat_walk(group, graph, layouts, target)
    n_rows, n_cols = math.prod(w.rows), math.prod(w.cols)
    cfg, tile = _config(group, graph, w, target, tf32)
    kinds, vals = scalar_args(w.slots, graph, float_dtype_of([*group.nodes, *group.inputs], graph.info))
    spec = KernelSpec(
        kind="row" if w.row else "pointwise",
        in_dtypes=tuple(layouts[n].dtype for n in group.inputs),
        loads=w.loads,
        nodes=w.nodes,
        outputs=w.outputs,
        scalars=tuple(kinds),
        reductions=_reductions(w.nodes),
        block=cfg.block,
        rows_per_program=cfg.rows_per_program,
        looped=cfg.looped,
        big=w.big,
        num_warps=cfg.num_warps,
        domain=w.domain,
        flags=w.flags,
        gemm=tile,
        columns=tuple(i for i, n in enumerate(w.nodes) if n.role is Role.COLUMN),
        scalar_names=scalar_names(w.slots),
        **printed_names(group, graph, w.notes),
    )
    if merge_of:
        spec, cfg = replace(spec, split=Split.MERGE, looped=False), merge_config(target)
        programs, n_split, chunk = -(-n_rows // cfg.rows_per_program), merge_of, 0
        spec = replace(spec, block=cfg.block, rows_per_program=cfg.rows_per_program, num_warps=cfg.num_warps)
    else:
        spec, programs, n_split, chunk = _programs(spec, w, target)
        if w.row and not spec.split and n_split == 1 and tile is None and n_cols and n_cols % spec.block == 0:
            spec = replace(spec, even=True)  # the row fills its blocks: no column mask
    if spec.columns:  # a program per block of rows, up to the table's count: each loops over its rows
        programs = min(programs, column_programs(target))
    grid, meta = grid_and_meta(cfg if w.row else None, programs * n_split, n_rows * n_cols, target)
    if tile is not None:
        meta += (("BLOCK_K", tile.block_k), ("num_stages", tile.num_stages))
    if merge_of:
        grid, meta = (max(1, programs),), (*meta, ("SPLIT_BLOCK", cfg.block))
    launched = _launched(spec, n_split)
    values = w.ints | _extents(w.row, n_rows, n_cols, w.rows, w.cols, n_split, chunk, launched.split)
    ints = launch_ints(launched, values)
    # nothing to launch only when nothing is written: reducing an empty extent still writes
    # torch's identity values (0 for sum, nan for mean and var, -inf for logsumexp)
    empty = all(graph.of(o).numel == 0 for o in group.outputs)
    split = 1 if spec.split is Split.TILE else n_split
    scalar_inputs = scalar_positions(w.slots, kinds, graph, len(ints))
    kept = 1.0
    if spec.gemm is not None and spec.gemm.guard is not None:  # block sparsity: the tiles that run
        kept = kept_fraction(spec, {"rows": (w.rows[-1], cfg.rows_per_program), "cols": (n_cols, cfg.block)}, vals)
    return spec, Launch(ints, tuple(vals), grid, meta, empty, scalar_inputs, w.checks, split, n_rows, kept)


def _config(group: Group, graph: Graph, w: Walk, target: Target, tf32: bool) -> tuple[Config, GemmTile | None]:
    """The kernel's tile: a 2-D tile's, a product's (rows by a block of its columns, looped), a
    row kernel's from the row table, or a pointwise kernel's (its block is a launch parameter)."""
    n_rows, n_cols = math.prod(w.rows), math.prod(w.cols)
    c = group.contraction
    if w.tiled and target.tile is not None:
        return Config(target.tile[1], target.tile[0], True, 4), None
    if c is not None:
        dtype = graph.of(c.srcs[0]).dtype
        bm, bn, bk, _, warps, stages = target.gemm
        # half the GEMM's columns: the reductions' states and per-tile temporaries live beside
        # the accumulator (at sm_90's 128 x 128 a cross-entropy's forward spilled)
        # a right operand with batch dims (attention's keys) is read at the rows' batch: each
        # program's rows keep to one batch, blocks of its last row dim
        batch = len(w.rows) - 1 if len(graph.of(c.srcs[1]).shape) > 2 else 0
        m = w.rows[-1] if batch else n_rows
        bm, bn, bk = gemm_block(bm, max(16, bn // 2), bk, m, n_cols, dtype)
        precision = "tf32" if tf32 and dtype == torch.float32 else "ieee"
        guard = _row_guard(group, graph, w) if batch else None
        tile = GemmTile(bm, bn, bk, 1, warps, stages, batch=batch, precision=precision, guard=guard)
        return Config(bn, bm, True, warps), tile
    if w.row:
        # a load varying along the reduced dims is a tile; per-row ones (targets) and 0-dim ones (a
        # scalar loss's cotangent) are not
        reduced = len(w.cols)
        full = [ld for ld in w.loads if len(ld.rows) > len(w.rows) and set(ld.rows[-reduced:]) != {BCAST}]
        # column reductions hold their lanes across the row loop: a tile each
        tiles = len(full) + sum(o.role is Role.FULL for o in w.outputs) + sum(n.role is Role.COLUMN for n in w.nodes)
        return row_config(n_rows, n_cols, target, w.column, tiles), None
    return Config(0, 1, False, 0), None


def _row_guard(group: Group, graph: Graph, w: Walk) -> tuple[Src, int] | None:
    """Block sparsity in a row kernel computing a product in tiles (its rows in one batch): the
    guard (its node) under which every reduction reads its neutral value (``lower.sparsity``),
    when the kernel writes per-row values only; or None."""
    if any(group.role(o) is Role.FULL for o in group.outputs):
        return None
    reductions = [n for n in group.nodes if REGISTRY[n.op].kind is OpKind.REDUCTION]
    if any(n.op not in NEUTRAL for n in reductions):
        return None
    guard = vanishing_guard(group.nodes, graph, [(n.srcs[0], NEUTRAL[n.op]) for n in reductions])
    return None if guard is None or guard not in w.index else (Src.NODE, w.index[guard])


def _programs(spec: KernelSpec, w: Walk, target: Target) -> tuple[KernelSpec, int, int, int]:
    """How rows are cut across programs: (spec, programs per split, splits per row, reduced
    elements each). A 2-D tile's programs take one block of columns each; a product's row is
    reduced by one program (its tiles are not split); other rows may split (``split_count``)."""
    n_rows, n_cols = math.prod(w.rows), math.prod(w.cols)
    if not w.row:
        return spec, 0, 1, n_cols
    programs = -(-n_rows // spec.rows_per_program)
    if spec.gemm is not None and spec.gemm.batch:  # each batch's rows in whole blocks of their own
        m = w.rows[-1]
        programs = (n_rows // m) * -(-m // spec.rows_per_program) if m else 0
    if w.tiled:
        return replace(spec, split=Split.TILE, looped=True), programs, max(1, -(-n_cols // spec.block)), spec.block
    if spec.gemm is not None or not splittable(spec):
        return spec, programs, 1, n_cols
    n_split, chunk = split_count(programs, n_rows, n_cols, spec.block, target)
    return (replace(spec, looped=True) if n_split > 1 else spec), programs, n_split, chunk


def _launched(spec: KernelSpec, n_split: int) -> KernelSpec:
    """The spec whose parameters a launch's arguments are for: a split row's are its two kernels'
    (``split_specs``), which take the splits."""
    return replace(spec, split=Split.PARTIAL) if n_split > 1 and not spec.split else spec


def _extents(
    row: bool,
    n_rows: int,
    n_cols: int,
    rows: tuple[int, ...],
    cols: tuple[int, ...],
    n_split: int,
    chunk: int,
    split: Split,
) -> dict[str, int]:
    """A kernel's extents by parameter name: rows by columns (each side's dims when several) and a
    split row's splits; a pointwise kernel's element count (and its dims when several)."""
    if not row:
        return {"n_elements": n_rows} | ({f"size{d}": s for d, s in enumerate(rows)} if len(rows) > 1 else {})
    values = {"n_rows": n_rows, "n_cols": n_cols}
    values |= {f"rsize{d}": s for d, s in enumerate(rows)} if len(rows) > 1 else {}
    values |= {f"csize{d}": s for d, s in enumerate(cols)} if len(cols) > 1 else {}
    if split is Split.MERGE:
        return values | {"n_split": n_split}
    return values | ({"n_split": n_split, "chunk": chunk} if split else {})


# ---- flat kernels: dims coalesced, every operand read at the kernel's own index --------------------
def flat_walk(group: Group, graph: Graph, layouts: Mapping[Expr, Layout], target: Target) -> Walk:
    """A group without movement ops: each (input, role, view) loaded once at the kernel's index,
    the dims every operand walks together coalesced (a pointwise group whose operands disagree on
    the fastest axis runs in 2-D tiles: ``_tile_axis``).

    The spec is a coordinate kernel's over the coalesced dims (rows, then reduced columns): the
    one writer renders both. Every value, load and output has the domain's rank (a per-row one
    size 1 along the columns), so a view (``unsqueeze``) reads its operand where it is."""
    b = body(group, graph)
    strides = operand_strides(group, graph, layouts, b)
    tile = None if group.is_row or target.tile is None else _tile_axis(group, b, strides)
    if tile is not None:  # a 2-D tile: the row kernel's code with a kept axis of rows, no reductions
        group = replace(group, axes=(tile,))
    row_sizes, row_strides, col_sizes, col_strides = _coalesced(group, strides)
    big = _int64_needed(math.prod(row_sizes) * math.prod(col_sizes), [row_sizes, col_sizes], [row_strides, col_strides])
    n_loads = len(b.loads)
    classes = [
        (tuple(stride_class(s) for s in r), tuple(stride_class(s) for s in c)) for r, c in zip(row_strides, col_strides)
    ]
    loads = tuple(LoadSpec(j, role, (*rows, *cols), ()) for (j, role, _), (rows, cols) in zip(b.loads, classes))
    outputs = tuple(
        # pointwise outputs are contiguous over the domain: written at offs
        OutSpec(b.index[o], layouts[o].dtype, group.role(o), (*rows, *cols) if group.is_row else (), ())
        for o, (rows, cols) in zip(group.outputs, classes[n_loads:])
    )
    names = [*load_names(loads), *(output_name(k) for k in range(len(outputs)))][
        : n_loads + (len(outputs) if group.is_row else 0)
    ]
    ints: dict[str, int] = {}
    for name, (rc, cc), r, c in zip(names, classes, row_strides, col_strides):
        ints |= zip(strided(name, (*rc, *cc)), _strided_values(r, c))
    column = tile is None and group.is_row and _is_column(group, layouts, b, classes)
    domain = (False,) * len(row_sizes) + (True,) * len(col_sizes)
    return Walk(
        _over(b.nodes, domain),
        b.slots,
        loads,
        outputs,
        tuple(row_sizes),
        tuple(col_sizes),
        ints,
        big,
        group.is_row,
        column,
        tile is not None,
        domain=domain,
        notes=notes_of(b.index, group.nodes, graph, len(b.nodes)),
    )


def _over(nodes: tuple[NodeSpec, ...], domain: tuple[bool, ...]) -> tuple[NodeSpec, ...]:
    """Flat nodes over the coalesced ``domain``, at its rank: which of its dims each has size 1
    (a per-row value's reduced ones, kept or dropped alike)."""
    ones = {Role.FULL: (False,) * len(domain), Role.KEEP: domain, Role.DROP: domain}
    return tuple(replace(n, ones=ones.get(n.role, ())) for n in nodes)


def _strided_values(*sides: list[int]) -> list[int]:
    """The strides of strided dims (not unit, not broadcast), side by side."""
    return [s for side in sides for s in side if stride_class(s) == STRIDED]


def _coalesced(
    group: Group, strides: list[tuple[int, ...]]
) -> tuple[list[int], list[list[int]], list[int], list[list[int]]]:
    """The group's domain as rows by columns (its reduced axes), each side's dims coalesced where
    every operand's strides allow: (row sizes, row strides per operand, column sizes, column strides)."""
    domain = group.shape
    row_dims = [d for d in range(len(domain)) if d not in group.axes]
    col_dims = list(group.axes)
    row_sizes, row_strides = coalesce([domain[d] for d in row_dims], [tuple(s[d] for d in row_dims) for s in strides])
    if not group.is_row:
        return row_sizes, row_strides, [], [[] for _ in strides]
    col_sizes, col_strides = coalesce([domain[d] for d in col_dims], [tuple(s[d] for d in col_dims) for s in strides])
    return row_sizes, row_strides, col_sizes, col_strides


def _tile_axis(group: Group, b: Body, strides: list[tuple[int, ...]]) -> int | None:
    """For a pointwise group whose operands disagree on the fastest axis (``x.t() + y``): the axis
    along which a load is contiguous while the output is not (tiles then load both ways)."""
    domain = group.shape
    if len(domain) < 2 or domain[-1] < 2 or math.prod(domain) < 2:
        return None
    for st in strides[: len(b.loads)]:
        if st[-1] not in (0, 1):
            unit = [d for d in range(len(domain) - 1) if st[d] == 1 and domain[d] > 1]
            if unit:
                return unit[-1]
    return None


def _is_column(group: Group, layouts: Mapping[Expr, Layout], b: Body, classes: list) -> bool:
    """Does the group's biggest full-size operand run contiguously along a kept axis and with
    stride along the reduced ones (a column reduction: tile it with kept elements side by side)?"""
    full = [(layouts[group.inputs[j]].nbytes, k) for k, (j, role, _) in enumerate(b.loads) if role is Role.FULL]
    if not full:
        return False
    rows, cols = classes[max(full)[1]]
    return bool(rows) and rows[-1] == UNIT and UNIT not in cols


def splittable(spec: KernelSpec) -> bool:
    """Can a split row merge its reductions across programs? One level of them (none depends on
    another's result), every output full-size or per row, and no column reduction (whose lanes
    span whole rows)."""
    lv = levels(spec)
    whole = bool(lv) and max(lv.values()) == 1 and all(o.role is not Role.KEEP for o in spec.outputs)
    return whole and not spec.columns


def split_specs(spec: KernelSpec, launch: Launch) -> tuple[tuple[KernelSpec, Launch], tuple[KernelSpec, Launch]]:
    """The two kernels of a split row: partial states, then merge + outputs (``SPLIT_BLOCK`` lanes of
    partial states per row, a launch parameter like the pointwise block)."""
    partial = replace(spec, split=Split.PARTIAL)
    finish = replace(spec, split=Split.FINISH)
    meta = (*launch.meta, ("SPLIT_BLOCK", _pow2(launch.split)))
    return (partial, launch), (finish, replace(launch, meta=meta))


# ---- coordinate kernels: movement ops inside ----------------------------------------------------
def _read_two_ways(group: Group, graph: Graph) -> bool:
    """Is a full-size value the group computes read both as it is and through a view that moves its
    dims off the domain's trailing ones (``e[..., None, :] + e``: ``e[i, k] + e[j, k]``)? A flat
    kernel holds one value per element for it, at its own alignment, so such a group is evaluated
    by coordinates (it added ``e[j, k]`` to itself; expression fuzzer seed 20307130)."""
    members = set(group.nodes)
    direct = {s for n in group.nodes if not REGISTRY[n.op].view for s in n.srcs} | set(group.outputs)
    for n in group.nodes:
        s = n.srcs[0] if REGISTRY[n.op].view and n.srcs else None
        if s is None or s not in members or s not in direct or group.role(s) is not Role.FULL:
            continue
        have, view = graph.of(s).shape, graph.of(n).shape
        if view[len(view) - len(have) :] != have:  # its dims no longer the trailing ones
            return True
    return False


def _tiles_coordinates(group: Group, graph: Graph, target: Target) -> bool:
    """Does a pointwise coordinate kernel run in 2-D tiles along its last axis? Where that axis
    fills a tile's width, other dims hold more than one row and every output has the group's
    shape: flat blocks would recover every dim of every element by integer division
    (``offs % size``, ``offs // size``) and gather each per-row operand per element, where a
    tile's columns are the last axis itself, its rows are decomposed once per row and per-row
    values are computed once per row (``_as_rows``)."""
    shape = group.shape
    if group.is_row or group.contraction is not None or target.tile is None or len(shape) < 2:
        return False
    if any(graph.of(o).shape != shape for o in group.outputs):
        return False
    # movement ops that re-index an axis (a cat, a slice: RoPE's halves) read across tile edges
    # wherever their offsets do not fall on them; views, broadcasts and positions read none
    ok = (AxisRule.VIEW, AxisRule.POSITIONS, AxisRule.SIZES)
    moves = [REGISTRY[n.op] for n in (*group.nodes, *group.cone) if REGISTRY[n.op].kind is OpKind.MOVEMENT]
    if any(op.axes not in ok for op in moves):
        return False
    return shape[-1] >= target.tile[1] and math.prod(shape[:-1]) > 1


def _as_rows(group: Group, graph: Graph) -> Group:
    """A pointwise group as a row group over its last axis with nothing to reduce (a 2-D tile's
    columns run along it): a value of size 1 along that axis (or of no dims) is one value per row
    (KEEP), computed once per tile row; the rest is full-size."""

    def per_row(n: Expr) -> bool:
        s = graph.of(n).shape
        return not s or s[-1] == 1  # shapes broadcast from the right

    roles = {n: Role.KEEP if group.role(n) is Role.FULL and per_row(n) else group.role(n) for n in group.nodes}
    return replace(group, axes=(len(group.shape) - 1,), roles=MappingProxyType({**group.roles, **roles}))


def coordinate_walk(group: Group, graph: Graph, layouts: Mapping[Expr, Layout]) -> Walk:
    """A group whose values are read at re-indexed coordinates (slices, ``cat``, ``gather``).

    Nothing is coalesced: every domain dim has its own index, every input its own strides over
    its own dims, and each movement op maps coordinates to its operands' coordinates with its
    launch arguments (offsets, sizes). Free nodes (cones of movement ops) are in the body with
    role "free": evaluated only where a movement op asks for them.

    A row kernel that computes a contraction's product (``Group.product_rows``) reads its operands
    at the tile's rows and a ``BLOCK_K`` slice of the contracted axis: its tile is the GEMM's
    (``ROWS`` = ``BLOCK_M`` rows by ``BLOCK_SIZE`` = ``BLOCK_N`` columns, looped over the row).
    """
    index, slots, specs, nargs = _coordinate_body(group, graph)
    loads, outs, values, reach = _coordinate_operands(group, graph, layouts, index)
    domain = group.shape
    rows = tuple(s for d, s in enumerate(domain) if d not in group.axes)
    cols = tuple(s for d, s in enumerate(domain) if d in group.axes)
    flags = tuple(i for i, n in enumerate(specs) if REGISTRY[n.op].index_operand is not None)
    by_index = {i: n for n in (*group.cone, *group.nodes) if (i := index.get(n)) is not None}
    return Walk(
        tuple(specs),
        tuple(slots),
        tuple(loads),
        tuple(outs),
        rows,
        cols,
        values | nargs,
        reach >= INT32_LIMIT,
        group.is_row,
        domain=tuple(d in group.axes for d in range(len(domain))),
        flags=flags,
        checks=tuple(_check_message(by_index[i], graph) for i in flags),
        index=index,
        notes=notes_of(index, by_index.values(), graph, len(specs)),
    )


def _coordinate_body(group: Group, graph: Graph) -> tuple[dict[Expr, int], list[Expr], list[NodeSpec], dict[str, int]]:
    """A coordinate kernel's node specs (its cone's free nodes too), in graph order: node ->
    spec index, the scalar slots, the specs, and the movement ops' launch arguments by name."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    members = set(group.nodes)
    inputs = {n: i for i, n in enumerate(group.inputs)}
    index: dict[Expr, int] = {}
    slots: list[Expr] = []
    specs: list[NodeSpec] = []
    nargs: dict[str, int] = {}

    def ref(s: Expr) -> tuple:
        if s in index:
            return (Src.NODE, index[s])
        if graph.of(s).is_scalar and not (s.is_var or s.is_const):
            return add(s, Role.SCALAR)
        if graph.of(s).is_scalar:
            if not any(o is s for o in slots):
                slots.append(s)
            return (Src.SLOT, next(i for i, o in enumerate(slots) if o is s))
        return (Src.LOAD, inputs[s])

    def add(n: Expr, role: str) -> tuple:
        op = REGISTRY[n.op]
        srcs = tuple((Src.SHAPE, 0) if k in op.shape_only else ref(s) for k, s in enumerate(n.srcs))
        args: tuple[int, ...] = ()
        if op.launch_args is not None:
            args = op.launch_args([graph.of(x).shape for x in n.srcs], graph.of(n).shape, **n.attr_dict)
        attrs = tuple((k, v) for k, v in n.attrs if k not in op.launch_attrs)
        ones = tuple(d == 1 for d in graph.of(n).shape)
        specs.append(NodeSpec(n.op, attrs, srcs, graph.of(n).dtype, _compute_dtype(n, graph), role, ones, len(args)))
        nargs.update((f"m{len(specs) - 1}_{k}", a) for k, a in enumerate(args))
        index[n] = len(specs) - 1
        return (Src.NODE, index[n])

    for n in sorted((*group.cone, *group.nodes), key=lambda m: order[m]):
        # a cone node another kernel writes is read, not recomputed where the kernel also reads it
        if n not in index and (n in members or n not in inputs):
            add(n, group.role(n) if n in members else Role.FREE)
    return index, slots, specs, nargs


def _coordinate_operands(
    group: Group, graph: Graph, layouts: Mapping[Expr, Layout], index: dict[Expr, int]
) -> tuple[list[LoadSpec], list[OutSpec], dict[str, int], int]:
    """A coordinate kernel's loads and outputs, each with its own strides over its own dims (a
    size-1 dim broadcast), their strided strides as launch arguments by name, and the farthest
    element any of them reaches (64-bit offsets past int32)."""
    domain = group.shape
    reduced = tuple(d in group.axes for d in range(len(domain)))
    loads = []
    values: dict[str, int] = {}
    reach = math.prod(domain)
    for j, n in enumerate(group.inputs):
        lay = layouts[n]
        classes = tuple(BCAST if size == 1 else stride_class(st) for size, st in zip(lay.shape, lay.strides))
        loads.append(LoadSpec(j, Role.FULL, classes, ()))
        name = input_name(j)
        values |= {stride_name(name, d): st for d, (c, st) in enumerate(zip(classes, lay.strides)) if c == STRIDED}
        reach = max(reach, sum(abs(st) * (size - 1) for size, st in zip(lay.shape, lay.strides)))
    outs = []
    for o in group.outputs:
        role = group.role(o)
        strides = iter(contiguous_strides(graph.of(o).shape if role is Role.FULL else group.drop_shape()))
        over = [0 if reduced[d] and role is not Role.FULL else next(strides) for d in range(len(domain))]
        over = [0 if size == 1 else st for size, st in zip(domain, over)]
        classes = tuple(stride_class(st) for st in over) if group.is_row else ()
        k = len(outs)
        outs.append(OutSpec(index[o], layouts[o].dtype, role, classes, ()))
        values |= {stride_name(output_name(k), d): st for d, (c, st) in enumerate(zip(classes, over)) if c == STRIDED}
    return loads, outs, values, reach


def grid_and_meta(
    rows: Config | None, programs: int, numel: int, target: Target
) -> tuple[tuple[int, ...], tuple[tuple[str, int], ...]]:
    """A row kernel's grid (``programs``, at least one) and meta-parameters from its ``rows``
    config; a pointwise kernel's (``rows`` None) from the block ``numel`` elements get on ``target``."""
    if rows is not None:
        meta = (("BLOCK_SIZE", rows.block), ("ROWS", rows.rows_per_program), ("num_warps", rows.num_warps))
        return (max(1, programs),), meta
    cfg = pointwise_config(numel, target)
    return (max(1, -(-numel // cfg.block)),), (("BLOCK_SIZE", cfg.block), ("num_warps", cfg.num_warps))


def scalar_positions(
    slots: tuple[Expr, ...], kinds: list[str] | tuple[str, ...], graph: Graph, first: int
) -> tuple[tuple[int, int, str], ...]:
    """Where a launch's scalar inputs go: (argument position from ``first`` on, the input's
    position in the call, its kind), for the slots that are inputs (not constants)."""
    position = {v: i for i, v in enumerate(graph.inputs)}
    return tuple((first + k, position[s], kind) for k, (s, kind) in enumerate(zip(slots, kinds)) if s.is_var)


def _reductions(nodes: list[NodeSpec] | tuple[NodeSpec, ...]) -> tuple[int, ...]:
    """The row's reductions (a column reduction's lanes run over the rows instead)."""
    return tuple(
        i for i, n in enumerate(nodes) if REGISTRY[n.op].kind is OpKind.REDUCTION and n.role is not Role.COLUMN
    )


def _check_message(n: Expr, graph: Graph) -> IndexCheck:
    op = REGISTRY[n.op]
    assert op.index_operand is not None
    data, idx = n.srcs[0], n.srcs[op.index_operand]
    shape = graph.of(data).shape
    size = shape[n.attr("axis")] if shape else 1
    steps, index = _host_steps(idx, graph)
    if positions_only(data):  # a range check (cross-entropy's target): the positions are no one's tensor
        owner = REGISTRY.get(graph.origin.get(n, n.op))  # the composite that built it words it
        if owner is not None and owner.range_error is not None:
            text = owner.range_error(", ".join(sorted({repr(v) for v in walk([idx]) if v.is_var})), size)
        else:
            text = f"{n.op}: an index in {idx!r} is out of range [0, {size}): the first is {{index}}"
    else:
        text = (
            f"{n.op}: an index in {idx!r} is out of range for axis {n.attr('axis')} of {data!r} (size {size}): "
            f"the first is {{index}} (torch: 'index {{index}} is out of bounds for dimension {n.attr('axis')} "
            f"with size {size}')"
        )
    return IndexCheck(text, size, steps, index)


def _host_steps(idx: Expr, graph: Graph) -> tuple[tuple[Any, ...], HostRef | None]:
    """``idx``'s cone as steps the host runs with torch references (see :class:`IndexCheck`)."""
    position = {v: i for i, v in enumerate(graph.inputs)}
    refs: dict[Expr, HostRef] = {}
    steps: list[tuple[str, tuple[tuple[str, Any], ...], tuple[HostRef, ...]]] = []
    for m in walk([idx]):
        if m.is_var:
            if m not in position:
                return (), None
            refs[m] = ("in", position[m])
        elif m.is_const:
            refs[m] = ("const", m.attr("value"))
        else:
            refs[m] = len(steps)
            steps.append((m.op, tuple(m.attr_dict.items()), tuple(refs[s] for s in m.srcs)))
    return tuple(steps), refs[idx]
