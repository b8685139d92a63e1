"""Preference losses over a linear head (DPO and its variants, ORPO, CPO, SimPO), as expressions
whose logits are never written.

Each loss compares per-sequence log-probabilities of a chosen and a rejected completion, stacked
on the batch axis (chosen first, as Liger-Kernel and TRL stack them). A sequence's log-probability
is a sum over its tokens of :func:`~rtxdsl.ops.llm.linear_logps`, so the analyzer computes every
logit tile inside one row kernel per model (policy, reference) and writes only per-token values;
the backward is derived (the logits recomputed from the saved logsumexp, or the chunk loop of
``FusionConfig.chunk_budget``). Nothing is hand-written per loss: a loss is one entry of
:data:`PAIR_LOSSES`, a formula over the pair's margins.

Example:
    >>> import rtxdsl as rx
    >>> h, w, t = rx.var("h"), rx.var("w"), rx.var("t")
    >>> outs = rx.preference_outputs("dpo", h, w, t, ref=(rx.var("ref_h"), rx.var("ref_w"), None))
    >>> list(outs)[:3], list(outs)[-2:]
    (['loss', 'chosen_logps', 'rejected_logps'], ['chosen_rewards', 'rejected_rewards'])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import RtxError
from ..expr import Expr, node
from .helpers import ExprLike, flag_arg, ref_arg, scalar_arg
from .llm import capped_logits, linear_logps
from .movement import chunk
from .reduction import mean_of


def sequence_logps(
    h: ExprLike, w: ExprLike, target: ExprLike, bias: ExprLike | None = None, ignore_index: int = -100,
    average: bool = False,
) -> Expr:  # fmt: skip
    """Each sequence's log-probability of its targets under ``softmax(h @ w.T (+ bias))``: the sum
    over the target's last axis of :func:`~rtxdsl.ops.llm.linear_logps`, or (``average``) its mean
    over the non-ignored tokens (NaN for a sequence without one, as Liger's). Float32.

    Example:
        >>> import torch, rtxdsl as rx
        >>> lp = rx.sequence_logps(rx.var("h"), rx.var("w"), rx.var("t"), average=True)
        >>> out = rx.compile(lp)(h=torch.zeros(2, 3, 4), w=torch.zeros(8, 4), t=torch.ones(2, 3, dtype=torch.long))
        >>> [round(v, 4) for v in out.tolist()]  # log(1/8) per token, averaged
        [-2.0794, -2.0794]
    """
    average = flag_arg(average, "sequence_logps", "average")
    total = node("sum", linear_logps(h, w, target, bias, ignore_index), axis=(-1,), keepdim=False)
    return node("div", total, _tokens(target, ignore_index)) if average else total


def _tokens(target: ExprLike, ignore_index: int) -> Expr:
    """How many tokens of each sequence count (float32)."""
    return node("sum", node("where", node("ne", target, ignore_index), 1.0, 0.0), axis=(-1,), keepdim=False)


def _logsigmoid(x: Expr) -> Expr:  # log(sigmoid(x)) = -softplus(-x), finite for any x
    return node("neg", node("softplus", node("neg", x), 1.0, 20.0))


def _sigmoid(x: Expr) -> Expr:
    return node("sigmoid", x)


def _all_mean(x: Expr) -> Expr:  # the mean over the pairs (Liger's ``sum() / n_pairs``)
    return mean_of(x, None, False)


@dataclass(frozen=True)
class Pair:
    """A batch of pairs: the policy's sequence log-probabilities of the chosen and rejected
    completions, the reference model's (0 without one), ``beta`` and the loss's options."""

    chosen: Expr
    rejected: Expr
    ref_chosen: Expr | float
    ref_rejected: Expr | float
    beta: float
    label_smoothing: float
    discopop_tau: float
    gamma: float

    @property
    def chosen_ratio(self) -> Expr:  # log(pi(y_w) / pi_ref(y_w))
        return node("sub", self.chosen, self.ref_chosen)

    @property
    def rejected_ratio(self) -> Expr:
        return node("sub", self.rejected, self.ref_rejected)

    @property
    def margin(self) -> Expr:  # DPO's logit: beta * (chosen log-ratio - rejected log-ratio)
        return node("mul", node("sub", self.chosen_ratio, self.rejected_ratio), self.beta)

    @property
    def chosen_reward(self) -> Expr:
        return node("mul", self.chosen_ratio, self.beta)

    @property
    def rejected_reward(self) -> Expr:
        return node("mul", self.rejected_ratio, self.beta)

    def smoothed(self, x: Expr) -> Expr:  # -(1 - eps) log sigmoid(x) - eps log sigmoid(-x) (cDPO, CPO, SimPO)
        eps = self.label_smoothing
        return node("sub", node("mul", _logsigmoid(x), eps - 1.0), node("mul", _logsigmoid(node("neg", x)), eps))


def _exo(p: Pair) -> Expr:  # EXO-pref (arXiv 2402.00856, eq. 16): KL(q || [1 - eps, eps]) over the pair
    d, eps = p.margin, p.label_smoothing
    win = node("mul", _sigmoid(d), node("sub", _logsigmoid(d), math.log1p(-eps)))
    lose = node("mul", _sigmoid(node("neg", d)), node("sub", _logsigmoid(node("neg", d)), math.log(eps)))
    return node("add", win, lose)


def _discopop(p: Pair) -> Expr:  # DiscoPOP (arXiv 2406.08414, eq. 5): logistic and exp losses blended
    d = p.margin
    blend = _sigmoid(node("div", d, p.discopop_tau))
    logistic = node("neg", _logsigmoid(d))
    return node("add", node("mul", logistic, node("sub", 1.0, blend)), node("mul", node("exp", node("neg", d)), blend))


def _nca(p: Pair) -> Expr:  # NCA (arXiv 2402.05369): the chosen reward up, both against 0
    against = node("add", _logsigmoid(node("neg", p.chosen_reward)), _logsigmoid(node("neg", p.rejected_reward)))
    return node("sub", node("neg", _logsigmoid(p.chosen_reward)), node("mul", against, 0.5))


def _robust(p: Pair) -> Expr:  # cDPO / robust DPO: a share label_smoothing of the labels assumed flipped
    d, eps = p.margin, p.label_smoothing
    clean, flipped = node("mul", _logsigmoid(d), eps - 1.0), node("mul", _logsigmoid(node("neg", d)), eps)
    return node("div", node("add", clean, flipped), 1.0 - 2.0 * eps)


def _sppo(p: Pair) -> Expr:  # SPPO, hard probabilities (arXiv 2405.00675): ratios pulled to +-1 / (2 beta)
    half = 0.5 / p.beta
    up, down = node("sub", p.chosen_ratio, half), node("add", p.rejected_ratio, half)
    return node("add", node("mul", up, up), node("mul", down, down))


def _odds(p: Pair) -> Expr:  # ORPO's log odds ratio: log(odds(y_w) / odds(y_l)), odds = P / (1 - P)
    log1m = [node("log1p", node("neg", node("exp", x))) for x in (p.chosen, p.rejected)]
    return node("sub", node("sub", p.chosen, p.rejected), node("sub", *log1m))


#: each DPO ``loss_type`` (Liger-Kernel's and TRL's names): the loss of one pair
DPO_LOSSES: dict[str, Callable[[Pair], Expr]] = {
    "sigmoid": lambda p: node("neg", _logsigmoid(p.margin)),  # DPO (arXiv 2305.18290)
    "hinge": lambda p: node("relu", node("sub", 1.0, p.margin)),  # SLiC: max(0, 1 - margin)
    "exo_pair": _exo,
    "nca_pair": _nca,
    "robust": _robust,
    "bco_pair": lambda p: node(  # BCO: each reward against 0
        "neg", node("add", _logsigmoid(p.chosen_reward), _logsigmoid(node("neg", p.rejected_reward)))
    ),
    "sppo_hard": _sppo,
    "apo_zero": lambda p: node(  # APO-zero (arXiv 2408.06266, eq. 7): chosen up, rejected down
        "add", node("sub", 1.0, _sigmoid(p.chosen_reward)), _sigmoid(p.rejected_reward)
    ),
    "apo_down": lambda p: node(  # APO-down (eq. 8): chosen down, rejected down more
        "add", _sigmoid(p.chosen_reward), node("sub", 1.0, _sigmoid(p.margin))
    ),
    "discopop": _discopop,
}

#: each preference loss: its loss per pair and its extra outputs, over the pair
PAIR_LOSSES: dict[str, Callable[[Pair, str], dict[str, Expr]]] = {
    "dpo": lambda p, kind: {"loss": _all_mean(DPO_LOSSES[kind](p)), **_rewards(p)},
    "cpo": lambda p, _: {  # CPO (arXiv 2401.08417): DPO without a reference, smoothed
        "loss": _all_mean(p.smoothed(node("mul", node("sub", p.chosen, p.rejected), p.beta))),
        **_rewards(p),
    },
    "simpo": lambda p, _: {  # SimPO (arXiv 2405.14734): average log-probabilities, a margin gamma
        "loss": _all_mean(p.smoothed(node("sub", node("mul", node("sub", p.chosen, p.rejected), p.beta), p.gamma))),
        **_rewards(p),
    },
    "orpo": lambda p, _: {  # ORPO (arXiv 2403.07691): -beta log sigmoid(log odds ratio)
        "loss": node("mul", _all_mean(_logsigmoid(_odds(p))), -p.beta),
        **_rewards(p),
        "log_odds_ratio": _all_mean(_logsigmoid(_odds(p))),
        "log_odds_chosen": _all_mean(_odds(p)),
    },
}


def _rewards(p: Pair) -> dict[str, Expr]:
    """The rewards Liger reports: ``beta`` times the log-ratios (the log-probabilities themselves
    without a reference model)."""
    return {"chosen_rewards": p.chosen_reward, "rejected_rewards": p.rejected_reward}


def _halves(x: Expr) -> tuple[Expr, Expr]:
    chosen, rejected = chunk(x, 2, 0)
    return chosen, rejected


def preference_outputs(
    loss: str, h: ExprLike, w: ExprLike, target: ExprLike, bias: ExprLike | None = None, *,
    ref: tuple[ExprLike, ExprLike, ExprLike | None] | None = None, nll_target: ExprLike | None = None,
    ignore_index: int = -100, alpha: float = 1.0, beta: float = 0.1, compute_nll_loss: bool = True,
    average_log_prob: bool = True, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
    discopop_tau: float = 0.05, gamma: float = 0.5,
) -> dict[str, Expr]:  # fmt: skip
    """A preference loss over the linear head ``h @ w.T (+ bias)``, with Liger-Kernel's outputs,
    for ``rx.compile`` (the logits are never written, forward or backward).

    ``h`` is ``[2B, T, hidden]``: ``B`` chosen sequences, then their ``B`` rejected ones; ``target``
    ``[2B, T]`` int64. ``loss`` is ``"dpo"`` (with ``loss_type`` one of :data:`DPO_LOSSES`),
    ``"orpo"``, ``"cpo"`` or ``"simpo"``. ``ref=(ref_h, ref_w, ref_bias)``: the reference model's
    head, for DPO's log-ratios (no gradient flows into it). Outputs, in Liger's order: ``loss``
    (``alpha * nll_loss`` plus the preference loss, a mean over the pairs), ``chosen_logps``,
    ``rejected_logps`` (per sequence; the mean over its tokens with ``average_log_prob``),
    ``chosen_logits_mean``, ``rejected_logits_mean`` (every logit of the half, ignored tokens
    too, as Liger's), ``nll_loss`` (the chosen half's mean token NLL of ``nll_target``, else of
    ``target``; left out unless ``compute_nll_loss``), ``chosen_rewards``, ``rejected_rewards`` and, for
    ORPO, ``log_odds_ratio``, ``log_odds_chosen``. The logits means, rewards and log odds are
    metrics without a gradient (Liger's have none); the loss, log-probabilities and NLL have one.

    Example:
        >>> import torch, rtxdsl as rx
        >>> outs = rx.preference_outputs("simpo", rx.var("h"), rx.var("w"), rx.var("t"), gamma=0.5)
        >>> h, w = torch.zeros(4, 3, 8), torch.zeros(16, 8)
        >>> got = rx.compile(outs)(h=h, w=w, t=torch.ones(4, 3, dtype=torch.long))
        >>> round(got["loss"].item(), 4)  # -log sigmoid(-gamma) + the chosen NLL, log(16)
        3.7467
    """
    pair_loss = PAIR_LOSSES.get(loss)
    if pair_loss is None:
        raise RtxError(f"preference_outputs: loss must be one of {sorted(PAIR_LOSSES)}, got {loss!r}")
    if loss == "dpo" and loss_type not in DPO_LOSSES:
        raise RtxError(
            f"preference_outputs: Unsupported loss_type {loss_type!r}; loss_type must be one of {sorted(DPO_LOSSES)}"
        )
    if ref is not None and loss != "dpo":
        raise RtxError(f"preference_outputs: {loss} takes no reference model (ref=...)")
    beta = scalar_arg(beta, "preference_outputs", "beta")
    eps = scalar_arg(label_smoothing, "preference_outputs", "label_smoothing")
    if loss == "dpo" and loss_type == "exo_pair" and not 0.0 < eps < 1.0:
        raise RtxError(f"preference_outputs: label_smoothing must be > 0 for loss_type='exo_pair' (and < 1), got {eps}")
    if loss == "dpo" and loss_type == "robust" and not 0.0 <= eps < 0.5:
        raise RtxError(f"preference_outputs: label_smoothing must lie in [0.0, 0.5) for loss_type='robust', got {eps}")
    if loss == "dpo" and loss_type == "sppo_hard" and beta == 0:
        raise RtxError("preference_outputs: beta must be nonzero for loss_type='sppo_hard'")
    seq = sequence_logps(h, w, target, bias, ignore_index, average_log_prob)
    chosen, rejected = _halves(seq)
    ref_chosen: Expr | float = 0.0
    ref_rejected: Expr | float = 0.0
    if ref is not None:
        ref_h, ref_w, ref_b = ref_arg(ref, "preference_outputs")
        ref_seq = node("detach", sequence_logps(ref_h, ref_w, target, ref_b, ignore_index, average_log_prob))
        ref_chosen, ref_rejected = _halves(ref_seq)
    pair = Pair(chosen, rejected, ref_chosen, ref_rejected, beta, eps, float(discopop_tau), float(gamma))
    pref = pair_loss(pair, loss_type)
    # every logit of a half counts, ignored tokens too: the mean over the vocabulary of each token, then over the
    # half, in the logits' dtype (Liger's; summed in float32)
    means = _halves(mean_of(capped_logits(h, w, bias, None), (-1,), False))
    nll = _nll(h, w, target if nll_target is None else nll_target, bias, ignore_index) if compute_nll_loss else None
    total = pref["loss"] if nll is None else node("add", pref["loss"], node("mul", nll, alpha))
    return {
        "loss": total,
        "chosen_logps": chosen,
        "rejected_logps": rejected,
        # metrics, without a gradient (Liger's give none but the loss's)
        "chosen_logits_mean": node("detach", _all_mean(means[0])),
        "rejected_logits_mean": node("detach", _all_mean(means[1])),
        **({"nll_loss": nll} if nll is not None else {}),
        **{k: node("detach", v) for k, v in pref.items() if k != "loss"},
    }


def _nll(h: ExprLike, w: ExprLike, target: ExprLike, bias: ExprLike | None, ignore_index: int) -> Expr:
    """The chosen half's token NLL, summed and divided by its non-ignored tokens (Liger's)."""
    logps = _halves(linear_logps(h, w, target, bias, ignore_index))[0]
    valid = _halves(node("where", node("ne", target, ignore_index), 1.0, 0.0))[0]
    total = node("sum", logps, axis=None, keepdim=False)
    return node("neg", node("div", total, node("sum", valid, axis=None, keepdim=False)))


def kto_outputs(
    h: ExprLike, w: ExprLike, target: ExprLike, labels: ExprLike, bias: ExprLike | None = None, *,
    ref: tuple[ExprLike, ExprLike, ExprLike | None] | None = None, kl: ExprLike | None = None,
    ignore_index: int = -100, beta: float = 0.1, average_log_prob: bool = False,
) -> dict[str, Expr]:  # fmt: skip
    """KTO (arXiv 2402.01306) over the linear head ``h @ w.T (+ bias)``: unpaired sequences, each
    desirable or not (``labels``, bool ``[B]``), with Liger-Kernel's outputs (logits never written).

    Each sequence's loss is ``1 - sigmoid(beta * (log-ratio - kl))`` when desirable and
    ``1 - sigmoid(beta * (kl - log-ratio))`` when not, the log-ratio against ``ref=(ref_h, ref_w,
    ref_bias)`` (the log-probability itself without one), ``kl`` a given estimate (a tensor that
    broadcasts to ``[B]``; 0 without one); ``loss`` is their mean. Outputs, in Liger's order:
    ``loss``, ``chosen_logps_sum``, ``rejected_logps_sum``, ``chosen_logits_sum``,
    ``rejected_logits_sum``, ``chosen_rewards_sum``, ``rejected_rewards_sum`` (sums over the
    desirable, or undesirable, sequences; metrics without a gradient).

    Example:
        >>> import torch, rtxdsl as rx
        >>> outs = rx.kto_outputs(rx.var("h"), rx.var("w"), rx.var("t"), rx.var("y"))
        >>> got = rx.compile(outs)(h=torch.zeros(3, 2, 8), w=torch.zeros(16, 8),
        ...                        t=torch.ones(3, 2, dtype=torch.long), y=torch.tensor([True, False, True]))
        >>> round(got["loss"].item(), 4), round(got["rejected_logps_sum"].item(), 4)  # 2 log(1/16) for the one
        (0.5451, -5.5452)
    """
    beta = scalar_arg(beta, "kto_outputs", "beta")
    seq = sequence_logps(h, w, target, bias, ignore_index, average_log_prob)
    ratio = seq
    if ref is not None:
        ref_h, ref_w, ref_b = ref_arg(ref, "kto_outputs")
        ratio = node(
            "sub", seq, node("detach", sequence_logps(ref_h, ref_w, target, ref_b, ignore_index, average_log_prob))
        )
    shifted = ratio if kl is None else node("sub", ratio, kl)
    sign = node("where", labels, 1.0, -1.0)
    loss = _all_mean(node("sub", 1.0, _sigmoid(node("mul", node("mul", shifted, beta), sign))))
    per_seq_logits = node(
        "sum", node("sum", capped_logits(h, w, bias, None), axis=(-1,), keepdim=False), axis=(-1,), keepdim=False
    )
    rewards = node("mul", ratio, beta)

    def split(x: Expr) -> tuple[Expr, Expr]:  # sums over the desirable sequences, then the others
        def total(v: Expr) -> Expr:
            return node("detach", node("sum", v, axis=None, keepdim=False))

        return total(node("where", labels, x, 0.0)), total(node("where", labels, 0.0, x))

    (cl, rl), (cg, rg), (cr, rr) = split(seq), split(per_seq_logits), split(rewards)
    return {
        "loss": loss,
        "chosen_logps_sum": cl,
        "rejected_logps_sum": rl,
        "chosen_logits_sum": cg,
        "rejected_logits_sum": rg,
        "chosen_rewards_sum": cr,
        "rejected_rewards_sum": rr,
    }
