"""Lowering: expressions + input layouts -> a frozen :class:`Program`, as a pure function.

``lower(outputs, inputs, layouts, config)`` binds (``bind``), expands composites
(``expand``), partitions the graph into fusion groups (``analyze``) and schedules each group
(``schedule``): the result says which kernels run with which buffers and arguments, and
nothing in it depends on where or how it will run. ``vjp`` differentiates a graph into
forward and backward expressions that lower the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from ..config import FusionConfig
from ..expr import Expr
from ..ops import REGISTRY, OpKind
from ..recursion import deep
from .analyze import Group, Plan, Role, analyze, read_srcs, views_of_inputs
from .bind import Info
from .columns import column_pairs, with_columns
from .expand import Graph, expand
from .flops import kernel_flops, minimum_flops
from .gemm import gemm_spec
from .params import ParamKind, own_params, pointer_slots, slots, with_tail_slots
from .passes import early_outputs, input_reads, input_scopes, partial_states, remaps
from .plans import plan_of
from .schedule import Launch, Layout, contiguous_strides, divisor_checks, kernel_spec, split_specs
from .spec import Buffer, ChunkLoop, KernelCall, KernelSpec, Program, Split, Src, tail_constexprs
from .target import GPU, INTERPRETER, Target, target_for

#: what a call gives for one input: a tensor's layout, or a python number (a scalar input)
InputMeta = Layout | bool | int | float


@deep
def lower(
    outputs: Sequence[tuple[str, Expr]],
    inputs: tuple[Expr, ...],
    metas: tuple[InputMeta, ...],
    config: FusionConfig,
    target: Target = GPU,
    into: Mapping[str, str] | None = None,
) -> Program:
    """The program computing ``outputs`` from inputs described by ``metas`` (in ``inputs`` order),
    with launch configurations shaped for ``target``; ``into`` (output key -> input name) asks for
    outputs written into an input's own memory, where that is safe (see :func:`program`)."""
    return program(plan_for(outputs, inputs, metas, config), metas, target, into, tf32=tf32_of(config))


@deep
def plan_for(
    outputs: Sequence[tuple[str, Expr]], inputs: tuple[Expr, ...], metas: tuple[InputMeta, ...], config: FusionConfig
) -> Plan:
    """The fusion groups over ``outputs`` bound to inputs described by ``metas``: expressions bound
    and expanded at these sizes, the analysis reused from a graph of the same structure
    (``lower.plans``)."""
    infos = tuple(Info.tensor(m.shape, m.dtype) if isinstance(m, Layout) else Info.scalar_input(m) for m in metas)
    return plan_of(expand(list(outputs), inputs, infos), config)


def tf32_of(config: FusionConfig) -> bool:
    """Does a product computed in a kernel multiply fp32 operands in TF32 (torch's setting unless
    the config says)?"""
    return torch.backends.cuda.matmul.allow_tf32 if config.allow_tf32 is None else config.allow_tf32


def program(
    plan: Plan,
    metas: tuple[InputMeta, ...],
    target: Target = GPU,
    into: Mapping[str, str] | None = None,
    tf32: bool = False,
) -> Program:
    """Buffers, kernel calls and results of ``plan`` for inputs described by ``metas``, on ``target``.

    An output named in ``into`` takes its input's memory when that input is contiguous with the
    output's shape and dtype and only the output's own pointwise kernel reads it, at the output's
    own coordinates: each element is read before it is overwritten, by the same program. Otherwise
    it gets a buffer of its own."""
    graph = plan.graph
    n_inputs = len(metas)
    slots: dict[Expr, int] = {}
    lay: dict[Expr, Layout] = {}
    for i, (v, meta) in enumerate(zip(graph.inputs, metas)):
        if isinstance(meta, Layout):
            slots[v] = i
            lay[v] = meta
    requested = {e for _, e in graph.outputs}
    for g in plan.groups:
        for o in g.outputs:
            info = graph.of(o)
            dtype = info.dtype if o in requested else intermediate_dtype(g, info, o)
            lay[o] = Layout(info.shape, contiguous_strides(info.shape), dtype)
    stored = _chunk_buffers(plan, lay)
    views = _views(plan, lay, slots, requested)
    out_views = _output_views(plan, lay, requested, stored, {n for g in views for n in g.nodes})
    groups = list(plan.groups)
    scheduled: list[tuple[KernelSpec, Launch] | None] = [
        None
        if g in views or g in out_views
        else gemm_spec(g, graph, lay, target, tf32)
        if g.contraction is not None and not g.is_row
        else kernel_spec(g, graph, lay, target, tf32)
        for g in groups
    ]
    merges = _column_reductions(groups, scheduled, graph, lay, target, tf32)
    aliases = _aliases(plan, scheduled, lay, slots, into or {})
    buffers = _buffers(groups, views, out_views, aliases, stored, lay, slots, n_inputs)
    calls = _launches(groups, scheduled, merges, slots, lay, buffers, n_inputs, graph)
    calls = _with_tails(_loops_together(calls), buffers, n_inputs)
    outputs: list[tuple[str, int | None]] = []
    scalars = {}
    for key, root in graph.outputs:
        if root in slots:
            outputs.append((key, slots[root]))
        else:  # a scalar-only output: no kernel needed
            info = graph.of(root)
            outputs.append((key, None))
            scalars[key] = (info.value, info.dtype)
    minimum = sum(m.nbytes for m in metas if isinstance(m, Layout)) + sum(
        graph.of(e).nbytes for _, e in graph.outputs if not graph.of(e).is_scalar
    )
    return Program(
        n_inputs=n_inputs,
        buffers=tuple(buffers),
        kernels=tuple(calls),
        outputs=tuple(outputs),
        scalar_outputs=scalars,
        eager_launches=graph.eager_launches,
        eager_bytes=graph.eager_bytes,
        minimum_bytes=minimum,
        minimum_flops=minimum_flops(graph),
        divisors=divisor_checks(graph),
    )


def _launches(
    groups: list[Group],
    scheduled: list[tuple[KernelSpec, Launch] | None],
    merges: dict[int, int],
    slots: dict[Expr, int],
    lay: dict[Expr, Layout],
    buffers: list[Buffer],
    n_inputs: int,
    graph: Graph,
) -> list[KernelCall]:
    """Every group's kernel calls in order (``_calls``), a row kernel's column reductions' partial
    states in buffers its merge reads too."""
    partials: dict[int, tuple[int, ...]] = {}  # a merge's group -> the partial states its row kernel stores
    calls = []
    for gi, (g, sched) in enumerate(zip(groups, scheduled)):
        if sched is None:
            continue
        spec, launch = sched
        if spec.columns:  # its own, and its merge's
            parts = partials[merges[gi]] = _column_buffers(spec, launch, g, buffers, n_inputs)
        else:
            parts = partials.get(gi, ())
        calls += _calls(gi, g, spec, launch, slots, lay, buffers, n_inputs, kernel_flops(g, graph), parts)
    return calls


def _column_reductions(
    groups: list[Group],
    scheduled: list[tuple[KernelSpec, Launch] | None],
    graph: Graph,
    lay: dict[Expr, Layout],
    target: Target,
    tf32: bool,
) -> dict[int, int]:
    """Column groups whose reductions a row kernel computes (``lower.columns``), rescheduled in
    place: the row group with their cones (its programs loop over blocks of rows), the column
    group as the merge of their partial states. Only where the row kernel keeps its rows whole
    and unsplit (the lanes span a row). Returns row group index -> its merge's group index."""
    merges: dict[int, int] = {}
    for bi, ai in column_pairs(Plan(tuple(groups), graph)).items():
        if scheduled[ai] is None or scheduled[bi] is None:
            continue
        merged = with_columns(groups[ai], groups[bi], graph)
        spec, launch = kernel_spec(merged, graph, lay, target, tf32)
        if spec.looped or launch.split > 1 or launch.empty:
            continue
        groups[ai], scheduled[ai] = merged, (spec, launch)
        scheduled[bi] = kernel_spec(groups[bi], graph, lay, target, tf32, merge_of=launch.grid[0])
        merges[ai] = bi
    return merges


def _column_buffers(
    spec: KernelSpec, launch: Launch, g: Group, buffers: list[Buffer], n_inputs: int
) -> tuple[int, ...]:
    """The partial states a row kernel's programs store for its column reductions, a buffer each
    (appended to ``buffers``): per state component, one state per program and column."""
    n_cols = math.prod(g.shape[d] for d in g.axes)
    out = []
    for _, n_state, dtype in partial_states(spec):
        out.append(n_inputs + len(buffers))
        buffers.append(Buffer((n_state, launch.grid[0] * n_cols), dtype))
    return tuple(out)


def _calls(
    gi: int,
    g: Group,
    spec: KernelSpec,
    launch: Launch,
    slots: dict[Expr, int],
    lay: dict[Expr, Layout],
    buffers: list[Buffer],
    n_inputs: int,
    flops: int,
    parts: tuple[int, ...] = (),
) -> list[KernelCall]:
    """Group ``gi``'s kernel calls (a split row's partial and finish kernels), with the buffers they
    add (index-check flags, partial states) appended to ``buffers``; ``flops``: the group's (a
    split row's partial kernel computes them); ``parts``: the partial states a row kernel's column
    reductions store (its own) or a merge reads."""
    in_slots = tuple(slots[i] for i in g.inputs)
    out_slots = tuple(slots[o] for o in g.outputs)
    flags: tuple[int, ...] = ()
    if spec.flags:  # index checks: an int32 flag per gathering op, zeroed per call
        flags = (n_inputs + len(buffers),)
        buffers.append(Buffer((len(spec.flags),), torch.int32, zero=True))
    in_bytes = [lay[i].nbytes for i in g.inputs]
    out_bytes = [0 if launch.empty else lay[o].nbytes for o in g.outputs]
    part_bytes = sum(math.prod(buffers[s - n_inputs].shape) * buffers[s - n_inputs].dtype.itemsize for s in parts)
    window = spec.gemm.window if spec.gemm is not None else None
    if window is not None and window.accumulate is not None:  # the sum across a chunk loop's chunks
        parts = (n_inputs + len(buffers),)
        buffers.append(Buffer(g.shape, window.accumulate))  # the product's (batches, rows, columns)
        # read by each chunk but the first, written by each but the last
        part_bytes = 2 * (g.chunk.chunks - 1) * math.prod(g.shape) * window.accumulate.itemsize  # type: ignore[union-attr]
    if spec.columns:  # its column reductions' partial states: written
        phases = [(spec, launch, 0, part_bytes)]
    elif launch.split > 1 and spec.split is not Split.MERGE:  # partial states of every reduction, one buffer each
        for _, n_state, dtype in partial_states(spec):
            parts += (n_inputs + len(buffers),)
            buffers.append(Buffer((n_state, launch.rows * launch.split), dtype))
            part_bytes += n_state * launch.rows * launch.split * dtype.itemsize
        (partial, p_launch), (finish, f_launch) = split_specs(spec, launch)
        phases = [(partial, p_launch, 0, part_bytes), (finish, f_launch, part_bytes, 0)]
    else:
        phases = [(spec, launch, part_bytes, 0)]
    by_kind = {ParamKind.INPUT: in_slots, ParamKind.OUTPUT: out_slots, ParamKind.PARTIAL: parts, ParamKind.FLAGS: flags}
    calls = []
    for sp, ln, part_read, part_written in phases:
        reads = input_reads(sp)
        moved = sum(r * b for r, b in zip(reads, in_bytes)) + part_read + part_written
        # a split row's partial kernel stores the full outputs that need no reduction, its finish
        # kernel the rest
        early = set(early_outputs(sp))
        if sp.split in (Split.PARTIAL, Split.FINISH):
            moved += sum(b for k, b in enumerate(out_bytes) if (k in early) == (sp.split is Split.PARTIAL))
        else:
            moved += sum(out_bytes)
        calls.append(
            KernelCall(
                spec=sp,
                summary=f"{g.pattern}: {', '.join(g.ops)}",
                grid=ln.grid,
                buffers=pointer_slots(sp, by_kind),
                args=(*ln.ints, *ln.scalars),
                meta=ln.meta,
                ops=len(g.nodes),
                bytes=0 if ln.empty else moved,
                flops=0 if ln.empty or sp.split is Split.FINISH else _kernel_flops(flops, sp, reads, ln),
                passes=max(reads, default=1),
                empty=ln.empty,
                scalar_inputs=ln.scalar_inputs,
                checks=ln.checks,
                group=gi,
                reads=tuple(reads),
                chunk=_chunk_loop(g, sp),
            )
        )
    return calls


def _kernel_flops(flops: list[int], spec: KernelSpec, reads: list[int], launch: Launch) -> int:
    """A launch's FLOPs: its group's (``flops.kernel_flops``), each product's times its passes,
    times the fraction of tiles block sparsity runs."""
    return round(sum(f * p for f, p in zip(flops, _product_passes(spec, reads))) * launch.kept)


def _product_passes(spec: KernelSpec, reads: list[int]) -> list[int]:
    """How many times a row kernel computes each of its products: once per looped pass over the
    row that reads its right operand (which nothing but the product's K loop loads); a GEMM's,
    once."""
    if spec.kind != "row" or spec.gemm is None:
        return [1]
    products = [nd for nd in spec.nodes if REGISTRY[nd.op].kind is OpKind.CONTRACTION]
    return [reads[spec.loads[j].input] if kind is Src.LOAD else 1 for kind, j in (p.srcs[1] for p in products)]


def _chunk_buffers(plan: Plan, lay: dict[Expr, Layout]) -> dict[Expr, tuple[int, ...]]:
    """Values a chunk loop stores one chunk at a time (``lower/chunk.py``): laid out over their full
    shape with one chunk's strides (column ``c`` of a chunk starting at ``lo`` at ``c - lo``), their
    buffer one chunk: node -> the buffer's shape."""
    found = {}
    for g in plan.groups:
        if g.chunk is None:
            continue
        for v in g.chunk.values:
            if any(v is o for o in g.outputs):
                have = lay[v]
                found[v] = (*have.shape[:-1], g.chunk.size)
                lay[v] = Layout(have.shape, contiguous_strides(found[v]), have.dtype)
    return found


def _chunk_loop(g: Group, spec: KernelSpec) -> ChunkLoop | None:
    """How a chunk loop's kernel is launched: each chunk's end replaces the windowed dim's extent
    (``M``, ``N`` or ``K``: arguments 0, 1, 2), its start ``W_LO`` (and ``W_LAST``)."""
    if g.chunk is None:
        return None
    ints = [p.name for p in own_params(spec) if p.kind is ParamKind.INT]
    last = ints.index("W_LAST") if "W_LAST" in ints else -1
    return ChunkLoop(g.chunk.loop, g.chunk.extent, g.chunk.size, "mnk".index(g.chunk.axis), ints.index("W_LO"), last)


def _loops_together(calls: list[KernelCall]) -> list[KernelCall]:
    """The kernels of each chunk loop made adjacent, in launch order: each moves up to the one
    before it in its loop, over kernels whose outputs it does not read; a kernel it does read that
    reads nothing of the loop's (a tied embedding's normed rows, recomputed for the loop's
    gradient GEMM) moves up before the loop instead."""
    out: list[KernelCall] = []
    for call in calls:
        loop = call.chunk.loop if call.chunk is not None else None
        at = [k for k, c in enumerate(out) if loop is not None and c.chunk is not None and c.chunk.loop == loop]
        if not at:
            out.append(call)
            continue
        hoist = _read_before(call, out[at[-1] + 1 :])
        if hoist:
            out = out[: at[0]] + hoist + _passed_by(out[at[0] :], hoist)
            at = [k for k, c in enumerate(out) if c.chunk is not None and c.chunk.loop == loop]
        passed = {s for c in out[at[-1] + 1 :] for s in slots(c, ParamKind.OUTPUT)}
        assert not passed & set(slots(call, ParamKind.INPUT)), "a chunk loop's kernel reads a kernel it would pass"
        out.insert(at[-1] + 1, call)
    return out


def _passed_by(calls: list[KernelCall], hoist: list[KernelCall]) -> list[KernelCall]:
    """``calls`` without ``hoist``, which move before them: none of those it passes (the loop's
    kernels) writes what it reads or reads what it writes."""
    rest = [c for c in calls if all(c is not h for h in hoist)]
    for h in hoist:
        passes = [c for c in calls[: next(k for k, c in enumerate(calls) if c is h)] if any(c is r for r in rest)]
        written = {s for c in passes for s in slots(c, ParamKind.OUTPUT)}
        read = {s for c in passes for s in slots(c, ParamKind.INPUT)}
        assert not set(slots(h, ParamKind.INPUT)) & written, "a kernel a chunk loop reads reads the loop"
        assert not set(slots(h, ParamKind.OUTPUT)) & read, "a kernel a chunk loop reads writes what it reads"
    return rest


def _read_before(call: KernelCall, between: list[KernelCall]) -> list[KernelCall]:
    """The kernels of ``between`` whose outputs ``call`` reads, directly or through one another,
    in launch order."""
    needed = set(slots(call, ParamKind.INPUT))
    found: list[KernelCall] = []
    for c in reversed(between):
        if set(slots(c, ParamKind.OUTPUT)) & needed:
            found.append(c)
            needed |= set(slots(c, ParamKind.INPUT))
    return found[::-1]


def _buffers(
    groups: list[Group],
    views: dict[Group, dict[Expr, int]],
    out_views: dict[Group, list[Expr]],
    aliases: dict[Expr, int],
    stored: Mapping[Expr, tuple[int, ...]],
    lay: dict[Expr, Layout],
    slots: dict[Expr, int],
    n_inputs: int,
) -> list[Buffer]:
    """A buffer (and slot) per value a kernel writes: none for a view of an input (its slot is the
    input's) or for an output that only reshapes an intermediate (that intermediate's kernel writes
    into the output's buffer)."""
    into_output = {s: n for g in groups for n, s in zip(g.nodes, out_views.get(g, ()))}
    buffers: list[Buffer] = []
    for g in groups:
        if g in views:  # reshapes of inputs: the inputs' own memory, no kernel
            slots.update(views[g])
            continue
        if g in out_views:  # its source's kernel wrote the output
            continue
        for o in g.outputs:
            if o in aliases:
                slots[o] = aliases[o]
                continue
            slots[o] = n_inputs + len(buffers)
            shown = into_output.get(o, o)
            slots[shown] = slots[o]
            buffers.append(Buffer(stored.get(o, lay[shown].shape), lay[o].dtype))
    return buffers


def _views(
    plan: Plan, lay: dict[Expr, Layout], slots: dict[Expr, int], requested: set[Expr]
) -> dict[Group, dict[Expr, int]]:
    """group -> {node: input slot}, for groups that only reshape inputs into intermediates
    (a flattened ``[batch, tokens, hidden]`` GEMM operand, attention's heads split into groups)
    where torch could view them: the inputs' own memory, no copy. A view's strides are its layout."""
    found = {}
    for g in plan.groups:
        if not _writes_each_node(g) or any(n in requested for n in g.nodes) or not views_of_inputs(g.nodes):
            continue
        views = {}
        for n in g.nodes:
            src = n.srcs[0]
            if src not in slots:
                break
            have, want = lay[src], lay[n]
            strides = view_strides(have, want.shape)
            if strides is None or have.dtype != want.dtype:
                break
            views[n] = (slots[src], Layout(want.shape, strides, want.dtype))
        else:
            found[g] = {i: slot for i, (slot, _) in views.items()}
            lay.update({i: layout for i, (_, layout) in views.items()})
    return found


def _writes_each_node(g: Group) -> bool:
    """Is every node of ``g`` one of its outputs (nothing computed only inside it)?"""
    written = set(g.outputs)
    return len(written) == len(g.nodes) and all(n in written for n in g.nodes)


def view_strides(have: Layout, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The strides of ``have`` viewed as ``shape`` (torch's ``view``), None where that needs a copy."""
    try:
        meta = torch.empty_strided(have.shape, have.strides, dtype=have.dtype, device="meta")
        return tuple(meta.view(shape).stride())
    except RuntimeError:
        return None


def _output_views(
    plan: Plan, lay: dict[Expr, Layout], requested: set[Expr], stored: Mapping, viewed: set[Expr]
) -> dict[Group, list[Expr]]:
    """group -> the intermediates its requested outputs only reshape (grouped attention's
    ``[B, Hkv, G, Tq, Dv]`` as ``[B, Hq, Tq, Dv]``, and its gradients): their kernels write the
    outputs' memory, in the same order, and the reshapes launch nothing. Not an intermediate that
    is itself a view of an input (``viewed``: no kernel writes it; ``a.reshape(2, 3, 1).view(-1)``
    returned no tensor)."""
    found = {}
    writers = {o for g in plan.groups for o in g.outputs}
    for g in plan.groups:
        if not _writes_each_node(g) or any(n not in requested for n in g.nodes):
            continue
        srcs = [n.srcs[0] for n in g.nodes]
        if len(set(srcs)) == len(srcs) and all(
            REGISTRY[n.op].regroups
            and s not in requested
            and s not in stored
            and s not in viewed
            and s in writers
            and lay[s].dtype == lay[n].dtype
            and lay[s].strides == contiguous_strides(lay[s].shape)
            for n, s in zip(g.nodes, srcs)
        ):
            found[g] = srcs
    return found


def _aliases(
    plan: Plan, scheduled: list, lay: dict[Expr, Layout], slots: dict[Expr, int], into: Mapping[str, str]
) -> dict[Expr, int]:
    """Output node -> the input slot it is written into (the safe cases of ``into``)."""
    graph = plan.graph
    roots = {key: root for key, root in graph.outputs}
    found: dict[Expr, int] = {}
    for key, name in into.items():
        v = next((v for v in graph.inputs if v.attr("name") == name), None)
        o = roots.get(key)
        if v is None or o is None or v not in slots:
            continue
        writer = [k for k, g in enumerate(plan.groups) if any(x is o for x in g.outputs)]
        readers = [k for k, g in enumerate(plan.groups) if any(x is v for x in g.inputs)]
        if len(writer) != 1 or readers != writer:
            continue
        if scheduled[writer[0]] is None:
            continue
        g, (spec, launch) = plan.groups[writer[0]], scheduled[writer[0]]
        src, out = lay[v], lay[o]
        same = (src.shape, src.strides, src.dtype) == (out.shape, out.strides, out.dtype)
        # pointwise, and no movement op reads it (one might read an element another program wrote;
        # shape-only operands, such as positions', read nothing)
        local = not any(REGISTRY[n.op].kind is OpKind.MOVEMENT and any(s is v for s in read_srcs(n)) for n in g.nodes)
        if same and local and not spec.split and launch.split <= 1 and _read_before_written(g, spec, v, o):
            found[o] = slots[v]
    return found


def _read_before_written(g: Group, spec: KernelSpec, v: Expr, o: Expr) -> bool:
    """Every load of ``v`` comes before ``o`` is stored over it: a kernel computes a scope's
    values before its stores (codegen), so this holds unless ``o`` is stored in a looped row's
    first pass while a later pass or the output loop loads ``v`` again, or ``v`` is a GEMM's
    operand (every program reads whole rows and columns of it)."""
    if g.contraction is not None:  # other programs read the operands' rows and columns
        return all(v is not s for s in g.contraction.srcs)
    if spec.kind != "row" or not spec.looped:
        return True
    k = next(k for k, x in enumerate(g.outputs) if x is o)
    if k not in early_outputs(spec):
        return True
    return input_scopes(spec)[next(i for i, x in enumerate(g.inputs) if x is v)] <= {1}


def can_be_tail(call: KernelCall) -> bool:
    """A one-program row kernel (a reduction over everything a previous kernel wrote, such as
    cross-entropy's mean over its rows) that the previous launch's last program can run: a flat
    one (nothing read at remapped coordinates, no product in it)."""
    s = call.spec
    return (
        s.kind == "row" and s.split in (Split.WHOLE, Split.MERGE) and not remaps(s) and not s.flags and s.tail is None
        and not call.empty and call.grid == (1,)
    )  # fmt: skip


def _with_tails(calls: list[KernelCall], buffers: list[Buffer], n_inputs: int) -> list[KernelCall]:
    """Fold each tail-able kernel into the launch before it: every program of that launch takes a
    ticket from a counter after its stores, and the last one runs the tail, then zeroes the counter
    for the next call. One launch fewer, the same loads and stores; the tail reads in a fixed
    order, so results are bit-stable. (The runtime keeps one counter per CUDA stream.)"""
    out: list[KernelCall] = []
    for call in calls:
        head = out[-1] if out else None
        if head is None or head.empty or head.tail is not None or len(head.grid) != 1 or not can_be_tail(call):
            out.append(call)
            continue
        counter = n_inputs + len(buffers)
        buffers.append(Buffer((1,), torch.int32, persistent=True))
        shift = len(head.args)
        spec = replace(head.spec, tail=call.spec)
        out[-1] = replace(
            head,
            spec=spec,
            buffers=with_tail_slots(spec, head.buffers, call.buffers, counter),
            args=head.args + call.args,  # the head's other parameters, then the tail's (lower.params)
            meta=head.meta + tuple((f"T_{k}", v) for k, v in call.meta if k in tail_constexprs(call.spec)),
            scalar_inputs=head.scalar_inputs + tuple((p + shift, i, kind) for p, i, kind in call.scalar_inputs),
            ops=head.ops + call.ops,
            bytes=head.bytes + call.bytes,
            tail=call,
        )
    return out


__all__ = [
    "Buffer",
    "InputMeta",
    "Graph",
    "Group",
    "Info",
    "KernelCall",
    "KernelSpec",
    "Layout",
    "Plan",
    "Program",
    "Role",
    "GPU",
    "INTERPRETER",
    "Target",
    "analyze",
    "expand",
    "lower",
    "plan_for",
    "program",
    "target_for",
]


def intermediate_dtype(group: Group, info: Info, node: Expr | None = None) -> torch.dtype:
    """The dtype of a value only kernels read back, written by ``group``: a per-row statistic
    (smaller than the group's domain, or a row group's per-row value ``node`` where rows hold one
    element) of fp16 / bf16 keeps float32, so that it is rounded once, at the final store; a
    full-size value keeps its own dtype (its traffic counts, as in eager). (A softmax over rows of
    one element stored its logsumexp rounded to fp16 where its exponentials read the value it was
    taken of unrounded: exp(x - round(x)) summed to 0.6.)"""
    if info.dtype not in (torch.float16, torch.bfloat16):
        return info.dtype
    per_row = node is not None and group.is_row and group.role(node) is not Role.FULL
    return torch.float32 if per_row or math.prod(info.shape) < math.prod(group.shape) else info.dtype
