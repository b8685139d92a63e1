"""Issue 36 item 4, Liger's remaining ops: the modulated RMSNorm (AdaLN), the sequence-tiled MLP and
the predicted tokens of cross-entropy. Each against a float64 torch reference written from its
definition (values and every gradient), with Liger's parametrizations (its test files
``test_modulated_rms_norm.py`` and ``test_tiled_mlp.py``) at sizes the interpreter runs quickly."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from conftest import FLOAT_TOLERANCES, assert_close

import rtxdsl as rx
from rtxdsl import liger
from rtxdsl.errors import RtxError

B, T, H = 3, 5, 24  # odd batch and sequence, a hidden size of no power of two


# ---- modulated RMSNorm: (1 + scale) * rms_norm(x) * (offset + w) + shift ----------------------------
def _modulated_reference(x, w, scale, shift, eps, offset):
    """In float64: Liger's broadcast of the modulation spelled as rows repeated in runs."""
    rows = x.reshape(-1, x.shape[-1]).double()
    runs = rows.shape[0] // (scale.numel() // x.shape[-1])
    s = scale.reshape(-1, x.shape[-1]).double().repeat_interleave(runs, 0)
    normed = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        normed = normed * (offset + w.double())
    out = normed * (1 + s)
    if shift is not None:
        out = out + shift.reshape(-1, x.shape[-1]).double().repeat_interleave(runs, 0)
    return out.reshape(x.shape)


MODULATIONS = {  # Liger's three scale modes
    "global": (H,),  # one row shared by every token
    "batch": (B, H),  # one row per sequence
    "row": (B, T, H),  # one per token
}


@pytest.mark.parametrize("scale_mode", sorted(MODULATIONS))
@pytest.mark.parametrize("has_shift", [True, False])
@pytest.mark.parametrize("elementwise_affine", [True, False])
@pytest.mark.parametrize("offset, casting_mode", [(0.0, "llama"), (1.0, "gemma")])
def test_modulated_rms_norm_against_float64(scale_mode, has_shift, elementwise_affine, offset, casting_mode, gen):
    """Every broadcast, with and without a shift and a weight: the output and the gradients of
    x, the weight, scale and shift (the modulation's summed over the rows sharing it)."""
    norm = liger.LigerModulatedRMSNorm(
        H, offset=offset, casting_mode=casting_mode, elementwise_affine=elementwise_affine, in_place=False
    )
    if elementwise_affine:
        norm.weight.data.normal_(generator=gen)
    x = torch.randn(B, T, H, generator=gen, requires_grad=True)
    scale = (0.3 * torch.randn(MODULATIONS[scale_mode], generator=gen)).requires_grad_()
    shift = (0.3 * torch.randn(MODULATIONS[scale_mode], generator=gen)).requires_grad_() if has_shift else None
    leaves = [t for t in (x, norm.weight, scale, shift) if t is not None]
    x64 = [t.detach().double().requires_grad_() for t in leaves]
    it = iter(x64)
    x_, w_, s_ = next(it), next(it) if elementwise_affine else None, next(it)
    sh_ = next(it) if has_shift else None
    out, want = norm(x, scale, shift), _modulated_reference(x_, w_, s_, sh_, 1e-6, offset)
    assert out.dtype == x.dtype
    assert_close(out, want, 1e-5, 1e-5, "out")
    g = torch.randn(B, T, H, generator=gen)
    for name, got, ref in zip(
        ("x", "weight", "scale", "shift"), torch.autograd.grad(out, leaves, g), torch.autograd.grad(want, x64, g)
    ):
        assert_close(got, ref, 1e-5 * max(1.0, ref.abs().max().item()), 1e-5, f"d{name}")


@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOAT_TOLERANCES)
@pytest.mark.parametrize("shape, mod", [((B, T, H), (B, H)), ((2, 37), (1, 37))])  # 3-d by sequence; 2-d shared
def test_modulated_rms_norm_in_every_dtype(dtype, atol, rtol, shape, mod, gen):
    norm = rx.nn.ModulatedRMSNorm(shape[-1], offset=0.5).to(dtype)
    norm.weight.data.normal_(generator=gen)
    x = torch.randn(shape, generator=gen).to(dtype).requires_grad_()
    scale, shift = (torch.randn(mod, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    out = norm(x, scale, shift)
    want = _modulated_reference(x.detach(), norm.weight.detach(), scale.detach(), shift.detach(), 1e-6, 0.5)
    assert out.dtype == dtype
    assert_close(out, want, atol * max(1.0, want.abs().max().item()), rtol, "out")
    rx.reset_fusion_stats()
    out.sum().backward()
    assert rx.fusion_stats().kernels_launched <= 2  # the row kernel, and the weight's finishing sum
    assert scale.grad.dtype == dtype and shift.grad.dtype == dtype


def test_modulated_rms_norm_mixed_dtypes_keep_each_dtype(gen):
    """Liger's AdaLN setup: x in bf16, the modulation in fp32. rx.nn promotes as torch's formula
    would; Liger's module returns x's dtype; each gradient has its tensor's dtype."""
    x = torch.randn(2, 4, H, generator=gen).bfloat16().requires_grad_()
    scale = (0.1 * torch.randn(2, H, generator=gen)).requires_grad_()
    assert rx.nn.ModulatedRMSNorm(H).bfloat16()(x, scale).dtype == torch.float32
    out = liger.LigerModulatedRMSNorm(H).bfloat16()(x, scale)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and scale.grad.dtype == torch.float32
    want = _modulated_reference(x.detach(), None, scale.detach(), None, 1e-6, 0.0)
    assert_close(out, want, 8e-3 * want.abs().max().item(), 1.6e-2, "out")


def test_modulated_rms_norm_empty_and_strided(gen):
    norm = rx.nn.ModulatedRMSNorm(H)
    empty = norm(torch.zeros(0, H), torch.zeros(H))
    assert empty.shape == (0, H)
    x = torch.randn(H, 2 * T, generator=gen).mT[::2]  # rows of stride 1, columns of stride 2T
    scale = torch.randn(H, generator=gen)
    assert_close(norm(x, scale), _modulated_reference(x, norm.weight, scale, None, 1e-6, 0.0), 1e-5, 1e-5)


@pytest.mark.parametrize(
    "scale, shift, named",
    [
        (torch.zeros(4, 5), None, "scale"),  # not the hidden size
        (torch.zeros(4, H), None, "scale"),  # 4 rows do not divide 15
        (torch.zeros(B, H), torch.zeros(H), "shift"),  # not scale's rows
    ],
)
def test_modulated_rms_norm_names_the_modulation_at_fault(scale, shift, named):
    with pytest.raises(RtxError, match=named):
        rx.nn.ModulatedRMSNorm(H)(torch.zeros(B, T, H), scale, shift)
    with pytest.raises(RtxError, match="casting_mode"):
        liger.LigerModulatedRMSNorm(H, casting_mode="fp8")


# ---- the sequence-tiled MLP --------------------------------------------------------------------------
def _config(act):
    return types.SimpleNamespace(hidden_size=H, intermediate_size=40, hidden_act=act)


TILED = [  # Liger's two tiled MLPs and the untiled module each must equal
    (liger.LigerTiledSwiGLUMLP, liger.LigerSwiGLUMLP, "silu"),
    (liger.LigerTiledGEGLUMLP, liger.LigerGEGLUMLP, "gelu_pytorch_tanh"),
]


@pytest.mark.parametrize("tiled_cls, plain_cls, act", TILED, ids=["swiglu", "geglu"])
@pytest.mark.parametrize("num_shards", [None, 2, 4, 11])  # auto (1 here), even, and more shards than 2-d rows of 5
@pytest.mark.parametrize("check_2d", [True, False])  # Liger's: [tokens, hidden] as MoE experts pass it
def test_tiled_mlp_equals_the_untiled_one(tiled_cls, plain_cls, act, num_shards, check_2d, gen):
    torch.manual_seed(0)
    tiled = tiled_cls(_config(act), num_shards=num_shards).double()
    plain = plain_cls(_config(act)).double()
    plain.load_state_dict(tiled.state_dict())
    x = torch.randn(B, T, H, generator=gen, dtype=torch.float64)
    x = x.reshape(-1, H) if check_2d else x
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = tiled(x1), plain(x2)
    assert_close(y1, y2, 1e-12, 1e-12, "out")
    dy = torch.randn(y1.shape, generator=gen, dtype=torch.float64)
    y1.backward(dy)
    y2.backward(dy)
    assert_close(x1.grad, x2.grad, 1e-12, 1e-12, "dx")
    for (name, p1), p2 in zip(tiled.named_parameters(), plain.parameters()):
        assert_close(p1.grad, p2.grad, 1e-12, 1e-12, f"d{name}")


def test_tiled_mlp_recomputes_once_per_shard_and_accumulates_each_weight_once(gen):
    """Liger's ``test_tiled_mlp_accumulates_each_weight_once`` (DDP marks a parameter ready on each
    AccumulateGrad firing): the parameters' gradients are the op's outputs, so each weight is
    accumulated once however many shards; the MLP runs once per shard forward and backward."""
    mlp = rx.nn.SwiGLU(H, 40, shards=4)
    calls = []
    inner = mlp._mlp
    mlp._mlp = lambda t: calls.append(t.shape[0]) or inner(t)
    fired = {n: 0 for n, _ in mlp.named_parameters()}
    for n, p in mlp.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=n: fired.__setitem__(n, fired[n] + 1))
    x = torch.randn(2, 9, H, generator=gen, requires_grad=True)
    mlp(x).sum().backward()
    assert calls == [5, 5, 5, 3] * 2  # ceil(18 / 4) rows a shard, the last shorter
    assert set(fired.values()) == {1}


@pytest.mark.parametrize("cls", [rx.nn.SwiGLU, rx.nn.GeGLU])
def test_a_sharded_mlp_takes_a_lazy_value(cls, gen):
    """A lazy value is a tensor to ``shards=`` too (it raised 'x must be a tensor with a hidden axis';
    outside fuzzer seeds 20308034, 20308133): it is materialized, as any op the stream cannot fuse."""
    mlp = cls(H, 16, shards=2)
    x = torch.randn(2, 3, H, generator=gen, requires_grad=True)
    want = mlp(x)
    f = rx.Fusion()
    got = mlp(f.lazy(x) * 1.0)
    assert_close(got.torch(), want.double(), 1e-5, 1e-5, "tiled")
    got.sum().backward()
    (ref,) = torch.autograd.grad(want.sum(), x)
    assert_close(x.grad, ref.double(), 1e-5, 1e-5, "d/dx")


def test_tiled_mlp_gives_autograd_grad_its_parameter_gradients(gen):
    """``torch.autograd.grad`` over the parameters (a backward that wrote ``.grad`` itself would give
    none), half precision summed in float32 across shards, and an empty sequence."""
    mlp = rx.nn.GateUpMLP(H, 16, shards=3).bfloat16()
    ref = rx.nn.GateUpMLP(H, 16).double()
    ref.load_state_dict(mlp.state_dict())
    x = torch.randn(4, 7, H, generator=gen).bfloat16()
    grads = torch.autograd.grad(mlp(x).float().sum(), list(mlp.parameters()))
    want = torch.autograd.grad(ref(x.double()).sum(), list(ref.parameters()))
    for got, w in zip(grads, want):
        assert got.dtype == torch.bfloat16
        assert_close(got, w, 3e-2 * w.abs().max().item(), 3e-2, "dW")
    assert mlp(torch.zeros(0, 7, H).bfloat16()).shape == (0, 7, H)


@pytest.mark.parametrize("shards", [0, -1, 2.5, True])
def test_tiled_mlp_refuses_a_shard_count_that_is_not_a_positive_int(shards):
    with pytest.raises(RtxError, match="shards"):
        rx.nn.SwiGLU(H, 8, shards=shards)
    with pytest.raises(RtxError, match="hidden_act"):
        liger.LigerTiledGEGLUMLP(_config("relu"))


# ---- predicted tokens: cross-entropy's argmax per token ------------------------------------------------
def _logits(gen, rows=7, classes=13):
    logits = torch.randn(rows, classes, generator=gen, dtype=torch.float64)
    logits[1, [2, 5]] = logits[1].max() + 1.0  # a tie: the first class wins, as torch.argmax
    logits[3, 4] = float("nan")  # a NaN: its class wins, as torch.argmax
    target = torch.randint(0, classes, (rows,), generator=gen)
    target[0] = -100
    return logits, target


def _predicted(logits, target):
    return torch.where(target != -100, logits.argmax(-1), -1)


def test_predicted_tokens_are_the_argmax_and_minus_one_where_ignored(gen):
    logits, target = _logits(gen)
    x, t = rx.var("x"), rx.var("t")
    outs = rx.compile(rx.cross_entropy_outputs(x, t))
    got = outs(x=logits, t=target)
    assert got["predicted_tokens"].dtype == torch.int64
    assert_close(got["predicted_tokens"], _predicted(logits, target), 0, 0, "predicted")
    assert got["predicted_tokens"][1] == 2 and got["predicted_tokens"][3] == 4
    only = rx.compile(rx.predicted_tokens(x, t, ignore_index=3))(x=logits, t=target)
    assert_close(only, torch.where(target != 3, logits.argmax(-1), -1), 0, 0, "ignore_index")
    loss, z, acc, pred = rx.nn.CrossEntropyLoss(
        z_loss=0.01, return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True
    )(logits, target)
    assert torch.equal(pred, _predicted(logits, target))


@pytest.mark.parametrize("bias", [False, True])
def test_fused_linear_cross_entropy_returns_predicted_tokens_without_logits(bias, gen):
    """Liger's ``return_predicted_tokens``: the argmax of ``h @ w.T (+ b)``, computed tile by tile
    in the loss's kernels (the logits' FLOPs counted once), with the accuracy it agrees with."""
    h = torch.randn(9, 16, generator=gen, dtype=torch.float64)
    w = torch.randn(37, 16, generator=gen, dtype=torch.float64)
    b = torch.randn(37, generator=gen, dtype=torch.float64) if bias else None
    target = torch.tensor([1, 2, -100, 4, 5, 6, 7, -100, 36])
    fn = liger.LigerFusedLinearCrossEntropyLoss(return_predicted_tokens=True, return_token_accuracy=True)
    rx.reset_fusion_stats()
    out = fn(w, h, target, b)
    assert rx.fusion_stats().flops == 2 * 9 * 16 * 37
    logits = F.linear(h, w, b)
    assert out.predicted_tokens.dtype == torch.int64
    assert_close(out.predicted_tokens, _predicted(logits, target), 0, 0, "predicted")
    assert_close(out.loss, F.cross_entropy(logits, target), 1e-12, 1e-12, "loss")
    kept = target != -100
    assert_close(out.token_accuracy, (logits.argmax(-1) == target)[kept].float().mean(), 0, 0, "accuracy")
    assert liger.LigerCrossEntropyLoss(return_predicted_tokens=True)(logits, target).predicted_tokens.shape == (9,)
