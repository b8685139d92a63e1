"""Preference losses over a fused linear head (issue 36): ``rx.linear_logps``, ``rx.sequence_logps``,
``rx.preference_outputs`` and ``rtxdsl.liger``'s DPO / ORPO / CPO / SimPO modules.

Each option set runs against Liger-Kernel's own chunked classes (``compiled=False``: plain torch,
so they run on CPU) on the same inputs upcast to float64 (Liger computes its log-softmax in
float32, so that is its precision), loss, every auxiliary output and the gradients of the
hidden states, the head and its bias; the log-probabilities, and the DPO loss written out, also
against a float64 torch reference of their definition. Plans: one row kernel per model with the
logits never written, forward and backward."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import ShapesSeen, assert_close, assert_grads_agree

import rtxdsl as rx
from rtxdsl import liger
from rtxdsl.errors import RtxError
from rtxdsl.ops.preference import DPO_LOSSES

chunked = pytest.importorskip("liger_kernel.chunked_loss", reason="the peer's classes are the reference here")

PAIRS, T, HIDDEN, VOCAB = 2, 5, 9, 37  # 4 sequences of 5 tokens, odd hidden and vocabulary sizes
IGNORE = -100

#: (dtype, atol, rtol) against Liger on float64 copies of the same (rounded) inputs: float32 log-softmax
#: there; bf16 logits are rounded by Liger's F.linear and not by rtxdsl's float32 accumulator
TOLERANCES = [(torch.float64, 2e-5, 2e-5), (torch.float32, 5e-5, 5e-5), (torch.bfloat16, 6e-2, 3e-2)]


def _batch(gen: torch.Generator, dtype: torch.dtype, bias: bool = True) -> dict[str, torch.Tensor | None]:
    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    target = torch.randint(0, VOCAB, (2 * PAIRS, T), generator=gen)
    target[0, :2] = IGNORE  # a prompt masked out, and a last token ignored in a rejected sequence
    target[3, -1] = IGNORE
    return {
        "h": rand(2 * PAIRS, T, HIDDEN),
        "w": rand(VOCAB, HIDDEN, scale=0.5),
        "t": target,
        "b": rand(VOCAB) if bias else None,
        "ref_h": rand(2 * PAIRS, T, HIDDEN),
        "ref_w": rand(VOCAB, HIDDEN, scale=0.5),
        "ref_b": rand(VOCAB) if bias else None,
    }


def _call(module: torch.nn.Module, x: dict, uses_ref: bool, **extra) -> tuple:
    args = (x["w"], x["h"], x["t"], x["b"])
    if uses_ref:
        return module(*args, x["ref_h"], x["ref_w"], x["ref_b"])
    return module(*args, **extra)


def _wide(x: dict) -> dict:
    """The inputs as float64 leaves with gradients (the policy's), the reference model's without."""
    out = {}
    for k, v in x.items():
        if v is None or not v.is_floating_point():
            out[k] = v
            continue
        out[k] = v.detach().double().requires_grad_(not k.startswith("ref"))
    return out


# (module name, options): every loss, DPO with each loss_type Liger ships, and the options that change the plan
CASES = [
    *[
        ("DPO", {"loss_type": kind, "label_smoothing": 0.1 if kind in ("exo_pair", "robust") else 0.0})
        for kind in sorted(DPO_LOSSES)
    ],  # fmt: skip
    ("DPO", {"compute_nll_loss": True, "average_log_prob": True, "beta": 0.5, "alpha": 0.3}),
    ("DPO", {"use_ref_model": False}),
    ("ORPO", {"beta": 0.2}),
    ("ORPO", {"compute_nll_loss": False}),
    ("CPO", {"label_smoothing": 0.2, "alpha": 0.5}),
    ("CPO", {"average_log_prob": True, "compute_nll_loss": False}),
    ("SimPO", {"gamma": 0.3, "label_smoothing": 0.1}),
]


def _ids(case: tuple) -> str:
    name, opts = case
    return name + "-" + "-".join(f"{k}={v}" for k, v in opts.items())


def _check(name: str, opts: dict, dtype, atol, rtol, gen, bias: bool = True) -> None:
    ours = getattr(liger, f"LigerFusedLinear{name}Loss")(**opts)
    peer = getattr(chunked, f"LigerFusedLinear{name}Loss")(compiled=False, **opts)
    uses_ref = name == "DPO" and opts.get("use_ref_model", True)
    x = _batch(gen, dtype, bias)
    mine = {k: v.clone().requires_grad_(True) if k in ("h", "w", "b") and v is not None else v for k, v in x.items()}
    wide = _wide(x)
    loss, aux = _call(ours, mine, uses_ref)
    want_loss, want_aux = _call(peer, wide, uses_ref)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert len(aux) == len(want_aux)
    assert_close(loss, want_loss.detach().double(), atol, rtol, "loss")
    for i, (got, want) in enumerate(zip(aux, want_aux)):
        assert_close(got.detach(), want.detach().double(), atol, rtol, f"aux output {i}")
    leaves = [k for k in ("h", "w", "b") if mine[k] is not None]
    assert_grads_agree(loss, want_loss, [(k, mine[k], wide[k]) for k in leaves], atol, rtol)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_each_loss_agrees_with_liger_in_float64(case, gen):
    _check(*case, torch.float64, *TOLERANCES[0][1:], gen)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), TOLERANCES[1:])
@pytest.mark.parametrize("case", [CASES[0], CASES[-1], ("ORPO", {})], ids=_ids)  # DPO, SimPO, ORPO (log1p(-exp))
def test_half_and_float32_inputs_agree_with_liger(case, dtype, atol, rtol, gen):
    _check(*case, dtype, atol, rtol, gen)


def test_without_a_bias(gen):
    _check("DPO", {"compute_nll_loss": True}, torch.float64, 2e-5, 2e-5, gen, bias=False)


#: KTO's options: with and without a reference model, averaged log-probabilities, a given KL estimate
KTO_CASES = [
    ({"use_ref_model": True}, False),
    ({"use_ref_model": True, "average_log_prob": True, "beta": 0.3}, True),
    ({"use_ref_model": False}, True),
    ({"use_ref_model": False, "average_log_prob": True}, False),
]


@pytest.mark.parametrize(("dtype", "atol", "rtol"), [TOLERANCES[0], TOLERANCES[2]])
@pytest.mark.parametrize(("opts", "with_kl"), KTO_CASES, ids=lambda v: str(v))
def test_kto_agrees_with_liger(opts, with_kl, dtype, atol, rtol, gen):
    """Unpaired sequences (an odd count here), each desirable or not; the input first, as Liger's."""
    x = _batch(gen, dtype)
    x = {k: v[:3] if v is not None and k in ("h", "t", "ref_h") else v for k, v in x.items()}
    labels = torch.tensor([True, False, True])
    # a 0-dim estimate, as TRL passes it (Liger chunks by sequence but not kl: a [B] one would count B times there)
    kl = torch.tensor(0.2, dtype=torch.float64) if with_kl else None
    mine = {k: v.clone().requires_grad_(True) if k in ("h", "w", "b") else v for k, v in x.items()}
    wide = _wide(x)

    def call(module, v):
        return module(v["h"], v["w"], v["t"], v["b"], labels, v["ref_h"], v["ref_w"], v["ref_b"],
                      None if kl is None else kl.to(v["h"].dtype))  # fmt: skip

    loss, aux = call(liger.LigerFusedLinearKTOLoss(**opts), mine)
    want, want_aux = call(chunked.LigerFusedLinearKTOLoss(compiled=False, **opts), wide)
    assert_close(loss.detach(), want.detach().double(), atol, rtol, "loss")
    assert len(aux) == len(want_aux) == 6
    for i, (got, ref) in enumerate(zip(aux, want_aux)):
        scale = max(1.0, ref.abs().item())  # sums over sequences and the vocabulary
        assert_close(got.detach(), ref.detach().double(), atol * scale, rtol, f"aux output {i}")
    grads = torch.autograd.grad(loss, [mine[k] for k in "hwb"])
    for k, got, ref in zip("hwb", grads, torch.autograd.grad(want, [wide[k] for k in "hwb"])):
        assert_close(got, ref, atol * max(1.0, ref.abs().max().item()), rtol, f"d{k}")


def test_kto_keeps_the_logits_unwritten(gen):
    x = _batch(gen, torch.float32)
    h, w = x["h"][:3].clone().requires_grad_(True), x["w"].clone().requires_grad_(True)
    m = liger.LigerFusedLinearKTOLoss(use_ref_model=True)
    with ShapesSeen() as seen:
        loss, _ = m(h, w, x["t"][:3], x["b"], torch.tensor([True, False, True]), x["ref_h"][:3], x["ref_w"],
                    x["ref_b"], torch.tensor(0.1))  # fmt: skip
        rx.reset_fusion_stats()
        loss.backward()
    assert rx.fusion_stats().kernels_launched == 3  # the per-token cotangent, dh, dw (db in its K loop)
    logits = 3 * T * VOCAB
    assert not [s for s in seen.shapes if math.prod(s) and math.prod(s) % logits == 0], seen.shapes


def test_orpo_nll_target_is_its_own_target(gen):
    x = _wide(_batch(gen, torch.float64))
    nll_target = x["t"].clone()
    nll_target[:, :3] = IGNORE  # only the completions count for the NLL
    ours, peer = liger.LigerFusedLinearORPOLoss(), chunked.LigerFusedLinearORPOLoss(compiled=False)
    loss, aux = ours(x["w"], x["h"], x["t"], x["b"], nll_target=nll_target)
    want, want_aux = peer(x["w"], x["h"], x["t"], x["b"], nll_target=nll_target)
    assert_close(aux[4].detach(), want_aux[4].detach().double(), 2e-5, 2e-5, "nll_loss")
    assert_close(loss.detach(), want.detach().double(), 2e-5, 2e-5, "loss")


def test_log_probabilities_against_float64_torch(gen):
    x = _wide(_batch(gen, torch.float64))
    h, w, t, b = (rx.var(n) for n in "hwtb")
    k = rx.compile({"tok": rx.linear_logps(h, w, t, b), "seq": rx.sequence_logps(h, w, t, b, average=True)})
    got = k(h=x["h"], w=x["w"], t=x["t"], b=x["b"])
    logp = torch.log_softmax(F.linear(x["h"], x["w"], x["b"]), -1)
    kept = x["t"] != IGNORE
    tok = torch.where(kept, logp.gather(-1, x["t"].clamp(min=0)[..., None])[..., 0], 0.0)
    assert_close(got["tok"], tok, 1e-12, 1e-12, "token log-probabilities")
    assert_close(got["seq"], tok.sum(-1) / kept.sum(-1), 1e-12, 1e-12, "sequence means")
    grads = torch.autograd.grad(got["seq"].sum(), (x["h"], x["w"], x["b"]))
    want = torch.autograd.grad((tok.sum(-1) / kept.sum(-1)).sum(), (x["h"], x["w"], x["b"]))
    for name, a, e in zip("hwb", grads, want):
        assert_close(a, e, 1e-12, 1e-12, f"d{name}")


def test_dpo_loss_written_out_in_float64(gen):
    """DPO's definition, ``-log sigmoid(beta * (log-ratio of chosen - of rejected)))``, in float64."""
    x = _wide(_batch(gen, torch.float64))
    h, w, t, b, rh, rw, rb = (rx.var(n) for n in ("h", "w", "t", "b", "rh", "rw", "rb"))
    outs = rx.preference_outputs("dpo", h, w, t, b, ref=(rh, rw, rb), beta=0.3, compute_nll_loss=False,
                                 average_log_prob=False)  # fmt: skip
    got = rx.compile(outs)(h=x["h"], w=x["w"], t=x["t"], b=x["b"], rh=x["ref_h"], rw=x["ref_w"], rb=x["ref_b"])

    def seq(h, w, b):
        logp = torch.log_softmax(F.linear(h, w, b), -1)
        picked = logp.gather(-1, x["t"].clamp(min=0)[..., None])[..., 0]
        return torch.where(x["t"] != IGNORE, picked, 0.0).sum(-1)

    pol, ref = seq(x["h"], x["w"], x["b"]), seq(x["ref_h"], x["ref_w"], x["ref_b"])
    margin = 0.3 * ((pol[:PAIRS] - ref[:PAIRS]) - (pol[PAIRS:] - ref[PAIRS:]))
    assert_close(got["loss"], -F.logsigmoid(margin).mean(), 1e-12, 1e-12, "loss")
    assert_close(got["chosen_rewards"], 0.3 * (pol[:PAIRS] - ref[:PAIRS]), 1e-12, 1e-12, "chosen_rewards")


def test_both_models_share_one_row_kernel_and_no_logits_are_written(gen):
    """The policy's and the reference model's products are computed tile by tile in one row kernel
    (the targets read there once); the backward writes no logits either."""
    x = _batch(gen, torch.float32)
    h, w, t, b, rh, rw, rb = (rx.var(n) for n in ("h", "w", "t", "b", "rh", "rw", "rb"))
    k = rx.compile(rx.preference_outputs("dpo", h, w, t, b, ref=(rh, rw, rb)))
    ins = {"h": x["h"], "w": x["w"], "t": x["t"], "b": x["b"], "rh": x["ref_h"], "rw": x["ref_w"], "rb": x["ref_b"]}
    text = k.explain(**ins)
    assert text.count("never written") == 2, text  # the policy's product and the reference model's
    assert "3 kernel launch(es)" in text, text  # the row kernel (its tail: the per-sequence sums), two reductions
    policy = {n: v.clone().requires_grad_(True) for n, v in ins.items() if n in ("h", "w", "b")}
    with ShapesSeen() as seen:
        loss = k(**(ins | policy))["loss"]
        rx.reset_fusion_stats()
        loss.backward()
    # the per-token cotangent (from the per-sequence terms), then dh and dw (db in its K loop), and the tail
    assert rx.fusion_stats().kernels_launched == 4
    logits = 2 * PAIRS * T * VOCAB  # elements; a buffer of them in any dtype (or as bytes) is a multiple
    assert not [s for s in seen.shapes if math.prod(s) and math.prod(s) % logits == 0], seen.shapes
    assert all(v.grad is not None for v in policy.values())


@pytest.mark.parametrize(
    ("make", "call", "message"),
    [
        (lambda: liger.LigerFusedLinearDPOLoss(loss_type="ipo"), None, "loss_type"),
        (lambda: liger.LigerFusedLinearDPOLoss(loss_type="exo_pair"), None, "label_smoothing"),
        (lambda: liger.LigerFusedLinearDPOLoss(loss_type="robust", label_smoothing=0.5), None, "label_smoothing"),
        (lambda: liger.LigerFusedLinearCPOLoss(chunk_size=0), None, "chunk_size"),
        (liger.LigerFusedLinearDPOLoss, lambda m, x: m(x["w"], x["h"], x["t"], x["b"]), "ref_input"),
        (liger.LigerFusedLinearSimPOLoss, lambda m, x: m(x["w"], x["h"][:3], x["t"][:3]), "first dim must be even"),
        (liger.LigerFusedLinearKTOLoss, lambda m, x: m(x["h"], x["w"], x["t"]), "preference_labels"),
    ],
    ids=[
        "unknown-loss-type",
        "exo-without-smoothing",
        "robust-smoothing",
        "chunk-size",
        "no-ref",
        "odd-batch",
        "kto-without-labels",
    ],  # fmt: skip
)
def test_bad_options_and_inputs_name_what_is_wrong(make, call, message, gen):
    with pytest.raises(RtxError, match=message):
        m = make()
        call(m, _batch(gen, torch.float32))


@pytest.mark.parametrize(
    "loss",
    [
        lambda lp: rx.sum(rx.sigmoid(rx.sum(lp, -1))),  # a nonlinear per-sequence term
        lambda lp: rx.sum(rx.chunk(rx.sum(lp, -1), 2, 0)[0]),  # one half of the batch
    ],
    ids=["sigmoid-of-sums", "half-of-the-batch"],
)
def test_a_per_sequence_cotangent_keeps_the_logits_unwritten_in_the_backward(loss, gen):
    """The backward's GEMMs recompute the logit tiles with a per-token cotangent that another kernel
    computes from per-sequence values (before, the analyzer wrote tokens x vocabulary of dP)."""
    h, w, t = (rx.var(n) for n in "hwt")
    k = rx.compile(loss(rx.linear_logps(h, w, t)))
    x = _batch(gen, torch.float64)
    hh, ww = x["h"].clone().requires_grad_(True), x["w"].clone().requires_grad_(True)
    with ShapesSeen() as seen:
        out = k(h=hh, w=ww, t=x["t"])
        rx.reset_fusion_stats()
        out.backward()
    assert rx.fusion_stats().kernels_launched == 3  # the cotangent, dh, dw
    logits = 2 * PAIRS * T * VOCAB
    assert not [s for s in seen.shapes if math.prod(s) and math.prod(s) % logits == 0], seen.shapes
    rh, rw = x["h"].clone().requires_grad_(True), x["w"].clone().requires_grad_(True)
    k.reference((rh, rw, x["t"])).backward()
    assert_close(hh.grad, rh.grad, 1e-12, 1e-12, "dh")
    assert_close(ww.grad, rw.grad, 1e-12, 1e-12, "dw")


def _halves(seq: rx.Expr) -> rx.Expr:
    """The first half of the batch minus the second (chosen minus rejected)."""
    chosen, rejected = rx.chunk(seq, 2, 0)
    return chosen - rejected


@pytest.mark.parametrize(
    "loss",
    [
        lambda lp, z: rx.sum(lp) + rx.sum(rx.sigmoid(rx.mean(z, -1))),  # crashed in planning (a value cut twice)
        lambda lp, z: rx.sum(lp) + rx.mean(z),  # the logits mean differentiable: dP is written (noted as work)
        # DPO's term beside the row means: crashed in planning (a cotangent cut where a kernel
        # recomputes it only at a view, and so cannot write it)
        lambda lp, z: rx.mean(rx.softplus(-_halves(rx.sum(lp, -1)))) + rx.mean(rx.sigmoid(rx.mean(z, -1))),
    ],
    ids=["sigmoid-of-row-means", "logits-mean", "pair-margin-beside-row-means"],
)
def test_log_probabilities_beside_other_sums_of_the_logits(loss, gen):
    h, w, t = (rx.var(n) for n in "hwt")
    k = rx.compile(loss(rx.linear_logps(h, w, t), rx.linear(h, w)))
    x = _batch(gen, torch.float64)
    ours = [x["h"].clone().requires_grad_(True), x["w"].clone().requires_grad_(True)]
    ref = [v.detach().clone().requires_grad_(True) for v in ours]
    out, want = k(h=ours[0], w=ours[1], t=x["t"]), k.reference((*ref, x["t"]))
    assert_close(out, want, 1e-12, 1e-12, "loss")
    out.backward()
    want.backward()
    for name, a, e in zip("hw", ours, ref):
        assert_close(a.grad, e.grad, 1e-12, 1e-12, f"d{name}")
