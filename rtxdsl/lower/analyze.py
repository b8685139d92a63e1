"""The fusion analyzer: a typed primitive graph -> fusion groups, one kernel each.

Each group runs over a *domain*: a full shape ``S`` and the axes ``A`` it reduces (none for
pointwise groups). Inside a row group (``A`` non-empty) a node has a role: FULL (varies over
the whole domain), KEEP (one value per row, reduced dims kept as size 1) or DROP (one value
per row, reduced dims removed).

The analysis is a sequence of passes, each a function from (graph, groups) to new groups:

1. ``partition``: greedy, in topological order. An elementwise node joins its operands'
   groups when its shape and their roles fit (operand groups that fit are merged unless that
   would make a cycle between groups); a private pointwise producer of a smaller,
   broadcastable shape is absorbed and recomputed at the larger shape; a reduction takes its
   input's pointwise group as prologue or joins a row group over the same rows (softmax:
   logsumexp, then exp(x - lse)). ``min_fusion_ops`` re-runs it with small groups kept apart.
2. ``merge_siblings``: independent groups over the same domain become one kernel.
3. ``absorb_per_row``: math on leaves only is recomputed in every kernel that reads it.
4. ``recompute_elementwise``: a kernel reading another kernel's elementwise value recomputes
   it from leaves instead of reading it back.
5. ``fuse_product_rows``: a row kernel reducing GEMMs' products over their last axis computes
   each product tile by tile itself (never written: linear cross-entropy; a student's and a
   teacher's logits in one distillation loss).
6. ``absorb_prologues``: a GEMM recomputes an elementwise operand at load time (its prologue)
   where the traffic model says that is cheaper than writing the operand and reading it back.
   Then ``merge_products``: two GEMMs of one shape that share an operand (a gate and an up
   projection of one input, k and v of one hidden state) become one kernel summing both
   products in one K loop, the shared operand's tile loaded (or its prologue computed) once; two
   where one reads the other (``dg @ wg + du @ wu``) become one kernel with two K loops.
7. ``chunk_recomputed`` (``lower/chunk.py``): a product that GEMM prologues would recompute
   many times (linear cross-entropy's backward) is computed once instead, a chunk of its last
   dim at a time, by a GEMM of its own whose epilogue writes the prologue's value to a buffer
   of one chunk; the GEMMs read it there, in the same loop.
8. ``finish``: what each kernel reads and writes (a value is written only when requested or
   read by a kernel that does not compute it), its pattern, and a launch order.

Movement ops that re-index (slices, ``cat``, ``flip``, ``gather``) are evaluated inside the
kernel that consumes them: their operands' elementwise cones are recomputed at the remapped
coordinates from leaves and reductions (:class:`Flow`). A node only ever read through such
cones is *free*: no group owns it and nothing writes it.
"""

from __future__ import annotations

import graphlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from ..config import FusionConfig
from ..expr import Expr
from ..ops import REGISTRY, OpKind, Pattern
from .chunk import chunk_recomputed
from .expand import Graph, is_leaf
from .online import STATISTICS, online_shift
from .prologue import Operand, choose, reloads
from .roles import Role
from .spec import Chunk, read_as


@dataclass(frozen=True)
class Group:
    """One kernel: its domain, its nodes (operands first) with their roles, what it reads and writes."""

    shape: tuple[int, ...]
    axes: tuple[int, ...]
    nodes: tuple[Expr, ...]
    roles: Mapping[int, Role]
    inputs: tuple[Expr, ...] = ()  # tensors read: vars or other groups' outputs
    outputs: tuple[Expr, ...] = ()
    pattern: Pattern = Pattern.SINGLE
    cone: tuple[Expr, ...] = ()  # free nodes its movement ops evaluate at remapped coordinates
    notes: tuple[str, ...] = ()  # the analyzer's choices for this kernel, with their figures (explain)
    chunk: Chunk | None = None  # a kernel of a chunk loop (``lower/chunk.py``)

    @property
    def remaps(self) -> bool:
        """Does the kernel evaluate values at coordinates of their own (a coordinate-mode kernel):
        re-indexed ones, or the operands' of a product it computes in tiles?"""
        return bool(self.cone) or any(reindexes(n) for n in self.nodes) or self.product_rows

    @property
    def product_rows(self) -> bool:
        """A row kernel computing a contraction's product tile by tile (see ``fuse_product_rows``)."""
        return self.is_row and self.contraction is not None

    @property
    def is_row(self) -> bool:
        return bool(self.axes)

    @property
    def contraction(self) -> Expr | None:
        """The contraction a GEMM kernel computes (the rest of its nodes are its epilogue and its
        prologues, which may recompute a product of their own)."""
        return contraction_of(self.nodes, self.roles)

    def keep_shape(self) -> tuple[int, ...]:
        return tuple(1 if d in self.axes else s for d, s in enumerate(self.shape))

    def drop_shape(self) -> tuple[int, ...]:
        return tuple(s for d, s in enumerate(self.shape) if d not in self.axes)

    def role(self, n: Expr) -> Role:
        return self.roles[id(n)]

    @property
    def ops(self) -> list[str]:
        return [n.op for n in self.nodes]


@dataclass(frozen=True)
class Plan:
    groups: tuple[Group, ...]  # in launch order
    graph: Graph

    @property
    def kernels(self) -> int:
        return len(self.groups)


def analyze(graph: Graph, config: FusionConfig) -> Plan:
    """Partition ``graph`` into fusion groups under ``config``'s limits."""
    fl = flow(graph)
    groups = partition(graph, fl, config, frozenset())
    small = frozenset(id(n) for g in groups if graph.ops(g.nodes) < config.min_fusion_ops for n in g.nodes)
    if small:
        groups = partition(graph, fl, config, small)
    groups = merge_siblings(graph, fl, groups, config, small)
    groups = absorb_per_row(graph, fl, groups, config, small)
    groups = recompute_elementwise(graph, fl, groups, config, small)
    groups = fuse_product_rows(graph, fl, groups, small)
    groups = absorb_prologues(graph, fl, groups, config, small)
    groups = merge_products(graph, fl, groups, config, small)
    groups = chunk_recomputed(graph, groups, config)
    return finish(graph, fl, groups)


def contraction_of(nodes: list[Expr] | tuple[Expr, ...], roles: Mapping[int, Role]) -> Expr | None:
    """The kernel's own contraction: not one a prologue recomputes at an operand's tiles."""
    own = (n for n in nodes if REGISTRY[n.op].kind is OpKind.CONTRACTION and roles[id(n)] not in (Role.A, Role.B))
    return next(own, None)


# ---- data flow through movement ops -------------------------------------------------------------
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

    ``reads[id(n)]``: the nodes whose values a kernel computing ``n`` must have (members of its
    group, or tensors it loads). For a re-indexing movement op these are the *boundaries* of
    its cone: leaves and reductions; the elementwise and movement nodes between them
    (``cones[id(n)]``) are recomputed at the remapped coordinates. ``free``: nodes read only
    inside cones; no group computes them at their own coordinates.
    """

    reads: Mapping[int, tuple[Expr, ...]]
    cones: Mapping[int, tuple[Expr, ...]]
    free: frozenset[int]


def flow(graph: Graph) -> Flow:
    requested = {id(e) for _, e in graph.outputs}
    leaf = {id(n) for n in graph.nodes if is_leaf(n, graph.info)}
    readers: dict[int, list[Expr]] = {}
    for n in graph.nodes:
        if id(n) not in leaf:
            for s in read_srcs(n):
                readers.setdefault(id(s), []).append(n)

    def _regrouped_output(c: Expr, n: Expr) -> bool:
        """An output that only regroups ``n`` (a reshape, same dtype): ``n``'s kernel writes the
        output's memory in the same order (``lower._output_views``), so ``n`` is computed, not
        recomputed at the output's coordinates by a kernel of the reshape's own."""
        return REGISTRY[c.op].regroups and id(c) in requested and graph.of(c).dtype == graph.of(n).dtype

    free: set[int] = set()
    for n in reversed(graph.nodes):
        kind = REGISTRY[n.op].kind
        if id(n) in leaf or id(n) in requested or kind not in (OpKind.ELEMENTWISE, OpKind.MOVEMENT):
            continue
        if all((reindexes(c) and not _regrouped_output(c, n)) or id(c) in free for c in readers.get(id(n), ())):
            free.add(id(n))
    reads: dict[int, tuple[Expr, ...]] = {}
    cones: dict[int, tuple[Expr, ...]] = {}
    for n in graph.nodes:
        if id(n) in leaf:
            continue
        if not reindexes(n) or _regrouped_output(n, n.srcs[0]):
            reads[id(n)] = read_srcs(n)
            continue
        cone: list[Expr] = []
        bounds: list[Expr] = []
        seen: set[int] = set()

        def visit(s: Expr) -> None:
            if id(s) in seen:
                return
            seen.add(id(s))
            if id(s) in leaf or REGISTRY[s.op].kind in (OpKind.REDUCTION, OpKind.CONTRACTION):
                bounds.append(s)
                return
            for x in read_srcs(s):
                visit(x)
            cone.append(s)

        for s in read_srcs(n):
            visit(s)
        reads[id(n)], cones[id(n)] = tuple(bounds), tuple(cone)
    return Flow(MappingProxyType(reads), MappingProxyType(cones), frozenset(free))


# ---- a group while a pass edits it -------------------------------------------------------------
@dataclass(eq=False)
class _Work:
    shape: tuple[int, ...]
    axes: tuple[int, ...] = ()
    nodes: list[Expr] = field(default_factory=list)
    roles: dict[int, Role] = field(default_factory=dict)
    free: list[Expr] = field(default_factory=list)  # recomputed where views of them are read
    notes: list[str] = field(default_factory=list)

    @staticmethod
    def of(g: Group) -> _Work:
        return _Work(g.shape, g.axes, list(g.nodes), dict(g.roles), list(g.cone), list(g.notes))

    def freeze(self, order: Mapping[int, int]) -> Group:
        # each node once (passes that recompute a value may add what the kernel computes already)
        nodes = tuple(sorted({id(m): m for m in self.nodes}.values(), key=lambda m: order[id(m)]))
        cone = tuple(sorted({id(m): m for m in self.free}.values(), key=lambda m: order[id(m)]))
        roles = MappingProxyType(dict(self.roles))
        return Group(self.shape, self.axes, nodes, roles, cone=cone, notes=tuple(self.notes))

    @property
    def is_row(self) -> bool:
        return bool(self.axes)

    def keep_shape(self) -> tuple[int, ...]:
        return tuple(1 if d in self.axes else s for d, s in enumerate(self.shape))

    def drop_shape(self) -> tuple[int, ...]:
        return tuple(s for d, s in enumerate(self.shape) if d not in self.axes)

    def role(self, n: Expr) -> Role:
        return self.roles[id(n)]

    @property
    def contraction(self) -> Expr | None:
        return contraction_of(self.nodes, self.roles)


def _order(graph: Graph) -> dict[int, int]:
    return {id(n): i for i, n in enumerate(graph.nodes)}


def _consumers(graph: Graph, fl: Flow) -> dict[int, list[Expr]]:
    """node id -> the grouped nodes that read it (through movement cones: their boundaries)."""
    out: dict[int, list[Expr]] = {}
    for n in graph.nodes:
        if id(n) in fl.reads and id(n) not in fl.free:
            for s in fl.reads[id(n)]:
                out.setdefault(id(s), []).append(n)
    return out


def broadcasts(small: tuple[int, ...], big: tuple[int, ...]) -> bool:
    """Does a value of shape ``small`` broadcast to ``big`` (right-aligned)?"""
    if len(small) > len(big):
        return False
    return all(s == 1 or s == b for s, b in zip(reversed(small), reversed(big)))


class _Deps:
    """Which groups read which (through node operands), for cycle checks while groups merge."""

    def __init__(self, fl: Flow) -> None:
        self.fl = fl
        self.home: dict[int, _Work] = {}  # node id -> the group that computes (and may write) it
        self.reads: dict[int, set[int]] = {}  # group id -> ids of groups it reads
        self.by_id: dict[int, _Work] = {}

    def add_group(self, g: _Work) -> None:
        self.by_id[id(g)] = g
        self.reads.setdefault(id(g), set())

    def put(self, g: _Work, n: Expr) -> None:
        self.home[id(n)] = g
        for s in self.fl.reads[id(n)]:
            h = self.home.get(id(s))
            if h is not None and h is not g:
                self.reads[id(g)].add(id(h))

    def merge(self, a: _Work, b: _Work) -> None:
        """``b``'s nodes now live in ``a``."""
        for m in b.nodes:
            self.home[id(m)] = a
        self.reads[id(a)] |= self.reads.pop(id(b))
        self.reads[id(a)].discard(id(a))
        self.reads[id(a)].discard(id(b))
        del self.by_id[id(b)]
        for r in self.reads.values():
            if id(b) in r:
                r.discard(id(b))
                r.add(id(a))
        for gid, r in self.reads.items():
            r.discard(gid)

    def reaches(self, a: _Work, b: _Work) -> bool:
        """Does ``a`` read, through any chain of groups, something ``b`` writes?"""
        stack, seen = [id(a)], {id(a)}
        while stack:
            for d in self.reads[stack.pop()]:
                if d == id(b):
                    return True
                if d not in seen:
                    seen.add(d)
                    stack.append(d)
        return False


# ---- pass 1: greedy partition ----------------------------------------------------------------
class _Partitioner:
    """The groups of :func:`partition`, built node by node in topological order."""

    def __init__(self, graph: Graph, fl: Flow, config: FusionConfig, solo: frozenset[int]) -> None:
        self.graph, self.fl, self.solo = graph, fl, solo
        self.cap = config.max_fusion_ops
        self.requested = {id(e) for _, e in graph.outputs}
        self.consumers = _consumers(graph, fl)
        self.groups: list[_Work] = []
        self.deps = _Deps(fl)
        self._alone: dict[int, bool] = {}  # contraction id -> alone_in_rows

    def new(self, n: Expr, shape: tuple[int, ...], axes: tuple[int, ...], role: Role) -> _Work:
        g = _Work(tuple(shape), tuple(axes))
        self.groups.append(g)
        self.deps.add_group(g)
        self.put(g, n, role)
        return g

    def put(self, g: _Work, n: Expr, role: Role) -> None:
        g.nodes.append(n)
        g.roles[id(n)] = role
        self.deps.put(g, n)

    def closed(self, g: _Work, n: Expr) -> bool:
        """``n`` cannot join ``g``: ``g`` is full, or either is kept apart (``solo``) and they are
        not parts of one op the user wrote (a composite in a small group stays one kernel)."""
        if self.graph.ops([*g.nodes, n]) > self.cap:
            return True
        if id(n) not in self.solo and not any(id(m) in self.solo for m in g.nodes):
            return False
        op = self.graph.written.get(id(n))
        return op is None or any(self.graph.written.get(id(m)) != op for m in g.nodes)

    def private_to(self, g: _Work, n: Expr) -> bool:
        """``g`` is pointwise, requested nowhere, and read only by itself and ``n``."""
        if g.is_row or any(id(m) in self.requested for m in g.nodes):
            return False
        members = {id(m) for m in g.nodes} | {id(n)}
        return all(id(c) in members for m in g.nodes for c in self.consumers.get(id(m), ()))

    def role_in(self, g: _Work, n: Expr, also: _Work | None = None) -> Role | None:
        """The role ``n`` would have in ``g`` (merged with ``also``), or None if it cannot join."""
        shape = self.graph.of(n).shape
        gemm = g.contraction is not None or (also is not None and also.contraction is not None)
        if gemm and (REGISTRY[n.op].kind is OpKind.MOVEMENT or shape != g.shape):
            return None  # a GEMM's epilogue is pointwise at the product's own tile coordinates
        if reindexes(n):  # its cone's boundaries are read from memory: written by other kernels first
            if any(self.deps.home.get(id(s)) in (g, also) for s in self.fl.reads[id(n)]):
                return None
            if shape == g.shape:
                return Role.FULL
            if g.is_row and shape == g.keep_shape():
                return Role.KEEP
            return Role.DROP if g.is_row and shape == g.drop_shape() else None
        view = REGISTRY[n.op].kind is OpKind.MOVEMENT
        if not g.is_row:
            if view and any(self.deps.home.get(id(s)) in (g, also) for s in n.srcs):
                return None  # reindexing a value computed in this kernel: it must be written first
            return Role.FULL if shape == g.shape else None
        homes = [h for h in (g, also) if h is not None]
        inner = [h.role(s) for s in n.srcs for h in homes if self.deps.home.get(id(s)) is h]
        if view and inner:  # a per-row value regains its reduced dims
            ok = inner == [Role.DROP] and tuple(sorted(n.attr("axes"))) == g.axes and shape == g.keep_shape()
            return Role.KEEP if ok else None
        if Role.DROP in inner:
            return Role.DROP if shape == g.drop_shape() and all(r is Role.DROP for r in inner) else None
        if shape == g.shape:
            return Role.FULL
        if shape == g.keep_shape() and all(r is Role.KEEP for r in inner):
            return Role.KEEP
        return None

    def can_join_rows(self, a: _Work, b: _Work) -> bool:
        if len(a.nodes) + len(b.nodes) > self.cap or not _contractions_fit(a, b):
            return False
        return not self.deps.reaches(a, b) and not self.deps.reaches(b, a)

    def can_merge(self, a: _Work, b: _Work) -> bool:
        same = a.shape == b.shape and (a.axes == b.axes or not a.is_row or not b.is_row)
        if not same or len(a.nodes) + len(b.nodes) > self.cap or not _contractions_fit(a, b):
            return False
        if _two_products(self.products(), self.deps.reads[id(a)], self.deps.reads[id(b)]):
            return False  # attention's rows: a kernel computing one of them in tiles computes no other
        return not self.deps.reaches(a, b) and not self.deps.reaches(b, a)

    def products(self) -> set[int]:
        """The GEMM groups whose product a row kernel would compute inside itself, alone
        (:func:`alone_in_rows`)."""
        return {id(g) for g in self.groups if (c := g.contraction) is not None and self._in_rows(c)}

    def _in_rows(self, c: Expr) -> bool:
        if id(c) not in self._alone:
            self._alone[id(c)] = alone_in_rows(self.graph, c)
        return self._alone[id(c)]

    def merge(self, a: _Work, b: _Work) -> _Work:
        a.nodes.extend(b.nodes)
        a.roles.update(b.roles)
        a.axes = a.axes or b.axes  # a pointwise group merged with a row group becomes its prologue
        self.deps.merge(a, b)
        self.groups.remove(b)
        return a

    def src_groups(self, n: Expr) -> list[_Work]:
        out: list[_Work] = []
        for s in self.fl.reads[id(n)]:
            g = self.deps.home.get(id(s))
            if g is not None and all(g is not o for o in out):
                out.append(g)
        return out

    def add_elementwise(self, n: Expr) -> None:
        shape = self.graph.of(n).shape
        target: _Work | None = None
        absorbed: list[_Work] = []
        srcs = self.src_groups(n)

        def upstream(h: _Work) -> int:  # how many other candidates ``h`` reads from: join downstream first
            return -sum(self.deps.reaches(h, o) for o in srcs if o is not h)

        for g in sorted(srcs, key=lambda h: (not h.is_row, upstream(h))):  # row groups first
            if self.closed(g, n):
                continue
            per_row = _per_row_role(target, g, shape) if target is not None else None
            if per_row is not None and self.can_join_rows(target, g):  # type: ignore[arg-type]
                for m in g.nodes:  # a pointwise group over the rows: one value per row here
                    g.roles[id(m)] = per_row
                target = self.merge(target, g)  # type: ignore[arg-type]
                continue
            role = self.role_in(g, n) if target is None else self.role_in(target, n, also=g)
            if role is not None and (target is None or self.can_merge(target, g)):
                target = g if target is None else self.merge(target, g)
            elif (
                not g.is_row
                and g.contraction is None
                and g.shape != shape
                and broadcasts(g.shape, shape)
                and self.private_to(g, n)
            ):
                absorbed.append(g)
        if target is not None:
            # a private producer that reads the target's outputs (through other kernels) stays apart
            absorbed = [
                g
                for g in absorbed
                if not self.deps.reaches(g, target) and (target.contraction is None or not _re_indexes(g))
            ]
            homes = (self.deps.home.get(id(s)) for s in self.fl.reads[id(n)])
            others = {id(h): h for h in homes if h is not None and h is not target}
            if any(self.deps.reaches(h, target) for h in others.values() if h not in absorbed):
                target = None
        if target is None:
            target = self.new(n, shape, (), Role.FULL)
        else:
            role = self.role_in(target, n)
            assert role is not None
            self.put(target, n, role)
        for g in absorbed:
            if g not in self.groups:
                continue
            for m in g.nodes:  # recomputed where ``n`` is: per row when ``n`` is a per-row value
                g.roles[id(m)] = target.role(n)
            self.merge(target, g)

    def add_reduction(self, n: Expr) -> None:
        (u,) = n.srcs
        in_shape = self.graph.of(u).shape
        axes = n.attr("axis")
        role = Role.KEEP if n.attr("keepdim") else Role.DROP
        g = self.deps.home.get(id(u))
        if g is not None and not self.closed(g, n):
            if g.is_row and g.role(u) is Role.KEEP and axes == g.axes and in_shape == g.keep_shape():
                self.put(g, n, role)  # reducing a per-row value over its size-1 dims only reshapes it
                return
            if g.shape == in_shape and g.role(u) is Role.FULL and g.contraction is None:
                if not g.is_row:
                    g.axes = axes
                if g.axes == axes:
                    self.put(g, n, role)
                    return
        self.new(n, in_shape, axes, role)


def partition(graph: Graph, fl: Flow, config: FusionConfig, solo: frozenset[int]) -> tuple[Group, ...]:
    """Groups built in topological order; nodes in ``solo`` get a kernel of their own."""
    parts = _Partitioner(graph, fl, config, solo)
    for n in graph.nodes:
        if is_leaf(n, graph.info) or id(n) in fl.free:
            continue
        kind = REGISTRY[n.op].kind
        if kind is OpKind.REDUCTION:
            parts.add_reduction(n)
        elif kind is OpKind.CONTRACTION:  # its operands are read from memory (written by other kernels)
            parts.new(n, graph.of(n).shape, (), Role.FULL)
        else:
            parts.add_elementwise(n)
    order = _order(graph)
    return tuple(g.freeze(order) for g in parts.groups)


def _re_indexes(g: _Work) -> bool:
    """Does ``g`` hold movement ops (or recompute values at re-indexed coordinates)? A GEMM's
    epilogue cannot: it computes at the product's own tile coordinates."""
    return bool(g.free) or any(REGISTRY[m.op].kind is OpKind.MOVEMENT for m in g.nodes)


def _contractions_fit(a: _Work, b: _Work) -> bool:
    """One kernel holds at most one contraction, and a GEMM merges only with pointwise groups that
    re-index nothing (its epilogue)."""
    ca, cb = a.contraction, b.contraction
    if ca is None and cb is None:
        return True
    if ca is not None and cb is not None:
        return False
    other = b if ca is not None else a
    return not other.is_row and not _re_indexes(other)


def _per_row_role(target: _Work, g: _Work, consumer: tuple[int, ...]) -> Role | None:
    """The role a pointwise group ``g`` over ``target``'s rows would have inside it, if a consumer
    of ``consumer``'s shape can then join too (a DROP value feeds only DROP values)."""
    if not target.is_row or g.is_row:
        return None
    if g.shape == target.drop_shape() and consumer == target.drop_shape():
        return Role.DROP
    if g.shape == target.keep_shape() and consumer in (target.keep_shape(), target.shape):
        return Role.KEEP
    return None


# ---- shared by the later passes ------------------------------------------------------------------
def _homes(groups: tuple[Group, ...] | list[_Work]) -> dict[int, int]:
    """node id -> index of the first group containing it (the one that computes and writes it)."""
    out: dict[int, int] = {}
    for i, g in enumerate(groups):
        for m in g.nodes:
            out.setdefault(id(m), i)
    return out


def _group_reads(g: Group | _Work, fl: Flow, homes: dict[int, int], self_index: int) -> set[int]:
    members = {id(m) for m in g.nodes}
    reads = {homes[id(s)] for m in g.nodes for s in fl.reads[id(m)] if id(s) in homes and id(s) not in members}
    return reads - {self_index}


def _reaches(reads: list[set[int]], a: int, b: int) -> bool:
    stack, seen = [a], {a}
    while stack:
        for d in reads[stack.pop()]:
            if d == b:
                return True
            if d not in seen:
                seen.add(d)
                stack.append(d)
    return False


# ---- pass 2: siblings --------------------------------------------------------------------------
def merge_siblings(
    graph: Graph, fl: Flow, groups: tuple[Group, ...], config: FusionConfig, solo: frozenset[int]
) -> tuple[Group, ...]:
    """Independent groups over the same domain become one kernel (shared inputs read once): two
    over the same axes, or a pointwise group and a row kernel over its shape (which computes the
    pointwise values at every element beside its rows' reductions: attention's backward writes
    ``dO`` over the row sum in the kernel computing its row term)."""
    work = [_Work.of(g) for g in groups]
    by_domain: dict[tuple, list[int]] = {}
    for i, g in enumerate(work):
        if not any(id(m) in solo for m in g.nodes) and not views_of_inputs(g.nodes):
            by_domain.setdefault(g.shape, []).append(i)
    alive = [True] * len(work)
    homes = _homes(work)
    reads = [_group_reads(g, fl, homes, i) for i, g in enumerate(work)]
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
                if not _contractions_fit(work[a], work[b]) or _two_products(products, reads[a], reads[b]):
                    continue
                if _reaches(reads, a, b) or _reaches(reads, b, a):
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
    order = _order(graph)
    return tuple(g.freeze(order) for g, ok in zip(work, alive) if ok)


def views_of_inputs(nodes: list[Expr] | tuple[Expr, ...]) -> bool:
    """Do ``nodes`` only reshape (or insert dims of one into) variables? Where torch could view
    them at the inputs' strides, ``lower._views`` launches nothing for them."""
    return all((REGISTRY[n.op].regroups or REGISTRY[n.op].view) and n.srcs[0].is_var for n in nodes)


def _two_products(products: set[int], a: set[int], b: set[int]) -> bool:
    """Do siblings reading groups ``a`` and ``b`` read two different ``products`` (GEMMs a row
    kernel would compute inside itself, alone: :func:`alone_in_rows`)? Merged, the other product
    would be written and read back."""
    pa, pb = products & a, products & b
    return bool(pa and pb and pa != pb)


# ---- pass 3: per-row math on leaves ------------------------------------------------------------
def absorb_per_row(
    graph: Graph, fl: Flow, groups: tuple[Group, ...], config: FusionConfig, solo: frozenset[int]
) -> tuple[Group, ...]:
    """Math on leaves only (e.g. rstd from a saved variance) is recomputed in every kernel reading it.

    Such a group would otherwise be a launch of its own whose results are written and read
    back; its values broadcast to each reader's domain, per row (KEEP) where they fit. A reader
    that sees them only through views with size-1 dims inserted (``g[:, None]`` of a per-row
    cotangent) recomputes them at the view's coordinates (free nodes of a coordinate kernel).
    """
    requested = {id(e) for _, e in graph.outputs}
    consumers = _consumers(graph, fl)
    work = [_Work.of(g) for g in groups]
    alive = [True] * len(work)
    for pi, p in enumerate(work):
        if p.is_row or p.contraction is not None or any(id(m) in requested or id(m) in solo for m in p.nodes):
            continue  # a GEMM is never recomputed
        homes = _homes([w for w, ok in zip(work, alive) if ok])
        live = [w for w, ok in zip(work, alive) if ok]
        members = {id(m) for m in p.nodes}
        if any(id(s) in homes and id(s) not in members for m in p.nodes for s in fl.reads[id(m)]):
            continue  # reads another kernel's output
        readers: dict[int, _Work] = {}
        for m in p.nodes:
            for c in consumers.get(id(m), ()):
                h = live[homes[id(c)]]
                if h is not p:
                    readers[id(h)] = h
        cap = config.max_fusion_ops

        def uses(r: _Work) -> list[Expr]:
            inside = {id(n) for n in r.nodes}
            return [c for m in p.nodes for c in consumers.get(id(m), ()) if id(c) in inside and id(c) not in members]

        def plain(r: _Work) -> bool:  # read by broadcasting (right-aligned): members of ``r``
            return broadcasts(p.shape, r.shape) and not any(REGISTRY[c.op].view for c in uses(r))

        def through_views(r: _Work) -> bool:  # read through size-1 dims inserted: free nodes of ``r``
            return all(REGISTRY[c.op].view and broadcasts(graph.of(c).shape, r.shape) for c in uses(r))

        def gemm_operand(r: _Work) -> bool:  # a GEMM reads its operands from memory, re-indexes nothing
            if r.contraction is None:
                return False
            return _re_indexes(p) or not plain(r) or any(c is r.contraction for c in uses(r))

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
            role = _per_row(r, p.shape)
            for m in p.nodes:
                r.roles[id(m)] = role
            r.nodes[:0] = p.nodes
        alive[pi] = False
    order = _order(graph)
    return tuple(g.freeze(order) for g, ok in zip(work, alive) if ok)


def _per_row(r: _Work, shape: tuple[int, ...]) -> Role:
    """The role of a value of ``shape`` recomputed in ``r``: per row when it is one value per row
    (KEEP with the reduced dims kept; DROP when they are the leading dims, so that broadcasting the
    value against the domain reads it per row), else FULL (broadcast over the whole tile)."""
    if not r.is_row or shape == r.shape:
        return Role.FULL
    if shape == r.keep_shape():
        return Role.KEEP
    leading = r.axes == tuple(range(len(r.axes)))
    return Role.DROP if leading and shape == r.drop_shape() else Role.FULL


# ---- pass 4: recompute elementwise values instead of reading them back ------------------------
def recompute_elementwise(
    graph: Graph, fl: Flow, groups: tuple[Group, ...], config: FusionConfig, solo: frozenset[int]
) -> tuple[Group, ...]:
    """A kernel reading another's elementwise value recomputes it from leaves instead.

    E.g. layer_norm's backward: the weight-gradient column reduction recomputes ``g * xhat``
    rather than have the row kernel write it and read it back.
    """
    work = [_Work.of(g) for g in groups]
    homes = _homes(work)
    requested = {id(e) for _, e in graph.outputs}
    # operands of a product recomputed in tiles are read from memory wherever it is computed: their
    # home writes them, and a copy here would shadow that load in a GEMM that later takes the
    # product into its prologue (linear cross-entropy over tanh(h): d/dh's epilogue recomputing
    # tanh(h) made the recomputed logits read it at the output's coordinates, d/dh wrong)
    stored = {id(x) for n in graph.nodes if _tileable(graph, n) for x in n.srcs}
    consumers = _consumers(graph, fl)

    def ancestry(s: Expr, r1: _Work, r2: _Work) -> list[Expr] | None:
        """``s`` and what it needs inside ``r1``, if all of it is elementwise over leaves and fits ``r2``
        (a requested value is written anyway: it is read back, and its home stays the kernel that writes it)."""
        out: list[Expr] = []
        stack, seen = [s], set()
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            kind = REGISTRY[n.op].kind
            if (
                id(n) in solo
                or id(n) in requested
                or id(n) in stored
                or (kind is not OpKind.ELEMENTWISE and not positions_only(n))  # positions read nothing
                or r1.role(n) is Role.DROP
                or not broadcasts(graph.of(n).shape, r2.shape)
            ):
                return None
            out.append(n)
            for src in read_srcs(n):
                if id(src) in homes and work[homes[id(src)]] is r1:
                    stack.append(src)
                elif not is_leaf(src, graph.info):
                    return None  # another kernel's output: reading it here could order kernels in a cycle
        return out

    for r2 in work:
        for m in list(r2.nodes):
            if REGISTRY[m.op].view or REGISTRY[m.op].kind is OpKind.CONTRACTION:
                continue  # a view of the value is not the value broadcast; a GEMM loads its operands
            for s in fl.reads[id(m)]:
                if id(s) not in homes:
                    continue
                r1 = work[homes[id(s)]]
                if r1 is r2 or id(s) in {id(x) for x in r2.nodes}:
                    continue
                chain = ancestry(s, r1, r2)
                if chain is None or graph.ops(r2.nodes + list(chain)) > config.max_fusion_ops:
                    continue
                c = r2.contraction
                if c is not None and any(x is n for n in chain for x in c.srcs):
                    continue  # the GEMM loads that operand: its epilogue reads it back too (``a + a @ w``)
                roles = dict(r2.roles)
                for n in chain:
                    r2.roles[id(n)] = _per_row(r2, graph.of(n).shape)
                r2.nodes[:0] = chain
                if _cyclic(graph, work, [], fl, requested, consumers):  # the copy would be read from r2
                    r2.nodes[: len(chain)], r2.roles = [], roles  # (a [4, 1] value at r2's domain exactly)
    # a kernel whose every value its readers now recompute (a causal mask's positions) is gone
    order = _order(graph)
    return tuple(g.freeze(order) for g in work if _writes(g, work, requested, consumers))


# ---- pass 5: reductions over a product ----------------------------------------------------------
def fuse_product_rows(graph: Graph, fl: Flow, groups: tuple[Group, ...], solo: frozenset[int]) -> tuple[Group, ...]:
    """A GEMM whose every output only a row kernel reads, reducing them over the product's last
    axis, moves into that row kernel: it computes each ``[rows, block]`` tile of the product with
    ``tl.dot`` where it would have loaded it, so the product is never written (linear
    cross-entropy: a tokens x vocabulary product reduced to a logsumexp and a target logit).

    Only for a product :func:`reduced_in_rows` (the backward recomputes exactly those), when nothing
    of the product's size is written (the row kernel's outputs are per row) and the product is read
    at its own coordinates (no movement op re-indexes it)."""
    requested = {id(e) for _, e in graph.outputs}
    consumers = _consumers(graph, fl)
    work = [_Work.of(g) for g in groups]
    dead: set[int] = set()
    for r in work:
        if not r.is_row or r.contraction is not None or r.axes != (len(r.shape) - 1,):
            continue
        # every product the row kernel reads, each tile computed where it is read (one if alone_in_rows)
        while gemm := _product_of(r, [w for w in work if id(w) not in dead], graph, fl, consumers, requested, solo):
            c = gemm.contraction
            assert c is not None
            for m in gemm.nodes:
                r.roles[id(m)] = Role.FULL
            r.nodes[:0] = gemm.nodes
            info = graph.of(c)
            r.notes.append(
                f"{_label(c, graph)}: the product is computed tile by tile in this row kernel and never "
                f"written ({info.nbytes} bytes not stored or read back)"
            )
            dead.add(id(gemm))
    order = _order(graph)
    return tuple(g.freeze(order) for g in work if id(g) not in dead)


#: the widest product a GEMM reading a tiled product as its A operand may have: one tile of its
#: columns, so the prologue recomputes each tile of the tiled product once (attention's ``P @ v``
#: over a head dim)
NARROW_PRODUCT = 256


def alone_in_rows(graph: Graph, c: Expr) -> bool:
    """Is ``c`` a product a row kernel computes in tiles (:func:`reduced_in_rows`) and no other with
    it: one whose right operand has batch dims (attention's keys), the kernel's rows kept to its
    batch? Products of a layer's weight share a row kernel (a student's and a teacher's logits,
    each tile of both computed where the loss reads them)."""
    return len(graph.of(c.srcs[1]).shape) > 2 and reduced_in_rows(graph, c)


def reduced_in_rows(graph: Graph, c: Expr) -> bool:
    """Is contraction ``c``'s product only reduced over its last axis, through elementwise ops of
    its shape, and never requested? A row kernel then computes it in tiles
    (:func:`fuse_product_rows`) and a backward recomputes it rather than the forward saving it.
    Where its right operand has batch dims (an activation: attention's keys), a value of it may
    also be the A operand of a narrow product (:data:`NARROW_PRODUCT`), whose prologue recomputes
    it: attention's probabilities, reduced to their row statistics and multiplied by ``v``."""
    shape = graph.of(c).shape
    if c.attr("sum_batch"):
        return False
    # a right operand with batch dims is an activation (attention's keys), not a layer's weight
    batched = len(graph.of(c.srcs[1]).shape) > 2
    requested = {id(e) for _, e in graph.outputs}
    readers: dict[int, list[Expr]] = {}
    for n in graph.nodes:
        for s in read_srcs(n):
            readers.setdefault(id(s), []).append(n)
    stack, seen = [c], {id(c)}
    while stack:
        n = stack.pop()
        if id(n) in requested:
            return False
        for r in readers.get(id(n), ()):
            kind = REGISTRY[r.op].kind
            if kind is OpKind.REDUCTION and tuple(r.attr("axis")) == (len(shape) - 1,):
                continue
            if kind is OpKind.CONTRACTION and batched and _narrow_reader(graph, r, n):
                continue
            if kind is not OpKind.ELEMENTWISE or graph.of(r).shape != shape:
                return False
            if id(r) not in seen:
                seen.add(id(r))
                stack.append(r)
    return True


def _narrow_reader(graph: Graph, r: Expr, n: Expr) -> bool:
    """Does contraction ``r`` read ``n`` only as its A operand, with at most :data:`NARROW_PRODUCT`
    columns: untransposed (``n``'s rows kept, its last axis contracted: attention's ``P @ v``,
    ``dS @ k``) or transposed (its columns kept, its rows contracted: ``P.T @ dO``, ``dS.T @ q``)?"""
    a, b = r.srcs
    kept = -1 if r.attr("ta") else -2  # the axis of ``n`` the product's rows run along
    out, shape = graph.of(r).shape, graph.of(n).shape
    summed = r.attr_dict.get("summed", 0)  # its last batch dims summed in the K loop: of one in ``out``
    batch = (*shape[: len(shape) - 2 - summed], *(1,) * summed)
    return (
        a is n
        and b is not n
        and not r.attr("sum_batch")
        and out[-1] <= NARROW_PRODUCT
        and out[:-2] == batch
        and out[-2] == shape[kept]
    )


def _recomputable(x: Expr, n: Expr, graph: Graph) -> bool:
    """Is ``x`` (a reader of ``n``) a narrow GEMM reading it as its A operand
    (:func:`_narrow_reader`), any GEMM reading it as an operand where ``n`` is computed from a
    product marked ``recompute`` (a backward's: never written, whatever the GEMM's width), a sum
    of it over its rows (a mergeable reduction: a bias gradient, summed in the K loop of the GEMM
    reading it transposed, ``_reduce_in_k_loop``), or elementwise on the way to such readers only?
    Their prologues recompute it from the product."""
    if REGISTRY[x.op].kind is OpKind.CONTRACTION:
        return _narrow_reader(graph, x, n) or (any(s is n for s in x.srcs) and not _untiled(n, graph))
    if REGISTRY[x.op].kind is OpKind.REDUCTION:
        rank = len(graph.of(n).shape)
        leading = tuple(range(rank - 1))
        return REGISTRY[x.op].reduce is not None and rank >= 2 and tuple(sorted(x.attr("axis"))) == leading
    if REGISTRY[x.op].kind is not OpKind.ELEMENTWISE:
        return False
    readers = [r for r in graph.nodes if any(s is x for s in read_srcs(r))]
    return bool(readers) and all(_recomputable(r, x, graph) for r in readers)


def _product_of(
    r: _Work,
    work: list[_Work],
    graph: Graph,
    fl: Flow,
    consumers: dict[int, list[Expr]],
    requested: set[int],
    solo: frozenset[int],
) -> _Work | None:
    """The GEMM kernel row kernel ``r`` can compute inside itself (see :func:`fuse_product_rows`)."""
    members = {id(m) for m in r.nodes}
    full = [m for m in r.nodes if r.role(m) is Role.FULL]

    def outside(x: Expr, m: Expr) -> bool:  # read by another kernel that does not recompute it from the product
        return id(x) not in members and not _recomputable(x, m, graph)

    if any(id(m) in requested or any(outside(x, m) for x in consumers.get(id(m), ())) for m in full):
        return None  # it writes a value of the product's size: the product would be computed twice
    homes = _homes(work)
    read = {homes[id(s)] for m in r.nodes for s in fl.reads[id(m)] if id(s) in homes and id(s) not in members}
    reads = [_group_reads(g, fl, homes, i) for i, g in enumerate(work)]
    own = [m for m in r.nodes if REGISTRY[m.op].kind is OpKind.CONTRACTION]
    for h in read:
        gemm = work[h]
        c = gemm.contraction
        if c is None or gemm.is_row or gemm.shape != r.shape or any(id(m) in solo for m in gemm.nodes):
            continue
        if any(x != h and _reaches(reads, x, h) for x in read):
            # another kernel the row kernel reads depends on this one (a sibling merged beside the
            # product computes an operand of another product: the hidden size equal to the
            # vocabulary's): inside the row kernel, the two would read each other
            continue
        if not _tileable(graph, c):  # as the backward decides not to save it (or it is the backward's)
            continue
        if own and any(alone_in_rows(graph, x) for x in (c, *own)):
            continue  # a batched right operand keeps the kernel's rows to one batch: no other product
        inside = {id(m) for m in gemm.nodes}
        if any(gemm.role(m) is not Role.FULL or id(m) in requested for m in gemm.nodes):
            continue
        if any(id(s) in inside or id(s) in members for s in c.srcs):
            continue  # an operand computed beside the product: its tiles would need a prologue
        if any(id(s) in inside for x in own for s in x.srcs):
            continue  # it computes an operand of a product already inside (read as loaded tiles)
        readers = [(x, m) for m in gemm.nodes for x in consumers.get(id(m), ()) if id(x) not in inside]
        # a reader elsewhere recomputes the product in a narrow GEMM's prologue (attention's P @ v)
        if any(reindexes(x) or outside(x, m) for x, m in readers):
            continue
        return gemm
    return None


# ---- pass 6: GEMM prologues ----------------------------------------------------------------------
def absorb_prologues(
    graph: Graph, fl: Flow, groups: tuple[Group, ...], config: FusionConfig, solo: frozenset[int]
) -> tuple[Group, ...]:
    """A GEMM recomputes an elementwise operand at load time, per tile (its prologue).

    The operand's elementwise cone inside the kernel that computes it (over that kernel's inputs:
    no reduction, no movement op) is copied into every GEMM reading the operand, when the traffic
    model (:mod:`rtxdsl.lower.prologue`) says recomputing it per tile costs less than writing it
    and reading it back. Its home kernel then stops writing it, and disappears if nothing else of
    it is needed. Each candidate's choice is a note on the GEMM's group (``explain()``). A choice
    that would make two kernels read each other's values (a statistic moved into a GEMM whose
    epilogue reads what another kernel computes from that statistic: split-KV decoding's merge
    weights) is undone (``_cyclic``).
    """
    st = _Absorb(graph, fl, groups, config, solo)
    for s in (n for n in graph.nodes if id(n) in st.readers and id(n) not in st.stored):
        before = st.snapshot()
        st.absorb(s)
        if _cyclic(graph, st.work, st.emptied, fl, st.requested, st.consumers):
            st.restore(before)
    dead = {id(h) for h in st.emptied if not _writes(h, st.work, st.requested, st.consumers)}
    order = _order(graph)
    return tuple(g.freeze(order) for g in st.work if id(g) not in dead)


class _Absorb:
    """``absorb_prologues``'s state: the kernels, what each GEMM's prologues hold, the kernels
    emptied of an operand now recomputed."""

    def __init__(
        self, graph: Graph, fl: Flow, groups: tuple[Group, ...], config: FusionConfig, solo: frozenset[int]
    ) -> None:
        self.graph, self.config, self.solo = graph, config, solo
        self.requested = {id(e) for _, e in graph.outputs}
        self.consumers = _consumers(graph, fl)
        self.work = [_Work.of(g) for g in groups]
        self.homes = _homes(self.work)
        self.readers = _gemm_readers(self.work, self.homes)
        self.taken: dict[int, set[int]] = {id(w): set() for w in self.work}  # nodes already in a GEMM's prologues
        self.emptied: list[_Work] = []  # kernels that computed an operand now recomputed: still needed?
        # a product recomputed in tiles reads its operands from memory wherever it is computed: they
        # are written, and no GEMM recomputes them (it would hold the value both as a member and a load)
        self.stored = {id(x) for n in graph.nodes if _tileable(graph, n) for x in n.srcs}
        self.writable = _writable(self.work, graph)
        self.in_kernels = {id(m) for w in self.work for m in w.nodes}  # not the free nodes: never written

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
        home = work[self.homes[id(s)]]
        tiled = _product_cone(s, graph, consumers, self.writable, self.in_kernels)
        if tiled is not None:  # a product no kernel writes: every reader computes it in its K loop
            found = _recompute_in_prologues(s, tiled, self.readers, work, graph, consumers, requested)
            if found is not None:
                self.emptied += found
                return
        cone = _elementwise_cone(s, home, self.solo)
        gemm_readers = self.readers[id(s)]
        chain, bounds = cone if cone is not None else ([], [])
        if cone is None or any(
            self.taken[id(w)] & {id(m) for m in chain}
            or graph.ops(w.nodes + chain) > self.config.max_fusion_ops
            or _epilogue_reads(w, chain, consumers)
            or _holds_other_operand(w, side, chain)
            or _crosses_tiles(w, side, chain, bounds)
            for w, side in gemm_readers
        ):
            return
        inside = {id(m) for m in home.nodes}
        gemm_nodes = {id(w.contraction) for w, _ in gemm_readers}
        outside = [c for c in consumers.get(id(s), ()) if id(c) not in gemm_nodes]
        written = id(s) in requested or any(id(c) not in inside for c in outside)
        members = {id(m) for m in chain}
        computed = written or any(id(c) in inside and id(c) not in members for c in outside)
        info = graph.of(s)
        choice = choose(
            _label(s, graph),
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
                    w.roles[id(m)] = side
                w.nodes[:0] = chain
                self.taken[id(w)] |= members
        if choice.fuse:
            self.emptied.append(home)
            if not computed:  # its own kernel no longer computes what only the GEMMs read
                kept = _still_needed(chain, home, members, consumers)
                home.nodes = [m for m in home.nodes if id(m) not in members or id(m) in kept]
            for w, side in gemm_readers:  # once every reader recomputes it
                if side is Role.A:
                    self.emptied += _reduce_in_k_loop(w, [s], work, graph, consumers, requested)


def _cyclic(
    graph: Graph, work: list[_Work], emptied: list[_Work], fl: Flow, requested: set[int], consumers: dict
) -> bool:
    """Would the kernels left (an emptied one that writes nothing is dropped) read each other's
    values in a cycle, so that none could launch first? Each value read from the kernel that
    writes it, as ``finish`` orders them (``_writers``: a copy a GEMM's prologue recomputes is
    not where it is read from)."""
    dead = {id(h) for h in emptied if not _writes(h, work, requested, consumers)}
    live = [w for w in work if id(w) not in dead]
    homes = _writers(graph, live)  # type: ignore[arg-type]
    deps = {}
    for i, w in enumerate(live):
        inside = {id(m) for m in (*w.nodes, *w.free)}
        reads = {homes.get(id(s)) for m in (*w.nodes, *w.free) for s in fl.reads[id(m)] if id(s) not in inside}
        deps[i] = {r for r in reads if r is not None} - {i}
    try:
        tuple(graphlib.TopologicalSorter(deps).static_order())
    except graphlib.CycleError:
        return True
    return False


#: the products one K loop sums at most (an fp32 accumulator each: at sm_90's 64 x 128 bf16 tile
#: beside two others, q, k and v of Llama-2-7B's attention take 166 registers, no spill)
SHARED_PRODUCTS = 3


def merge_products(
    graph: Graph, fl: Flow, groups: tuple[Group, ...], config: FusionConfig, solo: frozenset[int]
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
    work = [_Work.of(g) for g in groups]
    homes = _homes(work)
    reads = [_group_reads(g, fl, homes, i) for i, g in enumerate(work)]
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
                how = f"beside {_label(ca, graph)}: one K loop, their prologues' recomputed product once"
            elif side is not None and (id(ca.srcs[side]) in ga.roles) == (id(cb.srcs[side]) in gb.roles):
                # (the shared operand: a prologue in both kernels or read by both)
                if not _operands_at_tiles(ga, gb, (Role.A, Role.B)) or products[a] == SHARED_PRODUCTS:
                    continue
                if sharing[a] not in (None, (side, ca.srcs[side])):
                    continue  # every product of one K loop shares the one operand (q, k and v: x)
                sharing[a] = (side, ca.srcs[side])
                how = f"shares {_label(ca.srcs[side], graph)} with {_label(ca, graph)}: one K loop"
            elif products[a] == 1 and _summed_beside(ga, gb, graph) and (a in reads[b] or b in reads[a]):
                plain[a] = False  # a K loop of its own: no third product
                how = f"read with {_label(ca, graph)}: its own K loop in one kernel, neither written for the other"
            else:
                continue
            ga.nodes.extend(gb.nodes)
            ga.roles.update(gb.roles)
            ga.notes += [note for note in gb.notes if note not in ga.notes]
            ga.notes.append(f"{_label(cb, graph)} {how}")
            alive[b] = False
            products[a] += 1
            reads[a] = (reads[a] | reads[b]) - {a, b}
            for r in reads:
                if b in r:
                    r.discard(b)
                    r.add(a)
            reads[b] = set()
    order = _order(graph)
    return tuple(g.freeze(order) for g, ok in zip(work, alive) if ok)


def _summed_beside(ga: _Work, gb: _Work, graph: Graph) -> bool:
    """Can one kernel compute both GEMMs' products, the second in a K loop of its own? Their
    products have one shape and their operands are loaded as stored (no prologue)."""
    ca, cb = ga.contraction, gb.contraction
    assert ca is not None and cb is not None
    return graph.of(ca).shape == graph.of(cb).shape and _operands_at_tiles(ga, gb, ())


def _operands_at_tiles(ga: _Work, gb: _Work, prologues: tuple[Role, ...]) -> bool:
    """Is each operand of both kernels' products read from memory or computed by a prologue (a
    role in ``prologues``), never a value one of them computes at its output tile (``h`` of
    ``dy @ wd``'s epilogue, the operand of ``dy.T @ h``: at the product's coordinates, not the
    operand's; a merged kernel would read it at the wrong ones), directly or through a prologue?"""
    roles = {**ga.roles, **gb.roles}
    operands = [s for g in (ga, gb) if (c := g.contraction) is not None for s in c.srcs]
    if not all(id(s) not in roles or roles[id(s)] in prologues for s in operands):
        return False
    # nor does a prologue read a value the other kernel computes at its output tile (a residual
    # over the other's product, ``(x + rms_norm(x) @ w) @ w``: its product read before it exists)
    return all(_prologue_reads_at_tiles(g, h.roles, prologues) for g, h in ((ga, gb), (gb, ga)))


def _prologue_reads_at_tiles(g: _Work, other: dict[int, Role], prologues: tuple[Role, ...]) -> bool:
    """Does every prologue node of ``g`` read only loads, its own nodes, or ``other``'s prologues?"""
    at_tiles = [m for m in g.nodes if g.roles.get(id(m)) in prologues]
    return all(id(s) not in other or other[id(s)] in prologues for m in at_tiles for s in m.srcs)


def shared_operand(a: Expr, b: Expr, graph: Graph) -> int | None:
    """The operand (0: left, 1: right) contractions ``a`` and ``b`` share, read the same way, where
    their products have one shape (so one K loop sums both; matmul's operands have one dtype), or None."""
    if a is b or a.attrs != b.attrs or graph.of(a).shape != graph.of(b).shape:
        return None
    return next((side for side in (0, 1) if a.srcs[side] is b.srcs[side]), None)


def _plain_gemm(g: _Work, solo: frozenset[int]) -> bool:
    """A GEMM kernel that may share its K loop: one product, none recomputed, no batch summed in
    the loop, nothing kept apart by ``min_fusion_ops``."""
    c = g.contraction
    if c is None or g.is_row or g.free or any(id(m) in solo for m in g.nodes):
        return False
    if c.attr("sum_batch") or c.attr_dict.get("summed") or c.attr_dict.get("recompute"):
        return False
    return [m for m in g.nodes if REGISTRY[m.op].kind is OpKind.CONTRACTION] == [c]


def _prologue_gemm(g: _Work, solo: frozenset[int]) -> bool:
    """A GEMM kernel whose A operand is a prologue recomputing a product (attention's ``dS.T @ q``
    and ``P.T @ dO``, each recomputing ``q @ k.mT``): one product of its own, the others its
    prologue's; no reduction (an online softmax's K loop is its own product's); no value read at
    other coordinates (a transpose, a slice: the other kernel's prologue may read it as it is;
    size-1 dims inserted and positions are fine) nor recomputed where read; not every batch dim
    summed (a weight's gradient; grouped-query attention's dK and dV sum a group of heads)."""
    c = g.contraction
    if c is None or g.is_row or g.free or any(id(m) in solo for m in g.nodes):
        return False
    if c.attr("sum_batch") or c.attr_dict.get("recompute"):
        return False
    inner = [m for m in g.nodes if REGISTRY[m.op].kind is OpKind.CONTRACTION and m is not c]
    if not inner or any(g.roles[id(m)] is not Role.A for m in inner) or g.roles.get(id(c.srcs[0])) is not Role.A:
        return False
    return not any(REGISTRY[m.op].kind is OpKind.REDUCTION or _moves(m) for m in g.nodes)


def _moves(m: Expr) -> bool:
    """Does ``m`` read its operand at other coordinates than its own (a permute, a slice, a gather)?"""
    op = REGISTRY[m.op]
    return op.kind is OpKind.MOVEMENT and not op.view and not op.shape_only


def _prologues_share(ga: _Work, gb: _Work, graph: Graph) -> bool:
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
    recomputed = {id(m) for m in ga.nodes if REGISTRY[m.op].kind is OpKind.CONTRACTION and m is not ca}
    return bool(recomputed & both) and _operands_at_tiles(ga, gb, (Role.A, Role.B))


def _between(reads: list[set[int]], a: int, b: int) -> bool:
    """Does a third kernel lie on a path between kernels ``a`` and ``b`` (merged, a cycle)?"""
    return any(d != b and _reaches(reads, d, b) for d in reads[a]) or any(
        d != a and _reaches(reads, d, a) for d in reads[b]
    )


def _holds_other_operand(w: _Work, side: Role, chain: list[Expr]) -> bool:
    """Would ``side``'s prologue compute the GEMM's other operand (``mm(t * 2, t)``)? A node has one
    role: at one operand's tile, never at both; the other operand is then read from memory."""
    assert w.contraction is not None
    other = w.contraction.srcs[1 if side is Role.A else 0]
    return any(m is other for m in chain)


def _crosses_tiles(w: _Work, side: Role, chain: list[Expr], bounds: list[Expr]) -> bool:
    """Would ``side``'s prologue read a value the GEMM computes at another tile (the other operand's
    prologue: ``x @ log_softmax(x).T`` with ``x = a + b`` in A's), or compute one that another
    tile's nodes read? Each node is one value per kernel, at its role's tile: the other prologue
    would read it at the wrong coordinates (lazy fuzzer seed 20270130, program 2027013000031)."""
    other = Role.B if side is Role.A else Role.A
    members = {id(m) for m in chain}
    if any(w.roles.get(id(x)) is other for x in (*bounds, *(x for m in chain for x in m.srcs))):
        return True
    return any(w.roles.get(id(m)) is other and any(id(x) in members for x in m.srcs) for m in w.nodes)


def _product_cone(
    s: Expr, graph: Graph, consumers: dict[int, list[Expr]], writable: frozenset[int], in_kernels: set[int]
) -> list[Expr] | None:
    """:func:`_tiled_cone` of ``s`` down to the leaves or, failing that, down to per-row values a
    kernel writes (``writable``), unless a value of that cone computed from the product is also
    read by a node no kernel computes (a free node recomputing it inline, where it would not be
    cut; one computed from leaves alone, a loss's scale from its cotangents, is recomputed there
    as it is)."""
    tiled = _tiled_cone(s, graph)
    if tiled is not None:
        return tiled if _operands_loaded(tiled) else None
    tiled = _tiled_cone(s, graph, bounded=writable)
    if tiled is not None and not _operands_loaded(tiled):
        return None
    members = {id(m) for m in tiled or ()}
    if any(
        id(c) not in members and id(c) not in in_kernels and not _untiled(m, graph)
        for m in tiled or ()
        for c in consumers.get(id(m), ())
    ):
        return None
    return tiled


def _operands_loaded(cone: list[Expr]) -> bool:
    """Does no product of ``cone`` read a value the cone itself computes (``(g @ exp(s)) + (g @ s) *
    exp(s)``: ``exp(s)`` computed at the tile for the ``*`` is also ``g @ exp(s)``'s operand, which
    a product recomputed in tiles reads from memory, written by no kernel once the cone moves: the
    generated product read ``s`` in its place)? Views of inputs are loads either way."""
    computed = {id(m) for m in cone if REGISTRY[m.op].kind is OpKind.ELEMENTWISE}
    return not any(id(x) in computed for m in cone if REGISTRY[m.op].kind is OpKind.CONTRACTION for x in m.srcs)


def _writable(work: list[_Work], graph: Graph) -> frozenset[int]:
    """The values a kernel can write before the GEMMs reading them run: at its own coordinates (per
    row in a row kernel), not a GEMM's; computed without a product marked ``recompute``, unless the
    kernel computes its products in tiles itself (a backward's row sums over them)."""
    return frozenset(
        id(m)
        for w in work
        if w.contraction is None or w.is_row
        for m in w.nodes
        if _own_value(w, m, graph) and (w.contraction is not None or _untiled(m, graph))
    )


def _own_value(w: _Work, m: Expr, graph: Graph) -> bool:
    """Is ``m`` a value kernel ``w`` computes at its own coordinates (one per element of its
    domain, or one per row of a row kernel), so that it can write it?"""
    role = w.role(m)
    if w.is_row:
        return role in (Role.KEEP, Role.DROP) or (role is Role.FULL and graph.of(m).shape == w.shape)
    return role is Role.FULL and graph.of(m).shape == w.shape


def _gemm_readers(work: list[_Work], homes: dict[int, int]) -> dict[int, list[tuple[_Work, Role]]]:
    """operand id -> the GEMM kernels reading it from another kernel, as A or B (a product of a
    value with itself has no prologue: one tile cannot be both operands)."""
    readers: dict[int, list[tuple[_Work, Role]]] = {}
    for w in work:
        c = w.contraction
        if c is None or w.is_row or c.srcs[0] is c.srcs[1]:
            continue
        for side, s in zip((Role.A, Role.B), c.srcs):
            if id(s) in homes and work[homes[id(s)]] is not w:
                readers.setdefault(id(s), []).append((w, side))
    return readers


def _tiled_cone(
    s: Expr, graph: Graph, needs_product: bool = True, bounded: frozenset[int] = frozenset()
) -> list[Expr] | None:
    """``s`` and what it is computed from, down to the graph's leaves, when that includes a product
    marked ``recompute`` (one the forward never wrote): elementwise ops, views of leaves and of
    one-element values, index-only movement ops (positions) and the product itself (its operands
    read from memory).
    None when ``s`` computes no such product (unless not ``needs_product``) or needs anything else
    (a reduction, a re-indexing). ``bounded`` (values kernels can write before the GEMMs read them):
    a smaller one not computed from leaves by elementwise ops alone (a per-row cotangent: a
    preference loss's per-sequence term, sliced and broadcast to its tokens; a distillation loss's
    row sum over the products' tiles, in a row kernel computing them) is read from memory like a
    leaf instead, that kernel writing it."""
    out: list[Expr] = []
    seen: set[int] = set()
    stack, found = [s], False
    size = graph.of(s).numel
    while stack:
        n = stack.pop()
        if id(n) in seen or is_leaf(n, graph.info):
            continue
        seen.add(id(n))
        op = REGISTRY[n.op]
        if id(n) in bounded and graph.of(n).numel < size and _tiled_cone(n, graph, False) is None:
            continue  # a boundary: loaded where the cone reads it
        if op.kind is OpKind.CONTRACTION:  # its operands are read from memory, as a GEMM's are
            if not _tileable(graph, n):
                return None
            found = True
            out.append(n)
            continue
        if op.kind is OpKind.MOVEMENT:
            # a view of a leaf is a load through its strides; a view of one element broadcasts as
            # it is; positions read nothing: anything else would need coordinates of its own
            views_ok = op.view and all(is_leaf(x, graph.info) or graph.of(x).numel == 1 for x in n.srcs)
            if not views_ok and read_srcs(n):
                return None
        elif op.kind is not OpKind.ELEMENTWISE:
            return None
        out.append(n)
        stack.extend(read_srcs(n))
    return out if found or not needs_product else None


def _tileable(graph: Graph, n: Expr) -> bool:
    """Is ``n`` a product a kernel may compute in tiles where it is read, never written: one the
    forward did not save (``recompute``), or one only reduced over its rows or read by narrow
    products (:func:`reduced_in_rows`: attention's scores, and in its backward ``dO @ v.T``)?"""
    return REGISTRY[n.op].kind is OpKind.CONTRACTION and bool(n.attr_dict.get("recompute") or reduced_in_rows(graph, n))


def _untiled(n: Expr, graph: Graph) -> bool:
    """Is ``n`` computed without a product marked ``recompute`` (so a kernel can write it before a
    GEMM that recomputes the product reads it)?"""
    stack, seen = [n], set()
    while stack:
        x = stack.pop()
        if id(x) in seen or is_leaf(x, graph.info):
            continue
        seen.add(id(x))
        if REGISTRY[x.op].kind is OpKind.CONTRACTION and x.attr_dict.get("recompute"):
            return False
        stack.extend(x.srcs)
    return True


def _recompute_in_prologues(
    s: Expr,
    chain: list[Expr],
    readers: dict[int, list[tuple[_Work, Role]]],
    work: list[_Work],
    graph: Graph,
    consumers: dict[int, list[Expr]],
    requested: set[int],
) -> list[_Work] | None:
    """Operand ``s`` of its GEMM ``readers``, computed from a product no kernel writes (``chain``,
    see :func:`_tiled_cone`), becomes each reader's prologue whatever the traffic model would say:
    keeping a tokens x vocabulary buffer unwritten is the point. A value of ``chain`` that other
    GEMMs read as an operand is recomputed in theirs at once (attention's backward: ``P`` in
    ``P.T @ dO``, and ``dS``, computed from ``P``, in ``dS @ k`` and ``dS.T @ q``; neither alone
    would leave the other unwritten). The kernels that computed parts of it keep only what their
    other nodes need; those left with nothing to write are returned. Undone (None) when a value of
    ``chain`` would still be read by a kernel other than the GEMMs (:func:`_leaks`): the product
    is then written as usual."""
    members = {id(m) for m in chain}
    operands = [(s, chain)] + [
        (m, cone)
        for m in chain
        if m is not s and id(m) in readers and (cone := _tiled_cone(m, graph)) and {id(x) for x in cone} <= members
    ]
    gemm_readers = [(w, side, v, cone) for v, cone in operands for w, side in readers[id(v)]]
    if any(_epilogue_reads(w, cone, consumers) for w, _, _, cone in gemm_readers):
        return None
    before = [(w.nodes[:], dict(w.roles), w.notes[:]) for w in work]
    for w, side, v, cone in gemm_readers:
        for m in cone:
            w.roles[id(m)] = side
        w.nodes[:0] = [m for m in cone if not any(m is x for x in w.nodes)]
        w.notes.append(
            f"{_label(v, graph)}: computed from a product the forward never wrote, recomputed in tiles "
            f"in the K loop ({graph.of(v).nbytes} bytes not written)"
        )
    gemms = [(w, side) for w, side, _, _ in gemm_readers]
    others = [h for h in work if all(h is not w for w, _ in gemms)]
    loaded = _loaded_rows(chain, others, graph.of(s).numel, graph)
    homes = {id(h): h for h in others for m in h.nodes if id(m) in members}
    for home in homes.values():
        kept = _still_needed([m for m in home.nodes if id(m) in members], home, members, consumers, loaded)
        home.nodes = [m for m in home.nodes if id(m) not in members or id(m) in kept]
    emptied = list(homes.values())
    for w, side, v, cone in gemm_readers:
        if side is Role.A:
            emptied += _reduce_in_k_loop(w, [v, *cone], work, graph, consumers, requested)
    if not _leaks(chain, gemms, work, requested, consumers, loaded | _leaf_views(chain, graph)):
        return emptied
    for w, (nodes, roles, notes) in zip(work, before):  # written after all: as it was
        w.nodes, w.roles, w.notes = nodes, roles, notes
    return None


def _leaf_views(chain: list[Expr], graph: Graph) -> set[int]:
    """The views of leaves in ``chain`` (a grouped attention's mask with a group axis of one): any
    kernel reading one loads the leaf through its strides, so another kernel reading it as well
    keeps nothing written."""
    return {id(m) for m in chain if REGISTRY[m.op].view and all(is_leaf(x, graph.info) for x in read_srcs(m))}


def _epilogue_reads(w: _Work, chain: list[Expr], consumers: dict[int, list[Expr]]) -> bool:
    """Does GEMM ``w``'s epilogue read a value of ``chain`` (a residual around a projection,
    ``a + linear(a, w)``)? It reads it at the product's coordinates, loaded: a prologue holds the
    value only at the operand's tiles, so it stays written and is not recomputed."""
    epilogue = {id(m) for m in w.nodes if w.role(m) is Role.FULL and m is not w.contraction}
    return any(id(c) in epilogue for m in chain for c in consumers.get(id(m), ()))


def _loaded_rows(chain: list[Expr], others: list[_Work], size: int, graph: Graph) -> set[int]:
    """The values of a recomputed ``chain`` smaller than its operand (per row: a cross-entropy's
    per-row weight, beside the one-hot it scales) that kernels other than the GEMMs load, not
    computing them: their homes keep computing and writing them."""
    members = {id(m) for m in chain}
    return {
        id(x)
        for h in others
        for m in (*h.nodes, *h.free)
        if id(m) not in members
        for x in read_srcs(m)
        if id(x) in members and graph.of(x).numel < size and not any(x is y for y in (*h.nodes, *h.free))
    }


def _leaks(
    chain: list[Expr],
    gemm_readers: list[tuple[_Work, Role]],
    work: list[_Work],
    requested: set[int],
    consumers: dict[int, list[Expr]],
    loaded: set[int],
) -> bool:
    """Would a value of a recomputed ``chain`` still be read by a kernel that writes something, other
    than the GEMMs recomputing it (or be an output)? A GEMM writes no operand tile, so the product
    is then computed and written as usual. A node taking only a shape from it (the positions of a
    one-hot over the product, a cross-entropy's target gradient) reads nothing; a ``loaded`` per-row
    value (:func:`_loaded_rows`) is written by its home."""
    members = {id(m) for m in chain} - loaded
    if members & requested:
        return True
    readers = {id(w) for w, _ in gemm_readers}
    for h in work:
        if id(h) in readers:
            continue
        own = {id(m) for m in (*h.nodes, *h.free)}  # a free node is recomputed where a view reads it
        if any(id(x) in members and id(x) not in own for m in (*h.nodes, *h.free) for x in read_srcs(m)):
            if _writes(h, work, requested, consumers):
                return True
    return False


def _operand(w: _Work, side: Role, shape: tuple[int, ...], graph: Graph) -> Operand:
    """GEMM ``w`` reading an operand of ``shape`` as A or B, for the traffic model."""
    c = w.contraction
    assert c is not None
    return Operand(side.name, reloads(side.name, graph.of(c).shape, shape, c.attr("sum_batch")))


def _reduce_in_k_loop(
    w: _Work,
    values: list[Expr],
    work: list[_Work],
    graph: Graph,
    consumers: dict[int, list[Expr]],
    requested: set[int],
) -> list[_Work]:
    """A mergeable reduction of a prologue value of the operand's shape (``values``: the A operand,
    and what its prologue computes it from) over exactly its contracted dims (the K axis, and the
    batch dims a ``sum_batch`` GEMM sums) moves into ``w``: each program merges its A tiles'
    states in the K loop (a bias gradient's column sum in the weight-gradient GEMM), with the
    per-row math on its result (a cast to the bias's dtype). Only when its own kernel then has
    nothing left to write (a pass over the inputs saved)."""
    c = w.contraction
    assert c is not None
    shape = graph.of(values[0]).shape
    nd = len(shape)
    k_axis = nd - 2 if c.attr("ta") else nd - 1
    if c.attr_dict.get("summed"):
        return []  # one accumulator over several batches, each row's state is not one batch's
    if nd <= 2 or c.attr("sum_batch"):
        contracted = tuple(sorted({*range(nd - 2), k_axis}))  # the batches too: one accumulator
    elif not c.attr("ta"):
        contracted = (k_axis,)  # each batch's rows: attention's row sum of P in the P @ v GEMM
    else:
        return []  # A's columns per batch: a sum over the batches would cross programs

    # what the operand is computed from: a reduction it reads (softmax's logsumexp) is not its K loop's
    deps, stack = set(), [x for v in values for x in v.srcs]
    while stack:
        if id(x := stack.pop()) not in deps:
            deps.add(id(x))
            stack.extend(x.srcs)
    by_home: dict[int, tuple[_Work, list[Expr]]] = {}
    for v in (v for v in values if graph.of(v).shape == shape):
        for r in consumers.get(id(v), ()):
            op = REGISTRY[r.op]
            if op.kind is not OpKind.REDUCTION or op.reduce is None or tuple(sorted(r.attr("axis"))) != contracted:
                continue
            home = _home_of(r, w, work)
            if home is None or id(r) in deps:
                continue
            listed = by_home.setdefault(id(home), (home, []))[1]
            if not any(r is x for x in listed):  # read by the operand and by its prologue's values alike
                listed.append(r)
    moved = []
    pending: dict[int, list[Expr]] = {}  # reductions whose per-row math also reads another value
    for home, reductions in by_home.values():
        cones = {
            r: c for r, c in _tiled_reductions(home, reductions, contracted, shape, graph).items() if id(r) not in deps
        }
        reductions = reductions + list(cones)
        after = _per_row_after(home, reductions, graph, consumers)
        if after is None:  # its own kernel reads it otherwise: it stays there, unless the statistic
            if not cones:  # its per-row math also reads moves too (attention's lse: m + log(sum))
                pending[id(home)] = reductions
            continue
        taken = {id(m) for m in (*reductions, *after)}
        kept = home.nodes
        home.nodes = [m for m in kept if id(m) not in taken]
        # the kernel stays for other values: nothing saved, unless it is a row kernel computing a
        # product, whose pass for these reductions (a recompute of the product) is saved
        if _writes(home, work, requested, consumers) and not (home.is_row and home.contraction is not None):
            home.nodes = kept
            continue
        computed = {id(m) for m in w.nodes}
        for m in (m for cone in cones.values() for m in reversed(cone) if id(m) not in computed):
            computed.add(id(m))
            w.nodes.insert(0, m)
            w.roles[id(m)] = Role.A
        for r in (*reductions, *after):
            w.nodes.append(r)
            w.roles[id(r)] = Role.A
        for r in reductions:
            w.notes.append(f"{_label(r, graph)}: {r.op} of A over its contracted dims, merged in the K loop")
        moved.append(home)
    if contracted == (k_axis,):  # each program's rows are whole rows of one batch
        moved += _online_in_k_loop(w, values, contracted, deps, work, graph, consumers, requested, pending)
    return moved


def _online_in_k_loop(
    w: _Work,
    values: list[Expr],
    contracted: tuple[int, ...],
    deps: set[int],
    work: list[_Work],
    graph: Graph,
    consumers: dict[int, list[Expr]],
    requested: set[int],
    pending: Mapping[int, list[Expr]],
) -> list[_Work]:
    """The logsumexp the prologue shifts by (``exp(x - lse) @ v``: attention, ``softmax(x) @ v``)
    moves into ``w`` with its per-row math, where ``lower/online.py`` says the K loop may merge it
    as it runs (FlashAttention-2's forward: one pass over ``x``, no row kernel before the GEMM);
    with it the sums of its home (``pending``) whose per-row math also reads it (a logsumexp
    returned as ``m + log(sum)``), which could not move alone."""
    c = w.contraction
    assert c is not None
    own = {id(m): w.roles[id(m)] for m in w.nodes}
    found = {
        id(r): r
        for v in values
        for r in consumers.get(id(v), ())
        if r.op in STATISTICS and id(r) in deps and tuple(sorted(r.attr("axis"))) == contracted
    }
    for r in found.values():
        home = _home_of(r, w, work)
        if home is None or own.get(id(r.srcs[0])) is not Role.A:
            continue
        sums = pending.get(id(home), [])
        members = {**own, **{id(m): Role.A for m in sums}}
        # what the prologue recomputes that its home kept for readers since moved here (or moving
        # with the statistic) goes
        moving = {id(m) for m in sums}
        dead = _recomputed_only(
            replace(home, nodes=[m for m in home.nodes if id(m) not in moving]), members, requested, consumers
        )
        left = [m for m in home.nodes if id(m) not in dead]
        after = _per_row_after(replace(home, nodes=left), [r, *sums], graph, consumers)
        if after is None or online_shift(r, members, lambda n: consumers.get(id(n), ()), after, c) is None:
            continue
        taken = {id(r), *map(id, sums), *map(id, after)}
        home.nodes = [m for m in left if id(m) not in taken]
        for m in (*sums, r, *after):
            w.nodes.append(m)
            w.roles[id(m)] = Role.A
        w.notes += [f"{_label(m, graph)}: {m.op} of A over its contracted dims, merged in the K loop" for m in sums]
        w.notes.append(
            f"{_label(r, graph)}: the logsumexp the prologue shifts by, merged in the K loop as it runs "
            "(online softmax: the sums rescaled as its max grows; one pass, no row kernel before)"
        )
        return [home]
    return []


def _home_of(r: Expr, w: _Work, work: list[_Work]) -> _Work | None:
    """The kernel other than ``w`` that computes ``r``, if any."""
    return next((h for h in work if h is not w and any(m is r for m in h.nodes)), None)


def _recomputed_only(
    home: _Work, members: Mapping[int, Role], requested: set[int], consumers: dict[int, list[Expr]]
) -> set[int]:
    """The nodes of ``home`` a GEMM's prologue (``members`` of role A) recomputes and only it and
    other such nodes read: left in ``home`` for readers that moved into the K loop since."""
    inside = {id(m) for m in home.nodes}
    ours = {i for i, role in members.items() if role is Role.A}
    dead: set[int] = set()
    for m in reversed(home.nodes):  # readers first
        if id(m) in ours and id(m) not in requested:
            readers = [id(x) for x in consumers.get(id(m), ())]
            if all(x in dead or (x not in inside and x in members) for x in readers):
                dead.add(id(m))
    return dead


def _over_size_one(n: Expr, graph: Graph) -> bool:
    """A reduction over size-1 dims only: the value itself, reshaped."""
    if REGISTRY[n.op].kind is not OpKind.REDUCTION:
        return False
    shape = graph.of(n.srcs[0]).shape
    return all(shape[a] == 1 for a in n.attr("axis"))


def _tiled_reductions(
    home: _Work, reductions: list[Expr], contracted: tuple[int, ...], shape: tuple[int, ...], graph: Graph
) -> dict[Expr, list[Expr]]:
    """The other reductions of ``home`` over the same dims of a value of the operand's shape that a
    tile computes from its leaves alone (elementwise math, positions, views of leaves, a product
    recomputed): each with that cone, which the K loop computes too (a class weight's gradient
    beside the bias gradient: both merged, so no kernel reads the recomputed product's tiles)."""
    found: dict[Expr, list[Expr]] = {}
    for r in home.nodes:
        op = REGISTRY[r.op]
        if op.kind is not OpKind.REDUCTION or op.reduce is None or any(r is x for x in reductions):
            continue
        src = r.srcs[0]
        if graph.of(src).shape != shape or tuple(sorted(r.attr("axis"))) != contracted:
            continue
        cone = _tiled_cone(src, graph, needs_product=False)
        if cone is not None:
            found[r] = cone
    return found


def _per_row_after(
    home: _Work, reductions: list[Expr], graph: Graph, consumers: dict[int, list[Expr]]
) -> list[Expr] | None:
    """The elementwise nodes of ``home`` computed from ``reductions`` alone (and scalars), and
    reductions of them over size-1 dims: their per-row math, which moves with them. None when
    another node of ``home`` reads them."""
    members = {id(m) for m in home.nodes}
    done = {id(r) for r in reductions}
    after: list[Expr] = []
    waiting: set[int] = set()  # read before their other operands are done (met again once they are)
    stack = list(reductions)
    while stack:
        for x in consumers.get(id(stack.pop()), ()):
            if id(x) not in members or id(x) in done:
                continue
            if REGISTRY[x.op].kind is not OpKind.ELEMENTWISE and not _over_size_one(x, graph):
                return None
            if not all(id(y) in done or is_leaf(y, graph.info) for y in x.srcs):
                waiting.add(id(x))
                continue
            waiting.discard(id(x))
            done.add(id(x))
            after.append(x)
            stack.append(x)
    return None if waiting else after


def _elementwise_cone(s: Expr, home: _Work, solo: frozenset[int]) -> tuple[list[Expr], list[Expr]] | None:
    """``s`` and the nodes of its home kernel it is computed from, if all are elementwise (none
    kept apart by ``solo``), and the per-row values of a row kernel it reads (RMSNorm's ``rstd``:
    KEEP values, which broadcast against the operand; written by the row kernel, loaded at each
    tile). None where it needs anything else. A value the home kernel computes is in the cone
    even where another kernel also computes it (an epilogue recomputing it): the GEMM reads the
    cone's boundaries from memory, and one written by that other kernel could order them in a cycle."""
    inside = {id(m) for m in home.nodes}
    out: list[Expr] = []
    bounds: list[Expr] = []
    stack, seen = [s], set()
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        role = home.role(n)
        if n is not s and role is Role.KEEP:
            bounds.append(n)
            continue
        if id(n) in solo or REGISTRY[n.op].kind is not OpKind.ELEMENTWISE or role is not Role.FULL:
            return None
        out.append(n)
        stack.extend(x for x in n.srcs if id(x) in inside)
    return out, bounds


def _still_needed(
    chain: list[Expr], home: _Work, members: set[int], consumers: dict[int, list[Expr]], loaded: set[int] = frozenset()
) -> set[int]:
    """The nodes of a prologue's ``chain`` its home kernel still computes: those read by its other
    nodes or ``loaded`` by other kernels, and what they are computed from."""
    others = {id(x) for x in home.nodes} - members
    kept = {id(m) for m in chain if id(m) in loaded or any(id(c) in others for c in consumers.get(id(m), ()))}
    stack = [m for m in chain if id(m) in kept]
    while stack:
        for x in stack.pop().srcs:
            if id(x) in members and id(x) not in kept:
                kept.add(id(x))
                stack.append(x)
    return kept


def _writes(g: _Work, work: list[_Work], requested: set[int], consumers: dict[int, list[Expr]]) -> bool:
    """Does ``g`` still write anything: a value requested, or read by a kernel that does not compute it?"""
    members = [{id(m) for m in w.nodes} for w in work]
    for m in g.nodes:
        if id(m) in requested:
            return True
        for c in consumers.get(id(m), ()):
            if any(id(c) in ms and id(m) not in ms for ms in members):
                return True
    return False


def _label(n: Expr, graph: Graph) -> str:
    """A value's name in a note: its op and shape."""
    return f"{n.op}[{', '.join(map(str, graph.of(n).shape))}]"


# ---- pass 7: outputs, inputs, pattern, launch order ---------------------------------------------
def finish(graph: Graph, fl: Flow, groups: tuple[Group, ...]) -> Plan:
    requested = {id(e) for _, e in graph.outputs}
    consumers = _consumers(graph, fl)
    groups = _own_kernels_for_broadcast_values(graph, groups, requested, consumers)
    homes = _writers(graph, groups)
    members = [{id(m) for m in g.nodes} for g in groups]
    # a node's readers: the kernels computing it, as a member or in a cone (recomputed at a view's
    # coordinates, from what that kernel computes or loads); what a cone reads it computes or loads
    computing = [members[i] | {id(c) for c in g.cone} for i, g in enumerate(groups)]
    containing: dict[int, list[int]] = {}
    for i, ms in enumerate(computing):
        for m in ms:
            containing.setdefault(m, []).append(i)
    done: list[Group] = []
    for i, g in enumerate(groups):
        # written by its home group when requested, or read by a kernel that does not compute it
        outputs = tuple(
            m
            for m in g.nodes
            if homes[id(m)] == i
            and (
                id(m) in requested
                or any(id(m) not in computing[j] for c in consumers.get(id(m), ()) for j in containing[id(c)])
            )
        )
        seen = {id(f) for f in g.cone}  # free nodes: recomputed here, never read
        inputs: list[Expr] = []
        for m in (*g.cone, *g.nodes):
            for s in fl.reads[id(m)]:
                tensor = not graph.of(s).is_scalar and (s.is_var or not is_leaf(s, graph.info))
                if tensor and id(s) not in members[i] and id(s) not in seen:
                    seen.add(id(s))
                    inputs.append(s)
        cone: dict[int, Expr] = {id(c): c for c in g.cone}
        todo = [*g.nodes, *g.cone]
        while todo:  # the cones of re-indexing nodes, and of those inside them (free nodes absorbed too)
            for c in fl.cones.get(id(todo.pop()), ()):
                if id(c) not in cone:
                    cone[id(c)] = c
                    todo.append(c)
        order = _order(graph)
        done.append(
            Group(
                g.shape,
                g.axes,
                g.nodes,
                g.roles,
                tuple(inputs),
                outputs,
                _pattern(g, graph),
                tuple(sorted(cone.values(), key=lambda c: order[id(c)])),
                g.notes,
                g.chunk,
            ),
        )
    return Plan(_topo(done, homes), graph)


def _own_kernels_for_broadcast_values(
    graph: Graph, groups: tuple[Group, ...], requested: set[int], consumers: dict[int, list[Expr]]
) -> tuple[Group, ...]:
    """A value that must be written (requested, or read by a kernel that does not compute it) but
    that every kernel computing it computes broadcast (a smaller elementwise or movement value
    recomputed at a row kernel's larger shape) gets a pointwise kernel of its own, recomputing it
    from what that kernel read: a kernel writes only values of its own domain."""
    order = _order(graph)
    members = [{id(m) for m in g.nodes} for g in groups]
    extra: list[Group] = []
    for gi, g in enumerate(groups):
        for m in g.nodes:
            if graph.of(m).shape == _exact_shape(g, m) or REGISTRY[m.op].kind not in _POINTWISE:
                continue
            homes = [i for i, ms in enumerate(members) if id(m) in ms]
            if any(graph.of(m).shape == _exact_shape(groups[i], m) for i in homes):
                continue
            # read by a kernel that does not compute it (a GEMM's prologue reading it beside a home)
            readers = consumers.get(id(m), ())
            needed = id(m) in requested or any(id(m) not in ms for c in readers for ms in members if id(c) in ms)
            if not needed or any(any(x is m for x in e.nodes) for e in extra):
                continue
            cone = [m]  # its elementwise producers in this kernel, recomputed beside it
            stack = list(m.srcs)
            while stack:
                x = stack.pop()
                if id(x) in members[gi] and all(x is not c for c in cone):
                    if REGISTRY[x.op].kind not in _POINTWISE:
                        break
                    cone.append(x)
                    stack.extend(x.srcs)
            else:
                nodes = tuple(sorted(cone, key=lambda n: order[id(n)]))
                roles = MappingProxyType({id(n): Role.FULL for n in nodes})
                extra.append(Group(graph.of(m).shape, (), nodes, roles, pattern=Pattern.ELEMENTWISE_CHAIN))
    return (*groups, *extra)


_POINTWISE = (OpKind.ELEMENTWISE, OpKind.MOVEMENT)


def _exact_shape(g: Group, m: Expr) -> tuple[int, ...] | None:
    """The shape ``m`` has in ``g`` when ``g`` computes it at its own coordinates (by its role);
    None for a prologue's values (at an operand's tiles)."""
    return {Role.FULL: g.shape, Role.KEEP: g.keep_shape(), Role.DROP: g.drop_shape()}.get(g.role(m))


def _writers(graph: Graph, groups: tuple[Group, ...]) -> dict[int, int]:
    """node id -> the group that writes it: the first whose domain the value has exactly (a copy
    recomputed in another kernel may be broadcast there), else the first containing it."""
    out = _homes(groups)
    for i in reversed(range(len(groups))):
        for m in groups[i].nodes:  # a GEMM's prologue is never written by it
            if graph.of(m).shape == _exact_shape(groups[i], m):
                out[id(m)] = i
    return out


def _pattern(g: Group, graph: Graph) -> Pattern:
    """The first pattern, in ``Pattern``'s order, of the ops the group holds."""
    labels = {graph.origin[id(m)] for m in g.nodes if id(m) in graph.origin}
    names = {REGISTRY[o].pattern for o in labels} | {REGISTRY[m.op].pattern for m in g.nodes}
    if len(g.nodes) >= 2:
        names.add(Pattern.ELEMENTWISE_CHAIN)
    names.add(Pattern.SINGLE)
    if g.is_row:
        names.discard(Pattern.ACTIVATION)
        names.discard(Pattern.CONTRACTION)  # a product reduced in tiles: named by what it reduces to
    return next(p for p in Pattern if p in names)


def _topo(groups: list[Group], homes: dict[int, int]) -> tuple[Group, ...]:
    """Launch order: every group after the groups whose outputs it reads."""
    deps = {i: {homes[id(s)] for s in g.inputs if id(s) in homes} - {i} for i, g in enumerate(groups)}
    return tuple(groups[i] for i in graphlib.TopologicalSorter(deps).static_order())
