"""Pass 7: what each kernel reads and writes, its pattern, and a launch order."""

from __future__ import annotations

import graphlib
from types import MappingProxyType

from ...expr import Expr
from ...ops import REGISTRY, Pattern
from ..expand import Graph, is_leaf
from ..roles import Role
from .flow import Flow
from .groups import POINTWISE, Group, Plan, consumers_of, exact_shape, order_of, writers_of


def finish(graph: Graph, fl: Flow, groups: tuple[Group, ...]) -> Plan:
    requested = {e for _, e in graph.outputs}
    consumers = consumers_of(graph, fl)
    groups = _own_kernels_for_broadcast_values(graph, groups, requested, consumers)
    homes = writers_of(graph, groups)
    members = [set(g.nodes) for g in groups]
    # a node's readers: the kernels computing it, as a member or in a cone (recomputed at a view's
    # coordinates, from what that kernel computes or loads); what a cone reads it computes or loads
    computing = [members[i] | set(g.cone) for i, g in enumerate(groups)]
    containing: dict[Expr, list[int]] = {}
    for i, ms in enumerate(computing):
        for m in ms:
            containing.setdefault(m, []).append(i)
    done: list[Group] = []
    for i, g in enumerate(groups):
        # written by its home group when requested, or read by a kernel that does not compute it
        outputs = tuple(
            m
            for m in g.nodes
            if homes[m] == i
            and (m in requested or any(m not in computing[j] for c in consumers.get(m, ()) for j in containing[c]))
        )
        seen = set(g.cone)  # free nodes: recomputed here, never read
        inputs: list[Expr] = []
        for m in (*g.cone, *g.nodes):
            for s in fl.reads[m]:
                tensor = not graph.of(s).is_scalar and (s.is_var or not is_leaf(s, graph.info))
                if tensor and s not in members[i] and s not in seen:
                    seen.add(s)
                    inputs.append(s)
        cone = set(g.cone)
        todo = [*g.nodes, *g.cone]
        while todo:  # the cones of re-indexing nodes, and of those inside them (free nodes absorbed too)
            for c in fl.cones.get(todo.pop(), ()):
                if c not in cone:
                    cone.add(c)
                    todo.append(c)
        order = order_of(graph)
        done.append(
            Group(
                g.shape,
                g.axes,
                g.nodes,
                g.roles,
                tuple(inputs),
                outputs,
                _pattern(g, graph),
                tuple(sorted(cone, key=lambda c: order[c])),
                g.notes,
                g.chunk,
            ),
        )
    return Plan(_topo(done, homes), graph)


def _own_kernels_for_broadcast_values(
    graph: Graph, groups: tuple[Group, ...], requested: set[Expr], consumers: dict[Expr, list[Expr]]
) -> tuple[Group, ...]:
    """A value that must be written (requested, or read by a kernel that does not compute it) but
    that every kernel computing it computes broadcast (a smaller elementwise or movement value
    recomputed at a row kernel's larger shape) gets a pointwise kernel of its own, recomputing it
    from what that kernel read: a kernel writes only values of its own domain."""
    order = order_of(graph)
    members = [set(g.nodes) for g in groups]
    extra: list[Group] = []
    for gi, g in enumerate(groups):
        for m in g.nodes:
            if graph.of(m).shape == exact_shape(g, m) or REGISTRY[m.op].kind not in POINTWISE:
                continue
            homes = [i for i, ms in enumerate(members) if m in ms]
            if any(graph.of(m).shape == exact_shape(groups[i], m) for i in homes):
                continue
            # read by a kernel that does not compute it (a GEMM's prologue reading it beside a home)
            readers = consumers.get(m, ())
            needed = m in requested or any(m not in ms for c in readers for ms in members if c in ms)
            if not needed or any(any(x is m for x in e.nodes) for e in extra):
                continue
            cone = [m]  # its elementwise producers in this kernel, recomputed beside it
            stack = list(m.srcs)
            while stack:
                x = stack.pop()
                if x in members[gi] and all(x is not c for c in cone):
                    if REGISTRY[x.op].kind not in POINTWISE:
                        break
                    cone.append(x)
                    stack.extend(x.srcs)
            else:
                nodes = tuple(sorted(cone, key=lambda n: order[n]))
                roles = MappingProxyType({n: Role.FULL for n in nodes})
                extra.append(Group(graph.of(m).shape, (), nodes, roles, pattern=Pattern.ELEMENTWISE_CHAIN))
    return (*groups, *extra)


def _pattern(g: Group, graph: Graph) -> Pattern:
    """The first pattern, in ``Pattern``'s order, of the ops the group holds."""
    labels = {graph.origin[m] for m in g.nodes if m in graph.origin}
    names = {REGISTRY[o].pattern for o in labels} | {REGISTRY[m.op].pattern for m in g.nodes}
    if len(g.nodes) >= 2:
        names.add(Pattern.ELEMENTWISE_CHAIN)
    names.add(Pattern.SINGLE)
    if g.is_row:
        names.discard(Pattern.ACTIVATION)
        names.discard(Pattern.CONTRACTION)  # a product reduced in tiles: named by what it reduces to
    return next(p for p in Pattern if p in names)


def _topo(groups: list[Group], homes: dict[Expr, int]) -> tuple[Group, ...]:
    """Launch order: every group after the groups whose outputs it reads."""
    deps = {i: {homes[s] for s in g.inputs if s in homes} - {i} for i, g in enumerate(groups)}
    return tuple(groups[i] for i in graphlib.TopologicalSorter(deps).static_order())
