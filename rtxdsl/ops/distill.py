"""Distillation over two linear heads, a student's and a teacher's, as expressions whose logits
are never written (Liger-Kernel's fused linear JSD and its chunked JSD and cosine distillation
losses, without chunks).

Both products feed one per-row loss over the vocabulary, so the analyzer computes each tile of
both inside one row kernel (``lower.analyze.fuse_product_rows``: products of a layer's weight
share a row kernel) and writes only per-row values. The backward is derived: a row kernel
recomputes both products for the softmax gradient's row sum, and the two gradient GEMMs
recompute them in their K loops; the teacher gets no gradient (its logits are detached, as
Liger's). A soft loss is one entry of :data:`SOFT_LOSSES`, a formula over the two heads' scaled
logits.

Example:
    >>> import rtxdsl as rx
    >>> outs = rx.distillation_outputs("jsd", rx.var("hs"), rx.var("ws"), rx.var("ht"), rx.var("wt"), rx.var("t"))
    >>> list(outs)
    ['loss', 'soft_loss', 'hard_loss']
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import DtypeMismatchError, RtxError
from ..expr import Expr, node
from ..registry import FLOATING, Front, OpDef, OpKind, Pattern, register
from .contraction import linear_shape
from .divergence import jsd, jsd_rows
from .helpers import ExprLike, scalar_arg
from .llm import capped_logits, linear_logps


# ---- the logits of a head, in float32 --------------------------------------------------------------
def linear_logits(h: ExprLike, w: ExprLike, bias: ExprLike | None = None, temperature: float = 1.0) -> Expr:
    """The logits ``h @ w.T (+ bias)`` in float32 (float64 for float64 inputs), divided by
    ``temperature``: what a distillation loss takes the softmax of. A row kernel reducing them
    over the vocabulary computes them tile by tile, never written.

    Example:
        >>> import torch, rtxdsl as rx
        >>> z = rx.compile(rx.linear_logits(rx.var("h"), rx.var("w"), temperature=2.0))
        >>> out = z(h=torch.ones(1, 4, dtype=torch.bfloat16), w=torch.ones(3, 4, dtype=torch.bfloat16))
        >>> out.dtype, out.tolist()
        (torch.float32, [[2.0, 2.0, 2.0]])
    """
    temp = scalar_arg(temperature, "linear_logits", "temperature")
    if not temp > 0 or math.isinf(temp):
        raise RtxError(f"linear_logits: temperature must be a positive finite number, got {temperature!r}")
    return node("linear_logits", h, w, 0.0 if bias is None else bias, temperature=temp)


def _wide(dtypes: list[torch.dtype], **_: Any) -> torch.dtype:
    if not (dtypes[0].is_floating_point and dtypes[1].is_floating_point):
        raise RtxError(f"linear_logits: h and w must be floating point, got {dtypes[0]} and {dtypes[1]}")
    return torch.promote_types(torch.promote_types(dtypes[0], dtypes[1]), torch.float32)


def _logits_decompose(h: Expr, w: Expr, b: Expr, *, temperature: float, shapes: list, dtypes: list) -> Expr:
    if shapes[2] and dtypes[2] != dtypes[0]:
        raise DtypeMismatchError(f"linear_logits: bias is {dtypes[2]} and h is {dtypes[0]}; they must match")
    logits = node("cast", capped_logits(h, w, b, None), dtype=_wide(dtypes))
    return logits if temperature == 1.0 else node("div", logits, temperature)


def _logits_ref(h: torch.Tensor, w: torch.Tensor, b: Any, *, temperature: float) -> torch.Tensor:
    bias = b if isinstance(b, torch.Tensor) else None
    logits = F.linear(h, w, bias)
    return logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature


register(
    OpDef(
        name="linear_logits",
        kind=OpKind.COMPOSITE,
        arity=3,
        ref=_logits_ref,
        decompose=_logits_decompose,
        typed_decompose=True,
        shape=lambda shapes, **_: linear_shape(shapes),
        result_dtype=_wide,
        eager_launches=3,  # the GEMM, the cast, the division
        pattern=Pattern.CONTRACTION,
        accepts=FLOATING,
        front=Front(fn=linear_logits),
    )
)


# ---- fused linear JSD -------------------------------------------------------------------------------
def linear_jsd(
    student_h: ExprLike, student_w: ExprLike, teacher_h: ExprLike, teacher_w: ExprLike,
    label: ExprLike | None = None, beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
) -> Expr:  # fmt: skip
    """Liger-Kernel's fused linear JSD: :func:`~rtxdsl.ops.divergence.jsd` of the student's and
    the teacher's ``softmax(h @ w.T / temperature)`` (float32), the mean over the rows whose
    ``label`` is not ``ignore_index`` (every row without a label). Only the student gets a
    gradient; neither head's logits are written, forward or backward.

    ``student_h`` is ``[..., Hs]``, ``student_w`` ``[V, Hs]``, ``teacher_h`` ``[..., Ht]`` (the
    same rows), ``teacher_w`` ``[V, Ht]``: the hidden sizes may differ, the vocabulary may not.

    Example:
        >>> import torch, rtxdsl as rx
        >>> loss = rx.linear_jsd(rx.var("hs"), rx.var("ws"), rx.var("ht"), rx.var("wt"), beta=0.1)
        >>> ins = dict(hs=torch.zeros(3, 4), ws=torch.zeros(8, 4), ht=torch.zeros(3, 2), wt=torch.ones(8, 2))
        >>> out = rx.compile(loss)(**ins)
        >>> out.item()  # both uniform over the vocabulary
        0.0
    """
    student = _log_probs(student_h, student_w, None, temperature)
    teacher = node("detach", _log_probs(teacher_h, teacher_w, None, temperature))
    return jsd(student, teacher, label, beta, ignore_index)


def _log_probs(h: ExprLike, w: ExprLike, bias: ExprLike | None, temperature: float) -> Expr:
    return node("log_softmax", linear_logits(h, w, bias, temperature), axis=-1)


# ---- chunked distillation losses (Liger's LigerFusedLinearDistillationBase) ----------------------------
#: a row of logits of norm below this is 0 once normalized (``F.normalize``'s eps)
NORM_EPS = 1e-12


def _jsd_soft(student: Expr, teacher: Expr, valid: Expr | None, beta: float) -> Expr:
    """Each counted row's generalized JSD of the two softmaxes, 0 for an ignored row (Liger's)."""
    rows = jsd_rows(node("log_softmax", student, axis=-1), node("log_softmax", teacher, axis=-1), beta)
    return rows if valid is None else node("where", valid, rows, 0.0)


def _cosine_soft(student: Expr, teacher: Expr, valid: Expr | None, beta: float) -> Expr:
    """``beta * (1 - cos)`` of each counted row's two logit vectors, 0 for an ignored row (Liger's):
    the cosine of the vectors ``F.normalize`` makes (a norm clamped to :data:`NORM_EPS`, squared
    here so that a zero row's gradient is finite, not NaN)."""

    def norm(x: Expr) -> Expr:
        squares = node("sum", node("mul", x, x), axis=(-1,), keepdim=False)
        return node("sqrt", node("maximum", squares, NORM_EPS * NORM_EPS))

    dot = node("sum", node("mul", student, teacher), axis=(-1,), keepdim=False)
    cos = node("div", dot, node("mul", norm(student), norm(teacher)))
    rows = node("mul", node("sub", 1.0, cos), beta)
    return rows if valid is None else node("where", valid, rows, 0.0)


#: each distillation loss's per-row soft term, from the scaled student and teacher logits, the
#: rows that count (None: every row) and ``beta``
SOFT_LOSSES: dict[str, Callable[[Expr, Expr, Expr | None, float], Expr]] = {
    "jsd": _jsd_soft,  # Liger's LigerFusedLinearJSDLoss: beta 0 is KL(teacher || student), 1 KL(student || teacher)
    "cosine": _cosine_soft,  # Liger's LigerFusedLinearCosineSimilarityLoss
}


def _counted(target: ExprLike, ignore_index: int) -> tuple[Expr, Expr]:
    """The tokens whose label counts, and their number clamped to 1 (Liger's ``clamp_min(1)``: with
    no token counted, each term is a sum over one)."""
    valid = node("ne", target, ignore_index)
    count = node("sum", node("where", valid, 1.0, 0.0), axis=None, keepdim=False)
    return valid, node("maximum", count, 1.0)


def hard_loss(
    student_h: ExprLike, student_w: ExprLike, target: ExprLike, student_bias: ExprLike | None = None, *,
    ignore_index: int = -100,
) -> Expr:  # fmt: skip
    """A distillation's hard term: the student's token cross-entropy of ``target`` (unscaled logits,
    float32), summed over the tokens that count and divided by their number, at least 1.

    Example:
        >>> import torch, rtxdsl as rx
        >>> from rtxdsl.ops.distill import hard_loss
        >>> k = rx.compile(hard_loss(rx.var("h"), rx.var("w"), rx.var("t")))
        >>> round(k(h=torch.zeros(2, 3), w=torch.ones(4, 3), t=torch.tensor([1, -100])).item(), 4)  # log(4)
        1.3863
    """
    _, count = _counted(target, ignore_index)
    logps = linear_logps(student_h, student_w, target, student_bias, ignore_index)
    return node("div", node("neg", node("sum", logps, axis=None, keepdim=False)), count)


def distillation_outputs(
    loss: str, student_h: ExprLike, student_w: ExprLike, teacher_h: ExprLike, teacher_w: ExprLike,
    target: ExprLike, student_bias: ExprLike | None = None, teacher_bias: ExprLike | None = None, *,
    weight_hard_loss: float = 0.5, weight_soft_loss: float = 0.5, beta: float = 0.5, ignore_index: int = -100,
    temperature: float = 1.0,
) -> dict[str, Expr]:  # fmt: skip
    """A distillation loss over a student's and a teacher's linear heads, with Liger-Kernel's
    outputs, for ``rx.compile`` (neither head's logits are written, forward or backward).

    ``loss`` is one of :data:`SOFT_LOSSES`. Outputs: ``hard_loss``, the student's token
    cross-entropy of ``target`` (unscaled logits, float32; summed over the tokens that count and
    divided by their number, at least 1); ``soft_loss``, the soft term of each row over the
    logits divided by ``temperature``, summed and divided by the same count; and ``loss =
    weight_hard_loss * hard_loss + weight_soft_loss * soft_loss``. The teacher gets no gradient.

    Example:
        >>> import torch, rtxdsl as rx
        >>> outs = rx.distillation_outputs("cosine", rx.var("hs"), rx.var("ws"), rx.var("ht"), rx.var("wt"),
        ...                                rx.var("t"), beta=1.0)
        >>> got = rx.compile(outs)(hs=torch.ones(2, 4), ws=torch.eye(3, 4), ht=torch.ones(2, 2),
        ...                        wt=torch.ones(3, 2), t=torch.tensor([0, -100]))
        >>> [round(got[k].item(), 4) for k in outs]  # the logits [1, 1, 1] and [2, 2, 2]: cos 1, log(3)
        [0.5493, 0.0, 1.0986]
    """
    soft = SOFT_LOSSES.get(loss)
    if soft is None:
        raise RtxError(f"distillation_outputs: loss must be one of {sorted(SOFT_LOSSES)}, got {loss!r}")
    b = scalar_arg(beta, "distillation_outputs", "beta")
    if loss == "jsd" and not 0.0 <= b <= 1.0:
        raise RtxError(f"distillation_outputs: beta must be in [0, 1] for loss='jsd', got {beta!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise RtxError(f"distillation_outputs: ignore_index must be an int, got {ignore_index!r}")
    w_hard = scalar_arg(weight_hard_loss, "distillation_outputs", "weight_hard_loss")
    w_soft = scalar_arg(weight_soft_loss, "distillation_outputs", "weight_soft_loss")
    student = linear_logits(student_h, student_w, student_bias, temperature)
    teacher = node("detach", linear_logits(teacher_h, teacher_w, teacher_bias, temperature))
    valid, count = _counted(target, ignore_index)
    hard = hard_loss(student_h, student_w, target, student_bias, ignore_index=ignore_index)
    soft_loss = node("div", node("sum", soft(student, teacher, valid, b), axis=None, keepdim=False), count)
    total = node("add", node("mul", hard, w_hard), node("mul", soft_loss, w_soft))
    return {"loss": total, "soft_loss": soft_loss, "hard_loss": hard}
