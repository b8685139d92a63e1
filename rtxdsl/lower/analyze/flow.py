"""Data flow through movement ops: what a node reads, and which nodes a re-indexing consumer recomputes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ...expr import Expr
from ...ops import REGISTRY, OpKind
from ..expand import Graph, is_leaf


def reindexes(n: Expr) -> bool:
    """A movement op a kernel evaluates by reading its operands at other coordinates."""
    op = REGISTRY[n.op]
    return op.kind is OpKind.MOVEMENT and not op.view


def read_srcs(n: Expr) -> tuple[Expr, ...]:
    """Operands whose values ``n`` reads (not those it takes only a shape from)."""
    skip = REGISTRY[n.op].shape_only
    return tuple(s for k, s in enumerate(n.srcs) if k not in skip) if skip else n.srcs


def positions_only(n: Expr) -> bool:
    """Is ``n`` made of positions alone (movement ops over an index-only op, no value read)?"""
    if REGISTRY[n.op].kind is not OpKind.MOVEMENT:
        return False
    reads = read_srcs(n)
    return len(reads) <= 1 and all(positions_only(s) for s in reads)


@dataclass(frozen=True)
class Flow:
    """What each grouped node needs, seen through movement ops.

    ``reads[n]``: the nodes whose values a kernel computing ``n`` must have (members of its
    group, or tensors it loads). For a re-indexing movement op these are the *boundaries* of
    its cone: leaves and reductions; the elementwise and movement nodes between them
    (``cones[n]``) are recomputed at the remapped coordinates. ``free``: nodes read only
    inside cones; no group computes them at their own coordinates.
    """

    reads: Mapping[Expr, tuple[Expr, ...]]
    cones: Mapping[Expr, tuple[Expr, ...]]
    free: frozenset[Expr]


def flow(graph: Graph) -> Flow:
    requested = {e for _, e in graph.outputs}
    leaf = {n for n in graph.nodes if is_leaf(n, graph.info)}
    readers: dict[Expr, list[Expr]] = {}
    for n in graph.nodes:
        if n not in leaf:
            for s in read_srcs(n):
                readers.setdefault(s, []).append(n)

    def _regrouped_output(c: Expr, n: Expr) -> bool:
        """An output that only regroups ``n`` (a reshape, same dtype): ``n``'s kernel writes the
        output's memory in the same order (``lower._output_views``), so ``n`` is computed, not
        recomputed at the output's coordinates by a kernel of the reshape's own."""
        return REGISTRY[c.op].regroups and c in requested and graph.of(c).dtype == graph.of(n).dtype

    free: set[Expr] = set()
    for n in reversed(graph.nodes):
        kind = REGISTRY[n.op].kind
        if n in leaf or n in requested or kind not in (OpKind.ELEMENTWISE, OpKind.MOVEMENT):
            continue
        if all((reindexes(c) and not _regrouped_output(c, n)) or c in free for c in readers.get(n, ())):
            free.add(n)
    reads: dict[Expr, tuple[Expr, ...]] = {}
    cones: dict[Expr, tuple[Expr, ...]] = {}
    for n in graph.nodes:
        if n in leaf:
            continue
        if not reindexes(n) or _regrouped_output(n, n.srcs[0]):
            reads[n] = read_srcs(n)
            continue
        cone: list[Expr] = []
        bounds: list[Expr] = []
        seen: set[Expr] = set()

        def visit(s: Expr) -> None:
            if s in seen:
                return
            seen.add(s)
            if s in leaf or REGISTRY[s.op].kind in (OpKind.REDUCTION, OpKind.CONTRACTION):
                bounds.append(s)
                return
            for x in read_srcs(s):
                visit(x)
            cone.append(s)

        for s in read_srcs(n):
            visit(s)
        reads[n], cones[n] = tuple(bounds), tuple(cone)
    return Flow(MappingProxyType(reads), MappingProxyType(cones), frozenset(free))
