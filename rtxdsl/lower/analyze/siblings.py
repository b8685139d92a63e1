"""Pass 2: independent groups over one domain become one kernel."""

from __future__ import annotations

from ...config import FusionConfig
from ...expr import Expr
from ..expand import Graph
from .flow import Flow
from .groups import (
    Group,
    Work,
    contractions_fit,
    group_reads,
    homes_of,
    index_reaches,
    order_of,
    two_products,
    views_of_inputs,
)
from .tiles import alone_in_rows


def merge_siblings(
    graph: Graph, fl: Flow, groups: tuple[Group, ...], config: FusionConfig, solo: frozenset[Expr]
) -> tuple[Group, ...]:
    """Independent groups over the same domain become one kernel (shared inputs read once): two
    over the same axes, or a pointwise group and a row kernel over its shape (which computes the
    pointwise values at every element beside its rows' reductions: attention's backward writes
    ``dO`` over the row sum in the kernel computing its row term)."""
    work = [Work.of(g) for g in groups]
    by_domain: dict[tuple, list[int]] = {}
    for i, g in enumerate(work):
        if not any(m in solo for m in g.nodes) and not views_of_inputs(g.nodes):
            by_domain.setdefault(g.shape, []).append(i)
    alive = [True] * len(work)
    homes = homes_of(work)
    reads = [group_reads(g, fl, homes, i) for i, g in enumerate(work)]
    # GEMMs whose product a row kernel would compute inside itself, alone (fuse_product_rows)
    products = {i for i, g in enumerate(work) if (c := g.contraction) is not None and alone_in_rows(graph, c)}
    for members in by_domain.values():
        for k, a in enumerate(members):
            if not alive[a]:
                continue
            for b in members[k + 1 :]:
                if not alive[b] or graph.ops(work[a].nodes + work[b].nodes) > config.max_fusion_ops:
                    continue
                if work[a].axes != work[b].axes and work[a].is_row and work[b].is_row:
                    continue  # rows along different axes
                if not contractions_fit(work[a], work[b]) or two_products(products, reads[a], reads[b]):
                    continue
                if index_reaches(reads, a, b) or index_reaches(reads, b, a):
                    continue
                work[a].nodes.extend(work[b].nodes)
                work[a].roles.update(work[b].roles)
                work[a].axes = work[a].axes or work[b].axes
                alive[b] = False
                reads[a] = (reads[a] | reads[b]) - {a, b}
                reads[b] = set()
                for r in reads:
                    if b in r:
                        r.discard(b)
                        r.add(a)
                for i, r in enumerate(reads):
                    r.discard(i)
    order = order_of(graph)
    return tuple(g.freeze(order) for g, ok in zip(work, alive) if ok)
