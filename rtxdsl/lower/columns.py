"""Column reductions computed by a row kernel: a norm's weight gradient in its input gradient's pass.

A backward over rows (``dx`` of a layer or RMS norm, its per-row sums) is followed by reductions
over those rows (``dw = sum(dy * xhat, axis=0)``, ``db = sum(dy, axis=0)``) of values the row
kernel has at hand. As kernels of their own they read ``x`` and ``dy`` again: half again the
backward's traffic. Instead the row kernel takes their cones (role "column"): each of its
programs loops over blocks of rows (``schedule.column_programs`` of them), merges the column
reductions' lanes across its rows and stores one partial state per column; the column group's
own kernel becomes a merge of those states (``Split.MERGE``), in a fixed order (deterministic).
Liger-Kernel's RMSNorm and LayerNorm backward kernels accumulate their weight gradients so.

This is a choice of the program, not of the plan: whether the row kernel keeps its rows whole
(the lanes span a row) depends on the sizes, and plans are cached by structure.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

from ..expr import Expr
from ..ops import REGISTRY, OpKind
from .analyze import Group, Plan
from .expand import Graph
from .roles import Role


def _cone(b: Group) -> list[Expr] | None:
    """The column group's reductions and the elementwise nodes they read (its nodes after them,
    per column, stay with the merge), or None where a row kernel could not compute them: a
    movement op, a reduction whose state has no column form, or one reading another."""
    members = set(b.nodes)
    reductions = [n for n in b.nodes if REGISTRY[n.op].kind is OpKind.REDUCTION]
    if not reductions or any(REGISTRY[r.op].reduce.columns is None for r in reductions):
        return None
    cone: dict[Expr, Expr] = {}
    stack = [s for r in reductions for s in r.srcs]
    while stack:
        n = stack.pop()
        if n not in members or n in cone:
            continue
        if REGISTRY[n.op].kind is not OpKind.ELEMENTWISE:  # a reduction read by another, a movement op
            return None
        cone[n] = n
        stack += n.srcs
    keep = set(cone) | set(reductions)
    return [n for n in b.nodes if n in keep]


def _merge_reads_elements(b: Group) -> bool:
    """Would the merge of ``b``'s partial states compute a value of every element (role "full"),
    which it has no coordinates for: a node between its outputs and its reductions (``sum(g * b,
    0) + g`` with ``g`` a broadcast cotangent, read per element by the product the row kernel
    computes: a lazy program's backward crashed in codegen)?"""
    members = set(b.nodes)
    stack, seen = [o for o in b.outputs if o in members], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if b.role(n) is Role.FULL:
            return True
        if REGISTRY[n.op].kind is not OpKind.REDUCTION:  # (a reduction: merged from its partial states)
            stack += [s for s in n.srcs if s in members]
    return False


def _fits(a: Group, b: Group) -> bool:
    """Is ``a`` a row kernel over ``b``'s domain that reduces exactly the dims ``b`` keeps (its
    last ones), with nothing but flat reads in either?"""
    rank = len(a.shape)
    plain = all(not g.remaps and g.contraction is None and g.chunk is None for g in (a, b))
    return (
        plain
        and a.is_row
        and b.is_row
        and a.shape == b.shape
        and set(a.axes) | set(b.axes) == set(range(rank))
        and not set(a.axes) & set(b.axes)
        and a.axes == tuple(range(rank - len(a.axes), rank))
    )


def column_pairs(plan: Plan) -> dict[int, int]:
    """Column group index -> the index of the row group that computes its reductions' partial
    states: an earlier row kernel over the same domain reducing the dims it keeps, reading every
    value the column group reads or computing it (so it loads nothing more), and the column
    group's outputs one per column. (A pointwise kernel before a column reduction of its values,
    a bias gradient's, is already one kernel: the column kernel stores them as it reduces.)"""
    pairs: dict[int, int] = {}
    for bi, b in enumerate(plan.groups):
        if _cone(b) is None or any(b.role(o) is Role.FULL for o in b.outputs) or _merge_reads_elements(b):
            continue
        for ai in range(bi - 1, -1, -1):
            a = plan.groups[ai]
            if ai in pairs.values() or not _fits(a, b):
                continue
            known = set((*a.inputs, *a.nodes))
            if all(i in known for i in b.inputs):
                pairs[bi] = ai
                break
    return pairs


def with_columns(a: Group, b: Group, graph: Graph) -> Group:
    """Row group ``a`` also computing the cones of ``b``'s column reductions (role "column"): their
    elementwise nodes per row (KEEP) where they are one value per row, else full-size. It reads
    nothing more (``column_pairs``)."""
    members = set(a.nodes)
    extra = [n for n in _cone(b) or () if n not in members]
    keep = a.keep_shape()

    def role(n: Expr) -> Role:
        if REGISTRY[n.op].kind is OpKind.REDUCTION:
            return Role.COLUMN
        return Role.KEEP if graph.of(n).shape == keep else Role.FULL

    roles = MappingProxyType({**a.roles, **{n: role(n) for n in extra}})
    return replace(a, nodes=(*a.nodes, *extra), roles=roles)
