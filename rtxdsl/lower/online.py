"""Online softmax in a GEMM's K loop: a logsumexp the prologue shifts by, computed as it runs.

``softmax(x) @ v`` and attention's ``exp(s - lse) @ v`` read a row statistic, ``lse =
logsumexp(x)`` over the K axis, before the K loop that sums ``exp(x - lse) * v``: two passes over
``x``, and for attention two recomputes of the scores ``q @ k.mT``. Every value the K loop sums is
*proportional* to ``exp(x - c)`` for the per-row shift ``c`` (a cast, a mask, a dropout scale, the
product with ``v`` and a row sum keep it so), so any finite shift gives the same sums up to a
per-row factor: ``exp(c' - c)``. FlashAttention-2's forward is that fact. The K loop therefore
merges the logsumexp's state itself (its running max), shifts by the running max instead of
``c``, rescales what it has summed whenever the max grows, and after the loop, once ``lse`` and
the graph's own shift ``c`` are known, rescales the sums by ``exp(shift - c)``: every value the
epilogue reads is the two-pass value, up to rounding, whatever the epilogue does with it (the
division by the row sum, the logsumexp written for the backward).

``online_shift`` is the condition, read by the analyzer (may the logsumexp move into the K loop?)
and by the GEMM's spec (which nodes the writer treats so). ``normalized_after`` puts a softmax's
division by its total after the product (``softmax(x) @ v = (exp(x - c) @ v) / total``), where
the K loop sums the total too: how ``rx.attention`` is declared, and what the condition reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from ..dtypes import accumulator
from ..expr import Expr, node
from ..ops.reduction import softmax_of
from ..registry import REGISTRY, OpKind
from .bind import Info
from .roles import Role

#: ops whose value stays proportional to one operand (scaled by factors that do not depend on the
#: shift): the operand positions the shifted value may take, and whether the other value operand
#: must be the constant 0 (a select: the value on one branch, 0 on the other)
LINEAR: dict[str, tuple[tuple[int, ...], bool]] = {
    "cast": ((0,), False),  # a rounding, not a scale: proportional up to it
    "neg": ((0,), False),
    "mul": ((0, 1), False),  # times a factor of its own
    "div": ((0,), False),  # over a divisor of its own
    "where": ((1, 2), True),  # a mask: the value or 0
    "dropout": ((0,), False),  # the kept elements scaled by 1 / (1 - p), the others 0
}
STATISTICS = frozenset({"logsumexp"})  # merged as the loop runs: its state's running max gives the shift
SHIFTS = frozenset({"sub"})  # ``x - c``: the statistic's input shifted by it
EXPS = frozenset({"exp"})  # ``exp(x - c)``: what the loop sums in proportion
SUMS = frozenset({"sum"})  # a K-loop reduction that stays proportional to what it sums


def _zero(e: Expr) -> bool:
    return e.is_const and e.attr("value") == 0


def online_shift(
    r: Expr,
    members: Mapping[Expr, Role],
    readers: Callable[[Expr], Iterable[Expr]],
    per_row: Iterable[Expr],
    product: Expr,
) -> Expr | None:
    """The shift node when logsumexp ``r`` can merge in the K loop of GEMM ``product`` whose
    prologue reads it: ``per_row`` are the elementwise values computed from ``r`` alone (its guard,
    a detach); the prologue (``members`` with role A) reads ``r`` or those only as ``c`` in
    ``exp(x - c)``, with ``x`` the logsumexp's own input, one shift node for all; from each such
    exp, every reader in the kernel keeps the value proportional to it (``LINEAR``) up to the
    product's A operand or a sum over the K axis, and no kernel else reads one of them. None
    where not (the two passes stay)."""
    if r.op not in STATISTICS:
        return None
    x = r.srcs[0]
    rows = dict.fromkeys((r, *per_row))
    subs = [c for p in rows for c in readers(p) if members.get(c) is Role.A]
    if not subs or any(s.op not in SHIFTS or s.srcs[0] is not x or s.srcs[1] not in rows for s in subs):
        return None
    if len({s.srcs[1] for s in subs}) != 1:
        return None
    shifted = _shifted(subs, members, readers, product, {*rows, *subs})
    return subs[0].srcs[1] if shifted else None


def _shifted(
    subs: list[Expr], members: Mapping[Expr, Role], readers: Callable, product: Expr, shift: set[Expr]
) -> bool:
    """Does every value computed from ``exp(x - c)`` stay proportional to it up to the K loop's
    sums (the product's A operand, a ``sum`` of A over K), inside the kernel's prologue, scaled
    only by factors that read neither the statistic nor the shifted values (``shift``)?"""
    chain: dict[Expr, Expr] = {}
    stack = []
    for s in subs:
        outs = list(readers(s))
        if not outs or any(e.op not in EXPS or members.get(e) is not Role.A for e in outs):
            return False
        stack += outs
    while stack:
        z = stack.pop()
        if z in chain:
            continue
        chain[z] = z
        for y in readers(z):
            if y is product:
                if y.srcs[0] is not z or y.srcs[1] is z:
                    return False
                continue
            if members.get(y) is not Role.A:
                return False  # read by the epilogue, or by another kernel: it would see the running shift
            if REGISTRY[y.op].kind is OpKind.REDUCTION:
                if y.op not in SUMS:
                    return False
                continue
            at = [k for k, s in enumerate(y.srcs) if s is z]
            others = [s for k, s in enumerate(y.srcs) if s is not z]
            positions, select = LINEAR.get(y.op, ((), False))
            if len(at) != 1 or at[0] not in positions or (select and not _zero(y.srcs[3 - at[0]])):
                return False
            if any(_reads(o, shift) for o in others):
                return False
            stack.append(y)
    return True


def _reads(e: Expr, targets: set[Expr]) -> bool:
    """Does ``e`` depend on one of the nodes ``targets``?"""
    seen: set[Expr] = set()
    stack = [e]
    while stack:
        n = stack.pop()
        if n in targets:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.srcs)
    return False


def shifted_by(nodes: Iterable[Expr], roles: Mapping[Expr, Role]) -> tuple[Expr, Expr] | None:
    """A GEMM kernel's online logsumexp and the shift node its prologue reads (``exp(x - c)``, ``c``
    computed from the logsumexp of ``x`` in the same kernel: only ``online_shift`` puts one there),
    or None."""
    members = {n: n for n in nodes if roles[n] is Role.A}
    for s in members.values():
        if s.op not in SHIFTS:
            continue
        x, c = s.srcs
        stack, seen = [c], set()
        while stack:
            n = stack.pop()
            if n.op in STATISTICS and n.srcs[0] is x and n in members:  # (not another kernel's)
                return n, c
            if n in members and n not in seen:
                seen.add(n)
                stack.extend(n.srcs)
    return None


def _path_to_softmax(e: Expr) -> tuple[list[tuple[Expr, int]], Expr, Expr] | None:
    """``(path, exp(x - c), total)``: ``e`` is a softmax, or ops that keep one proportional
    (``LINEAR``) over it, ``path`` their (node, operand position) from ``e`` down; None if not."""
    found = softmax_of(e)
    if found is not None:
        return [], *found
    positions, select = LINEAR.get(e.op, ((), False))
    for k in positions:
        below = _path_to_softmax(e.srcs[k])
        if below is None or (select and not _zero(e.srcs[3 - k])):
            continue
        others = [s for j, s in enumerate(e.srcs) if j != k]
        if any(_reads(o, {below[2]}) for o in others):  # (p * p: its other p needs the total first)
            return None
        return [(e, k), *below[0]], below[1], below[2]
    return None


def normalized_after(p: Expr, info: Callable[[Expr], Info], typed: Callable[[Expr], Expr]) -> Expr:
    """Contraction ``p`` whose A operand is a softmax over its contracted (last) axis, through ops
    that keep it proportional (``LINEAR``: a cast, a mask, dropout): ``(exp(x - c) @ v) / total``,
    the total summed over ``exp(x - c)`` itself, cast to ``p``'s own dtype after the division (as
    ``rx.attention`` declares it). The same value, and the form whose K loop merges the logsumexp
    online: the prologue reads the shift only. The product is kept at its accumulator's dtype
    (``contract(dtype=fp32)`` for half operands) and rounded once, after the division: a backward
    that saves it (hand-written attention's ``rowsum(dO * (E @ v))``) reads it unrounded, as eager's
    ``sum(dP * P)`` is (bf16: a projection weight's gradient was 17x eager's error, model fuzzer
    program 2026130100046). ``info(e)`` is a typed node's ``Info``;
    ``typed(e)`` types a new node. ``p`` itself where the rule does not apply."""
    if REGISTRY[p.op].kind is not OpKind.CONTRACTION or p.attr("ta") or p.attr("sum_batch"):
        return p
    found = _path_to_softmax(p.srcs[0])
    if found is None:
        return p
    path, u, total = found
    if total.attr("axis") != (len(info(u).shape) - 1,) or not total.attr("keepdim"):
        return p
    if not info(u).shape[-1]:  # no keys: the product is 0 (torch's), where 0 / a total of 0 is NaN
        return p
    a = u
    for above, k in reversed(path):  # the chain again, over the unnormalized exp
        a = typed(node(above.op, *(a if j == k else s for j, s in enumerate(above.srcs)), **above.attr_dict))
    product = typed(node(p.op, a, p.srcs[1], **(p.attr_dict | {"dtype": accumulator(info(p).dtype)})))
    rowsum = typed(node("sum", u, axis=total.attr("axis"), keepdim=True))
    return typed(node("cast", typed(node("div", product, rowsum)), dtype=info(p).dtype))
