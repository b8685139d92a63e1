"""Cross-entropy, rotary embeddings, GeGLU, fused add+RMSNorm, dropout+residual+layer_norm:
composites of primitives, checked against torch in float64, differentiated, counted."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import FLOAT_TOLERANCES, assert_close

import rtxdsl as rx
from rtxdsl.ops.llm import _ce_ref, _rope_ref
from rtxdsl.workloads import rope_eager

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


@pytest.mark.parametrize(("kw", "weighted"), CE_CASES)
def test_cross_entropy_matches_torch_on_inf_and_nan_rows(kw, weighted):
    """torch takes log_softmax first: a row with a +inf logit, or only -inf ones, is NaN (not
    inf); a -inf logit elsewhere is fine; a NaN logit is NaN."""
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor(
        [[1.0, inf, 0.0, 2.0], [0.0, 1.0, 2.0, 3.0], [-inf, -inf, -inf, -inf], [-inf, 0.0, 1.0, 2.0],
         [nan, 0.0, 1.0, 2.0], [inf, inf, 0.0, 1.0]]
    )  # fmt: skip
    target = torch.tensor([0, 1, 2, 0, 3, 3])
    weight = torch.tensor([0.5, 1.0, 2.0, 1.5]) if weighted else None
    kw = {k: v for k, v in kw.items() if k != "ignore_index"}
    ins = {"x": logits, "t": target} | ({"w": weight} if weighted else {})
    got = rx.compile(rx.cross_entropy(x, t, w if weighted else None, **kw))(**ins)
    torch.testing.assert_close(got, _ce_ref(logits, target, *([weight] if weighted else []), ignore_index=-100,
                                            reduction=kw.get("reduction", "mean"),
                                            label_smoothing=kw.get("label_smoothing", 0.0),
                                            z_loss=kw.get("z_loss", 0.0)), equal_nan=True)  # fmt: skip


# (expression over x [4, 2, 3], reference): cross-entropy reading a value another kernel reduced,
# both directly (its logsumexp) and through a gather (its target logit)
OVER_REDUCED = {
    "mean_none": (rx.cross_entropy(rx.mean(x, axis=0), t, reduction="none"),
                  lambda x, t: F.cross_entropy(x.mean(0), t, reduction="none")),
    "mean_mean": (rx.cross_entropy(rx.mean(x, axis=0), t), lambda x, t: F.cross_entropy(x.mean(0), t)),
    "sum_smoothed": (rx.cross_entropy(rx.sum(x, axis=0) * 0.5, t, label_smoothing=0.1),
                     lambda x, t: F.cross_entropy(x.sum(0) * 0.5, t, label_smoothing=0.1)),
    "amax_then_gather": (rx.logsumexp(rx.amax(x, 0), -1) - rx.gather(rx.amax(x, 0), t[:, None], -1)[:, 0],
                         lambda x, t: torch.logsumexp(x.amax(0), -1) - x.amax(0).gather(-1, t[:, None])[:, 0]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(OVER_REDUCED))
def test_cross_entropy_over_a_value_another_kernel_reduced(case, gen):
    expr, ref = OVER_REDUCED[case]
    x4 = torch.randn(4, 2, 3, generator=gen, dtype=torch.float64)
    t2 = torch.tensor([1, 2])
    assert_close(rx.compile(expr)(x=x4, t=t2), ref(x4, t2), 1e-9, 1e-9, case)


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
    with pytest.raises(rx.RtxError, match="target .t. holds a class index out of range"):  # not ignored
        k(x=logits, t=torch.tensor([0, 6, 1, 2]))
    with pytest.raises(rx.RtxError, match="reduction must be one of"):
        rx.cross_entropy(x, t, reduction="avg")
    with pytest.raises(rx.RtxError, match="label_smoothing must be in"):
        rx.cross_entropy(x, t, label_smoothing=1.5)


@pytest.mark.parametrize(
    "interleaved, head_dim",
    [
        (False, 8),
        (True, 8),
        (False, 7),  # odd: Hugging Face's rotate_half splits at D // 2, the middle element goes second
    ],
)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOAT_TOLERANCES)
def test_rope(interleaved, head_dim, dtype, atol, rtol, gen):
    q = torch.randn(2, 3, 5, head_dim, generator=gen, dtype=torch.float64)  # [B, H, T, D]
    cos = torch.randn(5, head_dim, generator=gen, dtype=torch.float64)  # [T, D]: broadcast over B and H
    sin = torch.randn(5, head_dim, generator=gen, dtype=torch.float64)
    k = rx.compile(rx.rope(x, c, s, interleaved))
    ins = {"x": q.to(dtype).requires_grad_(), "c": cos.to(dtype), "s": sin.to(dtype)}
    out = k(**ins)
    ref_q = q.to(dtype).double().requires_grad_()
    ref_of = (lambda *a: _rope_ref(*a, True)) if interleaved else rope_eager  # rope_eager: HF's own code
    ref = ref_of(ref_q, cos.to(dtype).double(), sin.to(dtype).double())
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
    with pytest.raises(rx.RtxError, match="interleaved pairs need an even last axis"):
        rx.compile(rx.rope(x, c, s, interleaved=True))(x=torch.randn(2, 5), c=torch.randn(5), s=torch.randn(5))
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


@pytest.mark.parametrize(
    ("kw", "launches"),
    [
        # the count of non-ignored targets the mean divides by (each row's gradient needs it), then
        # one row kernel: loss, gradient into the logits, the mean as its tail
        ({}, 2),
        ({"reduction": "sum"}, 1),  # nothing to count: the one row kernel
        ({"label_smoothing": 0.1, "z_loss": 1e-3}, 2),  # every term in the same row kernel
    ],
)
def test_cross_entropy_grad_in_forward_reads_the_logits_once(kw, launches, gen):
    """Liger-Kernel's cross-entropy: the loss and its gradient from one read of the logits, the
    gradient written over them; the backward only scales it."""
    logits, target, _ = _ce_inputs(gen, torch.float32, rows=9, classes=21)
    k = rx.compile(rx.cross_entropy(x, t, grad_in_forward=True, **kw))
    a = logits.clone().requires_grad_()
    logits_in = a * 1.0
    rx.reset_fusion_stats()
    loss = k(x=logits_in, t=target)
    stats = rx.fusion_stats()
    assert stats.kernels_launched == launches
    # the logits read once and their gradient written once (a second read would be 3x), the rest
    # per row (targets, losses, the count)
    assert 2 * logits.nbytes <= stats.bytes_moved < 3 * logits.nbytes
    rx.reset_fusion_stats()
    loss.backward()
    assert rx.fusion_stats().kernels_launched == 1  # the backward only scales the saved gradient, in place
    ref = logits.clone().requires_grad_()
    opts = {key: v for key, v in kw.items() if key != "z_loss"}
    want = F.cross_entropy(ref, target, **opts)
    if kw.get("z_loss"):
        valid = target != -100
        want = want + (kw["z_loss"] * ref.logsumexp(-1) ** 2 * valid).sum() / valid.sum()
    want.backward()
    assert_close(loss, want.detach(), 1e-5, 1e-5, "loss")
    assert_close(a.grad, ref.grad, 1e-5, 1e-5, "gradient")


def test_cross_entropy_grad_in_forward_bad_input():
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
    assert timed  # the count was tuned; the loss kernel (its gradient in place) and the scaling were not


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_z_loss_with_class_weights_is_unweighted_over_tokens(reduction, gen):
    """PaLM's / Liger's z-loss: ``z * lse**2`` per non-ignored token, unweighted, its mean over the
    tokens (not over the target classes' weights, which only the cross-entropy term uses)."""
    logits = torch.randn(7, 13, generator=gen, dtype=torch.float64)
    target = torch.randint(0, 13, (7,), generator=gen)
    target[2] = -100
    weight = torch.rand(13, generator=gen, dtype=torch.float64)
    valid = target != -100
    zl = torch.where(valid, 0.1 * torch.logsumexp(logits, 1) ** 2, 0)
    z = {"mean": zl.sum() / valid.sum(), "sum": zl.sum(), "none": zl}[reduction]
    want = F.cross_entropy(logits, target, weight, reduction=reduction) + z
    got = rx.compile(rx.cross_entropy(x, t, w, reduction=reduction, z_loss=0.1))(x=logits, t=target, w=weight)
    assert_close(got, want, 1e-12, 1e-12, reduction)


def test_cross_entropy_grad_in_forward_where_it_cannot_apply_says_so():
    with pytest.warns(UserWarning, match="computed in the kernel"):
        rx.compile(rx.cross_entropy(rx.tanh(x / 30.0) * 30.0, t, grad_in_forward=True))  # softcapped logits
    with pytest.warns(UserWarning, match="other outputs"):
        rx.compile({"loss": rx.cross_entropy(x, t, grad_in_forward=True), "lse": rx.logsumexp(x, -1)})


FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@pytest.mark.parametrize("logits_dtype", FLOATS)
@pytest.mark.parametrize("target_kind", ["indices", *FLOATS])  # class indices, or probabilities of a dtype
def test_cross_entropy_accepts_the_dtypes_torch_accepts_with_its_result_dtype(logits_dtype, target_kind):
    """torch's rule, on CPU and CUDA alike: class-index targets take a weight of the logits' own dtype
    (bf16 logits with an fp32 weight raise: "expected scalar type BFloat16 but found Float"; cast the
    weight, as Liger's own tests do on the torch side); class probabilities promote with the logits
    and any weight, integer ones included."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, generator=gen).to(logits_dtype)
    if target_kind == "indices":
        target = torch.tensor([0, 3, -100])
    else:
        target = torch.softmax(torch.randn(3, 4, generator=gen), -1).to(target_kind)
    for weight_dtype in (None, *FLOATS, torch.int64):
        weight = None if weight_dtype is None else (torch.rand(4, generator=gen) * 3).to(weight_dtype)
        for smoothing in (0.0, 0.1):
            k = rx.compile(rx.cross_entropy(x, t, None if weight is None else w, label_smoothing=smoothing))
            feed = {"x": logits, "t": target} | ({} if weight is None else {"w": weight})
            case = f"weight {weight_dtype}, smoothing {smoothing}"
            try:
                want = F.cross_entropy(logits, target, weight, label_smoothing=smoothing)
            except RuntimeError:
                with pytest.raises(rx.DtypeMismatchError, match=f"cross_entropy: weight is {weight_dtype}; it must"):
                    k(**feed)
                continue
            got = k(**feed)
            assert got.dtype == want.dtype, case
            dtypes = [d for d in (logits_dtype, target.dtype, weight_dtype) if d is not None and d.is_floating_point]
            tol = 1e-2 if min(torch.finfo(d).bits for d in dtypes) <= 16 else 1e-5  # torch rounds the smoothed target
            assert_close(got, want.double(), tol, tol, case)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("index", [2, -100])  # a class; ignored (mean: 0 / 0 = NaN, as torch)
def test_cross_entropy_of_unbatched_logits(reduction, index, gen):
    logits = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.rand(5, generator=gen, dtype=torch.float64)
    target = torch.tensor(index)
    for kw in ({}, {"label_smoothing": 0.1}):
        got = rx.compile(rx.cross_entropy(x, t, w, reduction=reduction, **kw))(x=logits, t=target, w=weight)
        want = F.cross_entropy(logits, target, weight, reduction=reduction, **kw)
        torch.testing.assert_close(got, want, equal_nan=True)  # ignored, mean: NaN, with a gradient of 0
        torch.testing.assert_close(torch.autograd.grad(got, logits)[0], torch.autograd.grad(want, logits)[0])


def _errors_against_float64(fn_ours, fn_torch, inputs, cot):
    """Max error of our bf16 results and of torch's bf16 eager ones against float64 on the same
    bf16 inputs: (ours, torch's), per output and input gradient."""

    def run(fn, dtype):
        ins = [t.to(dtype).clone().requires_grad_() for t in inputs]
        out = fn(*ins)
        out.backward(cot.to(dtype) if cot is not None else None)
        return [out, *(t.grad for t in ins)]

    ref, torch_bf16, ours = run(fn_torch, torch.float64), run(fn_torch, torch.bfloat16), run(fn_ours, torch.bfloat16)
    err = lambda got: [(g.double() - r).abs().max().item() for g, r in zip(got, ref)]  # noqa: E731
    return err(ours), err(torch_bf16)


@pytest.mark.parametrize(
    "case",
    ["cross_entropy_3x32000", "geglu_tanh_64x1024"],  # the reported shapes (issue 22 item 9)
)
def test_bf16_results_and_gradients_are_no_less_accurate_than_torch(case):
    gen = torch.Generator().manual_seed(0)
    if case.startswith("cross_entropy"):
        logits = (torch.randn(3, 32000, generator=gen) * 2).bfloat16()
        target = torch.randint(0, 32000, (3,), generator=gen)
        k = rx.compile(rx.cross_entropy(x, t))
        ours, theirs = _errors_against_float64(
            lambda a: k(x=a, t=target), lambda a: F.cross_entropy(a, target), [logits], None
        )
    else:
        g, u = (torch.randn(64, 1024, generator=gen) * 2).bfloat16(), torch.randn(64, 1024, generator=gen).bfloat16()
        k = rx.compile(rx.geglu(x, w, "tanh"))
        ours, theirs = _errors_against_float64(
            lambda a, b: k(x=a, w=b), lambda a, b: F.gelu(a, approximate="tanh") * b, [g, u],
            torch.randn(64, 1024, generator=gen).bfloat16(),
        )  # fmt: skip
    for o, th in zip(ours, theirs):  # rounded once, at the store: at most torch's error (plus an ulp's slack)
        assert o <= th * 1.05 + 1e-6, (ours, theirs)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(7, 5), (2, 5, 3)])  # [N, C] and [N, C, d] (class axis 1)
def test_cross_entropy_outputs_z_loss_and_token_accuracy_in_one_kernel(reduction, shape, gen):
    """Liger's extra outputs: the z-loss term and the token accuracy (argmax == target, ties to
    the first index as torch.argmax, ignored tokens excluded), beside the loss, one kernel."""
    logits = torch.randn(shape, generator=gen, dtype=torch.float64)
    target = torch.randint(0, 5, shape[:1] + shape[2:], generator=gen)
    flat_t = target.view(-1)
    flat_t[0] = -100  # an ignored token
    if len(shape) == 2:
        logits[1] = torch.tensor([1.0, 3.0, 3.0, 0.0, 0.0])  # a tie: argmax is class 1
        target[1] = 2  # a tied class that is not the first: a miss, as in torch
        target[2] = logits[2].argmax()  # a hit
    outs = rx.compile(rx.cross_entropy_outputs(x, t, reduction=reduction, z_loss=0.01))
    rx.reset_fusion_stats()
    got = outs(x=logits, t=target)
    assert rx.fusion_stats().kernels_launched == 1
    valid = target != -100
    zl = torch.where(valid, 0.01 * torch.logsumexp(logits, 1) ** 2, 0)
    acc = torch.where(valid, (logits.argmax(1) == target).double(), 0)
    red = {"none": lambda v: v, "sum": lambda v: v.sum(), "mean": lambda v: v.sum() / valid.sum()}[reduction]
    assert_close(got["z_loss"], red(zl), 1e-12, 1e-12, "z_loss")
    assert_close(got["accuracy"], red(acc), 0, 0, "accuracy")
    assert_close(got["loss"], F.cross_entropy(logits, target, reduction=reduction) + red(zl), 1e-12, 1e-12, "loss")


def test_cross_entropy_loss_module_returns_liger_extra_outputs(gen):
    logits = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    target = torch.tensor([0, 1, -100, 3, 4, 2])
    valid = target != -100
    zl = 0.01 * (torch.logsumexp(logits, 1)[valid] ** 2).mean()
    acc = (logits.argmax(1) == target)[valid].double().mean()
    loss, z, a = rx.nn.CrossEntropyLoss(z_loss=0.01, return_z_loss=True, return_token_accuracy=True)(logits, target)
    assert_close(loss, F.cross_entropy(logits, target) + zl, 1e-12, 1e-12)
    assert_close(z, zl, 1e-12, 1e-12)
    assert_close(a, acc, 0, 0)
    only_acc = rx.nn.CrossEntropyLoss(return_token_accuracy=True)(logits, target)
    assert len(only_acc) == 2 and torch.equal(only_acc[1], a)
    assert_close(rx.nn.CrossEntropyLoss(z_loss=0.01)(logits, target), loss, 1e-12, 1e-12)  # a tensor, as torch's


# ---- a mean over no counted row: a padding-only micro-batch -------------------------------------------
ALL_IGNORED = [  # (options, class weights): each branch of the mean's denominator
    ({}, False),
    ({"label_smoothing": 0.1}, False),
    ({"z_loss": 0.01}, False),  # its own mean over the tokens
    ({}, True),  # the weight of the counted targets
    ({"label_smoothing": 0.2, "z_loss": 0.01}, True),
    ({"grad_in_forward": True}, False),  # the gradient written in the forward, over the same denominator
]


def _eager_grads(loss, inputs):
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize(("kw", "weighted"), ALL_IGNORED)
@pytest.mark.parametrize("shape", [(3, 5), (2, 5, 3)])  # [N, C] and [N, C, d]
def test_mean_cross_entropy_of_only_ignored_rows_is_eagers_nan_with_eagers_zero_gradient(kw, weighted, shape, gen):
    """torch: the value is 0 / 0 = NaN, the gradient 0 (no row counts, so none gets any); a NaN
    gradient would poison the weights through one padding-only micro-batch."""
    logits = torch.randn(shape, generator=gen, dtype=torch.float64)
    target = torch.full(shape[:1] + shape[2:], -100)
    weight = torch.rand(5, generator=gen, dtype=torch.float64)
    opts = {k: v for k, v in kw.items() if k != "grad_in_forward"}
    ref_x = logits.clone().requires_grad_()
    want = _ce_ref(ref_x, target, *([weight] if weighted else []), **({"ignore_index": -100, "reduction": "mean",
                   "label_smoothing": 0.0, "z_loss": 0.0} | opts))  # fmt: skip
    assert want.isnan() and torch.equal(_eager_grads(want, ref_x)[0], torch.zeros(shape, dtype=torch.float64))
    ours = logits.clone().requires_grad_()
    feed = {"x": ours * 1 if kw.get("grad_in_forward") else ours, "t": target} | ({"w": weight} if weighted else {})
    got = rx.compile(rx.cross_entropy(x, t, w if weighted else None, **kw))(**feed)
    assert got.isnan()
    assert torch.equal(torch.autograd.grad(got, ours)[0], torch.zeros(shape, dtype=torch.float64))


def test_mean_cross_entropy_whose_counted_rows_weigh_nothing_keeps_eagers_nan_gradient(gen):
    """The other 0 / 0: rows that count but whose classes weigh 0. torch's gradient is NaN on those
    rows and 0 on the ignored one; so is ours (only the ignored rows' gradient is masked)."""
    logits = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    target, weight = torch.tensor([0, 0, -100]), torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    ref_x, ours = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    want = F.cross_entropy(ref_x, target, weight)
    got = rx.compile(rx.cross_entropy(x, t, w))(x=ours, t=target, w=weight)
    torch.testing.assert_close(got, want, equal_nan=True)
    torch.testing.assert_close(torch.autograd.grad(got, ours)[0], _eager_grads(want, ref_x)[0], equal_nan=True)


def test_only_ignored_rows_through_the_module_the_lazy_stream_and_linear_cross_entropy(gen):
    """The same value and gradient from every front end that reaches the loss, and from the fused
    linear cross-entropy (its one kernel, its two gradient GEMMs recomputing the logits)."""
    logits = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    target, weight = torch.full((4,), -100), torch.rand(9, generator=gen, dtype=torch.float64)
    zeros = torch.zeros(4, 9, dtype=torch.float64)
    for module in (rx.nn.CrossEntropyLoss(), rx.nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)):
        ours = logits.clone().requires_grad_()
        loss = module(ours, target)
        assert loss.isnan() and torch.equal(torch.autograd.grad(loss, ours)[0], zeros)
    f, ours = rx.Fusion(), logits.clone().requires_grad_()
    loss = F.cross_entropy(f.lazy(ours), f.lazy(target)).torch()
    assert loss.isnan() and torch.equal(torch.autograd.grad(loss, ours)[0], zeros)

    h, v, b = (torch.randn(s, generator=gen, dtype=torch.float64) for s in ((4, 6), (9, 6), (9,)))
    hidden = rx.var("h")
    for kw, weighted in (({}, True), ({"label_smoothing": 0.1, "z_loss": 0.01, "softcap": 30.0}, False),
                         ({"grad_in_forward": True}, False)):  # fmt: skip
        e = rx.linear_cross_entropy(hidden, w, t, rx.var("b"), rx.var("c") if weighted else None, **kw)
        ins = [z.clone().requires_grad_() for z in (h, v, b)]
        feed = {"h": ins[0] * 1 if kw.get("grad_in_forward") else ins[0], "w": ins[1], "t": target, "b": ins[2]}
        feed |= {"c": weight} if weighted else {}
        k = rx.compile(e)
        assert k.program(**feed).kernels_launched == 1, kw  # fused: no logits written
        loss = k(**feed)
        eager = [z.clone().requires_grad_() for z in (h, v, b)]
        want = F.cross_entropy(F.linear(*eager), target, weight if weighted else None)
        assert loss.isnan() and want.isnan(), kw
        for got, ref in zip(torch.autograd.grad(loss, ins), _eager_grads(want, eager)):
            assert torch.equal(got, torch.zeros_like(got)) and torch.equal(ref, torch.zeros_like(ref)), kw


@pytest.mark.parametrize("shape", [(3, 5), (2, 5, 3)])  # [N, C] and [N, C, d]
def test_z_loss_and_token_accuracy_over_only_ignored_tokens_are_ligers(shape, gen):
    """Liger's cross-entropy over a padding-only micro-batch: its z-loss is the sum of per-token
    terms that are all 0, so 0 (and its gradient 0, not the 0 / 0 = NaN of a mean); its token
    accuracy is ``sum(hits) / n_non_ignore`` = 0 / 0 = NaN (a metric: nothing was measured, no
    gradient). The loss itself stays torch's NaN."""
    logits = torch.randn(shape, generator=gen, dtype=torch.float64)
    target = torch.full(shape[:1] + shape[2:], -100)
    ours = logits.clone().requires_grad_()
    z = rx.compile(rx.z_loss_term(x, t, 0.01))(x=ours, t=target)
    assert z.item() == 0.0
    (grad,) = torch.autograd.grad(z, ours, torch.tensor(float("inf"), dtype=torch.float64))
    assert torch.equal(grad, torch.zeros(shape, dtype=torch.float64))  # even for an inf cotangent
    assert rx.compile(rx.token_accuracy(x, t))(x=logits, t=target).isnan()
    assert rx.compile(rx.token_accuracy(x, t, reduction="sum"))(x=logits, t=target).item() == 0.0
    outs = rx.compile(rx.cross_entropy_outputs(x, t, z_loss=0.01))(x=ours, t=target)
    assert outs["loss"].isnan() and outs["z_loss"].item() == 0.0 and outs["accuracy"].isnan()
    (grad,) = torch.autograd.grad(outs["z_loss"], ours)
    assert torch.equal(grad, torch.zeros(shape, dtype=torch.float64))
    if len(shape) == 2:  # the module: Liger's tuple
        loss, zl, acc = rx.nn.CrossEntropyLoss(z_loss=0.01, return_z_loss=True, return_token_accuracy=True)(
            logits, target
        )
        assert loss.isnan() and zl.item() == 0.0 and acc.isnan()


def test_where_passes_no_gradient_to_the_branch_it_did_not_take_even_an_infinite_one():
    """torch's where backward is ``where(cond, grad, 0)``: exactly 0 for the other branch, even where
    the incoming gradient is inf or NaN (a mean over nothing sends 1 / 0 down to its masked rows)."""
    a = torch.tensor([1.0, 3.0, -2.0], requires_grad=True)
    c = torch.tensor([2.0, 2.0, 2.0], requires_grad=True)
    cot = torch.tensor([float("inf"), float("nan"), 1.0])
    want = torch.autograd.grad(torch.where(a > 2, a, c * 2), (a, c), cot)
    got = torch.autograd.grad(rx.compile(rx.where(x > 2, x, w * 2))(x=a, w=c), (a, c), cot)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, equal_nan=True)
