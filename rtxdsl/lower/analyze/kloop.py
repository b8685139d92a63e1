"""Reductions a GEMM's K loop computes beside its product: sums of a prologue's values over the
contracted axis, and the online softmax's running statistics (pass 6)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ...expr import Expr
from ...ops import REGISTRY, OpKind
from ..expand import Graph, is_leaf
from ..online import STATISTICS, online_shift
from ..roles import Role
from .groups import Work, label_of, still_writes
from .tiles import tiled_cone


def reduce_in_k_loop(
    w: Work,
    values: list[Expr],
    work: list[Work],
    graph: Graph,
    consumers: dict[Expr, list[Expr]],
    requested: set[Expr],
) -> list[Work]:
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
        if (x := stack.pop()) not in deps:
            deps.add(x)
            stack.extend(x.srcs)
    by_home: dict[Work, tuple[Work, list[Expr]]] = {}
    for v in (v for v in values if graph.of(v).shape == shape):
        for r in consumers.get(v, ()):
            op = REGISTRY[r.op]
            if op.kind is not OpKind.REDUCTION or op.reduce is None or tuple(sorted(r.attr("axis"))) != contracted:
                continue
            home = _home_of(r, w, work)
            if home is None or r in deps:
                continue
            listed = by_home.setdefault(home, (home, []))[1]
            if not any(r is x for x in listed):  # read by the operand and by its prologue's values alike
                listed.append(r)
    moved = []
    pending: dict[Work, list[Expr]] = {}  # reductions whose per-row math also reads another value
    for home, reductions in by_home.values():
        cones = {
            r: c for r, c in _tiled_reductions(home, reductions, contracted, shape, graph).items() if r not in deps
        }
        reductions = reductions + list(cones)
        after = _per_row_after(home, reductions, graph, consumers)
        if after is None:  # its own kernel reads it otherwise: it stays there, unless the statistic
            if not cones:  # its per-row math also reads moves too (attention's lse: m + log(sum))
                pending[home] = reductions
            continue
        taken = set((*reductions, *after))
        kept = home.nodes
        home.nodes = [m for m in kept if m not in taken]
        # the kernel stays for other values: nothing saved, unless it is a row kernel computing a
        # product, whose pass for these reductions (a recompute of the product) is saved
        if still_writes(home, work, requested, consumers) and not (home.is_row and home.contraction is not None):
            home.nodes = kept
            continue
        computed = set(w.nodes)
        for m in (m for cone in cones.values() for m in reversed(cone) if m not in computed):
            computed.add(m)
            w.nodes.insert(0, m)
            w.roles[m] = Role.A
        for r in (*reductions, *after):
            w.nodes.append(r)
            w.roles[r] = Role.A
        for r in reductions:
            w.notes.append(f"{label_of(r, graph)}: {r.op} of A over its contracted dims, merged in the K loop")
        moved.append(home)
    if contracted == (k_axis,):  # each program's rows are whole rows of one batch
        moved += _online_in_k_loop(w, values, contracted, deps, work, graph, consumers, requested, pending)
    return moved


def _online_in_k_loop(
    w: Work,
    values: list[Expr],
    contracted: tuple[int, ...],
    deps: set[Expr],
    work: list[Work],
    graph: Graph,
    consumers: dict[Expr, list[Expr]],
    requested: set[Expr],
    pending: Mapping[Work, list[Expr]],
) -> list[Work]:
    """The logsumexp the prologue shifts by (``exp(x - lse) @ v``: attention, ``softmax(x) @ v``)
    moves into ``w`` with its per-row math, where ``lower/online.py`` says the K loop may merge it
    as it runs (FlashAttention-2's forward: one pass over ``x``, no row kernel before the GEMM);
    with it the sums of its home (``pending``) whose per-row math also reads it (a logsumexp
    returned as ``m + log(sum)``), which could not move alone."""
    c = w.contraction
    assert c is not None
    own = {m: w.roles[m] for m in w.nodes}
    found = {
        r: r
        for v in values
        for r in consumers.get(v, ())
        if r.op in STATISTICS and r in deps and tuple(sorted(r.attr("axis"))) == contracted
    }
    for r in found.values():
        home = _home_of(r, w, work)
        if home is None or own.get(r.srcs[0]) is not Role.A:
            continue
        sums = pending.get(home, [])
        members = {**own, **{m: Role.A for m in sums}}
        # what the prologue recomputes that its home kept for readers since moved here (or moving
        # with the statistic) goes
        moving = set(sums)
        dead = _recomputed_only(
            replace(home, nodes=[m for m in home.nodes if m not in moving]), members, requested, consumers
        )
        left = [m for m in home.nodes if m not in dead]
        after = _per_row_after(replace(home, nodes=left), [r, *sums], graph, consumers)
        if after is None or online_shift(r, members, lambda n: consumers.get(n, ()), after, c) is None:
            continue
        taken = {r, *sums, *after}
        home.nodes = [m for m in left if m not in taken]
        for m in (*sums, r, *after):
            w.nodes.append(m)
            w.roles[m] = Role.A
        w.notes += [f"{label_of(m, graph)}: {m.op} of A over its contracted dims, merged in the K loop" for m in sums]
        w.notes.append(
            f"{label_of(r, graph)}: the logsumexp the prologue shifts by, merged in the K loop as it runs "
            "(online softmax: the sums rescaled as its max grows; one pass, no row kernel before)"
        )
        return [home]
    return []


def _home_of(r: Expr, w: Work, work: list[Work]) -> Work | None:
    """The kernel other than ``w`` that computes ``r``, if any."""
    return next((h for h in work if h is not w and any(m is r for m in h.nodes)), None)


def _recomputed_only(
    home: Work, members: Mapping[Expr, Role], requested: set[Expr], consumers: dict[Expr, list[Expr]]
) -> set[Expr]:
    """The nodes of ``home`` a GEMM's prologue (``members`` of role A) recomputes and only it and
    other such nodes read: left in ``home`` for readers that moved into the K loop since."""
    inside = set(home.nodes)
    ours = {i for i, role in members.items() if role is Role.A}
    dead: set[Expr] = set()
    for m in reversed(home.nodes):  # readers first
        if m in ours and m not in requested:
            readers = [x for x in consumers.get(m, ())]
            if all(x in dead or (x not in inside and x in members) for x in readers):
                dead.add(m)
    return dead


def _over_size_one(n: Expr, graph: Graph) -> bool:
    """A reduction over size-1 dims only: the value itself, reshaped."""
    if REGISTRY[n.op].kind is not OpKind.REDUCTION:
        return False
    shape = graph.of(n.srcs[0]).shape
    return all(shape[a] == 1 for a in n.attr("axis"))


def _tiled_reductions(
    home: Work, reductions: list[Expr], contracted: tuple[int, ...], shape: tuple[int, ...], graph: Graph
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
        cone = tiled_cone(src, graph, needs_product=False)
        if cone is not None:
            found[r] = cone
    return found


def _per_row_after(
    home: Work, reductions: list[Expr], graph: Graph, consumers: dict[Expr, list[Expr]]
) -> list[Expr] | None:
    """The elementwise nodes of ``home`` computed from ``reductions`` alone (and scalars), and
    reductions of them over size-1 dims: their per-row math, which moves with them. None when
    another node of ``home`` reads them."""
    members = set(home.nodes)
    done = set(reductions)
    after: list[Expr] = []
    waiting: set[Expr] = set()  # read before their other operands are done (met again once they are)
    stack = list(reductions)
    while stack:
        for x in consumers.get(stack.pop(), ()):
            if x not in members or x in done:
                continue
            if REGISTRY[x.op].kind is not OpKind.ELEMENTWISE and not _over_size_one(x, graph):
                return None
            if not all(y in done or is_leaf(y, graph.info) for y in x.srcs):
                waiting.add(x)
                continue
            waiting.discard(x)
            done.add(x)
            after.append(x)
            stack.append(x)
    return None if waiting else after
