"""Contractions: rx.matmul / @ / rx.linear as a generated tiled GEMM with its epilogue fused,
against float64 torch, gradchecked, counted; recorded by the lazy stream."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close

import rtxdsl as rx

x, w, b, r = rx.var("x"), rx.var("w"), rx.var("b"), rx.var("r")

#: (dtype, atol per sqrt(K), rtol): fp32 accumulation, one rounding at the store
TOLERANCES = [
    (torch.float32, 2e-6, 1e-5),
    (torch.float16, 1e-3, 2e-3),
    (torch.bfloat16, 8e-3, 1.6e-2),
]


def _close(got, want, dtype, atol, rtol, k, what=""):
    assert_close(got, want, atol * math.sqrt(max(k, 1)), rtol, what)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), TOLERANCES)
@pytest.mark.parametrize(
    "m, n, k",
    [
        (1, 1, 1),  # one element: every tile edge masked
        (7, 33, 129),  # odd sizes, K longer than one K slice
        (33, 7, 1),  # K of one
        (129, 257, 33),  # several tiles each way (grouped program order)
        (7, 9, 0),  # K = 0: zeros, and the epilogue still runs
        (0, 5, 3),  # no rows: nothing launched
    ],
)
def test_matmul_matches_float64_torch(dtype, atol, rtol, m, n, k, gen):
    a = torch.randn(m, k, generator=gen).to(dtype)
    bb = torch.randn(k, n, generator=gen).to(dtype)
    rx.reset_fusion_stats()
    got = rx.compile(x @ w)(x=a, w=bb)
    assert got.dtype == dtype and got.shape == (m, n)
    assert rx.fusion_stats().kernels_launched == (0 if m * n == 0 else 1)
    _close(got, a.double() @ bb.double(), dtype, atol, rtol, k)


@pytest.mark.parametrize(
    "sa, sb",
    [
        ((2, 1, 7, 33), (3, 33, 5)),  # batch dims broadcast both ways
        ((7, 33), (4, 33, 5)),  # an unbatched left operand
        ((4, 7, 33), (33, 5)),  # an unbatched weight
        ((33,), (4, 33, 5)),  # vector @ batched matrices: a reduction, not a GEMM
        ((4, 7, 33), (33,)),  # batched matrices @ vector
        ((33,), (33,)),  # a dot product
    ],
)
def test_matmul_ranks_and_broadcast_batch_dims(sa, sb, gen):
    a, bb = torch.randn(sa, generator=gen), torch.randn(sb, generator=gen)
    got = rx.compile(rx.matmul(x, w))(x=a, w=bb)
    _close(got, torch.matmul(a.double(), bb.double()), torch.float32, 2e-6, 1e-5, 33)


@pytest.mark.parametrize(
    "layout",
    [
        "transposed",  # a.mT and b.mT views: read through swapped strides
        "sliced",  # every other column and row: strides of 2
        "expanded",  # a batch dim expanded with stride 0
    ],
)
def test_operands_are_read_through_their_strides(layout, gen):
    a0, b0 = torch.randn(4, 33, 7, generator=gen), torch.randn(4, 9, 33, generator=gen)
    if layout == "transposed":
        a, bb = a0.mT, b0.mT
    elif layout == "sliced":
        a, bb = torch.randn(4, 14, 66, generator=gen)[:, ::2, ::2], torch.randn(4, 66, 9, generator=gen)[:, ::2]
    else:
        a, bb = torch.randn(1, 7, 33, generator=gen).expand(4, 7, 33), b0.mT
    k = rx.compile(x @ w)
    got = k(x=a, w=bb)
    _close(got, a.double() @ bb.double(), torch.float32, 2e-6, 1e-5, 33)
    assert k.summary(x=a, w=bb).bytes_moved <= sum(t.untyped_storage().nbytes() for t in (a, bb)) * 2 + got.nbytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_shape", [(3, 5), (5,)], ids=["matrix", "vector"])  # addmm and addmv
def test_a_half_linear_with_a_bias_rounds_once_as_torchs(dtype, x_shape, gen):
    """torch's ``F.linear(x, w, b)`` adds the bias to the float32 accumulator and rounds once; the
    product was rounded to the dtype first, then the sum (an ulp off: 5.5 for 5.46875, and a
    ``remainder`` after it turned the ulp into 1; lazy fuzzer program 2027811800005). Bit for bit
    against the sum rounded once, from the lazy stream and from an expression."""
    x = (torch.randn(x_shape, generator=gen) * 3).to(dtype)
    w, b = (torch.randn(7, 5, generator=gen) * 3).to(dtype), (torch.randn(7, generator=gen) * 3).to(dtype)
    once = (x.float() @ w.float().T + b.float()).to(dtype)
    assert torch.equal(F.linear(x, w, b), once)  # torch's own rule
    got = rx.compile(rx.linear(rx.var("x"), rx.var("w"), rx.var("b")))(x=x, w=w, b=b)
    f = rx.Fusion()
    lazy = F.linear(f.lazy(x), f.lazy(w), f.lazy(b)).torch()
    assert torch.equal(got, once) and torch.equal(lazy, once)


def test_linear_bias_activation_and_residual_are_one_kernel(gen):
    xs, ws, bs = (
        torch.randn(2, 5, 33, generator=gen),
        torch.randn(17, 33, generator=gen),
        torch.randn(17, generator=gen),
    )
    res = torch.randn(2, 5, 17, generator=gen)
    cases = {
        "linear + bias + gelu": (rx.gelu(rx.linear(x, w, b)), lambda: F.gelu(F.linear(xs, ws, bs))),
        "linear + bias + residual": (rx.linear(x, w, b) + r, lambda: F.linear(xs, ws, bs) + res),
        "x @ w.mT scaled, cast": (rx.cast((x @ rx.permute(w, (1, 0))) * 0.5, torch.bfloat16), None),
    }
    for what, (e, eager) in cases.items():
        k = rx.compile(e)
        ins = {n: t for n, t in {"x": xs, "w": ws, "b": bs, "r": res}.items() if n in k.inputs}
        rx.reset_fusion_stats()
        got = k(**ins)
        assert rx.fusion_stats().kernels_launched == 1, what
        want = eager() if eager else ((xs.double() @ ws.double().mT) * 0.5).to(torch.bfloat16)
        assert_close(got, want, 1e-5 if eager else 8e-3, 1e-5 if eager else 1.6e-2, what)
    # the pre-activation and the activation from one product (the backward needs one of them)
    h = rx.linear(x, w, b)
    both = rx.compile({"h": h, "y": rx.silu(h)})
    out = both(x=xs, w=ws, b=bs)
    assert both.launches(x=xs, w=ws, b=bs) == 1
    assert_close(out["y"], F.silu(F.linear(xs, ws, bs)), 1e-5, 1e-5)


def test_gradients_are_contractions_with_the_epilogue_backward_fused(gen):
    xs = torch.randn(2, 5, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    ws = torch.randn(7, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    bs = torch.randn(7, generator=gen, dtype=torch.float64, requires_grad=True)
    k = rx.compile(rx.gelu(rx.linear(x, w, b)))
    assert torch.autograd.gradcheck(lambda *t: k(x=t[0], w=t[1], b=t[2]), (xs, ws, bs), fast_mode=True)
    rx.reset_fusion_stats()
    out = k(x=xs, w=ws, b=bs)  # the forward saves the product: the backward runs no forward GEMM
    assert rx.fusion_stats().kernels_launched == 1
    rx.reset_fusion_stats()
    out.backward(torch.ones_like(out))
    # dx and dW (batch dims summed in-kernel), each recomputing gelu'(h) * g at load (their
    # prologue): it is never written; the bias gradient, its column sum, merged in dW's K loop
    assert rx.fusion_stats().kernels_launched == 2
    plan = k.grad_plan(x=xs, w=ws, b=bs)
    feed = {"_g0": torch.ones(2, 5, 7, dtype=torch.float64), "_s0": out.detach(), "x": xs, "w": ws, "b": bs}
    text = plan.backward.explain(**{n: feed[n].detach() for n in plan.backward.inputs})
    assert text.count("recomputed at load") == 2 and "intermediate" not in text, text
    assert "sum of A over its contracted dims, merged in the K loop" in text, text
    a = torch.randn(3, 1, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    c = torch.randn(2, 5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    km = rx.compile(x @ w)
    assert torch.autograd.gradcheck(lambda p, q: km(x=p, w=q), (a, c), fast_mode=True)


@pytest.mark.parametrize(
    "sa, sb",
    [
        ((2, 3, 4, 5), (2, 1, 5, 6)),  # one key head per query heads (grouped-query attention's dK)
        ((2, 1, 4, 5), (2, 3, 5, 6)),  # the left operand broadcast
        ((2, 3, 2, 4, 5), (2, 1, 1, 5, 6)),  # two summed batch dims
        ((3, 2, 4, 5), (1, 2, 5, 6)),  # a leading broadcast dim: summed by a reduction after the GEMM
    ],
)
def test_the_gradient_of_an_operand_broadcast_along_batch_dims(sa, sb, gen):
    """An operand broadcast along its product's last batch dims gets its gradient from one GEMM
    that sums them in its K loop (``contract(..., summed=j)``): nothing of the product's batch
    size is written for it. float64 gradcheck, and the largest buffer of the backward."""
    a = torch.randn(sa, generator=gen, dtype=torch.float64, requires_grad=True)
    c = torch.randn(sb, generator=gen, dtype=torch.float64, requires_grad=True)
    km = rx.compile(x @ w)
    assert torch.autograd.gradcheck(lambda p, q: km(x=p, w=q), (a, c), fast_mode=True)
    plan = km.grad_plan(x=a, w=c)
    feed = {"_g0": torch.ones(torch.broadcast_shapes(sa[:-2], sb[:-2]) + (sa[-2], sb[-1]), dtype=torch.float64)}
    backward = plan.backward.program(**{n: feed.get(n, {"x": a, "w": c}.get(n)) for n in plan.backward.inputs})
    trailing = sa[0] == sb[0]  # the broadcast dims are the last batch dims
    assert len(backward.launched) == (2 if trailing else 3)
    per_batch = [b.shape for b in backward.buffers if b.shape not in (sa, sb)]
    assert bool(per_batch) != trailing, per_batch


def test_bad_operands_are_refused_before_launch():
    k = rx.compile(x @ w)
    with pytest.raises(rx.RtxError, match=r"a of shape \[3, 4\] and b of shape \[5, 2\] cannot be multiplied"):
        k(x=torch.randn(3, 4), w=torch.randn(5, 2))
    with pytest.raises(rx.RtxError, match="batch dims"):
        k(x=torch.randn(2, 3, 4), w=torch.randn(3, 4, 2))
    with pytest.raises(rx.RtxError, match="torch.matmul needs one dtype"):
        k(x=torch.randn(3, 4), w=torch.randn(4, 2, dtype=torch.float64))
    with pytest.raises(rx.RtxError, match="matmul"):
        k(x=torch.ones(3, 4, dtype=torch.int64), w=torch.ones(4, 2, dtype=torch.int64))
    with pytest.raises(rx.RtxError, match="at least one dim"):
        k(x=torch.tensor(2.0), w=torch.randn(4))
    with pytest.raises(rx.RtxError, match=r"linear: weight must be 2-D"):
        rx.compile(rx.linear(x, w))(x=torch.randn(3, 4), w=torch.randn(4))


def test_parse_and_the_operator():
    assert rx.parse("x @ w") is x @ w
    assert rx.parse("linear(x, w, b)") is rx.linear(x, w, b)
    assert repr(rx.gelu(rx.linear(x, w))) == "gelu(linear(x, w, 0.0), approximate='none')"


def test_lazy_stream_records_linear_and_matmul(gen):
    torch.manual_seed(0)
    ln, l1, l2 = torch.nn.LayerNorm(32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
    xs = torch.randn(8, 32, generator=gen)

    def block(t):
        h = l2(F.gelu(l1(ln(t))))
        return torch.softmax(h + t, dim=-1) @ torch.ones(32, 3)

    f = rx.Fusion()
    with torch.no_grad():
        want = block(xs)
        got = block(f.lazy(xs))
        assert got.is_pending  # linear, @ and the epilogues were recorded, not synced
        got = got.torch()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    s = f.stats()
    assert s.kernels_launched + s.kernel_launches_saved == 7  # eager: ln, 2 x (addmm, act/add), softmax, mm
    # layer_norm; GEMM + bias + gelu; GEMM + bias + residual; softmax; GEMM
    assert s.kernels_launched == 5


def test_a_residual_gradient_is_the_cotangent_itself(gen):
    """As torch's AddBackward: the residual's gradient is handed on, no copy kernel."""
    xs = torch.randn(2, 5, 11, generator=gen, requires_grad=True)
    ws = torch.randn(7, 11, generator=gen, requires_grad=True)
    bs = torch.randn(7, generator=gen, requires_grad=True)
    res = torch.randn(2, 5, 7, generator=gen, requires_grad=True)
    k = rx.compile(rx.linear(x, w, b) + r)
    out = k(x=xs, w=ws, b=bs, r=res)
    g = torch.randn(out.shape, generator=gen)
    rx.reset_fusion_stats()
    out.backward(g)
    assert rx.fusion_stats().kernels_launched == 3  # dx, dW (batch summed), db
    assert torch.equal(res.grad, g)
    assert_close(ws.grad, torch.einsum("btn,btk->nk", g.double(), xs.double()), 1e-5, 1e-5)
    plan = k.grad_plan(x=xs, w=ws, b=bs, r=res)
    assert [name for _, name in plan.passthrough] == ["_g0"]
    # only the residual needs a gradient: nothing to launch
    rs = res.detach().requires_grad_()
    out = k(x=xs.detach(), w=ws.detach(), b=bs.detach(), r=rs)
    rx.reset_fusion_stats()
    out.backward(g)
    assert rx.fusion_stats().kernels_launched == 0 and torch.equal(rs.grad, g)


def test_tf32_follows_the_config_then_torch(gen):
    a, c = torch.randn(9, 17, generator=gen), torch.randn(17, 5, generator=gen)
    default = rx.compile(x @ w).sources(x=a, w=c)[0]
    assert "input_precision='ieee'" in default  # torch.backends.cuda.matmul.allow_tf32 is False by default
    tf32 = rx.compile(x @ w, config=rx.FusionConfig(allow_tf32=True))
    assert "input_precision='tf32'" in tf32.sources(x=a, w=c)[0]
    half = rx.compile(x @ w, config=rx.FusionConfig(allow_tf32=True)).sources(x=a.half(), w=c.half())[0]
    assert "input_precision" not in half  # 16-bit operands: tensor cores either way
    with pytest.raises(rx.ConfigError, match="allow_tf32"):
        rx.FusionConfig(allow_tf32="yes")  # a strict bool: nothing is coerced


def test_tf32_from_the_environment(monkeypatch):
    monkeypatch.setenv("RTXDSL_ALLOW_TF32", "on")
    assert rx.FusionConfig.from_env().allow_tf32 is True
    monkeypatch.setenv("RTXDSL_ALLOW_TF32", "none")
    assert rx.FusionConfig.from_env().allow_tf32 is None
    monkeypatch.setenv("RTXDSL_ALLOW_TF32", "maybe")
    with pytest.raises(rx.ConfigError, match="RTXDSL_ALLOW_TF32"):
        rx.FusionConfig.from_env()


def test_memory_trace_of_a_gemm_matches_its_tiling(gen):
    """On the sm_90 configuration (128 x 128 tiles): A is read once per column of tiles, B once per
    row of tiles, every sector it fetches fully used, the epilogue's output written once."""
    m, n, k = 300, 260, 96  # ragged edges: 3 x 3 tiles
    xs, ws, bs = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    kernel = rx.compile(rx.gelu(rx.linear(x, w, b)))
    t = rx.memory_trace(kernel, x=xs, w=ws, b=bs)
    (launch,) = t.launches
    a, bw, _, out = launch.tensors
    tiles_m, tiles_n = -(-m // 128), -(-n // 128)
    assert launch.programs == tiles_m * tiles_n
    assert a.issued == a.nbytes * tiles_n and bw.issued == bw.nbytes * tiles_m
    assert a.unique == a.nbytes and bw.unique == bw.nbytes
    assert a.sectors * 32 >= 0.9 * a.issued and bw.sectors * 32 >= 0.9 * bw.issued
    assert out.stored == out.nbytes == m * n * 4 and out.loaded == 0
    assert launch.model_bytes == sum(tt.nbytes for tt in launch.tensors)  # each operand charged once
    torch.testing.assert_close(t.result, F.gelu(F.linear(xs, ws, bs)), atol=1e-4, rtol=1e-5)


def test_mm_and_bmm_keep_their_stricter_ranks(gen):
    """torch.mm takes matrices only and torch.bmm equal batches: the lazy stream raises where torch does."""
    f = rx.Fusion()
    v, m3 = torch.randn(4, generator=gen), torch.randn(2, 3, 4, generator=gen)
    for call, a in ((lambda t: torch.mm(t, t), v), (lambda t: torch.bmm(t, t.mT[:1]), m3)):
        with pytest.raises(RuntimeError):
            call(a)
        with pytest.raises((RuntimeError, rx.RtxError)):
            call(f.lazy(a) * 1.0)
    with pytest.raises(rx.RtxError, match="mm: self must be a 2-D tensor"):
        rx.compile(rx.matmul(x, w, rank=2))(x=v, w=v)
    got = torch.bmm(f.lazy(m3) * 2, m3.mT)
    assert got.is_pending
    torch.testing.assert_close(got.torch(), torch.bmm(m3 * 2, m3.mT))
    with pytest.raises(rx.RtxError, match="rank must be"):
        rx.matmul(x, w, rank=4)


def test_a_plain_tensor_times_a_lazy_one_keeps_the_order(gen):
    """``plain @ lazy`` and ``Tensor.__rmatmul__`` are recorded, multiplying in the written order."""
    a, c = torch.randn(3, 4, generator=gen), torch.randn(4, 5, generator=gen)
    for product in (lambda lc: a @ lc, lambda lc: torch.Tensor.__rmatmul__(lc, a)):
        got = product(rx.Fusion().lazy(c))
        assert got.is_pending
        torch.testing.assert_close(got.torch(), a @ c)


g_, u_ = rx.var("g"), rx.var("u")

#: prologues: an operand's elementwise producer applied at load time, per (name, expression, eager)
PROLOGUES = {
    # SwiGLU feeding a down projection (A), at sizes where recomputing per tile is cheap
    "swiglu -> linear": (rx.linear(rx.silu(g_) * u_, w), lambda t: F.linear(F.silu(t["g"]) * t["u"], t["w"])),
    # a weight scaled and read transposed (B through swapped strides)
    "linear of a scaled weight": (rx.linear(g_, w * 0.5), lambda t: F.linear(t["g"], t["w"] * 0.5)),
    # a per-row factor [M, 1] and a per-K weight [K] (RMSNorm's rstd and w)
    "per-row and per-K factors": (rx.linear(g_ * u_ * b, w), lambda t: F.linear(t["g"] * t["u"] * t["b"], t["w"])),
    # zeros in the masked K tail would give inf: the tile is zeroed outside the mask, not computed
    "1 / x": (rx.linear(1.0 / g_, w), lambda t: F.linear(1.0 / t["g"], t["w"])),
}


def _prologue_inputs(name, m, n, k, dtype, gen):
    t = {
        "g": torch.randn(m, k, generator=gen).to(dtype),
        "u": torch.randn(m, 1 if "per-row" in name else k, generator=gen).to(dtype),
        "b": torch.randn(k, generator=gen).to(dtype),
        "w": torch.randn(n, k, generator=gen).to(dtype),
    }
    return t


@pytest.mark.parametrize(("dtype", "atol", "rtol"), TOLERANCES)
@pytest.mark.parametrize("name", PROLOGUES)
@pytest.mark.parametrize(
    "m, n, k",
    [
        (7, 33, 129),  # odd sizes, K longer than one K slice (a masked K tail)
        (1, 1, 1),  # one element
        (33, 7, 0),  # K = 0: the prologue runs on nothing
    ],
)
def test_prologues_are_applied_at_load(name, m, n, k, dtype, atol, rtol, gen):
    e, eager = PROLOGUES[name]
    kernel = rx.compile(e)
    t = _prologue_inputs(name, m, n, k, dtype, gen)
    ins = {v: t[v] for v in kernel.inputs}
    assert kernel.launches(**ins) == 1
    assert "recomputed at load" in kernel.explain(**ins)
    got = kernel(**ins)
    # eager rounds the operand to its dtype before the GEMM, as the prologue does
    want = eager({v: x.double() for v, x in t.items()}) if dtype == torch.float32 else eager(t).double()
    _close(got, want, dtype, atol, rtol, k, name)


def test_prologues_in_batched_and_transposed_operands(gen):
    """Batch dims broadcast into the prologue's loads, and an operand read transposed (``x.mT``)
    computed at its tile through the swapped strides."""
    a = torch.randn(2, 1, 33, 7, generator=gen)
    c = torch.randn(3, 33, 5, generator=gen)
    s_ = torch.randn(33, 1, generator=gen)
    kernel = rx.compile(rx.matmul(rx.permute(rx.exp(g_) * u_, (0, 1, 3, 2)), w))
    assert kernel.launches(g=a, u=s_, w=c) == 1
    want = torch.matmul((torch.exp(a.double()) * s_.double()).mT, c.double())
    _close(kernel(g=a, u=s_, w=c), want, torch.float32, 2e-6, 1e-5, 33)
    gs = torch.randn(6, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    us = torch.randn(6, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    ws = torch.randn(5, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    k2 = rx.compile(rx.linear(rx.silu(g_) * u_, w))
    assert torch.autograd.gradcheck(lambda p, q, r_: k2(g=p, u=q, w=r_), (gs, us, ws), fast_mode=True)


def test_a_prologue_never_computes_the_gemms_other_operand(gen):
    """``linear(t * 2, t)`` with ``t = tanh(sigmoid(x))``: A's prologue would hold t at A's tile,
    where B needs it at B's (a node has one role; the kernel mixed a [M, K] tile into B's [K, N]
    and crashed). Found by the lazy fuzzer (seed 25386736000029): another GEMM reading t decided
    the order the prologues were considered in."""
    x = rx.var("x")
    t = rx.tanh(rx.sigmoid(x))
    k = rx.compile({"v6": rx.linear(t * 2, t), "v2": rx.linear(rx.sigmoid(x), t)})
    for shape in ((4, 1), (7, 5), (33, 40)):
        xs = torch.randn(shape, generator=gen)
        out = k(x=xs)
        t64 = torch.tanh(torch.sigmoid(xs.double()))
        _close(out["v6"], F.linear(t64 * 2, t64), torch.float32, 2e-6, 1e-5, shape[1])
        _close(out["v2"], F.linear(torch.sigmoid(xs.double()), t64), torch.float32, 2e-6, 1e-5, shape[1])


def test_the_traffic_model_keeps_a_costly_prologue_apart():
    """Llama-7B's down projection: silu(gate) * up recomputed by each of 32 tile columns costs more
    than writing it and reading it back; a cast of the activation to bf16 costs less."""
    big = torch.empty(1, 1, dtype=torch.bfloat16)
    gate = up = big.expand(4096, 11008)
    swiglu = rx.compile(rx.linear(rx.silu(g_) * u_, w))
    text = swiglu.explain(g=gate, u=up, w=big.expand(4096, 11008))
    assert swiglu.launches(g=gate, u=up, w=big.expand(4096, 11008)) == 2
    assert "loaded by 32 tile(s): written and read back" in text, text
    cast = rx.compile(rx.linear(rx.cast(g_, torch.bfloat16), w))
    ins = dict(g=torch.empty(1, 1).expand(4096, 4096), w=big.expand(4096, 4096))
    assert cast.launches(**ins) == 1
    assert "loaded by 32 tile(s): recomputed at load" in cast.explain(**ins)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), TOLERANCES)
def test_a_bias_gradient_is_merged_in_the_weight_gradients_k_loop(dtype, atol, rtol, gen):
    """linear + bias + gelu's backward: two GEMMs, the bias gradient (a column sum of gelu'(h) * g
    over the tokens, which the dW GEMM contracts) merged in dW's K loop, written by the first column
    of tiles only. Sizes span several tiles both ways (130 out features, 70 in features)."""
    xs = torch.randn(37, 70, generator=gen).to(dtype).requires_grad_()
    ws = torch.randn(130, 70, generator=gen).to(dtype).requires_grad_()
    bs = torch.randn(130, generator=gen).to(dtype).requires_grad_()
    k = rx.compile(rx.gelu(rx.linear(x, w, b)))
    out = k(x=xs, w=ws, b=bs)
    cot = torch.randn(out.shape, generator=gen).to(dtype)
    rx.reset_fusion_stats()
    out.backward(cot)
    assert rx.fusion_stats().kernels_launched == 2
    ref = [t.detach().double().requires_grad_() for t in (xs, ws, bs)]
    F.gelu(F.linear(*ref)).backward(cot.double())
    for name, got, want in zip(("dx", "dw", "db"), (xs.grad, ws.grad, bs.grad), (t.grad for t in ref)):
        _close(got, want, dtype, atol * 4, rtol * 4, 37, name)  # gelu' in fp32 of a rounded product


def test_any_mergeable_reduction_of_A_over_the_contracted_axis_joins_the_gemm(gen):
    """Not only sums: a max and a logsumexp of the prologue operand over the axis the GEMM
    contracts are merged tile by tile in the K loop (their registry states), in one kernel. The
    values are negative: a masked lane (K = 33 is not a multiple of the K slice) must hold the
    max's identity, not the zero the loads fill in."""
    gs, ws = torch.randn(33, 9, generator=gen), torch.randn(33, 70, generator=gen)
    e = rx.exp(g_) * -0.5
    kernel = rx.compile({"y": rx.matmul(rx.permute(e, (1, 0)), w), "mx": rx.amax(e, 0), "lse": rx.logsumexp(e, 0)})
    assert kernel.launches(g=gs, w=ws) == 1
    got = kernel(g=gs, w=ws)
    ed = torch.exp(gs.double()) * -0.5
    assert_close(got["y"], ed.mT @ ws.double(), 1e-5, 1e-5, "y")
    assert_close(got["mx"], ed.amax(0), 1e-6, 1e-6, "amax")
    assert_close(got["lse"], torch.logsumexp(ed, 0), 1e-6, 1e-6, "logsumexp")


def test_memory_trace_of_the_fused_backward_writes_only_the_gradients(gen):
    """linear + bias + gelu's backward on the sm_90 configuration: gelu'(h) * g is never stored
    (each GEMM recomputes it at load), each gradient is stored once (the bias gradient by the
    first column of tiles only), and dh's inputs are read once per column of tiles, as A is."""
    m, n, k = 300, 260, 96  # ragged edges
    kernel = rx.compile(rx.gelu(rx.linear(x, w, b)))
    plan = kernel.grad_plan(x=torch.empty(m, k), w=torch.empty(n, k), b=torch.empty(n))
    shapes = {"_g0": (m, n), "_s0": (m, n), "b": (n,), "w": (n, k), "x": (m, k)}
    feed = {name: torch.randn(shapes[name], generator=gen) for name in plan.backward.inputs}
    t = rx.memory_trace(plan.backward, **feed)
    assert len(t.launches) == 2
    stored = sum(tt.stored for launch in t.launches for tt in launch.tensors)
    assert stored == (m * k + n * k + n) * 4  # dx, dW, db: nothing else
    for launch in t.launches:
        assert all(tt.stored in (0, tt.nbytes) for tt in launch.tensors)


def test_autotune_times_gemm_tiles_and_keeps_the_winner(tmp_path, gen):
    """FusionConfig(autotune=True): a GEMM times its tile candidates (the grid follows each tile),
    keeps the one the (injected) clock says is fastest, and computes the same product with it."""
    from rtxdsl import tune

    timed: list[int] = []

    def timer(launch) -> float:  # the last candidate wins
        launch()
        timed.append(1)
        return 10.0 - len(timed)

    cfg = rx.FusionConfig(autotune=True, cache_dir=str(tmp_path))
    xs, ws, bs = torch.randn(150, 33, generator=gen), torch.randn(70, 33, generator=gen), torch.randn(70, generator=gen)
    tune.set_timer(timer)
    try:
        out = rx.compile(rx.gelu(rx.linear(x, w, b)), config=cfg)(x=xs, w=ws, b=bs)
    finally:
        tune.set_timer(None)
    assert len(timed) >= 3  # several distinct tiles at this size
    (stored,) = (tmp_path / "tuned").glob("*.json")
    record = json.loads(stored.read_text())
    assert record["ms"].index(min(record["ms"])) == len(timed) - 1
    assert_close(out, F.gelu(F.linear(xs.double(), ws.double(), bs.double())), 1e-5, 1e-5)


def test_a_half_products_cotangent_through_fp32_statistics_is_cast_to_its_dtype(gen):
    """From the widened fuzzer: layer_norm of an fp16 product saves fp32 statistics, so the
    product's cotangent is computed in fp32; the backward GEMMs take it in the product's dtype
    (as eager autograd's cotangent is), not a dtype mismatch."""
    xs = torch.randn(5, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    ws = torch.randn(7, 9, generator=gen, dtype=torch.float64)
    h = rx.linear(rx.cast(x, torch.float16), rx.cast(w, torch.float16))
    k = rx.compile({"h": h, "n": rx.layer_norm(h)})
    out = k(x=xs, w=ws)
    g_h, g_n = torch.randn(5, 7, generator=gen).half(), torch.randn(5, 7, generator=gen).half()
    (got,) = torch.autograd.grad([out["h"], out["n"]], [xs], [g_h, g_n])
    ref = xs.detach().clone().requires_grad_()
    hr = F.linear(ref.half(), ws.half())
    (want,) = torch.autograd.grad([hr, F.layer_norm(hr, (7,))], [ref], [g_h, g_n])
    assert_close(got, want, 2e-2, 2e-2)


def test_an_epilogue_in_float64_gets_float64_constants(gen):
    """From the widened fuzzer: a float32 GEMM whose epilogue computes in float64 (a float64
    input) passes its constants as float64 (they were float32 python floats the kernel could not
    convert)."""
    xs, ws = torch.randn(5, 9, generator=gen), torch.randn(7, 9, generator=gen)
    ys = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    k = rx.compile(rx.linear(x, w) + rx.clamp(r, -0.5, 0.5))
    assert k.launches(x=xs, w=ws, r=ys) == 1
    assert_close(k(x=xs, w=ws, r=ys), F.linear(xs, ws).double() + ys.clamp(-0.5, 0.5), 1e-5, 1e-5)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), TOLERANCES)
def test_a_row_kernels_normalized_output_is_recomputed_at_load(dtype, atol, rtol, gen):
    """RMSNorm feeding a projection: the row kernel writes only its per-row rstd ([M, 1]) and the
    GEMM computes x * rstd * w as it loads A, where few tiles reload it; at Llama-7B sizes the
    traffic model keeps the normalized activations written."""
    xs, ws = torch.randn(37, 70, generator=gen).to(dtype), torch.randn(70, generator=gen).to(dtype)
    wp = torch.randn(20, 70, generator=gen).to(dtype)
    kernel = rx.compile(rx.linear(rx.rms_norm(x, w), b))
    text = kernel.explain(x=xs, w=ws, b=wp)
    assert kernel.launches(x=xs, w=ws, b=wp) == 2
    assert "recomputed at load" in text and "writes intermediate float32[37, 1]" in text, text
    want = F.linear(F.rms_norm(xs.double(), (70,), ws.double(), 1e-6).to(dtype).double(), wp.double())
    _close(kernel(x=xs, w=ws, b=wp), want, dtype, atol * 2, rtol * 2, 70)
    big = torch.empty(1, 1, dtype=torch.bfloat16)
    llama = dict(x=big.expand(4096, 4096), w=big[0].expand(4096), b=big.expand(4096, 4096))
    assert "written and read back" in kernel.explain(**llama)


def test_explain_reports_tensor_core_flops_beside_bytes(gen):
    """The compute model: a GEMM's 2 * m * n * k, per kernel and in total beside its minimum (a
    batched weight gradient's contracted batch counts too)."""
    xs, ws = torch.randn(3, 5, 7, generator=gen), torch.randn(11, 7, generator=gen)
    text = rx.compile(rx.linear(x, w)).explain(x=xs, w=ws)
    flops = 2 * 15 * 11 * 7
    assert f"{flops} FLOPs on tensor cores (minimum: {flops})" in text
    assert rx.compile(rx.relu(x)).program(x=xs).minimum_flops == 0  # no product: no FLOPs line
    assert "FLOPs" not in rx.compile(rx.relu(x)).explain(x=xs)
    grad = rx.compile(rx.linear(x, w)).grad_plan(x=xs.clone().requires_grad_(), w=ws.clone().requires_grad_())
    feed = {"_g0": torch.randn(3, 5, 11, generator=gen), "x": xs, "w": ws}
    bwd = grad.backward.program(**{n: feed[n] for n in grad.backward.inputs})
    assert bwd.flops == bwd.minimum_flops == 2 * flops  # dx and dw (its batch contracted)


@pytest.mark.parametrize(
    "m, n, k, unmasked",
    [
        (64, 64, 128, True),  # every extent fills the interpreter's 64 x 64 x 64 tile: no bounds check
        (64, 64, 100, False),  # K does not: the K loop's loads keep their masks (and the output's)
        (37, 64, 128, False),  # nor M
    ],
)
def test_a_product_whose_extents_fill_their_blocks_checks_no_bounds(m, n, k, unmasked, gen):
    """``GemmTile.even``: a GEMM whose M, N and K are multiples of its blocks loads and stores
    without masks and selects nothing (``rewrite.in_bounds``), as a hand-written kernel assuming
    divisible sizes does; another size class compiles the checked variant. The output and the
    gradients (their GEMMs even too) against float64 either way."""
    expr = rx.gelu(rx.linear(x, w) + b)
    xs, ws = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((m, k), (n, k)))
    bs = torch.randn(n, generator=gen, dtype=torch.float64)
    kern = rx.compile(expr)
    (src,) = kern.sources(x=xs, w=ws, b=bs)
    loop = src[src.index("for k_start") :]
    assert ("mask=" not in loop) is unmasked, loop
    leaves = {n_: t.float().requires_grad_() for n_, t in (("x", xs), ("w", ws), ("b", bs))}
    out = kern(**leaves)
    exact = {n_: t.clone().requires_grad_() for n_, t in (("x", xs), ("w", ws), ("b", bs))}
    want = F.gelu(F.linear(exact["x"], exact["w"]) + exact["b"])
    assert_close(out.double(), want, 1e-4, 1e-4)
    cot = torch.randn(m, n, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, list(leaves.values()), cot.float())
    ref = torch.autograd.grad(want, list(exact.values()), cot)
    for a, e in zip(got, ref):
        assert_close(a.double(), e, 1e-4 * max(1.0, e.abs().max().item()), 1e-4)


@pytest.mark.parametrize("keys", [1, 3], ids=["one key", "three keys"])
def test_a_product_of_an_expanded_operand_in_a_row_kernel_loads_it_as_a_tile(keys, gen):
    """k expanded along its head dim (stride 0) under a product a row kernel computes (attention's
    logsumexp, its output read transposed): every stride of the product's tile was dropped but the
    batch's, so its pointer was one element beside a block mask (Triton refused to load it;
    expression fuzzer seed 20301990)."""
    q, v = torch.randn(2, 2, 3, 8, generator=gen), torch.randn(2, 2, keys, 8, generator=gen)
    k = torch.randn(2, 2, keys, 1, generator=gen).expand(2, 2, keys, 8)
    got = rx.compile(rx.sum(rx.attention(rx.var("q"), rx.var("k"), rx.var("v")).mT, axis=0))(q=q, k=k, v=v)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double()).mT.sum(0)
    assert_close(got, want, 1e-5, 1e-5, "attention")


# a linear over no rows: the bias gradient is a sum over none (the GEMM's domain is empty, the sum
# merged in its K loop is not); x [1, 0, 0] with w [1, 0] (expression fuzzer seed 20306772: it read
# memory never written), and x [0, 5] with w [3, 5]
@pytest.mark.parametrize("xs, ws", [((1, 0, 0), (1, 0)), ((0, 5), (3, 5))], ids=["no features", "no rows"])
def test_the_bias_gradient_of_a_linear_over_no_rows_is_zero(xs, ws, gen):
    k = rx.compile(rx.relu(rx.linear(rx.var("x"), rx.var("w"), rx.var("b"))))
    x, w = torch.randn(xs, generator=gen, requires_grad=True), torch.randn(ws, generator=gen, requires_grad=True)
    b = torch.full((ws[0],), 7.0, requires_grad=True)
    torch.empty(4096).fill_(1e30)  # (memory the allocator may hand the gradient next)
    k(x=x, w=w, b=b).sum().backward()
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    F.relu(F.linear(x2, w2, b2)).sum().backward()
    for got, want in ((x.grad, x2.grad), (w.grad, w2.grad), (b.grad, b2.grad)):
        assert torch.equal(got, want)


# a product over a softmax's axis of no elements (no keys): the empty sum, 0 as torch's; the
# normalized-after rewrite divided the product's 0 by the softmax's total 0 (NaN; outside expression
# fuzzer seed 20351574)
@pytest.mark.parametrize(
    "build, ref",
    [
        (lambda: rx.linear(rx.softmax(rx.var("x"), -1), rx.var("v")), lambda x, v: F.linear(torch.softmax(x, -1), v)),
        (lambda: rx.softmax(rx.var("x"), -1) @ rx.var("v").mT, lambda x, v: torch.softmax(x, -1) @ v.mT),
    ],
    ids=["linear", "matmul"],
)
def test_a_product_over_a_softmax_of_no_elements_is_zero(build, ref, gen):
    x, v = torch.randn(2, 0, generator=gen), torch.randn(3, 0, generator=gen)
    got = rx.compile(build())(x=x, v=v)
    assert torch.equal(got, ref(x, v)) and not got.isnan().any()
