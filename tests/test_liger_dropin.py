"""rtxdsl.liger: Liger-Kernel's names, argument orders, flags and outputs, each module against a
float64 torch reference written from Liger's definition (values and gradients), and its
unsupported flags raising an error that names them."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from conftest import FLOAT_TOLERANCES, assert_close

from rtxdsl import liger
from rtxdsl.errors import RtxError

ROWS, HIDDEN, VOCAB = 7, 24, 13  # odd rows, a hidden size of no power of two, odd classes


@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOAT_TOLERANCES)
@pytest.mark.parametrize("offset, init_fn", [(0.0, "ones"), (1.0, "zeros")], ids=["llama", "gemma"])
def test_rms_norm(dtype, atol, rtol, offset, init_fn, gen):
    m = liger.LigerRMSNorm(
        HIDDEN, eps=1e-6, offset=offset, init_fn=init_fn, casting_mode="gemma" if offset else "llama"
    )
    assert torch.equal(m.weight, torch.ones(HIDDEN) if init_fn == "ones" else torch.zeros(HIDDEN))
    m.weight.data.normal_(generator=gen)
    x = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + m.weight.double())
    assert_close(m.to(dtype)(x.to(dtype)), want, atol, rtol, "rms_norm")


def test_fused_add_rms_norm_returns_the_sum(gen):
    m = liger.LigerFusedAddRMSNorm(HIDDEN)
    h, r = torch.randn(ROWS, HIDDEN, generator=gen), torch.randn(ROWS, HIDDEN, generator=gen)
    out, total = m(h, r)
    assert_close(total, (h + r).double(), 1e-6, 1e-6, "sum")
    assert_close(out, F.rms_norm((h + r).double(), (HIDDEN,), eps=1e-6), 1e-5, 1e-5, "normed")


def test_layer_norm_has_liger_s_parameters(gen):
    m = liger.LigerLayerNorm(HIDDEN, bias=False)
    assert torch.equal(m.bias, torch.zeros(HIDDEN)) and torch.equal(m.weight, torch.ones(HIDDEN))
    x = torch.randn(ROWS, HIDDEN, generator=gen)
    assert_close(m(x), F.layer_norm(x.double(), (HIDDEN,), eps=1e-6), 1e-5, 1e-5, "layer_norm")


def test_group_norm_takes_channels_first(gen):
    m = liger.LigerGroupNorm(6, 3)  # Liger's order: (num_channels, num_groups)
    assert (m.num_channels, m.num_groups) == (6, 3)
    x = torch.randn(2, 6, 5, generator=gen)
    assert_close(m(x), F.group_norm(x.double(), 3, eps=1e-6), 1e-5, 1e-5, "group_norm")


def _ce_reference(logits, target, z, softcap=None, weight=None):
    x = logits.double() if softcap is None else softcap * torch.tanh(logits.double() / softcap)
    kept = target != -100
    lse = torch.logsumexp(x, -1)
    loss = F.cross_entropy(x, target, weight=weight)
    z_term = z * (lse[kept] ** 2).mean()
    acc = (x.argmax(-1)[kept] == target[kept]).double().mean()
    return loss + z_term, z_term, acc


def test_cross_entropy_output_object(gen):
    logits = torch.randn(ROWS, VOCAB, generator=gen)
    target = torch.tensor([1, -100, 3, 4, 12, 0, 2])
    fn = liger.LigerCrossEntropyLoss(lse_square_scale=1e-2, softcap=5.0, return_z_loss=True, return_token_accuracy=True)
    out = fn(logits, target)
    assert isinstance(out, liger.CrossEntropyOutput)
    loss, z_term, acc = _ce_reference(logits, target, 1e-2, softcap=5.0)
    assert_close(out.loss, loss, 1e-5, 1e-5, "loss")
    assert_close(out.z_loss, z_term, 1e-5, 1e-5, "z_loss")
    assert_close(out.token_accuracy, acc, 1e-6, 1e-6, "accuracy")
    assert liger.LigerCrossEntropyLoss()(logits, target).shape == ()  # no flag: a tensor, as Liger's


@pytest.mark.parametrize(("dtype", "atol", "rtol"), [(torch.float32, 2e-5, 2e-5), (torch.bfloat16, 2e-2, 2e-2)])
def test_fused_linear_cross_entropy_weight_first(dtype, atol, rtol, gen):
    h = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64)
    w = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) / HIDDEN**0.5
    b = torch.randn(VOCAB, generator=gen, dtype=torch.float64)
    target = torch.tensor([1, -100, 3, 4, 12, 0, 2])
    fn = liger.LigerFusedLinearCrossEntropyLoss(lse_square_scale=1e-3, return_z_loss=True)
    leaves = [t.to(dtype).requires_grad_() for t in (w, h, b)]
    out = fn(*leaves[:2], target, leaves[2])  # Liger's order: (lin_weight, _input, target, bias)
    assert out.loss.dtype == torch.float32  # as Liger's, for half inputs too
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    loss, z_term, _ = _ce_reference(ref_leaves[1] @ ref_leaves[0].T + ref_leaves[2], target, 1e-3)
    assert_close(out.loss, loss, atol, rtol, "loss")
    assert_close(out.z_loss, z_term, atol, rtol, "z_loss")
    got = torch.autograd.grad(out.loss, leaves)
    want = torch.autograd.grad(loss, ref_leaves)
    for name, a, e in zip(("lin_weight", "_input", "bias"), got, want):
        assert_close(a, e, atol, rtol, f"d/d{name}")


def test_mlps_from_a_config(gen):
    config = types.SimpleNamespace(hidden_size=8, intermediate_size=12, hidden_act="silu")
    m = liger.LigerSwiGLUMLP(config)
    x = torch.randn(3, 8, generator=gen)
    want = m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))
    torch.testing.assert_close(m(x), want, atol=1e-5, rtol=1e-5)
    g = liger.LigerGEGLUMLP(config)
    want = g.down_proj(F.gelu(g.gate_proj(x), approximate="tanh") * g.up_proj(x))
    torch.testing.assert_close(g(x), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(RtxError, match="hidden_act"):
        liger.LigerSwiGLUMLP(types.SimpleNamespace(hidden_size=8, intermediate_size=12, hidden_act="relu"))


def test_softmax_and_relu_squared(gen):
    x = torch.randn(ROWS, VOCAB, generator=gen)
    assert_close(liger.LigerSoftmax()(x), torch.softmax(x.double(), -1), 1e-6, 1e-6, "softmax")
    assert_close(liger.LigerReLUSquared()(x), torch.relu(x.double()) ** 2, 1e-6, 1e-6, "relu_squared")


def test_apply_liger_kernel_swaps_an_instance():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    liger.apply_liger_kernel_to_llama(model=m)
    assert type(m[1]).__module__ == "rtxdsl.nn.modules"
    with pytest.raises(RtxError, match="pass model="):
        liger.apply_liger_kernel_to_qwen2()


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: liger.LigerFusedLinearCrossEntropyLoss(use_token_scaling=True), "use_token_scaling"),
        (lambda: liger.LigerFusedLinearCrossEntropyLoss(accum_dtype=torch.float16), "accum_dtype"),
        (lambda: liger.LigerRMSNorm(8, casting_mode="fp8"), "casting_mode"),
        (lambda: liger.LigerRMSNorm(8, init_fn="randn"), "init_fn"),
    ],
    ids=["use_token_scaling", "accum_dtype", "casting_mode", "init_fn"],
)
def test_unsupported_flags_name_themselves(make, words):
    with pytest.raises(RtxError, match=words):
        make()


def test_modules_run_inside_torch_compile(gen):
    """Their kernels are made when the module is (rtxdsl.nn.memo): the forward only finds them, so a
    whole-graph trace holds one custom op per kernel."""
    h, w = torch.randn(ROWS, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen)
    target = torch.tensor([1, -100, 3, 4, 12, 0, 2])
    for fn, args in (
        (liger.LigerFusedLinearCrossEntropyLoss(), (w, h, target)),
        (liger.LigerCrossEntropyLoss(), (h @ w.T, target)),
        (liger.LigerSoftmax(), (h,)),
    ):
        torch.testing.assert_close(torch.compile(fn, fullgraph=True)(*args), fn(*args))
