"""Fusion groups and what the passes share: a frozen ``Group``, a ``Work`` group a pass edits, the
groups' dependences."""

from __future__ import annotations

import graphlib
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from types import MappingProxyType

from ...expr import Expr
from ...ops import REGISTRY, OpKind, Pattern
from ..expand import Graph
from ..roles import Role
from ..spec import Chunk
from .flow import Flow, reindexes


class Domain:
    """What a group says of its domain (a full shape and the axes it reduces) and its nodes' roles:
    shared by the frozen :class:`Group` and the :class:`Work` group a pass edits."""

    shape: tuple[int, ...]
    axes: tuple[int, ...]
    nodes: Sequence[Expr]
    roles: Mapping[Expr, Role]

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
        return self.roles[n]


@dataclass(frozen=True, eq=False)
class Group(Domain):
    """One kernel: its domain, its nodes (operands first) with their roles, what it reads and writes."""

    shape: tuple[int, ...]
    axes: tuple[int, ...]
    nodes: tuple[Expr, ...]
    roles: Mapping[Expr, Role]
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
    def ops(self) -> list[str]:
        return [n.op for n in self.nodes]


@dataclass(frozen=True)
class Plan:
    groups: tuple[Group, ...]  # in launch order
    graph: Graph

    @property
    def kernels(self) -> int:
        return len(self.groups)


def contraction_of(nodes: Sequence[Expr], roles: Mapping[Expr, Role]) -> Expr | None:
    """The kernel's own contraction: not one a prologue recomputes at an operand's tiles."""
    own = (n for n in nodes if REGISTRY[n.op].kind is OpKind.CONTRACTION and roles[n] not in (Role.A, Role.B))
    return next(own, None)


@dataclass(eq=False)
class Work(Domain):
    shape: tuple[int, ...]
    axes: tuple[int, ...] = ()
    nodes: list[Expr] = field(default_factory=list)
    roles: dict[Expr, Role] = field(default_factory=dict)
    free: list[Expr] = field(default_factory=list)  # recomputed where views of them are read
    notes: list[str] = field(default_factory=list)

    @staticmethod
    def of(g: Group) -> Work:
        return Work(g.shape, g.axes, list(g.nodes), dict(g.roles), list(g.cone), list(g.notes))

    def freeze(self, order: Mapping[Expr, int]) -> Group:
        # each node once (passes that recompute a value may add what the kernel computes already)
        nodes = tuple(sorted(dict.fromkeys(self.nodes), key=lambda m: order[m]))
        cone = tuple(sorted(dict.fromkeys(self.free), key=lambda m: order[m]))
        roles = MappingProxyType(dict(self.roles))
        return Group(self.shape, self.axes, nodes, roles, cone=cone, notes=tuple(self.notes))


def order_of(graph: Graph) -> dict[Expr, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def consumers_of(graph: Graph, fl: Flow) -> dict[Expr, list[Expr]]:
    """node -> the grouped nodes that read it (through movement cones: their boundaries)."""
    out: dict[Expr, list[Expr]] = {}
    for n in graph.nodes:
        if n in fl.reads and n not in fl.free:
            for s in fl.reads[n]:
                out.setdefault(s, []).append(n)
    return out


def broadcasts(small: tuple[int, ...], big: tuple[int, ...]) -> bool:
    """Does a value of shape ``small`` broadcast to ``big`` (right-aligned)?"""
    if len(small) > len(big):
        return False
    return all(s == 1 or s == b for s, b in zip(reversed(small), reversed(big)))


class Deps:
    """Which groups read which (through node operands), for cycle checks while groups merge."""

    def __init__(self, fl: Flow) -> None:
        self.fl = fl
        self.home: dict[Expr, Work] = {}  # node -> the group that computes (and may write) it
        self.reads: dict[Work, set[Work]] = {}  # group -> the groups it reads
        self.by_id: dict[Work, Work] = {}

    def add_group(self, g: Work) -> None:
        self.by_id[g] = g
        self.reads.setdefault(g, set())

    def put(self, g: Work, n: Expr) -> None:
        self.home[n] = g
        for s in self.fl.reads[n]:
            h = self.home.get(s)
            if h is not None and h is not g:
                self.reads[g].add(h)

    def merge(self, a: Work, b: Work) -> None:
        """``b``'s nodes now live in ``a``."""
        for m in b.nodes:
            self.home[m] = a
        self.reads[a] |= self.reads.pop(b)
        self.reads[a].discard(a)
        self.reads[a].discard(b)
        del self.by_id[b]
        for r in self.reads.values():
            if b in r:
                r.discard(b)
                r.add(a)
        for gid, r in self.reads.items():
            r.discard(gid)

    def reaches(self, a: Work, b: Work) -> bool:
        """Does ``a`` read, through any chain of groups, something ``b`` writes?"""
        stack, seen = [a], {a}
        while stack:
            for d in self.reads[stack.pop()]:
                if d is b:
                    return True
                if d not in seen:
                    seen.add(d)
                    stack.append(d)
        return False


def re_indexes(g: Work) -> bool:
    """Does ``g`` hold movement ops (or recompute values at re-indexed coordinates)? A GEMM's
    epilogue cannot: it computes at the product's own tile coordinates."""
    return bool(g.free) or any(REGISTRY[m.op].kind is OpKind.MOVEMENT for m in g.nodes)


def contractions_fit(a: Work, b: Work) -> bool:
    """One kernel holds at most one contraction, and a GEMM merges only with pointwise groups that
    re-index nothing (its epilogue)."""
    ca, cb = a.contraction, b.contraction
    if ca is None and cb is None:
        return True
    if ca is not None and cb is not None:
        return False
    other = b if ca is not None else a
    return not other.is_row and not re_indexes(other)


def homes_of(groups: tuple[Group, ...] | list[Work]) -> dict[Expr, int]:
    """node -> index of the first group containing it (the one that computes and writes it)."""
    out: dict[Expr, int] = {}
    for i, g in enumerate(groups):
        for m in g.nodes:
            out.setdefault(m, i)
    return out


def group_reads(g: Group | Work, fl: Flow, homes: dict[Expr, int], self_index: int) -> set[int]:
    members = set(g.nodes)
    reads = {homes[s] for m in g.nodes for s in fl.reads[m] if s in homes and s not in members}
    return reads - {self_index}


def index_reaches(reads: list[set[int]], a: int, b: int) -> bool:
    stack, seen = [a], {a}
    while stack:
        for d in reads[stack.pop()]:
            if d == b:
                return True
            if d not in seen:
                seen.add(d)
                stack.append(d)
    return False


def views_of_inputs(nodes: list[Expr] | tuple[Expr, ...]) -> bool:
    """Do ``nodes`` only reshape (or insert dims of one into) variables? Where torch could view
    them at the inputs' strides, ``lower._views`` launches nothing for them."""
    return all((REGISTRY[n.op].regroups or REGISTRY[n.op].view) and n.srcs[0].is_var for n in nodes)


def two_products(products: Set[object], a: Set[object], b: Set[object]) -> bool:
    """Do siblings reading groups ``a`` and ``b`` read two different ``products`` (GEMMs a row
    kernel would compute inside itself, alone: :func:`alone_in_rows`)? Merged, the other product
    would be written and read back."""
    pa, pb = products & a, products & b
    return bool(pa and pb and pa != pb)


def per_row_role_of(r: Work, shape: tuple[int, ...]) -> Role:
    """The role of a value of ``shape`` recomputed in ``r``: per row when it is one value per row
    (KEEP with the reduced dims kept; DROP when they are the leading dims, so that broadcasting the
    value against the domain reads it per row), else FULL (broadcast over the whole tile)."""
    if not r.is_row or shape == r.shape:
        return Role.FULL
    if shape == r.keep_shape():
        return Role.KEEP
    leading = r.axes == tuple(range(len(r.axes)))
    return Role.DROP if leading and shape == r.drop_shape() else Role.FULL


def cyclic(
    graph: Graph, work: list[Work], emptied: list[Work], fl: Flow, requested: set[Expr], consumers: dict
) -> bool:
    """Would the kernels left (an emptied one that writes nothing is dropped) read each other's
    values in a cycle, so that none could launch first? Each value read from the kernel that
    writes it, as ``finish`` orders them (``writers_of``: a copy a GEMM's prologue recomputes is
    not where it is read from)."""
    dead = {h for h in emptied if not still_writes(h, work, requested, consumers)}
    live = [w for w in work if w not in dead]
    homes = writers_of(graph, live)  # type: ignore[arg-type]
    deps = {}
    for i, w in enumerate(live):
        inside = set((*w.nodes, *w.free))
        reads = {homes.get(s) for m in (*w.nodes, *w.free) for s in fl.reads[m] if s not in inside}
        deps[i] = {r for r in reads if r is not None} - {i}
    try:
        tuple(graphlib.TopologicalSorter(deps).static_order())
    except graphlib.CycleError:
        return True
    return False


def still_writes(g: Work, work: list[Work], requested: set[Expr], consumers: dict[Expr, list[Expr]]) -> bool:
    """Does ``g`` still write anything: a value requested, or read by a kernel that does not compute it?"""
    members = [set(w.nodes) for w in work]
    for m in g.nodes:
        if m in requested:
            return True
        for c in consumers.get(m, ()):
            if any(c in ms and m not in ms for ms in members):
                return True
    return False


def label_of(n: Expr, graph: Graph) -> str:
    """A value's name in a note: its op and shape."""
    return f"{n.op}[{', '.join(map(str, graph.of(n).shape))}]"


POINTWISE = (OpKind.ELEMENTWISE, OpKind.MOVEMENT)


def exact_shape(g: Group, m: Expr) -> tuple[int, ...] | None:
    """The shape ``m`` has in ``g`` when ``g`` computes it at its own coordinates (by its role);
    None for a prologue's values (at an operand's tiles)."""
    return {Role.FULL: g.shape, Role.KEEP: g.keep_shape(), Role.DROP: g.drop_shape()}.get(g.role(m))


def writers_of(graph: Graph, groups: tuple[Group, ...]) -> dict[Expr, int]:
    """node -> index of the group that writes it: the first whose domain the value has exactly (a copy
    recomputed in another kernel may be broadcast there), else the first containing it."""
    out = homes_of(groups)
    for i in reversed(range(len(groups))):
        for m in groups[i].nodes:  # a GEMM's prologue is never written by it
            if graph.of(m).shape == exact_shape(groups[i], m):
                out[m] = i
    return out
