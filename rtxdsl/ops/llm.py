"""The LLM kernels, as composites of primitives: cross-entropy (``logsumexp`` and masked sums) and
rotary embeddings (slices and ``cat``). Forward and backward are derived, not hand-written:
the VJP pass differentiates the decomposition, and the analyzer fuses both directions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import DtypeMismatchError, RtxError, ShapeError, UnsupportedDtypeError
from ..expr import Expr, node
from ..registry import ANY, FLOATING, Front, OpDef, OpKind, Pattern, Unsupported, register
from .divergence import valid_rows
from .helpers import ExprLike, flag_arg, int_arg, ints_arg, scalar_arg, torch_fns
from .reduction import softmax_parts

REDUCTIONS = ("none", "mean", "sum")


# ---- cross-entropy --------------------------------------------------------------------------------
def cross_entropy(
    logits: ExprLike,
    target: ExprLike,
    weight: ExprLike | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    grad_in_forward: bool = False,
) -> Expr:
    """``F.cross_entropy`` (class axis 1, or 0 for 1-d logits), plus PaLM's ``z_loss * lse**2``.

    ``target`` holds int64 class indices (shaped like ``logits`` without the class axis; ``weight``,
    if given, of the logits' dtype, as torch requires) or class probabilities (a floating-point
    tensor shaped like ``logits``; promoted with the logits and ``weight``, as torch's). With
    indices, rows whose target is ``ignore_index`` contribute nothing and "mean" divides by the
    weight of the other rows (their count without ``weight``): over no such row it is torch's
    NaN, with torch's gradient, 0. The z-loss term is never weighted: "mean" averages it over
    the non-ignored rows (PaLM's and Liger-Kernel's definition). The row kernel
    reads each row once and the backward reads the saved per-row logsumexp.

    ``grad_in_forward=True`` (Liger-Kernel's memory trick; "mean" or "sum"): when a kernel's one
    output is this loss and only ``logits`` (a kernel input, not a leaf) requires grad, the forward
    also runs the fused backward with a unit cotangent and writes the logits' gradient *into the
    logits' memory*; the backward only scales it there by the loss's cotangent. No second
    logits-sized buffer is alive at any time. The logits hold the gradient after the call and
    their version counter is bumped, so autograd raises if anything else saved them. Leaf logits
    (whose ``.grad`` must not alias them) get a new buffer instead; DTensors run as usual.

    Example:
        >>> import rtxdsl as rx
        >>> rx.cross_entropy(rx.var("logits"), rx.var("target"))
        cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.0, reduction='mean', z_loss=0.0)
    """
    if reduction not in REDUCTIONS:
        raise RtxError(f"cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise RtxError(f"cross_entropy: ignore_index must be an int, got {ignore_index!r}")
    eps = scalar_arg(label_smoothing, "cross_entropy", "label_smoothing")
    if not 0.0 <= eps <= 1.0:
        raise RtxError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing!r}")
    z = scalar_arg(z_loss, "cross_entropy", "z_loss")
    if not isinstance(grad_in_forward, bool):
        raise RtxError(f"cross_entropy: grad_in_forward must be a bool, got {grad_in_forward!r}")
    if grad_in_forward and reduction == "none":
        raise RtxError("cross_entropy: grad_in_forward needs a scalar loss (reduction 'mean' or 'sum')")
    operands = (logits, target) if weight is None else (logits, target, weight)
    marked = {"grad_in_forward": True} if grad_in_forward else {}  # only autograd reads it
    return node(
        "cross_entropy",
        *operands,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=eps,
        z_loss=z,
        **marked,
    )


def _class_axis(rank: int) -> int:
    return 1 if rank >= 2 else 0


def _ce_shape(shapes: list[tuple[int, ...]], reduction: str, **_: Any) -> tuple[int, ...]:
    x, t = shapes[0], shapes[1]
    if not x:
        raise ShapeError("cross_entropy: logits must have a class axis (at least 1-d)")
    cls = _class_axis(len(x))
    rows = x[:cls] + x[cls + 1 :]
    if t != rows and t != x:
        raise ShapeError(
            f"cross_entropy: target has shape {list(t)}; expected {list(rows)} (class indices) "
            f"or {list(x)} (class probabilities)"
        )
    if len(shapes) == 3 and shapes[2] != (x[cls],):
        raise ShapeError(f"cross_entropy: weight has shape {list(shapes[2])}; expected [{x[cls]}]")
    if reduction != "none":
        return ()
    return rows


def _ce_dtype(dtypes: list[torch.dtype], ignore_index: int = -100, **_: Any) -> torch.dtype:
    """torch's rule: floating-point logits; class probabilities promote with the logits (and the
    class weight) and know no ignore_index; class indices are int64 and take a weight of the
    logits' own dtype (torch raises otherwise)."""
    x, t, w = dtypes[0], dtypes[1], dtypes[2] if len(dtypes) == 3 else None
    if not x.is_floating_point:  # torch: "log_softmax_lastdim_kernel_impl" not implemented for 'Long'
        raise UnsupportedDtypeError(f"cross_entropy: logits must be floating point, got {x}")
    if t.is_floating_point and ignore_index != -100:  # torch's own refusal
        raise RtxError(f"cross_entropy: ignore_index ({ignore_index}) is not supported for class-probability targets")
    if t.is_floating_point:  # -(log_softmax(x) * t * w).sum(): promoted as torch promotes it
        out = torch.promote_types(x, t)
        return out if w is None else torch.promote_types(out, w)
    if t != torch.int64:
        raise RtxError(f"cross_entropy: class-index target must be int64, got {t}")
    if w is not None and w != x:  # torch: "expected scalar type BFloat16 but found Float"
        raise DtypeMismatchError(
            f"cross_entropy: weight is {w}; it must match the logits' {x} with class-index targets, as in "
            f"torch (cast it: weight.to({x}))"
        )
    return x


def _range_error(op: str) -> Any:
    """The error of a target class out of range, naming the target and, as torch does ("Target 7 is
    out of bounds."), the first class out of range: ``{index}``, which the check fills in."""

    def error(reads: str, size: int) -> str:
        return (
            f"{op}: target '{reads}' holds a class index out of range: each must be in [0, {size}) or be "
            f"ignore_index (torch: 'Target {{index}} is out of bounds.')"
        )

    return error


def _check_target(shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], op: str = "cross_entropy") -> None:
    """A target whose shape and dtype disagree on its kind: torch's errors, naming the target."""
    x, t = shapes[0], shapes[1]
    kind = f"{dtypes[1]} of shape {list(t)}"
    if dtypes[1].is_floating_point and t != x:
        raise RtxError(
            f"{op}: target is {kind}: class indices must be int64 (torch: 'expected target dtype to be "
            f"Long'), and a floating-point target holds class probabilities shaped like the logits {list(x)}"
        )
    cls = _class_axis(len(x))
    if not dtypes[1].is_floating_point and t == x and t != x[:cls] + x[cls + 1 :]:
        raise RtxError(
            f"{op}: target is {kind}, the logits' shape: class probabilities must be floating point "
            f"(torch: 'Expected floating point type for target with class probabilities'); class indices "
            f"have shape {list(x[:cls] + x[cls + 1 :])}"
        )


def _ce_ref(
    x: torch.Tensor, t: torch.Tensor, *w: torch.Tensor, ignore_index: int, reduction: str, label_smoothing: float,
    z_loss: float, grad_in_forward: bool = False,
) -> torch.Tensor:  # fmt: skip
    weight = w[0] if w else None
    loss = F.cross_entropy(
        x, t, weight, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
    )
    if not z_loss:
        return loss
    cls = _class_axis(x.ndim)
    lse = torch.logsumexp(x, cls)
    if t.is_floating_point():
        zl, count = z_loss * lse**2, lse.numel()
    else:  # an unweighted term, its mean over the non-ignored tokens
        valid = t != ignore_index
        zl = torch.where(valid, z_loss * lse**2, 0)
        count = valid.sum()
    if reduction == "none":
        return loss + zl
    return loss + (zl.sum() / count if reduction == "mean" else zl.sum())


def _ce_decompose(
    x: Expr, t: Expr, *w: Expr, ignore_index: int, reduction: str, label_smoothing: float, z_loss: float,
    shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], grad_in_forward: bool = False,
) -> Expr:  # fmt: skip
    _check_target(shapes, dtypes)
    rank = len(shapes[0])
    if rank == 1 and not dtypes[1].is_floating_point:  # unbatched: one row of [1, C], then its value
        one = _ce_decompose(
            node("unsqueeze", x, axes=(0,)), node("unsqueeze", t, axes=(0,)), *w, ignore_index=ignore_index,
            reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
            shapes=[(1, *shapes[0]), (1,), *shapes[2:]], dtypes=dtypes,
        )  # fmt: skip
        return node("select", one, axis=0, index=0) if reduction == "none" else one
    options = {"ignore_index": ignore_index, "reduction": reduction, "label_smoothing": label_smoothing}
    return _ce_rows(x, t, w[0] if w else None, _class_axis(rank), shapes, dtypes, z_loss=z_loss, **options)


def _ce_rows(
    x: Expr, t: Expr, weight: Expr | None, cls: int, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], *,
    ignore_index: int, reduction: str, label_smoothing: float, z_loss: float,
) -> Expr:  # fmt: skip
    """Cross-entropy over class axis ``cls`` of ``x`` (the shapes and dtypes of ``x, t[, weight]``)."""
    rank = len(shapes[0])
    w = (weight,) if weight is not None else ()
    n_classes = shapes[0][cls]
    eps = label_smoothing
    # every per-row value keeps its class axis (size 1) until the end: what the backward computes at
    # the logits' coordinates then only broadcasts (a kernel recomputing it per tile needs no re-indexing)
    keep = {"axis": (cls,), "keepdim": True}
    # -log p = (c - x) + log(total), c the logsumexp detached (a shift), total = sum(exp(x - c)) off
    # its own state, as log_softmax: exact where lse - x is not (the logsumexp rounded at the logits'
    # magnitude, an ulp of 1e3 is 6e-5; a row of one value far from zero, log n under its spacing),
    # and the gradient exp(x - c) / total a softmax's. NaN, value and gradient, on a row torch's
    # log_softmax makes NaN (``lse_shift``)
    shifted, total = softmax_parts(x, (cls,))
    c, log_total = shifted.srcs[1], node("log", total)
    lse = node("add", c, log_total)  # the logsumexp, its gradient the softmax (z-loss)

    def minus_log_p(v: Expr) -> Expr:  # -log p at logits ``v`` (per element, or the target's)
        return node("add", node("sub", c, v), log_total)

    # weight along the class axis, broadcast against the logits
    others = tuple(d for d in range(rank) if d != cls)
    wb = node("unsqueeze", w[0], axes=others) if w and others else (w[0] if w else None)
    if dtypes[1].is_floating_point:  # class probabilities (smoothed toward uniform)
        p = node("add", node("mul", t, 1.0 - eps), eps / n_classes) if eps else t
        if wb is not None:
            p = node("mul", p, wb)
        per = node("sum", node("mul", p, minus_log_p(x)), **keep)
        if z_loss:
            per = node("add", per, node("mul", node("mul", lse, lse), z_loss))
        per = node("sum", per, axis=(cls,), keepdim=False)  # drops the size-1 class axis
        if reduction == "none":
            return per
        total = node("sum", per, axis=None, keepdim=False)
        return node("div", total, max(1, math.prod(shapes[0]) // max(n_classes, 1))) if reduction == "mean" else total
    target = node("unsqueeze", t, axes=(cls,))
    valid = node("ne", target, ignore_index)
    safe = node("where", valid, target, 0)  # ignored rows pick class 0, then count nothing
    positions = node("arange_like", x, axis=cls)
    hit = node("eq", positions, safe)
    # one element per row as a masked sum over the class axis, not a gather of the logits: a row
    # reduction like the others, so it is merged tile by tile where the logits are never written
    picked = node("sum", node("where", hit, x, 0.0), **keep)
    tw = None
    if wb is not None:
        tw = node("sum", node("where", hit, node("expand", wb, shape=shapes[0]), 0.0), **keep)
    checked = _checked_class(positions, t, safe, ignore_index, cls, shapes[0])
    # the range check runs in the forward only: no gradient flows through it (0 unless it raised)
    nll = node("add", minus_log_p(picked), node("detach", node("mul", checked, 0)))
    per = node("mul", nll, tw) if tw is not None else nll
    if eps:
        # -sum_c w_c log p_c = (c * mass - sum_c w_c x_c) + log(total) * mass: its sum reads the
        # logits alone, so a split row stays one pass (sum_c w_c (c - x_c) would wait for c); its
        # cancellation is scaled by label_smoothing / n_classes
        summed = node("sum", node("mul", x, wb) if wb is not None else x, **keep)
        mass = node("sum", w[0], axis=None, keepdim=False) if w else float(n_classes)
        smooth = node("add", node("sub", node("mul", c, mass), summed), node("mul", log_total, mass))
        per = node("add", node("mul", per, 1.0 - eps), node("mul", smooth, eps / n_classes))
    # the z-loss term is unweighted and its mean is over the non-ignored tokens (PaLM, Liger); the
    # cross-entropy term's mean is over their class weights (torch)
    z = node("mul", node("mul", lse, lse), z_loss) if z_loss else None
    if reduction != "mean" or tw is None:
        per = node("add", per, z) if z is not None else per
        z = None

    def rows(v: Expr) -> Expr:  # a per-row value without its size-1 class axis (a reshape in the row kernel)
        return node("sum", node("where", valid, v, 0.0), axis=(cls,), keepdim=False)

    per = rows(per)
    if reduction == "none":
        return per
    total = node("sum", per, axis=None, keepdim=False)
    if reduction == "sum":
        return total
    ones = node("where", node("ne", t, ignore_index), 1.0, 0.0)  # per token: does it count?
    mean = node("div", total, node("sum", rows(tw) if tw is not None else ones, axis=None, keepdim=False))
    if z is None:
        return mean
    tokens = node("sum", ones, axis=None, keepdim=False)
    return node("add", mean, node("div", node("sum", rows(z), axis=None, keepdim=False), tokens))


def picked_by_position(node: Any, node_at: Any) -> tuple[Any, Any, Any] | None:
    """``sum(where(positions == t, x, c))`` over the axis ``positions`` counts along (the target
    logit as cross-entropy writes it, a masked sum so it merges tile by tile where the logits are
    computed): ``(x, t, c)`` as ``node.srcs`` refs them; None for any other node. ``node_at(ref)``
    is ``(index, node)`` for a node's ref, else None. A writer with ``x`` in memory reads ``x`` at
    ``t`` once per row instead (``n * c`` plus ``x[t] - c`` where ``t`` is in range)."""
    w = node_at(node.srcs[0]) if node.op == "sum" else None
    if w is None or w[1].op != "where":
        return None
    hit, x, c = w[1].srcs
    eq = node_at(hit)
    if eq is None or eq[1].op != "eq":
        return None
    for pos, t in (eq[1].srcs, eq[1].srcs[::-1]):
        p = node_at(pos)
        if p is not None and p[1].op == "arange_like" and (dict(p[1].attrs)["axis"],) == dict(node.attrs)["axis"]:
            return x, t, c
    return None


def _checked_class(positions: Expr, t: Expr, safe: Expr, ignore_index: int, cls: int, shape: tuple[int, ...]) -> Expr:
    """The target's class, range-checked: a gather of the class positions (the class itself, or a
    clear error naming the target). On ``[rows, classes]`` logits a 1-d gather of the positions
    at each row's target, which keeps the rows free (a DTensor shards them); otherwise the
    positions broadcast to the logits' shape first."""
    if len(shape) == 2:
        row = node("select", positions, axis=0, index=0)
        rows = node("where", node("ne", t, ignore_index), t, 0)
        return node("unsqueeze", node("gather", row, rows, axis=0), axes=(1,))
    return node("gather", node("expand", positions, shape=shape), safe, axis=cls)


def _torch_cross_entropy(
    x: Any, t: Any, weight: Any = None, size_average: Any = None, ignore_index: int = -100, reduce: Any = None,
    reduction: str = "mean", label_smoothing: float = 0.0,
) -> Expr:  # fmt: skip
    if size_average is not None or reduce is not None:
        raise Unsupported
    return cross_entropy(x, t, weight, ignore_index, reduction, label_smoothing)


register(
    OpDef(
        name="cross_entropy",
        kind=OpKind.COMPOSITE,
        arity=None,
        ref=_ce_ref,
        decompose=_ce_decompose,
        typed_decompose=True,
        shape=_ce_shape,
        result_dtype=_ce_dtype,
        eager_launches=2,  # log_softmax, nll_loss
        range_error=_range_error("cross_entropy"),
        pattern=Pattern.CROSS_ENTROPY,
        accepts=ANY,
        front=Front(fn=cross_entropy, torch=dict.fromkeys(torch_fns("cross_entropy"), _torch_cross_entropy)),
    )
)


# ---- linear cross-entropy: the logits never written -------------------------------------------------
def linear_cross_entropy(
    h: ExprLike,
    w: ExprLike,
    target: ExprLike,
    bias: ExprLike | None = None,
    weight: ExprLike | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    grad_in_forward: bool = False,
) -> Expr:
    """Cross-entropy of the logits ``h @ w.T (+ bias)`` over their last axis (the vocabulary),
    optionally soft-capped (``softcap * tanh(logits / softcap)``), without writing the logits.

    ``h`` is ``[..., hidden]``, ``w`` ``[vocab, hidden]``, ``target`` int64 class indices shaped
    like ``h`` without its last axis; the options are :func:`cross_entropy`'s. The analyzer finds
    the logsumexp, the target logit and the other per-row sums over the product and computes them
    tile by tile inside one kernel (Apple's Cut Cross-Entropy, derived): no tokens x vocabulary
    buffer is written, forward or backward, and the backward (two GEMMs) recomputes the logit
    tiles from the saved per-row logsumexp. ``rx.cross_entropy(rx.linear(h, w), t)`` on 2-D ``h``
    gets the same kernels. ``grad_in_forward=True`` (a scalar loss): the forward also runs the
    gradient kernels with a unit cotangent and keeps only ``dh``, ``dw`` (``db``); the backward
    scales them by the loss's cotangent.

    Example:
        >>> import rtxdsl as rx
        >>> e = rx.linear_cross_entropy(rx.var("h"), rx.var("w"), rx.var("t"), softcap=30.0)
        >>> e.op, e.attr("softcap"), e.attr("reduction")
        ('linear_cross_entropy', 30.0, 'mean')
    """
    ce = cross_entropy(0.0, 0, None, ignore_index, reduction, label_smoothing, z_loss, grad_in_forward)  # checks
    cap = None if softcap is None else scalar_arg(softcap, "linear_cross_entropy", "softcap")
    if cap is not None and not cap > 0:
        raise RtxError(f"linear_cross_entropy: softcap must be positive, got {softcap!r}")
    operands = (h, w, target, 0.0 if bias is None else bias) + (() if weight is None else (weight,))
    options = {k: v for k, v in ce.attrs if k != "grad_in_forward"}
    return node("linear_cross_entropy", *operands, softcap=cap, grad_in_forward=grad_in_forward, **options)


def _lce_shape(shapes: list[tuple[int, ...]], reduction: str, **_: Any) -> tuple[int, ...]:
    h, w, t = shapes[:3]
    if len(h) < 1 or len(w) != 2 or h[-1] != w[-1]:
        raise ShapeError(
            f"linear_cross_entropy: hidden states of shape {list(h)} and weight of shape {list(w)} do not "
            f"match (the weight must be [vocab, {h[-1] if h else 'hidden'}])"
        )
    if t != h[:-1]:
        raise ShapeError(f"linear_cross_entropy: target has shape {list(t)}; expected {list(h[:-1])}")
    for extra in shapes[3:]:  # the bias (a tensor one) and the class weight, each one per class
        if extra not in ((), (1,), (w[0],)):
            raise ShapeError(
                f"linear_cross_entropy: a bias or class weight of shape {list(extra)}; "
                f"expected [{w[0]}] (the vocabulary)"
            )
    return h[:-1] if reduction == "none" else ()


def _lce_dtype(dtypes: list[torch.dtype], **_: Any) -> torch.dtype:
    h, w, t = dtypes[:3]
    if h != w:
        raise DtypeMismatchError(f"linear_cross_entropy: hidden states are {h} and the weight is {w}; they must match")
    if t != torch.int64:
        raise RtxError(f"linear_cross_entropy: target must be int64 class indices, got {t}")
    return h


def capped_logits(h: ExprLike, w: ExprLike, b: ExprLike | None, softcap: float | None) -> Expr:
    """The logits ``h @ w.T (+ b)``, soft-capped to ``softcap * tanh(logits / softcap)`` (Gemma 2)."""
    logits = node("linear", h, w, 0.0 if b is None else b)
    return logits if softcap is None else node("mul", node("tanh", node("div", logits, softcap)), softcap)


def _lce_logits(h: Any, w: Any, b: Any, softcap: float | None) -> Any:
    logits = F.linear(h, w) + b
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def _lce_ref(
    h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, b: Any, *cw: torch.Tensor, softcap: float | None,
    grad_in_forward: bool = False, **options: Any,
) -> torch.Tensor:  # fmt: skip
    logits = _lce_logits(h, w, b, softcap).reshape(-1, w.shape[0])
    loss = _ce_ref(logits, t.reshape(-1), *cw, **options)
    return loss.reshape(t.shape) if options["reduction"] == "none" else loss


def _lce_eager(
    operands: list[int], result: int, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], *,
    softcap: float | None, **_: Any,
) -> tuple[int, int]:  # fmt: skip
    """Eager's F.linear (+ the softcap's div, tanh and mul) and F.cross_entropy: the logits are
    written by the GEMM, read and written by each softcap op, and read by the loss."""
    logits = math.prod(shapes[0][:-1]) * shapes[1][0] * dtypes[0].itemsize
    h, w, t, b, *cw = operands
    capped = 0 if softcap is None else 3
    return 1 + capped + 2, (h + w + b + logits) + capped * 2 * logits + (logits + t + sum(cw) + result)


def _lce_decompose(
    h: Expr, w: Expr, t: Expr, b: Expr, *cw: Expr, softcap: float | None, shapes: list, dtypes: list,
    grad_in_forward: bool = False, z_loss: float, **options: Any,
) -> Expr:  # fmt: skip
    logits = capped_logits(h, w, b, softcap)
    x_shape = (*shapes[0][:-1], shapes[1][0])
    ce_shapes = [x_shape, shapes[2], *shapes[4:]]
    rank = len(x_shape)
    weight = cw[0] if cw else None
    return _ce_rows(logits, t, weight, rank - 1, ce_shapes, [dtypes[0], dtypes[2]], z_loss=z_loss, **options)


register(
    OpDef(
        name="linear_cross_entropy",
        kind=OpKind.COMPOSITE,
        arity=None,
        ref=_lce_ref,
        decompose=_lce_decompose,
        typed_decompose=True,
        shape=_lce_shape,
        result_dtype=_lce_dtype,
        eager_launches=3,  # the logits' GEMM, log_softmax, nll_loss
        eager=_lce_eager,
        range_error=_range_error("linear_cross_entropy"),
        pattern=Pattern.LINEAR_CROSS_ENTROPY,
        accepts=ANY,
        front=Front(fn=linear_cross_entropy),
    )
)


# ---- log-probabilities of targets over a product: what preference losses sum per sequence -------------
def linear_logps(
    h: ExprLike, w: ExprLike, target: ExprLike, bias: ExprLike | None = None, ignore_index: int = -100,
    softcap: float | None = None, temperature: float = 1.0,
) -> Expr:  # fmt: skip
    """Each token's log-probability of its target under ``softmax(h @ w.T (+ bias))``, computed in
    float32 (float64 for float64 inputs), 0 where the target is ``ignore_index``; with a
    ``temperature``, of ``softmax(logits / temperature)`` (the float32 logits scaled by its
    inverse, as Liger's policy losses and TRL sample them); the logits are
    never written (the analyzer fuses the product into the row kernel, as for
    :func:`linear_cross_entropy`, whose per-token loss this is, negated, in float32).

    ``h`` is ``[..., hidden]``, ``w`` ``[vocab, hidden]``, ``target`` int64 shaped like ``h``
    without its last axis; the result has the target's shape. Per-sequence sums and means of it
    are what DPO, ORPO, CPO and SimPO compare (:mod:`rtxdsl.ops.preference`).

    Example:
        >>> import torch, rtxdsl as rx
        >>> lp = rx.linear_logps(rx.var("h"), rx.var("w"), rx.var("t"))
        >>> out = rx.compile(lp)(h=torch.zeros(2, 3, 4), w=torch.zeros(8, 4), t=torch.ones(2, 3, dtype=torch.long))
        >>> out.dtype, out.shape, round(out[0, 0].item(), 4)  # uniform over 8 classes: log(1/8)
        (torch.float32, torch.Size([2, 3]), -2.0794)
    """
    linear_cross_entropy(h, w, target, bias, ignore_index=ignore_index, reduction="none", softcap=softcap)  # checks
    cap = None if softcap is None else scalar_arg(softcap, "linear_logps", "softcap")
    temp = scalar_arg(temperature, "linear_logps", "temperature")
    if not temp > 0 or math.isinf(temp):
        raise RtxError(f"linear_logps: temperature must be a positive finite number, got {temperature!r}")
    b = 0.0 if bias is None else bias
    return node("linear_logps", h, w, target, b, ignore_index=ignore_index, softcap=cap, temperature=temp)


def _logps_dtype(dtypes: list[torch.dtype], **_: Any) -> torch.dtype:
    return torch.promote_types(_lce_dtype(dtypes), torch.float32)


def _logps_ref(
    h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, b: Any, *, ignore_index: int, softcap: float | None,
    temperature: float,
) -> torch.Tensor:  # fmt: skip
    if isinstance(b, torch.Tensor) and b.dtype != h.dtype:  # as F.linear's bias, and the kernel's
        raise DtypeMismatchError(f"linear_logps: bias is {b.dtype} and h is {h.dtype}; they must match")
    logits = _lce_logits(h, w, b, softcap)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, w.shape[0])
    logits = logits if temperature == 1.0 else logits * (1.0 / temperature)
    nll = F.cross_entropy(logits, t.reshape(-1), ignore_index=ignore_index, reduction="none")
    return (-nll).reshape(t.shape)


def _logps_eager(
    operands: list[int], result: int, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], *,
    softcap: float | None, **_: Any,
) -> tuple[int, int]:  # fmt: skip
    """:func:`_lce_eager`, and for half logits their float32 copy: one more kernel reading them and
    writing 4 bytes a logit, which the loss then reads instead of the half ones."""
    launches, moved = _lce_eager(operands, result, shapes, dtypes, softcap=softcap)
    if dtypes[0].itemsize >= 4:
        return launches, moved
    logits = math.prod(shapes[0][:-1]) * shapes[1][0]
    return launches + 1, moved + logits * (dtypes[0].itemsize + 4) + logits * (4 - dtypes[0].itemsize)


def _logps_decompose(
    h: Expr, w: Expr, t: Expr, b: Expr, *, ignore_index: int, softcap: float | None, temperature: float,
    shapes: list, dtypes: list,
) -> Expr:  # fmt: skip
    wide = _logps_dtype(dtypes)
    logits = node("cast", capped_logits(h, w, b, softcap), dtype=wide)  # the row math in float32
    if temperature != 1.0:  # scaled by its inverse after the cast, as Liger's policy losses
        logits = node("mul", logits, 1.0 / temperature)
    x_shape = (*shapes[0][:-1], shapes[1][0])
    options = {"ignore_index": ignore_index, "reduction": "none", "label_smoothing": 0.0, "z_loss": 0.0}
    nll = _ce_rows(logits, t, None, len(x_shape) - 1, [x_shape, shapes[2]], [wide, dtypes[2]], **options)
    return node("neg", nll)


register(
    OpDef(
        name="linear_logps",
        kind=OpKind.COMPOSITE,
        arity=4,
        ref=_logps_ref,
        decompose=_logps_decompose,
        typed_decompose=True,
        shape=lambda shapes, **_: _lce_shape(shapes, "none"),
        result_dtype=_logps_dtype,
        eager_launches=4,  # the logits' GEMM, the cast, log_softmax, gather
        eager=_logps_eager,
        range_error=_range_error("linear_logps"),
        pattern=Pattern.LINEAR_CROSS_ENTROPY,
        accepts=ANY,
        front=Front(fn=linear_logps),
    )
)


# ---- cross-entropy's extra outputs: its z-loss term, the token accuracy, the predicted tokens --------------------
def cross_entropy_outputs(
    logits: ExprLike, target: ExprLike, weight: ExprLike | None = None, ignore_index: int = -100,
    reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
) -> dict[str, Expr]:  # fmt: skip
    """``rx.cross_entropy`` with Liger-Kernel's extra outputs, for ``rx.compile`` (one row kernel
    computes all three): ``loss`` (z-loss included), ``z_loss`` (the z-loss term alone, reduced like
    the loss: the mean over non-ignored tokens, their sum, or per token; 0 when no token counts, as
    Liger's), ``accuracy`` (the share of non-ignored tokens whose target is the logits' argmax,
    ties going to the first index as ``torch.argmax``; per token for ``reduction="none"``; NaN when no
    token counts, as Liger's) and ``predicted_tokens`` (each token's argmax, -1 where ignored: always
    per token). Class indices only.

    Example:
        >>> import rtxdsl as rx
        >>> sorted(rx.cross_entropy_outputs(rx.var("x"), rx.var("t"), z_loss=1e-4))
        ['accuracy', 'loss', 'predicted_tokens', 'z_loss']
    """
    return {
        "loss": cross_entropy(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss),
        "z_loss": z_loss_term(logits, target, z_loss, ignore_index, reduction),
        "accuracy": token_accuracy(logits, target, ignore_index, reduction),
        "predicted_tokens": predicted_tokens(logits, target, ignore_index),
    }


def _stat_args(op: str, ignore_index: int, reduction: str) -> dict[str, Any]:
    if reduction not in REDUCTIONS:
        raise RtxError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise RtxError(f"{op}: ignore_index must be an int, got {ignore_index!r}")
    return {"ignore_index": ignore_index, "reduction": reduction}


def z_loss_term(
    logits: ExprLike, target: ExprLike, z_loss: float = 1e-4, ignore_index: int = -100, reduction: str = "mean"
) -> Expr:
    """PaLM's z-loss term alone, ``z_loss * logsumexp(logits)**2`` per non-ignored token, reduced
    as cross-entropy's (its mean over the non-ignored tokens, their sum, or per token). Over no
    counted token the mean is 0, and so is its gradient (Liger's, where 0 / 0 would make both NaN).

    Example:
        >>> import rtxdsl as rx
        >>> rx.z_loss_term(rx.var("x"), rx.var("t"))
        z_loss_term(x, t, ignore_index=-100, reduction='mean', z_loss=0.0001)
    """
    z = scalar_arg(z_loss, "z_loss_term", "z_loss")
    return node("z_loss_term", logits, target, z_loss=z, **_stat_args("z_loss_term", ignore_index, reduction))


def token_accuracy(logits: ExprLike, target: ExprLike, ignore_index: int = -100, reduction: str = "mean") -> Expr:
    """The share of non-ignored tokens whose target is the logits' argmax over the class axis
    (ties to the first class, as ``torch.argmax``); per token for ``reduction="none"``. Over no
    counted token the share is NaN (0 / 0), as Liger's: no token was measured (no gradient flows).

    Example:
        >>> import rtxdsl as rx
        >>> rx.token_accuracy(rx.var("x"), rx.var("t"))
        token_accuracy(x, t, ignore_index=-100, reduction='mean')
    """
    return node("token_accuracy", logits, target, **_stat_args("token_accuracy", ignore_index, reduction))


def predicted_tokens(logits: ExprLike, target: ExprLike, ignore_index: int = -100) -> Expr:
    """Each token's predicted class: the logits' argmax over the class axis (ties to the first
    class, a NaN's class where a row holds one, as ``torch.argmax``), ``-1`` where the target is
    ``ignore_index`` (Liger's ``return_predicted_tokens``). int64, one per token, no gradient; over
    a product (``h @ w.T``) it is a row reduction like the loss, so the logits are never written.

    Example:
        >>> import rtxdsl as rx
        >>> rx.predicted_tokens(rx.var("x"), rx.var("t"))
        predicted_tokens(x, t, ignore_index=-100, reduction='none')
    """
    return node("predicted_tokens", logits, target, **_stat_args("predicted_tokens", ignore_index, "none"))


def _rows_stat(per: Expr, valid: Expr, count: Expr, reduction: str) -> Expr:
    """A per-token statistic reduced as cross-entropy's z-loss: its mean over the non-ignored tokens
    (``count`` of them), its sum, or none."""
    per = node("where", valid, per, 0.0)
    if reduction == "none":
        return per
    total = node("sum", per, axis=None, keepdim=False)
    if reduction == "sum":
        return total
    return node("div", total, count)


def _z_loss_decompose(
    x: Expr, t: Expr, *, z_loss: float, ignore_index: int, reduction: str, shapes: list, dtypes: list
) -> Expr:
    lse = node("logsumexp", x, axis=(_class_axis(len(shapes[0])),), keepdim=False)
    # over no counted token Liger's z-loss is 0 (its per-token terms are 0, summed), and its gradient 0
    valid, count = valid_rows(t, ignore_index, ())
    return _rows_stat(node("mul", node("mul", lse, lse), z_loss), valid, count, reduction)


def _argmax(x: Expr, shape: tuple[int, ...]) -> Expr:
    """torch.argmax over the class axis: the first class holding the row's max, or its first NaN
    (where ``amax`` is NaN and no class equals it); two row reductions in one row kernel."""
    cls = _class_axis(len(shape))
    top = node("amax", x, axis=(cls,), keepdim=False)
    ties = node("or", node("eq", x, node("unsqueeze", top, axes=(cls,))), node("ne", x, x))
    return node("amin", node("where", ties, node("arange_like", x, axis=cls), shape[cls]), axis=(cls,), keepdim=False)


def _accuracy_decompose(x: Expr, t: Expr, *, ignore_index: int, reduction: str, shapes: list, dtypes: list) -> Expr:
    hit = node("cast", node("eq", _argmax(x, shapes[0]), t), dtype=dtypes[0])  # 1 or 0 in the logits' dtype
    valid = node("ne", t, ignore_index)
    # the share of no token is 0 / 0 = NaN, as Liger's (torch.sum(hits) / n_non_ignore): unlike the
    # z-loss (a loss), a metric with no gradient, and none was measured
    count = node("sum", node("where", valid, 1.0, 0.0), axis=None, keepdim=False)
    return _rows_stat(hit, valid, count, reduction)


def _predicted_decompose(x: Expr, t: Expr, *, ignore_index: int, reduction: str, shapes: list, dtypes: list) -> Expr:
    return node("where", node("ne", t, ignore_index), _argmax(x, shapes[0]), -1)


def _z_loss_ref(x: torch.Tensor, t: torch.Tensor, *, z_loss: float, ignore_index: int, reduction: str):
    valid = t != ignore_index
    per = torch.where(valid, z_loss * torch.logsumexp(x, _class_axis(x.ndim)) ** 2, 0)
    # Liger's: no token counts, the z-loss is 0
    return per if reduction == "none" else per.sum() if reduction == "sum" else per.sum() / valid.sum().clamp(min=1)


def _accuracy_ref(x: torch.Tensor, t: torch.Tensor, *, ignore_index: int, reduction: str):
    valid = t != ignore_index
    per = torch.where(valid, (x.argmax(_class_axis(x.ndim)) == t).to(x.dtype), 0)
    return per if reduction == "none" else per.sum() if reduction == "sum" else per.sum() / valid.sum()


def _predicted_ref(x: torch.Tensor, t: torch.Tensor, *, ignore_index: int, reduction: str):
    return torch.where(t != ignore_index, x.argmax(_class_axis(x.ndim)), -1)


def _stat_shape(shapes: list[tuple[int, ...]], reduction: str, **_: Any) -> tuple[int, ...]:
    x, t = shapes
    rows = x[: _class_axis(len(x))] + x[_class_axis(len(x)) + 1 :] if x else ()
    if not x or t != rows:
        raise ShapeError(f"cross_entropy outputs: target has shape {list(t)}; expected {list(rows)} (class indices)")
    return rows if reduction == "none" else ()


def _stat_dtype(dtypes: list[torch.dtype], **_: Any) -> torch.dtype:
    if dtypes[1] != torch.int64:
        raise RtxError(f"cross_entropy outputs: the target must be int64 class indices, got {dtypes[1]}")
    return dtypes[0]


def _predicted_dtype(dtypes: list[torch.dtype], **_: Any) -> torch.dtype:
    _stat_dtype(dtypes)
    return torch.int64


for _name, _fn, _ref, _decompose, _dtype in (
    ("z_loss_term", z_loss_term, _z_loss_ref, _z_loss_decompose, _stat_dtype),
    ("token_accuracy", token_accuracy, _accuracy_ref, _accuracy_decompose, _stat_dtype),
    ("predicted_tokens", predicted_tokens, _predicted_ref, _predicted_decompose, _predicted_dtype),
):
    register(
        OpDef(
            name=_name,
            kind=OpKind.COMPOSITE,
            arity=2,
            ref=_ref,
            decompose=_decompose,
            typed_decompose=True,
            shape=_stat_shape,
            result_dtype=_dtype,
            eager_launches=3,
            pattern=Pattern.CROSS_ENTROPY,
            accepts=ANY,
            front=Front(fn=_fn),
        )
    )


# ---- rotary embeddings ------------------------------------------------------------------------------
def rope(x: ExprLike, cos: ExprLike, sin: ExprLike, interleaved: bool = False) -> Expr:
    """Rotary position embedding on the last axis: ``x * cos + rotate(x) * sin``.

    ``rotate`` is Hugging Face Llama's rotate-half (``cat(-x2, x1)`` of the two halves, split at
    ``D // 2``: an odd head dimension works as there) or, with ``interleaved``, GPT-J's pairs
    (``(-x1, x0), (-x3, x2), ...``). ``cos`` and ``sin`` have the full last axis and broadcast
    against ``x`` (e.g. ``[T, D]`` against ``[B, H, T, D]``).
    q and k in one kernel: ``rx.compile({"q": rx.rope(q, c, s), "k": rx.rope(k, c, s)})``.

    Example:
        >>> import rtxdsl as rx
        >>> rx.rope(rx.var("q"), rx.var("cos"), rx.var("sin"))
        rope(q, cos, sin, interleaved=False)
    """
    return node("rope", x, cos, sin, interleaved=flag_arg(interleaved, "rope", "interleaved"))


def _rotate(x: Expr, interleaved: bool, last: int) -> Expr:
    if not interleaved:
        half = last // 2
        x1 = node("slice", x, axis=-1, start=0, stop=half, step=1)
        x2 = node("slice", x, axis=-1, start=half, stop=None, step=1)
        return node("cat", node("neg", x2), x1, axis=-1)
    nxt = node(
        "cat",
        node("slice", x, axis=-1, start=1, stop=None, step=1),
        node("slice", x, axis=-1, start=0, stop=1, step=1),
        axis=-1,
    )  # noqa: E501
    prv = node(
        "cat",
        node("slice", x, axis=-1, start=-1, stop=None, step=1),
        node("slice", x, axis=-1, start=0, stop=-1, step=1),
        axis=-1,
    )  # noqa: E501
    even = node("eq", node("remainder", node("arange_like", x, axis=-1), 2), 0)
    return node("where", even, node("neg", nxt), prv)


def _rope_shape(shapes: list[tuple[int, ...]], interleaved: bool) -> tuple[int, ...]:
    x = shapes[0]
    if not x or (interleaved and x[-1] % 2):
        raise ShapeError(f"rope: interleaved pairs need an even last axis, got shape {list(x)}")
    for name, s in zip(("cos", "sin"), shapes[1:]):
        pad = len(x) - len(s)
        if pad < 0 or not s or s[-1] != x[-1] or any(a not in (1, b) for a, b in zip(s, x[pad:])):
            raise ShapeError(f"rope: {name} has shape {list(s)}, which does not broadcast to x's {list(x)}")
    return x


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        rot = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
    else:  # Hugging Face's rotate_half: an odd last axis puts its middle element in the second half
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rot * sin


def _rope_decompose(x: Expr, cos: Expr, sin: Expr, interleaved: bool, shapes: list, dtypes: list) -> Expr:
    rot = _rotate(x, interleaved, shapes[0][-1])
    return node("add", node("mul", x, cos), node("mul", rot, sin))


register(
    OpDef(
        name="rope",
        kind=OpKind.COMPOSITE,
        arity=3,
        ref=_rope_ref,
        decompose=_rope_decompose,
        typed_decompose=True,
        shape=_rope_shape,
        result_dtype=lambda dtypes, interleaved: torch.promote_types(
            torch.promote_types(dtypes[0], dtypes[1]), dtypes[2]
        ),
        eager_launches=5,  # HF: two slices and a cat make copies: neg, cat, mul, mul, add
        pattern=Pattern.ROPE,
        accepts=FLOATING,
        front=Front(fn=rope),
    )
)


# ---- multimodal rotary embedding (Qwen2-VL) ---------------------------------------------------------
def mrope(
    x: ExprLike, cos: ExprLike, sin: ExprLike, sections: tuple[int, ...] | list[int], unsqueeze_dim: int = 1
) -> Expr:
    """Qwen2-VL's multimodal RoPE (Liger's ``LigerQwen2VLMRoPE``): ``cos`` / ``sin`` hold one table
    per position kind (``[3, B, T, D]``: time, height, width); channel block ``i`` of the split
    ``sections + sections`` (which sums to ``D``) takes table ``i % 3``. The chosen tables get a
    size-1 dim at ``unsqueeze_dim`` (the heads of ``[B, H, T, D]``), then rotate-half RoPE.

    Example:
        >>> import rtxdsl as rx
        >>> rx.mrope(rx.var("q"), rx.var("cos"), rx.var("sin"), (1, 1, 2))
        mrope(q, cos, sin, sections=(1, 1, 2), unsqueeze_dim=1)
    """
    parts = ints_arg(sections, "mrope", "sections")
    if not parts or any(s <= 0 for s in parts):
        raise RtxError(f"mrope: sections must be positive ints, got {sections!r}")
    return node("mrope", x, cos, sin, sections=parts, unsqueeze_dim=int_arg(unsqueeze_dim, "mrope", "unsqueeze_dim"))


def _mrope_tables(t: Expr, sections: tuple[int, ...], unsqueeze_dim: int) -> Expr:
    pieces, start = [], 0
    for i, size in enumerate((*sections, *sections)):
        table = node("select", t, axis=0, index=i % 3)
        pieces.append(node("slice", table, axis=-1, start=start, stop=start + size, step=1))
        start += size
    return node("unsqueeze", node("cat", *pieces, axis=-1), axes=(unsqueeze_dim,))


def _mrope_decompose(
    x: Expr, cos: Expr, sin: Expr, *, sections: tuple[int, ...], unsqueeze_dim: int, shapes: list, dtypes: list
) -> Expr:
    c, s = (_mrope_tables(t, sections, unsqueeze_dim) for t in (cos, sin))
    return node("rope", x, c, s, interleaved=False)


def _mrope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sections: tuple, unsqueeze_dim: int):
    split = list(sections) * 2
    c = torch.cat([m[i % 3] for i, m in enumerate(cos.split(split, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    s = torch.cat([m[i % 3] for i, m in enumerate(sin.split(split, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    return _rope_ref(x, c, s, False)


def _mrope_shape(shapes: list[tuple[int, ...]], sections: tuple[int, ...], unsqueeze_dim: int) -> tuple[int, ...]:
    x, c = shapes[0], shapes[1]
    if len(c) < 2 or c[0] != 3 or c != shapes[2]:
        raise ShapeError(
            f"mrope: cos and sin must be [3, ..., D] tables of one shape, got {list(c)}, {list(shapes[2])}"
        )
    if 2 * sum(sections) != c[-1] or not x or x[-1] != c[-1]:
        raise ShapeError(f"mrope: 2 * sum(sections) = {2 * sum(sections)} must be the head dim of x and the tables")
    return x


register(
    OpDef(
        name="mrope",
        kind=OpKind.COMPOSITE,
        arity=3,
        ref=_mrope_ref,
        decompose=_mrope_decompose,
        typed_decompose=True,
        shape=_mrope_shape,
        result_dtype=lambda dtypes, **_: torch.promote_types(torch.promote_types(dtypes[0], dtypes[1]), dtypes[2]),
        eager_launches=9,  # HF: the two table cats, then rope's five
        pattern=Pattern.ROPE,
        accepts=FLOATING,
        front=Front(fn=mrope),
    )
)
