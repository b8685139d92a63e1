"""Composites: declared once as decompositions into primitives.

Fusion and (later) derivatives come from the primitives; the composite keeps its torch
reference (the oracle, and torch's dtype/shape rules and errors) and the number of kernels
eager torch launches for it, which the traffic model charges eager execution with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..expr import Expr, node
from . import FLOAT, NUMERIC, OpDef, OpKind, register


def _composite(
    name: str, arity: int, ref, decompose, *, eager_launches: int = 1, pattern: str | None = None, accepts=NUMERIC
) -> OpDef:
    return register(
        OpDef(
            name=name,
            kind=OpKind.COMPOSITE,
            arity=arity,
            ref=ref,
            decompose=decompose,
            eager_launches=eager_launches,
            pattern=pattern,
            accepts=accepts,
        )
    )


def _keep(x: Expr, op: str, axis) -> Expr:
    return node(op, x, axis=axis, keepdim=True)


def _shift(x: Expr, axis) -> Expr:
    """The max subtracted for stability: its gradient cancels exactly, so it is detached."""
    return node("detach", _keep(x, "amax", axis))


def mean(x: Expr, axis, keepdim: bool) -> Expr:
    return node("div", node("sum", x, axis=axis, keepdim=keepdim), node("rcount", x, axis=axis))


def variance(x: Expr, correction: Expr, axis, keepdim: bool) -> Expr:
    d = node("sub", x, mean(x, axis, True))
    dof = node("maximum", node("sub", node("rcount", x, axis=axis), correction), 0)
    return node("div", node("sum", node("mul", d, d), axis=axis, keepdim=keepdim), dof)


def logsumexp(x: Expr, axis, keepdim: bool) -> Expr:
    m = _shift(x, axis)
    # torch shifts by 0 where the max is infinite, so all -inf rows give -inf, not nan
    m = node("where", node("eq", node("abs", m), float("inf")), 0.0, m)
    s = node("sum", node("exp", node("sub", x, m)), axis=axis, keepdim=keepdim)
    shift = m if keepdim else node("sum", m, axis=axis, keepdim=False)
    return node("add", node("log", s), shift)


def softmax(x: Expr, axis) -> Expr:
    e = node("exp", node("sub", x, _shift(x, axis)))
    return node("div", e, _keep(e, "sum", axis))


def log_softmax(x: Expr, axis) -> Expr:
    z = node("sub", x, _shift(x, axis))
    return node("sub", z, node("log", _keep(node("exp", z), "sum", axis)))


def _affine(y: Expr, w: Expr, b: Expr | None) -> Expr:
    if not (w.op == "const" and w.attr("value") == 1.0):
        y = node("mul", y, w)
    if b is not None and not (b.op == "const" and b.attr("value") == 0.0):
        y = node("add", y, b)
    return y


def layer_norm(x: Expr, w: Expr, b: Expr, eps: Expr) -> Expr:
    d = node("sub", x, mean(x, -1, True))
    rstd = node("rsqrt", node("add", mean(node("mul", d, d), -1, True), eps))
    return _affine(node("mul", d, rstd), w, b)


def rms_norm(x: Expr, w: Expr, eps: Expr) -> Expr:
    rstd = node("rsqrt", node("add", mean(node("mul", x, x), -1, True), eps))
    return _affine(node("mul", x, rstd), w, None)


def _scalar_affine_ref(y: torch.Tensor, w, b=0.0) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) and w != 1.0:
        y = y * w
    if not isinstance(b, torch.Tensor) and b != 0.0:
        y = y + b
    return y


def _tensor_or_none(v):
    return v if isinstance(v, torch.Tensor) else None


def _layer_norm_ref(x, w, b, eps):
    y = F.layer_norm(x, x.shape[-1:], _tensor_or_none(w), _tensor_or_none(b), eps)
    return _scalar_affine_ref(y, w, b)


def _rms_norm_ref(x, w, eps):
    return _scalar_affine_ref(F.rms_norm(x, x.shape[-1:], _tensor_or_none(w), eps), w)


def _dims(axis):
    return () if axis is None else axis


_composite(
    "mean", 1, lambda x, axis, keepdim: torch.mean(x, dim=_dims(axis), keepdim=keepdim), mean, pattern="Reduction"
)
_composite(
    "variance",
    2,
    lambda x, c, axis, keepdim: torch.var(x, dim=axis, correction=c, keepdim=keepdim),
    variance,
    pattern="Reduction",
)
_composite(
    "std",
    2,
    lambda x, c, axis, keepdim: torch.std(x, dim=axis, correction=c, keepdim=keepdim),
    lambda x, c, axis, keepdim: node("sqrt", variance(x, c, axis, keepdim)),
    pattern="Reduction",
)
# eager logsumexp: amax, masked fill, sub, exp, sum, log, add
_composite(
    "logsumexp",
    1,
    lambda x, axis, keepdim: torch.logsumexp(x, dim=_dims(axis) or tuple(range(x.ndim)), keepdim=keepdim),
    logsumexp,
    eager_launches=7,
    pattern="Reduction",
)
_composite(
    "softmax", 1, lambda x, axis: torch.softmax(x, dim=axis), softmax, pattern="Softmax", accepts=frozenset({FLOAT})
)
_composite(
    "log_softmax",
    1,
    lambda x, axis: torch.log_softmax(x, dim=axis),
    log_softmax,
    pattern="Softmax",
    accepts=frozenset({FLOAT}),
)
_composite("layer_norm", 4, _layer_norm_ref, layer_norm, pattern="LayerNorm", accepts=frozenset({FLOAT}))
_composite("rms_norm", 3, _rms_norm_ref, rms_norm, pattern="RMSNorm", accepts=frozenset({FLOAT}))
_composite(
    "swiglu",
    2,
    lambda g, u: F.silu(g) * u,
    lambda g, u: node("mul", node("silu", g), u),
    eager_launches=2,
    pattern="Activation",
    accepts=frozenset({FLOAT}),
)
_composite(
    "clamp", 3, lambda x, lo, hi: torch.clamp(x, lo, hi), lambda x, lo, hi: node("minimum", node("maximum", x, lo), hi)
)
_composite("clamp_min", 2, lambda x, lo: torch.clamp(x, min=lo), lambda x, lo: node("maximum", x, lo))
_composite("clamp_max", 2, lambda x, hi: torch.clamp(x, max=hi), lambda x, hi: node("minimum", x, hi))
