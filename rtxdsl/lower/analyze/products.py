"""Pass 6, then: GEMMs of one product shape that share an operand become one kernel."""

from __future__ import annotations

from ...config import FusionConfig
from ...expr import Expr
from ...ops import REGISTRY, OpKind
from ..expand import Graph
from ..roles import Role
from ..spec import read_as
from .flow import Flow
from .groups import Group, Work, group_reads, homes_of, index_reaches, label_of, order_of

#: the products one K loop sums at most (an fp32 accumulator each: at sm_90's 64 x 128 bf16 tile
#: beside two others, q, k and v of Llama-2-7B's attention take 166 registers, no spill)
SHARED_PRODUCTS = 3


def merge_products(
    graph: Graph, fl: Flow, groups: tuple[Group, ...], config: FusionConfig, solo: frozenset[Expr]
) -> tuple[Group, ...]:
    """Two GEMM kernels whose products have one shape become one kernel where that saves a read:

    * they share an operand (the same node, read the same way: ``silu(x @ wg.mT) * (x @ wu.mT)``,
      k and v of one hidden state, a gated MLP's ``dg.T @ h`` beside ``du.T @ h``): the K loop
      sums both products (:func:`shared_operand`), the shared tile loaded or its prologue computed
      once, each other operand's prologue (if any) at the same tile;
    * or one reads the other's values (a gated MLP's ``dx = dg @ wg + du @ wu``): the second
      product is summed in a K loop of its own in the epilogue, its operands read as stored.

    The epilogue of either reads both, so neither product is written unless something else reads
    it. Not where a third kernel lies between them (a cycle), nor for products with a K loop of
    their own already. One K loop sums at most :data:`SHARED_PRODUCTS` products sharing one operand
    (q, k and v of one hidden state); a product with a K loop of its own joins one other."""
    work = [Work.of(g) for g in groups]
    homes = homes_of(work)
    reads = [group_reads(g, fl, homes, i) for i, g in enumerate(work)]
    plain = [_plain_gemm(g, solo) for g in work]
    prologued = [_prologue_gemm(g, solo) for g in work]
    alive = [True] * len(work)
    products = [1] * len(work)
    sharing: list[tuple[int, Expr] | None] = [None] * len(work)  # what a merged kernel's products share
    for a in range(len(work)):
        for b in range(a + 1, len(work)):
            if not (alive[a] and alive[b] and ((plain[a] and plain[b]) or (prologued[a] and prologued[b]))):
                continue
            ga, gb = work[a], work[b]
            if graph.ops(ga.nodes + gb.nodes) > config.max_fusion_ops or _between(reads, a, b):
                continue
            ca, cb = ga.contraction, gb.contraction
            assert ca is not None and cb is not None
            side = shared_operand(ca, cb, graph) if plain[a] and plain[b] else None
            if prologued[a] and prologued[b]:
                if products[a] > 1 or not _prologues_share(ga, gb, graph):
                    continue
                prologued[a] = False  # two products: dK's and dV's
                how = f"beside {label_of(ca, graph)}: one K loop, their prologues' recomputed product once"
            elif side is not None and (ca.srcs[side] in ga.roles) == (cb.srcs[side] in gb.roles):
                # (the shared operand: a prologue in both kernels or read by both)
                if not _operands_at_tiles(ga, gb, (Role.A, Role.B)) or products[a] == SHARED_PRODUCTS:
                    continue
                if sharing[a] not in (None, (side, ca.srcs[side])):
                    continue  # every product of one K loop shares the one operand (q, k and v: x)
                sharing[a] = (side, ca.srcs[side])
                how = f"shares {label_of(ca.srcs[side], graph)} with {label_of(ca, graph)}: one K loop"
            elif products[a] == 1 and _summed_beside(ga, gb, graph) and (a in reads[b] or b in reads[a]):
                plain[a] = False  # a K loop of its own: no third product
                how = f"read with {label_of(ca, graph)}: its own K loop in one kernel, neither written for the other"
            else:
                continue
            ga.nodes.extend(gb.nodes)
            ga.roles.update(gb.roles)
            ga.notes += [note for note in gb.notes if note not in ga.notes]
            ga.notes.append(f"{label_of(cb, graph)} {how}")
            alive[b] = False
            products[a] += 1
            reads[a] = (reads[a] | reads[b]) - {a, b}
            for r in reads:
                if b in r:
                    r.discard(b)
                    r.add(a)
            reads[b] = set()
    order = order_of(graph)
    return tuple(g.freeze(order) for g, ok in zip(work, alive) if ok)


def _summed_beside(ga: Work, gb: Work, graph: Graph) -> bool:
    """Can one kernel compute both GEMMs' products, the second in a K loop of its own? Their
    products have one shape and their operands are loaded as stored (no prologue)."""
    ca, cb = ga.contraction, gb.contraction
    assert ca is not None and cb is not None
    return graph.of(ca).shape == graph.of(cb).shape and _operands_at_tiles(ga, gb, ())


def _operands_at_tiles(ga: Work, gb: Work, prologues: tuple[Role, ...]) -> bool:
    """Is each operand of both kernels' products read from memory or computed by a prologue (a
    role in ``prologues``), never a value one of them computes at its output tile (``h`` of
    ``dy @ wd``'s epilogue, the operand of ``dy.T @ h``: at the product's coordinates, not the
    operand's; a merged kernel would read it at the wrong ones), directly or through a prologue?"""
    roles = {**ga.roles, **gb.roles}
    operands = [s for g in (ga, gb) if (c := g.contraction) is not None for s in c.srcs]
    if not all(s not in roles or roles[s] in prologues for s in operands):
        return False
    # nor does a prologue read a value the other kernel computes at its output tile (a residual
    # over the other's product, ``(x + rms_norm(x) @ w) @ w``: its product read before it exists)
    return all(_prologue_reads_at_tiles(g, h.roles, prologues) for g, h in ((ga, gb), (gb, ga)))


def _prologue_reads_at_tiles(g: Work, other: dict[Expr, Role], prologues: tuple[Role, ...]) -> bool:
    """Does every prologue node of ``g`` read only loads, its own nodes, or ``other``'s prologues?"""
    at_tiles = [m for m in g.nodes if g.roles.get(m) in prologues]
    return all(s not in other or other[s] in prologues for m in at_tiles for s in m.srcs)


def shared_operand(a: Expr, b: Expr, graph: Graph) -> int | None:
    """The operand (0: left, 1: right) contractions ``a`` and ``b`` share, read the same way, where
    their products have one shape (so one K loop sums both; matmul's operands have one dtype), or None."""
    if a is b or a.attrs != b.attrs or graph.of(a).shape != graph.of(b).shape:
        return None
    return next((side for side in (0, 1) if a.srcs[side] is b.srcs[side]), None)


def _plain_gemm(g: Work, solo: frozenset[Expr]) -> bool:
    """A GEMM kernel that may share its K loop: one product, none recomputed, no batch summed in
    the loop, nothing kept apart by ``min_fusion_ops``."""
    c = g.contraction
    if c is None or g.is_row or g.free or any(m in solo for m in g.nodes):
        return False
    if c.attr("sum_batch") or c.attr_dict.get("summed") or c.attr_dict.get("recompute"):
        return False
    return [m for m in g.nodes if REGISTRY[m.op].kind is OpKind.CONTRACTION] == [c]


def _prologue_gemm(g: Work, solo: frozenset[Expr]) -> bool:
    """A GEMM kernel whose A operand is a prologue recomputing a product (attention's ``dS.T @ q``
    and ``P.T @ dO``, each recomputing ``q @ k.mT``): one product of its own, the others its
    prologue's; no reduction (an online softmax's K loop is its own product's); no value read at
    other coordinates (a transpose, a slice: the other kernel's prologue may read it as it is;
    size-1 dims inserted and positions are fine) nor recomputed where read; not every batch dim
    summed (a weight's gradient; grouped-query attention's dK and dV sum a group of heads)."""
    c = g.contraction
    if c is None or g.is_row or g.free or any(m in solo for m in g.nodes):
        return False
    if c.attr("sum_batch") or c.attr_dict.get("recompute"):
        return False
    inner = [m for m in g.nodes if REGISTRY[m.op].kind is OpKind.CONTRACTION and m is not c]
    if not inner or any(g.roles[m] is not Role.A for m in inner) or g.roles.get(c.srcs[0]) is not Role.A:
        return False
    return not any(REGISTRY[m.op].kind is OpKind.REDUCTION or _moves(m) for m in g.nodes)


def _moves(m: Expr) -> bool:
    """Does ``m`` read its operand at other coordinates than its own (a permute, a slice, a gather)?"""
    op = REGISTRY[m.op]
    return op.kind is OpKind.MOVEMENT and not op.view and not op.shape_only


def _prologues_share(ga: Work, gb: Work, graph: Graph) -> bool:
    """Can one K loop sum both kernels' products, their A prologues computed once at the loop's
    tile (dK = dS.T @ q beside dV = P.T @ dO: the scores and P once per tile)? Products of one shape,
    read the same way, over one K, of one operand dtype; a product both prologues recompute; every
    node both kernels hold at the same operand's tile; the B operands read from memory or computed
    at B's tile."""
    ca, cb = ga.contraction, gb.contraction
    assert ca is not None and cb is not None
    if read_as(ca.attrs) != read_as(cb.attrs) or graph.of(ca).shape != graph.of(cb).shape:
        return False  # (each product's own dtype: its accumulator rounded as it is stored)
    typed = [(graph.of(x).shape, graph.of(x).dtype) for x in (*ca.srcs, *cb.srcs)]
    if typed[:2] != typed[2:]:
        return False  # (one K, one operand dtype)
    both = ga.roles.keys() & gb.roles.keys()
    if any(ga.roles[i] is not gb.roles[i] for i in both):
        return False
    recomputed = {m for m in ga.nodes if REGISTRY[m.op].kind is OpKind.CONTRACTION and m is not ca}
    return bool(recomputed & both) and _operands_at_tiles(ga, gb, (Role.A, Role.B))


def _between(reads: list[set[int]], a: int, b: int) -> bool:
    """Does a third kernel lie on a path between kernels ``a`` and ``b`` (merged, a cycle)?"""
    return any(d != b and index_reaches(reads, d, b) for d in reads[a]) or any(
        d != a and index_reaches(reads, d, a) for d in reads[b]
    )
