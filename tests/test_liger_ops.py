"""Liger-Kernel's op set, declared once in the op table: KL divergence, generalized JSD, total
variation distance, DyT, ReLU², PolyNorm — each against a float64 torch reference written from
its definition, gradchecked, counted, and as an ``rx.nn`` module."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import FLOAT_TOLERANCES, assert_close

import rtxdsl as rx

x, a, b, lbl = rx.var("x"), rx.var("a"), rx.var("b"), rx.var("l")
ROWS, V = 7, 13  # odd rows and classes


def _gradcheck(fn, inputs):
    """torch's gradcheck in fast mode (a random projection of the Jacobian, a few kernel runs):
    the full Jacobian of a coordinate kernel costs minutes under the interpreter."""
    return torch.autograd.gradcheck(fn, inputs, fast_mode=True)


def _dists(gen, dtype=torch.float64):
    q = torch.randn(ROWS, V, generator=gen, dtype=torch.float64).log_softmax(-1).to(dtype)
    p = torch.randn(ROWS, V, generator=gen, dtype=torch.float64).log_softmax(-1).to(dtype)
    return q, p


def _label(kind):
    label = torch.tensor([1, -100, 3, 4, -100, 0, 2])  # two ignored rows
    return {"none": None, "some": label, "all": torch.full((ROWS,), -100)}[kind]


# ---- KL divergence ----------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["none", "sum", "mean", "batchmean"])
@pytest.mark.parametrize("log_target", [False, True])
def test_kl_div_matches_torch_and_is_one_kernel(reduction, log_target, gen):
    q, p = _dists(gen)
    target = p if log_target else p.exp()
    if not log_target:
        target[0, 0] = 0.0  # a zero probability: 0 * log 0 is 0, as torch's xlogy
    k = rx.compile(rx.kl_div(x, a, reduction, log_target))
    assert_close(k(x=q, a=target), F.kl_div(q, target, reduction=reduction, log_target=log_target), 1e-12, 1e-12)
    rx.reset_fusion_stats()
    k(x=q, a=target)
    assert rx.fusion_stats().kernels_launched == 1
    qg = q.clone().requires_grad_()
    assert _gradcheck(lambda t: k(x=t, a=target), (qg,))
    f = rx.Fusion()  # recorded by the lazy stream
    got = F.kl_div(f.lazy(q), target, reduction=reduction, log_target=log_target)
    assert got.is_pending
    assert_close(got.torch(), F.kl_div(q, target, reduction=reduction, log_target=log_target), 1e-12, 1e-12)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOAT_TOLERANCES)
def test_kl_div_loss_module(dtype, atol, rtol, gen):
    q, p = _dists(gen, dtype)
    for red in ("batchmean", "sum"):
        got = rx.nn.KLDivLoss(reduction=red, log_target=True)(q, p)
        want = F.kl_div(q.double(), p.double(), reduction=red, log_target=True)
        assert_close(got, want, atol, rtol, red)


# ---- JSD --------------------------------------------------------------------------------------------
def _jsd_reference(log_q, log_p, beta, label=None, ignore_index=-100):
    """Liger's test reference: beta * KL(P || M) + (1 - beta) * KL(Q || M), batchmean over rows."""
    p, q = log_p.exp(), log_q.exp()
    if beta == 0.0:
        rows = (p * (log_p - log_q)).sum(-1)
    elif beta == 1.0:
        rows = (q * (log_q - log_p)).sum(-1)
    else:
        log_m = torch.log(beta * p + (1 - beta) * q)
        rows = beta * (p * (log_p - log_m)).sum(-1) + (1 - beta) * (q * (log_q - log_m)).sum(-1)
    if label is None:
        return rows.mean()
    keep = label != ignore_index
    if not keep.any():  # Liger's kernel: every row ignored, the loss is 0 (not 0 / 0)
        return (rows * keep).sum()
    return (rows * keep).sum() / keep.sum()


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])  # 0 and 1: the KL ends
@pytest.mark.parametrize("labels", ["none", "some", "all"])  # all ignored: 0 and a gradient of 0, as Liger
def test_jsd_matches_the_reference_gradchecks_and_is_symmetric(beta, labels, gen):
    q, p = _dists(gen)
    label = _label(labels)
    e = rx.jsd(x, a, None if label is None else lbl, beta=beta)
    ins = {"x": q, "a": p} | ({"l": label} if label is not None else {})
    k = rx.compile(e)
    assert_close(k(**ins), _jsd_reference(q, p, beta, label), 1e-12, 1e-12, f"beta={beta}")
    qg = q.clone().requires_grad_()
    assert _gradcheck(lambda t: k(**(ins | {"x": t})), (qg,))
    if beta == 0.5:  # symmetric at 1/2
        assert_close(k(**(ins | {"x": p, "a": q})), k(**ins), 1e-12, 1e-12, "symmetry")
    if labels == "all":  # a padding-only micro-batch: no NaN reaches the weights (the loss, the gradient)
        loss = k(**(ins | {"x": qg}))
        assert loss.item() == 0.0
        assert torch.equal(torch.autograd.grad(loss, qg)[0], torch.zeros_like(q))
        assert rx.nn.JSD(beta=beta)(q, p, label).item() == 0.0


def test_jsd_module_and_bad_input(gen):
    q, p = _dists(gen, torch.float32)
    label = _label("some")
    assert_close(rx.nn.JSD(beta=0.1)(q, p, label), _jsd_reference(q.double(), p.double(), 0.1, label), 1e-5, 1e-5)
    with pytest.raises(rx.RtxError, match=r"jsd: beta must be in \[0, 1\]"):
        rx.jsd(x, a, beta=1.5)
    with pytest.raises(rx.RtxError, match="label must be int32 or int64"):
        rx.compile(rx.jsd(x, a, lbl))(x=q, a=p, l=label.float())
    with pytest.raises(rx.ShapeError, match=r"label has shape \[3\]; expected \[7\]"):
        rx.compile(rx.jsd(x, a, lbl))(x=q, a=p, l=label[:3])


# ---- TVD --------------------------------------------------------------------------------------------
def _tvd_reference(p, q, reduction, label=None, ignore_index=-100):
    """Liger's test reference."""
    tvd = (p - q).abs() / 2.0
    n = p.size(0)
    if label is not None:
        tvd = torch.where(label.unsqueeze(1) != ignore_index, tvd, torch.zeros_like(tvd))
        n = int((label != ignore_index).sum())
        if n == 0 and reduction in ("mean", "batchmean"):
            return tvd.sum() * 0
    return {"mean": lambda: tvd.sum() / (n * p.size(1)), "sum": tvd.sum, "none": lambda: tvd,
            "batchmean": lambda: tvd.sum() / n}[reduction]()  # fmt: skip


@pytest.mark.parametrize("reduction", ["none", "sum", "mean", "batchmean"])
@pytest.mark.parametrize("labels", ["none", "some", "all"])  # all ignored: 0, as Liger
def test_tvd_matches_the_reference_and_gradchecks(reduction, labels, gen):
    q, p = _dists(gen)
    x_in, target = q.exp() + torch.randn(ROWS, V, generator=gen, dtype=torch.float64) * 0.1, p.exp()
    label = _label(labels)
    e = rx.tvd(x, a, None if label is None else lbl, reduction=reduction)
    ins = {"x": x_in, "a": target} | ({"l": label} if label is not None else {})
    k = rx.compile(e)
    assert_close(k(**ins), _tvd_reference(x_in, target, reduction, label), 1e-12, 1e-12, reduction)
    xg = x_in.clone().requires_grad_()
    assert _gradcheck(lambda t: k(**(ins | {"x": t})), (xg,))
    assert_close(
        rx.nn.TVDLoss(reduction)(x_in, target, label), _tvd_reference(x_in, target, reduction, label), 1e-12, 1e-12
    )


# ---- DyT, ReLU², PolyNorm -----------------------------------------------------------------------------
@pytest.mark.parametrize("with_beta", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 1023), (3, 7, 33)])  # Liger's near-power-of-2 and prime shapes
def test_dyt(with_beta, shape, gen):
    xs = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    alpha = torch.randn(1, generator=gen, dtype=torch.float64, requires_grad=True)
    gamma = torch.randn(shape[-1], generator=gen, dtype=torch.float64, requires_grad=True)
    beta = torch.randn(shape[-1], generator=gen, dtype=torch.float64, requires_grad=True)
    k = rx.compile(rx.dyt(x, a, rx.var("g"), b if with_beta else None))
    ins = {"x": xs, "a": alpha, "g": gamma} | ({"b": beta} if with_beta else {})
    want = gamma * torch.tanh(alpha * xs) + (beta if with_beta else 0)
    assert_close(k(**ins), want, 1e-9, 1e-9)  # the kernels' tanh is accurate to ~1e-10 (fp32's needs)
    if shape[-1] < 100:
        assert _gradcheck(lambda *t: k(**dict(zip(ins, t))), tuple(ins.values()))
    m = rx.nn.DyT(shape[-1], beta=with_beta).double()
    assert_close(m(xs), m.gamma * torch.tanh(m.alpha * xs) + (m.beta if with_beta else 0), 1e-9, 1e-9)


def test_relu_squared(gen):
    xs = torch.randn(5, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    k = rx.compile(rx.relu_squared(x))
    assert_close(k(x=xs), torch.relu(xs) ** 2, 1e-12, 1e-12)
    assert _gradcheck(lambda t: k(x=t), (xs,))
    assert rx.relu2 is rx.relu_squared


@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOAT_TOLERANCES)
@pytest.mark.parametrize("shape", [(2, 2, 8), (9, 7, 41)])  # Liger's functional-test shapes
def test_poly_norm(dtype, atol, rtol, shape, gen):
    xs = torch.randn(shape, generator=gen, dtype=torch.float64)
    w = torch.tensor([0.3, 0.4, 0.3], dtype=torch.float64)
    bias = torch.tensor(0.1, dtype=torch.float64)

    def norm(u):
        return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-6)

    want = w[0] * norm(xs**3) + w[1] * norm(xs**2) + w[2] * norm(xs) + bias
    k = rx.compile(rx.poly_norm(x, rx.var("w"), b))
    rx.reset_fusion_stats()
    got = k(x=xs.to(dtype), w=w.to(dtype), b=bias.to(dtype))
    assert rx.fusion_stats().kernels_launched == 1 and got.dtype == dtype
    assert_close(got, want, atol * 10, rtol * 10)
    if dtype == torch.float64:
        args = tuple(t.clone().requires_grad_() for t in (xs, w, bias))
        assert _gradcheck(lambda *t: k(x=t[0], w=t[1], b=t[2]), args)
    m = rx.nn.PolyNorm().double()
    assert m(xs).shape == xs.shape


# ---- Qwen2-VL's multimodal RoPE ---------------------------------------------------------------------
@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOAT_TOLERANCES)
@pytest.mark.parametrize("sections", [(2, 2, 2), (1, 3, 2)])  # equal and unequal channel blocks
def test_mrope_matches_qwen2_vl_and_is_one_kernel(dtype, atol, rtol, sections, gen):
    B, H, T, D = 2, 3, 5, 2 * sum(sections)
    q = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)
    cos, sin = (torch.randn(3, B, T, D, generator=gen, dtype=torch.float64) for _ in range(2))

    def reference(x, c, s):  # Qwen2-VL's: block i of sections * 2 takes table i % 3, then rotate-half
        split = list(sections) * 2
        c = torch.cat([m[i % 3] for i, m in enumerate(c.split(split, dim=-1))], dim=-1).unsqueeze(1)
        s = torch.cat([m[i % 3] for i, m in enumerate(s.split(split, dim=-1))], dim=-1).unsqueeze(1)
        half = x.shape[-1] // 2
        return x * c + torch.cat((-x[..., half:], x[..., :half]), -1) * s

    k = rx.compile(rx.mrope(x, a, b, sections))
    rx.reset_fusion_stats()
    got = k(x=q.to(dtype), a=cos.to(dtype), b=sin.to(dtype))
    assert rx.fusion_stats().kernels_launched == 1  # the table selection is index arithmetic
    assert_close(got, reference(q, cos, sin), atol * 10, rtol * 10)
    if dtype == torch.float32:
        qg = q.clone().requires_grad_()
        assert _gradcheck(lambda t: k(x=t, a=cos, b=sin), (qg,))
    with pytest.raises(rx.ShapeError, match="2 \\* sum\\(sections\\)"):
        rx.compile(rx.mrope(x, a, b, (1, 1, 1)))(x=q, a=cos, b=sin)


# ---- group norm (and the reshape it reads through) ----------------------------------------------------
@pytest.mark.parametrize(
    ("shape", "groups"),
    [
        ((2, 6, 5), 3),
        ((3, 4, 2, 3), 2),
        ((2, 8), 4),
        ((1, 6, 7), 6),
        ((2, 6, 5), 1),
    ],  # [N, C, *] of ranks 2-4; G = C and 1
)
@pytest.mark.parametrize("affine", [True, False])
def test_group_norm(shape, groups, affine, gen):
    xs = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(shape[1], generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(shape[1], generator=gen, dtype=torch.float64, requires_grad=True)
    e = rx.group_norm(x, groups, rx.var("w") if affine else None, b if affine else None)
    k = rx.compile(e)
    ins = {"x": xs} | ({"w": w, "b": bias} if affine else {})
    want = F.group_norm(xs, groups, w if affine else None, bias if affine else None)
    assert_close(k(**ins), want, 1e-12, 1e-12)
    rx.reset_fusion_stats()
    k(**{n: t.detach() for n, t in ins.items()})
    # group statistics, then the output in x's layout (without a weight, the normalized groups
    # are the output's memory: their reshape to x's shape launches nothing)
    assert rx.fusion_stats().kernels_launched == (2 if affine else 1)
    assert _gradcheck(lambda *t: k(**dict(zip(ins, t))), tuple(ins.values()))
    f = rx.Fusion()
    got = F.group_norm(f.lazy(xs.detach()), groups, *((w.detach(), bias.detach()) if affine else ()))
    assert got.is_pending
    assert_close(got.torch(), want.detach(), 1e-12, 1e-12)
    m = rx.nn.GroupNorm(groups, shape[1], affine=affine).double()
    assert_close(m(xs), torch.nn.GroupNorm(groups, shape[1], affine=affine).double()(xs), 1e-12, 1e-12)


def test_group_norm_bad_input():
    with pytest.raises(rx.ShapeError, match="6 channels do not split into 4 groups"):
        rx.compile(rx.group_norm(x, 4))(x=torch.randn(2, 6, 5))
    with pytest.raises(rx.RtxError, match="num_groups must be a positive int"):
        rx.group_norm(x, 0)


@pytest.mark.parametrize("shape", [(6, 4), (4, -1), (24,), (3, 2, 4), (1, 24, 1)])  # -1; flat; more dims; size-1 dims
def test_reshape_reads_in_place_and_differentiates(shape, gen):
    xs = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = rx.compile(rx.softmax(rx.reshape(x, shape) * 2.0, -1))
    assert_close(k(x=xs), torch.softmax(xs.reshape(shape) * 2.0, -1), 1e-12, 1e-12)
    rx.reset_fusion_stats()
    k(x=xs.detach())
    assert rx.fusion_stats().kernels_launched == 1
    assert _gradcheck(lambda t: k(x=t), (xs,))
    with pytest.raises(rx.ShapeError, match="invalid for an input of 24 elements"):
        rx.compile(rx.reshape(x, (5, 5)))(x=xs)


# ---- sparsemax --------------------------------------------------------------------------------------
def _sparsemax_pairwise(z, dim):
    """The support test of the paper without a sort: element i is in the support iff
    1 + #{j: z_j >= z_i} * z_i > sum{z_j: z_j >= z_i}."""
    z = z.movedim(dim, -1)
    above = (z[..., None, :] >= z[..., :, None]).to(z.dtype)  # [..., i, j]: z_j >= z_i
    support = (1 + above.sum(-1) * z > (above * z[..., None, :]).sum(-1)).to(z.dtype)
    tau = ((support * z).sum(-1, keepdim=True) - 1) / support.sum(-1, keepdim=True)
    return torch.clamp(z - tau, min=0).movedim(-1, dim)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOAT_TOLERANCES)
@pytest.mark.parametrize(
    "shape, dim, scale, shift",
    [
        ((7, 13), -1, 1.0, 0.0),  # odd rows and columns
        ((2, 9, 5), 1, 3.0, 0.0),  # a middle axis: rows are strided
        ((3, 33), -1, 0.05, 0.0),  # close values: a wide support
        ((3, 33), -1, 1.0, 1000.0),  # large values: the bisection's bracket at fp32's resolution
        ((4, 1), -1, 1.0, 0.0),  # one column: all ones
        ((0, 9), -1, 1.0, 0.0),  # no rows
    ],
)
def test_sparsemax_matches_the_paper_and_is_one_kernel(dtype, atol, rtol, shape, dim, scale, shift, gen):
    xs = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + shift).to(dtype)
    if xs.numel():
        xs.view(-1)[1] = xs.view(-1)[0]  # a tie
    k = rx.compile(rx.sparsemax(x, dim=dim))
    rx.reset_fusion_stats()
    got = k(x=xs)
    assert rx.fusion_stats().kernels_launched == (1 if xs.numel() else 0)
    want = _sparsemax_pairwise(xs.double(), dim)
    # x - tau of values near ``shift`` is exact to fp32's resolution there (the compute dtype)
    assert_close(got, want, atol + 8 * shift * torch.finfo(torch.float32).eps, rtol)
    if xs.numel():
        assert_close(got.double().sum(dim), torch.ones(()).expand(got.sum(dim).shape), atol * 40, 0, "rows sum to 1")
    assert_close(rx.nn.Sparsemax(dim)(xs), got, 0, 0, "module")


def test_sparsemax_gradient(gen):
    xs = torch.randn(5, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    k = rx.compile(rx.sparsemax(x))
    assert _gradcheck(lambda t: k(x=t), (xs,))
    g = torch.randn(5, 11, generator=gen, dtype=torch.float64)
    rx.reset_fusion_stats()
    out = k(x=xs)  # the saving forward: its statistics are the composite's own nodes, one op, one kernel
    assert rx.fusion_stats().kernels_launched == 1
    (dx,) = torch.autograd.grad(out, xs, g)
    mask = (_sparsemax_pairwise(xs.detach(), -1) > 0).double()  # the closed form: mask * (g - mean over the support)
    want = mask * (g - (g * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True))
    assert_close(dx, want, 1e-12, 1e-12)


# ---- residual add + RMSNorm, and RMSNorm in place ----------------------------------------------------
@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOAT_TOLERANCES)
def test_add_rms_norm_module_matches_torch_in_one_kernel(dtype, atol, rtol, gen):
    h, r = (torch.randn(3, 5, 33, generator=gen, dtype=torch.float64) for _ in range(2))
    m = rx.nn.AddRMSNorm(33, eps=1e-6, offset=1.0).to(dtype)
    with torch.no_grad():
        m.weight.copy_(torch.randn(33, generator=gen))
    hs, rs = h.to(dtype).requires_grad_(), r.to(dtype).requires_grad_()
    rx.reset_fusion_stats()
    out, res = m(hs, rs)
    assert rx.fusion_stats().kernels_launched == 1
    hd, rd, wd = (t.detach().double().requires_grad_() for t in (hs, rs, m.weight))
    s = hd + rd
    want = F.rms_norm(s, (33,), 1 + wd, 1e-6)
    assert_close(res, s, atol, rtol, "residual")
    assert_close(out, want, atol * 4, rtol * 4, "out")
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out.double() * g).sum().backward()
    (want * g).sum().backward()
    assert_close(hs.grad, hd.grad, atol * 8, rtol * 8, "d hidden")
    assert_close(m.weight.grad, wd.grad, atol * 40, rtol * 8, "d weight")


@pytest.mark.parametrize(
    "width, layout",
    [
        (33, "contiguous"),  # written in place by the kernel
        (5001, "contiguous"),  # a looped row: the sum is stored in the first pass, copied in after
        (33, "transposed"),  # not contiguous: computed apart, copied in
    ],
)
def test_add_rms_norm_in_place(width, layout, gen):
    h, r = (torch.randn(7, width, generator=gen) for _ in range(2))
    w = torch.randn(width, generator=gen)
    if layout == "transposed":
        h, r = h.t().contiguous().t(), r.t().contiguous().t()
    s = h + r
    want = F.rms_norm(s, (width,), w, None)  # eps=None: float32's, as torch
    ptr, v = h.data_ptr(), h._version
    out, res = rx.nn.add_rms_norm_(h, r, w)
    assert out is h and res is r and h.data_ptr() == ptr and h._version > v
    torch.testing.assert_close(r, s, atol=0, rtol=0)
    torch.testing.assert_close(h, want)
    x0 = torch.randn(7, width, generator=gen)
    x1 = x0.clone()
    assert rx.nn.rms_norm_(x1, w, 1e-5) is x1
    torch.testing.assert_close(x1, F.rms_norm(x0, (width,), w, 1e-5))
    m = rx.nn.AddRMSNorm(width, in_place=True)
    a, b = torch.randn(2, width, generator=gen), torch.randn(2, width, generator=gen)
    with torch.no_grad():
        got = m(a, b)
    assert got[0] is a and got[1] is b


def test_in_place_rms_norm_refuses_autograd_and_aliasing():
    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(rx.RtxError, match="'x' requires grad"):
        rx.nn.rms_norm_(x)
    y = torch.randn(3, 8)
    with pytest.raises(rx.RtxError, match="share memory"):
        rx.nn.add_rms_norm_(y, y)
    with pytest.raises(rx.RtxError, match="x's shape and dtype"):
        rx.nn.add_rms_norm_(y, torch.randn(3, 8, dtype=torch.float64))
