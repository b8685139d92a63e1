"""Pass 3: math on leaves alone is recomputed in every kernel that reads it."""

from __future__ import annotations

from ...config import FusionConfig
from ...expr import Expr
from ...ops import REGISTRY
from ..expand import Graph
from .flow import Flow
from .groups import Group, Work, broadcasts, consumers_of, homes_of, order_of, per_row_role_of, re_indexes


def absorb_per_row(
    graph: Graph, fl: Flow, groups: tuple[Group, ...], config: FusionConfig, solo: frozenset[Expr]
) -> tuple[Group, ...]:
    """Math on leaves only (e.g. rstd from a saved variance) is recomputed in every kernel reading it.

    Such a group would otherwise be a launch of its own whose results are written and read
    back; its values broadcast to each reader's domain, per row (KEEP) where they fit. A reader
    that sees them only through views with size-1 dims inserted (``g[:, None]`` of a per-row
    cotangent) recomputes them at the view's coordinates (free nodes of a coordinate kernel).
    """
    requested = {e for _, e in graph.outputs}
    consumers = consumers_of(graph, fl)
    work = [Work.of(g) for g in groups]
    alive = [True] * len(work)
    for pi, p in enumerate(work):
        if p.is_row or p.contraction is not None or any(m in requested or m in solo for m in p.nodes):
            continue  # a GEMM is never recomputed
        homes = homes_of([w for w, ok in zip(work, alive) if ok])
        live = [w for w, ok in zip(work, alive) if ok]
        members = set(p.nodes)
        if any(s in homes and s not in members for m in p.nodes for s in fl.reads[m]):
            continue  # reads another kernel's output
        readers: dict[Work, Work] = {}
        for m in p.nodes:
            for c in consumers.get(m, ()):
                h = live[homes[c]]
                if h is not p:
                    readers[h] = h
        cap = config.max_fusion_ops

        def uses(r: Work) -> list[Expr]:
            inside = set(r.nodes)
            return [c for m in p.nodes for c in consumers.get(m, ()) if c in inside and c not in members]

        def plain(r: Work) -> bool:  # read by broadcasting (right-aligned): members of ``r``
            return broadcasts(p.shape, r.shape) and not any(REGISTRY[c.op].view for c in uses(r))

        def through_views(r: Work) -> bool:  # read through size-1 dims inserted: free nodes of ``r``
            return all(REGISTRY[c.op].view and broadcasts(graph.of(c).shape, r.shape) for c in uses(r))

        def gemm_operand(r: Work) -> bool:  # a GEMM reads its operands from memory, re-indexes nothing
            if r.contraction is None:
                return False
            return re_indexes(p) or not plain(r) or any(c is r.contraction for c in uses(r))

        if not readers or any(
            not (plain(r) or through_views(r)) or gemm_operand(r) or graph.ops(r.nodes + p.nodes) > cap
            for r in readers.values()
        ):
            continue
        for r in readers.values():
            r.free[:0] = p.free  # what p recomputed at views of its own operands, r recomputes too
            if not plain(r):
                r.free[:0] = p.nodes
                continue
            role = per_row_role_of(r, p.shape)
            for m in p.nodes:
                r.roles[m] = role
            r.nodes[:0] = p.nodes
        alive[pi] = False
    order = order_of(graph)
    return tuple(g.freeze(order) for g, ok in zip(work, alive) if ok)
