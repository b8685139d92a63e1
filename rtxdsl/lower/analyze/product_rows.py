"""Pass 5: a row kernel reducing GEMMs' products over their last axis computes each product tile by
tile itself."""

from __future__ import annotations

from ...expr import Expr
from ...ops import REGISTRY, OpKind
from ..expand import Graph
from ..roles import Role
from .flow import Flow, reindexes
from .groups import Group, Work, consumers_of, group_reads, homes_of, index_reaches, label_of, order_of
from .tiles import alone_in_rows, recomputable, tileable


def fuse_product_rows(graph: Graph, fl: Flow, groups: tuple[Group, ...], solo: frozenset[Expr]) -> tuple[Group, ...]:
    """A GEMM whose every output only a row kernel reads, reducing them over the product's last
    axis, moves into that row kernel: it computes each ``[rows, block]`` tile of the product with
    ``tl.dot`` where it would have loaded it, so the product is never written (linear
    cross-entropy: a tokens x vocabulary product reduced to a logsumexp and a target logit).

    Only for a product :func:`reduced_in_rows` (the backward recomputes exactly those), when nothing
    of the product's size is written (the row kernel's outputs are per row) and the product is read
    at its own coordinates (no movement op re-indexes it)."""
    requested = {e for _, e in graph.outputs}
    consumers = consumers_of(graph, fl)
    work = [Work.of(g) for g in groups]
    dead: set[Work] = set()
    for r in work:
        if not r.is_row or r.contraction is not None or r.axes != (len(r.shape) - 1,):
            continue
        # every product the row kernel reads, each tile computed where it is read (one if alone_in_rows)
        while gemm := _product_of(r, [w for w in work if w not in dead], graph, fl, consumers, requested, solo):
            c = gemm.contraction
            assert c is not None
            for m in gemm.nodes:
                r.roles[m] = Role.FULL
            r.nodes[:0] = gemm.nodes
            info = graph.of(c)
            r.notes.append(
                f"{label_of(c, graph)}: the product is computed tile by tile in this row kernel and never "
                f"written ({info.nbytes} bytes not stored or read back)"
            )
            dead.add(gemm)
    order = order_of(graph)
    return tuple(g.freeze(order) for g in work if g not in dead)


def _product_of(
    r: Work,
    work: list[Work],
    graph: Graph,
    fl: Flow,
    consumers: dict[Expr, list[Expr]],
    requested: set[Expr],
    solo: frozenset[Expr],
) -> Work | None:
    """The GEMM kernel row kernel ``r`` can compute inside itself (see :func:`fuse_product_rows`)."""
    members = set(r.nodes)
    full = [m for m in r.nodes if r.role(m) is Role.FULL]

    def outside(x: Expr, m: Expr) -> bool:  # read by another kernel that does not recompute it from the product
        return x not in members and not recomputable(x, m, graph)

    if any(m in requested or any(outside(x, m) for x in consumers.get(m, ())) for m in full):
        return None  # it writes a value of the product's size: the product would be computed twice
    homes = homes_of(work)
    read = {homes[s] for m in r.nodes for s in fl.reads[m] if s in homes and s not in members}
    reads = [group_reads(g, fl, homes, i) for i, g in enumerate(work)]
    own = [m for m in r.nodes if REGISTRY[m.op].kind is OpKind.CONTRACTION]
    for h in read:
        gemm = work[h]
        c = gemm.contraction
        if c is None or gemm.is_row or gemm.shape != r.shape or any(m in solo for m in gemm.nodes):
            continue
        if any(x != h and index_reaches(reads, x, h) for x in read):
            # another kernel the row kernel reads depends on this one (a sibling merged beside the
            # product computes an operand of another product: the hidden size equal to the
            # vocabulary's): inside the row kernel, the two would read each other
            continue
        if not tileable(graph, c):  # as the backward decides not to save it (or it is the backward's)
            continue
        if own and any(alone_in_rows(graph, x) for x in (c, *own)):
            continue  # a batched right operand keeps the kernel's rows to one batch: no other product
        inside = set(gemm.nodes)
        if any(gemm.role(m) is not Role.FULL or m in requested for m in gemm.nodes):
            continue
        if any(s in inside or s in members for s in c.srcs):
            continue  # an operand computed beside the product: its tiles would need a prologue
        if any(s in inside for x in own for s in x.srcs):
            continue  # it computes an operand of a product already inside (read as loaded tiles)
        readers = [(x, m) for m in gemm.nodes for x in consumers.get(m, ()) if x not in inside]
        # a reader elsewhere recomputes the product in a narrow GEMM's prologue (attention's P @ v)
        if any(reindexes(x) or outside(x, m) for x, m in readers):
            continue
        return gemm
    return None
