"""Distillation over a student's and a teacher's linear heads (issue 36): ``rx.linear_logits``,
``rx.linear_jsd``, ``rx.distillation_outputs`` and ``rtxdsl.liger``'s ``LigerFusedLinearJSDLoss``,
``LigerFusedLinearCosineSimilarityLoss`` and ``LigerFusedLinearJSD``.

The chunked losses run against Liger-Kernel's own classes (``compiled=False``: plain torch, so
they run on CPU) on float64 copies of the same inputs: loss, its soft and hard terms, and the
gradients of the student's hidden states, head and bias (Liger takes the hard term's
log-softmax in float32, so that is its precision). The fused linear JSD runs against a float64
torch reference of its definition (Liger's own is a Triton kernel). Plans: both heads' products
computed tile by tile in one row kernel, no tokens x vocabulary buffer forward or backward."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import ShapesSeen, assert_close

import rtxdsl as rx
from rtxdsl import liger
from rtxdsl.errors import RtxError
from rtxdsl.lower.target import GPU

chunked = pytest.importorskip("liger_kernel.chunked_loss", reason="the peer's classes are the reference here")

ROWS, HS, HT, VOCAB = 13, 9, 14, 37  # odd tokens, hidden sizes that differ (the teacher's wider), odd vocabulary

#: (dtype, atol, rtol) against Liger on float64 copies of the same (rounded) inputs: its hard term's
#: log-softmax is float32; bf16 logits are rounded by Liger's F.linear and not by rtxdsl's accumulator
TOLERANCES = [(torch.float64, 2e-5, 2e-5), (torch.float32, 5e-5, 5e-5), (torch.bfloat16, 6e-2, 3e-2)]

#: Liger's own parametrization (temperature, weight_hard_loss, weight_soft_loss, beta), and JSD's two KL ends
OPTIONS = [(1.0, 0.5, 0.5, 0.5), (2.0, 0.0, 1.0, 0.8), (0.5, 1.0, 0.0, 0.2), (1.5, 0.3, 0.7, 0.0), (1.0, 0.4, 0.6, 1.0)]
MODULES = {"jsd": (liger.LigerFusedLinearJSDLoss, "LigerFusedLinearJSDLoss"),
           "cosine": (liger.LigerFusedLinearCosineSimilarityLoss, "LigerFusedLinearCosineSimilarityLoss")}  # fmt: skip


def _batch(gen: torch.Generator, dtype: torch.dtype, ignore_index: int = -100) -> dict[str, torch.Tensor]:
    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    target = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    target[[0, 5, 6]] = ignore_index  # a prompt token and two more that do not count
    return {
        "hs": rand(ROWS, HS),
        "ws": rand(VOCAB, HS, scale=0.5),
        "ht": rand(ROWS, HT),
        "wt": rand(VOCAB, HT, scale=0.5),
        "t": target,
        "bs": rand(VOCAB),
        "bt": rand(VOCAB),
    }


def _args(x: dict, bias: bool) -> tuple:
    return (x["hs"], x["ws"], x["ht"], x["wt"], x["t"], *((x["bs"], x["bt"]) if bias else ()))


def _student(x: dict, dtype: torch.dtype | None = None) -> dict:
    """The inputs with the student's head as leaves with gradients (float64 copies for ``dtype``)."""
    out = {k: v.detach().to(dtype or v.dtype) if v.is_floating_point() else v for k, v in x.items()}
    return {k: v.requires_grad_(k in ("hs", "ws", "bs")) for k, v in out.items()}


def _check(
    loss: str, options: tuple, bias: bool, ignore_index: int, dtype, atol, rtol, gen, none=False, pad=0
) -> tuple:
    """Ours against Liger's (``none``: no label counts; ``pad``: classes the teacher has beyond the
    student's, a padded vocabulary); returns our outputs."""
    temperature, hard, soft, beta = options
    opts = dict(weight_hard_loss=hard, weight_soft_loss=soft, beta=beta, ignore_index=ignore_index,
                temperature=temperature, return_soft_hard_loss=True)  # fmt: skip
    ours, name = MODULES[loss]
    x = _batch(gen, dtype, ignore_index)
    if none:
        x["t"][:] = ignore_index
    if pad:
        extra = _batch(gen, dtype, ignore_index)
        x["wt"], x["bt"] = torch.cat([x["wt"], extra["wt"][:pad]]), torch.cat([x["bt"], extra["bt"][:pad]])
    mine, wide = _student(x), _student(x, torch.float64)
    got = ours(**opts)(*_args(mine, bias))
    want = getattr(chunked, name)(compiled=False, **opts)(*_args(wide, bias))
    assert got[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    for what, g, w in zip(("loss", "soft_loss", "hard_loss"), got, want):
        assert_close(g.detach(), w.detach().double(), atol, rtol, what)
    leaves = ["hs", "ws", *(["bs"] if bias else [])]
    grads = torch.autograd.grad(got[0], [mine[k] for k in leaves])
    for k, g, w in zip(leaves, grads, torch.autograd.grad(want[0], [wide[k] for k in leaves])):
        assert_close(g, w, atol * max(1.0, w.abs().max().item()), rtol, f"d{k}")
    return got


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("loss", sorted(MODULES))
def test_each_distillation_loss_agrees_with_liger_in_float64(loss, options, gen):
    _check(loss, options, True, -100, *TOLERANCES[0], gen)


@pytest.mark.parametrize("loss", sorted(MODULES))
def test_without_biases(loss, gen):  # one option set: the biases change the plan, not the options' math
    _check(loss, OPTIONS[0], False, -100, *TOLERANCES[0], gen)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), TOLERANCES[1:])
@pytest.mark.parametrize("loss", sorted(MODULES))
def test_half_and_float32_inputs_agree_with_liger(loss, dtype, atol, rtol, gen):
    _check(loss, OPTIONS[1], True, 42, dtype, atol, rtol, gen)  # an ignore_index that is also a class


def test_no_counted_token_gives_the_soft_term_over_one(gen):
    """Liger's count is clamped to 1: with every label ignored both terms are sums over no row,
    0, with gradients of 0 (where 0 / 0 would make them NaN)."""
    for loss in MODULES:
        out = _check(loss, OPTIONS[0], True, -100, *TOLERANCES[0], gen, none=True)
        assert [v.item() for v in out] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("loss", sorted(MODULES))
def test_a_teacher_with_a_padded_vocabulary_pads_the_student_s_logits_as_liger(loss, bias, gen):
    """A teacher's vocabulary padded beyond the student's (Qwen1.5-72B's): Liger pads the student's
    logits with zeros for the soft term and keeps the hard term over the student's own classes;
    rtxdsl.liger raised for vocabularies of different sizes. Values and every student gradient
    (the padded rows' gradients dropped) against Liger's classes in float64."""
    _check(loss, OPTIONS[0], bias, -100, *TOLERANCES[0], gen, pad=5)
    _check(loss, OPTIONS[1], bias, -100, *TOLERANCES[1], gen, pad=3)


def _jsd_rows_of(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """Each row's generalized JSD of the two heads' scaled logits' softmaxes (Liger's ``JSD``)."""
    log_q, log_p = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    p, q = log_p.exp(), log_q.exp()
    if beta == 0.0:
        return (p * (log_p - log_q)).sum(-1)
    if beta == 1.0:
        return (q * (log_q - log_p)).sum(-1)
    log_m = torch.log(beta * p + (1 - beta) * q)
    return (beta * p * (log_p - log_m) + (1 - beta) * q * (log_q - log_m)).sum(-1)


def _jsd_reference(x: dict, beta: float, temperature: float, labelled: bool, ignore_index: int = -100):
    """Liger's ``TorchLMHeadJSD`` with its ``JSD``, in float64: the mean over the counted rows."""
    rows = _jsd_rows_of(F.linear(x["hs"], x["ws"]).double() / temperature,
                        F.linear(x["ht"], x["wt"]).double() / temperature, beta)  # fmt: skip
    if not labelled:
        return rows.mean()
    valid = x["t"] != ignore_index
    return torch.where(valid, rows, 0.0).sum() / valid.sum().clamp(min=1)


#: (dtype, atol, rtol) against float64 torch: Liger's own for bf16 (its test_fused_linear_jsd)
JSD_TOLERANCES = [(torch.float32, 1e-5, 5e-4), (torch.bfloat16, 5e-3, 5e-2)]


@pytest.mark.parametrize(("dtype", "atol", "rtol"), JSD_TOLERANCES)
@pytest.mark.parametrize(("beta", "temperature", "labelled"), [(0.5, 1.0, True), (0.1, 2.0, True),
                         (0.0, 1.0, True), (1.0, 0.7, False)])  # fmt: skip
def test_fused_linear_jsd_agrees_with_float64_torch(beta, temperature, labelled, dtype, atol, rtol, gen):
    x = _batch(gen, dtype)
    mine, wide = _student(x), _student(x, torch.float64)
    module = liger.LigerFusedLinearJSD(jsd_beta=beta, temperature=temperature)
    got = module(mine["hs"], mine["ws"], mine["ht"], mine["wt"], mine["t"] if labelled else None)
    want = _jsd_reference(wide, beta, temperature, labelled)
    assert_close(got.detach(), want.detach(), atol, rtol, "loss")
    grads = torch.autograd.grad(got, [mine["hs"], mine["ws"]])
    for k, g, w in zip(("hs", "ws"), grads, torch.autograd.grad(want, [wide["hs"], wide["ws"]])):
        assert_close(g, w, atol * max(1.0, w.abs().max().item()), rtol, f"d{k}")


@pytest.mark.parametrize("loss", ["jsd", "cosine", "linear_jsd"])
def test_cast_heads_whose_hidden_size_is_the_vocabulary_s(loss, gen):
    """Hidden states cast as loaded, a hidden size equal to the vocabulary's (found by the head-loss
    fuzzer): the student's cast is a sibling of the teacher's product at the logits' shape, and a
    row kernel that took both in read a product of its own value (a cycle: graphlib.CycleError),
    or loaded a product's operand it computed (IndexError). Each product computed once still."""
    n = 13
    ins = {k: torch.randn(shape, generator=gen, dtype=torch.float64) for k, shape in
           (("hs", (7, n)), ("ws", (n, n)), ("ht", (7, 5)), ("wt", (n, 5)))}  # fmt: skip
    t = torch.randint(0, n, (7,), generator=gen)
    v = {k: rx.cast(rx.var(k), torch.float32) for k in ins}
    if loss == "linear_jsd":
        e = rx.linear_jsd(v["hs"], v["ws"], v["ht"], v["wt"], rx.var("t"))
    else:
        e = rx.distillation_outputs(loss, v["hs"], v["ws"], v["ht"], v["wt"], rx.var("t"))["loss"]
    leaves = {k: x.clone().requires_grad_(k in ("hs", "ws")) for k, x in ins.items()}
    got = rx.compile(e)(**leaves, t=t)
    ref_leaves = {k: x.float().double().requires_grad_(k in ("hs", "ws")) for k, x in ins.items()}
    want = rx.compile(e, config=rx.FusionConfig(backend="torch"))(**ref_leaves, t=t)
    assert_close(got, want, 5e-5, 5e-5, "loss")
    grads = torch.autograd.grad(got, [leaves["hs"], leaves["ws"]])
    for k, g, w in zip(("hs", "ws"), grads, torch.autograd.grad(want, [ref_leaves["hs"], ref_leaves["ws"]])):
        assert_close(g, w, 5e-5 * max(1.0, w.abs().max().item()), 5e-5, f"d{k}")


def test_the_teacher_gets_no_gradient(gen):
    """Its logits are detached, as Liger's: a teacher weight that requires grad gets zeros."""
    x = {k: v.requires_grad_(v.is_floating_point()) for k, v in _batch(gen, torch.float32).items()}
    loss = rx.compile(rx.linear_jsd(*(rx.var(n) for n in ("hs", "ws", "ht", "wt", "t"))))(
        **{k: x[k] for k in ("hs", "ws", "ht", "wt", "t")}
    )
    d_ws, d_wt = torch.autograd.grad(loss, [x["ws"], x["wt"]], allow_unused=True)
    assert d_ws.abs().max() > 0
    assert d_wt is None or not d_wt.any()


def test_a_zero_row_of_logits_has_a_finite_cosine_gradient(gen):
    """``F.normalize`` clamps a norm to 1e-12: a zero row's cosine is 0 and its gradient finite
    (a plain ``sqrt`` of the squares would give 0 x inf = NaN)."""
    x = _student(_batch(gen, torch.float64))
    with torch.no_grad():
        x["hs"][2] = 0.0
    out = liger.LigerFusedLinearCosineSimilarityLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=1.0)(
        *_args(x, False)
    )
    s, t = F.linear(x["hs"], x["ws"]), F.linear(x["ht"], x["wt"])
    rows = 1 - F.cosine_similarity(F.normalize(s, dim=-1), F.normalize(t, dim=-1), dim=-1)
    valid = x["t"] != -100
    want = torch.where(valid, rows, 0.0).sum() / valid.sum()
    assert_close(out.detach(), want.detach(), 1e-12, 1e-12, "loss")
    (d_hs,) = torch.autograd.grad(out, [x["hs"]])
    assert torch.isfinite(d_hs).all()


def _feeds(kern: rx.Kernel, x: dict) -> tuple:
    plan = kern.grad_plan(**x)
    saved = plan.forward(**x)
    feed = x | (dict(saved) if isinstance(saved, dict) else {})
    return plan, {n: feed[n] if n in feed else torch.ones(()) for n in plan.backward.inputs}  # _g*: cotangents


# temperature 1: the hard and soft terms share the student's log-softmax and the simplifier merges
# their gradients (the target's one-hot beside the row sums); all three outputs: Liger's modules'
# program, three cotangents scaled by the count (values no kernel computes, read by both GEMMs)
@pytest.mark.parametrize(
    ("loss", "temperature", "outputs"),
    [("fused", 1.0, "loss"), ("fused", 2.0, "loss")]
    + [(loss, temp, outs) for loss in sorted(MODULES) for temp in (1.0, 2.0) for outs in ("loss", "all")],
)
def test_neither_head_writes_its_logits_forward_or_backward(loss, temperature, outputs, gen):
    """One row kernel computes both products tile by tile (the JSD's two passes, the cosine's one);
    the backward's row kernel recomputes them for the softmax gradient's row sum and its two GEMMs
    in their K loops: no tokens x vocabulary buffer on the interpreter's plan or sm_90's."""
    hs, ws, ht, wt, t, bs, bt = (rx.var(n) for n in ("hs", "ws", "ht", "wt", "t", "bs", "bt"))
    if loss == "fused":
        expr = rx.linear_jsd(hs, ws, ht, wt, t, beta=0.3, temperature=temperature)
        names: tuple[str, ...] = ("hs", "ws", "ht", "wt", "t")
    else:
        outs = rx.distillation_outputs(loss, hs, ws, ht, wt, t, bs, bt, temperature=temperature)
        expr = outs["loss"] if outputs == "loss" else outs
        names = ("hs", "ws", "ht", "wt", "t", "bs", "bt")
    x = {k: v for k, v in _student(_batch(gen, torch.float32)).items() if k in names}
    kern = rx.compile(expr)
    logits = ROWS * VOCAB
    for program in (kern.program(**x), kern.lower_for(GPU, **x)):
        assert len(program.launched) == 1  # the final sums run as its tail
        assert all(math.prod(b.shape) < logits for b in program.buffers), [b.shape for b in program.buffers]
    plan, inputs = _feeds(kern, x)
    for backward in (plan.backward.program(**inputs), plan.backward.lower_for(GPU, **inputs)):
        assert all(math.prod(b.shape) < logits for b in backward.buffers), [b.shape for b in backward.buffers]
    with ShapesSeen() as seen:
        got = rx.compile(expr)(**x)
        sum(got.values()).backward() if isinstance(got, dict) else got.backward()
    assert not [s for s in seen.shapes if math.prod(s) == logits]  # 13 x 37: no tile or operand has that size


def test_the_compute_model_counts_each_product_where_it_is_computed(gen):
    """Forward: two passes of the JSD's row kernel (both logsumexps, then the terms), each computing
    both products. Backward: the row kernel's one pass for the softmax gradient's row sum, and each
    gradient GEMM its own product plus both products recomputed in its K loop."""
    x = _student(_batch(gen, torch.float32))
    kern = rx.compile(rx.linear_jsd(*(rx.var(n) for n in ("hs", "ws", "ht", "wt", "t"))))
    x = {k: x[k] for k in ("hs", "ws", "ht", "wt", "t")}
    student, teacher = 2 * ROWS * VOCAB * HS, 2 * ROWS * VOCAB * HT
    forward = kern.program(**x)
    assert (forward.flops, forward.minimum_flops) == (2 * (student + teacher), student + teacher)
    plan, inputs = _feeds(kern, x)
    backward = plan.backward.program(**inputs)
    assert backward.flops == 3 * (student + teacher) + 2 * student
    assert backward.minimum_flops == 3 * student + teacher  # the two gradient GEMMs are the student's size


@pytest.mark.parametrize("loss", ["fused", "cosine"])
def test_the_chunk_loop_computes_both_products_once_per_chunk(loss, gen):
    """Where the gradient GEMMs would recompute both heads' products in many tiles (hidden sizes of
    a few hundred here), the chunk loop computes them once per chunk of classes: its first kernel
    is the student's GEMM computing the teacher's product at its output tile too. Against float64
    torch (float64 inputs: every rounding but the order of sums is gone)."""
    n, v, h_s, h_t = 21, 300, 200, 150  # 3 chunks of 128 classes, the last one short
    wide = {"hs": torch.randn(n, h_s, generator=gen, dtype=torch.float64),
            "ws": torch.randn(v, h_s, generator=gen, dtype=torch.float64) * 0.1,
            "ht": torch.randn(n, h_t, generator=gen, dtype=torch.float64),
            "wt": torch.randn(v, h_t, generator=gen, dtype=torch.float64) * 0.1,
            "t": torch.randint(0, v, (n,), generator=gen)}  # fmt: skip
    wide["t"][[2, 9]] = -100
    hs, ws, ht, wt, t = (rx.var(k) for k in wide)
    if loss == "fused":
        kern = rx.compile(rx.linear_jsd(hs, ws, ht, wt, t, beta=0.3, temperature=2.0))
    else:
        kern = rx.compile(rx.distillation_outputs("cosine", hs, ws, ht, wt, t, temperature=2.0)["loss"])
    mine, ref = ({k: x.clone().requires_grad_(k in ("hs", "ws")) for k, x in wide.items()} for _ in range(2))
    plan, inputs = _feeds(kern, mine)
    assert "computed once, in 3 chunk(s) of 128" in plan.backward.explain(**inputs)
    out = kern(**mine)
    s, te = F.linear(ref["hs"], ref["ws"]) / 2.0, (F.linear(ref["ht"], ref["wt"]) / 2.0).detach()
    valid = ref["t"] != -100
    if loss == "fused":
        want = torch.where(valid, _jsd_rows_of(s, te, 0.3), 0.0).sum() / valid.sum()
    else:
        rows = 0.5 * (1 - F.cosine_similarity(s, te, dim=-1))
        hard = F.cross_entropy(F.linear(ref["hs"], ref["ws"]), ref["t"], reduction="sum")
        want = 0.5 * hard / valid.sum() + 0.5 * torch.where(valid, rows, 0.0).sum() / valid.sum()
    assert_close(out.detach(), want.detach(), 1e-12, 1e-12, "loss")
    got = torch.autograd.grad(out, [mine["hs"], mine["ws"]])
    for k, g, w in zip(("hs", "ws"), got, torch.autograd.grad(want, [ref["hs"], ref["ws"]])):
        assert_close(g, w, 1e-12, 1e-10, f"d{k}")


def test_the_chunk_loops_flops_at_4096_tokens(gen):
    """Planned for sm_90 (bf16, 4096 tokens x 32000 classes, student hidden 1024, teacher 2048): the
    backward computes both products twice (the softmax gradient's row sum, the chunk) and the two
    gradient GEMMs once each, 1.6x the minimum (it was 10.6x with both products recomputed in
    every output tile of the gradient GEMMs)."""
    bf = dict(dtype=torch.bfloat16)
    x = {"hs": torch.empty(4096, 1024, **bf).requires_grad_(), "ws": torch.empty(32000, 1024, **bf).requires_grad_(),
         "ht": torch.empty(4096, 2048, **bf), "wt": torch.empty(32000, 2048, **bf),
         "t": torch.zeros(4096, dtype=torch.int64)}  # fmt: skip
    kern = rx.compile(rx.linear_jsd(*(rx.var(k) for k in x), temperature=2.0))
    plan = kern.grad_plan(**x)
    # each head's saved logsumexp and softmax total, the count of tokens
    saved = {"_g0": torch.empty(()), "_s6": torch.empty(()), **{f"_s{i}": torch.empty(4096, 1) for i in range(4)}}
    backward = plan.backward.lower_for(GPU, **{n: x[n].detach() if n in x else saved[n] for n in plan.backward.inputs})
    student, teacher = 2 * 4096 * 32000 * 1024, 2 * 4096 * 32000 * 2048
    assert (backward.flops, backward.minimum_flops) == (2 * (student + teacher) + 2 * student, 3 * student + teacher)
    assert all(math.prod(b.shape) < 4096 * 32000 for b in backward.buffers)  # a chunk of 640 classes, dh's carry


def test_bad_arguments_name_what_is_wrong():
    hs, ws, ht, wt, t = (rx.var(n) for n in ("hs", "ws", "ht", "wt", "t"))
    with pytest.raises(RtxError, match="loss must be one of"):
        rx.distillation_outputs("kl", hs, ws, ht, wt, t)
    with pytest.raises(RtxError, match="beta must be in"):
        rx.distillation_outputs("jsd", hs, ws, ht, wt, t, beta=1.5)
    with pytest.raises(RtxError, match="temperature must be a positive"):
        rx.linear_jsd(hs, ws, ht, wt, t, temperature=0.0)
    with pytest.raises(RtxError, match="accum_dtype"):
        liger.LigerFusedLinearJSD(accum_dtype=torch.bfloat16)
    kern = rx.compile(rx.linear_jsd(hs, ws, ht, wt, t))
    with pytest.raises(RtxError, match="jsd"):  # a teacher vocabulary of another size
        kern(hs=torch.ones(3, 4), ws=torch.ones(8, 4), ht=torch.ones(3, 2), wt=torch.ones(9, 2), t=torch.ones(3).long())
