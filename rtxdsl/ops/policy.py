"""Policy-gradient losses over a linear head (GRPO and the variants Liger-Kernel and TRL ship), as
expressions whose logits are never written.

A batch of ``B`` completions of ``T`` tokens: the policy's per-token log-probabilities of the
sampled tokens (:func:`~rtxdsl.ops.llm.linear_logps`, the analyzer computing every logit tile in
one row kernel), their importance weights against the policy that sampled them, and a
per-sequence advantage. A ``loss_type`` is two table entries: the loss of one token
(:data:`TOKEN_LOSSES`) and how the masked tokens' losses are normalized (:data:`NORMALIZERS`).
The backward is derived; its per-token cotangent comes from a kernel of its own and the GEMMs
recompute the logit tiles with it, as for the preference losses.

Example:
    >>> import rtxdsl as rx
    >>> outs = rx.grpo_outputs(rx.var("h"), rx.var("w"), rx.var("t"), rx.var("mask"), rx.var("adv"))
    >>> list(outs)
    ['loss', 'kl', 'clip_ratio']
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import RtxError
from ..expr import Expr, node
from .helpers import ExprLike, int_arg, ref_arg, scalar_arg
from .llm import linear_logps
from .reduction import mean_of


def _total(x: Expr) -> Expr:
    return node("sum", x, axis=None, keepdim=False)


def _row_total(x: Expr) -> Expr:  # over the tokens of each sequence, kept as [B, 1]
    return node("sum", x, axis=(-1,), keepdim=True)


def _at_least_one(x: Expr) -> Expr:
    return node("maximum", x, 1.0)


@dataclass(frozen=True)
class Tokens:
    """A batch of completions: the policy's per-token log-probabilities (``logps``, ``[B, T]``),
    the log importance weights (``log_weight``: per token, or ``[B, 1]`` per sequence for GSPO),
    the token mask as a float, the advantages ``[B, 1]`` and the loss's options."""

    logps: Expr
    log_ratio: Expr  # per token: log(pi / pi_old)
    log_weight: Expr
    mask: Expr
    advantages: Expr
    is_ratio: Expr | None  # vLLM's importance-sampling correction, broadcast to [B, T]
    epsilon_low: float
    epsilon_high: float
    delta: float | None
    sapo: tuple[float, float]  # SAPO's temperatures for positive and negative advantages
    vespo: tuple[float, float, float, float]  # VESPO's k and lambda, non-negative then negative advantages

    @property
    def weight(self) -> Expr:  # the importance weight pi / pi_old
        return node("exp", self.log_weight)

    def clipped(self) -> tuple[Expr, Expr]:  # PPO's: -min(w A, clip(w, 1 - eps_low, 1 + eps_high) A)
        w = self.weight
        kept = w if self.delta is None else node("minimum", w, self.delta)  # INTELLECT-2's two-sided clip
        clip = node("minimum", node("maximum", w, 1.0 - self.epsilon_low), 1.0 + self.epsilon_high)
        a = self.advantages
        return node("mul", kept, a), node("mul", clip, a)


def _ppo(t: Tokens) -> Expr:  # GRPO, BNPO, Dr. GRPO, DAPO, LUSPO: the clipped surrogate
    unclipped, clipped = t.clipped()
    return node("neg", node("minimum", unclipped, clipped))


def _cispo(t: Tokens) -> Expr:  # CISPO (MiniMax-M1): the weight clipped above and detached, times the log-prob
    weight = node("detach", node("minimum", t.weight, t.epsilon_high))
    return node("neg", node("mul", node("mul", weight, t.advantages), t.logps))


def _sapo(t: Tokens) -> Expr:  # SAPO (arXiv 2511.20347): a sigmoid gate instead of the clip
    def gate(temp: float) -> Expr:
        return node("mul", node("sigmoid", node("mul", node("sub", t.weight, 1.0), temp)), 4.0 / temp)

    positive = node("gt", t.advantages, 0.0)
    return node("neg", node("mul", node("where", positive, gate(t.sapo[0]), gate(t.sapo[1])), t.advantages))


def _vespo(t: Tokens) -> Expr:  # VESPO: a detached gamma weight of the sequence's ratio times the log-prob
    k_pos, lam_pos, k_neg, lam_neg = t.vespo
    low = math.log(1e-8)
    seq = _row_total(node("mul", node("minimum", node("maximum", t.log_ratio, -20.0), 20.0), t.mask))
    if t.is_ratio is not None:
        seq = node("add", seq, _row_total(node("minimum", node("maximum", node("log", t.is_ratio), low), 20.0)))
    log_w = node("minimum", node("maximum", seq, low), 20.0)
    nonneg = node("ge", t.advantages, 0.0)
    k = node("where", nonneg, k_pos, k_neg)
    lam = node("where", nonneg, max(lam_pos, 1e-4), max(lam_neg, 1e-4))
    phi = node("exp", node("sub", node("add", lam, node("mul", k, log_w)), node("mul", lam, node("exp", log_w))))
    phi = node("detach", node("where", node("ne", phi, phi), 0.0, phi))  # NaN -> 0, as Liger's nan_to_num
    return node("neg", node("mul", node("mul", phi, t.advantages), t.logps))


#: the losses whose importance weights are per token by construction (no sequence-level variant)
TOKEN_LEVEL_ONLY = ("cispo", "sapo", "vespo")

#: each ``loss_type``: the loss of one token, before the vLLM correction and the KL term
TOKEN_LOSSES: dict[str, Callable[[Tokens], Expr]] = {
    "grpo": _ppo,  # DeepSeekMath (arXiv 2402.03300)
    "bnpo": _ppo,
    "dr_grpo": _ppo,  # Dr. GRPO (arXiv 2503.20783)
    "dapo": _ppo,  # DAPO (arXiv 2503.14476)
    "luspo": _ppo,
    "cispo": _cispo,
    "sapo": _sapo,
    "vespo": _vespo,
}


@dataclass(frozen=True)
class Batch:
    """What a normalizer sees: the tokens' losses (masked, and not), the mask, and the token count
    given for DAPO-like losses (the batch's, across processes)."""

    losses: Expr  # per token, masked
    unmasked: Expr  # per token
    mask: Expr
    max_completion_length: int | None
    normalizer: Expr | None


def _dapo(b: Batch) -> Expr:  # over the batch's tokens (or the count given: TRL's num_items_in_batch)
    count = _at_least_one(_total(b.mask) if b.normalizer is None else b.normalizer)
    return node("div", _total(b.losses), count)


def _dr_grpo(b: Batch) -> Expr:  # over B x the longest completion allowed
    if b.max_completion_length is None:
        raise RtxError("grpo_outputs: loss_type='dr_grpo' needs max_completion_length")
    return node("div", mean_of(_row_total(b.losses), None, False), float(b.max_completion_length))


def _grpo(b: Batch) -> Expr:  # each sequence's mean over its tokens, then the mean over sequences
    return mean_of(node("div", _row_total(b.losses), _at_least_one(_row_total(b.mask))), None, False)


#: each ``loss_type``: the loss of the batch from its tokens' losses
NORMALIZERS: dict[str, Callable[[Batch], Expr]] = {
    "grpo": _grpo,
    "sapo": _grpo,
    "bnpo": lambda b: node("div", _total(b.losses), _at_least_one(_total(b.mask))),
    "dr_grpo": _dr_grpo,
    "dapo": _dapo,
    "cispo": _dapo,
    "vespo": _dapo,
    # TRL's LUSPO: each token (padding too) weighted by its sequence's length, the mean over B x T
    "luspo": lambda b: mean_of(node("mul", b.unmasked, _row_total(b.mask)), None, False),
}


def _k3(log_p: Expr, log_q: Expr) -> Expr:  # Schulman's k3 estimate of KL[q, p]: exp(p - q) - (p - q) - 1
    d = node("sub", log_p, log_q)
    return node("sub", node("sub", node("exp", d), d), 1.0)


def grpo_outputs(
    h: ExprLike, w: ExprLike, target: ExprLike, mask: ExprLike, advantages: ExprLike, bias: ExprLike | None = None,
    *, ref: tuple[ExprLike, ExprLike, ExprLike | None] | None = None, ref_logps: ExprLike | None = None,
    old_logps: ExprLike | None = None, is_ratio: ExprLike | None = None, normalizer: ExprLike | None = None,
    beta: float = 0.04, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
    loss_type: str = "dapo", max_completion_length: int | None = None, importance_sampling_level: str = "token",
    temperature: float = 1.0, sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
    delta: float | None = None, use_bias_correction_kl: bool = False, vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
) -> dict[str, Expr]:  # fmt: skip
    """GRPO over the linear head ``h @ w.T (+ bias)``, with Liger-Kernel's outputs, for
    ``rx.compile`` (the logits are never written, forward or backward).

    ``h`` is ``[B, T, hidden]``, ``target`` ``[B, T]`` int64 (the sampled tokens), ``mask``
    ``[B, T]`` (which tokens count; bool, int or float), ``advantages`` ``[B]``. The log-probabilities
    are of ``softmax(logits / temperature)``. ``old_logps`` ``[B, T]``: the sampling policy's (the
    policy's own, detached, without it: on-policy); the KL term ``beta * k3`` is against
    ``ref_logps`` ``[B, T]``, or a reference model's head ``ref=(ref_h, ref_w, ref_bias)`` (no
    gradient; the policy's own, so 0, with neither). ``is_ratio``: vLLM's importance-sampling
    correction (``[B, T]`` or ``[B, 1]``). ``normalizer``: the token count DAPO, CISPO and VESPO
    divide by (TRL's ``num_items_in_batch`` over the processes; the mask's sum without it).
    ``loss_type`` is one of :data:`TOKEN_LOSSES`;
    ``importance_sampling_level="sequence"`` (GSPO) weights each token by its sequence's mean
    log-ratio. Outputs: ``loss``; ``kl`` (the masked mean of the KL term, when ``beta`` is not 0) and
    ``clip_ratio`` (the share of tokens whose weight was clipped against their advantage's sign),
    metrics without a gradient.

    Example:
        >>> import torch, rtxdsl as rx
        >>> v = {n: rx.var(n) for n in ("h", "w", "t", "m", "a")}
        >>> outs = rx.grpo_outputs(v["h"], v["w"], v["t"], v["m"], v["a"], loss_type="bnpo")
        >>> got = rx.compile(outs)(h=torch.zeros(2, 3, 8), w=torch.zeros(16, 8), t=torch.ones(2, 3, dtype=torch.long),
        ...                        m=torch.ones(2, 3), a=torch.tensor([1.0, -1.0]))
        >>> round(got["loss"].item(), 4), got["clip_ratio"].item()  # on-policy: weights 1, the advantages' mean
        (0.0, 0.0)
    """
    token_loss, normalize = TOKEN_LOSSES.get(loss_type), NORMALIZERS.get(loss_type)
    if token_loss is None or normalize is None:
        raise RtxError(f"grpo_outputs: loss_type must be one of {sorted(TOKEN_LOSSES)}, got {loss_type!r}")
    if importance_sampling_level not in ("token", "sequence"):
        raise RtxError(
            f"grpo_outputs: importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}"
        )
    for name, eps in (("epsilon_low", epsilon_low), ("epsilon_high", epsilon_high)):
        if scalar_arg(eps, "grpo_outputs", name) < 0:
            raise RtxError(f"grpo_outputs: {name} must be >= 0 (the clip's distance from 1), got {eps!r}")
    length = max_completion_length
    if length is not None and int_arg(length, "grpo_outputs", "max_completion_length") < 1:
        raise RtxError(f"grpo_outputs: max_completion_length must be >= 1, got {max_completion_length!r}")
    if importance_sampling_level == "sequence" and loss_type in TOKEN_LEVEL_ONLY:
        raise RtxError(
            f"grpo_outputs: Sequence-level importance sampling is not supported for loss_type={loss_type!r} "
            "(importance_sampling_level='sequence' applies to the clipped losses)"
        )
    if ref is not None and ref_logps is not None:
        raise RtxError(
            "grpo_outputs: give the reference model's head (ref=...) or its log-probabilities (ref_logps=...)"
        )
    beta = scalar_arg(beta, "grpo_outputs", "beta")
    for name, t in (("sapo_temperature_pos", sapo_temperature_pos), ("sapo_temperature_neg", sapo_temperature_neg)):
        if not scalar_arg(t, "grpo_outputs", name) > 0:
            raise RtxError(f"grpo_outputs: {name} must be positive, got {t!r}")
    if delta is not None and not scalar_arg(delta, "grpo_outputs", "delta") > 0:
        raise RtxError(f"grpo_outputs: delta must be positive, got {delta!r}")
    logps = linear_logps(h, w, target, bias, temperature=temperature)
    m = node("mul", mask, 1.0)  # a float mask (bool and int masks count their tokens)
    old = node("detach", logps) if old_logps is None else old_logps
    log_ratio = node("sub", logps, old)
    log_weight = log_ratio
    if importance_sampling_level == "sequence":  # GSPO: the sequence's mean log-ratio, for each of its tokens
        log_weight = node("div", _row_total(node("mul", log_ratio, m)), _at_least_one(_row_total(m)))
    adv = node("unsqueeze", advantages, axes=(1,))
    ratio = None if is_ratio is None else node("mul", is_ratio, 1.0)  # an expression, whatever was given
    tokens = Tokens(
        logps, log_ratio, log_weight, m, adv, ratio, float(epsilon_low), float(epsilon_high),
        None if delta is None else float(delta), (float(sapo_temperature_pos), float(sapo_temperature_neg)),
        (float(vespo_k_pos), float(vespo_lambda_pos), float(vespo_k_neg), float(vespo_lambda_neg)),
    )  # fmt: skip
    loss = token_loss(tokens)
    if ratio is not None and loss_type != "vespo":  # VESPO folds it into its weight
        loss = node("mul", loss, ratio)
    outs: dict[str, Expr] = {}
    if beta != 0.0:
        if ref is not None:
            ref_h, ref_w, ref_b = ref_arg(ref, "grpo_outputs")
            ref_lp: Expr = node("detach", linear_logps(ref_h, ref_w, target, ref_b, temperature=temperature))
        else:
            ref_lp = node("detach", logps) if ref_logps is None else ref_logps
        kl = _k3(ref_lp, logps)
        if use_bias_correction_kl:  # DeepSeek-V3.2: the KL weighted by the importance weight
            kl = node("mul", kl, tokens.weight)
        loss = node("add", loss, node("mul", kl, beta))
        outs["kl"] = _masked_mean(kl, m)
    batch = Batch(node("mul", loss, m), loss, m, max_completion_length, normalizer)
    return {"loss": normalize(batch), **outs, "clip_ratio": _masked_mean(_clipped(tokens, loss_type), m)}


def _masked_mean(x: Expr, mask: Expr) -> Expr:  # a metric: over the batch's tokens, without a gradient
    return node("detach", node("div", _total(node("mul", x, mask)), _at_least_one(_total(mask))))


def _clipped(t: Tokens, loss_type: str) -> Expr:
    """1.0 where a token's weight was clipped against its advantage's sign (below for a negative
    advantage, above for a positive one), else 0.0 (never for SAPO and VESPO, which do not clip)."""
    if loss_type in ("sapo", "vespo"):
        return node("mul", t.mask, 0.0)
    w = t.weight
    upper = 1.0 + t.epsilon_high if loss_type != "cispo" else t.epsilon_high
    below = node("lt", w, 1.0 - t.epsilon_low) if loss_type != "cispo" else None
    up = node("and", node("gt", w, upper), node("gt", t.advantages, 0.0))
    hit = up if below is None else node("or", node("and", below, node("lt", t.advantages, 0.0)), up)
    return node("where", hit, 1.0, 0.0)
