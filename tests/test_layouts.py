"""Broadcasting, strided inputs, empty and 0-dim tensors, NaN/inf: the layouts users pass."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import FLOAT_TOLERANCES, assert_close

import rtxdsl as rx

x, y, z = rx.var("x"), rx.var("y"), rx.var("z")
EXPR = rx.relu(x * y + 1.0) - z * 0.5


def ref(a, b, c):
    return torch.relu(a * b + 1.0) - c * 0.5


# (x shape, y shape, z shape): why each is there
BROADCASTS = [
    ((1023,), (1023,), (1023,)),  # same shape: flat path
    ((7, 33), (33,), (1,)),  # row vector and scalar-like operand
    ((5, 1, 9), (1, 4, 9), (9,)),  # both operands broadcast, different dims
    ((3, 4, 5, 6), (4, 1, 6), (3, 1, 1, 1)),  # rank 4 mixing every pattern
    ((), (7,), ()),  # 0-dim tensors against a vector
]


@pytest.mark.parametrize("dtype, atol, rtol", FLOAT_TOLERANCES)
@pytest.mark.parametrize("shapes", BROADCASTS, ids=str)
def test_broadcasting_across_ranks(shapes, dtype, atol, rtol, gen):
    a, b, c = (torch.randn(s, generator=gen).to(dtype) for s in shapes)
    out = rx.compile(EXPR)(x=a, y=b, z=c)
    assert_close(out, ref(a.double(), b.double(), c.double()), atol, rtol, str(shapes))


def _strided_cases(gen):
    base = torch.randn(40, 30, generator=gen)
    return {
        "transposed": (base.t(), torch.randn(30, 40, generator=gen), torch.randn(40, generator=gen)),
        "sliced_step2": (base[::2, 1::2], torch.randn(20, 15, generator=gen)[:, :], base[1::2, ::2]),
        "expanded_stride0": (torch.randn(1, 30, generator=gen).expand(40, 30), base, torch.randn(40, 1).expand(40, 30)),
        "permuted_3d": (
            torch.randn(4, 5, 6, generator=gen).permute(2, 0, 1),
            torch.randn(6, 4, 5, generator=gen),
            torch.randn(5, generator=gen),
        ),
    }


@pytest.mark.parametrize("case", ["transposed", "sliced_step2", "expanded_stride0", "permuted_3d"])
def test_strided_inputs_are_read_in_place(case, gen):
    a, b, c = _strided_cases(gen)[case]
    k = rx.compile(EXPR)
    out = k(x=a, y=b, z=c)
    assert_close(out, ref(a.double(), b.double(), c.double()), 1e-5, 1e-5, case)
    src = k.sources(x=a, y=b, z=c)[0]
    assert "_stride" in src and ".contiguous" not in src, "strided operands are indexed with strides, not copied"
    assert out.is_contiguous()


def test_contiguous_same_shape_takes_flat_path(gen):
    a, b, c = (torch.randn(1023, generator=gen) for _ in range(3))
    src = rx.compile(EXPR).sources(x=a, y=b, z=c)[0]
    assert "%" not in src and "//" not in src, "flat path has no index arithmetic"
    assert src.count("tl.load(") == 3 and src.count("tl.store(") == 1
    assert "x = tl.load(x_ptr + offs" in src  # the input's own name


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5)], ids=str)
def test_empty_tensors(shape):
    a = torch.empty(shape)
    rx.reset_fusion_stats()
    out = rx.compile(EXPR)(x=a, y=a, z=a)
    assert out.shape == shape
    assert rx.fusion_stats().kernels_launched == 0  # nothing to launch


def test_zero_dim_tensors():
    out = rx.compile(EXPR)(x=torch.tensor(2.0), y=torch.tensor(3.0), z=torch.tensor(4.0))
    assert out.shape == () and out.item() == pytest.approx(5.0)


def test_nan_and_inf_propagate_like_torch():
    vals = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, math.nan])
    other = torch.tensor([1.0, math.nan, 2.0, math.inf, -math.inf, math.nan, -2.0, math.nan])
    a, b = rx.var("a"), rx.var("b")
    exprs = {
        "max": rx.maximum(a, b),
        "min": rx.minimum(a, b),
        "relu": rx.relu(a),
        "add": a + b,
        "mul": a * b,
        "exp": rx.exp(a),
        "sigmoid": rx.sigmoid(a),
        "clamp": rx.clamp(a, -0.5, 0.5),
        "abs": abs(a),
        "where": rx.where(a > b, a, b),
    }
    refs = {
        "max": torch.maximum(vals, other),
        "min": torch.minimum(vals, other),
        "relu": torch.relu(vals),
        "add": vals + other,
        "mul": vals * other,
        "exp": vals.exp(),
        "sigmoid": vals.sigmoid(),
        "clamp": vals.clamp(-0.5, 0.5),
        "abs": vals.abs(),
        "where": torch.where(vals > other, vals, other),
    }
    out = rx.compile(exprs)(a=vals, b=other)
    for k, want in refs.items():
        assert_close(out[k], want, 1e-6, 1e-6, k)


def test_int64_offsets_when_an_extent_reaches_2_31():
    """The spec switches to int64 indexing from sizes alone (no 2**31-element tensor needed)."""
    from rtxdsl.codegen.module import kernel_source
    from rtxdsl.lower import Layout, lower

    k = rx.compile(rx.var("x") * 2.0)

    def source(n: int) -> tuple[bool, str]:
        spec = lower(k.expressions, k.variables, (Layout((n,), (1,), torch.float32),), rx.get_config()).kernels[0].spec
        return spec.big, kernel_source(spec, "k", "sig", "")

    big, src = source(2**31 + 5)
    assert big and "pid.to(tl.int64)" in src
    small, src = source(16)
    assert not small and "pid.to(tl.int64)" not in src
