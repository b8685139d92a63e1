"""Pass 6: a GEMM recomputes an elementwise operand at load time (its prologue) where that is cheaper
than writing it and reading it back."""

from __future__ import annotations

import math
from collections.abc import Set

from ...config import FusionConfig
from ...expr import Expr
from ...ops import REGISTRY, OpKind
from ..expand import Graph, is_leaf
from ..prologue import Operand, choose, reloads
from ..roles import Role
from .flow import Flow, read_srcs
from .groups import Group, Work, consumers_of, cyclic, homes_of, label_of, order_of, still_writes
from .kloop import reduce_in_k_loop
from .tiles import tileable, tiled_cone, untiled


def absorb_prologues(
    graph: Graph, fl: Flow, groups: tuple[Group, ...], config: FusionConfig, solo: frozenset[Expr]
) -> tuple[Group, ...]:
    """A GEMM recomputes an elementwise operand at load time, per tile (its prologue).

    The operand's elementwise cone inside the kernel that computes it (over that kernel's inputs:
    no reduction, no movement op) is copied into every GEMM reading the operand, when the traffic
    model (:mod:`rtxdsl.lower.prologue`) says recomputing it per tile costs less than writing it
    and reading it back. Its home kernel then stops writing it, and disappears if nothing else of
    it is needed. Each candidate's choice is a note on the GEMM's group (``explain()``). A choice
    that would make two kernels read each other's values (a statistic moved into a GEMM whose
    epilogue reads what another kernel computes from that statistic: split-KV decoding's merge
    weights) is undone (``cyclic``).
    """
    st = _Absorb(graph, fl, groups, config, solo)
    for s in (n for n in graph.nodes if n in st.readers and n not in st.stored):
        before = st.snapshot()
        st.absorb(s)
        if cyclic(graph, st.work, st.emptied, fl, st.requested, st.consumers):
            st.restore(before)
    dead = {h for h in st.emptied if not still_writes(h, st.work, st.requested, st.consumers)}
    order = order_of(graph)
    return tuple(g.freeze(order) for g in st.work if g not in dead)


class _Absorb:
    """``absorb_prologues``'s state: the kernels, what each GEMM's prologues hold, the kernels
    emptied of an operand now recomputed."""

    def __init__(
        self, graph: Graph, fl: Flow, groups: tuple[Group, ...], config: FusionConfig, solo: frozenset[Expr]
    ) -> None:
        self.graph, self.config, self.solo = graph, config, solo
        self.requested = {e for _, e in graph.outputs}
        self.consumers = consumers_of(graph, fl)
        self.work = [Work.of(g) for g in groups]
        self.homes = homes_of(self.work)
        self.readers = _gemm_readers(self.work, self.homes)
        self.taken: dict[Work, set[Expr]] = {w: set() for w in self.work}  # nodes already in a GEMM's prologues
        self.emptied: list[Work] = []  # kernels that computed an operand now recomputed: still needed?
        # a product recomputed in tiles reads its operands from memory wherever it is computed: they
        # are written, and no GEMM recomputes them (it would hold the value both as a member and a load)
        self.stored = {x for n in graph.nodes if tileable(graph, n) for x in n.srcs}
        self.writable = _writable(self.work, graph)
        self.in_kernels = {m for w in self.work for m in w.nodes}  # not the free nodes: never written

    def snapshot(self) -> tuple:
        kernels = [(w, list(w.nodes), dict(w.roles), len(w.notes)) for w in self.work]
        return kernels, {k: set(v) for k, v in self.taken.items()}, len(self.emptied)

    def restore(self, snap: tuple) -> None:
        kernels, taken, emptied = snap
        for w, nodes, roles, notes in kernels:
            w.nodes[:], w.roles = nodes, roles
            del w.notes[notes:]
        self.taken, self.emptied[:] = taken, self.emptied[:emptied]

    def absorb(self, s: Expr) -> None:
        """Operand ``s`` recomputed in the GEMMs reading it, where the traffic model says so."""
        graph, work, consumers, requested = self.graph, self.work, self.consumers, self.requested
        home = work[self.homes[s]]
        tiled = _product_cone(s, graph, consumers, self.writable, self.in_kernels)
        if tiled is not None:  # a product no kernel writes: every reader computes it in its K loop
            found = _recompute_in_prologues(s, tiled, self.readers, work, graph, consumers, requested)
            if found is not None:
                self.emptied += found
                return
        cone = _elementwise_cone(s, home, self.solo)
        gemm_readers = self.readers[s]
        chain, bounds = cone if cone is not None else ([], [])
        if cone is None or any(
            self.taken[w] & set(chain)
            or graph.ops(w.nodes + chain) > self.config.max_fusion_ops
            or _epilogue_reads(w, chain, consumers)
            or _holds_other_operand(w, side, chain)
            or _crosses_tiles(w, side, chain, bounds)
            for w, side in gemm_readers
        ):
            return
        inside = set(home.nodes)
        gemm_nodes = {w.contraction for w, _ in gemm_readers}
        outside = [c for c in consumers.get(s, ()) if c not in gemm_nodes]
        written = s in requested or any(c not in inside for c in outside)
        members = set(chain)
        computed = written or any(c in inside and c not in members for c in outside)
        info = graph.of(s)
        choice = choose(
            label_of(s, graph),
            sum(REGISTRY[m.op].cost for m in chain),
            math.prod(info.shape),
            info.dtype.itemsize,
            [_operand(w, side, info.shape, graph) for w, side in gemm_readers],
            computed,
            written,
            sum(graph.of(m).nbytes for m in bounds),
        )
        for w, side in gemm_readers:
            w.notes.append(choice.note)
            if choice.fuse:
                for m in chain:
                    w.roles[m] = side
                w.nodes[:0] = chain
                self.taken[w] |= members
        if choice.fuse:
            self.emptied.append(home)
            if not computed:  # its own kernel no longer computes what only the GEMMs read
                kept = _still_needed(chain, home, members, consumers)
                home.nodes = [m for m in home.nodes if m not in members or m in kept]
            for w, side in gemm_readers:  # once every reader recomputes it
                if side is Role.A:
                    self.emptied += reduce_in_k_loop(w, [s], work, graph, consumers, requested)


def _holds_other_operand(w: Work, side: Role, chain: list[Expr]) -> bool:
    """Would ``side``'s prologue compute the GEMM's other operand (``mm(t * 2, t)``)? A node has one
    role: at one operand's tile, never at both; the other operand is then read from memory."""
    assert w.contraction is not None
    other = w.contraction.srcs[1 if side is Role.A else 0]
    return any(m is other for m in chain)


def _crosses_tiles(w: Work, side: Role, chain: list[Expr], bounds: list[Expr]) -> bool:
    """Would ``side``'s prologue read a value the GEMM computes at another tile (the other operand's
    prologue: ``x @ log_softmax(x).T`` with ``x = a + b`` in A's), or compute one that another
    tile's nodes read? Each node is one value per kernel, at its role's tile: the other prologue
    would read it at the wrong coordinates (lazy fuzzer seed 20270130, program 2027013000031)."""
    other = Role.B if side is Role.A else Role.A
    members = set(chain)
    if any(w.roles.get(x) is other for x in (*bounds, *(x for m in chain for x in m.srcs))):
        return True
    return any(w.roles.get(m) is other and any(x in members for x in m.srcs) for m in w.nodes)


def _product_cone(
    s: Expr, graph: Graph, consumers: dict[Expr, list[Expr]], writable: frozenset[Expr], in_kernels: set[Expr]
) -> list[Expr] | None:
    """:func:`tiled_cone` of ``s`` down to the leaves or, failing that, down to per-row values a
    kernel writes (``writable``), unless a value of that cone computed from the product is also
    read by a node no kernel computes (a free node recomputing it inline, where it would not be
    cut; one computed from leaves alone, a loss's scale from its cotangents, is recomputed there
    as it is)."""
    tiled = tiled_cone(s, graph)
    if tiled is not None:
        return tiled if _operands_loaded(tiled) else None
    tiled = tiled_cone(s, graph, bounded=writable)
    if tiled is not None and not _operands_loaded(tiled):
        return None
    members = set(tiled or ())
    if any(
        c not in members and c not in in_kernels and not untiled(m, graph)
        for m in tiled or ()
        for c in consumers.get(m, ())
    ):
        return None
    return tiled


def _operands_loaded(cone: list[Expr]) -> bool:
    """Does no product of ``cone`` read a value the cone itself computes (``(g @ exp(s)) + (g @ s) *
    exp(s)``: ``exp(s)`` computed at the tile for the ``*`` is also ``g @ exp(s)``'s operand, which
    a product recomputed in tiles reads from memory, written by no kernel once the cone moves: the
    generated product read ``s`` in its place)? Views of inputs are loads either way."""
    computed = {m for m in cone if REGISTRY[m.op].kind is OpKind.ELEMENTWISE}
    return not any(x in computed for m in cone if REGISTRY[m.op].kind is OpKind.CONTRACTION for x in m.srcs)


def _writable(work: list[Work], graph: Graph) -> frozenset[Expr]:
    """The values a kernel can write before the GEMMs reading them run: at its own coordinates (per
    row in a row kernel), not a GEMM's; computed without a product marked ``recompute``, unless the
    kernel computes its products in tiles itself (a backward's row sums over them)."""
    return frozenset(
        m
        for w in work
        if w.contraction is None or w.is_row
        for m in w.nodes
        if _own_value(w, m, graph) and (w.contraction is not None or untiled(m, graph))
    )


def _own_value(w: Work, m: Expr, graph: Graph) -> bool:
    """Is ``m`` a value kernel ``w`` computes at its own coordinates (one per element of its
    domain, or one per row of a row kernel), so that it can write it?"""
    role = w.role(m)
    if w.is_row:
        return role in (Role.KEEP, Role.DROP) or (role is Role.FULL and graph.of(m).shape == w.shape)
    return role is Role.FULL and graph.of(m).shape == w.shape


def _gemm_readers(work: list[Work], homes: dict[Expr, int]) -> dict[Expr, list[tuple[Work, Role]]]:
    """operand -> the GEMM kernels reading it from another kernel, as A or B (a product of a
    value with itself has no prologue: one tile cannot be both operands)."""
    readers: dict[Expr, list[tuple[Work, Role]]] = {}
    for w in work:
        c = w.contraction
        if c is None or w.is_row or c.srcs[0] is c.srcs[1]:
            continue
        for side, s in zip((Role.A, Role.B), c.srcs):
            if s in homes and work[homes[s]] is not w:
                readers.setdefault(s, []).append((w, side))
    return readers


def _recompute_in_prologues(
    s: Expr,
    chain: list[Expr],
    readers: dict[Expr, list[tuple[Work, Role]]],
    work: list[Work],
    graph: Graph,
    consumers: dict[Expr, list[Expr]],
    requested: set[Expr],
) -> list[Work] | None:
    """Operand ``s`` of its GEMM ``readers``, computed from a product no kernel writes (``chain``,
    see :func:`tiled_cone`), becomes each reader's prologue whatever the traffic model would say:
    keeping a tokens x vocabulary buffer unwritten is the point. A value of ``chain`` that other
    GEMMs read as an operand is recomputed in theirs at once (attention's backward: ``P`` in
    ``P.T @ dO``, and ``dS``, computed from ``P``, in ``dS @ k`` and ``dS.T @ q``; neither alone
    would leave the other unwritten). The kernels that computed parts of it keep only what their
    other nodes need; those left with nothing to write are returned. Undone (None) when a value of
    ``chain`` would still be read by a kernel other than the GEMMs (:func:`_leaks`): the product
    is then written as usual."""
    members = set(chain)
    operands = [(s, chain)] + [
        (m, cone)
        for m in chain
        if m is not s and m in readers and (cone := tiled_cone(m, graph)) and set(cone) <= members
    ]
    gemm_readers = [(w, side, v, cone) for v, cone in operands for w, side in readers[v]]
    if any(_epilogue_reads(w, cone, consumers) for w, _, _, cone in gemm_readers):
        return None
    before = [(w.nodes[:], dict(w.roles), w.notes[:]) for w in work]
    for w, side, v, cone in gemm_readers:
        for m in cone:
            w.roles[m] = side
        w.nodes[:0] = [m for m in cone if not any(m is x for x in w.nodes)]
        w.notes.append(
            f"{label_of(v, graph)}: computed from a product the forward never wrote, recomputed in tiles "
            f"in the K loop ({graph.of(v).nbytes} bytes not written)"
        )
    gemms = [(w, side) for w, side, _, _ in gemm_readers]
    others = [h for h in work if all(h is not w for w, _ in gemms)]
    loaded = _loaded_rows(chain, others, graph.of(s).numel, graph)
    homes = {h: h for h in others for m in h.nodes if m in members}
    for home in homes.values():
        kept = _still_needed([m for m in home.nodes if m in members], home, members, consumers, loaded)
        home.nodes = [m for m in home.nodes if m not in members or m in kept]
    emptied = list(homes.values())
    for w, side, v, cone in gemm_readers:
        if side is Role.A:
            emptied += reduce_in_k_loop(w, [v, *cone], work, graph, consumers, requested)
    if not _leaks(chain, gemms, work, requested, consumers, loaded | _leaf_views(chain, graph)):
        return emptied
    for w, (nodes, roles, notes) in zip(work, before):  # written after all: as it was
        w.nodes, w.roles, w.notes = nodes, roles, notes
    return None


def _leaf_views(chain: list[Expr], graph: Graph) -> set[Expr]:
    """The views of leaves in ``chain`` (a grouped attention's mask with a group axis of one): any
    kernel reading one loads the leaf through its strides, so another kernel reading it as well
    keeps nothing written."""
    return {m for m in chain if REGISTRY[m.op].view and all(is_leaf(x, graph.info) for x in read_srcs(m))}


def _epilogue_reads(w: Work, chain: list[Expr], consumers: dict[Expr, list[Expr]]) -> bool:
    """Does GEMM ``w``'s epilogue read a value of ``chain`` (a residual around a projection,
    ``a + linear(a, w)``)? It reads it at the product's coordinates, loaded: a prologue holds the
    value only at the operand's tiles, so it stays written and is not recomputed."""
    epilogue = {m for m in w.nodes if w.role(m) is Role.FULL and m is not w.contraction}
    return any(c in epilogue for m in chain for c in consumers.get(m, ()))


def _loaded_rows(chain: list[Expr], others: list[Work], size: int, graph: Graph) -> set[Expr]:
    """The values of a recomputed ``chain`` smaller than its operand (per row: a cross-entropy's
    per-row weight, beside the one-hot it scales) that kernels other than the GEMMs load, not
    computing them: their homes keep computing and writing them."""
    members = set(chain)
    return {
        x
        for h in others
        for m in (*h.nodes, *h.free)
        if m not in members
        for x in read_srcs(m)
        if x in members and graph.of(x).numel < size and not any(x is y for y in (*h.nodes, *h.free))
    }


def _leaks(
    chain: list[Expr],
    gemm_readers: list[tuple[Work, Role]],
    work: list[Work],
    requested: set[Expr],
    consumers: dict[Expr, list[Expr]],
    loaded: set[Expr],
) -> bool:
    """Would a value of a recomputed ``chain`` still be read by a kernel that writes something, other
    than the GEMMs recomputing it (or be an output)? A GEMM writes no operand tile, so the product
    is then computed and written as usual. A node taking only a shape from it (the positions of a
    one-hot over the product, a cross-entropy's target gradient) reads nothing; a ``loaded`` per-row
    value (:func:`_loaded_rows`) is written by its home."""
    members = set(chain) - loaded
    if members & requested:
        return True
    readers = {w for w, _ in gemm_readers}
    for h in work:
        if h in readers:
            continue
        own = set((*h.nodes, *h.free))  # a free node is recomputed where a view reads it
        if any(x in members and x not in own for m in (*h.nodes, *h.free) for x in read_srcs(m)):
            if still_writes(h, work, requested, consumers):
                return True
    return False


def _operand(w: Work, side: Role, shape: tuple[int, ...], graph: Graph) -> Operand:
    """GEMM ``w`` reading an operand of ``shape`` as A or B, for the traffic model."""
    c = w.contraction
    assert c is not None
    return Operand(side.name, reloads(side.name, graph.of(c).shape, shape, c.attr("sum_batch")))


def _elementwise_cone(s: Expr, home: Work, solo: frozenset[Expr]) -> tuple[list[Expr], list[Expr]] | None:
    """``s`` and the nodes of its home kernel it is computed from, if all are elementwise (none
    kept apart by ``solo``), and the per-row values of a row kernel it reads (RMSNorm's ``rstd``:
    KEEP values, which broadcast against the operand; written by the row kernel, loaded at each
    tile). None where it needs anything else. A value the home kernel computes is in the cone
    even where another kernel also computes it (an epilogue recomputing it): the GEMM reads the
    cone's boundaries from memory, and one written by that other kernel could order them in a cycle."""
    inside = set(home.nodes)
    out: list[Expr] = []
    bounds: list[Expr] = []
    stack, seen = [s], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        role = home.role(n)
        if n is not s and role is Role.KEEP:
            bounds.append(n)
            continue
        if n in solo or REGISTRY[n.op].kind is not OpKind.ELEMENTWISE or role is not Role.FULL:
            return None
        out.append(n)
        stack.extend(x for x in n.srcs if x in inside)
    return out, bounds


def _still_needed(
    chain: list[Expr],
    home: Work,
    members: set[Expr],
    consumers: dict[Expr, list[Expr]],
    loaded: Set[Expr] = frozenset(),
) -> set[Expr]:
    """The nodes of a prologue's ``chain`` its home kernel still computes: those read by its other
    nodes or ``loaded`` by other kernels, and what they are computed from."""
    others = set(home.nodes) - members
    kept = {m for m in chain if m in loaded or any(c in others for c in consumers.get(m, ()))}
    stack = [m for m in chain if m in kept]
    while stack:
        for x in stack.pop().srcs:
            if x in members and x not in kept:
                kept.add(x)
                stack.append(x)
    return kept
