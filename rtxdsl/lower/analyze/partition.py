"""Pass 1: the greedy partition (see the package's docstring)."""

from __future__ import annotations

from ...config import FusionConfig
from ...expr import Expr
from ...ops import REGISTRY, OpKind
from ..expand import Graph, is_leaf
from ..roles import Role
from .flow import Flow, reindexes
from .groups import Deps, Group, Work, broadcasts, consumers_of, contractions_fit, order_of, re_indexes, two_products
from .tiles import alone_in_rows


class _Partitioner:
    """The groups of :func:`partition`, built node by node in topological order."""

    def __init__(self, graph: Graph, fl: Flow, config: FusionConfig, solo: frozenset[Expr]) -> None:
        self.graph, self.fl, self.solo = graph, fl, solo
        self.cap = config.max_fusion_ops
        self.requested = {e for _, e in graph.outputs}
        self.consumers = consumers_of(graph, fl)
        self.groups: list[Work] = []
        self.deps = Deps(fl)
        self._alone: dict[Expr, bool] = {}  # contraction -> alone_in_rows

    def new(self, n: Expr, shape: tuple[int, ...], axes: tuple[int, ...], role: Role) -> Work:
        g = Work(tuple(shape), tuple(axes))
        self.groups.append(g)
        self.deps.add_group(g)
        self.put(g, n, role)
        return g

    def put(self, g: Work, n: Expr, role: Role) -> None:
        g.nodes.append(n)
        g.roles[n] = role
        self.deps.put(g, n)

    def closed(self, g: Work, n: Expr) -> bool:
        """``n`` cannot join ``g``: ``g`` is full, or either is kept apart (``solo``) and they are
        not parts of one op the user wrote (a composite in a small group stays one kernel)."""
        if self.graph.ops([*g.nodes, n]) > self.cap:
            return True
        if n not in self.solo and not any(m in self.solo for m in g.nodes):
            return False
        op = self.graph.written.get(n)
        return op is None or any(self.graph.written.get(m) is not op for m in g.nodes)

    def private_to(self, g: Work, n: Expr) -> bool:
        """``g`` is pointwise, requested nowhere, and read only by itself and ``n``."""
        if g.is_row or any(m in self.requested for m in g.nodes):
            return False
        members = set(g.nodes) | {n}
        return all(c in members for m in g.nodes for c in self.consumers.get(m, ()))

    def role_in(self, g: Work, n: Expr, also: Work | None = None) -> Role | None:
        """The role ``n`` would have in ``g`` (merged with ``also``), or None if it cannot join."""
        shape = self.graph.of(n).shape
        gemm = g.contraction is not None or (also is not None and also.contraction is not None)
        if gemm and (REGISTRY[n.op].kind is OpKind.MOVEMENT or shape != g.shape):
            return None  # a GEMM's epilogue is pointwise at the product's own tile coordinates
        if reindexes(n):  # its cone's boundaries are read from memory: written by other kernels first
            if any(self.deps.home.get(s) in (g, also) for s in self.fl.reads[n]):
                return None
            if shape == g.shape:
                return Role.FULL
            if g.is_row and shape == g.keep_shape():
                return Role.KEEP
            return Role.DROP if g.is_row and shape == g.drop_shape() else None
        view = REGISTRY[n.op].kind is OpKind.MOVEMENT
        if not g.is_row:
            if view and any(self.deps.home.get(s) in (g, also) for s in n.srcs):
                return None  # reindexing a value computed in this kernel: it must be written first
            return Role.FULL if shape == g.shape else None
        homes = [h for h in (g, also) if h is not None]
        inner = [h.role(s) for s in n.srcs for h in homes if self.deps.home.get(s) is h]
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

    def can_join_rows(self, a: Work, b: Work) -> bool:
        if len(a.nodes) + len(b.nodes) > self.cap or not contractions_fit(a, b):
            return False
        return not self.deps.reaches(a, b) and not self.deps.reaches(b, a)

    def can_merge(self, a: Work, b: Work) -> bool:
        same = a.shape == b.shape and (a.axes == b.axes or not a.is_row or not b.is_row)
        if not same or len(a.nodes) + len(b.nodes) > self.cap or not contractions_fit(a, b):
            return False
        if two_products(self.products(), self.deps.reads[a], self.deps.reads[b]):
            return False  # attention's rows: a kernel computing one of them in tiles computes no other
        return not self.deps.reaches(a, b) and not self.deps.reaches(b, a)

    def products(self) -> set[Work]:
        """The GEMM groups whose product a row kernel would compute inside itself, alone
        (:func:`alone_in_rows`)."""
        return {g for g in self.groups if (c := g.contraction) is not None and self._in_rows(c)}

    def _in_rows(self, c: Expr) -> bool:
        if c not in self._alone:
            self._alone[c] = alone_in_rows(self.graph, c)
        return self._alone[c]

    def merge(self, a: Work, b: Work) -> Work:
        a.nodes.extend(b.nodes)
        a.roles.update(b.roles)
        a.axes = a.axes or b.axes  # a pointwise group merged with a row group becomes its prologue
        self.deps.merge(a, b)
        self.groups.remove(b)
        return a

    def src_groups(self, n: Expr) -> list[Work]:
        out: list[Work] = []
        for s in self.fl.reads[n]:
            g = self.deps.home.get(s)
            if g is not None and all(g is not o for o in out):
                out.append(g)
        return out

    def add_elementwise(self, n: Expr) -> None:
        shape = self.graph.of(n).shape
        target: Work | None = None
        absorbed: list[Work] = []
        srcs = self.src_groups(n)

        def upstream(h: Work) -> int:  # how many other candidates ``h`` reads from: join downstream first
            return -sum(self.deps.reaches(h, o) for o in srcs if o is not h)

        for g in sorted(srcs, key=lambda h: (not h.is_row, upstream(h))):  # row groups first
            if self.closed(g, n):
                continue
            per_row = _per_row_role(target, g, shape) if target is not None else None
            if per_row is not None and self.can_join_rows(target, g):  # type: ignore[arg-type]
                for m in g.nodes:  # a pointwise group over the rows: one value per row here
                    g.roles[m] = per_row
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
                if not self.deps.reaches(g, target) and (target.contraction is None or not re_indexes(g))
            ]
            homes = (self.deps.home.get(s) for s in self.fl.reads[n])
            others = {h: h for h in homes if h is not None and h is not target}
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
                g.roles[m] = target.role(n)
            self.merge(target, g)

    def add_reduction(self, n: Expr) -> None:
        (u,) = n.srcs
        in_shape = self.graph.of(u).shape
        axes = n.attr("axis")
        role = Role.KEEP if n.attr("keepdim") else Role.DROP
        g = self.deps.home.get(u)
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


def partition(graph: Graph, fl: Flow, config: FusionConfig, solo: frozenset[Expr]) -> tuple[Group, ...]:
    """Groups built in topological order; nodes in ``solo`` get a kernel of their own."""
    parts = _Partitioner(graph, fl, config, solo)
    for n in graph.nodes:
        if is_leaf(n, graph.info) or n in fl.free:
            continue
        kind = REGISTRY[n.op].kind
        if kind is OpKind.REDUCTION:
            parts.add_reduction(n)
        elif kind is OpKind.CONTRACTION:  # its operands are read from memory (written by other kernels)
            parts.new(n, graph.of(n).shape, (), Role.FULL)
        else:
            parts.add_elementwise(n)
    order = order_of(graph)
    return tuple(g.freeze(order) for g in parts.groups)


def _per_row_role(target: Work, g: Work, consumer: tuple[int, ...]) -> Role | None:
    """The role a pointwise group ``g`` over ``target``'s rows would have inside it, if a consumer
    of ``consumer``'s shape can then join too (a DROP value feeds only DROP values)."""
    if not target.is_row or g.is_row:
        return None
    if g.shape == target.drop_shape() and consumer == target.drop_shape():
        return Role.DROP
    if g.shape == target.keep_shape() and consumer in (target.keep_shape(), target.shape):
        return Role.KEEP
    return None
