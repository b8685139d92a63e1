"""Philox random numbers and dropout: statistics, reproducibility, and a backward that
regenerates the mask instead of storing it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import rtxdsl as rx

x = rx.var("x")
N = (61, 67)  # 4087 elements: odd on both axes


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def test_rand_like_is_uniform_and_seeded():
    t = torch.empty(N)
    k = rx.compile(rx.rand_like(x, seed=123))
    u = k(x=t)
    assert u.dtype == torch.float32 and u.shape == N
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    n = u.numel()
    assert abs(float(u.mean()) - 0.5) < 4 * math.sqrt(1 / 12 / n)  # within 4 sigma
    assert torch.equal(u, k(x=t))  # the same seed: the same numbers
    other = rx.compile(rx.rand_like(x, seed=124))(x=t)
    assert abs(_corr(u, other)) < 4 / math.sqrt(n)


def test_fresh_seed_per_call_follows_torch_manual_seed():
    t = torch.empty(N)
    k = rx.compile(rx.rand_like(x))
    torch.manual_seed(0)
    a, b = k(x=t), k(x=t)
    torch.manual_seed(0)
    assert torch.equal(k(x=t), a)  # reproducible from torch's generator
    n = a.numel()
    assert abs(_corr(a, b)) < 4 / math.sqrt(n)  # consecutive calls: uncorrelated
    assert abs(_corr(a[:, 1:], a[:, :-1])) < 4 / math.sqrt(n)  # neighbours along a row
    assert abs(_corr(a[1:], a[:-1])) < 4 / math.sqrt(n)  # neighbours along a column
    assert k.inputs == ("x",)  # the seed is drawn, not passed


def test_seeds_and_strides_are_arguments_not_constants():
    k = rx.compile(rx.rand_like(x))
    before = rx.cache_stats().compiles
    for shape in ((5, 7), (9, 3), (5, 7)):
        k(x=torch.empty(shape))
    assert rx.cache_stats().compiles - before <= 1


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dropout_keep_rate_scale_and_backward(p, dtype):
    t = (torch.rand(N, dtype=torch.float64) + 0.5).to(dtype)  # no zeros: a zero output means dropped
    k = rx.compile(rx.dropout(x, p))
    xt = t.clone().requires_grad_()
    out = k(x=xt)
    kept = out != 0
    n = t.numel()
    rate = float(kept.double().mean())
    assert abs(rate - (1 - p)) < 4 * math.sqrt(p * (1 - p) / n)
    want = (t.double() / (1 - p)).to(dtype)
    torch.testing.assert_close(out[kept], want[kept])
    g = torch.randn(N, dtype=torch.float64).to(dtype)
    out.backward(g)
    # the backward regenerated the same mask from the same seed
    torch.testing.assert_close(xt.grad, torch.where(kept, (g.double() / (1 - p)), 0).to(dtype))


def test_dropout_identity_cases_and_bad_p():
    assert rx.dropout(x, 0.3, training=False) is x
    assert rx.dropout(x, 0.0) is x
    assert rx.dropout(x, 1.0, training=False) is x  # torch: identity when not training, any p
    for bad in (-0.1, 2, 1.5):
        with pytest.raises(rx.RtxError, match=r"dropout: p must be in \[0, 1\]"):
            rx.dropout(x, bad)
    t = torch.tensor([1.0, -2.0, float("nan"), float("inf")], requires_grad=True)
    out = rx.compile(rx.dropout(x, 1.0))(x=t)  # p = 1: input * 0, as torch (NaN and inf give NaN)
    torch.testing.assert_close(out, F.dropout(t.detach(), 1.0), equal_nan=True)
    out.sum().backward()
    assert t.grad.tolist() == [0.0] * 4
    f = rx.Fusion()
    torch.testing.assert_close(F.dropout(f.lazy(t.detach()), 1.0).torch(), F.dropout(t.detach(), 1.0), equal_nan=True)
    with pytest.raises(rx.RtxError, match="seed must be None or a non-negative int"):
        rx.rand_like(x, seed=1.5)
    with pytest.raises(rx.RtxError, match="rand_like: the shape operand must be floating point"):
        rx.compile(rx.rand_like(x, seed=1))(x=torch.zeros(3, dtype=torch.int32))


def test_lazy_dropout_is_fused_and_reproducible():
    t = torch.rand(8, 16) + 0.5
    f = rx.Fusion()
    torch.manual_seed(5)
    a = F.dropout(f.lazy(t) * 2, 0.5, training=True) + 1
    assert a.is_pending
    first = a.torch()
    torch.manual_seed(5)
    second = (F.dropout(f.lazy(t) * 2, 0.5, training=True) + 1).torch()
    assert torch.equal(first, second)
    assert f.stats().kernels_launched == 2  # one fused kernel per step


def test_fused_function_with_dropout_draws_its_seed():
    @rx.fuse
    def drop_add(a, b):
        return rx.dropout(a, 0.5) + b

    t = torch.ones(64)
    out = drop_add(t, t)
    assert set(out.unique().tolist()) == {1.0, 3.0}  # dropped: 0 + 1; kept: 1 / 0.5 + 1
