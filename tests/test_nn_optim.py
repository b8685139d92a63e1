"""Drop-in modules and the fused AdamW: torch's arguments, parameters and state_dicts, torch's numbers."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

import rtxdsl as rx


def _mlp(norm: str = "layer") -> torch.nn.Module:
    torch.manual_seed(0)
    norm_mod = torch.nn.LayerNorm(16) if norm == "layer" else torch.nn.RMSNorm(16)
    return torch.nn.Sequential(torch.nn.Linear(7, 16), norm_mod, torch.nn.GELU(), torch.nn.Linear(16, 5))


@pytest.mark.parametrize(
    ("ours", "theirs", "args"),
    [
        (rx.nn.LayerNorm, torch.nn.LayerNorm, (13,)),
        (rx.nn.LayerNorm, torch.nn.LayerNorm, (13, 1e-3, False)),  # no affine parameters
        (rx.nn.RMSNorm, torch.nn.RMSNorm, (13,)),  # eps=None: the dtype's machine epsilon
        (rx.nn.RMSNorm, torch.nn.RMSNorm, (13, 1e-5)),
    ],
)
def test_norm_modules_match_torch_and_share_checkpoints(ours, theirs, args, gen):
    a, b = ours(*args), theirs(*args)
    with torch.no_grad():
        for p in b.parameters():
            p.uniform_(0.5, 1.5, generator=gen)
    a.load_state_dict(b.state_dict())  # torch's checkpoint into ours ...
    b.load_state_dict(a.state_dict())  # ... and back
    assert a.state_dict().keys() == b.state_dict().keys()
    x = torch.randn(5, 13, generator=gen)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.testing.assert_close(a(xa), b(xb))
    a(xa).sum().backward()
    b(xb).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad)


def test_replace_modules_swaps_norms_in_place():
    model = _mlp()
    x = torch.randn(4, 7)
    want = model(x)
    weight = model[1].weight
    assert rx.nn.replace_modules(model) == 1
    assert type(model[1]) is rx.nn.LayerNorm and model[1].weight is weight  # the same parameter
    torch.testing.assert_close(model(x), want)
    assert rx.nn.replace_modules(model) == 0  # nothing left to swap


def test_cross_entropy_loss_module(gen):
    logits, target = torch.randn(6, 11, generator=gen), torch.randint(0, 11, (6,), generator=gen)
    w = torch.rand(11, generator=gen)
    for kw in ({}, {"weight": w, "label_smoothing": 0.1}, {"reduction": "sum", "ignore_index": 3}):
        torch.testing.assert_close(
            rx.nn.CrossEntropyLoss(**kw)(logits, target), torch.nn.CrossEntropyLoss(**kw)(logits, target)
        )


@pytest.mark.parametrize(
    ("cls", "act"), [(rx.nn.SwiGLU, F.silu), (rx.nn.GeGLU, lambda t: F.gelu(t, approximate="tanh"))]
)
def test_gated_mlp_blocks(cls, act, gen):
    m = cls(8, 24)
    assert set(m.state_dict()) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    x = torch.randn(3, 8, generator=gen)
    want = m.down_proj(act(m.gate_proj(x)) * m.up_proj(x))
    torch.testing.assert_close(m(x), want)


@pytest.mark.parametrize(("amsgrad", "maximize"), [(False, False), (True, False), (False, True)])
def test_adamw_matches_torch_over_24_steps(amsgrad, maximize):
    a, b = _mlp(), _mlp()
    rx.nn.replace_modules(b)
    opt_a = torch.optim.AdamW(a.parameters(), lr=3e-3, weight_decay=0.05, amsgrad=amsgrad, maximize=maximize)
    opt_b = rx.optim.AdamW(b.parameters(), lr=3e-3, weight_decay=0.05, amsgrad=amsgrad, maximize=maximize)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, 6, 0.5)  # four learning rates, one kernel
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, 6, 0.5)
    gen = torch.Generator().manual_seed(1)
    before = rx.cache_stats().compiles
    for _ in range(24):
        x, y = torch.randn(16, 7, generator=gen), torch.randint(0, 5, (16,), generator=gen)
        for model, opt, sched in ((a, opt_a, sched_a), (b, opt_b, sched_b)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, atol=2e-5, rtol=1e-4)
    assert rx.cache_stats().compiles - before <= 8  # one kernel per parameter shape, not per step or lr


def test_adamw_state_dict_moves_both_ways():
    a, b = _mlp(), _mlp()
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    x, y = torch.randn(8, 7), torch.randint(0, 5, (8,))
    for _ in range(3):
        opt_a.zero_grad()
        F.cross_entropy(a(x), y).backward()
        opt_a.step()
    b.load_state_dict(a.state_dict())
    opt_b = rx.optim.AdamW(b.parameters(), lr=1e-2)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # continue torch's run with ours (own tensors)
    for model, opt in ((a, opt_a), (b, opt_b)):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5)
    back = torch.optim.AdamW(a.parameters(), lr=1e-2)
    back.load_state_dict(copy.deepcopy(opt_b.state_dict()))  # and ours into torch's
    assert back.state_dict()["state"][0]["step"] == 4


def test_adamw_bf16_parameters():
    torch.manual_seed(0)
    p32 = torch.randn(33)
    pa, pb = torch.nn.Parameter(p32.bfloat16()), torch.nn.Parameter(p32.bfloat16())
    opt_a, opt_b = torch.optim.AdamW([pa], lr=1e-2), rx.optim.AdamW([pb], lr=1e-2)
    for i in range(10):
        g = torch.randn(33, generator=torch.Generator().manual_seed(i)).bfloat16()
        pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    assert pb.dtype == torch.bfloat16
    torch.testing.assert_close(pa.float(), pb.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("missing", ["exp_avg", "exp_avg_sq"])
def test_adamw_state_dict_missing_a_state_key_fails_as_torch_does(missing):
    def step_after_loading(cls):
        p = torch.nn.Parameter(torch.ones(3))
        src = torch.optim.AdamW([p])
        p.grad = torch.ones(3)
        src.step()
        state = copy.deepcopy(src.state_dict())
        del state["state"][0][missing]
        q = torch.nn.Parameter(torch.ones(3))
        opt = cls([q])
        opt.load_state_dict(state)
        q.grad = torch.ones(3)
        with pytest.raises(Exception) as caught:
            opt.step()
        return type(caught.value), str(caught.value)

    assert step_after_loading(rx.optim.AdamW) == step_after_loading(torch.optim.AdamW) == (KeyError, repr(missing))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_rms_norm_default_eps_is_the_epsilon_torch_computes_with(dtype):
    """``eps=None``: torch takes the epsilon of its compute dtype (float32's for fp16 / bf16)."""
    x = torch.full((1, 4), 1e-2, dtype=dtype)
    want = torch.nn.RMSNorm(4).to(dtype)(x)
    torch.testing.assert_close(rx.nn.RMSNorm(4).to(dtype)(x), want)
    lazy = F.rms_norm(rx.Fusion().lazy(x), (4,)).torch()  # recorded by the lazy stream
    torch.testing.assert_close(lazy, F.rms_norm(x, (4,)))


@pytest.mark.parametrize(
    "make",
    [
        lambda: rx.nn.LayerNorm(6),
        lambda: rx.nn.RMSNorm(6, offset=1.0, promote=True),
        lambda: rx.nn.SwiGLU(6, 10),
        lambda: rx.nn.GeGLU(6, 10),
        lambda: rx.nn.GateUpMLP(6, 10, activation="gelu_tanh"),
        lambda: rx.nn.CrossEntropyLoss(label_smoothing=0.1),
    ],
)
def test_fused_modules_deepcopy_and_pickle(make):
    m = make()
    x = torch.randn(3, 6)
    args = (x, torch.tensor([1, 0, 5])) if isinstance(m, torch.nn.CrossEntropyLoss) else (x,)
    want = m(*args)
    for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert type(clone) is type(m) and clone.state_dict().keys() == m.state_dict().keys()
        torch.testing.assert_close(clone(*args), want)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_step_writes_parameters_and_state_in_place(amsgrad):
    """One kernel per parameter, each result written over its own tensor: no per-step copies (a
    copy_ would be a second launch and a second pass over the tensor)."""
    w = torch.nn.Parameter(torch.randn(33, 7))
    ws = torch.nn.Parameter(torch.randn(9, 5).t())  # non-contiguous: computed apart, copied in
    opt = rx.optim.AdamW([w, ws], lr=1e-2, amsgrad=amsgrad)
    ref = torch.optim.AdamW([w2 := torch.nn.Parameter(w.detach().clone())], lr=1e-2, amsgrad=amsgrad)
    for step in range(3):
        for p in (w, ws, w2):
            p.grad = torch.full_like(p, 0.1 * (step + 1))
        pointers = [w.data_ptr(), *(v.data_ptr() for k, v in opt.state[w].items() if k != "step")] if step else []
        version = w._version
        rx.reset_fusion_stats()
        calls = []
        real_copy = torch.Tensor.copy_
        torch.Tensor.copy_ = lambda self, src, *a, **k: calls.append(self.shape) or real_copy(self, src, *a, **k)
        try:
            opt.step()
        finally:
            torch.Tensor.copy_ = real_copy
        ref.step()
        assert rx.fusion_stats().kernels_launched == 2  # one per parameter
        assert all(s == ws.shape for s in calls)  # only the non-contiguous parameter (and its state) copied
        if step:
            assert pointers == [w.data_ptr(), *(v.data_ptr() for k, v in opt.state[w].items() if k != "step")]
        assert w._version > version  # autograd sees the write
        torch.testing.assert_close(w, w2)


@pytest.mark.parametrize("beta2", [0.999, 0.99999])
def test_adamw_first_step_state_is_torchs_bit_for_bit(beta2, gen):
    """The step's scalars are computed in double on the host, as torch computes them: ``1 - beta2``
    formed in the kernel from a float32 ``beta2`` was 1.3e-5 (0.999) to 1.4e-3 (0.99999) off, a
    bias in ``exp_avg_sq`` every step shared (an outside fuzzer's 0-dim parameter drifted)."""
    p0, g = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)
    a, b = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    ta, tb = torch.optim.AdamW([a], lr=0.1, betas=(0.9, beta2)), rx.optim.AdamW([b], lr=0.1, betas=(0.9, beta2))
    a.grad, b.grad = g.clone(), g.clone()
    ta.step()
    tb.step()
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(tb.state[b][key], ta.state[a][key]), key
    # the parameter within two ulps of the step (lr * update, up to 0.1 here): torch's CPU kernels
    # round the division and the square root as the machine's vector units do (2 ulps on an AMD
    # EPYC, 0 on CI's machine)
    torch.testing.assert_close(b, a, atol=2e-8, rtol=2e-7)
