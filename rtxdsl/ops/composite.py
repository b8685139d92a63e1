"""Composites: declared once as decompositions into primitives.

Fusion and derivatives come from the primitives; the composite keeps its torch reference
(the oracle, and torch's dtype/shape rules and errors) and the number of kernels eager torch
launches for it, which the traffic model charges eager execution with.

softmax is ``exp(x - logsumexp(x))`` and layer_norm reads its mean and ``m2`` in the same
pass: a row that does not fit on chip is read twice (statistics, then output), never three
times.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..dtypes import compute_dtype
from ..errors import RtxError, ShapeError
from ..expr import Expr, node
from ..registry import FLOATING, NUMERIC, Front, OpDef, OpKind, Pattern, Unsupported, register
from .helpers import ExprLike, axis_arg, binary_fn, flag_arg, int_axis, scalar_arg, torch_fns
from .reduction import deviations, mean_of, norm_axes, reduced_shape, softmax_parts


def _composite(
    name: str,
    arity: int,
    ref: Callable[..., Any],
    decompose: Callable[..., Expr],
    *,
    shape: Callable[..., tuple[int, ...]] | None = None,
    eager_launches: int = 1,
    pattern: Pattern | None = None,
    accepts=NUMERIC,
    front: Front | None = None,
    result_dtype: Callable[..., torch.dtype] | None = None,
    typed: bool = False,
) -> OpDef:
    return register(
        OpDef(
            name=name,
            kind=OpKind.COMPOSITE,
            arity=arity,
            ref=ref,
            decompose=decompose,
            typed_decompose=typed,
            shape=shape,
            result_dtype=result_dtype,
            eager_launches=eager_launches,
            pattern=pattern,
            accepts=accepts,
            front=front or Front(),
        )
    )


def _dims(axis: Any) -> Any:
    return () if axis is None else axis


def _reduced(shapes: list[tuple[int, ...]], axis: Any, keepdim: bool) -> tuple[int, ...]:
    return reduced_shape(shapes[0], axis, keepdim)


def _same_as_first(shapes: list[tuple[int, ...]], axis: int) -> tuple[int, ...]:
    norm_axes(axis, len(shapes[0]))  # checks the axis
    return shapes[0]


# ---- statistics -----------------------------------------------------------------------------
def variance_of(
    x: Expr, correction: Expr, axis: Any, keepdim: bool, shapes: list | None = None, dtypes: list | None = None
) -> Expr:
    """``m2 / max(n - correction, 0)``, torch's forward. Where the correction is past the count (``shapes``:
    the operands' when known), torch's var_backward divides by ``n - correction`` unclamped: the quotient
    by it, and the clamped one's difference detached (inf or NaN, as the forward)."""
    m2 = node("m2", x, axis=axis, keepdim=keepdim)
    dof = node("sub", node("rcount", x, axis=axis), correction)
    if not _past_count(correction, axis, shapes):
        return node("div", m2, node("maximum", dof, 0))
    plain = node("div", m2, dof)
    return node("add", plain, node("detach", node("sub", node("div", m2, 0.0), plain)))


def _past_count(correction: Expr, axis: Any, shapes: list | None) -> bool:
    """Is a constant correction larger than the count it divides (unknown: maybe)?"""
    if shapes is None or not correction.is_const:
        return True
    shape = shapes[0]
    axes = () if axis is None else (axis,) if isinstance(axis, int) else tuple(axis)
    dims = {a % len(shape) for a in axes} if axes and shape else range(len(shape))  # none named: every dim
    return correction.attr("value") > math.prod(shape[d] for d in dims)


def _std_of(x: Expr, correction: Expr, axis: Any, keepdim: bool, **types: Any) -> Expr:
    """sqrt of the variance, with torch's gradient where it is 0 (a constant row): torch's
    std_backward is ``(grad / (2 * std)).masked_fill_(std == 0, 0)``, exactly 0 there, where the
    sqrt's own ``g / (2 * 0)`` times the row's deviations (0) would be NaN; the sqrt reads 1 there,
    so no inf enters the gradient."""
    v = variance_of(x, correction, axis, keepdim, **types)
    zero = node("eq", v, 0.0)
    return node("where", zero, 0.0, node("sqrt", node("where", zero, 1.0, v)))


def _torch_spread(fn: Callable[..., Expr]) -> Callable[..., Expr]:
    def build(a: Any, dim: Any = None, unbiased: Any = None, keepdim: bool = False, *, correction: Any = None) -> Expr:
        if isinstance(unbiased, bool) or unbiased is None:
            corr = correction if correction is not None else (0 if unbiased is False else 1)
        else:  # torch.var(x, 0) passes dim positionally where unbiased would be
            raise Unsupported
        if isinstance(dim, list):
            dim = tuple(dim)
        return fn(a, dim, keepdim, correction=corr)

    return build


def _spread_fn(op: str, text: str) -> Callable[..., Expr]:
    def fn(x: ExprLike, axis: Any = None, keepdim: bool = False, *, correction: int = 1, dim: Any = None) -> Expr:
        if isinstance(correction, bool) or not isinstance(correction, (int, float)):
            raise RtxError(f"{op}: correction must be a number, got {correction!r}")
        return node(op, x, correction, axis=axis_arg(axis, dim, op), keepdim=flag_arg(keepdim, op, "keepdim"))

    fn.__name__ = fn.__qualname__ = op
    fn.__doc__ = (
        f"{text} over ``axis`` with ``correction`` (1: Bessel's), from a one-pass Welford state.\n\n"
        f"Example:\n    >>> import rtxdsl as rx\n    >>> rx.{op}(rx.var('x'), axis=-1)\n"
        f"    {op}(x, 1, axis=-1, keepdim=False)\n"
    )
    return fn


def _mean_fn(x: ExprLike, axis: Any = None, keepdim: bool = False, *, dim: Any = None) -> Expr:
    """Mean over ``axis`` (None or (): all), keeping reduced dims as size 1 if ``keepdim``.

    Example:
        >>> import rtxdsl as rx
        >>> rx.mean(rx.var('x'), axis=-1)
        mean(x, axis=-1, keepdim=False)
    """
    return node("mean", x, axis=axis_arg(axis, dim, "mean"), keepdim=flag_arg(keepdim, "mean", "keepdim"))


_mean_fn.__name__ = _mean_fn.__qualname__ = "mean"


def _torch_mean(a: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None, out: Any = None) -> Expr:
    if dtype is not None or out is not None:
        raise Unsupported
    return _mean_fn(a, tuple(dim) if isinstance(dim, list) else dim, keepdim)


_composite(
    "mean",
    1,
    lambda x, axis, keepdim: torch.mean(x, dim=_dims(axis), keepdim=keepdim),
    lambda x, axis, keepdim: mean_of(x, axis, keepdim),
    shape=_reduced,
    pattern=Pattern.REDUCTION,
    accepts=FLOATING,
    front=Front(fn=_mean_fn, methods={"mean": None}, torch=dict.fromkeys(torch_fns("mean"), _torch_mean)),
)
_variance = _spread_fn("variance", "Variance")
_std = _spread_fn("std", "Standard deviation")
_composite(
    "variance",
    2,
    lambda x, c, axis, keepdim: torch.var(x, dim=axis, correction=c, keepdim=keepdim),
    variance_of,
    typed=True,
    shape=_reduced,
    pattern=Pattern.REDUCTION,
    accepts=FLOATING,
    front=Front(fn=_variance, methods={"var": None}, torch=dict.fromkeys(torch_fns("var"), _torch_spread(_variance))),
)
_composite(
    "std",
    2,
    lambda x, c, axis, keepdim: torch.std(x, dim=axis, correction=c, keepdim=keepdim),
    _std_of,
    typed=True,
    shape=_reduced,
    pattern=Pattern.REDUCTION,
    accepts=FLOATING,
    front=Front(fn=_std, methods={"std": None}, torch=dict.fromkeys(torch_fns("std"), _torch_spread(_std))),
)


# ---- softmax family ---------------------------------------------------------------------------
def softmax(x: ExprLike, axis: int | None = None, *, dim: int | None = None) -> Expr:
    """exp(x - logsumexp(x)) over ``axis``: one kernel, minimum bytes.

    Example:
        >>> import rtxdsl as rx
        >>> rx.softmax(rx.var("x") * 0.125)
        softmax(x * 0.125, axis=-1)
    """
    return node("softmax", x, axis=int_axis(axis, dim, "softmax", -1))


def log_softmax(x: ExprLike, axis: int | None = None, *, dim: int | None = None) -> Expr:
    """x - logsumexp(x) over ``axis``.

    Example:
        >>> import rtxdsl as rx
        >>> rx.log_softmax(rx.var("x"))
        log_softmax(x, axis=-1)
    """
    return node("log_softmax", x, axis=int_axis(axis, dim, "log_softmax", -1))


def _torch_softmax(fn: Callable[..., Expr]) -> Callable[..., Expr]:
    def build(a: Any, dim: int | None = None, _stacklevel: int = 3, dtype: Any = None) -> Expr:
        if dim is None or not (dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point)):
            raise Unsupported
        # ``dtype``: the input cast first, as torch does (attention's scores in float32)
        return fn(a if dtype is None else node("cast", a, dtype=dtype), dim)

    return build


def _softmax(shifted: Expr, total: Expr) -> Expr:
    return node("mul", node("exp", shifted), node("reciprocal", total))


def _log_softmax(shifted: Expr, total: Expr) -> Expr:
    return node("sub", shifted, node("log", total))


_composite(
    "softmax",
    1,
    lambda x, axis: torch.softmax(x, dim=axis),
    lambda x, axis: _softmax(*softmax_parts(x, axis)),
    shape=_same_as_first,
    pattern=Pattern.SOFTMAX,
    accepts=FLOATING,
    front=Front(
        fn=softmax, methods={"softmax": None}, torch=dict.fromkeys(torch_fns("softmax"), _torch_softmax(softmax))
    ),
)
_composite(
    "log_softmax",
    1,
    lambda x, axis: torch.log_softmax(x, dim=axis),
    lambda x, axis: _log_softmax(*softmax_parts(x, axis)),
    shape=_same_as_first,
    pattern=Pattern.SOFTMAX,
    accepts=FLOATING,
    front=Front(
        fn=log_softmax,
        methods={"log_softmax": None},
        torch=dict.fromkeys(torch_fns("log_softmax"), _torch_softmax(log_softmax)),
    ),
)


# ---- norms ----------------------------------------------------------------------------------------
def _affine(y: Expr, w: Expr, b: Expr | None) -> Expr:
    if not (w.op == "const" and w.attr("value") == 1.0):
        y = node("mul", y, w)
    if b is not None and not (b.op == "const" and b.attr("value") == 0.0):
        y = node("add", y, b)
    return y


def _layer_norm(x: Expr, w: Expr, b: Expr, eps: Expr) -> Expr:
    centred, m2 = deviations(x, (-1,))
    var = node("div", m2, node("rcount", x, axis=(-1,)))
    return _affine(node("mul", centred, node("rsqrt", node("add", var, eps))), w, b)


def _rms_norm(x: Expr, w: Expr, eps: Expr) -> Expr:
    rstd = node("rsqrt", node("add", mean_of(node("mul", x, x), (-1,), True), eps))
    return _affine(node("mul", x, rstd), w, None)


def _scalar_affine_ref(y: torch.Tensor, w: Any, b: Any = 0.0) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) and w != 1.0:
        y = y * w
    if not isinstance(b, torch.Tensor) and b != 0.0:
        y = y + b
    return y


def _tensor_or_none(v: Any) -> Any:
    return v if isinstance(v, torch.Tensor) else None


def _layer_norm_ref(x: Any, w: Any, b: Any, eps: float) -> torch.Tensor:
    y = F.layer_norm(x, x.shape[-1:], _tensor_or_none(w), _tensor_or_none(b), eps)
    return _scalar_affine_ref(y, w, b)


def _rms_norm_ref(x: Any, w: Any, eps: float) -> torch.Tensor:
    return _scalar_affine_ref(F.rms_norm(x, x.shape[-1:], _tensor_or_none(w), eps), w)


def _norm_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    x = shapes[0]
    if not x:
        raise RtxError("norms normalize the last axis: a 0-dim input has none")
    for s in shapes[1:]:
        if s and s != x[-1:]:
            raise RtxError(f"norm weight/bias of shape {list(s)} does not match the last axis of {list(x)}")
    return x


def layer_norm(x: ExprLike, weight: ExprLike | None = None, bias: ExprLike | None = None, eps: float = 1e-5) -> Expr:
    """Layer norm over the last axis (one-pass mean and variance), then ``* weight + bias``.

    Example:
        >>> import rtxdsl as rx
        >>> rx.layer_norm(rx.var("x"), rx.var("w"), rx.var("b"))
        layer_norm(x, w, b, 1e-05)
    """
    return node(
        "layer_norm",
        x,
        1.0 if weight is None else weight,
        0.0 if bias is None else bias,
        scalar_arg(eps, "layer_norm", "eps"),
    )


def rms_norm(x: ExprLike, weight: ExprLike | None = None, eps: float = 1e-6) -> Expr:
    """x * rsqrt(mean(x**2, -1) + eps) * weight (the seed's rms_norm_cpu semantics).

    Example:
        >>> import rtxdsl as rx
        >>> rx.rms_norm(rx.var("x"), rx.var("w"))
        rms_norm(x, w, 1e-06)
    """
    return node("rms_norm", x, 1.0 if weight is None else weight, scalar_arg(eps, "rms_norm", "eps"))


def _torch_layer_norm(a: Any, normalized_shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Expr:
    if len(tuple(normalized_shape)) != 1:
        raise Unsupported  # rtxdsl normalizes over the last axis only
    return layer_norm(a, weight, bias, eps)


def _torch_rms_norm(a: Any, normalized_shape: Any, weight: Any = None, eps: float | None = None) -> Expr:
    if len(tuple(normalized_shape)) != 1:
        raise Unsupported  # rtxdsl normalizes over the last axis only
    if eps is None:  # torch: the machine epsilon of the input's dtype
        return node("rms_norm", a, 1.0 if weight is None else weight, node("eps_of", a))
    return rms_norm(a, weight, eps)


_composite(
    "layer_norm",
    4,
    _layer_norm_ref,
    _layer_norm,
    shape=_norm_shape,
    pattern=Pattern.LAYER_NORM,
    accepts=FLOATING,
    front=Front(fn=layer_norm, torch={F.layer_norm: _torch_layer_norm}),
)
_composite(
    "rms_norm",
    3,
    _rms_norm_ref,
    _rms_norm,
    shape=_norm_shape,
    pattern=Pattern.RMS_NORM,
    accepts=FLOATING,
    front=Front(fn=rms_norm, torch=dict.fromkeys(torch_fns("rms_norm"), _torch_rms_norm)),
)

# ---- gated activations and clamps ---------------------------------------------------------------
_composite(
    "swiglu",
    2,
    lambda g, u: F.silu(g) * u,
    lambda g, u: node("mul", node("silu", g), u),
    eager_launches=2,
    pattern=Pattern.ACTIVATION,
    accepts=FLOATING,
    front=Front(fn=binary_fn("swiglu", "silu(gate) * up", "swiglu(a, b)")),
)


def geglu(gate: ExprLike, up: ExprLike, approximate: str = "none") -> Expr:
    """gelu(gate) * up (GeGLU; ``approximate="tanh"`` as in Gemma).

    Example:
        >>> import rtxdsl as rx
        >>> rx.geglu(rx.var("g"), rx.var("u"))
        geglu(g, u, approximate='none')
    """
    if approximate not in ("none", "tanh"):
        raise RtxError(f"geglu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return node("geglu", gate, up, approximate=approximate)


_composite(
    "geglu",
    2,
    lambda g, u, approximate: F.gelu(g, approximate=approximate) * u,
    lambda g, u, approximate: node("mul", node("gelu", g, approximate=approximate), u),
    eager_launches=2,
    pattern=Pattern.ACTIVATION,
    accepts=FLOATING,
    front=Front(fn=geglu),
)


def clamp(x: ExprLike, min: ExprLike | None = None, max: ExprLike | None = None) -> Expr:  # noqa: A002
    """Clamp into [min, max] (either may be None); NaN stays NaN.

    Example:
        >>> import rtxdsl as rx
        >>> rx.clamp(rx.var("x"), 0.0, 6.0)
        clamp(x, 0.0, 6.0)
    """
    if min is None and max is None:
        raise RtxError("clamp: at least one of min and max must be given")
    if max is None:
        return node("clamp_min", x, min)
    if min is None:
        return node("clamp_max", x, max)
    return node("clamp", x, min, max)


def _torch_clamp(a: Any, min: Any = None, max: Any = None) -> Expr:  # noqa: A002
    if min is None and max is None:
        raise Unsupported  # torch raises; let it
    return clamp(a, min, max)


# torch's clamp_backward: x takes the cotangent where lo <= x <= hi (its bounds included: where, not
# maximum, whose tie would halve it), a bound where x lies beyond it; nothing takes it where x or
# the bound is NaN (the value is NaN there, as torch's: x + bound, outside autograd)
def _clamp_min(x: Expr, lo: Expr) -> Expr:
    return node("where", node("ge", x, lo), x, node("where", node("lt", x, lo), lo, node("detach", node("add", x, lo))))


def _clamp_max(x: Expr, hi: Expr) -> Expr:
    return node("where", node("le", x, hi), x, node("where", node("gt", x, hi), hi, node("detach", node("add", x, hi))))


def _clamp(x: Expr, lo: Expr, hi: Expr) -> Expr:
    # min(max(x, lo), hi): lo takes a cotangent only where lo < hi, as torch's (where lo == hi, hi
    # does not take it either; where lo > hi, hi takes it everywhere)
    return _clamp_max(_clamp_min(x, node("where", node("lt", lo, hi), lo, node("detach", lo))), hi)


_composite(
    "clamp",
    3,
    lambda x, lo, hi: torch.clamp(x, lo, hi),
    _clamp,
    front=Front(
        fn=clamp,
        names=("clamp", "clip"),
        methods={"clamp": None, "clip": None},
        torch=dict.fromkeys(torch_fns("clamp", "clip"), _torch_clamp),
        inplace=(torch.Tensor.clamp_, torch.Tensor.clip_),
        cpu_rounds_numbers=True,
    ),
)
_composite("clamp_min", 2, lambda x, lo: torch.clamp(x, min=lo), _clamp_min)
_composite("clamp_max", 2, lambda x, hi: torch.clamp(x, max=hi), _clamp_max)


# ---- Liger-Kernel's activations and norms ----------------------------------------------------------
def dyt(x: ExprLike, alpha: ExprLike, gamma: ExprLike, beta: ExprLike | None = None) -> Expr:
    """Dynamic tanh (a norm-free transformer's norm): ``gamma * tanh(alpha * x) + beta``.

    Example:
        >>> import rtxdsl as rx
        >>> rx.dyt(rx.var("x"), rx.var("a"), rx.var("g"), rx.var("b"))
        dyt(x, a, g, b)
    """
    return node("dyt", x, alpha, gamma, 0.0 if beta is None else beta)


_composite(
    "dyt",
    4,
    lambda x, a, g, b: g * torch.tanh(a * x) + b,
    lambda x, a, g, b: _affine(node("tanh", node("mul", a, x)), g, b),
    pattern=Pattern.ACTIVATION,
    accepts=FLOATING,
    eager_launches=3,
    front=Front(fn=dyt),
)


def relu_squared(x: ExprLike) -> Expr:
    """``relu(x) ** 2`` (Primer's ReLU²).

    Example:
        >>> import rtxdsl as rx
        >>> rx.relu_squared(rx.var("x"))
        relu_squared(x)
    """
    return node("relu_squared", x)


def _relu_squared(x: Expr) -> Expr:
    r = node("relu", x)
    return node("mul", r, r)


_composite(
    "relu_squared",
    1,
    lambda x: torch.relu(x) ** 2,
    _relu_squared,
    pattern=Pattern.ACTIVATION,
    accepts=FLOATING,
    eager_launches=2,
    front=Front(fn=relu_squared, names=("relu_squared", "relu2")),
)


def poly_norm(x: ExprLike, weight: ExprLike, bias: ExprLike, eps: float = 1e-6) -> Expr:
    """PolyNorm (PolyCom): ``w[0] * norm(x**3) + w[1] * norm(x**2) + w[2] * norm(x) + bias``, each
    ``norm`` an RMS normalization over the last axis; ``weight`` has 3 elements.

    Example:
        >>> import rtxdsl as rx
        >>> rx.poly_norm(rx.var("x"), rx.var("w"), rx.var("b"))
        poly_norm(x, w, b, 1e-06)
    """
    return node("poly_norm", x, weight, bias, scalar_arg(eps, "poly_norm", "eps"))


def _poly_norm(x: Expr, w: Expr, b: Expr, eps: Expr) -> Expr:
    x2 = node("mul", x, x)
    powers = (node("mul", x2, x), x2, x)
    out = b
    for k, u in enumerate(powers):
        rstd = node("rsqrt", node("add", mean_of(node("mul", u, u), (-1,), True), eps))
        out = node("add", out, node("mul", node("select", w, axis=0, index=k), node("mul", u, rstd)))
    return out


def _poly_norm_ref(x: torch.Tensor, w: torch.Tensor, b: Any, eps: float) -> torch.Tensor:
    """Liger's (and PolyCom's) PolyNorm, whose dtype is torch's: each ``w[k]`` is a 0-dim tensor, so
    it promotes with ``x`` by category only (bf16 ``x`` and fp32 weights give bf16, as Liger's kernel
    writes), as does a 0-dim or python-number bias; a ``[1]`` bias promotes as a tensor. Binding
    types the op by running this on one-element probes: the expand lets a probe's one weight stand
    for the three (a no-op on the real ``[3]`` weight)."""

    def norm(u: torch.Tensor) -> torch.Tensor:
        return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)

    w = w.expand(3)
    return w[0] * norm(x**3) + w[1] * norm(x**2) + w[2] * norm(x) + b


def _poly_norm_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    x, w = shapes[0], shapes[1]
    b = shapes[2] if len(shapes) > 2 else ()  # a python number bias has no shape
    if not x:
        raise ShapeError("poly_norm normalizes the last axis: a 0-dim input has none")
    if w != (3,):
        raise ShapeError(f"poly_norm: weight has shape {list(w)}; expected [3]")
    if math.prod(b) != 1:
        raise ShapeError(f"poly_norm: bias has shape {list(b)}; expected one element")
    return x


_composite(
    "poly_norm",
    4,
    _poly_norm_ref,
    _poly_norm,
    shape=_poly_norm_shape,
    pattern=Pattern.RMS_NORM,
    accepts=FLOATING,
    eager_launches=13,
    front=Front(fn=poly_norm),
)


# ---- group norm ------------------------------------------------------------------------------------
def group_norm(
    x: ExprLike, num_groups: int, weight: ExprLike | None = None, bias: ExprLike | None = None, eps: float = 1e-5
) -> Expr:
    """``F.group_norm``: ``x`` of shape ``[N, C, *]`` normalized over each group of ``C //
    num_groups`` channels (and all of ``*``), then ``* weight + bias`` per channel. One row
    kernel: the groups are rows of a reshape (index arithmetic, nothing copied).

    Example:
        >>> import rtxdsl as rx
        >>> rx.group_norm(rx.var("x"), 4, rx.var("w"), rx.var("b"))
        group_norm(x, w, b, 1e-05, num_groups=4)
    """
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups <= 0:
        raise RtxError(f"group_norm: num_groups must be a positive int, got {num_groups!r}")
    eps_ = scalar_arg(eps, "group_norm", "eps")
    return node(
        "group_norm", x, 1.0 if weight is None else weight, 0.0 if bias is None else bias, eps_, num_groups=num_groups
    )


def _group_norm_shape(shapes: list[tuple[int, ...]], num_groups: int) -> tuple[int, ...]:
    x = shapes[0]
    if len(x) < 2:
        raise ShapeError(f"group_norm: the input must be [N, C, *], got {list(x)}")
    if x[1] % num_groups:
        raise ShapeError(f"group_norm: {x[1]} channels do not split into {num_groups} groups")
    for s in shapes[1:]:
        if s and s != (x[1],):
            raise ShapeError(f"group_norm: weight / bias of shape {list(s)}; expected [{x[1]}]")
    return x


def _group_norm(x: Expr, w: Expr, b: Expr, eps: Expr, *, num_groups: int, shapes: list, dtypes: list) -> Expr:
    shape = shapes[0]
    group = math.prod(shape[1:]) // num_groups  # (not -1: an empty input's group size is no quotient)
    rows = node("reshape", x, shape=(shape[0], num_groups, group))
    centred, m2 = deviations(rows, (-1,))
    var = node("div", m2, node("rcount", rows, axis=(-1,)))
    y = node("reshape", node("mul", centred, node("rsqrt", node("add", var, eps))), shape=shape)
    per_channel = tuple(range(1, len(shape) - 1))  # [C] -> [C, 1, ...] against [N, C, *]

    def channel(v: Expr) -> Expr:
        return node("unsqueeze", v, axes=per_channel) if per_channel and not _is_const(v) else v

    return _affine(y, channel(w), channel(b))


def _is_const(v: Expr) -> bool:
    return v.op == "const"


def _group_norm_ref(x: torch.Tensor, w: Any, b: Any, eps: float, num_groups: int) -> torch.Tensor:
    channels = x.shape[1] if x.dim() > 1 else 1
    r = 2 * num_groups // channels if channels else 1
    if channels and math.prod(x.shape[2:]) == 1 and num_groups % channels == 0:
        # one value per group (eager raises "Expected more than 1 value per channel"), or binding's
        # one-element probe (one channel, read for torch's dtype and errors only): each channel is
        # repeated so a group holds two copies of its value, and the result read back at the
        # originals' channels is the kernel's, (x - mean) = 0 times the weight plus the bias
        x = x.repeat_interleave(r, 1)
        w, b = (v.repeat_interleave(r) if isinstance(v, torch.Tensor) and v.dim() else v for v in (w, b))
    y = F.group_norm(x, num_groups, _tensor_or_none(w), _tensor_or_none(b), eps)
    return _scalar_affine_ref(y[:, ::r] if y.shape[1] != channels else y, w, b)


def _torch_group_norm(a: Any, num_groups: int, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Expr:
    return group_norm(a, num_groups, weight, bias, eps)


register(
    OpDef(
        name="group_norm",
        kind=OpKind.COMPOSITE,
        arity=4,
        ref=_group_norm_ref,
        decompose=_group_norm,
        typed_decompose=True,
        shape=_group_norm_shape,
        eager_launches=1,
        pattern=Pattern.LAYER_NORM,
        accepts=FLOATING,
        front=Front(fn=group_norm, torch=dict.fromkeys(torch_fns("group_norm"), _torch_group_norm)),
    )
)


# ---- sparsemax ----------------------------------------------------------------------------------------
def sparsemax(x: ExprLike, axis: int | None = None, *, dim: int | None = None) -> Expr:
    """Sparsemax (Martins & Astudillo, 2016) over ``axis``: the Euclidean projection of ``x`` onto
    the probability simplex, ``relu(x - tau)`` with ``tau`` the threshold where the row sums to 1.

    One row kernel, no sort: ``tau`` is found by bisection on ``[max - 1, max]`` (``sum(relu(x -
    t))`` falls as ``t`` rises), one step per mantissa bit of the compute dtype, then computed
    exactly from the support it found, ``(sum of x over the support - 1) / its size``. The
    gradient follows from that last step: ``mask * (g - mean of g over the support)``.

    Example:
        >>> import rtxdsl as rx
        >>> rx.sparsemax(rx.var("x"))
        sparsemax(x, axis=-1)
    """
    return node("sparsemax", x, axis=int_axis(axis, dim, "sparsemax", -1))


def _sparsemax(x: Expr, axis: int, shapes: list, dtypes: list) -> Expr:
    ax = (axis,)
    z = node("detach", x)
    lo = node("sub", node("amax", z, axis=ax, keepdim=True), 1.0)
    bits = 53 if compute_dtype(dtypes[0]) == torch.float64 else 24  # the mantissa, implicit bit included
    for step in range(1, bits + 2):
        mid = node("add", lo, 0.5**step)
        mass = node("sum", node("relu", node("sub", z, mid)), axis=ax, keepdim=True)
        lo = node("where", node("ge", mass, 1.0), mid, lo)  # tau >= mid while the mass is >= 1
    support = node("gt", z, lo)
    size = node("sum", node("where", support, 1.0, 0.0), axis=ax, keepdim=True)
    total = node("sum", node("where", support, x, 0.0), axis=ax, keepdim=True)
    return node("relu", node("sub", x, node("div", node("sub", total, 1.0), size)))


def _sparsemax_ref(x: torch.Tensor, axis: int) -> torch.Tensor:
    """The sorting algorithm of the paper (as Liger's reference)."""
    if x.numel() == 0:
        return x.clone()
    z = x.movedim(axis, -1)
    srt = z.sort(-1, descending=True).values
    csum = srt.cumsum(-1) - 1
    k = torch.arange(1, z.shape[-1] + 1, dtype=z.dtype, device=z.device)
    size = (k * srt > csum).sum(-1, keepdim=True)
    tau = csum.gather(-1, size - 1) / size.to(z.dtype)
    return torch.clamp(z - tau, min=0).movedim(-1, axis)


register(
    OpDef(
        name="sparsemax",
        kind=OpKind.COMPOSITE,
        arity=1,
        ref=_sparsemax_ref,
        decompose=_sparsemax,
        typed_decompose=True,
        shape=_same_as_first,
        eager_launches=9,  # sort, cumsum, sub, mul, gt, sum, gather, div, clamp
        pattern=Pattern.SOFTMAX,
        accepts=FLOATING,
        front=Front(fn=sparsemax),
    )
)
