"""Plans cached by structure: a known graph at new sizes reuses its fusion groups.

The analyzer reads sizes only through their relations: whether two dims (or shapes) are equal,
whether a dim is 1 or 0, whether a shape broadcasts to another. Its one exception is the GEMM
prologue's cost model (``prologue.choose``), which weighs bytes. So the *structure* of a bound
graph (every node's op, attrs, dtype and operands, each dim replaced by the position where its
size first appears) determines its plan, provided sizes that equal 0, 1 or any integer the graph
holds (an attr: an axis, a bound, a shape; an int constant) stay themselves, so that no relation
between a size and those integers can change unseen. A graph with a contraction is analyzed anew at every size.

A cached plan is translated to the new graph: nodes by position (the same structure walks in the
same order), each group's domain size by size. A call at a new batch size of a known layout then
binds and expands its expressions (shapes and folded constants change) but skips the analysis.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from ..config import FusionConfig
from ..expr import Expr
from ..lru import LRU
from ..ops import REGISTRY, OpKind
from .analyze import Group, Plan, analyze
from .expand import Graph

#: plans kept, least recently used evicted first (an entry holds one graph of each structure)
CAPACITY = 256
_PLANS: LRU[tuple, Plan] = LRU(CAPACITY)


def plan_of(graph: Graph, config: FusionConfig) -> Plan:
    """The analyzer's plan for ``graph``: a cached one translated when a graph of the same
    structure was analyzed before (see the module docstring), else a new analysis."""
    if not cacheable(graph):
        return analyze(graph, config)
    key = (structure(graph), config)
    cached = _PLANS.get(key)
    if cached is not None:
        return cached if cached.graph is graph else translated(cached, graph)
    plan = analyze(graph, config)
    _PLANS.put(key, plan)
    return plan


def cacheable(graph: Graph) -> bool:
    """Is ``graph``'s plan a function of its structure? Not with a contraction: the GEMM prologue's
    cost model weighs bytes, so sizes matter beyond their relations."""
    return not any(REGISTRY[n.op].kind is OpKind.CONTRACTION for n in graph.nodes)


def reused() -> int:
    """Plans served from the cache since the last :func:`clear` (the analyzer did not run)."""
    return _PLANS.hits


def clear(reset_count: bool = True) -> None:
    """Forget every cached plan (``rx.clear_cache()`` calls it), the count too unless told not to."""
    _PLANS.clear()
    if reset_count:
        _PLANS.hits = _PLANS.misses = _PLANS.evictions = 0


def structure(graph: Graph) -> Hashable:
    """``graph`` up to its sizes (those the analyzer only compares), as a hashable key."""
    literal = _integers(graph)
    symbols: dict[int, int] = {}

    def dim(s: int) -> Hashable:
        if s in literal:
            return s
        return ("d", symbols.setdefault(s, len(symbols)))

    position = {n: k for k, n in enumerate(graph.nodes)}
    # which nodes one composite wrote (``Graph.ops`` counts them once): its first node's position
    first: dict[Expr, int] = {}
    for k, n in enumerate(graph.nodes):
        if n in graph.written:
            first.setdefault(graph.written[n], k)
    nodes = tuple(
        (
            n.op,
            n.attrs,
            _scalar(graph, n),
            tuple(position[s] for s in n.srcs),
            tuple(dim(s) for s in graph.of(n).shape),
            graph.origin.get(n),
            first.get(graph.written.get(n)),
        )
        for n in graph.nodes
    )
    outputs = tuple((key, position[e]) for key, e in graph.outputs)
    return (nodes, outputs, tuple(position.get(v) for v in graph.inputs))


def _scalar(graph: Graph, n: Expr) -> Hashable:
    """A node's type: a tensor's dtype; a scalar's value (a folded constant) or, for a scalar known
    only at call time, its python type."""
    info = graph.of(n)
    if not info.is_scalar:
        return info.dtype
    return type(info.value).__name__ if info.symbolic else (type(info.value).__name__, info.value)


def _integers(graph: Graph) -> frozenset[int]:
    """0, 1 and every integer an attr or a folded constant of ``graph`` holds (floats are values
    the analyzer never compares with a size: they stay in the key, not among these)."""
    found: set[int] = {0, 1}
    for n in graph.nodes:
        _collect(n.attrs, found)
        info = graph.of(n)
        if info.is_scalar and not info.symbolic:
            _collect(info.value, found)
    return frozenset(found)


def _collect(value: Any, found: set[int]) -> None:
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        found.add(abs(value))
    elif isinstance(value, (tuple, list, frozenset)):
        for v in value:
            _collect(v, found)


def translated(plan: Plan, graph: Graph) -> Plan:
    """``plan`` (for a graph of ``graph``'s structure) over ``graph``'s nodes and sizes."""
    old = plan.graph
    node_of = {a: b for a, b in zip(old.nodes, graph.nodes)}
    size_of: dict[int, int] = {}
    for a, b in zip(old.nodes, graph.nodes):
        size_of.update(zip(old.of(a).shape, graph.of(b).shape))

    def at(nodes: Iterable[Expr]) -> tuple[Expr, ...]:
        return tuple(node_of[n] for n in nodes)

    def group(g: Group) -> Group:
        return replace(
            g,
            shape=tuple(size_of[s] for s in g.shape),
            nodes=at(g.nodes),
            roles=MappingProxyType({node_of[k]: role for k, role in g.roles.items()}),
            inputs=at(g.inputs),
            outputs=at(g.outputs),
            cone=at(g.cone),
        )

    return Plan(tuple(group(g) for g in plan.groups), graph)
