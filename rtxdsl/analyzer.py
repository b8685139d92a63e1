"""FusionAnalyzer: partitions a bound graph of primitives into fusion groups.

Each group becomes one kernel over a *domain*: a full shape ``S`` and the axes ``A`` it
reduces (none for pointwise groups). Inside a row group (``A`` non-empty) a node has a
role: FULL (varies over the whole domain), KEEP (one value per row, reduced dims kept
as size 1) or DROP (one value per row, reduced dims removed). Rules, in order:

* an elementwise node joins its operands' groups when its shape and their roles fit;
  operand groups that fit are merged unless that would make a cycle between groups;
* a private pointwise producer group of a smaller, broadcastable shape is absorbed and
  recomputed at the larger shape ("fusion across broadcasts");
* a reduction takes its input's pointwise group as prologue (upgrading it to a row
  group), or joins a row group over the same rows (softmax: max, then sum of exp);
* a node is written to memory only when it is requested or read by another group.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .bind import Bound
from .config import FusionConfig
from .expr import Expr
from .ops import REGISTRY, OpKind
from .ops.reduction import axes_of


class Role(enum.Enum):
    FULL = "full"
    KEEP = "keep"
    DROP = "drop"


PATTERN_PRIORITY = ("LayerNorm", "RMSNorm", "Softmax", "Reduction", "Activation", "ElementwiseChain", "Single")


@dataclass(eq=False)
class FusionGroup:
    shape: tuple[int, ...]
    axes: tuple[int, ...] = ()
    nodes: list[Expr] = field(default_factory=list)
    roles: dict[int, Role] = field(default_factory=dict)
    outputs: list[Expr] = field(default_factory=list)
    inputs: list[Expr] = field(default_factory=list)  # tensors read: vars or other groups' outputs
    pattern: str = "Single"

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
    def ops(self) -> list[str]:
        return [n.op for n in self.nodes]


@dataclass
class FusionPlan:
    groups: list[FusionGroup]
    bound: Bound

    @property
    def kernels(self) -> int:
        return len(self.groups)


def is_leaf(n: Expr, bound: Bound) -> bool:
    """Leaves are loaded or passed, never computed by a group: vars, constants, scalars."""
    return n.op in ("var", "const") or REGISTRY[n.op].kind is OpKind.SCALAR or bound.of(n).is_scalar


class FusionAnalyzer:
    """Groups the primitives of a :class:`Bound` graph into kernels.

    Example:
        >>> plan = FusionAnalyzer(config).plan(bound)   # doctest: +SKIP
        >>> [g.pattern for g in plan.groups]            # doctest: +SKIP
        ['Softmax']
    """

    def __init__(self, config: FusionConfig) -> None:
        self.config = config

    def plan(self, bound: Bound) -> FusionPlan:
        groups = self._partition(bound, solo=set())
        small = {id(n) for g in groups if len(g.nodes) < self.config.min_fusion_ops for n in g.nodes}
        if small:
            groups = self._partition(bound, solo=small)
        groups = self._recompute_elementwise(self._absorb_per_row(self._siblings(groups)))
        return FusionPlan(self._finish(groups, bound), bound)

    # ---- partitioning ---------------------------------------------------------------
    def _partition(self, bound: Bound, solo: set[int]) -> list[FusionGroup]:
        self.bound = bound
        self.solo = solo
        self.group_of: dict[int, FusionGroup] = {}
        self.groups: list[FusionGroup] = []
        self.consumers: dict[int, list[Expr]] = {}
        self.requested = {id(e) for _, e in bound.outputs}
        for n in bound.nodes:
            if not is_leaf(n, bound):
                for s in n.srcs:
                    self.consumers.setdefault(id(s), []).append(n)
        for n in bound.nodes:
            if is_leaf(n, bound):
                continue
            if REGISTRY[n.op].kind is OpKind.REDUCTION:
                self._add_reduction(n, alone=id(n) in solo)
            else:
                self._add_elementwise(n, alone=id(n) in solo)
        return self.groups

    def _new(self, n: Expr, shape, axes, role: Role) -> None:
        g = FusionGroup(shape=tuple(shape), axes=tuple(axes))
        self.groups.append(g)
        self._put(g, n, role)

    def _put(self, g: FusionGroup, n: Expr, role: Role) -> None:
        g.nodes.append(n)
        g.roles[id(n)] = role
        self.group_of[id(n)] = g

    def _full(self, g: FusionGroup) -> bool:
        return len(g.nodes) >= self.config.max_fusion_ops

    def _src_groups(self, n: Expr) -> list[FusionGroup]:
        out: list[FusionGroup] = []
        for s in n.srcs:
            g = self.group_of.get(id(s))
            if g is not None and all(g is not o for o in out):
                out.append(g)
        return out

    def _private_to(self, g: FusionGroup, n: Expr) -> bool:
        """``g`` is pointwise, requested nowhere, and read only by itself and ``n``."""
        if g.is_row or any(id(m) in self.requested for m in g.nodes):
            return False
        members = {id(m) for m in g.nodes} | {id(n)}
        return all(id(c) in members for m in g.nodes for c in self.consumers.get(id(m), ()))

    def _role_in(self, g: FusionGroup, n: Expr, also: FusionGroup | None = None) -> Role | None:
        """The role ``n`` would have in ``g`` (merged with ``also``), or None if it cannot join."""
        shape = self.bound.of(n).shape
        if not g.is_row:
            if REGISTRY[n.op].view and any(self.group_of.get(id(s)) in (g, also) for s in n.srcs):
                return None  # reindexing a value computed in this kernel: it must be written first
            return Role.FULL if shape == g.shape else None
        homes = [h for h in (g, also) if h is not None]
        inner = [h.role(s) for s in n.srcs for h in homes if self.group_of.get(id(s)) is h]
        if REGISTRY[n.op].view and inner:  # a per-row value regains its reduced dims
            ok = inner == [Role.DROP] and tuple(sorted(n.attr("axes"))) == g.axes and shape == g.keep_shape()
            return Role.KEEP if ok else None
        if Role.DROP in inner:
            return Role.DROP if shape == g.drop_shape() and all(r is Role.DROP for r in inner) else None
        if shape == g.shape:
            return Role.FULL
        if shape == g.keep_shape() and all(r is Role.KEEP for r in inner):
            return Role.KEEP
        return None

    def _add_elementwise(self, n: Expr, alone: bool) -> None:
        shape = self.bound.of(n).shape
        target: FusionGroup | None = None
        absorbed: list[FusionGroup] = []
        if not alone:
            for g in self._src_groups(n):
                if self._full(g) or any(id(m) in self.solo for m in g.nodes):
                    continue
                role = self._role_in(g, n) if target is None else self._role_in(target, n, also=g)
                if role is not None and (target is None or self._can_merge(target, g)):
                    target = g if target is None else self._merge(target, g)
                elif not g.is_row and g.shape != shape and _broadcasts(g.shape, shape) and self._private_to(g, n):
                    absorbed.append(g)
        if target is not None and self._would_cycle(target, n):
            target = None
        if target is None:
            self._new(n, shape, (), Role.FULL)
            target = self.group_of[id(n)]
        else:
            role = self._role_in(target, n)
            assert role is not None
            self._put(target, n, role)
        for g in absorbed:
            for m in g.nodes:
                target.roles[id(m)] = Role.FULL
                self.group_of[id(m)] = target
            target.nodes[:0] = g.nodes
            self.groups.remove(g)

    def _would_cycle(self, target: FusionGroup, n: Expr) -> bool:
        """Would ``n`` in ``target`` read a group that itself reads ``target``?"""
        others = {id(h): h for s in n.srcs if (h := self.group_of.get(id(s))) is not None and h is not target}
        return any(self._reaches(h, target) for h in others.values())

    def _add_reduction(self, n: Expr, alone: bool) -> None:
        (u,) = n.srcs
        in_shape = self.bound.of(u).shape
        axes = axes_of(n.attr("axis"), len(in_shape))
        role = Role.KEEP if n.attr("keepdim") else Role.DROP
        g = self.group_of.get(id(u))
        if (
            g is not None
            and g.is_row
            and g.role(u) is Role.KEEP
            and axes == g.axes
            and in_shape == g.keep_shape()
            and not alone
        ):
            # reducing a per-row value over its size-1 dims only reshapes it
            self._put(g, n, role)
            return
        if (
            not alone
            and g is not None
            and not self._full(g)
            and g.shape == in_shape
            and g.role(u) is Role.FULL
            and not any(id(m) in self.solo for m in g.nodes)
        ):
            if not g.is_row:
                g.axes = axes
            if g.axes == axes:
                self._put(g, n, role)
                return
        self._new(n, in_shape, axes, role)

    # ---- merging ----------------------------------------------------------------------
    def _deps(self, g: FusionGroup) -> set[int]:
        return {
            id(self.group_of[id(s)])
            for m in g.nodes
            for s in m.srcs
            if id(s) in self.group_of and self.group_of[id(s)] is not g
        }

    def _reaches(self, a: FusionGroup, b: FusionGroup) -> bool:
        """Does ``a`` read, through any chain of groups, something ``b`` writes?"""
        by_id = {id(g): g for g in self.groups}
        stack, seen = [a], set()
        while stack:
            g = stack.pop()
            for d in self._deps(g):
                if d == id(b):
                    return True
                if d not in seen:
                    seen.add(d)
                    stack.append(by_id[d])
        return False

    def _can_merge(self, a: FusionGroup, b: FusionGroup) -> bool:
        """Same domain, or a pointwise group over a row group's full shape; no cycle; within the cap."""
        same = a.shape == b.shape and (a.axes == b.axes or not a.is_row or not b.is_row)
        if not same or len(a.nodes) + len(b.nodes) > self.config.max_fusion_ops:
            return False
        return not self._reaches(a, b) and not self._reaches(b, a)

    def _merge(self, a: FusionGroup, b: FusionGroup) -> FusionGroup:
        order = {id(m): i for i, m in enumerate(self.bound.nodes)}
        for m in b.nodes:
            self.group_of[id(m)] = a
        a.roles.update(b.roles)
        a.axes = a.axes or b.axes  # a pointwise group merged with a row group becomes its prologue
        a.nodes = sorted(a.nodes + b.nodes, key=lambda m: order[id(m)])
        self.groups.remove(b)
        return a

    def _siblings(self, groups: list[FusionGroup]) -> list[FusionGroup]:
        """Independent groups over the same domain become one kernel (shared inputs read once)."""
        merged = True
        while merged:
            merged = False
            for i, a in enumerate(groups):
                for b in groups[i + 1 :]:
                    if (
                        (a.shape, a.axes) == (b.shape, b.axes)
                        and not any(id(m) in self.solo for m in [*a.nodes, *b.nodes])
                        and self._can_merge(a, b)
                    ):
                        self._merge(a, b)  # removes b from self.groups, which is ``groups``
                        merged = True
                        break
                if merged:
                    break
        return groups

    def _absorb_per_row(self, groups: list[FusionGroup]) -> list[FusionGroup]:
        """Math on leaves only (e.g. rstd from a saved variance) is recomputed in every kernel reading it.

        Such a group would otherwise be a launch of its own whose results are written and read
        back; its values broadcast to each reader's domain, per row (KEEP) where they fit.
        """
        for p in list(groups):
            if p.is_row or any(id(m) in self.requested or id(m) in self.solo for m in p.nodes):
                continue
            if any(id(s) in self.group_of and self.group_of[id(s)] is not p for m in p.nodes for s in m.srcs):
                continue  # reads another kernel's output
            readers = {
                id(h): h for m in p.nodes for c in self.consumers.get(id(m), ()) if (h := self.group_of[id(c)]) is not p
            }
            cap = self.config.max_fusion_ops
            if not readers or any(
                not _broadcasts(p.shape, r.shape) or len(r.nodes) + len(p.nodes) > cap for r in readers.values()
            ):
                continue
            for r in readers.values():
                role = Role.KEEP if r.is_row and p.shape == r.keep_shape() else Role.FULL
                for m in p.nodes:
                    r.roles[id(m)] = role
                r.nodes[:0] = p.nodes
            for m in p.nodes:
                self.group_of[id(m)] = next(iter(readers.values()))
            groups.remove(p)
        return groups

    def _recompute_elementwise(self, groups: list[FusionGroup]) -> list[FusionGroup]:
        """A kernel reading another's elementwise value recomputes it from leaves instead.

        E.g. layer_norm's backward: the weight-gradient column reduction recomputes
        ``g * xhat`` rather than have the row kernel write it and read it back.
        """
        for r2 in groups:
            for m in list(r2.nodes):
                for s in m.srcs:
                    r1 = self.group_of.get(id(s))
                    if r1 is None or r1 is r2 or any(x is s for x in r2.nodes):
                        continue
                    chain = self._elementwise_ancestry(s, r1, r2)
                    if chain is None or len(r2.nodes) + len(chain) > self.config.max_fusion_ops:
                        continue
                    for n in chain:
                        shape = self.bound.of(n).shape
                        r2.roles[id(n)] = (
                            Role.KEEP if r2.is_row and shape == r2.keep_shape() and (shape != r2.shape) else Role.FULL
                        )
                    r2.nodes[:0] = chain
        return groups

    def _elementwise_ancestry(self, s: Expr, r1: FusionGroup, r2: FusionGroup) -> list[Expr] | None:
        """``s`` and what it needs inside ``r1``, if all of it is elementwise over leaves and fits ``r2``."""
        out: list[Expr] = []
        stack, seen = [s], set()
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            info = self.bound.of(n)
            if (
                id(n) in self.solo
                or REGISTRY[n.op].kind is not OpKind.ELEMENTWISE
                or REGISTRY[n.op].view
                or r1.role(n) is Role.DROP
                or not _broadcasts(info.shape, r2.shape)
            ):
                return None
            out.append(n)
            for src in n.srcs:
                if id(src) in self.group_of and self.group_of[id(src)] is r1:
                    stack.append(src)
                elif not is_leaf(src, self.bound):
                    return None  # another kernel's output: reading it here could order kernels in a cycle
        return out

    # ---- outputs, inputs, order -------------------------------------------------------
    def _finish(self, groups: list[FusionGroup], bound: Bound) -> list[FusionGroup]:
        requested = {id(e) for _, e in bound.outputs}
        order = {id(m): i for i, m in enumerate(bound.nodes)}
        sets = {id(g): {id(m) for m in g.nodes} for g in groups}
        for g in groups:
            g.nodes.sort(key=lambda m: order[id(m)])
            members = sets[id(g)]
            # written when requested, or read by a kernel that does not compute it itself
            g.outputs = [
                m
                for m in g.nodes
                if id(m) in requested
                or any(id(m) not in sets[id(self.group_of[id(c)])] for c in self.consumers.get(id(m), ()))
            ]
            seen: set[int] = set()
            g.inputs = []
            for m in g.nodes:
                for s in m.srcs:
                    tensor = s.op == "var" or not is_leaf(s, bound)
                    if tensor and id(s) not in members and id(s) not in seen:
                        seen.add(id(s))
                        g.inputs.append(s)
            g.pattern = _pattern(g, bound)
        return _topo(groups, self.group_of)


def _broadcasts(small: tuple[int, ...], big: tuple[int, ...]) -> bool:
    if len(small) > len(big):
        return False
    return all(s == 1 or s == b for s, b in zip(reversed(small), reversed(big)))


def _pattern(g: FusionGroup, bound: Bound) -> str:
    labels = {bound.origin[id(m)] for m in g.nodes if id(m) in bound.origin}
    names = {REGISTRY[o].pattern for o in labels} | {REGISTRY[m.op].pattern for m in g.nodes}
    if len(g.nodes) >= 2:
        names.add("ElementwiseChain")
    names.add("Single")
    if g.is_row:
        names.discard("Activation")
    return next(p for p in PATTERN_PRIORITY if p in names)


def _topo(groups: list[FusionGroup], group_of: dict[int, FusionGroup]) -> list[FusionGroup]:
    done: list[FusionGroup] = []
    placed: set[int] = set()
    pending = list(groups)
    while pending:
        for g in pending:
            deps = {id(group_of[id(s)]) for s in g.inputs if id(s) in group_of}
            if deps <= placed:
                done.append(g)
                placed.add(id(g))
                pending.remove(g)
                break
        else:  # pragma: no cover - the analyzer never builds a cycle
            raise RuntimeError("fusion groups form a cycle")
    return done
