"""Sharding: which axes of a typed graph can be split across devices without changing any value.

Each dimension of each node gets a label; operations that line dimensions up (elementwise
broadcasting, the passed-through axes of a slice, ``cat``, ``select`` or ``gather``) join their
labels, and operations that need a whole axis (a reduction, the axis a movement op re-indexes,
positions and random numbers, sizes baked into ``expand``) mark it *whole*. A joined axis that
no node needs whole is *shardable*: every tensor holding it can be cut along it and each piece
computed alone, giving exactly the pieces of the full result. A size-1 axis never shards (it
broadcasts). An axis only ``sum`` needs whole, where each such sum is an output (a bias or weight
gradient next to the row-wise input gradient), shards too: those outputs are *partial* sums,
added across the pieces. This is what ``rtxdsl.dtensor`` offers DTensor's sharding propagation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..expr import Expr
from ..ops import REGISTRY, AxisRule, DtypeRule, OpKind
from .expand import Graph


class _Labels:
    """Union-find over axis labels, each with the reason it must stay whole (``""``: shardable)."""

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.whole: list[str] = []
        self.summed: list[tuple[int, Expr]] = []  # (label, the sum reducing it)

    def fresh(self, size: int, whole: str = "") -> int:
        self.parent.append(len(self.parent))
        self.whole.append(whole or ("a size-1 axis" if size <= 1 else ""))
        return len(self.parent) - 1

    def find(self, a: int) -> int:
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def join(self, a: int, b: int) -> int:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
            self.whole[ra] = self.whole[ra] or self.whole[rb]
        return ra

    def mark(self, a: int, why: str) -> None:
        r = self.find(a)
        self.whole[r] = self.whole[r] or why


Dims = tuple[int, ...]  # one label per dimension of a node
PARTIAL = "partial"  # an output summed over a sharded axis: each piece holds a partial sum


@dataclass(frozen=True)
class Sharding:
    """The shardable axes of one graph: per input and output, the dimension each axis is on.

    ``ways`` lists, per shardable axis, the dimension of each input (``None``: the input does
    not have it, or is a python number, so it is replicated) and of each output; ``whole``
    says, per input dimension, why it cannot be sharded (``""`` when it can).
    """

    #: (outputs, inputs): an output's entry is its dimension, None, or PARTIAL (a sum over the axis)
    ways: tuple[tuple[tuple[int | str | None, ...], tuple[int | None, ...]], ...]
    whole: tuple[tuple[str, ...], ...]  # per input, per dimension


def axes_of(n: Expr, rank: int) -> tuple[int, ...]:
    axis = n.attr("axis")
    if axis is None:
        return tuple(range(rank))
    axes = axis if isinstance(axis, tuple) else (axis,)
    return tuple(a % rank for a in axes) if rank else ()


def _broadcast(lb: _Labels, n: Expr, shape: tuple[int, ...], srcs: list[tuple[Dims, tuple[int, ...]]]) -> Dims:
    out = []
    for j, size in enumerate(shape):
        back = len(shape) - j
        label = None
        for dims, sshape in srcs:
            k = len(sshape) - back
            if k >= 0 and sshape[k] == size:
                label = dims[k] if label is None else lb.join(label, dims[k])
        out.append(lb.fresh(size) if label is None or size <= 1 else label)
    return tuple(out)


def _reduce(lb: _Labels, n: Expr, shape: tuple[int, ...], srcs: list[tuple[Dims, tuple[int, ...]]]) -> Dims:
    dims, sshape = srcs[0]
    axes = axes_of(n, len(sshape))
    partial = REGISTRY[n.op].reduce
    for a in axes:
        if partial is not None and partial.partial == "sum":
            lb.summed.append((dims[a], n))
        else:
            lb.mark(dims[a], f"reduced by {n.op}")
    if n.attr("keepdim"):
        return tuple(lb.fresh(1) if a in axes else d for a, d in enumerate(dims))
    return tuple(d for a, d in enumerate(dims) if a not in axes)


def _contract(lb: _Labels, n: Expr, shape: tuple[int, ...], srcs: list[tuple[Dims, tuple[int, ...]]]) -> Dims:
    """``A @ B``: batch dims line up (broadcast), A's rows and B's columns pass through, and the
    contracted axis (with the batch dims under ``sum_batch``) is *summed*: split, each piece's
    product is a partial sum of the whole (Partial(sum) where it is an output)."""
    (a, sa), (b, sb) = srcs
    am, ak = (a[-1], a[-2]) if n.attr("ta") else (a[-2], a[-1])
    bk, bn = (b[-1], b[-2]) if n.attr("tb") else (b[-2], b[-1])
    k = lb.join(ak, bk)
    lb.summed.append((k, n))
    rank = max(len(sa), len(sb)) - 2
    batch = []
    for j in range(rank):
        back = rank - j
        labels = [dims[len(sh) - 2 - back] for dims, sh in ((a, sa), (b, sb)) if len(sh) - 2 - back >= 0]
        sizes = [sh[len(sh) - 2 - back] for _, sh in ((a, sa), (b, sb)) if len(sh) - 2 - back >= 0]
        big = [lab for lab, size in zip(labels, sizes) if size > 1]
        label = big[0] if big else labels[0]
        for other in big[1:]:
            label = lb.join(label, other)
        for lab, size in zip(labels, sizes):
            if size <= 1 and big:
                lb.mark(lab, "broadcast against a longer batch dim")
        batch.append(label)
    if n.attr("sum_batch"):
        for label in batch:
            lb.summed.append((label, n))
        return (am, bn)
    return (*batch, am, bn)


def _along_axis(lb: _Labels, n: Expr, shape: tuple[int, ...], srcs: list[tuple[Dims, tuple[int, ...]]]) -> Dims:
    """slice, unslice, flip, cat, select: the named axis is re-indexed, the others pass through."""
    why = f"re-indexed by {n.op}"
    rank = len(srcs[0][1])
    axes = axes_of(n, rank)
    kept = [a for a in range(rank) if a not in axes or len(shape) == rank]
    out = [lb.fresh(shape[j], why if kept[j] in axes else "") for j in range(len(shape))]
    for dims, _ in srcs:
        for a in axes:
            lb.mark(dims[a], why)
        for j, a in enumerate(kept):
            out[j] = lb.join(out[j], dims[a])
    return tuple(out)


def _gather(lb: _Labels, n: Expr, shape: tuple[int, ...], srcs: list[tuple[Dims, tuple[int, ...]]]) -> Dims:
    """torch.gather: the output is shaped like the index; other axes line up where sizes agree.
    Along the gathered axis the input is read whole and the index's elements are independent: the
    index (and the output) may be split there."""
    (xd, xs), (idx, _) = srcs
    axis = n.attr("axis") % max(len(xs), 1)
    out = []
    for j, size in enumerate(shape):
        if j == axis:
            lb.mark(xd[j], f"re-indexed by {n.op}")
            out.append(idx[j])
        elif xs[j] != size:  # the output is the index's shape: its axis, read at the input's first positions
            lb.mark(xd[j], f"re-indexed by {n.op}")
            lb.mark(idx[j], f"re-indexed by {n.op}")
            out.append(idx[j])
        else:
            out.append(lb.join(xd[j], idx[j]))
    return tuple(out)


def _unsqueeze(lb: _Labels, n: Expr, shape: tuple[int, ...], srcs: list[tuple[Dims, tuple[int, ...]]]) -> Dims:
    new = {a % len(shape) for a in n.attr("axes")}
    rest = iter(srcs[0][0])
    return tuple(lb.fresh(1) if j in new else next(rest) for j in range(len(shape)))


def _positions(lb: _Labels, n: Expr, shape: tuple[int, ...], srcs: list[tuple[Dims, tuple[int, ...]]]) -> Dims:
    """arange_like, rand_like: values tied to the full extent of every axis."""
    return tuple(lb.fresh(size, f"tied to positions or sizes by {n.op}") for size in shape)


def _sizes(lb: _Labels, n: Expr, shape: tuple[int, ...], srcs: list[tuple[Dims, tuple[int, ...]]]) -> Dims:
    """expand: sizes baked in, so every axis of the operand and the result stays whole."""
    for d in srcs[0][0]:
        lb.mark(d, f"tied to positions or sizes by {n.op}")
    return _positions(lb, n, shape, srcs)


Rule = Callable[[_Labels, Expr, tuple[int, ...], list[tuple[Dims, tuple[int, ...]]]], Dims]


def _opaque(lb: _Labels, n: Expr, shape: tuple[int, ...], srcs: list[tuple[Dims, tuple[int, ...]]]) -> Dims:
    for dims, _ in srcs:
        for d in dims:
            lb.mark(d, f"re-indexed by {n.op}")
    return tuple(lb.fresh(size, f"re-indexed by {n.op}") for size in shape)


#: how each kind of movement op labels its axes (``OpDef.axes``)
MOVEMENT: dict[AxisRule, Rule] = {
    AxisRule.OPAQUE: _opaque,
    AxisRule.VIEW: _unsqueeze,
    AxisRule.ALONG_AXIS: _along_axis,
    AxisRule.GATHER: _gather,
    AxisRule.POSITIONS: _positions,
    AxisRule.RANDOM: _positions,
    AxisRule.SIZES: _sizes,
}


def axis_labels(graph: Graph, follow_positions: bool = False) -> tuple[_Labels, dict[Expr, Dims]]:
    """Each node's axis labels (keyed by the node). ``follow_positions``: positions and ``expand`` line
    up with their operand's axes (a piece of them is the positions or sizes of a piece, given its
    offset): what running a graph in pieces along an axis asks (``lower.pieces``)."""
    lb = _Labels()
    dims: dict[Expr, Dims] = {}
    for v in graph.inputs:
        info = graph.of(v)
        dims[v] = () if info.is_scalar else tuple(lb.fresh(s) for s in info.shape)
    for n in graph.nodes:
        if n in dims:
            continue
        info = graph.of(n)
        kind = REGISTRY[n.op].kind
        srcs = [(dims[s], graph.of(s).shape) for s in n.srcs if not graph.of(s).is_scalar]
        if kind is OpKind.SCALAR:  # a count of reduced elements: those axes stay whole
            if srcs:
                for a in axes_of(n, len(srcs[0][1])):
                    lb.mark(srcs[0][0][a], f"counted by {n.op}")
            dims[n] = ()
        elif info.is_scalar or kind is OpKind.LEAF:
            dims[n] = tuple(lb.fresh(s) for s in info.shape)
        elif kind is OpKind.REDUCTION:
            dims[n] = _reduce(lb, n, info.shape, srcs)
        elif kind is OpKind.MOVEMENT:
            axes = REGISTRY[n.op].axes
            following = follow_positions and srcs and axes in (AxisRule.POSITIONS, AxisRule.RANDOM, AxisRule.SIZES)
            rule = _broadcast if following else MOVEMENT[axes]
            dims[n] = rule(lb, n, info.shape, srcs)
        elif kind is OpKind.CONTRACTION:
            dims[n] = _contract(lb, n, info.shape, srcs)
        else:
            dims[n] = _broadcast(lb, n, info.shape, srcs)
    return lb, dims


def sharding(graph: Graph) -> Sharding:
    """The shardable axes of ``graph`` (typed for the full, unsharded inputs)."""
    lb, dims = axis_labels(graph)
    partial = _partial_outputs(graph, lb)
    ins = [tuple(lb.find(d) for d in dims[v]) for v in graph.inputs]
    outs = [tuple(lb.find(d) for d in dims[p]) for _, p in graph.outputs]
    tensors = [*outs, *ins]
    ways, why = [], {}
    for label in sorted({d for t in ins for d in t}):
        if label in partial and partial[label] is None:
            why[label] = "reduced by sum"
        elif lb.whole[label]:
            why[label] = lb.whole[label]
        elif any(t.count(label) > 1 for t in tensors):
            why[label] = "the same axis twice in one tensor"
        elif not any(label in t for t in outs) and label not in partial:
            why[label] = "in no output"
        else:
            sums = partial.get(label) or set()
            where = tuple(t.index(label) if label in t else None for t in tensors)
            out = tuple(PARTIAL if k in sums else d for k, d in enumerate(where[: len(outs)]))
            ways.append((out, where[len(outs) :]))
    return Sharding(tuple(ways), tuple(tuple(why.get(d, "") for d in t) for t in ins))


def _partial_outputs(graph: Graph, lb: _Labels) -> dict[int, set[int] | None]:
    """Per summed axis: the outputs holding its sums, or None when some sum is used inside the kernel."""
    users: dict[Expr, list[Expr]] = {}
    for n in graph.nodes:
        for s in n.srcs:
            users.setdefault(s, []).append(n)
    roots = {p: k for k, (_, p) in enumerate(graph.outputs)}

    def output_of(n: Expr) -> int | None:  # the output ``n`` is, through casts only
        while n not in roots:
            used = users.get(n, [])
            if len(used) != 1 or REGISTRY[used[0].op].rule is not DtypeRule.CAST:
                return None
            n = used[0]
        return None if users.get(n) else roots[n]

    found: dict[int, set[int] | None] = {}
    for label, n in lb.summed:
        root = lb.find(label)
        k = output_of(n)
        if k is None or root in found and found[root] is None:
            found[root] = None
        else:
            found.setdefault(root, set()).add(k)  # type: ignore[union-attr]
    return found
