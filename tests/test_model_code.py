"""Model-shaped programs, each a class of bug found from outside (issue 33), in every float dtype:
forward and every gradient against float64 torch, held to eager's own error.

Each case is written twice, once in the DSL and once in torch (the reference, run in the
program's dtype and in float64); a result is accepted when it is no farther from float64 than
eager torch's result in that dtype (plus the dtype's tolerance at the output's scale).
Every kernel runs with bounds checks (``RTXDSL_CHECK_BOUNDS``, set by conftest).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from fuzzing import TOLERANCE

import rtxdsl as rx

#: (dtype, how much farther from float64 than eager a result may be) — bf16 / fp16 GEMMs in
#: fp32 accumulation are often closer than eager's; the slack covers rounding at another place
DTYPES = [(torch.float32, 2.0), (torch.float16, 2.0), (torch.bfloat16, 2.0)]


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got.double())), "non-finite where float64 is finite (or not)"
    return (got.double() - want)[finite].abs().max().item() if finite.any() else 0.0


def check_fair(
    dsl: Callable[..., rx.Expr],
    eager: Callable[..., torch.Tensor],
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    slack: float,
    *,
    ints: dict[str, tuple[int, tuple[int, ...]]] | None = None,
    frozen: tuple[str, ...] = (),
    seed: int = 0,
) -> None:
    """``dsl`` (over ``rx.var``s) against ``eager`` (over tensors): each value (one, or a dict of
    them) and the gradient of every float input not ``frozen``, for random cotangents."""
    gen = torch.Generator().manual_seed(seed)
    base = {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
    fixed = {n: torch.randint(0, hi, s, generator=gen) for n, (hi, s) in (ints or {}).items()}

    def leaves(dt: torch.dtype) -> dict[str, torch.Tensor]:
        out = {n: t.to(dt).requires_grad_(n not in frozen) for n, t in base.items()}
        return {**out, **fixed}

    def run(fn: Callable[..., torch.Tensor | dict], ins: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        y = fn(**ins)
        ys = list(y.values()) if isinstance(y, dict) else [y]
        wrt = [ins[n] for n in base if n not in frozen]
        gen = torch.Generator().manual_seed(seed + 1)
        cots = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in ys]
        return [*ys, *torch.autograd.grad(ys, wrt, cots)]

    kernel = rx.compile(dsl(**{n: rx.var(n) for n in [*base, *fixed]}))
    got = run(lambda **t: kernel(**t), leaves(dtype))
    same = run(eager, leaves(dtype))
    want = run(eager, leaves(torch.float64))
    atol = TOLERANCE[dtype][0]
    values = [f"value {k}" for k in range(len(got) - len(base) + len(frozen))]
    for what, g, s, w in zip([*values, *[f"d{n}" for n in base if n not in frozen]], got, same, want):
        assert g.dtype == s.dtype and g.shape == s.shape, f"{what}: {g.dtype}{list(g.shape)} vs eager's"
        scale = max(1.0, w.abs().max().item())
        err, eager_err = _error(g, w), _error(s, w)
        assert err <= slack * eager_err + atol * scale, f"{what}: error {err:.3g}, eager's {eager_err:.3g}"


# ---- 1. a norm or softmax feeding a matmul, backward in half precision ----------------------------
# the weight gradient multiplies the recomputed norm (from saved fp32 statistics) by the cotangent:
# the operand must be cast back to the product's dtype, as the forward multiplied it
NORMS = {
    "rms_norm": (lambda x, w: rx.linear(rx.rms_norm(x), w), lambda x, w: F.linear(F.rms_norm(x, (8,), eps=1e-6), w)),
    "layer_norm": (lambda x, w: rx.linear(rx.layer_norm(x), w), lambda x, w: F.linear(F.layer_norm(x, (8,)), w)),
    "softmax": (lambda x, w: rx.linear(rx.softmax(x), w), lambda x, w: F.linear(torch.softmax(x, -1), w)),
}


@pytest.mark.parametrize("dtype, slack", DTYPES)
@pytest.mark.parametrize("name", sorted(NORMS))
def test_a_norm_feeding_a_matmul_differentiates_in_every_dtype(name, dtype, slack):
    dsl, eager = NORMS[name]
    check_fair(dsl, eager, {"x": (4, 8), "w": (5, 8)}, dtype, slack)


def test_a_lazy_layer_norm_feeding_a_linear_differentiates_in_bf16():
    f = rx.Fusion()
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(5, 8, dtype=torch.bfloat16, requires_grad=True)
    F.linear(F.layer_norm(f.lazy(x), (8,)), w).torch().sum().backward()
    x0, w0 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    F.linear(F.layer_norm(x0, (8,)), w0).sum().backward()
    torch.testing.assert_close(w.grad.double(), w0.grad, atol=0.1, rtol=0.05)
    torch.testing.assert_close(x.grad.double(), x0.grad, atol=0.1, rtol=0.05)


# ---- 2. cross-entropy over a product whose hidden state or weight is computed ---------------------
# the backward recomputes the logits in tiles from the product's operands, read from memory: a
# computed operand is written once, never recomputed as a prologue of the GEMM holding the product
def _lce(h: rx.Expr, w: rx.Expr, t: rx.Expr) -> rx.Expr:
    return rx.linear_cross_entropy(h, w, t)


COMPUTED_OPERANDS = {
    "hidden": (lambda x, w, t: _lce(x * 2, w, t), lambda x, w, t: F.cross_entropy(F.linear(x * 2, w), t)),
    "weight": (lambda x, w, t: _lce(x, w * 2, t), lambda x, w, t: F.cross_entropy(F.linear(x, w * 2), t)),
    "normed hidden": (
        lambda x, w, t: rx.cross_entropy(rx.linear(rx.rms_norm(x), w), t),
        lambda x, w, t: F.cross_entropy(F.linear(F.rms_norm(x, (8,), eps=1e-6), w), t),
    ),
}


@pytest.mark.parametrize("frozen", [(), ("x",), ("w",)], ids=["both", "weight only", "hidden only"])
@pytest.mark.parametrize("name", sorted(COMPUTED_OPERANDS))
def test_cross_entropy_over_a_product_of_computed_operands_differentiates(name, frozen):
    dsl, eager = COMPUTED_OPERANDS[name]
    check_fair(dsl, eager, {"x": (6, 8), "w": (11, 8)}, torch.float32, 2.0, ints={"t": (11, (6,))}, frozen=frozen)


@pytest.mark.parametrize("dtype, slack", DTYPES[1:])
def test_an_lm_head_over_a_final_norm_differentiates_in_half_precision(dtype, slack):
    dsl, eager = COMPUTED_OPERANDS["normed hidden"]
    check_fair(dsl, eager, {"x": (6, 8), "w": (11, 8)}, dtype, slack, ints={"t": (11, (6,))})


# ---- 3. a computed value used both as a GEMM operand and beside it (a residual) -----------------
# the GEMM's epilogue reads the value at the product's coordinates: it is loaded there, not held
# as the prologue's tile (which lives at the operand's coordinates)
@pytest.mark.parametrize("dtype, slack", DTYPES)
def test_a_residual_around_a_projection_of_a_computed_value(dtype, slack):
    check_fair(
        lambda x, w: rx.gelu(x) + rx.linear(rx.gelu(x), w),
        lambda x, w: F.gelu(x) + F.linear(F.gelu(x), w),
        {"x": (4, 8), "w": (8, 8)},
        dtype,
        slack,
    )


def test_two_residual_blocks_with_a_norm_differentiate():
    def dsl(x, w1, b1, wt, w2, b2):
        h1 = x + rx.linear(x, w1, b1)
        h2 = h1 + rx.linear(rx.gelu(h1 @ wt), w2, b2)
        a = rx.silu(rx.rms_norm(h2))
        return rx.sum(a * a)

    def eager(x, w1, b1, wt, w2, b2):
        h1 = x + F.linear(x, w1, b1)
        h2 = h1 + F.linear(F.gelu(h1 @ wt), w2, b2)
        a = F.silu(F.rms_norm(h2, (8,), eps=1e-6))
        return (a * a).sum()

    shapes = {"x": (5, 8), "w1": (8, 8), "b1": (8,), "wt": (8, 6), "w2": (8, 6), "b2": (8,)}
    check_fair(dsl, eager, shapes, torch.float32, 2.0)


# ---- 4. a sum or mean directly over a product --------------------------------------------------
# the reduction's cotangent broadcasts; a contraction's VJP multiplies whole matrices, so it is
# expanded to the product's shape first; a pooled (per-row) value a GEMM reads is kept in fp32 for
# half inputs, and cast to the product's dtype as its tiles are loaded
POOLED = {
    "mean": (lambda x, w: rx.mean(rx.linear(x, w)), lambda x, w: F.linear(x, w).mean()),
    "sum over rows": (lambda x, w: rx.sum(x @ w, axis=0), lambda x, w: (x @ w).sum(0)),
    "mean pooling then projection": (
        lambda x, w: rx.linear(rx.mean(x, axis=1), w),
        lambda x, w: F.linear(x.mean(1), w),
    ),
}


@pytest.mark.parametrize("dtype, slack", DTYPES)
@pytest.mark.parametrize("name", sorted(POOLED))
def test_a_reduction_over_a_product_differentiates(name, dtype, slack):
    dsl, eager = POOLED[name]
    shape = (3, 4, 8) if name.startswith("mean pooling") else (4, 8)
    w = (5, 8) if name.startswith("mean pooling") else (8, 8)
    check_fair(dsl, eager, {"x": shape, "w": w}, dtype, slack)


# a bias added before a pooled loss: the loss's cotangent broadcasts over the pooled rows, and the
# bias gradient sums it over every row (it summed one: silently wrong, found by the model fuzzer)
BIAS_THEN_POOL = {
    "elementwise": (
        lambda x, w, b: rx.sum(rx.mean(x * 2 + b, -2) * w),
        lambda x, w, b: ((x * 2 + b).mean(-2) * w).sum(),
    ),
    "projection": (
        lambda x, w, b: rx.sum(rx.mean(rx.linear(x, w, b), -2)),
        lambda x, w, b: F.linear(x, w, b).mean(-2).sum(),
    ),
}


@pytest.mark.parametrize("name", sorted(BIAS_THEN_POOL))
def test_a_bias_before_a_pooled_loss_gets_every_rows_gradient(name):
    dsl, eager = BIAS_THEN_POOL[name]
    w = (10,) if name == "elementwise" else (10, 10)
    check_fair(dsl, eager, {"x": (3, 9, 10), "w": w, "b": (10,)}, torch.float32, 2.0)


# a value both GEMMs' operands are computed from, and an epilogue reads too: each prologue's cone
# takes it from the kernel it copies from (it read it from the other GEMM, which read the first:
# a cycle between kernels; lazy fuzzer, seed 700294)
def test_two_gemms_sharing_an_operands_producer_with_a_loss_beside_them():
    def dsl(x, y):
        v1 = rx.clamp(rx.exp(x), max=4.0)
        loss = rx.cross_entropy(3 * v1 * 2, y, label_smoothing=0.1)
        return {"loss": loss, "product": rx.linear(v1, v1 + 2 * x)}

    def eager(x, y):
        v1 = x.exp().clamp(max=4.0)
        return {"loss": F.cross_entropy(3 * v1 * 2, y, label_smoothing=0.1), "product": F.linear(v1, v1 + 2 * x)}

    check_fair(dsl, eager, {"x": (4, 4)}, torch.float32, 2.0, ints={"y": (4, (4,))})


# a tensor summed over a GEMM's contracted dims beside a prologue's own sum (two bias gradients
# beside a weight gradient): both merge in the K loop, which reads the tensor at the operand's
# tile (it was loaded at the product's, which the K loop has not yet: a crash; model fuzzer,
# program 19704994500093)
@pytest.mark.parametrize("dtype, slack", DTYPES)
def test_a_tensor_summed_in_a_gemms_k_loop_beside_its_prologue(dtype, slack):
    check_fair(
        lambda x, y, w: {"p": rx.transpose(x * 2 + 1, 0, 1) @ w, "sa": rx.sum(x * 2 + 1, 0), "sy": rx.sum(y, 0)},
        lambda x, y, w: {"p": (x * 2 + 1).mT @ w, "sa": (x * 2 + 1).sum(0), "sy": y.sum(0)},
        {"x": (5, 7), "y": (5, 7), "w": (5, 3)},
        dtype,
        slack,
    )


# ---- 6. stacked linears viewed to heads, then a product of the view ------------------------------
# a node a composite typed outside its own cone (a transpose of a size-1 dim is a reshape, which
# moves into the product's rows) has an origin but no writer: folding scalars kept only both
@pytest.mark.parametrize("heads", [1, 2])
def test_stacked_linears_viewed_to_heads_then_a_product(heads):
    b, t, d = 2, 3, 8

    def dsl(x, w1, b1, w2, b2, p):
        v = rx.linear(rx.linear(x, w1, b1), w2, b2)
        return p @ rx.transpose(v.reshape((b, t, heads, d // heads)), 1, 2)

    def eager(x, w1, b1, w2, b2, p):
        v = F.linear(F.linear(x, w1, b1), w2, b2)
        return p @ v.view(b, t, heads, d // heads).transpose(1, 2)

    shapes = {"x": (b, t, d), "w1": (d, d), "b1": (d,), "w2": (d, d), "b2": (d,), "p": (b, heads, t, t)}
    check_fair(dsl, eager, shapes, torch.float32, 2.0)


# ---- 14. every index a generated kernel computes is in bounds -----------------------------------
# a value smaller than its kernel's domain (a causal mask [T, T] beside scores [B, H, T, T]) that
# a GEMM's prologue reads must be written by a kernel of its own shape, not stored over the domain
@pytest.mark.parametrize("masked", [True, False], ids=["causal", "unmasked"])
def test_attention_with_a_gathered_relative_position_bias_differentiates(masked):
    n = 29  # odd: every tile has a ragged edge

    def dsl(q, k, v, rel):
        s = q @ rx.transpose(k, -2, -1)
        i, j, h = (rx.arange_like(s, d) for d in (2, 3, 1))
        g = rx.gather(rel[None, :, None, :] + 0 * i, i - j + (n - 1) + 0 * h, axis=3)
        return rx.softmax(rx.where(i >= j, s + g, float("-inf")) if masked else s + g, axis=-1) @ v

    def eager(q, k, v, rel):
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        s = q @ k.mT + rel[:, i - j + n - 1]
        return torch.softmax(s.masked_fill(i < j, float("-inf")) if masked else s, -1) @ v

    shapes = {"q": (2, 2, n, 16), "k": (2, 2, n, 16), "v": (2, 2, n, 16), "rel": (2, 2 * n - 1)}
    check_fair(dsl, eager, shapes, torch.float32, 2.0)


def test_bounds_checks_catch_an_access_outside_every_tensor():
    """The checker itself: a kernel reading one element past its input raises (it is not silent)."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    from rtxdsl import interpret

    @triton.jit
    def past_the_end(x_ptr, y_ptr, n):
        offs = tl.arange(0, 8)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs + 1, mask=offs < n))

    # a memory trace first: it wraps the interpreter's loads too, and once left its wrapper's
    # original pinned on the builder, so that a later bounds check never ran (a test that ran
    # after a trace on the same pytest worker passed without checking)
    rx.memory_trace(rx.compile(rx.var("a") * 2), a=torch.ones(4))
    # x is the first half of a buffer: the element past it is that buffer's, never another tensor's
    # (two separate allocations may lie end to end, and a read past x would land inside y)
    x, y = torch.zeros(16)[:8], torch.zeros(8)
    with interpret.bounds_checked("past_the_end", ["x_ptr", "y_ptr"], [x, y]):
        past_the_end[(1,)](x, y, 7)  # every lane in bounds: no error
        with pytest.raises(Exception, match="past_the_end: a load of 1 element"):
            past_the_end[(1,)](x, y, 8)


# ---- a half value a kernel stores and also reads: its readers see the stored (rounded) value ------
# a kernel computes in fp32; a value it stores in bf16 / fp16 for later kernels (a residual, a
# product saved for the backward) and also reads itself is rounded where it is computed, so the
# kernel's own readers see what every later kernel and a backward recomputing from it read back
def test_softmax_over_one_key_has_an_exactly_zero_gradient_in_bf16():
    """Softmax over one key is 1 whatever the score: the gradient of q and k is exactly 0, in eager
    and here. The backward's GEMM epilogue recomputed the softmax from its unrounded accumulator
    while the forward had saved the rounded bf16 scores: 1 - exp(s - lse) was a few ulps off."""
    q, k, v = rx.var("q"), rx.var("k"), rx.var("v")
    e = rx.cast(rx.softmax(rx.cast(q @ rx.transpose(k, 0, 1), torch.float32), -1), torch.bfloat16) @ v
    gen = torch.Generator().manual_seed(0)
    ins = {n: torch.randn(1, 8, generator=gen).bfloat16().requires_grad_() for n in "qkv"}
    out = rx.compile(e)(**ins)
    dq, dk, dv = torch.autograd.grad(out, list(ins.values()), torch.ones(1, 8, dtype=torch.bfloat16))
    assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dk, torch.zeros_like(dk))
    assert torch.equal(dv, torch.ones_like(dv))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_residual_stored_and_normed_in_one_kernel_is_rounded_once(dtype):
    """``h = x + y`` stored in half and normed in the same kernel: the norm reads the rounded ``h``
    (rounded once in the source, its store the rounded half value), so its result is eager's on
    eager's ``h``."""
    x, y = rx.var("x"), rx.var("y")
    kernel = rx.compile({"h": x + y, "n": rx.rms_norm(x + y)})
    gen = torch.Generator().manual_seed(0)
    xs, ys = (torch.randn(3, 37, generator=gen).to(dtype) for _ in range(2))
    (src,) = kernel.sources(x=xs, y=ys)
    half = "tl.bfloat16" if dtype is torch.bfloat16 else "tl.float16"
    # rounded once (its fp32 copy read by the norm), and stored as that half value: two conversions
    assert src.count(f".to({half})") == 2 and src.count("_r = ") == 1, src
    out = kernel(x=xs, y=ys)
    torch.testing.assert_close(out["h"], xs + ys, atol=0, rtol=0)
    torch.testing.assert_close(out["n"], F.rms_norm(out["h"].float(), (37,), eps=1e-6).to(dtype), atol=0, rtol=0)


# ---- a tied head's logits, recomputed by the backward, are the forward's to the last bit ----------
# the backward recomputes the logits of linear cross-entropy in tiles and takes exp(logits - lse)
# with the forward's saved logsumexp: in bf16 / fp16 the half product is rounded where it is
# computed (the forward's row kernel never stored it), and a hidden state computed by several ops
# (``norm(h) @ w + h``) is the one the forward multiplied, saved, not recomputed with other rounding.
# A tied embedding's gradient was ten times eager's error (model fuzzer, program 25093038400146)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype, slack", DTYPES[1:])
def test_a_tied_head_over_a_residual_mlp_differentiates_in_half_precision(dtype, slack, seed):
    def dsl(E, P, g, w1, w2, w3, b3, ids, t):
        h = rx.gather(E, ids, 0) + P
        n = rx.layer_norm(h, g)
        y = rx.linear(rx.silu(rx.linear(n, w1)) * rx.linear(n, w2), w3, b3) + h
        return rx.linear_cross_entropy(y, E, t)

    def eager(E, P, g, w1, w2, w3, b3, ids, t):
        h = torch.gather(E, 0, ids) + P
        n = F.layer_norm(h, (19,), g)
        y = F.linear(F.silu(F.linear(n, w1)) * F.linear(n, w2), w3, b3) + h
        return F.cross_entropy(F.linear(y, E), t)

    shapes = {"E": (32, 19), "P": (27, 19), "g": (19,), "w1": (9, 19), "w2": (9, 19), "w3": (19, 9), "b3": (19,)}
    check_fair(dsl, eager, shapes, dtype, slack, ints={"ids": (32, (27, 19)), "t": (32, (27,))}, seed=seed)
