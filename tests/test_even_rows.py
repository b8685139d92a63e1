"""Rows that fill their blocks (``KernelSpec.even``: a power-of-two row kept whole, or a looped row a
multiple of its block): no column mask, and a row reduction's lanes need no select. A masked row's
values are computed from whatever its loads give but never stored; everything else must agree
with torch exactly as where columns are masked, NaN and inf included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import FLOAT_TOLERANCES, assert_close
from test_gpu_shapes import AT_SMALL

import rtxdsl as rx
from rtxdsl.lower import INTERPRETER

x, w, b, t = rx.var("x"), rx.var("w"), rx.var("b"), rx.var("t")

# name: (expression, torch reference over float64 inputs, does it take w / b / t)
CASES = {
    "softmax": (lambda: rx.softmax(x), lambda v: torch.softmax(v["x"], -1)),
    "log_softmax": (lambda: rx.log_softmax(x), lambda v: torch.log_softmax(v["x"], -1)),
    "logsumexp": (lambda: rx.logsumexp(x, -1), lambda v: v["x"].logsumexp(-1)),
    "variance": (lambda: rx.variance(x, -1), lambda v: v["x"].var(-1)),
    "amax_sum": (lambda: rx.amax(x, -1) + rx.sum(x * 2, -1), lambda v: v["x"].amax(-1) + (v["x"] * 2).sum(-1)),
    "layer_norm": (
        lambda: rx.layer_norm(x, w, b),
        lambda v: F.layer_norm(v["x"], v["x"].shape[-1:], v["w"], v["b"]),
    ),
    "rms_norm": (lambda: rx.rms_norm(x, w), lambda v: F.rms_norm(v["x"], v["x"].shape[-1:], v["w"], 1e-6)),
    "cross_entropy": (
        lambda: rx.cross_entropy(x, t, reduction="none"),
        lambda v: F.cross_entropy(v["x"], v["t"], reduction="none"),
    ),
}
# widths: 32 and 64 fill one block on either target; 128 loops over SMALL's 32-wide blocks four
# times (an even looped row); 7 rows leave the last row block part-masked (SMALL: 4 rows a block)
WIDTHS = [32, 64, 128]


def _inputs(names: str, rows: int, n: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    v = {"x": torch.randn(rows, n, generator=gen, dtype=torch.float64) * 3}
    v["x"][1, 3], v["x"][2, 5] = float("nan"), float("inf")  # rows 1 and 2: NaN, inf; the rest finite
    v |= {
        "w": torch.randn(n, generator=gen, dtype=torch.float64),
        "b": torch.randn(n, generator=gen, dtype=torch.float64),
    }
    v["t"] = torch.randint(0, n, (rows,), generator=gen)
    return {k: (val.to(dtype) if val.is_floating_point() else val) for k, val in v.items() if k in names}


@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype,atol,rtol", FLOAT_TOLERANCES, ids=lambda v: str(v).replace("torch.", ""))
def test_even_rows_match_torch(name, n, dtype, atol, rtol, gen):
    expr, ref = CASES[name]
    k = rx.compile(expr())
    ins = _inputs("".join(k.inputs), 7, n, dtype, gen)
    want = ref({key: val.double() if val.is_floating_point() else val for key, val in ins.items()})
    assert_close(k(**ins), want, atol, rtol, f"{name} interpreter")
    trace = rx.memory_trace(k, **ins, **AT_SMALL)
    assert_close(trace.result, want, atol, rtol, f"{name} small")
    # the interpreter's row is one power-of-two block (even); SMALL splits 128 (few long rows)
    assert all(c.spec.even for c in k.lower_for(INTERPRETER, **ins).launched if c.spec.kind == "row")


@pytest.mark.parametrize("n", [64, 128])
def test_even_norm_gradients_match_torch(n, gen):
    """Backward row kernels with weight gradients (column lanes: still masked by row) at even widths."""
    for name, ref in (("layer_norm", lambda v: F.layer_norm(v["x"], (n,), v["w"], v["b"])), ("rms_norm", None)):
        expr = rx.layer_norm(x, w, b) if name == "layer_norm" else rx.rms_norm(x, w)
        k = rx.compile(expr)
        ins = {n_: val.requires_grad_() for n_, val in _inputs("".join(k.inputs), 7, n, torch.float32, gen).items()}
        ins["x"] = (ins["x"].detach().nan_to_num(0.0, 5.0, -5.0)).requires_grad_()
        truth = {key: val.detach().double().requires_grad_() for key, val in ins.items()}
        f = ref or (lambda v: F.rms_norm(v["x"], (n,), v["w"], 1e-6))
        g = torch.randn(7, n, generator=gen)
        k(**ins).backward(g)
        f(truth).backward(g.double())
        for key in ins:
            assert_close(ins[key].grad, truth[key].grad, 1e-4, 1e-4, f"{name} d{key}")


@pytest.mark.parametrize("name", ["softmax", "logsumexp", "variance", "amax_sum", "layer_norm", "rms_norm"])
def test_a_row_of_one_value_broadcast_reduces_over_every_lane(name, gen):
    """An input broadcast along the row (stride 0: one value per row) is a per-row value; its
    reduction still counts every lane of the row (hypothesis found layer_norm of such rows giving
    -1.41 for 0: the select that broadcast it to the tile had become the rows' mask alone)."""
    expr, ref = CASES[name]
    k = rx.compile(expr())
    ins = _inputs("".join(k.inputs), 7, 32, torch.float32, gen)
    ins["x"] = ins["x"][:, :1].expand(7, 32)
    want = ref({key: val.double() for key, val in ins.items()})
    assert_close(k(**ins), want, 1e-5, 1e-5, name)
    assert_close(rx.memory_trace(k, **ins, **AT_SMALL).result, want, 1e-5, 1e-5, f"{name} small")


@pytest.mark.parametrize("reduce", ["sum", "mean", "amax"])
@pytest.mark.parametrize("rows", [8, 32])  # the reduced extent fills its blocks: an even kernel
def test_a_reduction_of_a_value_broadcast_along_the_reduced_axis_counts_every_lane(reduce, rows, gen):
    """The backward's ``sum(expand(g), 0)``: the value is emitted at one lane per row (a movement op
    reads it at other coordinates), so an even kernel's unselected sum counted it once, not
    ``rows`` times: the gradient of a bias through ``(x + b).mean(-2)`` under a tensor cotangent
    was 1/rows of torch's (found by the model fuzzer, seed 20261802), compiled and lazily alike."""
    xv, bv = torch.randn(rows, 16, generator=gen), torch.randn(16, generator=gen)
    cot = torch.randn(16, generator=gen)
    leaves = [xv.clone().requires_grad_(), bv.clone().requires_grad_()]
    k = rx.compile(getattr(rx, reduce)(x + b, -2))
    got = torch.autograd.grad(k(x=leaves[0], b=leaves[1]), leaves, cot)
    ref = [v.double().requires_grad_() for v in (xv, bv)]
    want = torch.autograd.grad(getattr(ref[0] + ref[1], reduce)(-2), ref, cot.double())
    for name, g, e in zip("xb", got, want):
        assert_close(g, e, 1e-5, 1e-5, f"d{name}")
    f = rx.Fusion()
    lb = bv.clone().requires_grad_()
    y = getattr(f.lazy(leaves[0].detach()) + f.lazy(lb), reduce)(-2)
    (gb,) = torch.autograd.grad(y.torch(), [lb], cot)
    assert_close(gb, want[1], 1e-5, 1e-5, "lazy db")
