"""Gradients where a derivative masks (issue 33): inf and NaN cotangents (a mean over no counted row
sends 1 / 0 down to its masked rows) and inputs at the special points (0 for relu and abs, ties for
maximum / minimum and amax / amin, clamp's bounds, +-0, +-inf, NaN), for every differentiable op in
the registry, against torch autograd through each op's torch reference, NaN positions included.

torch's rules differ per op and each is held to its own: a piecewise-constant op (floor, ceil,
round, trunc, sign; div with a rounding mode) gives ``zeros_like(grad)``, exactly 0 even for an inf
or NaN cotangent; where, relu, clamp, maximum / minimum and pow at a 0 exponent mask with ``where``
/ ``masked_fill`` (exactly 0 for what is not taken); abs, amax / amin (ties split evenly), leaky_relu,
dropout and the products multiply, so inf * 0 is NaN there in torch too. ``g * 0`` as a mask is
therefore wrong exactly where torch's rule is not a product.

Each op of the registry is covered: by a generic case from its kind and arity (a new elementwise
or reduction op is picked up as it is declared), by its own cases below, or skipped with a reason.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import rtxdsl as rx
from rtxdsl.expr import Expr, node, walk
from rtxdsl.ops import REGISTRY, OpKind, apply_ref
from rtxdsl.ops.helpers import no_grad

INF, NAN = float("inf"), float("nan")
F64 = torch.float64
x, y, w, b, t = (rx.var(n) for n in "xywbt")

#: one operand's special points: signed zeros, the infinities, NaN, and values around them
POINTS = torch.tensor([-INF, -2.5, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 2.5, INF, NAN], dtype=F64)
#: every pair of these (ties included: +-0, +-inf, 1 and 1), as two operands
_PAIR_VALUES = [-INF, -1.0, -0.0, 0.0, 1.0, 2.0, INF, NAN]
A = torch.tensor([u for u, _ in itertools.product(_PAIR_VALUES, repeat=2)], dtype=F64)
B = torch.tensor([v for _, v in itertools.product(_PAIR_VALUES, repeat=2)], dtype=F64)
#: rows for reductions and row ops: a tied max, all tied (zero variance), -inf twice (a tied min),
#: +inf twice, a NaN, ties at both ends
ROWS = torch.tensor(
    [
        [1.0, 3.0, 3.0, 0.0, -1.0, 2.0],
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [2.0, -INF, 0.0, 1.0, -INF, 1.0],
        [INF, 1.0, 0.0, 0.0, 2.0, INF],
        [NAN, 1.0, 2.0, 3.0, 4.0, 5.0],
        [-1.0, -2.0, -2.0, 5.0, 5.0, 0.5],
    ],
    dtype=F64,
)
FINITE_ROWS = ROWS[[0, 1, 5]]  # the ones without inf or NaN (ties only)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


@dataclass(frozen=True)
class Case:
    """An expression, its inputs (the floating-point ones get gradients, unless frozen), and
    optionally torch references standing in for an op's own (by op name)."""

    id: str
    expr: Expr
    inputs: dict[str, torch.Tensor]
    refs: dict[str, Callable[..., Any]] = field(default_factory=dict)
    frozen: tuple[str, ...] = ()  # floating-point inputs torch cannot differentiate by (a class weight)


# ---- generic cases: an op's kind and arity say how to call it ---------------------------------------
def _unary(op: str) -> list[Case]:
    return [Case(op, node(op, x), {"x": POINTS})]


def _binary(op: str) -> list[Case]:
    return [Case(op, node(op, x, y), {"x": A, "y": B})]


def _reduction(op: str) -> list[Case]:
    return [Case(op, node(op, x, axis=-1, keepdim=False), {"x": ROWS})]


def _generic(op: str) -> list[Case] | None:
    d = REGISTRY[op]
    if d.kind is OpKind.ELEMENTWISE and d.arity in (1, 2):
        return (_unary if d.arity == 1 else _binary)(op)
    if d.kind is OpKind.REDUCTION:
        return _reduction(op)
    return None


# torch's floor_divide has no derivative; div with rounding_mode="floor" is the same op with one
# (zeros_like(grad)), and the lazy stream records that as floordiv too
FLOOR_DIV = {"floordiv": lambda a, c: torch.div(a, c, rounding_mode="floor")}
LABELS = torch.tensor([0, -100, 2, 1, -100, 3])  # per row of ROWS: two ignored
NONE_COUNTS = torch.full((6,), -100)  # a padding-only micro-batch
TARGET_ROWS = torch.tensor([2, 0, 3, 1, 4, 5])


def _log_probs(rows: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(rows.nan_to_num(0.0, 30.0, -30.0), -1)  # finite log-probabilities


def _movement_cases() -> list[Case]:
    idx = torch.tensor([[0, 0, 5], [1, 2, 1], [3, 3, 3], [5, 4, 0], [2, 2, 2], [0, 1, 2]])  # repeats: summed
    return [
        Case("unsqueeze", node("unsqueeze", x, axes=(0,)), {"x": ROWS}),
        Case("expand", node("expand", x, shape=(3, 11)), {"x": POINTS}),
        Case("slice", node("slice", x, axis=1, start=1, stop=None, step=2), {"x": ROWS}),
        Case("unslice", node("unslice", x, axis=1, start=1, step=2, size=8), {"x": ROWS[:, :3]}),
        Case("flip", rx.flip(x, -1), {"x": ROWS}),
        Case("permute", rx.permute(x, (1, 0)), {"x": ROWS}),
        Case("transpose", rx.transpose(x, 0, 1), {"x": ROWS}),
        Case("reshape", rx.reshape(x, (4, 9)), {"x": ROWS}),
        Case("narrow", rx.narrow(x, -1, 1, 3), {"x": ROWS}),
        Case("cat", rx.cat([x, y], -1), {"x": ROWS, "y": ROWS.flip(0)}),
        Case("stack", rx.stack([x, y], 0), {"x": ROWS, "y": ROWS.flip(0)}),
        Case("select", node("select", x, axis=0, index=3), {"x": ROWS}),
        Case("gather", rx.gather(x, t, -1), {"x": ROWS, "t": idx}),
    ]


def _llm_cases() -> list[Case]:
    probs = torch.softmax(_randn(6, 6, seed=3), -1)
    weight = torch.rand(6, generator=torch.Generator().manual_seed(4), dtype=F64)
    h, vocab, none = _randn(6, 4, seed=5) * 3, _randn(6, 4, seed=6), {"t": NONE_COUNTS}
    ce = [
        ("cross_entropy", {}, LABELS),
        ("cross_entropy-sum", {"reduction": "sum"}, LABELS),
        ("cross_entropy-none", {"reduction": "none"}, LABELS),
        ("cross_entropy-smoothed-z", {"label_smoothing": 0.1, "z_loss": 0.01}, LABELS),
        ("cross_entropy-all-ignored", {}, NONE_COUNTS),
        ("cross_entropy-all-ignored-z", {"z_loss": 0.01, "label_smoothing": 0.2}, NONE_COUNTS),
    ]
    cases = [Case(i, rx.cross_entropy(x, t, **kw), {"x": ROWS, "t": tg}) for i, kw, tg in ce]
    cases += [
        Case("cross_entropy-weighted", rx.cross_entropy(x, t, w), {"x": ROWS, "t": LABELS, "w": weight}, frozen=("w",)),
        Case("cross_entropy-probabilities", rx.cross_entropy(x, y), {"x": ROWS, "y": probs}),
        Case("z_loss_term", rx.z_loss_term(x, t, 0.01), {"x": ROWS, "t": LABELS}),
        Case("z_loss_term-all-ignored", rx.z_loss_term(x, t, 0.01), {"x": ROWS, "t": NONE_COUNTS}),
        Case("z_loss_term-none", rx.z_loss_term(x, t, 0.01, reduction="none"), {"x": ROWS, "t": LABELS}),
        Case("linear_cross_entropy", rx.linear_cross_entropy(x, w, t), {"x": h, "w": vocab, "t": LABELS}),
        Case("linear_cross_entropy-all-ignored", rx.linear_cross_entropy(x, w, t), {"x": h, "w": vocab} | none),
        Case("linear_logps", rx.linear_logps(x, w, t), {"x": h, "w": vocab, "t": LABELS}),
        Case("linear_logps-all-ignored", rx.linear_logps(x, w, t), {"x": h, "w": vocab} | none),
        Case("linear_logits", rx.linear_logits(x, w, temperature=2.0), {"x": h, "w": vocab}),
        Case("rope", rx.rope(x, y, w), {"x": ROWS, "y": _randn(6, seed=7), "w": _randn(6, seed=8)}),
        Case(
            "rope-interleaved",
            rx.rope(x, y, w, interleaved=True),
            {"x": ROWS, "y": _randn(6, seed=7), "w": _randn(6, seed=8)},
        ),
        Case(
            "mrope",
            rx.mrope(x, y, w, (1, 1, 1)),
            {"x": ROWS.reshape(1, 1, 6, 6), "y": _randn(3, 1, 6, 6, seed=9), "w": _randn(3, 1, 6, 6, seed=10)},
        ),
    ]
    q, p = _log_probs(ROWS), _log_probs(ROWS.flip(0))
    for beta in (0.0, 0.5, 1.0):
        cases.append(Case(f"jsd-{beta}", rx.jsd(x, y, t, beta=beta), {"x": q, "y": p, "t": LABELS}))
    cases.append(Case("jsd-all-ignored", rx.jsd(x, y, t), {"x": q, "y": p, "t": NONE_COUNTS}))
    pq = {"x": q.exp(), "y": p.exp().index_fill(1, torch.tensor([0]), 0.0)}
    pq["x"][1] = pq["y"][1]  # a row of ties: |p - q| at 0
    for reduction in ("batchmean", "mean", "none"):
        cases.append(Case(f"tvd-{reduction}", rx.tvd(x, y, t, reduction), pq | {"t": LABELS}))
    cases.append(Case("tvd-all-ignored", rx.tvd(x, y, t), pq | {"t": NONE_COUNTS}))
    zero_targets = p.exp().index_fill(1, torch.tensor([1, 4]), 0.0)  # xlogy at 0
    cases += [
        Case("kl_div", rx.kl_div(x, y, "batchmean"), {"x": q, "y": zero_targets}),
        Case("kl_div-log-target", rx.kl_div(x, y, "sum", log_target=True), {"x": q, "y": p}),
    ]
    return cases


def _dropout_ref(a: torch.Tensor, seed: int, p: float) -> torch.Tensor:
    """torch's dropout (``input * noise``, noise the scaled mask) with rtxdsl's mask (its Philox draws)."""
    keep = rx.compile(rx.rand_like(x, seed))(x=a.detach()) >= p
    return a * (keep / (1 - p))


def _affine(n: int) -> dict[str, torch.Tensor]:
    return {"w": _randn(n, seed=1), "b": _randn(n, seed=2)}


def _own_cases() -> list[Case]:
    pairs = {"x": A, "y": B}
    bounds = {"x": A, "y": B, "w": B + 1.0}  # lo < hi (and below: lo == hi, lo > hi)
    return [
        Case("gelu", rx.gelu(x), {"x": POINTS}),
        Case("gelu-tanh", rx.gelu(x, "tanh"), {"x": POINTS}),
        Case("cast", rx.cast(x, torch.float32), {"x": POINTS}),
        Case("leaky_relu", rx.leaky_relu(x, 0.2), {"x": POINTS}),
        Case("leaky_relu-0", rx.leaky_relu(x, 0.0), {"x": POINTS}),
        Case("elu", rx.elu(x, 0.5), {"x": POINTS}),
        Case("softplus", rx.softplus(x, 2.0, 1.0), {"x": POINTS}),
        Case("where", rx.where(x > y, x, y), pairs),
        *_binary("pow"),
        Case("pow-0", rx.pow(x, 0.0), {"x": POINTS}),
        Case("pow-2", x**2, {"x": POINTS}),
        Case("pow-3", x**3.0, {"x": POINTS}),
        Case("pow-minus-1", rx.pow(x, -1.0), {"x": POINTS}),
        Case("floordiv", x // y, pairs, FLOOR_DIV),
        Case("floordiv-scalar", x // 2.0, {"x": POINTS}, FLOOR_DIV),
        *_reduction("amax"),
        *_reduction("amin"),
        Case("amax-all-ties", rx.amax(x), {"x": FINITE_ROWS}),
        Case("amin-all-ties", rx.amin(x), {"x": FINITE_ROWS}),
        Case("amax-axis-0", rx.amax(x, 0), {"x": ROWS}),
        Case("mean", rx.mean(x, -1), {"x": ROWS}),
        Case("mean-all", rx.mean(x), {"x": ROWS}),
        Case("variance", rx.variance(x, -1), {"x": ROWS}),
        Case("std", rx.std(x, -1), {"x": ROWS}),
        Case("softmax", rx.softmax(x), {"x": ROWS}),
        Case("log_softmax", rx.log_softmax(x), {"x": ROWS}),
        Case("layer_norm", rx.layer_norm(x, w, b), {"x": ROWS} | _affine(6)),
        Case("rms_norm", rx.rms_norm(x, w), {"x": ROWS, "w": _randn(6, seed=1)}),
        Case("swiglu", rx.swiglu(x, y), pairs),
        Case("geglu", rx.geglu(x, y), pairs),
        Case("clamp", rx.clamp(x, 0.0, 1.0), {"x": POINTS}),
        Case("clamp-tensors", rx.clamp(x, y, w), bounds),
        Case("clamp-tensors-equal", rx.clamp(x, y, y), pairs),
        # lo > hi: hi takes every cotangent; torch gives it a NaN x's too (its rule is x > hi or
        # hi < lo), rtxdsl none (a NaN output either way), so x is not NaN here
        Case("clamp-tensors-crossed", rx.clamp(x, w, y), bounds | {"x": A.nan_to_num(0.5)}),
        Case("clamp_min", rx.clamp(x, y), pairs),
        Case("clamp_max", rx.clamp(x, None, y), pairs),
        Case("dyt", rx.dyt(x, y, w, b), {"x": POINTS, "y": torch.tensor([0.7], dtype=F64)} | _affine(11)),
        Case("relu_squared", rx.relu_squared(x), {"x": POINTS}),
        Case("poly_norm", rx.poly_norm(x, w, b), {"x": ROWS, "w": _randn(3, seed=1), "b": _randn(1, seed=2)}),
        Case("group_norm", rx.group_norm(x, 2, w, b), {"x": ROWS.reshape(3, 4, 3)} | _affine(4)),
        Case("sparsemax", rx.sparsemax(x), {"x": FINITE_ROWS}),  # the reference sorts: no inf or NaN
        Case("matmul", rx.matmul(x, y), {"x": ROWS, "y": _randn(6, 2, seed=1)}),
        Case("contract", rx.contract(x, y, tb=True), {"x": ROWS, "y": _randn(2, 6, seed=1)}),
        Case("linear", rx.linear(x, w, b), {"x": ROWS, "w": _randn(2, 6, seed=1), "b": _randn(2, seed=2)}),
        Case("dropout", rx.dropout(x, 0.5, seed=3), {"x": POINTS}, {"dropout": _dropout_ref}),
        # rows 0 and 1 fully masked (output 0, zero gradients), the others causal
        Case(
            "attention",
            rx.attention(x, y, w, causal=True, mask_mod=lambda b, h, i, j: i >= 2),
            {"x": _randn(1, 2, 5, 3, seed=1), "y": _randn(1, 2, 4, 3, seed=2), "w": _randn(1, 2, 4, 2, seed=3)},
        ),
        *_movement_cases(),
        *_llm_cases(),
    ]


#: ops with no gradient to compare, and why (leaves, scalar arguments and ``no_grad`` rules aside)
SKIP = {
    "detach": "the identity that stops the gradient: none to compare (torch's detach)",
    "token_accuracy": "a share of argmax hits: no gradient (torch's argmax has none)",
    "predicted_tokens": "an argmax per token: integer, no gradient",
    "arange_like": "int64 positions: no gradient",
    "rand_like": "uniform draws from a seed: no gradient",
}


def _skip_reason(op: str) -> str | None:
    d = REGISTRY[op]
    if op in SKIP:
        return SKIP[op]
    if d.kind in (OpKind.LEAF, OpKind.SCALAR):
        return "a leaf or a scalar argument"
    if d.derivative is no_grad:
        return "a comparison or logic op (no_grad): a bool or integer result has no gradient, as in torch"
    return None


OWN = _own_cases()
_OWNED = {c.expr.op for c in OWN}
GENERIC = [
    c for d in REGISTRY.values() if d.name not in _OWNED and not _skip_reason(d.name) for c in _generic(d.name) or []
]
CASES = OWN + GENERIC


def test_every_differentiable_op_has_a_case_or_a_reason():
    """A new op is covered as it is declared: generically from its kind and arity, or by cases of
    its own here (composites, ops with attributes or scalar parameters), or it says why not."""
    covered = {c.expr.op for c in CASES}
    missing = [d.name for d in REGISTRY.values() if d.name not in covered and not _skip_reason(d.name)]
    assert not missing, f"no zero-gradient case for {missing}: add one to _own_cases (or a reason to SKIP)"
    assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


def _torch_eval(e: Expr, feed: dict[str, torch.Tensor], refs: dict[str, Callable[..., Any]]) -> torch.Tensor:
    """``e`` run op by op through each op's torch reference (torch's autograd differentiates it)."""
    vals: dict[int, Any] = {}
    for n in walk([e]):
        if n.is_var:
            vals[id(n)] = feed[n.attr("name")]
        elif n.is_const:
            vals[id(n)] = n.attr("value")
        elif n.op in refs:
            vals[id(n)] = refs[n.op](*[vals[id(s)] for s in n.srcs], **n.attr_dict)
        else:
            vals[id(n)] = apply_ref(REGISTRY[n.op], [vals[id(s)] for s in n.srcs], n.attr_dict)
    return vals[id(e)]


def _leaves(case: Case) -> dict[str, torch.Tensor]:
    return {k: v.clone().requires_grad_(v.is_floating_point() and k not in case.frozen) for k, v in case.inputs.items()}


def _grads(out: torch.Tensor, ins: dict[str, torch.Tensor], cot: torch.Tensor) -> dict[str, torch.Tensor]:
    named = [(k, v) for k, v in ins.items() if v.requires_grad]
    got = torch.autograd.grad(out, [v for _, v in named], cot, retain_graph=True, allow_unused=True)
    return {k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(named, got)}


def _cotangents(out: torch.Tensor):
    """inf, -inf and NaN everywhere and at every other element (1 elsewhere), then 1 everywhere."""
    every_other = (torch.arange(out.numel()) % 2 == 0).reshape(out.shape)
    for v in (INF, -INF, NAN):
        yield f"{v} everywhere", torch.full_like(out, v)
        if out.numel() > 1:
            yield f"{v} at every other element", torch.where(every_other, v, torch.ones_like(out))
    yield "1 everywhere", torch.ones_like(out)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gradient_is_torchs_for_inf_and_nan_cotangents_and_special_inputs(case):
    ours, theirs = _leaves(case), _leaves(case)
    got = rx.compile(case.expr)(**ours)
    want = _torch_eval(case.expr, theirs, case.refs)
    close = {"rtol": 1e-6, "atol": 1e-9, "equal_nan": True}
    torch.testing.assert_close(got, want.to(got.dtype), **close, msg=lambda m: f"{case.id}: the value: {m}")
    for what, cot in _cotangents(want):
        mine, torchs = _grads(got, ours, cot), _grads(want, theirs, cot)
        for k in torchs:
            torch.testing.assert_close(
                mine[k], torchs[k], **close, msg=lambda m, k=k, what=what: f"{case.id}: d{k} for cotangent {what}: {m}"
            )
