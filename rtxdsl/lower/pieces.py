"""Pieces: a graph run piece by piece along one axis, its reductions over that axis merged after.

A kernel whose input is split along an axis that the kernel reduces (a sum, max, min or
logsumexp over it: the vocabulary of a cross-entropy, the tokens of its mean) need not gather
that axis. Each piece computes those reductions over its own part, with positions along the axis
offset by where the piece starts; the pieces' values are stacked; a second kernel reduces each
stack by the same op (a sum of sums, a logsumexp of logsumexps) and computes the rest. This is
Megatron's vocabulary-parallel cross-entropy, derived for any graph of that shape;
``rtxdsl.dtensor`` runs it across ranks with an all-gather of the per-row values in between.

A graph runs in pieces when every node holding the axis is one a piece computes alone
(elementwise math, reductions over other axes, products that do not contract it, size-1
insertions, ``expand`` to the piece's size, positions, movement along other axes) and nothing
after a reduction over the axis holds it again: a softmax over it would need the merged value
back in the piece (three passes, not two). Positions along the axis read after the merge (the
range check of cross-entropy's target) are taken from a stand-in of the full shape, never loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..expr import Expr, node
from ..ops import REGISTRY, AxisRule, OpKind
from .analyze import positions_only, read_srcs
from .expand import Graph
from .shard import axes_of, axis_labels

#: movement ops a piece computes alone (``OpDef.axes``): views; ops re-indexing their ``axis``
#: attribute, which must not be the split one; positions (shifted by the piece's start along the
#: split axis); ``expand`` (to the piece's size). Random numbers and opaque re-indexing are not.
PIECEWISE = (AxisRule.VIEW, AxisRule.ALONG_AXIS, AxisRule.GATHER, AxisRule.POSITIONS, AxisRule.SIZES)


@dataclass(frozen=True)
class Stand:
    """An input of the merge kernel: a stack of the pieces' values of a reduction, or a stand-in
    of a split node's full shape (its positions are read, no value)."""

    name: str
    shape: tuple[int, ...]  # a stack's shape without its leading pieces axis
    dtype: torch.dtype


@dataclass(frozen=True)
class Pieces:
    """How ``graph`` runs in pieces along one axis (see the module docstring).

    ``dims``: per input, its dimension on the axis (None: the input does not hold it; each piece
    reads it whole). ``local``: the outputs each piece computes (its part of them), with their
    dimension on the axis; ``merged``: the outputs the merge kernel computes from the stacks.
    """

    graph: Graph
    dims: tuple[int | None, ...]
    local: tuple[tuple[str, int], ...]
    merged: tuple[str, ...]
    offset: str  # the piece kernel's input holding where its piece starts along the axis
    stacks: tuple[Stand, ...]  # per reduction over the axis, in ``cuts`` order
    stand_ins: tuple[Stand, ...]
    cuts: tuple[Expr, ...]
    held: dict[Expr, int]  # node -> its dimension on the axis, for every node holding it
    shape_of: dict[Expr, str]  # node -> the stand-in standing for it in the merge kernel

    def piece(self, size: int) -> dict[str, Expr]:
        """The outputs of the kernel computing a piece ``size`` long along the axis: each
        reduction over the axis (named as its stack) and the local outputs."""
        offset = node("var", name=self.offset, dtype=None)
        built: dict[Expr, Expr] = {}
        for n in self.graph.nodes:  # operands first
            attrs = n.attr_dict
            how, d = REGISTRY[n.op].axes, self.held.get(n)
            if how is AxisRule.SIZES and d is not None:
                attrs["shape"] = tuple(size if k == d else s for k, s in enumerate(attrs["shape"]))
            got = Expr(n.op, tuple(built[s] for s in n.srcs), attrs)
            built[n] = node("add", got, offset) if how is AxisRule.POSITIONS and d is not None else got
        roots = dict(self.graph.outputs)
        return {s.name: built[c] for s, c in zip(self.stacks, self.cuts)} | {
            name: built[roots[name]] for name, _ in self.local
        }

    def merge(self) -> dict[str, Expr]:
        """The outputs of the kernel merging the stacks (inputs: the stacks, the stand-ins and the
        kernel's inputs that do not hold the axis)."""
        stacks = {c: s.name for s, c in zip(self.stacks, self.cuts)}
        built: dict[Expr, Expr] = {}

        def merged(c: Expr) -> Expr:  # a reduction's value of the whole, from its pieces'
            stack = node("var", name=stacks[c], dtype=None)
            beside = REGISTRY[c.op].reduce.merged_with
            if beside is None:
                return node(c.op, stack, axis=(0,), keepdim=False)
            twin = _twin(c, self.cuts)
            return beside[1](stack, node("var", name=stacks[twin], dtype=None), merged(twin))

        for n in self.graph.nodes:
            if n in stacks:
                built[n] = merged(n)
                continue
            skip = REGISTRY[n.op].shape_only
            srcs = tuple(
                node("var", name=self.shape_of[s], dtype=None) if j in skip and s in self.shape_of
                else built[s]
                for j, s in enumerate(n.srcs)
            )  # fmt: skip
            built[n] = Expr(n.op, srcs, n.attr_dict)
        roots = dict(self.graph.outputs)
        return {name: built[roots[name]] for name in self.merged}


def pieces(graph: Graph, k: int, dim: int) -> Pieces | str:
    """``graph`` run in pieces along dimension ``dim`` of its input ``k``, or why it cannot be."""
    lb, dims = axis_labels(graph, follow_positions=True)
    axis = lb.find(dims[graph.inputs[k]][dim])
    held = {}
    for n in graph.nodes:
        found = [d for d, lab in enumerate(dims.get(n, ())) if lb.find(lab) == axis]
        if len(found) > 1:
            return f"{n.op} holds the axis twice"
        if found:
            held[n] = found[0]
    cuts = [n for n in graph.nodes if _reduces(n, held, graph)]
    why = _piece_side(graph, held, set(cuts))  # (first: softmax's total is such a value too)
    if why:
        return why
    for c in cuts:
        spec = REGISTRY[c.op].reduce
        if spec is not None and spec.merged_with is not None:
            if _twin(c, cuts) is None:
                return f"{c.op} over the axis merges beside its {spec.merged_with[0]}, which is not computed"
        elif spec is None or not spec.of_values:
            return f"{c.op} over the axis does not merge from its pieces' values"
    shape_of: dict[Expr, str] = {}
    why = _merge_side(graph, held, set(cuts), shape_of)
    if why:
        return why
    taken = {v.attr("name") for v in graph.inputs}
    offset = _fresh("offset", taken)
    stacks = tuple(Stand(_fresh(f"part{j}", taken), graph.of(c).shape, graph.of(c).dtype) for j, c in enumerate(cuts))
    stand_ins = []
    for n in graph.nodes:
        if n in shape_of:
            shape_of[n] = _fresh(f"shape{len(stand_ins)}", taken)
            stand_ins.append(Stand(shape_of[n], graph.of(n).shape, graph.of(n).dtype))
    local = tuple((name, held[root]) for name, root in graph.outputs if root in held)
    merged = tuple(name for name, root in graph.outputs if root not in held)
    return Pieces(
        graph=graph,
        dims=tuple(held.get(v) for v in graph.inputs),
        local=local,
        merged=merged,
        offset=offset,
        stacks=stacks,
        stand_ins=tuple(stand_ins),
        cuts=tuple(cuts),
        held=held,
        shape_of=shape_of,
    )


def _twin(c: Expr, cuts: list[Expr] | tuple[Expr, ...]) -> Expr | None:
    """The reduction among ``cuts`` whose pieces ``c``'s merge beside (``ReduceSpec.merged_with``), or None."""
    op = REGISTRY[c.op].reduce.merged_with[0]
    return next((t for t in cuts if t.op == op and t.srcs[0] is c.srcs[0] and t.attrs == c.attrs), None)


def _reduces(n: Expr, held: dict[Expr, int], graph: Graph) -> bool:
    """Is ``n`` a reduction over the axis (its operand holds it there)?"""
    if REGISTRY[n.op].kind is not OpKind.REDUCTION or n.srcs[0] not in held:
        return False
    return held[n.srcs[0]] in axes_of(n, len(graph.of(n.srcs[0]).shape))


def _piece_side(graph: Graph, held: dict[Expr, int], cuts: set[Expr]) -> str:
    """Why a piece cannot compute the reductions over the axis and the outputs holding it ("": it can)."""
    roots = [n for n in graph.nodes if n in cuts] + [r for _, r in graph.outputs if r in held]
    seen: set[Expr] = set()
    stack = [s for r in roots for s in (r.srcs if r in cuts else (r,))]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in cuts:
            return f"a value of the whole axis ({n.op} over it) is needed inside a piece"
        why = _piecewise(n, held, graph) if n in held else _reads_held(n, held)
        if why:
            return why
        stack.extend(n.srcs)
    return ""


def _piecewise(n: Expr, held: dict[Expr, int], graph: Graph) -> str:
    """Why ``n``, holding the axis, is not computed by a piece alone ("": it is)."""
    op = REGISTRY[n.op]
    if op.kind is OpKind.MOVEMENT:
        if op.axes not in PIECEWISE:
            return f"{n.op} along the axis"
        if op.axes in (AxisRule.ALONG_AXIS, AxisRule.GATHER) and any(
            s in held and held[s] in axes_of(n, len(graph.of(s).shape)) for s in read_srcs(n)[:1]
        ):
            return f"{n.op} re-indexes the axis"
        if op.axes is AxisRule.GATHER and held[n] not in axes_of(n, len(graph.of(n).shape)):
            if held.get(n.srcs[0]) != held[n]:  # a piece would read the input at its own positions
                return f"{n.op} reads its input at the positions of the axis"
    elif op.kind is OpKind.CONTRACTION:
        a = n.srcs[0]
        k_dim = len(graph.of(a).shape) - (2 if n.attr("ta") else 1)
        if held.get(a) == k_dim:
            return f"{n.op} contracts the axis"
    return ""


def _reads_held(n: Expr, held: dict[Expr, int]) -> str:
    """A node without the axis computed in a piece may take only a shape from one holding it."""
    if any(s in held for s in read_srcs(n)):
        return f"{n.op} reads along the axis without keeping it"
    return ""


def _merge_side(graph: Graph, held: dict[Expr, int], cuts: set[Expr], shape_of: dict[Expr, str]) -> str:
    """Why the merge kernel cannot compute the outputs without the axis ("": it can); fills
    ``shape_of`` with the nodes holding the axis whose shape (positions) it reads."""
    seen: set[Expr] = set()
    stack = [r for _, r in graph.outputs if r not in held]
    while stack:
        n = stack.pop()
        if n in seen or n in cuts:
            continue
        seen.add(n)
        if n in held and not positions_only(n):
            return f"{n.op} needs the whole axis after its reductions"
        skip = REGISTRY[n.op].shape_only
        for j, s in enumerate(n.srcs):
            if j in skip and s in held:
                shape_of[s] = ""
            else:
                stack.append(s)
    return ""


def _fresh(base: str, taken: set[str]) -> str:
    name = base
    while name in taken:
        name += "_"
    taken.add(name)
    return name
