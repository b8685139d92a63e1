"""rx.attention (DESIGN section 8): forward, logsumexp and every gradient against float64 torch, on
odd sizes, with GQA, causal and data masks, score modifications that read tensors (and get their
gradients), dropout, fully masked rows, SDPA's attn_mask, the lazy stream's
F.scaled_dot_product_attention, and the errors that name the input at fault."""

from __future__ import annotations

import importlib
import math
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close

import rtxdsl as rx
from rtxdsl.errors import DtypeMismatchError, RtxError, ShapeError
from rtxdsl.lower.spec import Src
from rtxdsl.lower.target import GPU

attention_ops = importlib.import_module("rtxdsl.ops.attention")  # (rx.attention is the function)

q, k, v = rx.var("q"), rx.var("k"), rx.var("v")

# (dtype, atol, rtol): scores and row statistics are fp32 (fp64 for fp64); half types round the
# scores' product, the probabilities before P @ v (as FlashAttention does) and the outputs
TOLERANCES = [
    (torch.float64, 1e-10, 1e-10),
    (torch.float32, 2e-5, 2e-5),
    (torch.float16, 4e-3, 4e-3),
    (torch.bfloat16, 3e-2, 3e-2),
]

# (B, Hq, Hkv, Tq, Tk, D, Dv): why each is there
SIZES = [
    (2, 3, 3, 7, 5, 16, 16),  # odd lengths, Tq > Tk (causal rows past the keys)
    (1, 2, 2, 5, 9, 12, 7),  # Tq < Tk, a head dim that is no power of two, Dv != D
    (1, 1, 1, 1, 1, 8, 8),  # one query, one key: the softmax is 1
    (1, 4, 2, 6, 6, 8, 8),  # GQA: each key/value head serves two query heads
    (2, 3, 1, 4, 7, 8, 4),  # MQA
]


def _inputs(gen, b, hq, hkv, tq, tk, d, dv, dtype):
    def t(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return {"q": t(b, hq, tq, d), "k": t(b, hkv, tk, d), "v": t(b, hkv, tk, dv)}


def _reference(ins, scale=None, keep=None, bias=None):
    """float64 attention written out: scores, an additive bias, a kept mask, softmax with fully
    masked rows giving 0 (and logsumexp -inf)."""
    qd, kd, vd = (ins[n].double() for n in "qkv")
    g = qd.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1)
    s = qd @ kd.mT * (1 / math.sqrt(qd.shape[-1]) if scale is None else scale)
    if bias is not None:
        s = s + bias
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    lse = _logsumexp(s)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).detach()[..., None])
    return _normalized(p, vd), lse


def _logsumexp(s):
    """The scores' logsumexp as ``max + log(sum(exp(s - max)))``: torch.logsumexp's gradient,
    ``exp(s - lse)``, is 1 per key (not 1 / n) where lse rounds to a row of equal scores far below
    zero (Hugging Face's padding), in float64 too; a fully masked row: -inf, no gradient."""
    mx = s.amax(-1, keepdim=True).detach()
    total = torch.exp(s - torch.where(torch.isinf(mx), 0.0, mx)).sum(-1, keepdim=True)
    empty = total == 0
    return torch.where(empty, float("-inf"), mx + torch.log(torch.where(empty, 1.0, total))).squeeze(-1)


def _normalized(p, vd):
    """``p @ v`` over ``p``'s row sum (1 up to rounding; not where every score is a finite
    minimum: the logsumexp rounds to it and each ``p`` is 1), 0 for a row of zeros."""
    total = p.sum(-1, keepdim=True)
    return (p @ vd) / torch.where(total == 0, 1.0, total)


def _k_loops(src):
    """A GEMM's K loops over the kept key (or query) slices, each loop's text: where the guard
    holds over whole tiles (causal, a window) two, the slices it may fail over, then the others
    (``GemmWriter._split_loop``), whose names end in ``_f``."""
    lines = src.splitlines()
    heads = [i for i, line in enumerate(lines) if re.match(r"\s*for (kp|k_start) in range\((k_lo|full_lo)", line)]
    depth = [len(line) - len(line.lstrip()) for line in lines]
    ends = [next((j for j in range(i + 1, len(lines)) if depth[j] <= depth[i]), len(lines)) for i in heads]
    return ["\n".join(lines[i:j]) for i, j in zip(heads, ends)]


def _grads(out, leaves, cot):
    return torch.autograd.grad(out, leaves, cot, allow_unused=True)


def _check(expr, ins, ref_fn, dtype, atol, rtol, gen, grad=True):
    """The kernel's outputs and gradients (every float input) against ``ref_fn`` on float64 leaves."""
    kern = rx.compile(expr)
    leaves = {n: t.clone().requires_grad_(grad and t.dtype.is_floating_point) for n, t in ins.items()}
    out = kern(**leaves)
    ref_leaves = {
        n: t.double().requires_grad_(t.requires_grad) if t.dtype.is_floating_point else t for n, t in leaves.items()
    }
    ref = ref_fn(ref_leaves)
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.dtype == (dtype if i == 0 else (torch.float64 if dtype == torch.float64 else torch.float32))
        assert_close(o, r, atol, rtol, f"output {i}")
    if not grad:
        return
    cots = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]
    names = [n for n, t in leaves.items() if t.requires_grad]
    got = _grads(outs, [leaves[n] for n in names], [c.to(o.dtype) for c, o in zip(cots, outs)])
    want = _grads(refs, [ref_leaves[n] for n in names], cots)
    for n, a, e in zip(names, got, want):
        assert a is not None and torch.isfinite(a).all(), f"d/d{n} not finite"
        assert_close(a, e, atol * _grad_scale(e, outs, dtype), rtol, f"d/d{n}")


def _grad_scale(e, outs, dtype):
    """A gradient's tolerance scale: its largest value (at least 1); in half precision also the
    square root of the outputs' elements per element of it (a tensor the scores read sums the
    rounding of every score it touches, a random walk: an ALiBi slope's gradient, 0 where Tk = 1)."""
    scale = max(1.0, float(e.abs().max()))
    if dtype in (torch.float16, torch.bfloat16):
        scale *= math.sqrt(max(1, max(o.numel() for o in outs) // max(e.numel(), 1)))
    return scale


def _check_sm90(expr, ins, ref_fn, dtype, atol, rtol, gen):
    """``_check`` at sm_90's plan, run under the interpreter (``rx.memory_trace``): the kernels an
    H200 runs (its tiles and warps, products taken whole, operands read transposed, split K loops),
    every output and gradient against float64."""
    plan = rx.compile(expr).grad_plan(
        **{n: t.clone().requires_grad_(t.dtype.is_floating_point) for n, t in ins.items()}
    )
    forward = rx.memory_trace(plan.forward, target=GPU, **{n: ins[n] for n in plan.forward.inputs}).result
    ref_leaves = {n: t.double().requires_grad_() if t.dtype.is_floating_point else t for n, t in ins.items()}
    ref = ref_fn(ref_leaves)
    refs = ref if isinstance(ref, tuple) else (ref,)
    outs = [forward[key] for key in plan.grads.user_keys]
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert_close(o, r, atol, rtol, f"sm_90 output {i}")
    cots = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]
    feed = ins | forward | {f"_g{i}": c.to(o.dtype) for i, (c, o) in enumerate(zip(cots, outs))}
    got = rx.memory_trace(plan.backward, target=GPU, **{n: feed[n] for n in plan.backward.inputs}).result
    got |= {key: feed[name] for key, name in plan.passthrough}
    names = [n for n, t in ref_leaves.items() if t.requires_grad]
    for n, e in zip(names, _grads(refs, [ref_leaves[n] for n in names], cots)):
        a = got[dict(plan.grads.grad_of)[n]].expand(e.shape)
        assert_close(a, e, atol * _grad_scale(e, outs, dtype), rtol, f"sm_90 d/d{n}")


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES, ids=lambda x: str(x).removeprefix("torch."))
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_float64_with_every_gradient(size, dtype, atol, rtol, causal, gen):
    ins = _inputs(gen, *size, dtype)
    tq, tk = size[3], size[4]
    keep = torch.ones(tq, tk, dtype=torch.bool).tril() if causal else None
    expr = rx.attention(q, k, v, causal=causal, enable_gqa=size[1] != size[2])
    _check(expr, ins, lambda r: _reference(r, keep=keep)[0], dtype, atol, rtol, gen)


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES[1:2], ids=["float32"])  # the layout, not the dtype
def test_query_rows_past_one_block_keep_to_their_head(dtype, atol, rtol, gen):
    """70 query rows are two of the interpreter's 64-row blocks per head: each program's rows keep
    to one (batch, head), whose keys the row kernel's product reads (``BATCH_ROWS``)."""
    ins = _inputs(gen, 2, 2, 1, 70, 67, 8, 8, dtype)
    keep = torch.ones(70, 67, dtype=torch.bool).tril()
    expr = rx.attention(q, k, v, causal=True, enable_gqa=True)
    _check(expr, ins, lambda r: _reference(r, keep=keep)[0], dtype, atol, rtol, gen)


# ---- the plan: the scores are never written in the forward ------------------------------------------
B_, H_, T_ = 2, 4, 33  # scores of 2 x 4 x 33 x 33: larger than any per-row or [T, D] buffer

PLANS = {  # what the attention reads beside q, k, v: (expression, extra inputs, launches)
    "full": (lambda: rx.attention(q, k, v), {}, 1),
    "causal": (lambda: rx.attention(q, k, v, causal=True), {}, 1),
    "window-softcap": (
        lambda: rx.attention(
            q, k, v, score_mod=lambda s, b, h, i, j: 5.0 * rx.tanh(s / 5.0), mask_mod=lambda b, h, i, j: i - j < 4
        ),
        {},
        1,
    ),
    "bias": (
        lambda: rx.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + rx.var("bias")),
        {"bias": (H_, T_, T_)},
        1,
    ),
    "padding-mask": (lambda: rx.attention(q, k, v, attn_mask=rx.var("m")), {"m": (B_, 1, 1, T_)}, 1),
    "gqa": (lambda: rx.attention(q, k, v, causal=True, enable_gqa=True), {}, 1),  # K and V read as they are
}


@pytest.mark.parametrize("kind", list(PLANS))
def test_the_forward_writes_no_scores(kind, gen):
    """One kernel, the ``P @ v`` GEMM, computes the scores' product tile by tile in its K loop,
    their logsumexp merged as it runs (online softmax, ``lower/online.py``): no buffer of the scores' size,
    on the interpreter's plan and on sm_90's. Nor in the backward, whose ``P.T @ dO``, ``dS @ k``
    and ``dS.T @ q`` GEMMs recompute ``P`` and ``dS`` (two products: the scores and ``dO @ v.T``)
    in their K loops; except where a tensor the scores read gets a gradient of their size (a
    bias): ``dS`` is then written (with a value it shares with the probabilities)."""
    make, extra, launches = PLANS[kind]
    hkv = 1 if kind == "gqa" else H_
    ins = _inputs(gen, B_, H_, hkv, T_, T_, 8, 8, torch.float32)
    for n, shape in extra.items():
        ins[n] = torch.rand(shape, generator=gen) > 0.2 if n == "m" else torch.randn(shape, generator=gen)
    kern = rx.compile(make())
    scores = B_ * H_ * T_ * T_
    for program in (kern.program(**ins), kern.lower_for(GPU, **ins)):
        assert len(program.launched) == launches
        assert all(math.prod(b.shape) < scores for b in program.buffers), [b.shape for b in program.buffers]
    grads = {n: t.requires_grad_(t.dtype.is_floating_point) for n, t in ins.items()}
    plan = kern.grad_plan(**grads)
    assert all(math.prod(b.shape) < scores for b in plan.forward.program(**grads).buffers)
    saved = plan.forward(**grads)
    feed = grads | dict(saved) | {"_g0": torch.ones(B_, H_, T_, 8)}
    inputs = {n: feed[n] for n in plan.backward.inputs}
    for backward in (plan.backward.program(**inputs), plan.backward.lower_for(GPU, **inputs)):
        written = [b.shape for b in backward.buffers if math.prod(b.shape) >= scores]
        # (a bias: dS and a value it shares with the probabilities; dS times the scale was a third
        # before the scale became a factor of the products reading it, vjp._constant_factor)
        assert len(written) == (2 if kind == "bias" else 0), written


@pytest.mark.parametrize("hkv", [4, 1], ids=["multi-head", "multi-query"])
def test_the_training_forward_saves_its_output_and_two_row_statistics(hkv, gen):
    """The backward's ``rowsum(dO * O)`` reads the output back, as SDPA saves it, not the product
    ``P @ v`` before its division (saved beside it, the output's size again: 33.5 MB at 32 heads x
    4096 x 128 in bf16). Planned for sm_90, the training forward moves q, k, v, the output and two
    statistics per row; the saved output is the very tensor returned, so an in-place write to it
    fails the backward as eager's does, never a silent wrong gradient."""
    b, hq, t, d = 2, 4, 70, 16
    ins = {n: torch.randn(b, hq if n == "q" else hkv, t, d, generator=gen).bfloat16().requires_grad_() for n in "qkv"}
    kern = rx.compile(rx.attention(q, k, v, causal=True, enable_gqa=hkv != hq))
    plan = kern.grad_plan(**ins)
    program = plan.forward.lower_for(GPU, **{n: x.detach() for n, x in ins.items()})
    halves = sum(x.numel() for x in ins.values()) + b * hq * t * d  # q, k, v read, the output written
    assert program.bytes_moved == 2 * halves + 2 * 4 * b * hq * t
    out = kern(**ins)
    assert any(s.data_ptr() == out.data_ptr() for s in out.grad_fn.saved_tensors)
    out.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def _gqa(**kw):
    return lambda: rx.attention(q, k, v, enable_gqa=True, **kw)


GROUPED = {  # grouped-query attention: what the scores read beside q, k, v, and whether K and V are copied
    "causal": (_gqa(causal=True), {}, False),
    "padding mask": (_gqa(attn_mask=rx.var("m")), {"m": (2, 1, 1, 20)}, False),
    # a model's [B, 1, Tq, Tk] mask (causal and padding, or a sliding window) serves every head
    "model mask": (_gqa(attn_mask=rx.var("m")), {"m": (2, 1, 33, 20)}, False),
    "softcap": (_gqa(score_mod=lambda s, *_: 5.0 * rx.tanh(s / 5.0)), {}, False),
    # a tensor that differs per query head: each key head is repeated for its query heads
    "per-head mask": (_gqa(attn_mask=rx.var("m")), {"m": (2, 4, 33, 20)}, True),
}


@pytest.mark.parametrize("kind", list(GROUPED))
def test_grouped_query_attention_reads_keys_and_values_as_they_are(kind, gen):
    """Each key/value head's query heads are one batch of the products, ``[B, Hkv, G, Tq, D]``
    against ``[B, Hkv, 1, Tk, D]`` (views of q, k and v, strided as a model's transposed
    projections are): no buffer of the keys repeated per query head in the forward or the backward
    (whose dK and dV sum over the group, in one kernel), as many launches as multi-head attention's, and the
    output and every gradient as float64's. Only a tensor read per query head repeats them."""
    make, extra, copies = GROUPED[kind]
    tq, tk, d = 33, 20, 8  # Tq != Tk: a [.., Tk, D] buffer larger than k is k repeated
    ins = {
        "q": torch.randn(2, tq, 4, d, generator=gen).transpose(1, 2),
        "k": torch.randn(2, tk, 1, d, generator=gen).transpose(1, 2),
        "v": torch.randn(2, tk, 1, d, generator=gen).transpose(1, 2),
    }
    for n, shape in extra.items():
        ins[n] = torch.rand(shape, generator=gen) > 0.2
    kern = rx.compile(make())

    def repeats(program):
        return [b.shape for b in program.buffers if b.shape[-2:] == (tk, d) and math.prod(b.shape) > 2 * tk * d]

    forward = kern.program(**ins)
    assert len(forward.launched) == (2 if copies else 1)
    assert bool(repeats(forward)) == copies
    grads = {n: t.requires_grad_(t.dtype.is_floating_point) for n, t in ins.items()}
    plan = kern.grad_plan(**grads)
    saved = plan.forward(**grads)
    feed = grads | dict(saved) | {"_g0": torch.ones(2, 4, tq, d)}
    backward = plan.backward.program(**{n: feed[n] for n in plan.backward.inputs})
    assert len(backward.launched) == (5 if copies else 3)
    # dK and dV two products of one GEMM kernel summing the group's query heads in its K loop
    # (``contract``'s ``summed``): no buffer per query head, neither K copied nor a per-head dK
    assert bool(repeats(backward)) == copies

    def ref(r):
        qd, kd, vd = r["q"], r["k"].expand(-1, 4, -1, -1), r["v"].expand(-1, 4, -1, -1)
        s = qd @ kd.mT / math.sqrt(d)
        s = 5.0 * torch.tanh(s / 5.0) if kind == "softcap" else s
        keep = torch.ones(tq, tk, dtype=torch.bool).tril() if kind == "causal" else r.get("m", True)
        s = s.masked_fill(~torch.as_tensor(keep), float("-inf"))
        return torch.nan_to_num(torch.softmax(s, -1)) @ vd

    _check(make(), {n: t.detach() for n, t in ins.items()}, ref, torch.float32, 2e-5, 2e-5, gen)


@pytest.mark.parametrize("mask", [None, (2, 1, 1, 300)])  # none, or a padding mask
def test_a_decoding_step_reads_each_key_once_per_key_head(mask, gen):
    """One query per head (decoding) with grouped-query attention: the group's queries are the
    rows of one product per key head (``[B, Hkv, G, D]``, a view at any strides), so each program
    of the ``P @ v`` GEMM covers a key head's whole group and K and V are read once per key head,
    not once per query head; the output, logsumexp and every gradient as float64's."""
    ins = {
        "q": torch.randn(2, 1, 8, 16, generator=gen).transpose(1, 2),  # a model's transposed projection
        "k": torch.randn(2, 2, 300, 16, generator=gen),
        "v": torch.randn(2, 2, 300, 16, generator=gen),
    }
    extra = {}
    if mask is not None:
        ins["m"] = torch.rand(mask, generator=gen) > 0.2
        extra["attn_mask"] = rx.var("m")
    expr = rx.attention(q, k, v, enable_gqa=True, return_lse=True, **extra)
    for program in (rx.compile(expr).program(**ins), rx.compile(expr).lower_for(GPU, **ins)):
        (gemm,) = [c for c in program.kernels if c.spec.kind == "gemm"]
        assert gemm.grid[1] == 2 * 2  # a program per batch and key head (and column tile): not per query head

    def ref(r):
        kd, vd = r["k"].repeat_interleave(4, 1), r["v"].repeat_interleave(4, 1)
        s = (r["q"] @ kd.mT / 4.0).masked_fill(~r["m"], float("-inf")) if mask else r["q"] @ kd.mT / 4.0
        return torch.softmax(s, -1) @ vd, torch.logsumexp(s, -1)

    _check(expr, ins, ref, torch.float32, 2e-5, 2e-5, gen)


# softmax(s) through ops that keep it proportional before @ v: divided after the product, one launch
# (lower/online.py: normalized_after); through one that does not (p * p), left as written
PROPORTIONAL = {  # name: (rtxdsl chain, torch chain, extra inputs, launches)
    "masked": (lambda p: rx.where(rx.var("m"), p, 0.0), lambda p, m: torch.where(m, p, 0.0), ("m",), 1),
    "scaled per key": (lambda p: p * rx.var("w"), lambda p, w: p * w, ("w",), 1),
    "squared": (lambda p: p * p, lambda p: p * p, (), None),
}


@pytest.mark.parametrize("name", PROPORTIONAL)
def test_a_softmax_before_a_product_is_divided_after_it(name, gen):
    chain, ref_chain, names, launches = PROPORTIONAL[name]
    ins = _inputs(gen, 1, 2, 2, 9, 13, 8, 8, torch.float32)
    made = {"m": torch.rand(9, 13, generator=gen) > 0.3, "w": torch.rand(13, generator=gen)}
    extra = {n: made[n] for n in names}
    expr = chain(rx.softmax(q @ k.mT * 0.3, -1)) @ v
    if launches is not None:
        assert len(rx.compile(expr).program(**ins, **extra).launched) == launches

    def ref(r):
        p = torch.softmax(r["q"] @ r["k"].mT * 0.3, -1)
        return ref_chain(p, *(r[n] for n in names)) @ r["v"]

    _check(expr, ins | extra, ref, torch.float32, 2e-5, 2e-5, gen)


@pytest.mark.xfail(strict=True, reason="open: the backward's rowsum(dO * O), FlashAttention's, against dP's own sum")
def test_saturated_attention_written_by_hand_has_eagers_gradients(gen):
    """Rows of one-hot probabilities (scores 1e3 apart) over values of 1e3: the gradients of q and
    k are 0 (float64: 1e-11), and eager's ``p * (dP - sum(dP * p))`` gives 0 exactly. The fused
    backward takes ``D = rowsum(dO * O)`` (FlashAttention's, from the output, as ``rx.attention``'s):
    ``dP - D`` cancels up to the rounding of two sums of ``dO * v`` taken in other orders, which ``k``
    scales to 3e-2 where ``v``'s own gradient is 3.4 (found by the model fuzzer, program
    2026121300040: raw hidden states of 1e3 projected to q and k). Before 3b4588d divided a softmax
    after its product the same program was off by 5e-4; eager parity would sum ``dP * p`` in a pass
    of its own (recomputing both products): open."""
    q_, k_ = (torch.randn(1, 2, 12, 5, generator=gen) * 30 for _ in range(2))
    ins = {"q": q_, "k": k_, "v": torch.randn(1, 2, 12, 5, generator=gen) * 1000}
    kern = rx.compile(rx.softmax(q @ k.mT, -1) @ v)
    leaves = {n: t.clone().requires_grad_() for n, t in ins.items()}
    out = kern(**leaves)
    cot = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, list(leaves.values()), cot)
    exact = {n: t.double().requires_grad_() for n, t in ins.items()}
    want = torch.autograd.grad(
        torch.softmax(exact["q"] @ exact["k"].mT, -1) @ exact["v"], list(exact.values()), cot.double()
    )
    scale = max(w.abs().max().item() for w in want)
    for name, a, b in zip(ins, got, want):
        torch.testing.assert_close(
            a.double(), b, atol=3e-5 * scale, rtol=3e-5, msg=lambda m, name=name: f"d{name}: {m}"
        )


def test_attention_written_by_hand_with_mT_writes_no_scores(gen):
    """``q @ k.mT`` (torch's property, as model code writes it) is ``k`` transposed: hand-written
    attention over it is found as ``rx.attention`` is, one launch and no buffer of the scores."""
    assert repr(k.mT) == repr(rx.transpose(k, -2, -1)) == repr(k.mH)
    ins = _inputs(gen, 2, 4, 4, 33, 33, 8, 8, torch.float32)
    expr = rx.softmax(q @ k.mT * 0.25, -1) @ v
    program = rx.compile(expr).program(**ins)
    assert len(program.launched) == 1
    assert all(math.prod(b.shape) < 2 * 4 * 33 * 33 for b in program.buffers)
    _check(expr, ins, lambda r: torch.softmax(r["q"] @ r["k"].mT * 0.25, -1) @ r["v"], torch.float32, 1e-5, 1e-5, gen)


def test_the_compute_model_counts_each_pass_that_computes_the_scores(gen):
    """The forward computes the scores once (the P @ v GEMM's K loop merges their logsumexp as it
    runs and sums the probabilities) and P @ v once: FlashAttention-2's count, the minimum; the
    logsumexp alone is a row kernel of two passes (the statistic, then the row sum), each
    computing the scores' product."""
    ins = _inputs(gen, B_, H_, H_, T_, T_, 8, 8, torch.float32)
    scores = 2 * B_ * H_ * T_ * T_ * 8  # the q @ k.mT product's FLOPs, as P @ v's at Dv = D
    program = rx.compile(rx.attention(q, k, v)).program(**ins)
    assert (program.flops, program.minimum_flops) == (2 * scores, 2 * scores)
    assert rx.compile(rx.attention(q, k, v, return_lse=True)[1]).program(**ins).flops == 2 * scores


def test_the_backward_computes_each_product_once_per_gemm_that_reads_it(gen):
    """The backward's two GEMM kernels recompute what they read in their K loops: ``dS @ k`` the
    scores and ``dO @ v.T`` (3 products), ``dS.T @ q`` beside ``P.T @ dO`` in one K loop the scores
    and ``dO @ v.T`` once for both (4): 7 products, as Triton's fused-attention tutorial computes,
    where the minimum is FlashAttention-2's 5 (dQ summed across key blocks). Planned for sm_90 at
    1 x 32 heads x 4096 x 128 (nothing runs), without a mask (a causal one skips about half the
    tiles: see the block sparsity test)."""
    bf = {"dtype": torch.bfloat16, "requires_grad": True}
    ins = {n: torch.empty(1, 32, 4096, 128, **bf) for n in "qkv"}
    plan = rx.compile(rx.attention(q, k, v)).grad_plan(**ins)
    saved = plan.forward.program(**ins)
    feed = {n: t.detach() for n, t in ins.items()} | {"_g0": torch.empty(1, 32, 4096, 128, dtype=torch.bfloat16)}
    for key, slot in saved.outputs:
        buf = saved.buffers[slot - saved.n_inputs]
        feed[key] = torch.empty(buf.shape, dtype=buf.dtype)
    backward = plan.backward.lower_for(GPU, **{n: feed[n] for n in plan.backward.inputs})
    product = 2 * 32 * 4096 * 4096 * 128
    assert (backward.flops, backward.minimum_flops) == (7 * product, 5 * product)
    assert len(backward.launched) == 3  # the row term and dO over the row sum in one kernel, dQ, dK beside dV
    assert all(math.prod(b.shape) < 32 * 4096 * 4096 for b in backward.buffers)


@pytest.mark.parametrize(
    ("d", "hkv", "planned"),
    [
        (64, 32, {"dQ": (4, 2), "dK + dV": (4, 2)}),
        (128, 32, {"dQ": (4, 2), "dK + dV": (8, 0)}),  # dK + dV's four tiles at 128: 8 warps, sliced
        (128, 8, {"dQ": (8, 0), "dK + dV": (8, 0)}),  # grouped: 5-D coordinates, summed over the group
    ],
)
def test_the_backward_gemms_run_on_four_warps_where_their_tiles_fit(d, hkv, planned):
    """Planned for sm_90 (causal bf16, 32 heads x 4096): dQ's GEMM (its accumulator, the scores and
    ``dO @ v.T`` recomputed) and dK beside dV at head dim 64 fit ``schedule.FOUR_WARP_ELEMENTS`` and
    run on 4 warps, as tutorial 06's backward, with both recomputed products taken whole
    (``GemmTile.whole_k``: the tiles the loop does not move loaded once; sm_90 SASS, warp
    instructions per score: dQ 0.924 -> 0.688 -> 0.492, dK + dV 1.09 -> 0.821 -> 0.604, no
    spills); dK + dV at 128 (two 64 x 128 accumulators) keeps 8 warps and slices, and so do
    grouped-query attention's GEMMs (5-D coordinates: dQ spilled at 4 warps with a partial last
    tile) and a GEMM of three accumulators (q, k and v of one input) that recomputes nothing."""
    bf = {"dtype": torch.bfloat16, "requires_grad": True}
    ins = {n: torch.empty(1, 32 if n == "q" else hkv, 4096, d, **bf) for n in "qkv"}
    plan = rx.compile(rx.attention(q, k, v, causal=True, enable_gqa=hkv != 32)).grad_plan(**ins)
    feed = plan.backward_feed({n: t.detach() for n, t in ins.items()})
    gemms = [c for c in plan.backward.lower_for(GPU, **feed).launched if c.spec.kind == "gemm"]
    got = {
        "dK + dV" if len(c.spec.outputs) == 2 else "dQ": (dict(c.meta)["num_warps"], len(c.spec.gemm.whole_k))
        for c in gemms
    }
    assert got == planned
    x, w = rx.var("x"), [rx.var(f"w{j}") for j in range(3)]
    qkv = rx.compile({f"o{j}": rx.linear(x, w[j]) for j in range(3)})
    mats = {n: torch.empty(4096, 4096, dtype=torch.bfloat16) for n in ("x", "w0", "w1", "w2")}
    assert [dict(c.meta)["num_warps"] for c in qkv.lower_for(GPU, **mats).launched] == [8]


@pytest.mark.parametrize("hkv", [32, 8, 1])  # multi-head, grouped (4 query heads a key head), multi-query
def test_a_half_precision_backward_writes_each_gradient_once_in_its_dtype(hkv):
    """bf16 at 1 x 32 heads x 4096 x 128, causal, planned for sm_90: three launches whatever the
    key/value heads (the row term, dQ, dK beside dV), every buffer bf16 or a per-row statistic.
    Grouped-query dq is ``[B, Hkv, G, T, D]`` regrouped to q's shape: its cast
    is the product's epilogue's and the regrouped bf16 buffer a view (026ffa5 cast after the
    reshape: an fp32 dq of 67 MB written, read back and cast in launches of their own, 6 in all)."""
    bf = {"dtype": torch.bfloat16, "requires_grad": True}
    ins = {n: torch.empty(1, 32 if n == "q" else hkv, 4096, 128, **bf) for n in "qkv"}
    plan = rx.compile(rx.attention(q, k, v, causal=True, enable_gqa=hkv != 32)).grad_plan(**ins)
    backward = plan.backward.lower_for(GPU, **plan.backward_feed({n: t.detach() for n, t in ins.items()}))
    assert len(backward.launched) == 3
    for b in backward.buffers:
        assert b.dtype == torch.bfloat16 or b.shape[-1] == 1, b


def test_dk_and_dv_are_one_k_loop_recomputing_the_scores_once(gen):
    """The dK and dV GEMMs read the same recomputed scores at the same tiles (keys x queries): one
    kernel whose K loop over the queries computes ``q @ k.mT``, ``dO @ v.T`` and the probabilities
    once and sums ``dS.T @ q`` and ``P.T @ dO`` into two accumulators (FlashAttention-2's dK/dV
    loop; analyze.merge_products). Causal with block sparsity, odd sizes, against float64."""
    ins = _inputs(gen, 1, 2, 2, 37, 29, 12, 12, torch.float32)
    kern = rx.compile(rx.attention(q, k, v, causal=True))
    plan = kern.grad_plan(**{n: t.clone().requires_grad_() for n, t in ins.items()})
    sources = plan.backward.sources(**plan.backward_feed(ins))
    assert len(sources) == 3
    both = [src for src in sources if "tl.dot(" in src and src.count("tl.store(") == 2]
    assert len(both) == 1 and "tl.exp(" not in both[0] and "k_lo" in both[0]  # the causal mask's tiles skipped
    for loop in _k_loops(both[0]):
        assert loop.count("tl.dot(") == 4  # the scores, dO @ v.T, dK's, dV's
        assert loop.count("tl.exp2(") == 1  # P once (flush-to-zero exp2 of the scores less their logsumexp)
        # the logsumexp and the row term, one per query, load one row of the tile, masked along it alone
        assert len(re.findall(r"(ks(_f)?)\[None, :\], mask=\1\[None, :\] < K, other=0\)", loop)) == 2
        assert "mask=a_mask" not in loop
    _check(
        rx.attention(q, k, v, causal=True),
        ins,
        lambda r: _reference(r, keep=torch.ones(37, 29).tril().bool())[0],
        torch.float32,
        2e-5,
        2e-5,
        gen,
    )


# ---- block sparsity: tiles the mask's positions rule out are not computed -----------------------------
SPARSE = {  # mask_mod over positions, and its float64 form over (i, j)
    "causal": (lambda b, h, i, j: i >= j, lambda i, j: i >= j),
    "window": (lambda b, h, i, j: (i - j < 40) & (j - i < 40), lambda i, j: (i - j).abs() < 40),
    "prefix": (lambda b, h, i, j: (j < 20) | (i >= j), lambda i, j: (j < 20) | (i >= j)),
    "shifted": (lambda b, h, i, j: i + 30 >= j, lambda i, j: i + 30 >= j),  # (bottom-right causal at Tk = Tq + 30)
}


@pytest.mark.parametrize("mask", list(SPARSE))
def test_tiles_the_mask_rules_out_are_skipped_and_the_result_is_unchanged(mask, gen):
    """130 queries and 97 keys are several of the interpreter's row blocks, column tiles and K
    slices: each loop runs only over the tiles the mask may keep (a scan of the tiles' position
    ranges), forward and every gradient against float64."""
    mod, keep = SPARSE[mask]
    ins = _inputs(gen, 1, 2, 2, 130, 97, 8, 8, torch.float32)
    i, j = torch.arange(130)[:, None], torch.arange(97)[None, :]
    expr = rx.attention(q, k, v, mask_mod=mod)
    _check(expr, ins, lambda r: _reference(r, keep=keep(i, j))[0], torch.float32, 2e-5, 2e-5, gen)


DATA_MASKS = {  # rx.attention's mask arguments over document ids or a padding mask, and their form over (i, j)
    "documents": (lambda dq, dk, m: {"mask_mod": lambda b, h, i, j: dq == dk}, lambda i, j, d, p: d[i] == d[j]),
    "documents, causal": (
        lambda dq, dk, m: {"mask_mod": lambda b, h, i, j: (dq == dk) & (i >= j)},
        lambda i, j, d, p: (d[i] == d[j]) & (i >= j),
    ),
    "padding, causal": (
        lambda dq, dk, m: {"mask_mod": lambda b, h, i, j: m & (i >= j)},
        lambda i, j, d, p: p[j] & (i >= j),
    ),
    "padding": (lambda dq, dk, m: {"attn_mask": m}, lambda i, j, d, p: p[j] & (i >= 0)),  # a bool mask alone
    "2-D": (lambda dq, dk, m: {"attn_mask": m}, lambda i, j, d, p: p[j] & (i >= j)),  # Hugging Face's, causal
}


@pytest.mark.parametrize("mask", list(DATA_MASKS))
def test_tiles_a_mask_of_data_rules_out_are_skipped_on_the_device(mask, gen):
    """Packed documents (ids one per query and one per key), a key padding mask and a 2-D bool mask:
    the kernels scan each tile's range of the ids or the mask (a load and its min and max:
    ``GemmWriter.load_range``) and skip the tiles where no id can match or the mask is false. Keys
    128 on (two of the interpreter's 64-wide K slices) belong to no query's document, or are
    padding, and hold NaN: a tile that ran would multiply them by 0 (NaN, as eager's does); skipped,
    the output and every gradient are those of the first 128 keys alone (NaN everywhere before)."""
    t, d = 256, 16
    docs = torch.arange(t) // 48  # documents of 48 tokens: tiles within, across and between them
    key_docs = torch.where(torch.arange(t) < 128, docs, 99)
    pad = torch.arange(t) < 128
    ins = {n: torch.randn(1, 2, t, d, generator=gen) for n in "qkv"}
    for n in "kv":
        ins[n][..., 128:, :] = float("nan")
    dq, dk, m = rx.var("dq"), rx.var("dk"), rx.var("m")
    args, keep = DATA_MASKS[mask]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    bools = keep(i, j, docs, pad).reshape(1, 1, t, t) if mask == "2-D" else pad.reshape(1, 1, 1, t)
    data = {"dq": docs.reshape(1, 1, t, 1), "dk": key_docs.reshape(1, 1, 1, t), "m": bools}
    kern = rx.compile(rx.attention(q, k, v, **args(dq, dk, m)))
    data = {n: x for n, x in data.items() if n in kern.inputs}
    assert "tl.max(tl.load(" in kern.sources(**ins, **data)[0].replace(
        "tl.max(tl.max(", "tl.max("
    )  # the scan reads them
    kept = keep(i, j[:, :128], docs, pad)  # (key j < 128 is in document docs[j])
    leaves = {n: x.clone().requires_grad_() for n, x in ins.items()}
    out = kern(**leaves, **data)
    cot = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, list(leaves.values()), cot)
    exact = {n: (x[..., :128, :] if n in "kv" else x).double().requires_grad_() for n, x in ins.items()}
    s = (exact["q"] @ exact["k"].mT / d**0.5).masked_fill(~kept, float("-inf"))
    want_out = torch.softmax(s, -1).nan_to_num(0.0) @ exact["v"]  # a query with no key: 0
    want = torch.autograd.grad(want_out, list(exact.values()), cot.double())
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=2e-5)
    for name, g, w in zip("qkv", got, want):
        full = torch.zeros(g.shape, dtype=torch.float64)
        full[..., : w.shape[-2], :] = w  # the keys no query reaches get no gradient
        torch.testing.assert_close(g.double(), full, atol=2e-5, rtol=2e-5, msg=lambda m, name=name: f"d{name}: {m}")


def _planned_flops(expr, extra=None):
    """Forward and backward tensor-core FLOPs planned for sm_90 at 1 x 8 heads x 4096 x 64, bf16."""
    bf = {"dtype": torch.bfloat16}
    ins = {n: torch.empty(1, 8, 4096, 64, **bf, requires_grad=True) for n in "qkv"} | (extra or {})
    kern = rx.compile(expr)
    plan = kern.grad_plan(**ins)
    fwd = plan.forward.lower_for(GPU, **{n: ins[n].detach() for n in plan.forward.inputs})
    feed = {n: t.detach() for n, t in ins.items()} | {"_g0": torch.empty(1, 8, 4096, 64, **bf)}
    for key, slot in fwd.outputs:
        buf = fwd.buffers[slot - fwd.n_inputs]
        feed[key] = torch.empty(buf.shape, dtype=buf.dtype)
    bwd = plan.backward.lower_for(GPU, **{n: feed[n] for n in plan.backward.inputs})
    return fwd.flops, bwd.flops, kern.lower_for(GPU, **{n: ins[n].detach() for n in kern.inputs})


def test_the_compute_model_counts_only_the_tiles_that_run():
    """Causal attention computes about half the tiles (up to the diagonal's, at most 128 of 4096:
    <= 51.6%), a window of 256 under 10%, a padding mask (data, not positions) all of them: the
    model plans without the data (the kernels scan the mask's ranges on the device:
    ``test_tiles_a_mask_of_data_rules_out_are_skipped_on_the_device``)."""
    full = _planned_flops(rx.attention(q, k, v))
    causal = _planned_flops(rx.attention(q, k, v, causal=True))
    window = _planned_flops(rx.attention(q, k, v, causal=True, mask_mod=lambda b, h, i, j: i - j < 256))
    pad = {"m": torch.ones(1, 1, 1, 4096, dtype=torch.bool)}
    padded = _planned_flops(rx.attention(q, k, v, attn_mask=rx.var("m")), pad)
    for part in (0, 1):
        assert 0.5 <= causal[part] / full[part] <= 0.516, part
        assert window[part] / full[part] < 0.1, part
        assert padded[part] == full[part], part
    scans = [(c.spec.gemm.guard is not None) for c in causal[2].kernels]
    assert scans == [True]  # the P @ v GEMM, its logsumexp merged in its K loop
    assert [c.spec.gemm.guard[0] for c in padded[2].kernels] == [Src.LOAD]  # the mask itself


@pytest.mark.parametrize("causal", [False, True])
def test_the_output_and_its_logsumexp_are_one_launch(causal, gen):
    """``return_lse=True`` returns ``m + log(row sum)`` beside the output: the one-pass GEMM merges
    the logsumexp and the row sum in its K loop and writes both values per row (the per-row math
    reading both moves with them: analyze.kloop._online_in_k_loop's ``pending`` sums), the lse's
    ``[B, H, Tq]`` a view of its ``[B, H, Tq, 1]``; bytes moved the minimum (two launches, a
    flat kernel reading the two statistics back, before)."""
    ins = _inputs(gen, 1, 2, 2, 37, 29, 16, 16, torch.float32)
    out, lse = rx.attention(q, k, v, causal=causal, return_lse=True)
    program = rx.compile({"out": out, "lse": lse}).program(**ins)
    assert len(program.launched) == 1
    assert program.bytes_moved == program.minimum_bytes
    keep = torch.ones(37, 29, dtype=torch.bool).tril() if causal else None
    _check((out, lse), ins, lambda r: _reference(r, keep=keep), torch.float32, 2e-5, 2e-5, gen)


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES[1:2] + TOLERANCES[3:], ids=["float32", "bfloat16"])
def test_logsumexp_and_its_gradient(dtype, atol, rtol, gen):
    ins = _inputs(gen, 1, 2, 2, 6, 5, 8, 8, dtype)
    expr = rx.attention(q, k, v, scale=0.3, return_lse=True)
    assert isinstance(expr, tuple) and len(expr) == 2
    _check(expr, ins, lambda r: _reference(r, scale=0.3), dtype, atol, rtol, gen)


def test_score_mods_read_tensors_and_get_their_gradients(gen):
    """Softcap, ALiBi from positions with learned slopes, and a learned relative bias: each tensor
    the score_mod reads is an input with a gradient."""
    b_, h_, t_ = 1, 2, 6
    ins = _inputs(gen, b_, h_, h_, t_, t_, 8, 8, torch.float32)
    ins["slopes"] = torch.rand(1, h_, 1, 1, generator=gen)
    ins["bias"] = torch.randn(h_, t_, t_, generator=gen)
    slopes, bias = rx.var("slopes"), rx.var("bias")

    def mod(s, b, h, qi, ki):
        return 4.0 * rx.tanh(s / 4.0) - slopes * (qi - ki).abs() + bias

    def ref(r):
        dist = (torch.arange(t_)[:, None] - torch.arange(t_)[None, :]).abs()
        qd, kd = r["q"], r["k"]
        s = qd @ kd.mT / math.sqrt(8)
        s = 4.0 * torch.tanh(s / 4.0) - r["slopes"] * dist + r["bias"]
        return torch.softmax(s, -1) @ r["v"]

    _check(rx.attention(q, k, v, score_mod=mod), ins, ref, torch.float32, 2e-5, 2e-5, gen)


def test_mask_mods_sliding_window_and_documents(gen):
    """A sliding window over causal positions and packed documents (ids given as tensors)."""
    ins = _inputs(gen, 1, 2, 2, 9, 9, 8, 8, torch.float32)
    docs = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    ins["dq"], ins["dk"] = docs.reshape(1, 1, 9, 1), docs.reshape(1, 1, 1, 9)
    dq, dk = rx.var("dq"), rx.var("dk")

    def mask(b, h, qi, ki):
        return (qi - ki < 3) & (dq == dk)

    pos = torch.arange(9)
    keep = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < 3) & (docs[:, None] == docs[None, :])
    expr = rx.attention(q, k, v, causal=True, mask_mod=mask)
    _check(expr, ins, lambda r: _reference(r, keep=keep)[0], torch.float32, 2e-5, 2e-5, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_fully_masked_row_gives_zero_and_no_nan(dtype, gen):
    ins = _inputs(gen, 1, 2, 2, 5, 4, 8, 8, dtype)
    expr = rx.attention(q, k, v, mask_mod=lambda b, h, qi, ki: qi >= 2, return_lse=True)
    leaves = {n: t.clone().requires_grad_() for n, t in ins.items()}
    out, lse = rx.compile(expr)(**leaves)
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    assert torch.isneginf(lse[:, :, :2]).all() and torch.isfinite(lse[:, :, 2:]).all()
    (out.float().sum() + lse[:, :, 2:].sum()).backward()
    for n, t in leaves.items():
        assert torch.isfinite(t.grad).all(), f"d/d{n} has NaN or inf"
    assert torch.equal(leaves["q"].grad[:, :, :2], torch.zeros_like(leaves["q"].grad[:, :, :2]))


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_attn_mask_as_sdpa_takes_it(kind, gen):
    ins = _inputs(gen, 2, 2, 2, 5, 6, 8, 8, torch.float32)
    keep = torch.rand(2, 1, 5, 6, generator=gen) > 0.3
    keep[..., 0] = True
    ins["m"] = keep if kind == "bool" else torch.randn(2, 1, 5, 6, generator=gen)
    expr = rx.attention(q, k, v, attn_mask=rx.var("m"))
    mask = ins["m"] if kind == "bool" else ins["m"].double()
    want = F.scaled_dot_product_attention(*(ins[n].double() for n in "qkv"), attn_mask=mask)
    assert_close(rx.compile(expr)(**ins), want, 2e-5, 2e-5, "out")


def test_one_tensor_as_both_queries_and_keys(gen):
    """``q @ q.mT`` (a model's q and k projections tied): the backward's GEMMs recompute a product
    whose two operands are one load, whose strides are one set of parameters (they were declared
    twice: a SyntaxError, found by the model fuzzer)."""
    x = torch.randn(1, 2, 6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    val = torch.randn(1, 2, 6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    out = rx.compile(rx.attention(q, q, v, causal=True))(q=x, v=val)
    want = F.scaled_dot_product_attention(x, x, val, is_causal=True)
    assert_close(out, want, 1e-12, 1e-12, "out")
    cot = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    for name, g, w in zip("qv", torch.autograd.grad(out, [x, val], cot), torch.autograd.grad(want, [x, val], cot)):
        assert_close(g, w, 1e-10, 1e-10, f"d{name}")


def test_dropout_regenerates_its_mask_in_the_backward(gen):
    """With ``v`` the identity, the output is the dropped probabilities themselves, so ``dv`` must be
    ``out.T @ g``: the backward drew the same mask. The kept ones average 1 / (1 - p) of p's sum."""
    t_, p = 16, 0.25
    ins = _inputs(gen, 1, 2, 2, t_, t_, 8, t_, torch.float32)
    ins["v"] = torch.eye(t_).expand(1, 2, t_, t_).contiguous().requires_grad_()
    kern = rx.compile(rx.attention(q, k, v, dropout_p=p, seed=11))
    out = kern(**ins)
    assert torch.equal(out, kern(**ins))  # the same seed: the same mask
    dropped = (out == 0).float().mean()
    assert 0.1 < float(dropped) < 0.4
    torch.testing.assert_close(out.sum(-1).mean(), torch.tensor(1.0), atol=0.15, rtol=0)
    g = torch.randn(out.shape, generator=gen)
    (dv,) = torch.autograd.grad(out, ins["v"], g)
    torch.testing.assert_close(dv, out.mT @ g, atol=1e-5, rtol=1e-5)
    fresh = rx.compile(rx.attention(q, k, v, dropout_p=p))
    assert not torch.equal(fresh(**ins), fresh(**ins))  # seed=None: a new mask per call


def test_lazy_records_scaled_dot_product_attention(gen):
    ins = _inputs(gen, 1, 4, 2, 6, 7, 8, 8, torch.float32)
    f = rx.Fusion()
    lq, lk, lv = (f.lazy(ins[n]) for n in "qkv")
    out = F.scaled_dot_product_attention(torch.relu(lq), lk, lv, is_causal=True, enable_gqa=True)
    want = F.scaled_dot_product_attention(torch.relu(ins["q"]), ins["k"], ins["v"], is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out.torch(), want, atol=2e-5, rtol=2e-5)
    assert f.eager_ops == 0  # recorded, not run eagerly


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: rx.attention(q, k, v, dropout_p=1.0), RtxError, "dropout_p"),
        (lambda: rx.attention(q, k, v, causal=1), RtxError, "causal"),
        (lambda: rx.attention(q, k, v, mask_mod=lambda b, h, i, j: i * 1.0), RtxError, "mask_mod"),
        (lambda: rx.attention(q, k, v, score_mod=lambda s, b, h, i, j: s > 0), RtxError, "score_mod"),
        (lambda: rx.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + rx.var("wide")), ShapeError, "score_mod"),
    ],
    ids=["dropout_p", "causal", "mask_mod-dtype", "score_mod-dtype", "score_mod-shape"],
)
def test_mistakes_name_the_argument(call, error, words, gen):
    ins = _inputs(gen, 1, 2, 2, 3, 4, 8, 8, torch.float32)
    ins["wide"] = torch.zeros(5, 1, 1, 1)
    with pytest.raises(error, match=words):
        kern = rx.compile(call())
        kern(**{n: ins[n] for n in kern.inputs})


@pytest.mark.parametrize(
    "shapes, error, words",
    [
        (((1, 2, 3, 8), (1, 2, 4, 6), (1, 2, 4, 8)), ShapeError, "k has shape"),
        (((1, 2, 3, 8), (1, 2, 4, 8), (1, 2, 5, 8)), ShapeError, "v has shape"),
        (((1, 4, 3, 8), (1, 2, 4, 8), (1, 2, 4, 8)), ShapeError, "enable_gqa"),
        (((2, 3, 8), (2, 4, 8), (2, 4, 8)), ShapeError, "q must be 4-D"),
    ],
    ids=["head-dim", "v-length", "heads", "rank"],
)
def test_shape_mistakes_name_the_input(shapes, error, words):
    ins = {n: torch.zeros(s) for n, s in zip("qkv", shapes)}
    with pytest.raises(error, match=words):
        rx.compile(rx.attention(q, k, v))(**ins)


def test_dtype_mismatch_names_the_input():
    ins = {"q": torch.zeros(1, 1, 2, 4), "k": torch.zeros(1, 1, 2, 4).half(), "v": torch.zeros(1, 1, 2, 4)}
    with pytest.raises(DtypeMismatchError, match="k is torch.float16"):
        rx.compile(rx.attention(q, k, v))(**ins)


def test_torch_backend_is_the_same_math(gen):
    ins = _inputs(gen, 1, 4, 2, 5, 6, 8, 8, torch.float32)
    expr = rx.attention(q, k, v, causal=True, enable_gqa=True, score_mod=lambda s, b, h, i, j: s * (h + 1))
    fused = rx.compile(expr)(**ins)
    ref = rx.compile(expr, config=rx.FusionConfig(backend="torch"))(**ins)
    torch.testing.assert_close(fused, ref, atol=2e-5, rtol=2e-5)


def test_a_new_sequence_length_in_the_same_tiles_compiles_nothing(gen):
    kern = rx.compile(rx.attention(q, k, v, causal=True, score_mod=lambda s, b, h, i, j: s * 0.5))
    kern(**_inputs(gen, 1, 2, 2, 5, 5, 8, 8, torch.float32))
    misses = rx.cache_stats().misses
    for t in (6, 7):  # the same power-of-two tiles as 5: the same kernels, new launch sizes only
        kern(**_inputs(gen, 1, 2, 2, t, t, 8, 8, torch.float32))
    assert rx.cache_stats().misses == misses


# ---- random draws: every feature at once, on odd sizes and each dtype ---------------------------------
def _draw(rnd):
    """One attention: sizes, dtype, and a choice of each feature, with its float64 reference."""
    hkv, g = rnd.choice([1, 2]), rnd.choice([1, 2, 3])
    # one draw in four spans several of the interpreter's tiles (block sparsity skips some), in fp32
    wide = rnd.random() < 0.25
    lengths = (rnd.randint(40, 140), rnd.randint(40, 140)) if wide else (rnd.randint(1, 11), rnd.randint(1, 11))
    size = (1 if wide else rnd.choice([1, 2]), hkv * g, hkv, *lengths, rnd.choice([4, 8, 12]), rnd.choice([3, 8]))
    dtype, atol, rtol = TOLERANCES[1] if wide else rnd.choice(TOLERANCES[1:])
    causal, mod, mask = (
        rnd.random() < 0.5,
        # a bias per head (K and V repeated for grouped heads) or shared by the heads (grouped)
        rnd.choice(["none", "softcap", "bias", "shared_bias", "alibi"]),
        # additive masks far below zero: Hugging Face's padding (finfo.min on a left prefix of the
        # keys, a whole key slice in wide draws) and scores near -200: a row's first finite max
        # under -88 (the one-pass forward's first rescale overflowed there); packed documents (ids per
        # query and per key, sorted: tiles within, across and between documents, skipped on the device)
        rnd.choice(["none", "window", "bool", "float", "padding", "low", "documents"]),
    )
    # one draw in eight takes the keys as queries too (q and k projections tied): one tensor is
    # both operands of the scores' product
    tied = rnd.random() < 0.125
    if tied:
        size = (size[0], hkv, hkv, size[4], size[4], *size[5:])
    return size, (dtype, atol, rtol), causal, mod, mask, rnd.random() < 0.5, tied


@pytest.mark.parametrize("draw", range(16))
def test_random_attentions_match_float64(draw, gen):
    import random

    from conftest import commit_seed

    rnd = random.Random(commit_seed("RTXDSL_ATTENTION_SEED") * 100 + draw)
    size, (dtype, atol, rtol), causal, mod, mask, lse, tied = _draw(rnd)
    b_, hq, hkv, tq, tk, d, dv = size
    ins = _inputs(gen, *size, dtype)
    if tied:
        del ins["q"]
    extra = {}
    if mod in ("bias", "shared_bias"):
        shape = (hq, tq, tk) if mod == "bias" else (tq, tk)
        ins["bias"] = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if mod == "alibi":
        ins["slopes"] = torch.rand(1, hq, 1, 1, generator=gen, dtype=torch.float64)
    if mask in ("bool", "float", "padding", "low"):
        m = (
            torch.rand(b_, 1, tq, tk, generator=gen) > 0.3
            if mask == "bool"
            else torch.randn(b_, 1, tq, tk, generator=gen) - (200.0 if mask == "low" else 0.0)
        )
        if mask == "padding":  # each batch's keys before a random start are padding, or (causal, one
            # draw in two) after an end; left padding under a causal mask leaves the first rows nothing
            # but padding, every score finfo.min: torch's softmax is uniform there
            left = not causal or bool(torch.randint(0, 2, (), generator=gen))
            edge = torch.randint(0 if left else 1, max(tk, 2), (b_, 1, 1, 1), generator=gen)
            pad = torch.arange(tk) < edge if left else torch.arange(tk) >= edge
            m = torch.where(pad, torch.finfo(dtype).min, 0.0)
        ins["m"] = m if mask == "bool" else m.double().to(dtype)
        extra["attn_mask"] = rx.var("m")
    mods = {
        "none": None,
        "softcap": lambda s, *_: 3.0 * rx.tanh(s / 3.0),
        "bias": lambda s, *_: s + rx.var("bias"),
        "shared_bias": lambda s, *_: s + rx.var("bias"),
        "alibi": lambda s, b, h, i, j: s - rx.var("slopes") * (i - j).abs(),
    }
    if mask == "documents":  # some keys in a document no query is in (ids 0-3 against 0-4)
        ins["dq"] = torch.randint(0, 4, (b_, 1, tq, 1), generator=gen).sort(dim=2).values
        ins["dk"] = torch.randint(0, 5, (b_, 1, 1, tk), generator=gen).sort(dim=3).values
    window = {
        "window": lambda b, h, i, j: (i - j < 3) & (j - i < 3),
        "documents": lambda b, h, i, j: rx.var("dq") == rx.var("dk"),
    }.get(mask)
    expr = rx.attention(
        k if tied else q,
        k,
        v,
        causal=causal,
        score_mod=mods[mod],
        mask_mod=window,
        enable_gqa=hq != hkv,
        return_lse=lse,
        **extra,
    )

    def ref(r):
        qd = r["k"] if tied else r["q"]
        kd, vd = r["k"].repeat_interleave(hq // hkv, 1), r["v"].repeat_interleave(hq // hkv, 1)
        s = qd @ kd.mT / math.sqrt(d)
        i, j = torch.arange(tq)[:, None], torch.arange(tk)[None, :]
        s = {
            "none": s,
            "softcap": 3.0 * torch.tanh(s / 3.0),
            "bias": s + r.get("bias", 0),
            "shared_bias": s + r.get("bias", 0),
            "alibi": s - r.get("slopes", 0) * (i - j).abs(),
        }[mod]
        keep = torch.ones(tq, tk, dtype=torch.bool)
        keep = keep & (i >= j) if causal else keep
        keep = keep & ((i - j).abs() < 3) if mask == "window" else keep
        if mask == "bool":
            keep = keep & r["m"]
        if mask == "documents":
            keep = keep & (r["dq"] == r["dk"])
        if mask in ("float", "padding", "low"):
            s = s + r["m"]
        s = s.masked_fill(~keep, float("-inf"))
        lse_ = _logsumexp(s)
        out = _normalized(torch.exp(s - torch.where(torch.isinf(lse_), 0.0, lse_).detach()[..., None]), vd)
        return (out, lse_) if lse else out

    if tied and dtype in (torch.float16, torch.bfloat16):  # k's gradient sums both operands' rounding
        atol *= 2  # (Tk = 1: dS is 0 in float64, bf16's O - v rounding twice over, 0.035 at seed 41)
    _check(expr, ins, ref, dtype, atol, rtol, gen)
    _check_sm90(expr, ins, ref, dtype, atol, rtol, gen)  # and as planned for an H200


# ---- the forward in one pass: online softmax in the P @ v GEMM's K loop (lower/online.py) --------
def _growing(gen, dtype, t=70, d=8, slope=3.0):
    """Scores that grow along every row: ``k``'s rows point along ``q``'s, longer with the key
    position, so each K slice (32 keys under the interpreter) raises the row's max by about
    ``32 * slope``: every slice rescales what the loop summed, and exp at the first slice's
    shift would overflow (scores up to ~200)."""
    u = torch.randn(d, generator=gen, dtype=torch.float64)
    u = u / u.norm()
    pos = torch.arange(t, dtype=torch.float64)[:, None]
    noise = 0.1 * torch.randn(2, 2, t, d, generator=gen, dtype=torch.float64)
    ins = {
        "q": (math.sqrt(d) * u + noise).to(dtype),
        "k": (slope * pos * u + noise).to(dtype),
        "v": torch.randn(2, 2, t, d, generator=gen, dtype=torch.float64).to(dtype),
    }
    return ins


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_one_pass_forward_rescales_as_the_max_grows(gen, dtype, atol, rtol, causal):
    """Values, the logsumexp and every gradient against float64 where the row max moves in every
    K slice: the sums kept at a stale shift (or never rescaled) are off by exp(slice's growth).
    In fp16 / bf16 the scores stay fp32 (``contract(..., dtype=)``): rounded to bf16, scores near
    200 moved the output by 0.33 (eager fp32 SDPA on the same inputs: 0.007)."""
    ins = _growing(gen, dtype)
    expr = rx.attention(q, k, v, causal=causal, return_lse=True)
    assert len(rx.compile(rx.attention(q, k, v, causal=causal)).program(**ins).launched) == 1
    keep = torch.ones(70, 70, dtype=torch.bool).tril() if causal else None

    def ref(r):
        out, lse = _reference(r, keep=keep)
        return out, lse

    _check(expr, ins, ref, dtype, atol, rtol, gen)


def test_the_one_pass_forward_gives_masked_rows_zero_and_nan_rows_nan(gen):
    """A query row with no kept key gives 0 and logsumexp -inf (its running max never leaves -inf:
    the shift stays 0, nothing is summed); a row whose scores hold a NaN is NaN, the others exact."""
    ins = _inputs(gen, 1, 2, 2, 40, 40, 8, 8, torch.float32)
    keep = torch.rand(1, 1, 40, 40, generator=gen) > 0.3
    keep[..., 5, :] = False
    ins["m"] = keep
    expr = rx.attention(q, k, v, attn_mask=rx.var("m"), return_lse=True)
    out, lse = rx.compile(expr)(**ins)
    ref_out, ref_lse = _reference(ins, keep=keep)
    assert torch.equal(out[..., 5, :], torch.zeros_like(out[..., 5, :]))
    assert bool((lse[..., 5] == float("-inf")).all())
    assert_close(out, ref_out, 2e-5, 2e-5, "out")
    assert_close(lse, ref_lse, 2e-5, 2e-5, "lse")
    ins["q"][0, 1, 7, 3] = float("nan")
    out = rx.compile(rx.attention(q, k, v, attn_mask=rx.var("m")))(**ins)
    nan_rows = out.isnan().any(-1)
    assert nan_rows[0, 1, 7] and int(nan_rows.sum()) == 1


def test_the_one_pass_forward_computes_the_scores_once_per_k_slice(gen):
    """The generated GEMM: one kernel, the scores' product one inner ``tl.dot`` loop (the row
    kernel that computed them a first time for the logsumexp is gone), one exp per score, the
    scores masked once (the operand and the row sum read their exp as it is), the running max
    rescaling the accumulator, one store (the output); the logsumexp a backward saves is that
    kernel's per-row output. On sm_90 the head dim is one slice of the scores' product
    (``Target.whole_k``): ``q``'s tile is loaded once before the loop, as tutorial 06 loads it."""
    ins = _inputs(gen, 1, 2, 2, 37, 37, 16, 16, torch.float32)
    kern = rx.compile(rx.attention(q, k, v, causal=True))
    (src,) = kern.sources(**ins)
    loops = _k_loops(src)
    for loop in loops:
        assert loop.count("tl.dot(") == 2  # q @ k.mT (in its K0 loop), P @ v
        assert loop.count("tl.exp2(") == 1  # one exp per score (base 2: at most 1, the running max's term)
        assert loop.count("tl.exp(") == 1  # per row: the rescale
        assert len(re.findall(r"tl\.where\(a_mask(_f)?, ", loop)) == 1  # the scores masked once: exp 0 outside
        assert loop.count("acc = acc * rescale") == 1
    assert src.count("tl.exp(") == src.count("acc = acc * rescale") == len(loops) + 1  # and once after the loop
    assert src.count("tl.store(") == 1
    leaves = {n: t.clone().requires_grad_() for n, t in ins.items()}
    assert len(kern.grad_plan(**leaves).forward.program(**ins).launched) == 1
    from rtxdsl.build import prepare

    (gpu,) = (c.source for c in prepare(kern, ins)[1])
    loop = gpu.index(_k_loops(gpu)[0])  # the key slices (block sparsity's bounds)
    assert gpu.count("tl.load(q_ptr") == 1 and gpu.index("tl.load(q_ptr") < loop
    assert all(loop.count("tl.dot(") == 2 for loop in _k_loops(gpu))
    assert "for kk_start" not in gpu  # one slice: no loop over the head dim


@pytest.mark.parametrize("d", [64, 80], ids=["head dim 64", "80: a masked slice of 128"])
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES[1:])
def test_the_sm90_forward_runs_right_under_the_interpreter(gen, d, dtype, atol, rtol):
    """The forward as planned for sm_90 (128 rows, the head dim one slice, ``q`` loaded once, one
    FMA per score in half precision), run under the interpreter at the GPU's launch choices
    (``rx.memory_trace``): values against float64, causal over two key slices and a padding mask."""
    ins = _inputs(gen, 1, 2, 2, 70, 75, d, d, dtype)
    keep = torch.rand(1, 1, 1, 75, generator=gen) > 0.2
    cases = ((rx.attention(q, k, v, causal=True), None), (rx.attention(q, k, v, attn_mask=rx.var("m")), keep))
    for expr, mask in cases:
        extra = {} if mask is None else {"m": mask}
        out = rx.memory_trace(rx.compile(expr), target=GPU, **ins, **extra).result
        ref = _reference(ins, keep=torch.ones(70, 75, dtype=torch.bool).tril() if mask is None else mask)
        assert_close(out, ref[0] if isinstance(ref, tuple) else ref, atol, rtol, "out")


# head dim 64: both GEMMs on 4 warps take their two products whole, and read k (dQ), q and dO
# (dK + dV) as the tiles those load, transposed; 80: dQ alone (dK + dV's 128 x 128 x 32 tiles keep
# 8 warps and slices)
@pytest.mark.parametrize(
    ("d", "whole", "trans"), [(64, 2, 3), (80, 1, 1)], ids=["head dim 64", "80: a masked slice of 128"]
)
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES[2:])  # 16-bit operands: 4 warps
def test_the_sm90_backward_runs_right_under_the_interpreter(gen, d, whole, trans, dtype, atol, rtol):
    """The backward's GEMMs as planned for sm_90 (the recomputed products taken whole: ``q`` and
    ``dO`` loaded once before dQ's loop over keys, ``k`` and ``v`` before dK + dV's over queries;
    an operand the K loop reads twice, once per product, loaded once: ``params.transposed_operands``),
    run under the interpreter at the GPU's launch choices (``rx.memory_trace``): every gradient
    against float64, causal, 70 queries over 75 keys (two slices of each, the last partial)."""
    from rtxdsl.build import prepare

    ins = _inputs(gen, 1, 2, 2, 70, 75, d, d, dtype)
    leaves = {n: t.clone().requires_grad_() for n, t in ins.items()}
    plan = rx.compile(rx.attention(q, k, v, causal=True)).grad_plan(**leaves)
    cot = torch.randn(1, 2, 70, d, generator=gen, dtype=torch.float64)
    feed = ins | plan.forward(**ins) | {"_g0": cot.to(dtype)}
    feed = {n: feed[n] for n in plan.backward.inputs}
    gemms = [c.source for c in prepare(plan.backward, feed, target=GPU)[1] if "tl.dot(" in c.source]
    assert len(gemms) == 2 and sum("for kk_start" not in src for src in gemms) == whole  # no loop over the head dim
    assert sum(_k_loops(src)[-1].count("tl.trans(") for src in gemms) == trans  # (in each loop of a split one)
    got = rx.memory_trace(plan.backward, target=GPU, **feed).result
    leaves = {n: t.double().requires_grad_() for n, t in ins.items()}
    keep = torch.ones(70, 75, dtype=torch.bool).tril()
    want = _grads(_reference(leaves, keep=keep)[0], list(leaves.values()), cot)
    for n, a, e in zip("qkv", got if isinstance(got, tuple) else tuple(got.values()), want):
        assert_close(a, e, atol * max(1.0, float(e.abs().max())), rtol, f"d/d{n}")


SOFTCAP = lambda s, b, h, i, j: 30 * rx.tanh(s / 30)  # noqa: E731 - a score_mod


@pytest.mark.parametrize(
    ("d", "score_mod", "tile", "warps"),
    [(64, None, (64, 64, 64), 4), (128, None, (128, 128, 32), 8), (128, SOFTCAP, (64, 128, 64), 8)],
    ids=["64: 4 warps", "128", "128 softcapped: costlier math per score"],
)
def test_an_eight_warp_dk_dv_keeps_its_rows_and_halves_its_k_slice(d, score_mod, tile, warps):
    """dK + dV at head dim 128 runs on 8 warps: as planned for sm_90 it takes tutorial 06's shape,
    128 keys a program and 32 queries a K slice (``schedule.inner_slices``), where halving its rows
    to 64 recomputed each product over twice the programs (compiled, causal bf16 32 x 4096: 0.961
    -> 0.812 warp instructions per score below the diagonal, 238 registers, no spill). On 4 warps
    (head dim 64) the tile stays 64 x 64, and so does a softcapped one's (its tanh and derivative
    cost 39 a score, over ``CHEAP_SCORE_COST``: at 128 rows it spilled 20 bytes)."""
    from rtxdsl.build import prepare

    ins = {n: torch.empty(1, 4, 4096, d, dtype=torch.bfloat16) for n in "qkv"}
    kern = rx.compile(rx.attention(q, k, v, causal=True, score_mod=score_mod))
    plan = kern.grad_plan(**{n: t.requires_grad_() for n, t in ins.items()})
    program, _ = prepare(plan.backward, plan.backward_feed(ins), target=GPU)
    (meta,) = [dict(c.meta) for c in program.kernels if c.spec.kind == "gemm" and len(c.spec.outputs) == 2]
    assert (meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"], meta["num_warps"]) == (*tile, warps)


def test_grouped_attention_at_head_dim_256_plans_its_backward_for_sm90(gen):
    """Gemma's shape (head dim 256, 4 query heads a key/value head), causal, as planned for sm_90:
    dK and dV sum the group in their programs, so no chunk loop computes their recomputed scores
    (``chunk._reader``; the chunk's kernels keep one batch a program: an AssertionError in
    codegen, found by a register sweep). Every gradient against float64 under the interpreter."""
    ins = _inputs(gen, 1, 4, 1, 70, 70, 256, 256, torch.float32)
    plan = rx.compile(rx.attention(q, k, v, causal=True, enable_gqa=True)).grad_plan(
        **{n: t.clone().requires_grad_() for n, t in ins.items()}
    )
    cot = torch.randn(1, 4, 70, 256, generator=gen, dtype=torch.float64)
    feed = ins | plan.forward(**ins) | {"_g0": cot.float()}
    got = rx.memory_trace(plan.backward, target=GPU, **{n: feed[n] for n in plan.backward.inputs}).result
    leaves = {n: t.double().requires_grad_() for n, t in ins.items()}
    want = _grads(_reference(leaves, keep=torch.ones(70, 70, dtype=torch.bool).tril())[0], list(leaves.values()), cot)
    for n, a, e in zip("qkv", got if isinstance(got, tuple) else tuple(got.values()), want):
        assert_close(a, e, 2e-5 * max(1.0, float(e.abs().max())), 2e-5, f"d/d{n}")


def test_autotune_keeps_the_columns_one_block_where_an_operand_is_a_recomputed_tile_transposed():
    """dQ's ``dS @ k`` reads ``k`` as the transposed tile its recomputed scores loaded (head dim
    128, sm_90): its columns are one block of the slice, in every tile autotune may try (a
    64-column candidate would read half the tile)."""
    from rtxdsl.lower.params import transposed_operands
    from rtxdsl.lower.schedule import candidates

    bf = {"dtype": torch.bfloat16, "requires_grad": True}
    ins = {n: torch.empty(1, 32, 4096, 128, **bf) for n in "qkv"}
    plan = rx.compile(rx.attention(q, k, v, causal=True)).grad_plan(**ins)
    feed = plan.backward_feed({n: t.detach() for n, t in ins.items()})
    (dq,) = [c for c in plan.backward.lower_for(GPU, **feed).launched if transposed_operands(c.spec)]
    options = candidates(dq.spec, dq.meta, dq.grid, dq.args)
    assert len(options) > 1 and {m["BLOCK_N"] for m, _ in options} == {128}


@pytest.mark.parametrize("tk", [1, 2, 45], ids=["one key", "two keys", "two K slices"])
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES[1:3])
def test_hand_written_attention_over_few_keys(gen, tk, dtype, atol, rtol):
    """``softmax(q @ k.mT) @ v`` with gradients at any key length: over one key the softmax's
    logsumexp runs in a kernel of its own, and the GEMM reading it shifts by the saved statistic
    (the model fuzzer's program 2026121000112 raised KeyError there)."""
    ins = _inputs(gen, 1, 3, 3, 5, tk, 4, 4, dtype)
    expr = rx.softmax(q @ k.mT * 0.5, -1) @ v
    _check(expr, ins, lambda r: torch.softmax(r["q"] @ r["k"].mT * 0.5, -1) @ r["v"], dtype, atol, rtol, gen)


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES[1:])
def test_the_one_pass_forward_survives_scores_far_below_zero(gen, dtype, atol, rtol):
    """Rows whose first finite scores lie under -88: Hugging Face's padding mask (``finfo.min``
    added) over a whole key slice on the left, and a bias of -200 on every score. The running max's
    first rescale is exp(-inf) = 0, never exp(0 - max) = inf: every such row was NaN (found by a
    fuzzer of attention drawing ALiBi on long rows and left-padded batches)."""
    ins = _inputs(gen, 2, 2, 2, 9, 70, 8, 8, dtype)
    pad = torch.zeros(2, 1, 1, 70, dtype=dtype)
    pad[0, ..., :40] = torch.finfo(dtype).min  # the first batch's 40 leftmost keys are padding
    expr = rx.attention(q, k, v, attn_mask=rx.var("m"))
    _check(expr, ins | {"m": pad}, lambda r: _reference(r, bias=r["m"])[0], dtype, atol, rtol, gen)
    low = torch.full((1, 1, 9, 70), -200.0, dtype=dtype)
    _check(expr, ins | {"m": low}, lambda r: _reference(r, bias=r["m"])[0], dtype, atol, rtol, gen)


def test_hand_written_softmax_over_a_row_of_a_finite_minimum_averages_v(gen):
    """A row every key of which is masked with -1e9 (``masked_fill``, as model code writes it): in
    fp32 the scores are all -1e9, so torch's softmax is uniform and the output v's mean. The
    logsumexp rounds to -1e9 there, and ``exp(x - lse)`` is 1 for every key: softmax divides by
    its row's total (``softmax_parts``), or it gives the sum of v."""
    ins = _inputs(gen, 1, 1, 1, 4, 8, 8, 8, torch.float32)
    keep = torch.ones(4, 8, dtype=torch.bool)
    keep[1] = False
    expr = rx.softmax(rx.where(rx.var("m"), q @ k.mT * 0.35, -1e9), -1) @ v
    out = rx.compile(expr)(**ins, m=keep)
    ref = torch.softmax((ins["q"] @ ins["k"].mT * 0.35).masked_fill(~keep, -1e9), -1) @ ins["v"]
    assert_close(out, ref, 1e-5, 1e-5, "out")
    assert_close(out[0, 0, 1], ins["v"][0, 0].mean(0), 1e-5, 1e-5, "the masked row")


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES[1:])
def test_hugging_faces_eager_attention_over_left_padding_matches_float64(gen, dtype, atol, rtol):
    """Hugging Face's eager attention as its models write it: ``finfo.min`` added where a key is
    padding or in the future, ``softmax(..., dtype=float32).to(dtype) @ v``. Left padding under a
    causal mask leaves a padded query's row with every key at ``finfo.min``: uniform in torch,
    forward and gradients (the sum of ``v``, and gradients ``n`` times too large, before the
    softmax divided by its row's total). One kernel for the forward."""
    ins = _inputs(gen, 2, 2, 2, 11, 11, 8, 8, dtype)
    keep = torch.ones(2, 1, 11, 11, dtype=torch.bool).tril()
    keep[0, ..., :4] = False  # the first batch's 4 leftmost keys are padding: its 4 first rows see none
    bias = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
    scores = rx.cast(q @ k.mT * 0.35 + rx.var("m"), torch.float32)
    expr = rx.cast(rx.softmax(scores, -1), dtype) @ v
    assert len(rx.compile(expr).program(**ins, m=bias).launched) == 1

    def ref(r):
        p = torch.softmax(r["q"] @ r["k"].mT * 0.35 + r["m"], -1)
        return p @ r["v"]

    _check(expr, ins | {"m": bias}, ref, dtype, atol, rtol, gen)


def test_hand_written_attention_gradients_at_large_scores_match_eagers_error(gen):
    """fp32 ``softmax(q @ k.mT * s) @ v`` with scores near 100 (q 16x): its gradient recomputes
    ``P = exp(s - lse)`` from scores summed again, so the forward and every backward kernel must
    sum ``q @ k.mT`` in one order (on the interpreter, slices of the same width:
    ``Target.whole_k``). One whole slice in the forward made dq and dk 10x eager's error."""
    d, sc = 64, 0.125
    qd = torch.randn(1, 2, 24, d, generator=gen, dtype=torch.float64) * 16
    kd, vd = (torch.randn(1, 2, 70, d, generator=gen, dtype=torch.float64) for _ in range(2))
    cot = torch.randn(1, 2, 24, d, generator=gen, dtype=torch.float64)
    kern = rx.compile(rx.softmax(q @ k.mT * sc, -1) @ v)
    grads = {}
    for lib, dt in (("rx", torch.float32), ("eager", torch.float32), ("f64", torch.float64)):
        leaves = [t.to(dt).requires_grad_() for t in (qd, kd, vd)]
        if lib == "rx":
            out = kern(q=leaves[0], k=leaves[1], v=leaves[2])
        else:
            out = torch.softmax(leaves[0] @ leaves[1].mT * sc, -1) @ leaves[2]
        grads[lib] = torch.autograd.grad(out, leaves, cot.to(dt))
    for name, a, b, r in zip("qkv", grads["rx"], grads["eager"], grads["f64"]):
        err, eager = ((x.double() - r).abs().max().item() for x in (a, b))
        assert err <= 3 * eager + 1e-6 * r.abs().max().item(), (name, err, eager)


@pytest.mark.parametrize(
    "dtype, fill",
    [
        (torch.float16, torch.finfo(torch.float16).min),  # Hugging Face's padding mask
        (torch.bfloat16, -1e4),  # a large additive mask, spacing 64: bf16's finfo.min rounds no score
    ],
)
def test_scores_also_returned_in_half_precision_give_eagers_gradients(dtype, fill, gen):
    """The scores returned beside the output are stored rounded and the forward's logsumexp is of
    the rounded scores: the backward reads them back as stored (``vjp._half_output``). Recomputed
    unrounded, a row masked at ``finfo.min`` no longer summed to one under that logsumexp: dv 106
    off where eager fp16 is 1.9 off (model fuzzer program 2026122400033)."""
    q, k, v = (torch.randn(1, 4, 8, generator=gen).to(dtype) for _ in range(3))
    mask = torch.zeros(4, 4, dtype=dtype)
    mask[0] = fill  # a fully masked query row
    cot = torch.randn(1, 4, 8, generator=gen).to(dtype)
    Q, K, V, M = rx.var("q"), rx.var("k"), rx.var("v"), rx.var("m")
    s = Q @ rx.transpose(K, -2, -1) + M
    kernel = rx.compile({"o": rx.softmax(s, -1) @ V, "s": s})

    def grads(fn, dt):
        ins = [t.to(dt).requires_grad_() for t in (q, k, v)]
        return [g.double() for g in torch.autograd.grad(fn(*ins), ins, cot.to(dt))]

    want = grads(lambda a, b, c: torch.softmax(a @ b.mT + mask.double(), -1) @ c, torch.float64)
    eager = grads(lambda a, b, c: torch.softmax(a @ b.mT + mask, -1) @ c, dtype)
    got = grads(lambda a, b, c: kernel(q=a, k=b, v=c, m=mask)["o"], dtype)
    for name, g, e, w in zip("qkv", got, eager, want):
        assert (g - w).abs().max() <= 1.1 * (e - w).abs().max() + 1e-3, f"d{name}"  # eager's rounding, no more


@pytest.mark.parametrize(
    "shape",
    [
        (1, 3, 5, 6),  # tiny heads, as the fuzzer's: a row of 5 keys
        (1, 2, 33, 16),  # keys past one 32-wide tile
    ],
)
def test_hugging_faces_bf16_attention_backward_sums_dp_times_p_unrounded(shape, gen):
    """Hugging Face's eager attention in bf16, ``softmax(s, dtype=float32).to(bf16) @ v``: the
    backward's ``sum(dP * P)`` is ``dO . (E @ v) / total**2`` from the forward's unnormalized product,
    which the forward saves at its accumulator's dtype (``online.normalized_after``). Saved rounded
    to bf16, ``dP - sum(dP * P)`` lost what the rounding moved, most where the values share an offset
    (a mean the rows carry, here 8): q's and k's gradients 3-5x eager's error, a projection weight's
    17x in the model fuzzer's program 2026130100046; now within 1.6x."""
    bf = torch.bfloat16
    Q, K, V = rx.var("q"), rx.var("k"), rx.var("v")
    s = (Q * 0.408) @ rx.transpose(K, -1, -2)
    kernel = rx.compile(rx.cast(rx.softmax(rx.cast(s, torch.float32), -1), bf) @ V)

    def eager(a, b, c):
        return torch.softmax((a * 0.408) @ b.mT, -1, dtype=torch.float32).to(a.dtype) @ c

    worst = 0.0  # the largest ratio to eager's error over four draws (one draw's ratio is noisy)
    for _ in range(4):
        q_, k_ = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 for _ in range(2))
        ins = [q_, k_, torch.randn(shape, generator=gen, dtype=torch.float64) + 8]
        cot = torch.randn(shape, generator=gen, dtype=torch.float64)

        def grads(fn, dt, ins=ins, cot=cot):
            leaves = [t.to(dt).requires_grad_() for t in ins]
            return [g.double() for g in torch.autograd.grad(fn(*leaves), leaves, cot.to(dt))]

        want = grads(lambda a, b, c: torch.softmax((a * 0.408) @ b.mT, -1) @ c, torch.float64)
        errors = zip(grads(lambda a, b, c: kernel(q=a, k=b, v=c), bf), grads(eager, bf), want)
        worst = max(worst, *((g - w).abs().max().item() / (e - w).abs().max().item() for g, e, w in errors))
    assert worst <= 1.6, worst  # saved rounded: 2.0 to 3.0


@pytest.mark.parametrize(
    "q_shape, kv_shape",
    [
        ((1, 0, 3, 4), (1, 0, 3, 4)),  # no head (x[1:][1:] of a [2, 3, 4]): hq // hkv divided by zero
        ((0, 2, 3, 4), (0, 2, 3, 4)),  # no batch
        ((1, 2, 0, 4), (1, 2, 3, 4)),  # no query
        ((1, 2, 3, 0), (1, 2, 3, 0)),  # a head dim of 0: 1 / sqrt(0) divided by zero
    ],
)
def test_attention_over_an_empty_axis_is_eagers(q_shape, kv_shape, gen):
    """SDPA of lazy tensors with an empty axis gives eager's empty result, and gradients (lazy
    fuzzer program 2027812400026 raised ZeroDivisionError at the flush)."""
    q, k, v = (torch.randn(s, generator=gen).requires_grad_() for s in (q_shape, kv_shape, kv_shape))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    f = rx.Fusion()
    got = F.scaled_dot_product_attention(f.lazy(q), f.lazy(k), f.lazy(v), is_causal=True).torch()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    assert all(g.shape == t.shape for g, t in zip(grads, (q, k, v)))


# ---- split-KV decoding: a long cache's keys split into chunks, one program each, then merged ---------
FP32, BF16 = (torch.float32, 2e-5, 2e-5), (torch.bfloat16, 2e-2, 2e-2)


# the split and the merge do not depend on the dtype: each case runs in one, the masked one in both
@pytest.mark.parametrize(
    "hq, hkv, mods, dtype, atol, rtol",
    [
        (4, 2, {}, *FP32),  # grouped: the chunks of each key head's group
        (2, 2, {"softcap": True}, *BF16),  # one query head per key head, a score function
        (4, 1, {"padding": True}, *FP32),  # multi-query, a key padding mask ([Tk]) beside the chunks' positions
        (4, 1, {"padding": True}, *BF16),
    ],
)
def test_a_decoding_step_over_a_long_cache_splits_its_keys_and_merges_them(
    hq, hkv, mods, dtype, atol, rtol, monkeypatch, gen
):
    """One query per head over 300 keys (``SPLIT_KV``'s threshold lowered from 4,096 for the
    interpreter): the keys split into chunks of their own programs (a batch axis of the product,
    its positions guarding the tiles: each program runs its chunk's tiles only), each chunk's
    output and logsumexp merged by a row kernel over the chunks. Output, logsumexp and every
    gradient against float64, and the chunks' programs in the plan (``b * heads * chunks``)."""
    monkeypatch.setitem(attention_ops.SPLIT_KV, "min_keys", 256)
    tk, d = 300, 8
    ins = _inputs(gen, 1, hq, hkv, 1, tk, d, d, dtype)
    extra, keep = {}, torch.ones(1, tk, dtype=torch.bool)
    if mods.get("padding"):
        ins["m"] = (torch.arange(tk) < 190) & (torch.arange(tk) % 5 != 0)
        extra["attn_mask"] = rx.var("m")
        keep = ins["m"][None, :]
    if mods.get("softcap"):
        extra["score_mod"] = lambda s, *_: 3.0 * rx.tanh(s / 3.0)
    expr = rx.attention(q, k, v, enable_gqa=hq != hkv, return_lse=True, **extra)

    def ref(r):
        kd, vd = r["k"].repeat_interleave(hq // hkv, 1), r["v"].repeat_interleave(hq // hkv, 1)
        s = r["q"] @ kd.mT / math.sqrt(d)
        s = 3.0 * torch.tanh(s / 3.0) if mods.get("softcap") else s
        s = s.masked_fill(~keep, float("-inf"))
        return torch.softmax(s, -1) @ vd, torch.logsumexp(s, -1)

    _check(expr, ins, ref, dtype, atol, rtol, gen)
    program = rx.compile(expr).lower_for(GPU, **{n: t for n, t in ins.items()})
    (split,) = [c for c in program.kernels if c.spec.gemm is not None and c.spec.gemm.guard is not None]
    chunks = min(16, 128 // hkv)
    assert math.prod(split.grid) == hkv * chunks  # one program per key head and chunk (a row tile each)
    # a step with no key at all: output 0 and logsumexp -inf, as the whole step's (the merge gave 0)
    ins["m"] = torch.zeros(tk, dtype=torch.bool)
    out, lse = rx.compile(rx.attention(q, k, v, enable_gqa=hq != hkv, attn_mask=rx.var("m"), return_lse=True))(**ins)
    assert not out.any() and bool((lse == float("-inf")).all())


@pytest.mark.parametrize(
    "hq, hkv, mask_shape, dtype, atol, rtol",
    [
        (4, 2, (2, 1, 1, 300), *FP32),  # Hugging Face's 4-D padding mask of a batch, grouped query heads
        (4, 2, (2, 1, 1, 300), *BF16),
        (4, 4, (2, 4, 1, 300), *BF16),  # a mask per head (not grouped: a head axis of its own)
        (4, 2, (1, 300), *FP32),  # SDPA's [Tq, Tk]
    ],
)
def test_a_decoding_step_with_a_batch_or_head_mask_splits_too(hq, hkv, mask_shape, dtype, atol, rtol, monkeypatch, gen):
    """``attn_mask`` only broadcasts against the scores, so a mask with batch, head and query axes
    takes a chunk axis of one (a view read by the chunks' GEMM, no kernel of its own) and the step
    splits as with a key padding mask (it stayed one program per head). Two sequences, different
    padding; output, logsumexp and every gradient against float64; the chunks' programs."""
    monkeypatch.setitem(attention_ops.SPLIT_KV, "min_keys", 256)  # (4,096 on a GPU; the interpreter is slow)
    b, tk, d = 2, 300, 8
    ins = _inputs(gen, b, hq, hkv, 1, tk, d, d, dtype)
    ins["m"] = torch.rand(mask_shape, generator=gen) < 0.7
    expr = rx.attention(q, k, v, enable_gqa=hq != hkv, attn_mask=rx.var("m"), return_lse=True)
    _check(expr, ins, lambda r: _reference(r, keep=ins["m"]), dtype, atol, rtol, gen)
    program = rx.compile(expr).lower_for(GPU, **ins)
    (split,) = [c for c in program.kernels if c.spec.gemm is not None]
    heads = hkv if mask_shape[-3:-2] != (hq,) else hq
    assert math.prod(split.grid) == b * heads * min(16, 128 // (b * heads))
    assert "m" in split.spec.names  # the mask read by the chunks' GEMM, not computed apart


def test_a_statistic_kept_out_of_a_k_loop_where_it_would_make_kernels_read_each_other(gen):
    """Chunks of attention merged by hand, ``sum_c exp(lse_c - logsumexp_c(lse_c)) * (P_c @ v)``:
    merging each chunk's logsumexp into the ``P @ v`` GEMM's K loop (online softmax) while that
    GEMM's epilogue multiplies by weights computed from it in another kernel made the two
    kernels read each other (graphlib.CycleError at planning, before ``analyze.groups.cyclic``). Such a
    move is undone; the result against float64."""
    qv, kv, vv = rx.var("q"), rx.var("k"), rx.var("v")
    s = qv @ rx.transpose(kv, -1, -2)
    lse = rx.logsumexp(s, -1, keepdim=True)
    out = rx.sum(rx.exp(lse - rx.logsumexp(lse, 1, keepdim=True)) * (rx.exp(s - lse) @ vv), 1)
    ins = {"q": torch.randn(2, 3, 5, 4, generator=gen), "k": torch.randn(2, 1, 7, 4, generator=gen)}
    ins["v"] = torch.randn(2, 1, 7, 6, generator=gen)
    got = rx.compile(out)(**ins)
    d = {n: t.double() for n, t in ins.items()}
    sc = d["q"] @ d["k"].mT
    chunk = torch.logsumexp(sc, -1, keepdim=True)
    want = (torch.exp(chunk - torch.logsumexp(chunk, 1, keepdim=True)) * (torch.exp(sc - chunk) @ d["v"])).sum(1)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_grouped_attention_over_document_ids_compares_them_per_tile(gen):
    """Grouped-query attention with ``mask_mod=lambda b, h, i, j: doc_q == doc_k``: the ids compare
    at the scores' tiles (``_template`` keeps elementwise math over its tensors in the template),
    read through their group-axis views, and the scan skips the tiles between documents. Lifted
    whole, ``doc_q == doc_k`` was a ``[Tq, Tk]`` bool computed by a kernel of its own and written
    (2 launches, 300,000 bytes where the minimum is 120,000). Keys no query's document holds are
    NaN: the output and every gradient those of the others."""
    t, d = 256, 16
    docs = torch.arange(t) // 48
    key_docs = torch.where(torch.arange(t) < 128, docs, 99)
    ins = {n: torch.randn(1, h, t, d, generator=gen) for n, h in (("q", 4), ("k", 2), ("v", 2))}
    for n in "kv":
        ins[n][..., 128:, :] = float("nan")
    data = {"dq": docs.reshape(1, 1, t, 1), "dk": key_docs.reshape(1, 1, 1, t)}
    kern = rx.compile(rx.attention(q, k, v, enable_gqa=True, mask_mod=lambda b, h, i, j: rx.var("dq") == rx.var("dk")))
    summary = kern.summary(**ins, **data)
    assert summary.kernels == 1 and summary.bytes_moved == summary.bytes_minimum
    assert "tile_keep = (tl.max(tl.load(dk_ptr" in kern.sources(**ins, **data)[0]
    leaves = {n: x.clone().requires_grad_() for n, x in ins.items()}
    out = kern(**leaves, **data)
    cot = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, list(leaves.values()), cot)
    exact = {n: (x[..., :128, :] if n in "kv" else x).double().requires_grad_() for n, x in ins.items()}
    s = exact["q"] @ exact["k"].repeat_interleave(2, 1).mT / d**0.5
    s = s.masked_fill(~(docs[:, None] == docs[None, :128]), float("-inf"))
    want_out = torch.softmax(s, -1).nan_to_num(0.0) @ exact["v"].repeat_interleave(2, 1)
    want = torch.autograd.grad(want_out, list(exact.values()), cot.double())
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=2e-5)
    for name, g, w in zip("qkv", got, want):
        full = torch.zeros(g.shape, dtype=torch.float64)
        full[..., : w.shape[-2], :] = w
        torch.testing.assert_close(g.double(), full, atol=2e-5, rtol=2e-5, msg=lambda m, name=name: f"d{name}: {m}")


# (costs per score, OpDef.cost summed over the prologues: causal 20, a softcap's tanh and its
# derivative's exp 39)
@pytest.mark.parametrize(("score_mod", "loops"), [(None, 2), (lambda s, b, h, i, j: 30 * rx.tanh(s / 30), 1)])
def test_a_four_warp_dk_dv_splits_its_loop_where_its_math_per_score_leaves_registers(score_mod, loops):
    """dK + dV at head dim 64 runs on 4 warps with two accumulators: planned for sm_90 its K loop
    splits where the prologues' math per score costs at most ``CHEAP_SCORE_COST`` (compiled, causal
    bf16 32 x 4096: 197 registers, warp instructions per score below the diagonal 0.529 -> 0.396),
    not for a softcap's (split, it spilled 4 bytes at 255 registers)."""
    from rtxdsl.build import prepare

    ins = {n: torch.empty(1, 2, 300, 64, dtype=torch.bfloat16) for n in "qkv"}
    kern = rx.compile(rx.attention(q, k, v, causal=True, score_mod=score_mod))
    plan = kern.grad_plan(**{n: t.clone().requires_grad_() for n, t in ins.items()})
    program, compiled = prepare(plan.backward, plan.backward_feed(ins), target=GPU)
    calls = zip(compiled, program.kernels)
    ((src, meta),) = [(c.source, dict(k.meta)) for c, k in calls if k.spec.kind == "gemm" and len(k.spec.outputs) == 2]
    assert meta["num_warps"] == 4 and len(_k_loops(src)) == loops


# head dim 80: every GEMM on 8 warps, or dQ's on 4 (one accumulator, no online softmax), splits;
# 64: dK + dV on 4 warps too (two accumulators, its prologues' math per score within
# CHEAP_SCORE_COST); the forward (online softmax, 253 registers of 255 split) keeps one loop
@pytest.mark.parametrize(
    ("d", "window", "split"),
    [
        (80, None, {"forward": 2, "dQ": 2, "dK + dV": 2}),
        (64, None, {"forward": 1, "dQ": 2, "dK + dV": 2}),
        (80, 129, {"forward": 2, "dQ": 2, "dK + dV": 2}),  # a sliding window: its full slices in the middle
    ],
)
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES[2:3])
def test_causal_key_slices_below_the_diagonal_run_in_a_loop_without_the_mask(gen, d, window, split, dtype, atol, rtol):
    """As planned for sm_90, a guarded K loop runs as two where registers allow
    (``GemmWriter._split_loop``, ``_roomy``): the slices across the diagonal (``k_start`` stepping
    over the others), then those below it, where the causal compare is ``| True`` and Triton
    folds it and every select by it (sm_90, causal bf16 32 x 4096, warp instructions per score in
    that loop: the forward 0.519 -> 0.432 at head dim 128, dQ 0.441 -> 0.302 at 64). Run under
    the interpreter at the GPU's choices: output and every gradient against float64, 200 queries
    and keys (full slices below the diagonal; a window of 129's between two partial ones)."""
    from rtxdsl.build import prepare

    ins = _inputs(gen, 1, 2, 2, 200, 200, d, d, dtype)
    mods = {} if window is None else {"mask_mod": lambda b, h, i, j: (i >= j) & (i - j < window)}
    kern = rx.compile(rx.attention(q, k, v, causal=window is None, **mods))
    leaves = {n: t.clone().requires_grad_() for n, t in ins.items()}
    plan = kern.grad_plan(**leaves)
    cot = torch.randn(1, 2, 200, d, generator=gen, dtype=torch.float64)
    feed = ins | plan.forward(**ins) | {"_g0": cot.to(dtype)}
    feed = {n: feed[n] for n in plan.backward.inputs}
    sources = [c.source for c in prepare(kern, ins, target=GPU)[1]]
    sources += [c.source for c in prepare(plan.backward, feed, target=GPU)[1] if "tl.dot(" in c.source]
    names = ["forward", *("dK + dV" if src.count("tl.store(") == 2 else "dQ" for src in sources[1:])]
    assert {n: len(_k_loops(src)) for n, src in zip(names, sources)} == split
    for src in sources:
        if len(_k_loops(src)) == 2:
            assert re.search(r"\w+_f = .* \| True", _k_loops(src)[1])
    pos = torch.arange(200)
    keep = (pos[:, None] >= pos) & (pos[:, None] - pos < (window or 200))
    ref_leaves = {n: t.double().requires_grad_() for n, t in ins.items()}
    ref = _reference(ref_leaves, keep=keep)[0]
    out = rx.memory_trace(kern, target=GPU, **ins).result
    assert_close(out, ref, atol, rtol, "out")
    got = rx.memory_trace(plan.backward, target=GPU, **feed).result
    want = _grads(ref, list(ref_leaves.values()), cot)
    for n, a, e in zip("qkv", got if isinstance(got, tuple) else tuple(got.values()), want):
        assert_close(a, e, atol * max(1.0, float(e.abs().max())), rtol, f"d/d{n}")


@pytest.mark.parametrize("t, unmasked", [(64, True), (63, False)])  # 64: the interpreter's tile, filled
def test_attention_whose_lengths_fill_its_tiles_checks_no_bounds(t, unmasked, gen):
    """Causal attention at 64 tokens, head dim 64: every extent of the forward's and the
    backward's GEMMs (queries, keys, the head dim of the recomputed scores) fills its blocks, so
    no load, select or store checks bounds (``GemmTile.even``; on sm_90 at 4,096 tokens this took
    the forward from 0.459 to 0.406 warp instructions per score at head dim 64, dQ from 1.26 to
    1.02). The causal mask stays. At 63 tokens the checked variant. Output and every gradient
    against float64."""
    ins = _inputs(gen, 1, 2, 2, t, t, 64, 64, torch.float32)
    expr = rx.attention(q, k, v, causal=True)
    kern = rx.compile(expr)
    keep = torch.ones(t, t, dtype=torch.bool).tril()
    _check(expr, ins, lambda r: _reference(r, keep=keep)[0], torch.float32, 2e-5, 2e-5, gen)
    plan = kern.grad_plan(**{n: x.clone().requires_grad_() for n, x in ins.items()})
    sources = [*kern.sources(**ins), *plan.backward.sources(**plan.backward_feed(ins))]
    gemms = [_k_loops(s) for s in sources if "tl.dot(" in s]
    assert len(gemms) == 3  # the forward, dQ's and dK / dV's GEMMs
    for loops in gemms:
        for loop in loops:
            assert ("mask=" not in loop and "a_mask" not in loop) is unmasked, loop
        assert re.search(r"tl\.where\(v\d+, ", loops[0])  # the causal mask
