"""Reductions and whole-row fusion: one kernel each, minimum bytes, float64-reference accuracy."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from conftest import FLOAT_TOLERANCES, assert_close

import rtxdsl as rx
from rtxdsl import interpret

x, w, b, g, u, r, m = (rx.var(n) for n in ("x", "w", "b", "g", "u", "r", "m"))

# row counts: 1 (decode), 7 (odd, fewer than rows per program), 37 (several programs)
ROWS = [1, 7, 37]
# row lengths: 1 (degenerate), 100 and 781 (odd, in registers), 1823 (another bucket), 70001 (looped)
COLS = [1, 100, 781, 1823, 70001]


def _shapes():
    for rows in ROWS:
        for cols in COLS:
            if cols == 70001 and rows == 37:
                continue  # looped rows are slow under the interpreter: 1 and 7 rows cover them
            yield rows, cols


SHAPES = list(_shapes())


def _minimum_bytes(ins: dict, outs: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ins.values()) + sum(o.numel() * o.element_size() for o in outs)


def _check_one_kernel(k, ins, outs, looped_passes=2, stat_inputs=("x",)):
    """One kernel; rows kept on chip read each input once (the minimum); a looped row reads the
    inputs its statistics need once per statistics pass, and every input once in the output pass."""
    rx.reset_fusion_stats()
    k(**ins)
    s = rx.fusion_stats()
    assert s.kernels_launched == 1, k.explain(**ins)
    looped = max(t.shape[-1] for t in ins.values()) > 16384
    extra = (looped_passes - 1) * sum(ins[n].numel() * ins[n].element_size() for n in stat_inputs) if looped else 0
    assert s.bytes_moved == _minimum_bytes(ins, outs) + extra


# passes over a looped row: logsumexp and the Welford statistics are online (one pass), then the
# output pass; the hand-written softmax reduces twice (max, then sum of exp) before its output.
# STAT_INPUTS: what the statistics pass reads (the rest is read by the output pass only)
LOOPED_PASSES = {"handwritten_softmax": 3}
STAT_INPUTS = {"rms_norm_swiglu": ("g",), "scaled_masked_softmax": ("x", "m")}
PATTERNS = {
    # name: (expression, torch reference, inputs from (rows, cols, dtype, gen), expected pattern)
    "softmax": (rx.softmax(x), lambda x: torch.softmax(x, -1), "Softmax"),
    "log_softmax": (rx.log_softmax(x), lambda x: torch.log_softmax(x, -1), "Softmax"),
    "handwritten_softmax": (
        rx.exp(x - rx.amax(x, -1, keepdim=True)) / rx.sum(rx.exp(x - rx.amax(x, -1, keepdim=True)), -1, keepdim=True),
        lambda x: torch.softmax(x, -1),
        "Reduction",
    ),
    "layer_norm": (rx.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b), "LayerNorm"),
    "rms_norm": (rx.rms_norm(x, w), lambda x, w: F.rms_norm(x, x.shape[-1:], w, 1e-6), "RMSNorm"),
    "rms_norm_swiglu": (
        rx.swiglu(rx.rms_norm(g, w), u),
        lambda g, w, u: F.silu(F.rms_norm(g, g.shape[-1:], w, 1e-6)) * u,
        "RMSNorm",
    ),
    "center": (x - rx.mean(x, -1, keepdim=True), lambda x: x - x.mean(-1, keepdim=True), "Reduction"),
    "scaled_masked_softmax": (rx.softmax(x * 0.125 + m), lambda x, m: torch.softmax(x * 0.125 + m, -1), "Softmax"),
}


def _inputs(name, rows, cols, dtype, gen):
    def t(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    ins = {"x": t(rows, cols)}
    if name in ("layer_norm", "rms_norm"):
        ins["w"] = t(cols)
    if name == "layer_norm":
        ins["b"] = t(cols)
    if name == "rms_norm_swiglu":
        ins = {"g": t(rows, cols), "w": t(cols), "u": t(rows, cols)}
    if name == "scaled_masked_softmax":
        mask = torch.zeros(rows, cols)
        mask[:, ::3] = -math.inf
        mask[:, 0] = 0.0  # every row keeps an element
        ins["m"] = mask.to(dtype)
    return ins


@pytest.mark.parametrize("dtype, atol, rtol", FLOAT_TOLERANCES)
@pytest.mark.parametrize("name", PATTERNS)
def test_row_patterns_one_kernel_minimum_bytes(name, dtype, atol, rtol, gen):
    expr, ref, pattern = PATTERNS[name]
    k = rx.compile(expr)
    shapes = SHAPES if dtype is torch.float32 else [(7, 781), (1, 70001), (37, 100)]
    for rows, cols in shapes:
        ins = _inputs(name, rows, cols, dtype, gen)
        out = k(**ins)
        want = ref(**{n: t.double() for n, t in ins.items()})
        assert_close(out, want, atol * 4, rtol * 4, f"{name} {rows}x{cols} {dtype}")
        _check_one_kernel(k, ins, [out], LOOPED_PASSES.get(name, 2), STAT_INPUTS.get(name, ("x",)))
    assert f"{pattern} —" in k.explain(**_inputs(name, 3, 50, dtype, gen))


def test_residual_layer_norm_with_both_outputs_is_one_kernel(gen):
    h = x + r
    k = rx.compile({"h": h, "y": rx.layer_norm(h, w, b)})
    for rows, cols in [(7, 781), (1, 70001)]:
        ins = {
            "x": torch.randn(rows, cols, generator=gen),
            "r": torch.randn(rows, cols, generator=gen),
            "w": torch.randn(cols, generator=gen),
            "b": torch.randn(cols, generator=gen),
        }
        out = k(**ins)
        hh = ins["x"].double() + ins["r"].double()
        assert_close(out["h"], hh, 1e-5, 1e-5, "h")
        assert_close(out["y"], F.layer_norm(hh, (cols,), ins["w"].double(), ins["b"].double()), 1e-4, 1e-4, "y")
        _check_one_kernel(k, ins, [out["h"], out["y"]], stat_inputs=("x", "r"))


def test_layer_norm_with_mean_and_rstd_outputs_is_one_kernel(gen):
    mu = rx.mean(x, -1, keepdim=True)
    var = rx.variance(x, -1, keepdim=True, correction=0)
    rstd = rx.rsqrt(var + 1e-5)
    k = rx.compile({"y": (x - mu) * rstd, "mean": mu, "rstd": rstd})
    ins = {"x": torch.randn(37, 781, generator=gen) * 3 + 2}
    out = k(**ins)
    xd = ins["x"].double()
    assert_close(out["mean"], xd.mean(-1, keepdim=True), 1e-5, 1e-5, "mean")
    assert_close(out["rstd"], (xd.var(-1, keepdim=True, unbiased=False) + 1e-5).rsqrt(), 1e-5, 1e-5, "rstd")
    assert_close(out["y"], F.layer_norm(xd, (781,)), 1e-4, 1e-4, "y")
    _check_one_kernel(k, ins, list(out.values()))


# whole rows (7, 100), looped (5000: a row longer than one block) and split (70001 over 2 rows);
# float32 only: a half value holds few enough bits that n copies of it sum exactly in fp32 (no fp16
# or bf16 row of one value missed its mean before the fix)
@pytest.mark.parametrize("cols", [7, 100, 5000, 70001])
def test_norms_of_an_input_expanded_along_its_row_are_exact(cols, gen):
    """An input expanded along the normalized dim is a row of one value: torch's layer norm is
    exactly 0 there (its bias), and its variance and std 0. ``sum(x) / n`` can miss the value by an
    ulp, which ``1 / sqrt(eps)`` scales up to 6e-4 (found by the expression fuzzer,
    ``RTXDSL_FUZZ_SEED=20261207``, in a loss over a normed head); the mean is Welford's, corrected
    by the deviations' sum (``ops/reduction.py: _m2_tile_of``)."""
    t = (torch.randn(2, 1, generator=gen) * 5 + 0.1).expand(2, cols)
    out = rx.compile(
        {"ln": rx.layer_norm(x, 1.0, 0.0, 1e-5), "var": rx.variance(x, -1), "std": rx.std(x, -1, correction=0)}
    )(x=t)
    assert torch.equal(out["ln"], F.layer_norm(t, (cols,), eps=1e-5)), out["ln"].abs().max()
    assert torch.equal(out["var"], torch.zeros_like(out["var"])), out["var"]
    assert torch.equal(out["std"], torch.zeros_like(out["std"])), out["std"]


@triton.jit
def _sum_and_first(a0, a1, b0, b1):
    return a0 + b0, a1  # the left operand's second value: the first element's, if left is lower


@triton.jit
def _pair_reduce_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    rows = tl.arange(0, 4)[:, None]
    x = tl.load(x_ptr + rows * BLOCK + tl.arange(0, BLOCK)[None, :])
    total, first = tl.reduce((x, x * 2), 1, _sum_and_first)
    tl.store(out_ptr + tl.arange(0, 4), total)
    tl.store(out_ptr + 4 + tl.arange(0, 4), first)


def test_the_interpreters_reduce_with_a_kernels_own_combine_combines_halves():
    """The layer norm sums its deviations and their squares in one ``tl.reduce`` of a pair; Triton's
    interpreter called the combine once per element from Python (3.5 s a launch), ``rtxdsl.interpret``
    combines halves with the lower one always on the left: a combine keeping its left operand's
    value keeps the first element's, as the interpreter's own left-to-right reduce does."""
    from triton.runtime import interpreter

    interpret.install()
    assert getattr(interpreter.ReduceOps.generic_reduce, "__rtxdsl__", False)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    out = torch.empty(8)
    _pair_reduce_kernel[(1,)](x, out, BLOCK=256)
    torch.testing.assert_close(out[:4], x.sum(1), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[4:], x[:, 0] * 2)


def test_group_norm_of_a_constant_group_is_exact(gen):
    """group_norm shares the norms' Welford mean: a group of one value normalizes to exactly 0."""
    t = (torch.randn(6, 1, 1, generator=gen) * 7 + 0.3).expand(6, 4, 25)  # 12 groups of 50
    got = rx.compile(rx.group_norm(x, 2, 1.0, 0.0, 1e-5))(x=t)
    assert torch.equal(got, F.group_norm(t, 2, eps=1e-5)), got.abs().max()


@pytest.mark.parametrize("shape", [(0, 4, 3), (2, 0, 5), (2, 4, 0), (0, 0, 0)])  # each dim empty in turn
def test_group_norm_of_an_empty_input_is_empty(shape):
    """Its groups reshaped as (N, G, -1) named an internal reshape for an empty input (expression
    fuzzer seed 20306611); torch returns the empty input's shape."""
    t, groups = torch.empty(shape), 2 if shape[1] else 1
    for config in (None, rx.FusionConfig(backend="torch")):  # (its reference divided by 0 channels)
        got = rx.compile(rx.group_norm(rx.var("x"), groups), config=config)(x=t)
        assert got.shape == F.group_norm(t, groups).shape


def test_variance_is_accurate_far_from_zero(gen):
    """Values near 1e4 with spread 100: a one-pass E[x^2]-E[x]^2 would lose every digit in fp32."""
    t = 1e4 + 100 * torch.randn(5, 70001, generator=gen)
    for axis in (-1, 0):
        got = rx.compile(rx.variance(x, axis))(x=t)
        assert_close(got, t.double().var(axis), 0, 1e-4, f"variance axis {axis}")
    got = rx.compile(rx.variance(x, -1))(x=t[:, :781])
    assert_close(got, t[:, :781].double().var(-1), 0, 1e-4, "variance in registers")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_cols", [3, 5000], ids=["in-registers", "long"])  # a short row, a looped one
def test_a_variance_past_the_dtype_range_is_inf_not_nan(dtype, n_cols):
    """Finite values whose squared deviations overflow: the corrected sum of squares was inf - inf
    (NaN; outside expression fuzzer seeds 20309209, 20321713). The variance is inf, as float32
    accumulation gives on a GPU (torch on CPU accumulates in float64 and returns a finite std)."""
    t = torch.ones(2, n_cols, dtype=dtype)
    t[:, 0], t[:, 1] = 1.5e30, 1e30
    got = rx.compile({"v": rx.variance(x, -1), "s": rx.std(x, -1)})(x=t)
    assert torch.isinf(got["v"]).all() and torch.isinf(got["s"]).all(), got


# (count, correction): the correction past the count, and equal to it (dof 0)
@pytest.mark.parametrize("n, correction", [(3, 4), (3, 3), (1, 2)])
def test_a_variance_with_a_correction_past_its_count_differentiates_as_torch(n, correction, gen):
    """torch's forward clamps ``n - correction`` at 0 (inf or NaN) and its var_backward divides by it
    unclamped: the derived gradient was NaN and inf where torch's is finite (outside fuzzer, plumbing
    seed 20312202)."""
    t = torch.randn(2, n, generator=gen, dtype=torch.float64, requires_grad=True)
    for op, ref in ((rx.variance, torch.var), (rx.std, torch.std)):
        got = rx.compile(op(x, -1, correction=correction))(x=t)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns of the degrees of freedom
            want = ref(t, -1, correction=correction)
        torch.testing.assert_close(got, want, equal_nan=True)
        if op is rx.variance:  # (std's gradient over an inf or NaN std is torch's 0 and NaN alike)
            g, w = (torch.autograd.grad(v.sum(), t)[0] for v in (got, want))
            torch.testing.assert_close(g, w, equal_nan=True)


REDUCTIONS = {
    "sum": (rx.sum, torch.sum),
    "mean": (rx.mean, torch.mean),
    "amax": (rx.amax, torch.amax),
    "amin": (rx.amin, torch.amin),
    "max": (rx.max, torch.amax),
    "min": (rx.min, torch.amin),
    "variance": (rx.variance, torch.var),
    "std": (rx.std, torch.std),
    "logsumexp": (rx.logsumexp, torch.logsumexp),
}
# axes: last, first (strided rows), middle tuple, all
AXES = [-1, 0, (0, 2), None]


# rows of one value far from zero: ``masked_fill(mask, -1e9)`` over a whole row, Hugging Face's
# ``finfo.min`` padding, a huge positive constant; beside rows of logits spread wide (1e4)
FAR_ROWS = {"-1e9": -1e9, "finfo.min": None, "+3e8": 3e8}


@pytest.mark.parametrize("cols", [37, 70001], ids=["whole row", "looped row"])
@pytest.mark.parametrize("dtype, atol, rtol", FLOAT_TOLERANCES)
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_of_a_row_of_one_value_far_from_zero_is_uniform(name, dtype, atol, rtol, cols, gen):
    """In every dtype a row holding one value ``v`` far from zero has a logsumexp that rounds to
    ``v`` (``log n`` lies under ``v``'s spacing), so ``exp(x - logsumexp(x))`` is 1 at every
    element: softmax divides by the row's total (``softmax_parts``) and gives torch's uniform row,
    ``-log n`` for log_softmax, and their gradients (they were ``n`` times too large and 0)."""
    finfo = torch.finfo(dtype)
    t = torch.randn(2 + len(FAR_ROWS), cols, generator=gen, dtype=torch.float64)
    t[1] *= 1e4 if dtype is torch.float32 else 100  # wide logits
    for i, v in enumerate(FAR_ROWS.values(), 2):
        t[i] = finfo.min if v is None else math.copysign(min(abs(v), finfo.max / 2), v)  # (fp16's max: 65504)
    xt = t.to(dtype)
    ref = torch.softmax if name == "softmax" else torch.log_softmax
    k = rx.compile(getattr(rx, name)(x, -1))
    leaf = xt.clone().requires_grad_()
    out = k(x=leaf)
    x64 = xt.double().requires_grad_()
    want = ref(x64, -1)
    cot = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    (grad,) = torch.autograd.grad(out, leaf, cot.to(dtype))
    (grad64,) = torch.autograd.grad(want, x64, cot)
    # log_softmax's values on the wide row are as large as the row's spread: rtol covers them
    assert_close(out, want, atol, rtol, f"{name} {dtype}")
    assert_close(grad, grad64, atol * 4, rtol * 4, f"d{name} {dtype}")
    if cols == 37:  # the total is read off the logsumexp's state: one sum of one exp per element
        (src,) = k.sources(x=xt)
        assert src.count("tl.sum(") == 1 and src.count("tl.exp2(") == 1, src
    uniform = torch.full((cols,), 1.0 / cols, dtype=torch.float64)
    for i, label in enumerate(FAR_ROWS, 2):
        expect = uniform if name == "softmax" else uniform.log()
        assert_close(out[i], expect, atol, rtol, f"{name} of the {label} row")


# statistics of rows of one element kept across kernels (expression fuzzer seeds 20301239,
# 20303912, 20304819): a half statistic was stored rounded where the value it was taken of was
# read unrounded, so exp(x - round(x)) summed to 0.6
ONE_ELEMENT_ROWS = {
    "softmax_of_a_half_sum": lambda b, m: m.softmax(b.sum(0), -1).mT,
    "log_softmax_of_a_half_sum": lambda b, m: m.log_softmax(b.sum(0), -1).mT,
    "group_norm_of_a_half_power": lambda b, m: (rx if m is rx else F).group_norm((3.0**b)[..., :1], 1),
}


@pytest.mark.parametrize("case", ONE_ELEMENT_ROWS)
def test_half_statistics_of_one_element_rows_are_kept_in_fp32_across_kernels(case):
    fn = ONE_ELEMENT_ROWS[case]
    t = torch.tensor([[[300.3]], [[400.2]], [[333.1]]]) if "sum" in case else torch.linspace(-2, 2, 23)[:, None, None]
    t = t.half()
    got = rx.compile(fn(rx.var("b"), rx))(b=t)
    assert got.dtype == fn(t, torch).dtype
    assert_close(got, fn(t.double(), torch), 2e-3, 2e-3, case)


def test_the_gradient_of_a_max_over_one_element_read_through_a_slice_is_torchs():
    t = torch.tensor([0.7], dtype=torch.bfloat16, requires_grad=True)
    rx.compile(rx.max(rx.exp(rx.var("a"))[0:1]))(a=t).backward()
    assert_close(t.grad, torch.exp(torch.tensor([0.7], dtype=torch.float64)), 2e-2, 2e-2, "d/da")


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("name", REDUCTIONS)
def test_reductions_over_axes(name, axis, keepdim, gen):
    build, ref = REDUCTIONS[name]
    t = torch.randn(6, 7, 33, generator=gen)
    out = rx.compile(build(x, axis, keepdim))(x=t)
    dims = tuple(range(t.ndim)) if axis is None else axis
    want = ref(t.double(), dims, keepdim=keepdim) if name != "logsumexp" else ref(t.double(), dims, keepdim)
    assert_close(out, want, 1e-5, 1e-5, f"{name} axis={axis} keepdim={keepdim}")
    assert out.dtype == ref(t, dims, keepdim=keepdim).dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_reductions_accumulate_in_fp32(dtype, gen):
    t = (torch.rand(3, 4097, generator=gen) + 0.5).to(dtype)
    out = rx.compile(rx.sum(x, -1))(x=t)
    assert out.dtype == dtype
    assert_close(out, t.double().sum(-1), 1, 1e-2, "sum")  # fp16 eager accumulation would be far worse


def test_integer_and_bool_reductions_exact(gen):
    t = torch.randint(-50, 50, (5, 37), generator=gen, dtype=torch.int32)
    out = rx.compile({"s": rx.sum(x, -1), "mx": rx.amax(x, 0), "mn": rx.amin(x), "cnt": rx.sum(x > 0, -1)})(x=t)
    assert out["s"].dtype == torch.int64 and torch.equal(out["s"], t.sum(-1))
    assert torch.equal(out["mx"], t.amax(0)) and torch.equal(out["mn"], t.amin())
    assert torch.equal(out["cnt"], (t > 0).sum(-1))


def test_nan_semantics_of_reductions():
    t = torch.tensor([[1.0, math.nan, 3.0], [1.0, 2.0, 3.0], [-math.inf, -math.inf, -math.inf]])
    out = rx.compile(
        {
            "mx": rx.amax(x, -1),
            "mn": rx.amin(x, -1),
            "s": rx.sum(x, -1),
            "lse": rx.logsumexp(x, -1),
            "sm": rx.softmax(x),
        }
    )(x=t)
    assert_close(out["mx"], t.amax(-1), 0, 0, "amax")
    assert_close(out["mn"], t.amin(-1), 0, 0, "amin")
    assert_close(out["s"], t.sum(-1), 0, 0, "sum")
    assert_close(out["lse"], torch.logsumexp(t, -1), 1e-6, 1e-6, "logsumexp")
    assert_close(out["sm"], torch.softmax(t, -1), 1e-6, 1e-6, "softmax")


def test_looped_nan_propagation():
    t = torch.randn(2, 70001)
    t[1, 50000] = math.nan
    out = rx.compile(rx.amax(x, -1))(x=t)
    assert out[0].item() == t[0].max().item() and math.isnan(out[1].item())


def test_seed_reference_semantics(gen):
    """rms_norm_cpu: x * rsqrt(mean(x^2) + eps) * weight; swiglu_cpu: silu(gate) * up; the gate normalized first."""
    xs, ws, us = torch.randn(4, 64, generator=gen), torch.randn(64, generator=gen), torch.randn(4, 64, generator=gen)
    rms = xs * torch.rsqrt((xs * xs).mean(-1, keepdim=True) + 1e-6) * ws
    assert_close(rx.compile(rx.rms_norm(x, w))(x=xs, w=ws), rms, 1e-5, 1e-5, "rms_norm_cpu")
    assert_close(rx.compile(rx.swiglu(g, u))(g=xs, u=us), F.silu(xs) * us, 1e-5, 1e-5, "swiglu_cpu")
    got = rx.compile(rx.swiglu(rx.rms_norm(g, w), u))(g=xs, w=ws, u=us)
    assert_close(got, F.silu(rms) * us, 1e-5, 1e-5, "rms_norm_swiglu_cpu")


def test_block_bucket_not_row_length_in_signature(gen):
    from rtxdsl.cache import GLOBAL_CACHE

    GLOBAL_CACHE.clear(reset_stats=False)  # forget kernels earlier tests built
    k = rx.compile(rx.layer_norm(x, w, b))
    k(x=torch.randn(2, 600), w=torch.randn(600), b=torch.randn(600))
    before = rx.cache_stats().compiles + rx.cache_stats().disk_hits
    for cols in (513, 700, 1000):  # same 1024 bucket
        k(x=torch.randn(3, cols), w=torch.randn(cols), b=torch.randn(cols))
    assert rx.cache_stats().compiles + rx.cache_stats().disk_hits == before
    for cols in (1024, 1024):  # the row fills its block (no column mask: KernelSpec.even): one more
        k(x=torch.randn(3, cols), w=torch.randn(cols), b=torch.randn(cols))
    assert rx.cache_stats().compiles + rx.cache_stats().disk_hits == before + 1
    k(x=torch.randn(3, 1025), w=torch.randn(1025), b=torch.randn(1025))  # next bucket
    assert rx.cache_stats().compiles + rx.cache_stats().disk_hits == before + 2


# (expression, reference, shape of b): a per-row value (a reduction's result) combined with math on
# a smaller operand that the row kernel absorbs and recomputes: it must stay per row
PER_ROW_WITH_SMALLER = {
    "sum_mod_0dim": (
        rx.sum(x, -1) % (rx.abs(b) + 1),
        lambda x, b: x.sum(-1) % (b.abs() + 1),
        (),
    ),
    "mean_div_len1": (
        rx.mean(x, -1) / (rx.abs(b) + 1),
        lambda x, b: x.mean(-1) / (b.abs() + 1),
        (1,),
    ),
    "amax_keepdim_times_0dim": (
        rx.amax(x, -1, keepdim=True) * rx.exp(b),
        lambda x, b: x.amax(-1, keepdim=True) * b.exp(),
        (),
    ),
    "logsumexp_sub_0dim_then_full": (
        x - (rx.logsumexp(x, -1, keepdim=True) + rx.sin(b)),
        lambda x, b: x - (x.logsumexp(-1, keepdim=True) + b.sin()),
        (),
    ),
}


@pytest.mark.parametrize("case", sorted(PER_ROW_WITH_SMALLER))
@pytest.mark.parametrize(("rows", "cols"), [(1, 2), (7, 100)])  # the reported shape; several rows, odd
def test_per_row_value_with_a_smaller_operand(case, rows, cols, gen):
    expr, ref, b_shape = PER_ROW_WITH_SMALLER[case]
    xs = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    bs = torch.randn(b_shape, generator=gen, dtype=torch.float64)
    assert_close(rx.compile(expr)(x=xs, b=bs), ref(xs, bs), 1e-9, 1e-9, case)


# a row of one class (no other lane), five, and one looped over in blocks; the target at the first
# column, the last, out of range on both sides
@pytest.mark.parametrize("n", [1, 5, 40001])
@pytest.mark.parametrize("c", [0.0, 2.5, float("nan"), float("inf")])
def test_a_masked_pick_of_a_loaded_row_is_a_load_at_the_index(n, c, gen):
    """sum(where(positions == t, x, c)): x read at t once per row, plus c for each other lane,
    exactly the masked sum's terms (NaN and inf c included, a row of one element adds no c)."""
    x, t = rx.var("x"), rx.var("t")
    k = rx.compile(rx.sum(rx.where(rx.arange_like(x, axis=-1) == t, x, c), axis=-1, keepdim=True))
    xs = torch.randn(4, n, generator=gen)
    ts = torch.tensor([[0], [n - 1], [n + 3], [-2]])
    want = torch.where(torch.arange(n) == ts, xs.double(), c).sum(-1, keepdim=True)
    got = k(x=xs, t=ts)
    assert_close(got, want, 1e-5 * max(1, n), 1e-5)
    src = k.sources(x=xs, t=ts)[0]
    assert "tl.sum(" not in src and "for col_start" not in src  # the load at t: no row reduction, no loop
