"""Every broadcast pattern of two operands under every unary, forward and backward (issue 22 item 2).

``u(x) * v(y)`` with ``x`` full and ``y`` broadcast as ``(C,)``, ``(R, 1)``, ``(1, C)`` or ``()``,
both requiring grad: the broadcast operand's gradient is a reduction of per-element math, and the
values that feed both that reduction and the full gradient must keep the right per-row / full
shape in the kernel. Checked against float64 torch on the interpreter's launch configurations and
on the sm_90 target's (through the memory trace, whose tiles differ).
"""

from __future__ import annotations

import pytest
import torch
from fuzzing import UNARY_FLOAT

import rtxdsl as rx

R, C = 7, 64  # odd rows; 64 columns fill a column-reduction tile
PATTERNS = {"cols": (C,), "rows": (R, 1), "row_vector": (1, C), "scalar": ()}
x, y = rx.var("x"), rx.var("y")
CASES = [(f"{name}(x)*sigmoid(y)", fn(x) * rx.sigmoid(y)) for name, fn in UNARY_FLOAT]
CASES += [(f"sigmoid(x)*{name}(y)", rx.sigmoid(x) * fn(y)) for name, fn in UNARY_FLOAT]
REFERENCE = rx.FusionConfig(backend="torch")


def _inputs(shape):
    gen = torch.Generator().manual_seed(len(shape) * 7 + sum(shape))
    return torch.randn(R, C, generator=gen), torch.randn(shape, generator=gen)


def _reference(expr, xs, ys):
    x64, y64 = (t.double().requires_grad_() for t in (xs, ys))
    out = rx.compile(expr, config=REFERENCE)(x=x64, y=y64)
    cot = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
    return out, cot, torch.autograd.grad(out, (x64, y64), cot)


def _close(got, want, what):
    # fp32 against float64, through half-precision casts in some cases: scaled by the magnitude
    scale = 1 + want.abs().max().item()
    torch.testing.assert_close(got.double(), want.double(), atol=4e-3 * scale, rtol=4e-3, msg=what)


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize(("name", "expr"), CASES, ids=[c[0] for c in CASES])
def test_broadcast_operand_forward_and_backward(pattern, name, expr):
    xs, ys = _inputs(PATTERNS[pattern])
    want, cot, (dx, dy) = _reference(expr, xs, ys)
    xg, yg = xs.clone().requires_grad_(), ys.clone().requires_grad_()
    out = rx.compile(expr)(x=xg, y=yg)
    _close(out, want, f"{name} {pattern}: forward")
    gx, gy = torch.autograd.grad(out, (xg, yg), cot.to(out.dtype))
    _close(gx, dx, f"{name} {pattern}: dx")
    _close(gy, dy, f"{name} {pattern}: dy")


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize(
    ("name", "expr"), CASES[:: len(UNARY_FLOAT) // 4], ids=[c[0] for c in CASES[:: len(UNARY_FLOAT) // 4]]
)
def test_broadcast_operand_backward_on_the_sm90_target(pattern, name, expr):
    """The backward kernels with sm_90's tiles (a column-reduction tile of 64 columns, 1024-wide
    pointwise blocks), run by the memory trace; a sample of the unaries on both sides."""
    xs, ys = _inputs(PATTERNS[pattern])
    _, cot, (dx, dy) = _reference(expr, xs, ys)
    plan = rx.compile(expr).grad_plan(x=xs, y=ys)
    feed = {"x": xs, "y": ys} | {n: cot.float() for n in plan.backward.inputs if n.startswith("_g")}
    forward = rx.memory_trace(plan.forward, **{n: feed[n] for n in plan.forward.inputs}).result
    feed |= forward if isinstance(forward, dict) else {plan.forward.outputs[0]: forward}  # saved values
    result = rx.memory_trace(plan.backward, **{n: feed[n] for n in plan.backward.inputs}).result
    result = result if isinstance(result, dict) else {plan.backward.outputs[0]: result}
    grad_of = dict(plan.grads.grad_of)
    _close(result[grad_of["x"]], dx, f"{name} {pattern}: dx (sm_90)")
    _close(result[grad_of["y"]], dy, f"{name} {pattern}: dy (sm_90)")


#: every binary elementwise op under a loss that reduces it: the loss's cotangent reaches the op
#: broadcast (one value per reduced row, or one number), and the broadcast operand's gradient sums it
#: over every element it was broadcast to (a bias before a mean: once a sum over one row)
BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / (rx.abs(b) + 1.0),
    "maximum": lambda a, b: rx.maximum(a, b),
    "where": lambda a, b: rx.where(a > 0, a, b),
}
LOSSES = {
    "sum": lambda e: rx.sum(e),
    "mean over rows": lambda e: rx.mean(e, axis=0),
    "mean of row sums": lambda e: rx.mean(rx.sum(e, axis=-1)),
}


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("op", sorted(BINARY))
def test_a_broadcast_operand_under_a_reducing_loss(op, pattern, loss):
    expr = LOSSES[loss](BINARY[op](x, y))
    xs, ys = _inputs(PATTERNS[pattern])
    want, cot, (dx, dy) = _reference(expr, xs, ys)
    xg, yg = xs.clone().requires_grad_(), ys.clone().requires_grad_()
    out = rx.compile(expr)(x=xg, y=yg)
    gx, gy = torch.autograd.grad(out, (xg, yg), cot.to(out.dtype))
    _close(gx, dx, f"{op} {pattern} {loss}: dx")
    _close(gy, dy, f"{op} {pattern} {loss}: dy")
