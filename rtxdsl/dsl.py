"""The user-facing DSL: symbolic inputs, op functions, operators and torch-named methods.

Functions are thin: each builds one registry op (``node``); their behaviour lives in
``rtxdsl/ops``. Operators and methods on :class:`Expr` are attached here from the same
functions, so an op has one spelling per surface and one definition.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from .dtypes import check_supported
from .errors import RtxError
from .expr import Expr, Scalar, as_expr, node
from .runtime import Kernel

ExprLike = Expr | Scalar


def var(name: str, dtype: torch.dtype | None = None) -> Expr:
    """A named symbolic input; its dtype and shape come from the tensor given at call time.

    Example:
        >>> import torch, rtxdsl as rx
        >>> x = rx.var("x", dtype=torch.float16)   # checked when the kernel is called
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise RtxError(f"input name must be a python identifier, got {name!r}")
    if dtype is not None:
        if not isinstance(dtype, torch.dtype):
            raise RtxError(f"input {name!r}: dtype must be a torch.dtype, got {dtype!r}")
        check_supported(dtype, f"input {name!r}")
    return Expr("var", (), {"name": name, "dtype": dtype})


def const(value: Scalar) -> Expr:
    """A python scalar constant (passed to kernels as an argument, never baked into source).

    Example:
        >>> import rtxdsl as rx
        >>> rx.const(2.0) * rx.var("x")
        2.0 * x
    """
    if not isinstance(value, (bool, int, float)):
        raise RtxError(f"const takes a python bool, int or float, got {type(value).__name__}")
    return as_expr(value)


def _unary(op: str, doc: str) -> Callable[[ExprLike], Expr]:
    def fn(x: ExprLike) -> Expr:
        return node(op, x)

    fn.__name__ = fn.__qualname__ = op
    fn.__doc__ = f"{doc}\n\nExample:\n    >>> import rtxdsl as rx\n    >>> rx.{op}(rx.var('x'))\n    {op}(x)\n"
    return fn


#: one-operand functions with no parameters: name -> what it computes
UNARY = {
    "exp": "e**x",
    "exp2": "2**x",
    "log": "natural log",
    "log2": "base-2 log",
    "log1p": "log(1 + x), accurate near 0",
    "expm1": "exp(x) - 1, accurate near 0",
    "sqrt": "square root",
    "rsqrt": "1 / sqrt(x)",
    "abs": "absolute value",
    "neg": "-x",
    "sign": "-1, 0 or 1 (0 for NaN, as torch)",
    "floor": "round down",
    "ceil": "round up",
    "round": "round half to even",
    "trunc": "round toward zero",
    "sin": "sine",
    "cos": "cosine",
    "tan": "tangent",
    "tanh": "hyperbolic tangent",
    "sigmoid": "1 / (1 + exp(-x))",
    "relu": "max(x, 0), NaN kept",
    "silu": "x * sigmoid(x)",
    "erf": "error function",
    "reciprocal": "1 / x",
}
for _op, _doc in UNARY.items():
    globals()[_op] = _unary(_op, _doc)


def _binary(op: str, doc: str) -> Callable[[ExprLike, ExprLike], Expr]:
    def fn(a: ExprLike, b: ExprLike) -> Expr:
        return node(op, a, b)

    fn.__name__ = fn.__qualname__ = op
    fn.__doc__ = (
        f"{doc}\n\nExample:\n    >>> import rtxdsl as rx\n    >>> rx.{op}(rx.var('a'), 0.0)\n    {op}(a, 0.0)\n"
    )
    return fn


maximum = _binary("maximum", "Elementwise max; NaN in either operand gives NaN (torch.maximum).")
minimum = _binary("minimum", "Elementwise min; NaN in either operand gives NaN (torch.minimum).")


def pow(x: ExprLike, exponent: ExprLike) -> Expr:  # noqa: A001
    """``x ** exponent`` with torch's rules for negative bases and zero exponents (float results).

    Example:
        >>> import rtxdsl as rx
        >>> rx.pow(rx.var("x"), 2)
        x ** 2
    """
    return node("pow", x, exponent)


def where(cond: ExprLike, a: ExprLike, b: ExprLike) -> Expr:
    """``a`` where ``cond`` is true, else ``b`` (cond must be bool).

    Example:
        >>> import rtxdsl as rx
        >>> x = rx.var("x"); rx.where(x > 0, x, 0.0)
        where(x > 0, x, 0.0)
    """
    return node("where", cond, a, b)


def cast(x: ExprLike, dtype: torch.dtype) -> Expr:
    """Convert to ``dtype`` (same as ``x.to(dtype)``); half types round as torch does.

    Example:
        >>> import torch, rtxdsl as rx
        >>> rx.cast(rx.var("x"), torch.float16)
        cast(x, dtype=float16)
    """
    if not isinstance(dtype, torch.dtype):
        raise RtxError(f"cast: dtype must be a torch.dtype, got {dtype!r}")
    check_supported(dtype, "cast target")
    return node("cast", x, dtype=dtype)


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


def gelu(x: ExprLike, approximate: str = "none") -> Expr:
    """Gaussian error linear unit; ``approximate="tanh"`` for the tanh form (torch's F.gelu).

    Example:
        >>> import rtxdsl as rx
        >>> rx.gelu(rx.var("x") + rx.var("b"))
        gelu(x + b, approximate='none')
    """
    if approximate not in ("none", "tanh"):
        raise RtxError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return node("gelu", x, approximate=approximate)


def leaky_relu(x: ExprLike, negative_slope: float = 0.01) -> Expr:
    """``x`` if positive else ``x * negative_slope``.

    Example:
        >>> import rtxdsl as rx
        >>> rx.leaky_relu(rx.var("x"), 0.2)
        leaky_relu(x, 0.2)
    """
    return node("leaky_relu", x, _scalar(negative_slope, "leaky_relu", "negative_slope"))


def elu(x: ExprLike, alpha: float = 1.0) -> Expr:
    """``x`` if positive else ``alpha * (exp(x) - 1)``.

    Example:
        >>> import rtxdsl as rx
        >>> rx.elu(rx.var("x"))
        elu(x, 1.0)
    """
    return node("elu", x, _scalar(alpha, "elu", "alpha"))


def softplus(x: ExprLike, beta: float = 1.0, threshold: float = 20.0) -> Expr:
    """``log(1 + exp(beta * x)) / beta``, linear above ``threshold`` (torch's F.softplus).

    Example:
        >>> import rtxdsl as rx
        >>> rx.softplus(rx.var("x"))
        softplus(x, 1.0, 20.0)
    """
    return node("softplus", x, _scalar(beta, "softplus", "beta"), _scalar(threshold, "softplus", "threshold"))


def _scalar(v: Any, op: str, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RtxError(f"{op}: {name} must be a python number, got {v!r}")
    return float(v)


# ---- reductions ------------------------------------------------------------------------
def _axis(axis: Any, dim: Any, op: str) -> int | tuple[int, ...] | None:
    if dim is not None:
        if axis is not None:
            raise RtxError(f"{op}: give axis or dim, not both")
        axis = dim
    if axis is None:
        return None
    if isinstance(axis, bool) or not isinstance(axis, (int, tuple, list)):
        raise RtxError(f"{op}: axis must be None, an int or a tuple of ints, got {axis!r}")
    if isinstance(axis, (tuple, list)):
        if not all(isinstance(a, int) and not isinstance(a, bool) for a in axis) or not axis:
            raise RtxError(f"{op}: axis must be a non-empty tuple of ints, got {axis!r}")
        return tuple(axis)
    return axis


def _reduction(op: str, doc: str) -> Callable[..., Expr]:
    def fn(x: ExprLike, axis: Any = None, keepdim: bool = False, *, dim: Any = None) -> Expr:
        return node(op, x, axis=_axis(axis, dim, op), keepdim=bool(keepdim))

    fn.__name__ = fn.__qualname__ = op
    fn.__doc__ = (
        f"{doc} over ``axis`` (None: all), keeping reduced dims as size 1 if ``keepdim``.\n\n"
        f"Example:\n    >>> import rtxdsl as rx\n    >>> rx.{op}(rx.var('x'), axis=-1)\n"
        f"    {op}(x, axis=-1, keepdim=False)\n"
    )
    return fn


sum = _reduction("sum", "Sum (ints accumulate in int64, half types in fp32)")  # noqa: A001
mean = _reduction("mean", "Mean")
amax = _reduction("amax", "Maximum (NaN wins)")
amin = _reduction("amin", "Minimum (NaN wins)")
max = _reduction("amax", "Maximum (NaN wins); values only, like torch.amax")  # noqa: A001
min = _reduction("amin", "Minimum (NaN wins); values only, like torch.amin")  # noqa: A001
logsumexp = _reduction("logsumexp", "log(sum(exp(x))), computed stably")


def _spread(op: str, doc: str) -> Callable[..., Expr]:
    def fn(x: ExprLike, axis: Any = None, keepdim: bool = False, *, correction: int = 1, dim: Any = None) -> Expr:
        if isinstance(correction, bool) or not isinstance(correction, (int, float)):
            raise RtxError(f"{op}: correction must be a number, got {correction!r}")
        return node(op, x, correction, axis=_axis(axis, dim, op), keepdim=bool(keepdim))

    fn.__name__ = fn.__qualname__ = op
    fn.__doc__ = (
        f"{doc} over ``axis`` with ``correction`` (1: Bessel's), computed in two passes.\n\n"
        f"Example:\n    >>> import rtxdsl as rx\n    >>> rx.{op}(rx.var('x'), axis=-1)\n"
        f"    {op}(x, 1, axis=-1, keepdim=False)\n"
    )
    return fn


variance = _spread("variance", "Variance")
std = _spread("std", "Standard deviation")


# ---- composites ----------------------------------------------------------------------
def _dim_axis(axis: int, dim: int | None, op: str) -> int:
    a = _axis(axis if dim is None else None, dim, op)
    if not isinstance(a, int):
        raise RtxError(f"{op}: axis must be an int, got {a!r}")
    return a


def softmax(x: ExprLike, axis: int = -1, *, dim: int | None = None) -> Expr:
    """exp(x - max) / sum(exp(x - max)) over ``axis``: one kernel, minimum bytes.

    Example:
        >>> import rtxdsl as rx
        >>> rx.softmax(rx.var("x") * 0.125)
        softmax(x * 0.125, axis=-1)
    """
    return node("softmax", x, axis=_dim_axis(axis, dim, "softmax"))


def log_softmax(x: ExprLike, axis: int = -1, *, dim: int | None = None) -> Expr:
    """x - max - log(sum(exp(x - max))) over ``axis``.

    Example:
        >>> import rtxdsl as rx
        >>> rx.log_softmax(rx.var("x"))
        log_softmax(x, axis=-1)
    """
    return node("log_softmax", x, axis=_dim_axis(axis, dim, "log_softmax"))


def layer_norm(x: ExprLike, weight: ExprLike | None = None, bias: ExprLike | None = None, eps: float = 1e-5) -> Expr:
    """Layer norm over the last axis (two-pass variance), then ``* weight + bias``.

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
        _scalar(eps, "layer_norm", "eps"),
    )


def rms_norm(x: ExprLike, weight: ExprLike | None = None, eps: float = 1e-6) -> Expr:
    """x * rsqrt(mean(x**2, -1) + eps) * weight (the seed's rms_norm_cpu semantics).

    Example:
        >>> import rtxdsl as rx
        >>> rx.rms_norm(rx.var("x"), rx.var("w"))
        rms_norm(x, w, 1e-06)
    """
    return node("rms_norm", x, 1.0 if weight is None else weight, _scalar(eps, "rms_norm", "eps"))


def swiglu(gate: ExprLike, up: ExprLike) -> Expr:
    """silu(gate) * up.

    Example:
        >>> import rtxdsl as rx
        >>> rx.swiglu(rx.var("g"), rx.var("u"))
        swiglu(g, u)
    """
    return node("swiglu", gate, up)


# ---- compile helpers -----------------------------------------------------------------
def fuse(fn: Callable[..., Any] | None = None, *, config: Any = None) -> Any:
    """Decorator: parameters become vars by name; the result is a kernel called with tensors.

    Example:
        >>> import torch, rtxdsl as rx
        >>> @rx.fuse
        ... def bias_gelu(x, b):
        ...     return rx.gelu(x + b)
        >>> bias_gelu(torch.zeros(4), torch.zeros(4)).shape
        torch.Size([4])
    """

    def wrap(f: Callable[..., Any]) -> Kernel:
        params = inspect.signature(f).parameters
        for p in params.values():
            if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                raise RtxError(f"@fuse {f.__name__}: parameter {p.name!r} must be a plain named parameter")
        out = f(*[var(p) for p in params])
        kernel = Kernel(out, config)
        missing = [p for p in params if p not in kernel.inputs]
        if missing:
            raise RtxError(f"@fuse {f.__name__}: parameter {missing[0]!r} is not used by the expression")
        kernel.inputs = tuple(params)  # positional order follows the signature
        kernel._vars = tuple(next(v for v in kernel._vars if v.attr("name") == p) for p in params)
        kernel._index = {n: i for i, n in enumerate(kernel.inputs)}
        functools.update_wrapper(kernel, f)  # type: ignore[arg-type]
        return kernel

    return wrap(fn) if fn is not None else wrap


# ---- operators and methods on Expr ---------------------------------------------------
def _install() -> None:
    binops = {
        "add": "add",
        "sub": "sub",
        "mul": "mul",
        "truediv": "div",
        "floordiv": "floordiv",
        "mod": "remainder",
        "pow": "pow",
        "and": "and",
        "or": "or",
        "xor": "xor",
    }
    for dunder, op in binops.items():
        setattr(Expr, f"__{dunder}__", (lambda o: lambda a, b: node(o, a, b))(op))
        setattr(Expr, f"__r{dunder}__", (lambda o: lambda a, b: node(o, b, a))(op))
    for dunder, op in {"lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne"}.items():
        setattr(Expr, f"__{dunder}__", (lambda o: lambda a, b: node(o, a, b))(op))
    Expr.__neg__ = lambda a: node("neg", a)  # type: ignore[method-assign]
    Expr.__pos__ = lambda a: a  # type: ignore[method-assign]
    Expr.__abs__ = lambda a: node("abs", a)  # type: ignore[method-assign]
    Expr.__invert__ = lambda a: node("invert", a)  # type: ignore[method-assign]
    g = globals()
    for name in [
        *UNARY,
        "maximum",
        "minimum",
        "pow",
        "clamp",
        "sum",
        "mean",
        "amax",
        "amin",
        "max",
        "min",
        "logsumexp",
        "std",
        "softmax",
        "log_softmax",
    ]:
        setattr(Expr, name, g[name])
    Expr.var = variance  # type: ignore[attr-defined]  # torch's Tensor.var
    Expr.to = cast  # type: ignore[attr-defined]
    Expr.where = lambda self, cond, other: where(cond, self, other)  # type: ignore[attr-defined]
    Expr.gelu = gelu  # type: ignore[attr-defined]


_install()
