"""The public contract of DESIGN section 3, as a user writes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rtxdsl as rx


def test_contract_example(gen):
    x, b = rx.var("x"), rx.var("b")
    e = rx.relu(x * b + 1.0)
    k = rx.compile(e)
    assert isinstance(k, rx.Kernel) and k.inputs == ("x", "b")
    tx, tb = torch.randn(7, 5, generator=gen), torch.randn(5, generator=gen)
    want = torch.relu(tx * tb + 1.0)
    assert torch.allclose(k(x=tx, b=tb), want)
    assert torch.allclose(k(tx, tb), want)  # positional follows k.inputs
    assert torch.allclose(k(tx, b=tb), want)
    ks = rx.compile({"y": e, "s": rx.sum(e, axis=-1)})
    out = ks(x=tx, b=tb)
    assert list(out) == ["y", "s"]
    assert torch.allclose(out["s"], want.sum(-1), atol=1e-5)
    text = k.explain(x=tx, b=tb)
    assert "group 0: Activation" in text  # relu makes the chain an Activation pattern
    assert "1 kernel launch" in text and "bytes moved" in text
    srcs = k.sources(x=tx, b=tb)
    assert len(srcs) == 1 and "@triton.jit" in srcs[0]


def test_declared_dtype_is_accepted():
    h = rx.var("x", dtype=torch.float16)
    assert rx.compile(h * 2)(x=torch.ones(3, dtype=torch.float16)).dtype == torch.float16


def test_fuse_decorator(gen):
    @rx.fuse
    def bias_gelu(x, b):
        return rx.gelu(x + b)

    tx, tb = torch.randn(4, 9, generator=gen), torch.randn(9, generator=gen)
    assert bias_gelu.inputs == ("x", "b") and bias_gelu.__name__ == "bias_gelu"
    assert torch.allclose(bias_gelu(tx, tb), F.gelu(tx + tb), atol=1e-6)
    assert torch.allclose(bias_gelu(b=tb, x=tx), F.gelu(tx + tb), atol=1e-6)

    @rx.fuse
    def swapped(b, x):  # positional order follows the signature, not first appearance
        return x - b

    assert torch.equal(swapped(torch.ones(2), torch.zeros(2)), -torch.ones(2))


def test_operators_and_methods_mirror_torch(gen):
    a, c = rx.var("a"), rx.var("c")
    t = torch.randn(5, 6, generator=gen)
    s = torch.randn(5, 6, generator=gen)
    exprs = {
        "ops": (a + c) * (a - c) / 2 - -a,
        "pow": abs(a) ** 2.5,
        "rpow": 2.0**a,
        "rsub": 1 - a,
        "rdiv": 1 / (a * a + 1),
        "exp": a.exp(),
        "sum": a.sum(-1, keepdim=True),
        "mean": a.mean(dim=0),
        "var": a.var(-1),
        "std": a.std(),
        "to": a.to(torch.float16),
        "max": a.max(-1),
        "amin": a.amin(0),
        "softmax": a.softmax(-1),
        "clamp": a.clamp(-0.5, 0.5),
        "where": a.where(a > 0, c),
        "cmp": (a > c) & (a < 1.0) | ~(c >= 0),
        "lse": a.logsumexp(-1),
        "sig": a.sigmoid().tanh().relu(),
    }
    refs = {
        "ops": (t + s) * (t - s) / 2 - -t,
        "pow": t.abs() ** 2.5,
        "rpow": 2.0**t,
        "rsub": 1 - t,
        "rdiv": 1 / (t * t + 1),
        "exp": t.exp(),
        "sum": t.sum(-1, keepdim=True),
        "mean": t.mean(dim=0),
        "var": t.var(-1),
        "std": t.std(),
        "to": t.to(torch.float16),
        "max": t.amax(-1),
        "amin": t.amin(0),
        "softmax": t.softmax(-1),
        "clamp": t.clamp(-0.5, 0.5),
        "where": t.where(t > 0, s),
        "cmp": (t > s) & (t < 1.0) | ~(s >= 0),
        "lse": t.logsumexp(-1),
        "sig": t.sigmoid().tanh().relu(),
    }
    out = rx.compile(exprs)(a=t, c=s)
    for k, want in refs.items():
        assert out[k].dtype == want.dtype, k
        torch.testing.assert_close(out[k], want, atol=2e-3 if k == "to" else 1e-5, rtol=1e-4, msg=k)


def test_expressions_are_interned_and_print_readably():
    x = rx.var("x")
    assert (x * 2 + 1) is (x * 2 + 1)
    assert repr(rx.relu(x * 2.0 + 1.0)) == "relu(x * 2.0 + 1.0)"
    assert repr((x + 1) * (x - 1)) == "(x + 1) * (x - 1)"
    assert repr(x - (x - 1)) == "x - (x - 1)"
    assert (x + 1) is not (x + 1.0)  # int and float constants differ


def test_const_and_output_of_a_bare_input():
    x = rx.var("x")
    t = torch.randn(4)
    out = rx.compile({"same": x, "c": rx.const(2) + x})(x=t)
    assert torch.equal(out["same"], t) and out["same"] is not t
    assert torch.equal(out["c"], t + 2)


@pytest.mark.parametrize("keys", [("a", "b"), ("a", "_s0")], ids=["plain", "a gradient's saved name"])
def test_one_expression_under_two_keys_gives_two_tensors(keys):
    """Two outputs that are one node are two tensors, as eager's two results: a write to one leaves
    the other, whatever the keys are called (only a gradient plan's forward returns its saved output
    as the very tensor, ``Kernel(shared=...)``)."""
    x = rx.var("x")
    out = rx.compile({k: x * 2.0 for k in keys})(x=torch.ones(3))
    out[keys[0]].add_(1.0)
    assert torch.equal(out[keys[1]], torch.full((3,), 2.0))


def test_shared_subexpressions_computed_once_in_source(gen):
    x = rx.var("x")
    e = rx.exp(x)
    k = rx.compile({"a": e + 1, "b": e * 2})
    t = torch.randn(8, generator=gen)
    src = k.sources(x=t)[0]
    assert src.count("tl.exp(") == 1 and src.count("tl.store(") == 2


def test_broadcast_producer_is_recomputed_not_materialized(gen):
    x, w, v = rx.var("x"), rx.var("w"), rx.var("v")
    k = rx.compile(x * rx.sigmoid(w * v))  # w * v is [N]; x is [M, N]
    tx, tw, tv = torch.randn(6, 9, generator=gen), torch.randn(9, generator=gen), torch.randn(9, generator=gen)
    assert k.launches(x=tx, w=tw, v=tv) == 1
    assert torch.allclose(k(x=tx, w=tw, v=tv), tx * torch.sigmoid(tw * tv))


def test_intermediate_consumed_by_two_groups_is_written_once(gen):
    x = rx.var("x")
    e = rx.exp(x)
    k = rx.compile({"rows": rx.sum(e, -1), "cols": rx.sum(e, 0)})  # two reductions over different axes
    t = torch.randn(5, 7, generator=gen)
    out = k(x=t)
    assert torch.allclose(out["rows"], t.exp().sum(-1)) and torch.allclose(out["cols"], t.exp().sum(0))
    assert k.launches(x=t) <= 3


def test_backend_torch_is_the_reference(gen):
    x = rx.var("x")
    k = rx.compile(rx.layer_norm(x), config=rx.FusionConfig(backend="torch"))
    t = torch.randn(3, 8, generator=gen)
    assert torch.equal(k(x=t), F.layer_norm(t, (8,)))


def test_interpreter_backend_explicit(gen):
    x = rx.var("x")
    k = rx.compile(x * 3, config=rx.FusionConfig(backend="interpreter"))
    assert "backend: interpreter" in k.explain(x=torch.ones(2))


@pytest.mark.parametrize(
    "fn",
    [
        "exp",
        "relu",
        "sum",
        "softmax",
        "layer_norm",
        "compile",
        "fuse",
        "FusionConfig",
        "fusion_stats",
        "cache_stats",
        "var",
        "variance",
    ],
)
def test_public_api_has_docstring_with_example(fn):
    doc = getattr(rx, fn).__doc__ or ""
    assert "Example" in doc or ">>>" in doc, f"rx.{fn} lacks an example"
