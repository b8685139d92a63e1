"""Linear cross-entropy without logits: a row reduction over a contraction's product computed tile by
tile inside one kernel (forward), the backward's two GEMMs recomputing the product's tiles. Checked
against float64 torch on odd sizes and every option; the memory and launch figures are counted."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close

import rtxdsl as rx
from rtxdsl.errors import RtxError, ShapeError
from rtxdsl.expr import node

h, w, t, b, cw = (rx.var(n) for n in ("h", "w", "t", "b", "cw"))

# (dtype, atol, rtol) of the loss and gradients: the product accumulates in fp32 (fp64 for fp64
# inputs) and the row statistics are fp32, so half-type error is the inputs' and outputs' rounding
TOLERANCES = [
    (torch.float64, 1e-10, 1e-10),
    (torch.float32, 2e-5, 2e-5),
    (torch.bfloat16, 2e-2, 2e-2),
]

# (tokens, vocabulary, hidden): why each is there
SIZES = [
    ((37,), 31, 33),  # odd everything: masked rows, columns and K slices
    ((1,), 1000, 8),  # one token, a vocabulary of many column tiles
    ((257,), 2, 8),  # rows spanning programs, a two-class vocabulary
    ((37,), 1, 33),  # one class: the softmax is 1, the gradient 0
    ((3, 13), 31, 33),  # batched hidden states: rows decomposed over (batch, token)
    ((1,), 1, 1),  # every extent 1: each operand one element, its tile load still a block (a crash)
]

# each exercises one option of rx.cross_entropy (plus the logit softcap)
OPTIONS = [
    {},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-2},
    {"softcap": 5.0},
    {"ignore_index": 3},  # an ignore index that is a valid class
]


def _inputs(gen, shape, vocab, hidden, dtype, bias=False, weight=False, ignore=-100):
    hs = torch.randn(*shape, hidden, generator=gen, dtype=torch.float64).to(dtype)
    ws = (torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) / hidden**0.5).to(dtype)
    ts = torch.randint(0, vocab, shape, generator=gen)
    if ts.numel() > 2:
        ts.view(-1)[1] = ignore  # an ignored token
    ins = {"h": hs, "w": ws, "t": ts}
    if bias:
        ins["b"] = torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype)
    if weight:
        ins["cw"] = (torch.rand(vocab, generator=gen, dtype=torch.float64) + 0.1).to(dtype)
    return ins


def _reference(ins, options):
    """float64 torch: the logits written, then F.cross_entropy over them flattened (+ the z-loss)."""
    opts = {"ignore_index": -100, "reduction": "mean", "label_smoothing": 0.0} | options
    z, cap = opts.pop("z_loss", 0.0), opts.pop("softcap", None)
    hs, ws = ins["h"], ins["w"]
    logits = F.linear(hs, ws, ins.get("b"))
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    flat, target = logits.reshape(-1, ws.shape[0]), ins["t"].reshape(-1)
    loss = F.cross_entropy(flat, target, ins.get("cw"), **opts)
    if z:
        valid = target != opts["ignore_index"]
        zl = torch.where(valid, z * torch.logsumexp(flat, -1) ** 2, 0)
        loss = loss + (
            zl if opts["reduction"] == "none" else zl.sum() / valid.sum() if opts["reduction"] == "mean" else zl.sum()
        )
    return loss.reshape(ins["t"].shape) if opts["reduction"] == "none" else loss


def _expr(bias, weight, options):
    return rx.linear_cross_entropy(h, w, t, b if bias else None, cw if weight else None, **options)


def _check(gen, shape, vocab, hidden, options, dtype, atol, rtol, bias, weight):
    ins = _inputs(gen, shape, vocab, hidden, dtype, bias, weight, options.get("ignore_index", -100))
    k = rx.compile(_expr(bias, weight, options))
    leaves = {n: v.clone().requires_grad_() for n, v in ins.items() if v.dtype.is_floating_point and n != "cw"}
    out = k(**(ins | leaves))
    ref_leaves = {n: v.double().requires_grad_() for n, v in leaves.items()}
    ref = _reference(
        {n: (v.double() if v.dtype.is_floating_point else v) for n, v in ins.items()} | ref_leaves, options
    )
    assert_close(out, ref, atol * 10, rtol, f"loss {options}")
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, list(leaves.values()), g.to(out.dtype))
    want = torch.autograd.grad(ref, list(ref_leaves.values()), g)
    for name, a, e in zip(leaves, got, want):
        assert_close(a, e, atol * 10, rtol * 10, f"d{name} {options}")


@pytest.mark.parametrize(("shape", "vocab", "hidden"), SIZES)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), TOLERANCES)
def test_sizes_against_float64(shape, vocab, hidden, dtype, atol, rtol, gen):
    _check(gen, shape, vocab, hidden, {}, dtype, atol, rtol, bias=vocab > 2, weight=False)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize(("dtype", "atol", "rtol"), TOLERANCES)
def test_options_against_float64(options, dtype, atol, rtol, gen):
    """Every option with a bias and class weights (the weighted mean, the weighted smoothing sum)."""
    _check(gen, (37,), 31, 33, options, dtype, atol, rtol, bias=True, weight=True)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_options_over_batched_hidden_states(options, gen):
    """[batch, tokens, hidden]: the product has a batch dim (the weight broadcasts over it)."""
    _check(gen, (3, 13), 31, 33, options, torch.float32, 2e-5, 2e-5, bias=False, weight=False)


def test_cross_entropy_of_linear_is_the_same_kernels(gen):
    ins = _inputs(gen, (37,), 31, 33, torch.float32, bias=True)
    named = rx.compile(rx.linear_cross_entropy(h, w, t, b)).program(**ins)
    found = rx.compile(rx.cross_entropy(rx.linear(h, w, b), t)).program(**ins)
    assert named.kernels_launched == found.kernels_launched == 1

    # the same kernel (and tail), commented after the code that made it (``KernelSpec.notes``)
    def bare(spec):
        return replace(spec, notes=(), tail=spec.tail and bare(spec.tail))

    assert [bare(k.spec) for k in named.launched] == [bare(k.spec) for k in found.launched]


def test_gradcheck(gen):
    ins = _inputs(gen, (5,), 7, 4, torch.float64, bias=True, weight=True)
    k = rx.compile(_expr(True, True, {"label_smoothing": 0.1, "z_loss": 0.01, "softcap": 3.0}))
    args = (ins["h"].requires_grad_(), ins["w"].requires_grad_(), ins["b"].requires_grad_())
    assert torch.autograd.gradcheck(lambda x, y, z: k(h=x, w=y, t=ins["t"], b=z, cw=ins["cw"]), args)


# ---- memory and launches: no tokens x vocabulary buffer, forward or backward -----------------------
def _programs(kernel, ins):
    """The forward and backward programs autograd runs (every float input requiring grad)."""
    plan = kernel.grad_plan(**ins)
    fwd = plan.forward.program(**ins)
    saved = plan.forward(**ins)
    feed = ins | dict(saved) | {"_g0": torch.ones(saved["out"].shape, dtype=saved["out"].dtype)}
    bwd = plan.backward.program(**{n: feed[n] for n in plan.backward.inputs})
    return fwd, bwd


def test_flops_at_llama3_sizes_are_the_compute_model_s(gen):
    """Planned at 8192 tokens x 128256 classes x 4096 hidden (nothing runs): the forward computes the
    logits' product once; the backward computes it once more, a chunk of 2560 classes at a time (2%
    of the logits' bytes), and its two gradient GEMMs read each chunk: 3x the logits' GEMM, the
    minimum. Recomputing the logits in the GEMMs' tiles instead would cost 66x
    (``chunk_budget=0``: each GEMM recomputes them once per block of its 4096 / 128 hidden columns)."""
    tokens, vocab, hidden = 8192, 128256, 4096
    bf = {"dtype": torch.bfloat16}
    ins = {
        "h": torch.empty(tokens, hidden, **bf, requires_grad=True),
        "w": torch.empty(vocab, hidden, **bf, requires_grad=True),
        "t": torch.zeros(tokens, dtype=torch.int64),
    }
    logits = 2 * tokens * vocab * hidden
    for budget, launches, flops in ((0.02, 3 * 51, 3 * logits), (0.0, 2, 66 * logits)):
        kernel = rx.compile(rx.linear_cross_entropy(h, w, t), config=rx.FusionConfig(chunk_budget=budget))
        plan = kernel.grad_plan(**ins)
        fwd = plan.forward.program(**{n: ins[n].detach() for n in plan.forward.inputs})
        assert (fwd.flops, fwd.minimum_flops) == (logits, logits)
        bwd = plan.backward.program(**plan.backward_feed({n: ins[n].detach() for n in ins}))
        assert (bwd.flops, bwd.minimum_flops, bwd.kernels_launched) == (flops, 3 * logits, launches)
    chunk = tokens * 2560 * 2  # dP, one chunk of bf16 columns: within 2% of the bf16 logits
    assert chunk <= 0.02 * tokens * vocab * 2
    assert bwd.scratch_bytes == 0
    plan = rx.compile(rx.linear_cross_entropy(h, w, t)).grad_plan(**ins)
    program = plan.backward.program(**plan.backward_feed({n: ins[n].detach() for n in ins}))
    assert program.scratch_bytes == chunk + tokens * hidden * 4  # and dh's fp32 sum across chunks


# (tokens, vocabulary, hidden) where the backward's GEMMs would recompute the logits more than twice
# (hidden > 128: each recomputes them once per 128 of its hidden columns), so it runs a chunk loop
CHUNKED = [
    ((37,), 300, 257),  # three chunks of 128 classes, the last one of 44; odd tokens and hidden
    ((1,), 129, 129),  # one token; a last chunk of one class
    ((3, 13), 200, 130),  # batched hidden states: rows decomposed over (batch, token)
]


@pytest.mark.parametrize(("shape", "vocab", "hidden"), CHUNKED)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), TOLERANCES)
def test_chunk_loop_against_float64(shape, vocab, hidden, dtype, atol, rtol, gen):
    """The one-recompute backward: values and every gradient (bias and class weights included)."""
    _check(gen, shape, vocab, hidden, {}, dtype, atol, rtol, bias=True, weight=True)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_chunk_loop_options_against_float64(options, gen):
    """Every option through the chunk loop: positions compared with the targets in the chunk's
    kernel (an ignore index inside the vocabulary too), the smoothing and z-loss terms."""
    _check(gen, (37,), 300, 257, options, torch.float32, 2e-5, 2e-5, bias=False, weight=False)


@pytest.mark.parametrize("bias", [False, True])
def test_chunk_loop_plan(bias, gen):
    """Three kernels per chunk, each product once (the compute model's minimum), a buffer of one
    chunk (fp32 when a bias gradient sums dP before its bf16 rounding), bit-identical reruns, and
    the same gradients as the recompute plan (``chunk_budget=0``)."""
    ins = _inputs(gen, (37,), 300, 257, torch.bfloat16, bias=bias)
    _, bwd = _programs(rx.compile(_expr(bias, False, {})), ins)
    assert bwd.kernels_launched == 3 * 3 and bwd.flops == bwd.minimum_flops
    assert [c.chunk.size for c in bwd.launched] == [128] * 3
    stored = 4 if bias else 2
    assert bwd.scratch_bytes == 37 * 128 * stored + 37 * 257 * 4  # one chunk of dP, dh's fp32 sum
    grads = []
    for budget in (0.02, 0.02, 0.0):
        kernel = rx.compile(_expr(bias, False, {}), config=rx.FusionConfig(chunk_budget=budget))
        leaves = {n: v.clone().requires_grad_() for n, v in ins.items() if n in ("h", "w", "b")}
        kernel(**(ins | leaves)).backward()
        grads.append([v.grad for v in leaves.values()])
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))  # reruns: bit-identical
    for a, b in zip(grads[0], grads[2]):
        assert_close(a, b, 2e-2, 2e-2, "chunk loop vs recompute plan")


def test_chunk_budget_is_validated():
    with pytest.raises(RtxError, match="chunk_budget"):
        rx.FusionConfig(chunk_budget=1.5)


@pytest.mark.parametrize("bias", [False, True])
def test_no_logits_buffer_and_launch_counts(bias, gen):
    tokens, vocab, hidden = 128, 4099, 32  # the interpreter's size of the 4096 x 32000 x 1024 case
    ins = _inputs(gen, (tokens,), vocab, hidden, torch.float32, bias=bias)
    fwd, bwd = _programs(rx.compile(_expr(bias, False, {})), ins)
    logits = tokens * vocab * 4
    for p in (fwd, bwd):
        assert p.scratch_bytes <= logits // 100  # beyond inputs and results: under 1% of the logits
        assert all(math.prod(buf.shape) < tokens * vocab for buf in p.buffers)  # no tokens x vocabulary tensor
    assert fwd.kernels_launched == 1  # the product's tiles, logsumexp, target logit; the mean as a tail
    assert bwd.kernels_launched == 2  # dh and dw (db in dw's K loop), each recomputing the logit tiles


# ---- bad input, determinism ----------------------------------------------------------------------
def test_mismatched_hidden_sizes_name_both_shapes_before_any_launch(gen):
    k = rx.compile(rx.linear_cross_entropy(h, w, t))
    rx.reset_fusion_stats()
    with pytest.raises(ShapeError, match=r"\[4, 8\].*\[5, 9\]"):
        k(h=torch.randn(4, 8), w=torch.randn(5, 9), t=torch.zeros(4, dtype=torch.int64))
    assert rx.fusion_stats().kernels_launched == 0


def test_a_target_out_of_range_is_the_error_cross_entropy_gives(gen):
    ins = _inputs(gen, (6,), 5, 8, torch.float32)
    ins["t"][3] = 5
    with pytest.raises(RtxError, match="out of range") as lce:
        rx.compile(rx.linear_cross_entropy(h, w, t))(**ins)
    with pytest.raises(RtxError, match="out of range") as ce:
        rx.compile(rx.cross_entropy(h, t))(h=ins["h"] @ ins["w"].T, t=ins["t"])
    tail = "target 't' holds a class index out of range: each must be in [0, 5) or be ignore_index"
    assert str(lce.value).startswith(f"linear_cross_entropy: {tail}")
    assert str(ce.value).startswith(f"cross_entropy: {tail}")


def test_reruns_are_bit_identical(gen):
    """No atomics: each dh / dw element is summed by one program in a fixed order."""
    ins = _inputs(gen, (37,), 31, 33, torch.float32, bias=True)
    k = rx.compile(rx.linear_cross_entropy(h, w, t, b))
    runs = []
    for _ in range(2):
        leaves = {n: ins[n].clone().requires_grad_() for n in ("h", "w", "b")}
        loss = k(**(ins | leaves))
        runs.append([loss, *torch.autograd.grad(loss, list(leaves.values()))])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# ---- front ends ------------------------------------------------------------------------------------
def test_module_form_matches_the_function(gen):
    ins = _inputs(gen, (37,), 31, 33, torch.float32, bias=True, weight=True)
    options = {"label_smoothing": 0.1, "softcap": 5.0}
    loss = rx.nn.LinearCrossEntropyLoss(weight=ins["cw"], **options)
    want = rx.compile(_expr(True, True, options))(**ins)
    torch.testing.assert_close(loss(ins["h"], ins["w"], ins["t"], ins["b"]), want, atol=0, rtol=0)
    assert "softcap=5.0" in repr(loss)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_module_form_gives_a_float32_loss_for_half_inputs_and_follows_autocast(dtype, gen):
    """Half inputs: a float32 loss, as torch's cross-entropy under autocast and Liger's fused loss
    (computed in float32 in the kernel either way); under autocast a float32 head beside half
    hidden states runs the projection in autocast's dtype (no dtype error), its gradient float32."""
    ins = _inputs(gen, (37,), 31, 33, torch.float32)
    loss = rx.nn.LinearCrossEntropyLoss(label_smoothing=0.1)
    h, w = ins["h"].to(dtype).requires_grad_(), ins["w"].requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        got = loss(h, w, ins["t"])
    assert got.dtype == torch.float32
    gh, gw = torch.autograd.grad(got, (h, w))
    assert gh.dtype == dtype and gw.dtype == torch.float32
    hd, wd = h.detach().double().requires_grad_(), w.detach().to(dtype).double().requires_grad_()
    want = F.cross_entropy(hd @ wd.T, ins["t"], label_smoothing=0.1)
    atol, rtol = (2e-3, 2e-3) if dtype == torch.float16 else (1.6e-2, 1.6e-2)
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)
    torch.testing.assert_close(gh.double(), torch.autograd.grad(want, hd)[0], atol=atol, rtol=rtol)
    assert loss(ins["h"].double(), ins["w"].double(), ins["t"]).dtype == torch.float64  # no cast down


def test_the_lazy_stream_finds_linear_then_cross_entropy(gen):
    """``F.cross_entropy(F.linear(h, w), y)`` run lazily: one kernel, the logits never written."""
    ins = _inputs(gen, (37,), 31, 33, torch.float32)
    f = rx.Fusion()
    with torch.no_grad():
        got = F.cross_entropy(F.linear(f.lazy(ins["h"]), f.lazy(ins["w"])), f.lazy(ins["t"]))
        assert got.is_pending
        got = got.torch()
    torch.testing.assert_close(got, F.cross_entropy(F.linear(ins["h"], ins["w"]), ins["t"]))
    s = f.stats()
    assert s.kernels_launched == 1 and s.bytes_moved < 37 * 31 * 4 * 3  # inputs once, no logits


@pytest.mark.parametrize("bias", [False, True])
def test_grad_in_forward_keeps_only_the_gradients(bias, gen):
    """The forward runs the loss and the two gradient GEMMs with a unit cotangent; the backward only
    scales dh, dw (and db) by the loss's cotangent: the same gradients as the ordinary backward."""
    ins = _inputs(gen, (37,), 31, 33, torch.float32, bias=bias)
    names = ("h", "w", "b") if bias else ("h", "w")
    want_leaves = {n: ins[n].clone().requires_grad_() for n in names}
    want = rx.compile(_expr(bias, False, {}))(**(ins | want_leaves))
    want_grads = torch.autograd.grad(want * 3.0, list(want_leaves.values()))
    k = rx.compile(rx.linear_cross_entropy(h, w, t, b if bias else None, grad_in_forward=True))
    leaves = {n: ins[n].clone().requires_grad_() for n in names}
    rx.reset_fusion_stats()
    loss = k(**(ins | leaves))
    assert rx.fusion_stats().kernels_launched == 3  # the loss, then dh and dw with a unit cotangent
    got = torch.autograd.grad(loss * 3.0, list(leaves.values()))
    torch.testing.assert_close(loss, want, atol=0, rtol=0)
    for a, e in zip(got, want_grads):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-6)


def test_the_lazy_stream_fuses_a_causal_lm_loss_over_flattened_logits(gen):
    """``lm_head(h)`` on ``[batch, tokens, hidden]``, then ``.float().view(-1, V)`` and cross-entropy
    (what causal-LM losses do): the flatten regroups the product's rows, so the product is the
    flattened hidden states' (a free view) and one kernel reduces it; nobody holds the logits."""
    head = torch.nn.Linear(33, 31)
    hs, ys = torch.randn(2, 5, 33, generator=gen), torch.randint(0, 31, (2, 5), generator=gen)
    f = rx.Fusion()
    with torch.no_grad():
        loss = F.cross_entropy(head(f.lazy(hs)).float().view(-1, 31), f.lazy(ys).view(-1)).torch()
        want = F.cross_entropy(head(hs).view(-1, 31), ys.view(-1))
    torch.testing.assert_close(loss, want)
    s = f.stats()
    assert s.kernels_launched == 1 and s.bytes_moved < 10 * 31 * 4 + (10 * 33 + 31 * 34 + 10) * 4 + 64


def test_memory_trace_on_the_sm90_configuration_stores_no_logits(gen):
    """The kernels as an H200 would run them (128-row tiles), traced: every tensor a launch loads or
    stores is far smaller than the logits, and stored once, forward and backward; the gradients are
    the interpreter's plan's (there the hidden dim is one slice, ``w`` and ``h`` loaded once a tile:
    the recomputed logits' tile read transposed as the gradient GEMM's operand,
    ``params.transposed_operands``)."""
    tokens, vocab, hidden = 130, 2000, 32
    ins = _inputs(gen, (tokens,), vocab, hidden, torch.bfloat16, bias=True)
    plan = rx.compile(_expr(True, False, {})).grad_plan(**ins)
    forward = rx.memory_trace(plan.forward, **ins)
    saved = {k: forward.result[k] for k in plan.grads.saved_keys}
    feed = ins | saved | {"_g0": torch.ones((), dtype=torch.bfloat16)}
    backward = rx.memory_trace(plan.backward, **{n: feed[n] for n in plan.backward.inputs})
    here = plan.backward(**{n: feed[n] for n in plan.backward.inputs})
    for key, got in backward.result.items():
        assert_close(got, here[key], 2e-2, 2e-2, key)
    logits = tokens * vocab * 2
    launches = [*forward.launches, *backward.launches]
    assert len(forward.launches) == 1 and len(backward.launches) == 2
    for launch in launches:  # the largest tensors are w and dw (vocabulary x hidden), each written once
        for t in launch.tensors:
            assert t.nbytes < logits // 2 and t.stored <= t.nbytes, (launch.summary, t)


def test_memory_trace_of_the_chunk_loop(gen):
    """The chunk loop traced at sm_90's tiles: each chunk's kernel stores its chunk of dP (one
    buffer of 128 columns, rewritten by every chunk) and the GEMMs load it; each element of dw is
    stored once, dh's sum carried in its fp32 buffer and dh stored by the last chunk only."""
    tokens, vocab, hidden = 130, 300, 257
    ins = _inputs(gen, (tokens,), vocab, hidden, torch.bfloat16)
    plan = rx.compile(_expr(False, False, {})).grad_plan(**ins)
    forward = rx.memory_trace(plan.forward, **ins)
    feed = ins | {k: forward.result[k] for k in plan.grads.saved_keys} | {"_g0": torch.ones((), dtype=torch.bfloat16)}
    launches = rx.memory_trace(plan.backward, **{n: feed[n] for n in plan.backward.inputs}).launches
    assert len(launches) == 3 * 3  # three chunks: 128, 128 and 44 classes
    chunk = tokens * 128 * 2  # dP in bf16 (no bias: the operand itself is stored)
    written = {}  # tensor address -> bytes stored over the loop
    for launch in launches:
        for t in launch.tensors:
            known = (vocab * hidden * 2, tokens * hidden * 4)  # w and dw; dh's fp32 sum
            assert t.nbytes < tokens * vocab * 2 or t.nbytes in known, (launch.summary, t)
            written[t.address] = written.get(t.address, 0) + t.stored
    sizes = {t.address: t.nbytes for launch in launches for t in launch.tensors}
    assert [written[a] for a, n in sizes.items() if n == chunk] == [tokens * vocab * 2]  # each chunk once
    for nbytes in (tokens * hidden * 2, vocab * hidden * 2):  # dh and dw: each element stored once
        assert [written[a] for a, n in sizes.items() if n == nbytes and written[a]] == [nbytes]
    carried = [written[a] for a, n in sizes.items() if n == tokens * hidden * 4]
    assert carried == [2 * tokens * hidden * 4]  # dh's sum: stored by every chunk but the last


# (expression, float64 reference over the logits): why each is there
PRODUCT_REDUCTIONS = {
    # softmax's normalizer
    "logsumexp": (lambda: rx.logsumexp(rx.linear(h, w), -1), lambda z: torch.logsumexp(z, -1)),
    # its max, through a transposed view
    "amax": (lambda: rx.amax(rx.matmul(h, rx.transpose(w, 0, 1)), -1), lambda z: z.amax(-1)),
    "sum_exp": (  # an elementwise op on the product, the per-row value kept 2-d
        lambda: rx.sum(rx.exp(rx.linear(h, w) - 1.0), -1, keepdim=True),
        lambda z: (z - 1.0).exp().sum(-1, keepdim=True),
    ),
}


@pytest.mark.parametrize("case", sorted(PRODUCT_REDUCTIONS))
def test_other_row_reductions_of_a_product_are_one_kernel(case, gen):
    """Not only cross-entropy: any mergeable row reduction over a product's last axis is computed
    in its tiles (the statistics of ``softmax(h @ w.T)``), with its gradient, never the product."""
    build, reference = PRODUCT_REDUCTIONS[case]
    ins = {n: v for n, v in _inputs(gen, (37,), 31, 33, torch.float64).items() if n != "t"}
    k = rx.compile(build())
    p = k.program(**ins)
    assert p.kernels_launched == 1 and all(math.prod(b.shape) < 37 * 31 for b in p.buffers)
    assert_close(k(**ins), reference(ins["h"] @ ins["w"].T), 1e-10, 1e-10, case)
    small = (ins["h"][:3, :8].clone().requires_grad_(), ins["w"][:5, :8].clone().requires_grad_())
    assert torch.autograd.gradcheck(lambda a, b: k(h=a, w=b), small)  # a few elements: a launch each


def test_per_row_sums_over_a_product_as_separate_outputs_with_a_weight_gradient(gen):
    F64 = torch.float64
    """What a vocabulary piece computes (``lower.pieces``): the logsumexp and the class-weighted
    target sum as separate outputs, each with its own cotangent. The class weights' gradient, a
    column sum of positions and cotangents, is merged in the weight-gradient GEMM's K loop beside
    the bias gradient, so no kernel reads the recomputed product's tiles from another (a GEMM
    writes no operand tile: it once stored one as a per-row value and failed)."""
    h, w = torch.randn(6, 8, dtype=F64, generator=gen), torch.randn(9, 8, dtype=F64, generator=gen)
    b, cw = torch.randn(9, dtype=F64, generator=gen), torch.rand(9, dtype=F64, generator=gen) + 0.5
    t = torch.randint(0, 9, (6,), generator=gen)
    logits = rx.linear(rx.var("h"), rx.var("w"), rx.var("b"))
    hit = rx.arange_like(logits, -1) == node("unsqueeze", rx.var("t"), axes=(1,))
    weights = node("expand", node("unsqueeze", rx.var("cw"), axes=(0,)), shape=(6, 9))  # as the decomposition
    picked = rx.sum(rx.where(hit, weights, 0.0), -1, keepdim=True)
    k = rx.compile({"lse": rx.logsumexp(logits, -1, keepdim=True), "tw": picked})
    leaves = [v.clone().requires_grad_() for v in (h, w, b, cw)]
    out = k(h=leaves[0], w=leaves[1], b=leaves[2], cw=leaves[3], t=t)
    g0, g1 = torch.randn(6, 1, dtype=F64, generator=gen), torch.randn(6, 1, dtype=F64, generator=gen)
    (out["lse"] * g0 + out["tw"] * g1).sum().backward()
    refs = [v.clone().requires_grad_() for v in (h, w, b, cw)]
    ref_logits = F.linear(refs[0], refs[1], refs[2])
    ref_hit = torch.arange(9)[None, :] == t[:, None]
    ref_tw = torch.where(ref_hit, refs[3][None, :].expand(6, 9), 0.0).sum(-1, keepdim=True)
    (torch.logsumexp(ref_logits, -1, keepdim=True) * g0 + ref_tw * g1).sum().backward()
    for got, want in zip(leaves, refs):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-12, rtol=1e-12)
    plan = k.grad_plan(h=h, w=w, b=b, cw=cw, t=t)
    saved = plan.forward(h=h, w=w, b=b, cw=cw, t=t)
    feed = {"h": h, "w": w, "b": b, "cw": cw, "t": t, "_g0": g0, "_g1": g1} | saved
    backward = plan.backward.program(**{n: feed[n] for n in plan.backward.inputs})
    assert backward.kernels_launched == 2 and all(tuple(x.shape) != (6, 9) for x in backward.buffers)


@pytest.mark.parametrize("act", ["tanh", "exp_clamp"])
@pytest.mark.parametrize("layout", ["contiguous", "expanded"])  # a stride-0 row: one token repeated
@pytest.mark.parametrize("second", [False, True], ids=["loss", "loss+activation"])
def test_an_activation_before_the_head_differentiates(act, layout, second, gen):
    """``linear_cross_entropy(act(h), w, t)``: the backward recomputes the logits from ``act(h)`` in
    d/dh's K loop and multiplies by ``act'(h)`` in its epilogue. The epilogue's copy of ``act(h)``
    shadowed the operand the recomputed logits load (d/dh O(1) wrong in float64), a second output
    of the activation crashed (KeyError in gemm._tile_values), a stride-0 h too (launch values
    assert); found by the head-loss fuzzer at seed 32."""
    fn = {"tanh": (rx.tanh, torch.tanh), "exp_clamp": (lambda e: rx.exp(rx.clamp(e, -6.0, 6.0)),
                                                       lambda x: torch.exp(x.clamp(-6.0, 6.0)))}[act]  # fmt: skip
    row = torch.randn(1 if layout == "expanded" else 7, 5, generator=gen, dtype=torch.float64)
    h0 = row.expand(7, 5) if layout == "expanded" else row
    w = torch.randn(11, 5, generator=gen, dtype=torch.float64)
    t = torch.tensor([1, -100, 3, 4, 10, 0, 2])
    a = fn[0](rx.var("h"))
    outs = {"o0": rx.linear_cross_entropy(a, rx.var("w"), rx.var("t"), reduction="none")} | (
        {"o1": a} if second else {}
    )
    h, wl = h0.detach().requires_grad_(), w.clone().requires_grad_()
    got = rx.compile(outs)(h=h, w=wl, t=t)
    hr, wr = h0.detach().clone().requires_grad_(), w.clone().requires_grad_()
    ar = fn[1](hr)
    want = {"o0": F.cross_entropy(ar @ wr.T, t, reduction="none")} | ({"o1": ar} if second else {})
    cots = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in want.items()}
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-12, rtol=1e-12)
    grads = torch.autograd.grad([got[k] for k in want], [h, wl], [cots[k] for k in want])
    wants = torch.autograd.grad([want[k] for k in want], [hr, wr], [cots[k] for k in want])
    for name, g, e in zip(("d/dh", "d/dw"), grads, wants):
        torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-10, msg=name)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 3e-2), (torch.float32, 1e-4)])  # bf16 hit it
@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
def test_a_tied_embedding_under_a_norm_runs_the_chunk_loop(norm, dtype, tol, gen):
    """``linear_cross_entropy(norm(E[ids]), E, t)``, the embedding tied to the head over a hidden
    size that runs the chunk loop: in bf16 the kernel recomputing the normed rows for the loop's
    ``dh`` GEMM came between the loop's kernels, which then read a kernel they passed (an assert in
    ``lower._loops_together``; found by the model fuzzer, program 2026120700108). It now runs
    before the loop: the loss and every gradient (E's sums the gather's and the head's) against
    float64."""
    e0 = torch.randn(139, 131, generator=gen, dtype=torch.float64).to(dtype)
    g0 = (torch.rand(131, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    ids = torch.randint(0, 139, (18,), generator=gen)[:, None].expand(18, 131).contiguous()
    t = torch.randint(0, 139, (18,), generator=gen).masked_fill(torch.arange(18) % 3 == 0, -100)
    fn = {"rms_norm": (lambda x, g: rx.rms_norm(x, g, 1e-6), lambda x, g: F.rms_norm(x, (131,), g, 1e-6)),
          "layer_norm": (lambda x, g: rx.layer_norm(x, g, None, 1e-6),
                         lambda x, g: F.layer_norm(x, (131,), g, None, 1e-6))}[norm]  # fmt: skip
    e, g = (v.clone().requires_grad_() for v in (e0, g0))
    loss = rx.linear_cross_entropy(fn[0](rx.gather(rx.var("E"), rx.var("I"), 0), rx.var("g")), rx.var("E"), rx.var("t"))
    got = rx.compile(loss)(E=e, I=ids, g=g, t=t)
    er, gr = (v.double().requires_grad_() for v in (e0, g0))
    want = F.cross_entropy(fn[1](torch.gather(er, 0, ids), gr) @ er.T, t)
    torch.testing.assert_close(got.double(), want, atol=tol * 5, rtol=tol)
    for a, b in zip(torch.autograd.grad(got, [e, g]), torch.autograd.grad(want, [er, gr])):
        torch.testing.assert_close(a.double(), b, atol=tol * float(b.abs().max()), rtol=tol)
