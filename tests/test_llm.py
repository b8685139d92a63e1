"""Cross-entropy, rotary embeddings, GeGLU, fused add+RMSNorm, dropout+residual+layer_norm:
composites of primitives, checked against torch in float64, differentiated, counted."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import FLOAT_TOLERANCES, assert_close

import rtxdsl as rx
from rtxdsl.ops.llm import _ce_ref, _rope_ref

x, t, w, c, s, r = (rx.var(n) for n in ("x", "t", "w", "c", "s", "r"))

# (kwargs, weighted): each exercises one branch of torch's cross_entropy
CE_CASES = [
    ({}, False),  # mean over the non-ignored rows
    ({"reduction": "sum"}, False),
    ({"reduction": "none"}, False),
    ({"label_smoothing": 0.1}, False),  # smoothing: the uniform term over all classes
    ({"z_loss": 1e-2}, False),  # PaLM's z-loss
    ({}, True),  # mean divides by the weight of the non-ignored targets
    ({"label_smoothing": 0.2}, True),  # smoothing with weights: the weighted class sum
    ({"reduction": "none", "z_loss": 0.1}, True),
    ({"ignore_index": 3}, False),  # an ignore index that is a valid class
]


def _ce_inputs(gen, dtype, rows=7, classes=13, ignore=-100):
    logits = torch.randn(rows, classes, generator=gen, dtype=torch.float64).to(dtype)
    target = torch.randint(0, classes, (rows,), generator=gen)
    target[2] = ignore  # an ignored row
    target[-1] = 3  # class 3, the ignore index of one case
    weight = torch.rand(classes, generator=gen, dtype=torch.float64).to(dtype)
    return logits, target, weight


@pytest.mark.parametrize(("kw", "weighted"), CE_CASES)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOAT_TOLERANCES)
def test_cross_entropy_forward_and_backward(kw, weighted, dtype, atol, rtol, gen):
    logits, target, weight = _ce_inputs(gen, dtype, ignore=kw.get("ignore_index", -100))
    ins = {"x": logits.clone().requires_grad_(), "t": target} | ({"w": weight} if weighted else {})
    k = rx.compile(rx.cross_entropy(x, t, w if weighted else None, **kw))
    out = k(**ins)
    ref_x = logits.double().requires_grad_()
    opts = {"ignore_index": -100, "reduction": "mean", "label_smoothing": 0.0, "z_loss": 0.0} | kw
    ref = _ce_ref(ref_x, target, *([weight.double()] if weighted else []), **opts)
    if opts["z_loss"] == 0.0:  # our reference is torch's own when there is no z-loss
        torch.testing.assert_close(
            ref,
            F.cross_entropy(
                ref_x, target, weight.double() if weighted else None, **{k: v for k, v in opts.items() if k != "z_loss"}
            ),
        )
    assert_close(out, ref, atol, rtol, f"loss {kw}")
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(g.to(out.dtype))
    ref.backward(g)
    assert_close(ins["x"].grad, ref_x.grad, atol * 10, rtol * 10, f"grad {kw}")


def test_cross_entropy_probability_targets_and_higher_rank(gen):
    logits = torch.randn(5, 9, generator=gen, dtype=torch.float64)
    probs = torch.softmax(torch.randn(5, 9, generator=gen, dtype=torch.float64), -1)
    for kw in ({}, {"label_smoothing": 0.1, "reduction": "none"}):
        assert_close(
            rx.compile(rx.cross_entropy(x, t, **kw))(x=logits, t=probs),
            F.cross_entropy(logits, probs, **kw),
            1e-9,
            1e-9,
            str(kw),
        )
    x3 = torch.randn(2, 5, 3, generator=gen, dtype=torch.float64)  # class axis 1 of [N, C, d]
    t3 = torch.randint(0, 5, (2, 3), generator=gen)
    w5 = torch.rand(5, generator=gen, dtype=torch.float64)
    assert_close(rx.compile(rx.cross_entropy(x, t, w))(x=x3, t=t3, w=w5), F.cross_entropy(x3, t3, w5), 1e-9, 1e-9, "3d")


def test_cross_entropy_gradcheck(gen):
    logits, target, weight = _ce_inputs(gen, torch.float64, rows=4, classes=5)
    target[2] = -100
    k = rx.compile(rx.cross_entropy(x, t, w, label_smoothing=0.1, z_loss=0.01))
    assert torch.autograd.gradcheck(lambda a: k(x=a, t=target, w=weight), (logits.requires_grad_(),))


def test_cross_entropy_kernel_counts(gen):
    logits, target, _ = _ce_inputs(gen, torch.float32, rows=64, classes=257)
    per_row = rx.compile(rx.cross_entropy(x, t, reduction="none")).program(x=logits, t=target)
    assert per_row.kernels_launched == 1  # gather, logsumexp and the ignore mask in one row kernel
    assert per_row.bytes_moved == per_row.minimum_bytes
    mean = rx.compile(rx.cross_entropy(x, t)).program(x=logits, t=target)
    assert mean.kernels_launched == 1  # the mean over rows: the tail the row kernel's last program runs
    assert mean.kernels[0].tail is not None
    assert _backward_launches(rx.cross_entropy(x, t), x=logits, t=target) == 1  # from the saved lse, one pass


def _backward_launches(e, **ins):
    """Kernels the backward of ``e`` launches (the first float input requires grad)."""
    name = next(n for n, v in ins.items() if v.is_floating_point())
    ins = {**ins, name: ins[name].detach().requires_grad_()}
    out = rx.compile(e)(**ins)
    before = rx.fusion_stats().kernels_launched
    out.backward(torch.ones_like(out))
    return rx.fusion_stats().kernels_launched - before


def test_cross_entropy_bad_input():
    logits = torch.randn(4, 6)
    k = rx.compile(rx.cross_entropy(x, t))
    with pytest.raises(rx.RtxError, match=r"target has shape \[4, 2\]"):
        k(x=logits, t=torch.zeros(4, 2, dtype=torch.int64))
    with pytest.raises(rx.RtxError, match="class-index target must be int64"):
        k(x=logits, t=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(rx.RtxError, match="out of range"):  # a class index that is not ignored
        k(x=logits, t=torch.tensor([0, 6, 1, 2]))
    with pytest.raises(rx.RtxError, match="reduction must be one of"):
        rx.cross_entropy(x, t, reduction="avg")
    with pytest.raises(rx.RtxError, match="label_smoothing must be in"):
        rx.cross_entropy(x, t, label_smoothing=1.5)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOAT_TOLERANCES)
def test_rope(interleaved, dtype, atol, rtol, gen):
    q = torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64)  # [B, H, T, D]
    cos = torch.randn(5, 8, generator=gen, dtype=torch.float64)  # [T, D]: broadcast over B and H
    sin = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    k = rx.compile(rx.rope(x, c, s, interleaved))
    ins = {"x": q.to(dtype).requires_grad_(), "c": cos.to(dtype), "s": sin.to(dtype)}
    out = k(**ins)
    ref_q = q.to(dtype).double().requires_grad_()
    ref = _rope_ref(ref_q, cos.to(dtype).double(), sin.to(dtype).double(), interleaved)
    assert_close(out, ref, atol, rtol, "rope")
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(g.to(dtype))
    ref.backward(g.to(dtype).double())
    assert_close(ins["x"].grad, ref_q.grad, atol * 4, rtol * 4, "rope grad")
    p = k.program(**ins)
    assert p.kernels_launched == 1 and p.bytes_moved == p.minimum_bytes


def test_rope_q_and_k_in_one_kernel_and_backward_in_one(gen):
    q, kk = torch.randn(2, 4, 6, 16, generator=gen), torch.randn(2, 2, 6, 16, generator=gen)  # GQA: fewer k heads
    cos, sin = torch.randn(6, 16, generator=gen), torch.randn(6, 16, generator=gen)
    both = rx.compile({"q": rx.rope(x, c, s), "k": rx.rope(r, c, s)})
    out = both(x=q, r=kk, c=cos, s=sin)
    torch.testing.assert_close(out["q"], _rope_ref(q, cos, sin, False))
    torch.testing.assert_close(out["k"], _rope_ref(kk, cos, sin, False))
    assert both.launches(x=q, r=kk, c=cos, s=sin) == 2  # q and k have different shapes: one kernel each
    same = rx.compile({"q": rx.rope(x, c, s), "k": rx.rope(r, c, s)})
    assert same.launches(x=q, r=q.clone(), c=cos, s=sin) == 1  # same shape: one kernel
    assert _backward_launches(rx.rope(x, c, s), x=q, c=cos, s=sin) == 1


def test_rope_bad_input():
    k = rx.compile(rx.rope(x, c, s))
    with pytest.raises(rx.RtxError, match="even size"):
        k(x=torch.randn(2, 5), c=torch.randn(5), s=torch.randn(5))
    with pytest.raises(rx.RtxError, match="cos has shape"):
        k(x=torch.randn(2, 4), c=torch.randn(3, 4), s=torch.randn(4))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_geglu(approximate, gen):
    a, b = (
        torch.randn(3, 10, generator=gen, dtype=torch.float64),
        torch.randn(3, 10, generator=gen, dtype=torch.float64),
    )
    k = rx.compile(rx.geglu(x, r, approximate))
    assert_close(k(x=a, r=b), F.gelu(a, approximate=approximate) * b, 1e-10, 1e-10, approximate)  # tanh: formula
    assert torch.autograd.gradcheck(lambda p, q: k(x=p, r=q), (a.requires_grad_(), b.requires_grad_()))


def test_fused_residual_add_rms_norm_writes_both_outputs(gen):
    a, res = torch.randn(6, 32, generator=gen), torch.randn(6, 32, generator=gen)
    wt = torch.randn(32, generator=gen)
    h = x + r
    k = rx.compile({"h": h, "y": rx.rms_norm(h, w)})
    out = k(x=a, r=res, w=wt)
    torch.testing.assert_close(out["h"], a + res)
    torch.testing.assert_close(out["y"], F.rms_norm(a + res, (32,), wt, 1e-6))
    p = k.program(x=a, r=res, w=wt)
    assert p.kernels_launched == 1 and p.bytes_moved == p.minimum_bytes


def test_dropout_residual_layer_norm_in_one_kernel(gen):
    a, res = torch.randn(6, 32, generator=gen), torch.randn(6, 32, generator=gen)
    e = rx.layer_norm(rx.dropout(x, 0.25, seed=11) + r)
    k = rx.compile(e)
    p = k.program(x=a, r=res)
    assert p.kernels_launched == 1 and p.bytes_moved == p.minimum_bytes
    kept = rx.compile(rx.dropout(x, 0.25, seed=11))(x=a)
    torch.testing.assert_close(k(x=a, r=res), F.layer_norm(kept + res, (32,)))


# ---- cross_entropy(..., grad_in_forward=True): Liger-Kernel's memory trick --------------------------
@pytest.mark.parametrize(
    "kw, weighted",
    [
        ({}, False),  # plain mean
        ({"label_smoothing": 0.1}, True),  # smoothing with class weights: every term of the gradient
        ({"reduction": "sum", "z_loss": 0.01}, False),  # sum, and the z-loss term
    ],
)
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float64, 1e-12, 1e-12), *FLOAT_TOLERANCES])
def test_cross_entropy_grad_in_forward_writes_the_gradient_into_the_logits(kw, weighted, dtype, atol, rtol, gen):
    logits64, target, weight = _ce_inputs(gen, torch.float64, rows=13, classes=37)
    target[3] = -100  # an ignored row
    w_in = {"w": weight.to(dtype)} if weighted else {}
    k = rx.compile(rx.cross_entropy(x, t, w if weighted else None, grad_in_forward=True, **kw))
    logits64 = logits64.detach()
    a = logits64.to(dtype).clone().requires_grad_()
    logits = a * 1.0  # not a leaf: its memory is reused
    loss = k(x=logits, t=target, **w_in)
    assert logits._version == 1  # it holds the gradient now, and autograd knows it was written
    (loss * 3).backward()
    ref = logits64.clone().requires_grad_()
    want = F.cross_entropy(
        ref, target, weight if weighted else None, reduction=kw.get("reduction", "mean"),
        label_smoothing=kw.get("label_smoothing", 0.0),
    )  # fmt: skip
    if kw.get("z_loss"):
        want = want + (0.01 * ref.logsumexp(-1) ** 2 * (target != -100)).sum()
    (want * 3).backward()
    assert_close(loss, want.detach(), atol, rtol, "loss")
    assert_close(a.grad, ref.grad, atol * 10, rtol * 10, "gradient")
    assert_close(logits.detach(), ref.grad, atol * 10, rtol * 10, "the logits' memory holds the gradient")


def test_cross_entropy_grad_in_forward_leaves_leaf_logits_alone_and_fails_loudly_on_saved_logits(gen):
    logits, target, _ = _ce_inputs(gen, torch.float32, rows=9, classes=21)
    k = rx.compile(rx.cross_entropy(x, t, grad_in_forward=True))
    leaf = logits.clone().requires_grad_()
    k(x=leaf, t=target).backward()
    assert torch.equal(leaf.detach(), logits) and leaf._version == 0  # a leaf's .grad must not alias it
    ref = logits.clone().requires_grad_()
    F.cross_entropy(ref, target).backward()
    torch.testing.assert_close(leaf.grad, ref.grad)
    a = logits.clone().requires_grad_()
    saved = a.exp()  # exp saves its output for its own backward: overwriting it must not go unnoticed
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        k(x=saved, t=target).backward()


def test_cross_entropy_grad_in_forward_launches_and_bad_input(gen):
    logits, target, _ = _ce_inputs(gen, torch.float32, rows=9, classes=21)
    k = rx.compile(rx.cross_entropy(x, t, grad_in_forward=True))
    a = logits.clone().requires_grad_()
    logits_in = a * 1.0
    rx.reset_fusion_stats()
    loss = k(x=logits_in, t=target)
    assert rx.fusion_stats().kernels_launched == 2  # the loss (its mean a tail), then the gradient into the logits
    rx.reset_fusion_stats()
    loss.backward()
    assert rx.fusion_stats().kernels_launched == 1  # the backward only scales the saved gradient, in place
    with pytest.raises(rx.RtxError, match="grad_in_forward needs a scalar loss"):
        rx.cross_entropy(x, t, reduction="none", grad_in_forward=True)
    with pytest.raises(rx.RtxError, match="grad_in_forward must be a bool"):
        rx.cross_entropy(x, t, grad_in_forward=1)


def test_cross_entropy_grad_in_forward_with_autotune_times_no_kernel_that_writes_its_input(tmp_path, gen):
    """Timing runs a kernel again on the same tensors: a kernel writing into its input is never tuned."""
    from rtxdsl import tune

    logits, target, _ = _ce_inputs(gen, torch.float32, rows=9, classes=21)
    timed = []

    def timer(launch) -> float:
        launch()
        timed.append(1)
        return 1.0

    k = rx.compile(
        rx.cross_entropy(x, t, grad_in_forward=True), config=rx.FusionConfig(autotune=True, cache_dir=str(tmp_path))
    )
    tune.set_timer(timer)
    try:
        a = logits.clone().requires_grad_()
        k(x=a * 1.0, t=target).backward()
    finally:
        tune.set_timer(None)
    ref = logits.clone().requires_grad_()
    F.cross_entropy(ref, target).backward()
    torch.testing.assert_close(a.grad, ref.grad)
    assert timed  # the loss kernel was tuned; the in-place gradient and scaling kernels were not
