"""Random expression trees (hypothesis) against the float64 torch reference."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rtxdsl as rx

UNARY = [
    rx.relu,
    rx.sigmoid,
    rx.tanh,
    rx.sin,
    rx.cos,
    rx.abs,
    rx.neg,
    lambda e: rx.gelu(e),
    lambda e: rx.exp(rx.clamp(e, -4.0, 4.0)),
    lambda e: rx.softmax(e),
    lambda e: rx.sum(e, -1, keepdim=True),
    lambda e: rx.amax(e, -1, keepdim=True),
    lambda e: e - rx.mean(e, -1, keepdim=True),
]
BINARY = [
    lambda a, b: a + b,
    lambda a, b: a - b,
    lambda a, b: a * b,
    rx.maximum,
    rx.minimum,
    lambda a, b: rx.where(a > b, a, b * 0.5),
]
VARS = {"x": (5, 7), "y": (7,), "z": (5, 1)}


def trees():
    leaves = st.one_of(
        st.sampled_from(list(VARS)).map(rx.var), st.floats(-3, 3, allow_nan=False, width=32).map(rx.const)
    )

    def extend(children):
        return st.one_of(
            st.tuples(st.sampled_from(UNARY), children).map(lambda p: p[0](p[1])),
            st.tuples(st.sampled_from(BINARY), children, children).map(lambda p: p[0](p[1], p[2])),
        )

    return st.recursive(leaves, extend, max_leaves=8).filter(lambda e: e.op not in ("const",))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(expr=trees(), seed=st.integers(0, 2**16))
def test_random_trees_match_torch(expr, seed):
    gen = torch.Generator().manual_seed(seed)
    k = rx.compile(expr)
    ins = {n: torch.randn(VARS[n], generator=gen) for n in k.inputs}
    if not ins:
        return
    ref = rx.compile(expr, config=rx.FusionConfig(backend="torch"))(**{n: t.double() for n, t in ins.items()})
    out = k(**ins)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4, equal_nan=True, msg=lambda m: f"{expr!r}: {m}")
