"""The spec and launch of a contraction group: a tiled GEMM whose epilogue is the group's other nodes.

Programs tile the product ``[M, N]`` in ``BLOCK_M x BLOCK_N`` blocks, in grouped order (``GROUP_M``
row blocks side by side share their B columns in L2), one grid column per batch; each runs the K
loop over ``BLOCK_K`` slices with ``tl.dot`` into an fp32 accumulator, then the epilogue at the
tile's coordinates. Operands are read through their strides (a transpose is two strides swapped),
batch dims broadcast by a zero stride. With ``sum_batch`` the batch loop runs inside the program
and one accumulator sums every batch's product (a weight gradient).

The traffic model charges each operand once, as it charges eager torch's GEMM: re-reads of A
and B across tiles are L2 hits when the grouped order works (the memory trace counts the loads).

Launch arguments, in parameter order: ``M, N, K``, the batch sizes, then per load (operands and
epilogue inputs, in load order) and per output its batch strides and its two matrix strides, then
the scalars.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import torch

from ..dtypes import accumulator
from ..errors import RtxError
from ..expr import Expr
from ..registry import REGISTRY, OpKind
from .analyze import Group, Role
from .expand import Graph, float_dtype_of
from .names import scalar_names
from .online import shifted_by
from .params import (
    batch_stride_name,
    dim_stride_name,
    inner_products,
    launch_ints,
    load_names,
    output_name,
    product_loads,
    prologue_cost,
    shared_operands,
    stride_name,
    tile_loads,
)
from .schedule import (
    INT32_LIMIT,
    Body,
    Launch,
    Layout,
    body,
    contiguous_strides,
    expand_strides,
    gemm_block,
    inner_rows,
    inner_slices,
    inner_warps,
    notes_of,
    printed_names,
    scalar_args,
    scalar_positions,
    stride_class,
    viewed,
    wide_epilogue,
)
from .sparsity import NEUTRAL, batch_dim, guard_dims, kept_fraction, vanishing_guard
from .spec import STRIDED, UNIT, GemmTile, KernelSpec, LoadSpec, OutSpec, Src, Window
from .target import Target

MAX_BATCH_GRID = 65535  # CUDA's limit on a grid's second dim


def gemm_tile(
    target: Target,
    m: int,
    n: int,
    dtype: torch.dtype,
    inner: int = 0,
    whole_k: tuple[tuple[int, int], ...] = (),
    at_output: int = 0,
    batch: int = 0,
    cost: int = 0,
) -> GemmTile:
    """The target's tile, narrowed to small products (a power of two >= 16: ``tl.dot``'s minimum)
    and to ``inner`` products its prologues recompute (``schedule.inner_rows``, ``inner_warps``,
    ``inner_slices``; ``at_output`` of them at the output tile: an epilogue's, and a wide
    epilogue's tiles as one),
    with the products of ``whole_k`` taken whole: several only on 4 warps (on 8, sm_90 attention's
    dK + dV at head dim 128 held its two operand tiles for 1.48 warp instructions per score where
    slices take 1.13; at 4, a softcap's spilled 16 bytes). Over more than two ``batch`` dims two
    products keep the target's warps (grouped-query attention's dQ, its 5-D coordinates and a
    partial last tile, spilled 32 bytes at 4 warps, head dim 80 or 128 on sm_90)."""
    bm, bn, bk, group_m, warps, stages = target.gemm
    block = gemm_block(inner_rows(bm, dtype, inner, whole_k), bn, bk, m, n, dtype)
    if inner < 2 or batch <= 2:
        warps = inner_warps(warps, dtype, inner, whole_k, block, at_output)
        block = inner_slices(block, gemm_block(bm, bn, bk, m, n, dtype)[0], dtype, inner, at_output, warps, cost)
    return GemmTile(*block, group_m, warps, stages, whole_k=whole_k if len(whole_k) < 2 or warps == 4 else ())


def operand_layout(s: Expr, graph: Graph, layouts: Mapping[Expr, Layout]) -> Layout:
    """A contraction operand's layout: read from memory, or (a prologue) computed at load time."""
    if s in layouts:
        return layouts[s]
    info = graph.of(s)
    return Layout(info.shape, contiguous_strides(info.shape), info.dtype)


def gemm_spec(
    group: Group, graph: Graph, layouts: Mapping[Expr, Layout], target: Target, tf32: bool = False
) -> tuple[KernelSpec, Launch]:
    """Spec and launch of a contraction group; ``tf32``: fp32 operands multiply in TF32."""
    c = group.contraction
    assert c is not None
    ta, tb, sum_batch, summed = c.attr("ta"), c.attr("tb"), c.attr("sum_batch"), c.attr_dict.get("summed", 0)
    a, b = (operand_layout(s, graph, layouts) for s in c.srcs)
    m, k = (a.shape[-1], a.shape[-2]) if ta else (a.shape[-2], a.shape[-1])
    n = b.shape[-2] if tb else b.shape[-1]
    batch = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    kept = (*batch[: len(batch) - summed], *(1,) * summed)  # the output's batch dims
    domain = (m, n) if sum_batch else (*kept, m, n)
    bd = body(group, graph)
    inner, whole = inner_products(bd.nodes), _whole_k(group, graph, bd, target)
    sa = (a.strides[-1], a.strides[-2]) if ta else (a.strides[-2], a.strides[-1])  # (m, k)
    sb = (b.strides[-1], b.strides[-2]) if tb else (b.strides[-2], b.strides[-1])  # (k, n)
    operand = {Role.A: (a, ta, batch), Role.B: (b, tb, batch)}
    strides, at_tiles = _load_strides(group, bd, layouts, operand, domain, inner), tile_loads(bd.nodes)
    loads = tuple(
        LoadSpec(j, role, *_load_classes(strides[i][1], i in at_tiles) if i in strides else ((), ()))
        for i, (j, role, _) in enumerate(bd.loads)
    )
    outputs = tuple(_out_spec(bd.index[o], layouts[o].dtype, group.role(o)) for o in group.outputs)
    at_output = sum(bd.nodes[i].role is Role.FULL for i in inner) + (wide := wide_epilogue(bd.nodes, loads, outputs))
    tile = gemm_tile(target, m, n, a.dtype, len(inner) + wide, whole, at_output, len(batch), prologue_cost(bd.nodes))
    a_in, b_in = (next((j for j, s in enumerate(group.inputs) if s is x), -1) for x in c.srcs)
    spec = KernelSpec(
        kind="gemm",
        in_dtypes=tuple(layouts[s].dtype for s in group.inputs),
        loads=loads,
        nodes=bd.nodes,
        outputs=outputs,
        **printed_names(group, graph, notes_of(bd.index, group.nodes, graph, len(bd.nodes))),
        scalars=(),
        reductions=(),
        block=0,
        rows_per_program=0,
        looped=False,
        big=_int64_needed([a, b, *(layouts[i] for i in group.inputs)], math.prod(domain)),
        num_warps=tile.num_warps,
        gemm=replace(
            tile,
            a=a_in,
            b=b_in,
            batch=len(batch),
            sum_batch=sum_batch,
            summed=summed,
            a_classes=(_unit(sa[0], sa[1]), _unit(sa[1], sa[0])),
            b_classes=(_unit(sb[0], sb[1]), _unit(sb[1], sb[0])),
            precision="tf32" if tf32 and a.dtype == torch.float32 else "ieee",
            window=_window(group, graph.of(c).dtype),
            guard=_guard(group, graph, bd),
            online=_online(group, bd),
            whole_k=tile.whole_k,
        ),
    )
    values = {"M": m, "N": n, "K": k} | {f"bsize{d}": v for d, v in enumerate(batch)} | _window_values(spec)
    values |= _operand_values(spec, (a, b), (sa, sb), batch)
    values |= _tile_values(spec, group, graph, layouts, bd, strides, inner)
    spec = _even(spec, group.chunk is None, values)
    ints = list(launch_ints(spec, values))
    kinds, vals = scalar_args(bd.slots, graph, float_dtype_of([*group.nodes, *group.inputs], graph.info))
    spec = replace(spec, scalars=tuple(kinds), scalar_names=scalar_names(bd.slots))
    scalar_inputs = scalar_positions(bd.slots, kinds, graph, len(ints))
    chunk = group.chunk
    rows, cols = (chunk.size if chunk is not None and chunk.axis == d else e for d, e in (("m", m), ("n", n)))
    tiles = -(-rows // tile.block_m) * -(-cols // tile.block_n)  # a chunk loop's kernel: one chunk's
    batches = 1 if sum_batch else math.prod(kept)
    if batches > MAX_BATCH_GRID:
        raise RtxError(f"matmul: {batches} batches exceed the grid's limit of {MAX_BATCH_GRID}; fold the batch dims")
    meta = tuple((name, getattr(tile, attr)) for name, attr in TILE_META)
    empty = all(graph.of(o).numel == 0 for o in group.outputs)  # (a bias gradient over no rows is written)
    spans = {"m": (m, tile.block_m), "k": (k, tile.block_k)}
    # a batch dim the guard reads positions along (a split of the keys): each of its positions
    batch_spans = {batch_dim(d, len(batch)): (size, 1) for d, size in enumerate(batch)}
    spans |= {d: batch_spans[d] for d in guard_dims(spec) if d in batch_spans}
    kept = kept_fraction(spec, spans, vals)
    grid = (max(1, tiles), max(1, batches))
    return spec, Launch(tuple(ints), tuple(vals), grid, meta, empty, scalar_inputs, kept=kept)


def _even(spec: KernelSpec, unchunked: bool, values: Mapping[str, int]) -> KernelSpec:
    """``spec`` with the extents that fill their blocks (``GemmTile.even``): ``M``, ``N``, ``K``
    multiples of the tile's blocks, a recomputed product's ``K<i>`` of ``BLOCK_K`` (or equal to its
    one slice). None in a chunk loop's kernel (its windows start mid-extent)."""
    tile = spec.gemm
    assert tile is not None
    if not unchunked or tile.window is not None:
        return spec
    blocks = {"M": tile.block_m, "N": tile.block_n, "K": tile.block_k}
    whole = {f"K{i}": size for i, size in tile.whole_k}
    even = []
    for name, v in values.items():
        if name in blocks and v % blocks[name] == 0:
            even.append(name)
        elif name[:1] == "K" and name[1:].isdigit() and (v == whole[name] if name in whole else v % tile.block_k == 0):
            even.append(name)
    return replace(spec, gemm=replace(tile, even=tuple(sorted(even))))


def _load_strides(
    group: Group, bd: Body, layouts: Mapping[Expr, Layout], operand: dict, domain: tuple[int, ...], inner: list[int]
) -> dict[int, tuple[tuple[int, ...], tuple[int, int]]]:
    """Each load's strides over the product's batch dims and its tile: at an operand's tile (a
    prologue's), at the product's (the epilogue's), or as stored (a recomputed product's operand)."""
    at_tiles = tile_loads(bd.nodes)
    batch = operand[Role.A][2]
    strides: dict[int, tuple[tuple[int, ...], tuple[int, int]]] = {}
    for i, (j, role, view) in enumerate(bd.loads):
        lay = viewed(layouts[group.inputs[j]], view)
        if i in at_tiles:
            strides[i] = _operand_strides(lay, *operand[role]) if role in operand else _tile_strides(lay, domain)
        elif any((Src.LOAD, i) in bd.nodes[p].srcs for p in inner):
            strides[i] = _batch_strides(lay, batch), (lay.strides[-2], lay.strides[-1])
    return strides


#: a GEMM launch's meta-parameters: (name, GemmTile field)
TILE_META = (
    ("BLOCK_M", "block_m"),
    ("BLOCK_N", "block_n"),
    ("BLOCK_K", "block_k"),
    ("GROUP_M", "group_m"),
    ("num_warps", "num_warps"),
    ("num_stages", "num_stages"),
)


def _operand_values(
    spec: KernelSpec, layouts: tuple[Layout, Layout], strides: tuple[tuple[int, int], tuple[int, int]], batch: tuple
) -> dict[str, int]:
    """The strides of the operands read from memory, by name (a prologue's strides are its loads')."""
    g = spec.gemm
    assert g is not None
    values: dict[str, int] = {}
    for op, dims, lay, st, cls, j in zip("ab", ("mk", "kn"), layouts, strides, (g.a_classes, g.b_classes), (g.a, g.b)):
        if j >= 0:
            values |= {batch_stride_name(op, d): v for d, v in enumerate(_batch_strides(lay, batch))}
            values |= {dim_stride_name(op, dim): v for dim, v, c in zip(dims, st, cls) if c == STRIDED}
    return values


def _window(group: Group, dtype: torch.dtype) -> Window | None:
    """A chunk loop's kernel: the dim its programs or K loop window, the inputs and outputs stored
    one chunk at a time, the accumulator's dtype where the sum runs across chunks."""
    chunk = group.chunk
    if chunk is None:
        return None
    relative = tuple(j for j, s in enumerate(group.inputs) if any(s is v for v in chunk.values))
    relative_out = tuple(k for k, o in enumerate(group.outputs) if any(o is v for v in chunk.values))
    return Window(chunk.axis, relative, relative_out, accumulator(dtype) if chunk.axis == "k" else None)


def _guard(group: Group, graph: Graph, bd: Body) -> tuple[Src, int] | None:
    """Block sparsity: the guard under which the K loop's A tile, a product computed in tiles, is 0
    and each reduction in the K loop reads its neutral value (``lower.sparsity``): its node, its
    load where it is a bool tensor itself (a padding mask read at A's tile), or None."""
    c = group.contraction
    assert c is not None
    a = c.srcs[0]
    if group.chunk is not None or c.attr("sum_batch") or group.roles.get(a) is not Role.A:
        return None
    prologue = [n for n in group.nodes if group.role(n) is Role.A]
    if not any(REGISTRY[n.op].kind is OpKind.CONTRACTION for n in prologue):
        return None  # only where A is a product computed in tiles (attention's P, dS): a masked
        # operand read from memory keeps eager's 0 * inf in every tile
    targets = [(a, 0.0)]  # and each product summed beside it from a prologue (dV's P beside dK's dS)
    targets += [(n.srcs[0], 0.0) for n in group.nodes if n is not c and _from_prologue(n, group)]
    for n in prologue:
        if REGISTRY[n.op].kind is OpKind.REDUCTION:
            if n.op not in NEUTRAL:
                return None
            targets.append((n.srcs[0], NEUTRAL[n.op]))
    guard = vanishing_guard(prologue, graph, targets)
    if guard is not None and group.roles.get(guard) is Role.A:
        return Src.NODE, bd.index[guard]
    held = [i for i, x in enumerate(group.inputs) if x is guard]  # a bool tensor as the guard, loaded at A's tile
    loads = [k for k, (i, role, _) in enumerate(bd.loads) if i in held and role is Role.A]
    return (Src.LOAD, loads[0]) if len(loads) == 1 else None


def _from_prologue(n: Expr, group: Group) -> bool:
    """Is ``n`` a product at the output tile whose A operand is a prologue at A's tile?"""
    full = REGISTRY[n.op].kind is OpKind.CONTRACTION and group.roles.get(n) is Role.FULL
    return full and group.roles.get(n.srcs[0]) is Role.A


def _whole_k(group: Group, graph: Graph, bd: Body, target: Target) -> tuple[tuple[int, int], ...]:
    """The prologues' recomputed products whose contracted size fits one slice (``target.whole_k``),
    each with that slice (a power of two >= 16), where no batch loop runs inside the program: the
    operand tile the K loop does not move is loaded once before it, and each K tile takes one
    ``tl.dot`` without a zero-filled accumulator (as tutorial 06 holds ``q``, and ``k`` and ``v``
    in its backward; two or more only on 4 warps, ``gemm_tile``). (The GPU's MMA sums K in order,
    so one slice gives the bits a loop of slices gives in a kernel recomputing the same product.)"""
    own = group.contraction
    assert own is not None
    at_operand = [i for i in inner_products(bd.nodes) if bd.nodes[i].role in (Role.A, Role.B)]
    if not at_operand or own.attr("sum_batch") or own.attr_dict.get("summed"):
        return ()
    whole = []
    for i in at_operand:
        p = next(p for p in group.nodes if bd.index.get(p) == i)
        size = graph.of(p.srcs[0]).shape[-2 if p.attr("ta") else -1]
        if size <= target.whole_k:
            whole.append((i, max(16, 1 << (size - 1).bit_length())))
    return tuple(whole)


def _online(group: Group, bd: Body) -> tuple[int, int] | None:
    """Online softmax (``lower.online``): the logsumexp merged in the K loop and its shift node."""
    found = shifted_by(group.nodes, group.roles)
    return None if found is None else (bd.index[found[0]], bd.index[found[1]])


def _window_values(spec: KernelSpec) -> dict[str, int]:
    """A chunk loop's kernel: the first chunk's start and, accumulating, whether it is the last
    (the runtime passes each chunk's own, :class:`~rtxdsl.lower.spec.ChunkLoop`)."""
    w = spec.gemm.window if spec.gemm is not None else None
    if w is None:
        return {}
    return {"W_LO": 0} | ({"W_LAST": 1} if w.accumulate is not None else {})


def _tile_values(
    spec: KernelSpec,
    group: Group,
    graph: Graph,
    layouts: Mapping[Expr, Layout],
    bd: Body,
    strides: dict[int, tuple[tuple[int, ...], tuple[int, int]]],
    inner: list[int],
) -> dict[str, int]:
    """The launch's other integer arguments by name: loads at tiles (their strides), the outputs'
    row strides, and each recomputed product's contracted size and operand strides."""
    names = load_names(spec.loads)
    values: dict[str, int] = {}
    for i in tile_loads(spec.nodes):
        over_batch, tile_strides = strides[i]
        values |= {stride_name(names[i], d): v for d, v in enumerate(over_batch)}
        n_b = len(over_batch)
        values |= {stride_name(names[i], n_b + d): v for d, v in enumerate(tile_strides) if stride_class(v) == STRIDED}
    for k, o in enumerate(group.outputs):
        if group.role(o) is Role.FULL:  # a reduction of A is one contiguous value per row of the product
            row_strides = layouts[o].strides[:-1]  # contiguous (one chunk's, in a chunk loop): columns' is 1
            values |= {stride_name(output_name(k), d): v for d, v in enumerate(row_strides)}
    shared = shared_operands(spec)
    for p in group.nodes:  # each recomputed product: its contracted size, its operands' strides
        i = bd.index.get(p)
        if i in inner:
            if i not in shared:
                values[f"K{i}"] = graph.of(p.srcs[0]).shape[-2 if p.attr("ta") else -1]
            for j in product_loads(spec, i, shared):
                over_batch, (r, cl) = strides[j]
                values |= {batch_stride_name(names[j], d): v for d, v in enumerate(over_batch)}
                # the load's own classes (one load read at a tile too has them from there: a [4, 1]
                # operand of a recomputed product read elementwise as well, both strides unit;
                # lazy fuzzer program 2026151400164)
                classes = (*spec.loads[j].rows, *spec.loads[j].cols)
                n_b = len(over_batch)  # (numbered past the batch dims: params.strided's first)
                values |= {
                    stride_name(names[j], n_b + d): v for d, (v, c) in enumerate(zip((r, cl), classes)) if c == STRIDED
                }
    return values


def _out_spec(node: int, dtype: torch.dtype, role: Role) -> OutSpec:
    """The product's tile (rows strided, columns unit), or a reduction of A: one value per row."""
    return (
        OutSpec(node, dtype, role, (STRIDED,), (UNIT,))
        if role is Role.FULL
        else OutSpec(node, dtype, role, (UNIT,), ())
    )


def _unit(stride: int, other: int) -> str:
    """A matrix dim's stride class: unit only where the other dim is not unit too (a one-element
    dim can have stride 1 beside a real unit stride: the real one gets it)."""
    return UNIT if stride == 1 and other != 1 else STRIDED


def _tile_strides(lay: Layout, domain: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, int]]:
    """An epilogue input's strides over the product's batch dims and its (rows, cols)."""
    full = expand_strides(lay, domain)
    return full[:-2], (full[-2], full[-1])


def _operand_strides(
    lay: Layout, operand: Layout, transposed: bool, batch: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, int]]:
    """A prologue input's strides over the product's batch dims and the operand's tile: (m, k) for
    A, (k, n) for B (an operand read transposed swaps its last two dims)."""
    full = expand_strides(lay, operand.shape)
    r, c = full[-2:]
    return _batch_strides(Layout(operand.shape, full, lay.dtype), batch), ((c, r) if transposed else (r, c))


def _load_classes(tile: tuple[int, int], at_tile: bool) -> tuple[tuple[str], tuple[str]]:
    """A load's stride classes: at a tile, of its (rows, cols) strides; a recomputed product's
    operand, of its two matrix dims (unit as :func:`_unit` says)."""
    if at_tile:
        return (stride_class(tile[0]),), (stride_class(tile[1]),)
    return (_unit(tile[0], tile[1]),), (_unit(tile[1], tile[0]),)


def _batch_strides(lay: Layout, batch: tuple[int, ...]) -> tuple[int, ...]:
    """An operand's strides over the product's batch dims (0 where it broadcasts)."""
    return expand_strides(Layout(lay.shape[:-2], lay.strides[:-2], lay.dtype), batch)


def _int64_needed(layouts: list[Layout], numel: int) -> bool:
    spans = [sum((s - 1) * abs(st) for s, st in zip(lay.shape, lay.strides)) + 1 for lay in layouts]
    return max([numel, *spans]) >= INT32_LIMIT
