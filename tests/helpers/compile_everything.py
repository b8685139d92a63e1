"""Compile, for sm_90, every kernel the test suite's expressions generate (run by test_compiled_code.py).

The interpreter is lenient about types where the compiler is not; with no GPU this is the
guard that every generated kernel, forward and backward, compiles for a real device.
Runs with TRITON_INTERPRET=0 (compiling needs Triton's compiled mode); prints "N/M compiled".
"""

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from test_autograd import CASES  # noqa: E402
from test_elementwise import BINARY, UNARY  # noqa: E402

import rtxdsl as rx  # noqa: E402
from rtxdsl.build import compile_kernel  # noqa: E402

x, y = rx.var("x"), rx.var("y")
fails = 0
n = 0


def tryc(name, k, ins):
    global fails, n
    n += 1
    try:
        compile_kernel(k, ins)
    except Exception as e:  # report every failure, then the count
        fails += 1
        print("FAIL", name, type(e).__name__, " | ".join(str(e).splitlines()[-8:])[:900])


def try_together(label, exprs, ins):
    """Every expression of ``exprs`` as an output of one kernel (one compile where they fuse); on a
    failure, each alone, so that the report names the op."""
    global n
    try:
        compile_kernel(rx.compile(exprs), ins)
        n += len(exprs)
    except Exception:  # find which: each one compiled alone
        for name, e in exprs.items():
            tryc(f"{name}-{label}", rx.compile(e), ins)


for dt in (torch.float32, torch.float16, torch.bfloat16):
    pair = {"x": torch.empty(1000, dtype=dt), "y": torch.empty(1000, dtype=dt)}
    try_together(dt, {name: build(x) for name, (build, _, _) in UNARY.items()}, {"x": pair["x"]})
    try_together(dt, {name: build(x, y) for name, (build, _, _, _) in BINARY.items()}, pair)
for dt in (torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool):
    ops = {"add": x + y, "mul": x * y, "cmp": x < y, "where": rx.where(x > y, x, y), "cast": x.to(torch.float16)}
    if dt is not torch.bool:
        ops.update(
            {
                "fd": x // y,
                "rem": x % y,
                "max": rx.maximum(x, y),
                "abs": abs(x),
                "sign": rx.sign(x),
                "sum": rx.sum(x, -1),
                "amax": rx.amax(x, 0),
            }
        )
    if dt is not torch.bool and not dt.is_floating_point:
        ops.update({"and": x & y, "inv": ~x})
    try_together(dt, ops, {"x": torch.empty(8, 100, dtype=dt), "y": torch.empty(8, 100, dtype=dt)})
# reductions over axes, long rows, strided
for name, e, ins in [
    ("var0", rx.variance(x, 0), {"x": torch.empty(50, 70)}),
    ("sumall", rx.sum(x), {"x": torch.empty(50, 70)}),
    ("tuple", rx.mean(x, (0, 2)), {"x": torch.empty(5, 6, 7)}),
    ("long_sm", rx.softmax(x), {"x": torch.empty(3, 70001)}),
    ("long_lse_drop", rx.logsumexp(x, -1), {"x": torch.empty(3, 70001)}),
    ("long_max", rx.amax(x, -1), {"x": torch.empty(3, 70001)}),
    ("strided", rx.relu(x * y), {"x": torch.empty(40, 30).t(), "y": torch.empty(30, 1)}),
    (
        "ln_half",
        rx.layer_norm(x, y),
        {"x": torch.empty(7, 781, dtype=torch.float16), "y": torch.empty(781, dtype=torch.float16)},
    ),
    ("f64_const", rx.exp(x) * 0.1 + 1e-12, {"x": torch.empty(100, dtype=torch.float64)}),
    ("zero_dim", x + 1, {"x": torch.tensor(1.0)}),
    # GPU-shaped families: split rows (partial + finish), column tiles, 2-D pointwise tiles
    ("split_softmax", rx.softmax(x), {"x": torch.empty(8, 131072)}),
    (
        "split_ln_bf16",
        rx.layer_norm(x, y),
        {"x": torch.empty(8, 131072, dtype=torch.bfloat16), "y": torch.empty(131072, dtype=torch.bfloat16)},
    ),
    ("split_sum_all", rx.sum(x), {"x": torch.empty(1 << 22)}),
    ("column_sum", rx.sum(x, 0), {"x": torch.empty(4096, 1024)}),
    ("column_var_f16", rx.variance(x, 0), {"x": torch.empty(4096, 1024, dtype=torch.float16)}),
    ("tile_add", x + y, {"x": torch.empty(1024, 4096).t(), "y": torch.empty(4096, 1024)}),
    # a tail: rows, then the last program reduces what every program wrote (one launch)
    ("tail_sum_lse_sq", rx.sum(rx.logsumexp(x, -1) ** 2), {"x": torch.empty(64, 4096, dtype=torch.float16)}),
    # movement: slices, joins, gathers, positions, random numbers (coordinate kernels)
    ("slice_cat_flip", rx.cat([x[:, 1:], rx.flip(y, -1)], -1) * 2, {"x": torch.empty(8, 65), "y": torch.empty(8, 30)}),
    ("select_strided", x[..., 3] + y[0], {"x": torch.empty(30, 40).t(), "y": torch.empty(5, 40)}),
    ("gather_i32", rx.gather(x, rx.var("i"), 1), {"x": torch.empty(8, 100), "i": torch.empty(8, 3, dtype=torch.int32)}),
    ("dropout_half", rx.dropout(x, 0.1), {"x": torch.empty(8, 100, dtype=torch.float16)}),
    ("rand_f64", rx.rand_like(x, seed=3), {"x": torch.empty(9, dtype=torch.float64)}),
    (
        "ce_bf16",
        rx.cross_entropy(x, rx.var("t"), label_smoothing=0.1),
        {"x": torch.empty(16, 32000, dtype=torch.bfloat16), "t": torch.empty(16, dtype=torch.int64)},
    ),
    (
        "rope_bf16",
        rx.rope(x, y, rx.var("s")),
        {
            "x": torch.empty(2, 8, 16, 128, dtype=torch.bfloat16),
            "y": torch.empty(16, 128, dtype=torch.bfloat16),
            "s": torch.empty(16, 128, dtype=torch.bfloat16),
        },
    ),
    # contractions: a GEMM with its epilogue, transposed and batched operands, every float dtype
    (
        "gemm_linear_gelu_bf16",
        rx.gelu(rx.linear(x, y, rx.var("b"))),
        {
            "x": torch.empty(300, 520, dtype=torch.bfloat16),
            "y": torch.empty(260, 520, dtype=torch.bfloat16),
            "b": torch.empty(260, dtype=torch.bfloat16),
        },
    ),
    (
        "gemm_batched_mT_f16",
        x @ rx.permute(y, (0, 2, 1)),
        {"x": torch.empty(4, 100, 64, dtype=torch.float16), "y": torch.empty(4, 96, 64, dtype=torch.float16)},
    ),
    (
        "gemm_f32_residual",
        x @ y + rx.var("r"),
        {"x": torch.empty(70, 90), "y": torch.empty(90, 50), "r": torch.empty(70, 50)},
    ),
    ("gemm_f64", x @ y, {"x": torch.empty(33, 17, dtype=torch.float64), "y": torch.empty(17, 9, dtype=torch.float64)}),
]:
    tryc(name, rx.compile(e), ins)
# a linear layer's backward: gelu'(h) * g with the bias's column sum, dx, and dW with the batch summed
lin = rx.compile(rx.gelu(rx.linear(x, y, rx.var("b"))))
lin_in = {"x": torch.empty(4, 64, 96, dtype=torch.bfloat16), "y": torch.empty(80, 96, dtype=torch.bfloat16)}
lin_in["b"] = torch.empty(80, dtype=torch.bfloat16)
lin_plan = lin.grad_plan(**lin_in)
lin_feed = {
    **lin_in,
    "_g0": torch.empty(4, 64, 80, dtype=torch.bfloat16),
    "_s0": torch.empty(4, 64, 80, dtype=torch.bfloat16),
}
tryc("bwd-linear-gelu-bf16", lin_plan.backward, {n_: lin_feed[n_] for n_ in lin_plan.backward.inputs})
# backward kernels
for name, (expr, make) in CASES.items():
    k = rx.compile(expr)
    ins = [t.float() for t in make()]
    plan = k.grad_plan(*ins)
    feed = dict(zip(k.inputs, ins))
    fo = plan.forward(**feed)
    for kk in plan.grads.saved_keys:
        feed[kk] = fo[kk]
    for i, key in enumerate(plan.grads.user_keys):
        feed[f"_g{i}"] = torch.empty_like(fo[key])
    tryc(f"bwd-{name}", plan.backward, {n_: feed[n_] for n_ in plan.backward.inputs})
    tryc(f"fwd-{name}", plan.forward, {n_: feed[n_] for n_ in plan.forward.inputs})
print(f"{n - fails}/{n} compiled")  # expressions (those compiled together count one each)
