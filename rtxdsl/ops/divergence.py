"""Distances between distributions, as composites of primitives (one row kernel each, fused
backward): ``kl_div`` (``F.kl_div``), ``jsd`` (Liger-Kernel's generalized Jensen-Shannon
divergence for distillation) and ``tvd`` (total variation distance)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import RtxError, ShapeError
from ..expr import Expr, node
from ..registry import ANY, FLOATING, Front, OpDef, OpKind, Pattern, Unsupported, register
from .helpers import ExprLike, scalar_arg, torch_fns

KL_REDUCTIONS = ("none", "sum", "mean", "batchmean")


def _broadcast(shapes: list[tuple[int, ...]], op: str) -> tuple[int, ...]:
    try:
        return tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError as e:
        raise ShapeError(f"{op}: operands of shapes {[list(s) for s in shapes]} do not broadcast") from e


def _total(e: Expr) -> Expr:
    return node("sum", e, axis=None, keepdim=False)


# ---- KL divergence ---------------------------------------------------------------------------------
def kl_div(input: ExprLike, target: ExprLike, reduction: str = "mean", log_target: bool = False) -> Expr:  # noqa: A002
    """``F.kl_div``: ``target * (log(target) - input)`` (0 where the target is 0), or with
    ``log_target`` ``exp(target) * (target - input)``; reduced as ``none`` / ``sum`` / ``mean`` /
    ``batchmean`` (the sum over the first dim's size).

    Example:
        >>> import rtxdsl as rx
        >>> rx.kl_div(rx.var("logq"), rx.var("p"), reduction="batchmean")
        kl_div(logq, p, log_target=False, reduction='batchmean')
    """
    if reduction not in KL_REDUCTIONS:
        raise RtxError(f"kl_div: reduction must be one of {KL_REDUCTIONS}, got {reduction!r}")
    if not isinstance(log_target, bool):
        raise RtxError(f"kl_div: log_target must be a bool, got {log_target!r}")
    return node("kl_div", input, target, reduction=reduction, log_target=log_target)


def _kl_pointwise(x: Expr, t: Expr, log_target: bool) -> Expr:
    if log_target:
        return node("mul", node("exp", t), node("sub", t, x))
    xlogy = node("where", node("eq", t, 0.0), 0.0, node("mul", t, node("log", t)))  # torch.xlogy(t, t)
    return node("sub", xlogy, node("mul", t, x))


def _reduce(pointwise: Expr, reduction: str, shape: tuple[int, ...]) -> Expr:
    if reduction == "none":
        return pointwise
    total = _total(pointwise)
    if reduction == "sum":
        return total
    count = math.prod(shape) if reduction == "mean" else (shape[0] if shape else 1)
    return node("div", total, float(count))


def _kl_decompose(x: Expr, t: Expr, *, reduction: str, log_target: bool, shapes: list, dtypes: list) -> Expr:
    return _reduce(_kl_pointwise(x, t, log_target), reduction, _broadcast(shapes, "kl_div"))


def _kl_ref(x: torch.Tensor, t: torch.Tensor, reduction: str, log_target: bool) -> torch.Tensor:
    return F.kl_div(x, t, reduction=reduction, log_target=log_target)


def _kl_shape(shapes: list[tuple[int, ...]], reduction: str, log_target: bool) -> tuple[int, ...]:
    shape = _broadcast(shapes, "kl_div")
    return shape if reduction == "none" else ()


def _torch_kl_div(
    x: Any, t: Any, size_average: Any = None, reduce: Any = None, reduction: str = "mean", log_target: bool = False
) -> Expr:
    if size_average is not None or reduce is not None:
        raise Unsupported
    return kl_div(x, t, reduction, log_target)


register(
    OpDef(
        name="kl_div",
        kind=OpKind.COMPOSITE,
        arity=2,
        ref=_kl_ref,
        decompose=_kl_decompose,
        typed_decompose=True,
        shape=_kl_shape,
        eager_launches=3,  # the pointwise terms, then the reduction (and its division)
        pattern=Pattern.REDUCTION,
        accepts=FLOATING,
        front=Front(fn=kl_div, torch=dict.fromkeys(torch_fns("kl_div"), _torch_kl_div)),
    )
)


# ---- rows with an optional label: the mask and count of the tokens that count ---------------------
def valid_rows(label: Expr | None, ignore_index: int, rows: tuple[int, ...]) -> tuple[Expr | None, Expr | float]:
    """(mask per row or None, the number of rows that count, or 1 where none does: a mean over no
    row is 0 / 1 = 0, as Liger's, and its gradient 0, where 0 / 0 would make both NaN)."""
    if label is None:
        return None, float(math.prod(rows))
    valid = node("ne", label, ignore_index)
    count = _total(node("where", valid, 1.0, 0.0))
    return valid, node("where", node("eq", count, 0.0), 1.0, count)


def _label_shape(shapes: list[tuple[int, ...]], op: str) -> tuple[int, ...]:
    a, b = shapes[0], shapes[1]
    if a != b or not a:
        raise ShapeError(f"{op}: both distributions must have one shape with a class axis, got {list(a)}, {list(b)}")
    if len(shapes) == 3 and shapes[2] != a[:-1]:
        raise ShapeError(f"{op}: label has shape {list(shapes[2])}; expected {list(a[:-1])} (one per row)")
    return a


def _pair_dtype(op: str) -> Any:
    """The result dtype rule of a divergence with an optional label: two floating distributions
    (promoted), an int32 / int64 label."""

    def rule(dtypes: list[torch.dtype], **_: Any) -> torch.dtype:
        if not (dtypes[0].is_floating_point and dtypes[1].is_floating_point):
            raise RtxError(f"{op}: the distributions must be floating point, got {dtypes[0]} and {dtypes[1]}")
        if len(dtypes) == 3 and dtypes[2] not in (torch.int32, torch.int64):
            raise RtxError(f"{op}: label must be int32 or int64, got {dtypes[2]}")
        return torch.promote_types(dtypes[0], dtypes[1])

    return rule


# ---- generalized Jensen-Shannon divergence ---------------------------------------------------------
def jsd(
    log_q: ExprLike, log_p: ExprLike, label: ExprLike | None = None, beta: float = 0.5, ignore_index: int = -100
) -> Expr:
    """Liger-Kernel's generalized JSD over the last axis, from log-probabilities (student ``log_q``,
    teacher ``log_p``): with ``M = beta * P + (1 - beta) * Q``, each row's
    ``beta * KL(P || M) + (1 - beta) * KL(Q || M)`` (``beta=0``: ``KL(P || Q)``; ``beta=1``:
    ``KL(Q || P)``), summed over rows whose ``label`` is not ``ignore_index``, divided by their count
    (0, and a gradient of 0, when no row counts: Liger's).

    Example:
        >>> import rtxdsl as rx
        >>> rx.jsd(rx.var("logq"), rx.var("logp"), beta=0.1)
        jsd(logq, logp, beta=0.1, ignore_index=-100)
    """
    b = scalar_arg(beta, "jsd", "beta")
    if not 0.0 <= b <= 1.0:
        raise RtxError(f"jsd: beta must be in [0, 1], got {beta!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise RtxError(f"jsd: ignore_index must be an int, got {ignore_index!r}")
    operands = (log_q, log_p) if label is None else (log_q, log_p, label)
    return node("jsd", *operands, beta=b, ignore_index=ignore_index)


def jsd_rows(log_q: Expr, log_p: Expr, beta: float) -> Expr:
    """Each row's divergence (summed over the last axis)."""
    p, q = node("exp", log_p), node("exp", log_q)
    if beta == 0.0:
        terms = node("mul", p, node("sub", log_p, log_q))
    elif beta == 1.0:
        terms = node("mul", q, node("sub", log_q, log_p))
    else:
        log_m = node("log", node("add", node("mul", p, beta), node("mul", q, 1.0 - beta)))
        terms = node(
            "add",
            node("mul", node("mul", p, node("sub", log_p, log_m)), beta),
            node("mul", node("mul", q, node("sub", log_q, log_m)), 1.0 - beta),
        )
    return node("sum", terms, axis=(-1,), keepdim=False)


def _jsd_decompose(
    log_q: Expr, log_p: Expr, *label: Expr, beta: float, ignore_index: int, shapes: list, dtypes: list
) -> Expr:
    rows = jsd_rows(log_q, log_p, beta)
    valid, count = valid_rows(label[0] if label else None, ignore_index, shapes[0][:-1])
    if valid is not None:
        rows = node("where", valid, rows, 0.0)
    return node("div", _total(rows), count)


def _jsd_ref(log_q: torch.Tensor, log_p: torch.Tensor, *label: torch.Tensor, beta: float, ignore_index: int):
    p, q = log_p.exp(), log_q.exp()
    if beta == 0.0:
        rows = (p * (log_p - log_q)).sum(-1)
    elif beta == 1.0:
        rows = (q * (log_q - log_p)).sum(-1)
    else:
        log_m = torch.log(beta * p + (1 - beta) * q)
        rows = (beta * p * (log_p - log_m) + (1 - beta) * q * (log_q - log_m)).sum(-1)
    if label:  # Liger's: no row counts, the loss is 0
        valid = label[0] != ignore_index
        return torch.where(valid, rows, 0).sum() / valid.sum().clamp(min=1)
    return rows.sum() / rows.numel()


def _jsd_shape(shapes: list[tuple[int, ...]], **_: Any) -> tuple[int, ...]:
    _label_shape(shapes, "jsd")
    return ()


register(
    OpDef(
        name="jsd",
        kind=OpKind.COMPOSITE,
        arity=None,
        ref=_jsd_ref,
        decompose=_jsd_decompose,
        typed_decompose=True,
        shape=_jsd_shape,
        result_dtype=_pair_dtype("jsd"),
        eager_launches=8,  # exp x2, the mixture, its log, the two KL terms, the row sums, the mean
        pattern=Pattern.REDUCTION,
        accepts=ANY,
        front=Front(fn=jsd),
    )
)


# ---- total variation distance ----------------------------------------------------------------------
TVD_REDUCTIONS = ("none", "sum", "mean", "batchmean")


def tvd(
    p: ExprLike, q: ExprLike, label: ExprLike | None = None, reduction: str = "batchmean", ignore_index: int = -100
) -> Expr:
    """Total variation distance ``|p - q| / 2`` over the last axis (Liger-Kernel's TVD loss): rows
    whose ``label`` is ``ignore_index`` count nothing; ``batchmean`` divides the sum by the rows
    that count, ``mean`` by their elements (0 when no row counts), ``none`` keeps each element.

    Example:
        >>> import rtxdsl as rx
        >>> rx.tvd(rx.var("p"), rx.var("q"))
        tvd(p, q, ignore_index=-100, reduction='batchmean')
    """
    if reduction not in TVD_REDUCTIONS:
        raise RtxError(f"tvd: reduction must be one of {TVD_REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise RtxError(f"tvd: ignore_index must be an int, got {ignore_index!r}")
    operands = (p, q) if label is None else (p, q, label)
    return node("tvd", *operands, reduction=reduction, ignore_index=ignore_index)


def _tvd_decompose(
    p: Expr, q: Expr, *label: Expr, reduction: str, ignore_index: int, shapes: list, dtypes: list
) -> Expr:
    half = node("mul", node("abs", node("sub", p, q)), 0.5)
    valid, count = valid_rows(label[0] if label else None, ignore_index, shapes[0][:-1])
    if valid is not None:
        half = node("where", node("unsqueeze", valid, axes=(-1,)), half, 0.0)
    if reduction == "none":
        return half
    total = _total(half)
    if reduction == "sum":
        return total
    per = count if reduction == "batchmean" else node("mul", count, float(shapes[0][-1]))
    return node("div", total, per)


def _tvd_ref(p: torch.Tensor, q: torch.Tensor, *label: torch.Tensor, reduction: str, ignore_index: int):
    half = (p - q).abs() / 2
    n: Any = math.prod(p.shape[:-1])
    if label:  # the count stays a tensor: torch.compile's fakes run this, and hold no data
        valid = label[0] != ignore_index
        half = torch.where(valid[..., None], half, 0)
        n = valid.sum().clamp(min=1)  # Liger's: no row counts, the loss is 0 (a sum of nothing over 1)
    if reduction == "none":
        return half
    if reduction == "sum":
        return half.sum()
    return half.sum() / (n if reduction == "batchmean" else n * p.shape[-1])


def _tvd_shape(shapes: list[tuple[int, ...]], reduction: str, **_: Any) -> tuple[int, ...]:
    shape = _label_shape(shapes, "tvd")
    return shape if reduction == "none" else ()


register(
    OpDef(
        name="tvd",
        kind=OpKind.COMPOSITE,
        arity=None,
        ref=_tvd_ref,
        decompose=_tvd_decompose,
        typed_decompose=True,
        shape=_tvd_shape,
        result_dtype=_pair_dtype("tvd"),
        eager_launches=4,  # sub, abs, the half, the reduction
        pattern=Pattern.REDUCTION,
        accepts=ANY,
        front=Front(fn=tvd),
    )
)
