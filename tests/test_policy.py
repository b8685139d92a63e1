"""GRPO over a fused linear head (issue 36): ``rx.grpo_outputs``, ``rx.linear_logps(temperature=)``
and ``rtxdsl.liger.LigerFusedLinearGRPOLoss``.

Each configuration runs against Liger-Kernel's own chunked class (``compiled=False``: plain torch,
so it runs on CPU) on float64 copies of the same inputs (Liger computes its log-probabilities in
float32, so that is its precision): the loss, the metrics (KL, clip ratio) and the gradients of the
hidden states, the head and its bias. Plans: one row kernel per model, the logits never written,
forward or backward."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ShapesSeen, assert_close, assert_grads_agree

import rtxdsl as rx
from rtxdsl import liger
from rtxdsl.errors import RtxError
from rtxdsl.ops.policy import TOKEN_LOSSES

chunked = pytest.importorskip("liger_kernel.chunked_loss", reason="the peer's class is the reference here")

B, T, HIDDEN, VOCAB = 3, 5, 9, 37  # odd sizes throughout; a sequence with no token counted (its mean is 0 / 1)

#: (dtype, atol, rtol) against Liger on float64 copies: float32 log-probabilities there; bf16 logits
#: are rounded by Liger's matmul and not by rtxdsl's float32 accumulator
TOLERANCES = [(torch.float64, 2e-5, 2e-5), (torch.bfloat16, 6e-2, 3e-2)]


def _batch(gen: torch.Generator, dtype: torch.dtype, bias: bool, ref: str, old: bool, ratio: tuple | None) -> dict:
    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    mask = (torch.rand(B, T, generator=gen) > 0.3).to(torch.int64)
    mask[0] = 0
    h, w, t = rand(B, T, HIDDEN), rand(VOCAB, HIDDEN, scale=0.5), torch.randint(0, VOCAB, (B, T), generator=gen)
    b = rand(VOCAB, scale=0.1) if bias else None
    logits = h.double() @ w.double().T + (0.0 if b is None else b.double())
    logps = torch.log_softmax(logits, -1).gather(-1, t.unsqueeze(-1)).squeeze(-1).float()
    # the sampling policy's log-probabilities: importance weights from 0.6 to 1.5, either side of each
    # clip bound (0.8, 1.2, 1.28), none within 3% of one (bf16's logits move them less)
    spread = torch.tensor([0.6, 0.65, 0.7, 0.76, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15, 1.24, 1.35, 1.4, 1.5])
    weights = spread[torch.randperm(B * T, generator=gen)].reshape(B, T)
    x = {
        "_input": h,
        "lin_weight": w,
        "selected_token_ids": t,
        "attention_mask": mask,
        "advantages": torch.tensor([0.7, -1.3, 0.4], dtype=torch.float32),  # both signs: both clip sides count
        "bias": b,
        "old_per_token_logps": logps - weights.log() if old else None,
        "vllm_is_ratio": torch.rand(ratio, generator=gen) + 0.5 if ratio else None,
    }
    if ref == "logps":
        x["ref_per_token_logps"] = -torch.rand(B, T, generator=gen) * 3.0 - 2.0
    if ref == "model":
        x |= {"ref_input": rand(B, T, HIDDEN), "ref_weight": rand(VOCAB, HIDDEN, scale=0.5), "ref_bias": rand(VOCAB)}
    return x


# (options, inputs): every loss type, each with an option or input that changes its math, then the
# options every loss type shares
CASES = [
    ({"loss_type": "bnpo"}, {}),  # on-policy: weights of 1 with a gradient, no reference (its KL is 0)
    ({"loss_type": "cispo", "epsilon_high": 1.2}, {"old": True, "num_items": 13}),
    ({"loss_type": "dapo"}, {"old": True}),
    ({"loss_type": "dr_grpo", "max_completion_length": 7}, {"old": True, "ref": "logps"}),
    ({"loss_type": "grpo", "importance_sampling_level": "sequence"}, {"old": True}),
    ({"loss_type": "luspo"}, {"old": True}),
    ({"loss_type": "sapo", "sapo_temperature_neg": 2.0}, {"old": True, "ref": "logps"}),
    ({"loss_type": "vespo", "vespo_k_pos": 1.5}, {"old": True, "ratio": (B, T)}),
    ({"importance_sampling_level": "sequence"}, {"old": True, "ref": "logps"}),  # GSPO
    ({"temperature": 0.7, "beta": 0.1}, {"ref": "model", "old": True, "ratio": (B,)}),  # the reference's head
    ({"delta": 1.3, "beta": 0.0}, {"old": True, "ratio": (B, T)}),  # INTELLECT-2's clip, no KL term
    ({"use_bias_correction_kl": True, "epsilon_high": 0.28}, {"old": True, "ref": "logps", "ratio": (B, 1)}),
]
assert sorted({o.get("loss_type", "dapo") for o, _ in CASES}) == sorted(TOKEN_LOSSES)


def _ids(case: tuple) -> str:
    return "-".join(f"{k}={v}" for k, v in {**case[0], **case[1]}.items())


def _check(opts: dict, given: dict, dtype, atol, rtol, gen, bias: bool = True) -> None:
    ref = given.get("ref", "")
    opts = {"use_ref_model": bool(ref)} | opts
    x = _batch(gen, dtype, bias, ref, given.get("old", False), given.get("ratio"))
    x = {k: v for k, v in x.items() if v is not None} | (
        {"num_items_in_batch": given["num_items"]} if "num_items" in given else {}
    )
    leaves = [k for k in ("_input", "lin_weight", "bias") if k in x]
    mine = {k: v.clone().requires_grad_(True) if k in leaves else v for k, v in x.items()}
    wide = {k: v.detach().double().requires_grad_(True) if k in leaves else v for k, v in x.items()}
    for k in ("ref_input", "ref_weight", "ref_bias"):
        if k in wide:
            wide[k] = wide[k].double()
    loss, metrics = liger.LigerFusedLinearGRPOLoss(**opts)(**mine)
    want_loss, want_metrics = chunked.LigerFusedLinearGRPOLoss(compiled=False, **opts)(**wide)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert len(metrics) == len(want_metrics) == (2 if opts.get("beta", 0.04) != 0.0 else 1)
    assert_close(loss, want_loss.detach().double(), atol, rtol, "loss")
    for name, got, want in zip(("kl", "clip_ratio")[-len(metrics) :], metrics, want_metrics):
        scale = max(1.0, want.abs().item())
        assert_close(got.detach(), want.detach().double(), atol * scale, rtol, name)
    assert_grads_agree(loss, want_loss, [(k, mine[k], wide[k]) for k in leaves], atol, rtol)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_each_loss_type_agrees_with_liger_in_float64(case, gen):
    _check(*case, torch.float64, *TOLERANCES[0][1:], gen)


@pytest.mark.parametrize("case", [CASES[2], CASES[9]], ids=_ids)  # DAPO; the reference model's head, T = 0.7
def test_bf16_agrees_with_liger(case, gen):
    _check(*case, *TOLERANCES[1], gen)


def test_without_a_bias(gen):
    _check({"loss_type": "bnpo"}, {"old": True, "ref": "logps"}, *TOLERANCES[0], gen, bias=False)


def test_temperature_scales_the_float32_logits(gen):
    """``linear_logps(temperature=)`` against its definition in float64: log_softmax(logits / T)."""
    h, w, t = torch.randn(2, 3, 8, generator=gen), torch.randn(11, 8, generator=gen), torch.randint(0, 11, (2, 3))
    k = rx.compile(rx.linear_logps(rx.var("h"), rx.var("w"), rx.var("t"), temperature=0.6))
    want = torch.log_softmax((h.double() @ w.double().T) / 0.6, -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
    assert_close(k(h=h, w=w, t=t).double(), want, 1e-5, 1e-5, "logps")


def test_both_models_share_one_row_kernel_and_no_logits_are_written(gen):
    """With the reference model's head: its rows and the policy's are one row kernel computing both
    products' logit tiles inside itself (the per-token KL term reads both); the backward's GEMMs
    recompute the policy's tiles."""
    m = liger.LigerFusedLinearGRPOLoss(beta=0.1)
    x = _batch(gen, torch.float64, True, "model", True, None)
    x = {k: v for k, v in x.items() if v is not None}
    x["_input"].requires_grad_(True)
    x["lin_weight"].requires_grad_(True)
    rx.reset_fusion_stats()
    with ShapesSeen() as seen:
        loss, _ = m(**x)
        forward = rx.fusion_stats().kernels_launched
        rx.reset_fusion_stats()
        loss.backward()
    assert forward == 2  # the advantages' signs, then both models' rows (the sums as its tail)
    assert rx.fusion_stats().kernels_launched == 4  # the cotangent, dh, dw and the bias gradient's sum
    logits = B * T * VOCAB
    assert not [s for s in seen.shapes if math.prod(s) and math.prod(s) % logits == 0], seen.shapes


@pytest.mark.parametrize(
    ("make", "call", "message"),
    [
        (lambda: liger.LigerFusedLinearGRPOLoss(loss_type="ppo"), None, "loss_type"),
        (  # refused when called, as Liger's (its own test builds the module first)
            lambda: liger.LigerFusedLinearGRPOLoss(loss_type="sapo", importance_sampling_level="sequence"),
            lambda m, x: m(**x),
            "Sequence-level importance sampling is not supported for loss_type='sapo'",
        ),  # fmt: skip
        (lambda: liger.LigerFusedLinearGRPOLoss(loss_type="dr_grpo"), None, "max_completion_length"),
        (lambda: liger.LigerFusedLinearGRPOLoss(temperature=0.0), None, "temperature"),
        (lambda: liger.LigerFusedLinearGRPOLoss(sapo_temperature_neg=-1.0), None, "sapo_temperature_neg"),
        (lambda: liger.LigerFusedLinearGRPOLoss(chunk_size=0), None, "chunk_size"),
        (liger.LigerFusedLinearGRPOLoss, lambda m, x: m(**x), "ref_input"),
        (
            lambda: liger.LigerFusedLinearGRPOLoss(use_ref_model=False),
            lambda m, x: m(**x, vllm_is_ratio=torch.ones(B, 2)),
            "vllm_is_ratio",
        ),
    ],
    ids=[
        "unknown-loss-type",
        "sequence-sapo",
        "dr-grpo-length",
        "temperature",
        "sapo-temperature",
        "chunk-size",
        "no-ref",
        "ratio-shape",
    ],  # fmt: skip
)
def test_bad_options_and_inputs_name_what_is_wrong(make, call, message, gen):
    x = {k: v for k, v in _batch(gen, torch.float32, False, "", False, None).items() if v is not None}
    with pytest.raises(RtxError, match=message):
        m = make()
        call(m, x)
