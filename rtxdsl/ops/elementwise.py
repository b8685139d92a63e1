"""Elementwise ops: reference, emitter, derivative and every way users reach them, one
declaration each.

Emitters receive operand names already cast to the compute dtype (``ctx.dtype``) and
return one Triton expression. They use only core ``tl`` ops (no libdevice, no nested
``@triton.jit`` helpers), so the same source runs compiled and under the interpreter.
Derivative rules are written in DSL ops (see :class:`~rtxdsl.ops.helpers.D`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..dtypes import TRITON_TYPE, check_supported
from ..errors import RtxError
from ..expr import Expr, node
from ..registry import (
    ANY,
    FLOATING,
    INTEGRAL,
    NUMERIC,
    DtypeRule,
    EmitCtx,
    Front,
    OpDef,
    OpKind,
    Pattern,
    Unsupported,
    as_tensors,
    register,
)
from .helpers import D, ExprLike, binary_fn, no_grad, scalar_arg, torch_fns, unary_fn, zeros_like


def _ew(
    name: str,
    arity: int,
    ref: Callable[..., Any],
    emit: Callable[..., str],
    derivative: Callable[[D], tuple] | None,
    *,
    front: Front | None = None,
    accepts=ANY,
    results=ANY,
    rule=DtypeRule.PROMOTE,
    symbol: str | None = None,
    precedence: int = 10,
    pattern: Pattern | None = None,
    eager_launches: int = 1,
    cost: int = 1,
    divisor_operand: int | None = None,
) -> OpDef:
    return register(
        OpDef(
            name=name,
            kind=OpKind.ELEMENTWISE,
            cost=cost,
            arity=arity,
            ref=ref,
            emit=emit,
            derivative=derivative,
            eager_launches=eager_launches,
            rule=rule,
            accepts=accepts,
            results=results,
            symbol=symbol,
            precedence=precedence,
            pattern=pattern,
            divisor_operand=divisor_operand,
            front=front or Front(),
        )
    )


def _binary_ref(fn: Callable[..., Any], scalar_second: bool = True) -> Callable[..., Any]:
    """torch's binary function; a python scalar first operand becomes a 0-dim tensor (same promotion).
    With ``scalar_second`` a python scalar second operand stays a scalar, so torch's own scalar
    rules and errors apply (``int_tensor ** -1``); otherwise it becomes a 0-dim tensor too."""

    def ref(a: Any, b: Any) -> Any:
        if not scalar_second:
            return fn(*as_tensors(a, b))
        if not isinstance(a, torch.Tensor):
            a = as_tensors(a, b)[0]
        return fn(a, b)

    return ref


def _float_only(ctx: EmitCtx, a: str, expr: str) -> str:
    """``expr`` for float operands; integers and bools are already integral."""
    return expr if ctx.is_float else a


def _scaled(b: Any, alpha: Any) -> Any:
    return b if alpha == 1 else b * alpha


# ---- source-text helpers shared by several emitters (not ops) -----------------------------
# Conditions combine through nested tl.where, never & or |: Triton's interpreter mistypes the
# comparison results of 0-dim values, and & / | between them then fails.
def both(a: str, b: str) -> str:
    return f"tl.where({a}, {b}, False)"


def either(a: str, b: str) -> str:
    return f"tl.where({a}, True, {b})"


def nan_max(a: str, b: str) -> str:
    """torch.maximum: NaN in either operand wins (nested where: no ``|`` of mixed operand types)."""
    return f"tl.where({a} != {a}, {a}, tl.where({a} > {b}, {a}, {b}))"


def nan_min(a: str, b: str) -> str:
    return f"tl.where({a} != {a}, {a}, tl.where({a} < {b}, {a}, {b}))"


def _expm1(ctx: EmitCtx, a: str) -> str:
    # exp(x) - 1 cancels near 0: a Taylor polynomial is exact to fp32 there.
    poly = f"{a} * (1.0 + {a} * (0.5 + {a} * (1.0 / 6.0 + {a} * (1.0 / 24.0 + {a} * (1.0 / 120.0 + {a} / 720.0)))))"
    return f"tl.where(tl.abs({a}) < 0.03125, {poly}, tl.exp({a}) - 1.0)"


def _log1p(ctx: EmitCtx, a: str) -> str:
    # Goldberg's trick: log(u) * x / (u - 1) with u = 1 + x is accurate for small x.
    u = ctx.tmp(f"1.0 + {a}")
    return f"tl.where({u} == 1.0, {a}, tl.where({a} == float('inf'), {a}, tl.log({u}) * ({a} / ({u} - 1.0))))"


#: tanh's Taylor coefficients (of x, x**3, ...): below |x| = 1/8 each term is under 0.0063 of the
#: one before, so 4 terms leave float32's rounding and 8 float64's
TANH_SERIES = ("1.0", "-1.0 / 3.0", "2.0 / 15.0", "-17.0 / 315.0", "62.0 / 2835.0", "-1382.0 / 155925.0",
               "21844.0 / 6081075.0", "-929569.0 / 638512875.0")  # fmt: skip


def tanh_text(ctx: EmitCtx, a: str) -> str:
    t = ctx.tmp(f"tl.exp(-2.0 * tl.abs({a}))")
    big = f"tl.where({a} < 0, -1.0, 1.0) * ((1.0 - {t}) / (1.0 + {t}))"
    a2 = ctx.tmp(f"{a} * {a}")
    terms = TANH_SERIES if ctx.dtype is torch.float64 else TANH_SERIES[:4]
    poly = terms[-1]
    for c in reversed(terms[:-1]):  # Horner
        poly = f"({c} + {a2} * {poly})"
    return f"tl.where(tl.abs({a}) < 0.125, {a} * {poly}, {big})"


def _round(ctx: EmitCtx, a: str) -> str:
    # round half to even, as torch.round; values beyond 2**mantissa are integers already
    limit = "4503599627370496.0" if ctx.dtype is torch.float64 else "8388608.0"
    r = ctx.tmp(f"tl.floor({a} + 0.5)")
    even = ctx.tmp(f"tl.where({r} - {a} == 0.5, tl.where({r} - 2.0 * tl.floor({r} * 0.5) != 0.0, {r} - 1.0, {r}), {r})")
    # a zero keeps the operand's sign, as C's rint: round(-0.3) is -0.0 (floor(0.2) gave +0.0)
    fixed = f"tl.where({even} == 0.0, {a} * 0.0, {even})"
    return f"tl.where(tl.abs({a}) >= {limit}, {a}, {fixed})"


def _pow(ctx: EmitCtx, a: str, b: str) -> str:
    if not ctx.is_float:
        return _int_pow(ctx, a, b)
    # |a|**b through exp2/log2, then C pow's special values (torch.pow): the sign of odd integer
    # powers of negative bases (-0 and -inf included), NaN for negative bases to non-integers,
    # 1 for b == 0, a == 1 and (-1)**inf. Nested where rather than & / | of mixed operands.
    inf = "float('inf')"
    if ctx.dtype == torch.float64:
        mag = ctx.tmp(f"tl.exp2({b} * tl.log2(tl.abs({a})))")
    else:  # b * log2|a| in float64: float32's rounding of it is amplified by exp2 (torch's pow is exact)
        log_a = ctx.tmp(f"tl.log2(tl.abs({a}).to(tl.float64))")
        wide = f"tl.exp2((tl.zeros_like({log_a}) + {b}) * {log_a})"  # b may be a literal
        mag = ctx.tmp(f"({wide}).to({TRITON_TYPE[ctx.dtype]})")
    is_int = ctx.tmp(f"tl.floor({b}) == {b}")
    odd = ctx.tmp(f"tl.where({is_int}, tl.floor({b} * 0.5) * 2.0 != {b}, {is_int})")
    negative = ctx.tmp(f"tl.where({a} == 0, 1.0 / {a} < 0, {a} < 0)")  # -0 counts as negative
    signed = ctx.tmp(f"tl.where({odd}, -{mag}, {mag})")
    non_int = f"tl.where({a} == 0, {mag}, tl.where({a} == -{inf}, {mag}, float('nan')))"
    general = ctx.tmp(f"tl.where({negative}, tl.where({is_int}, {signed}, {non_int}), {mag})")
    minus_one = f"tl.where(tl.abs({b}) == {inf}, 1.0, {general})"
    return f"tl.where({b} == 0.0, 1.0, tl.where({a} == 1.0, 1.0, tl.where({a} == -1.0, {minus_one}, {general})))"


INT_POW = """\
@triton.jit
def rx_int_pow(a, b):
    # exact integer powers by squaring over every exponent bit, wrapping like torch;
    # negative exponents give 1 for a base of 1, +-1 for -1 and 0 otherwise
    acc = a * 0 + 1
    base = a
    e = tl.where(b < 0, b * 0, b)
    for _ in range(64):
        acc = tl.where((e & 1) != 0, acc * base, acc)
        base = base * base
        e = e >> 1
    odd = (b & 1) != 0
    negative = tl.where(a == 1, a * 0 + 1, tl.where(a == -1, tl.where(odd, a * 0 - 1, a * 0 + 1), a * 0))
    return tl.where(b < 0, negative, acc)
"""


def _int_pow(ctx: EmitCtx, a: str, b: str) -> str:
    return f"{ctx.helper('rx_int_pow', INT_POW)}({a}, {b})"


def _floordiv(ctx: EmitCtx, a: str, b: str) -> str:
    if not ctx.is_float:
        q = ctx.tmp(f"{a} // {b}")
        return f"tl.where({both(f'({a} % {b}) != 0', f'({a} < 0) != ({b} < 0)')}, {q} - 1, {q})"
    # ATen's div_floor_floating
    mod = ctx.tmp(f"tl.where({b} == 0, {a} * 0.0, {a} % {b})")
    div = ctx.tmp(f"({a} - {mod}) / {b}")
    div = ctx.tmp(f"tl.where({both(f'{mod} != 0', f'({b} < 0) != ({mod} < 0)')}, {div} - 1.0, {div})")
    fl = ctx.tmp(f"tl.floor({div})")
    fl = ctx.tmp(f"tl.where({div} - {fl} > 0.5, {fl} + 1.0, {fl})")
    signed_zero = f"tl.where(({a} < 0) != ({b} < 0), -0.0, 0.0)"
    return f"tl.where({b} == 0, {a} / {b}, tl.where({div} != 0, {fl}, {signed_zero}))"


def _remainder(ctx: EmitCtx, a: str, b: str) -> str:
    r = ctx.tmp(f"{a} % {b}")  # fmod for floats (sign of a), then shifted to the sign of b
    return f"tl.where({both(f'{r} != 0', f'({r} < 0) != ({b} < 0)')}, {r} + {b}, {r})"


def to_storage(a: str, have: torch.dtype, want: torch.dtype) -> str:
    """Convert a computed value to a storage dtype, rounding to nearest even as torch does (a
    plain cast: a GPU's rounds so, and rtxdsl's interpreter fix makes the interpreter's bf16 cast
    round so too, ``interpret.install``)."""
    if want is torch.bool:
        return a if have is torch.bool else f"{a} != 0"
    if have == want:
        return a
    if want is torch.bfloat16 and have is torch.float64:
        return f"{a}.to(tl.float32).to(tl.bfloat16)"
    return f"{a}.to({TRITON_TYPE[want]})"


def _cast(ctx: EmitCtx, a: str) -> str:
    """The value in the target's compute dtype: half targets round as asked, then compute in fp32."""
    target: torch.dtype = ctx.attrs["dtype"]
    if target in (torch.float16, torch.bfloat16):
        have = ctx.dtype if ctx.dtype.is_floating_point else torch.float32
        src = a if ctx.dtype.is_floating_point else f"{a}.to(tl.float32)"
        return f"{to_storage(src, have, target)}.to(tl.float32)"
    return to_storage(a, ctx.dtype, target)


def _bool_or(on_bools: Callable[[str, str], str], op: str) -> Callable[..., str]:
    return lambda ctx, a, b: on_bools(a, b) if ctx.is_bool else f"{a} {op} {b}"


def _zero(d: D) -> tuple:
    """Piecewise constant (floor, sign, floordiv...): torch's zeros_like(grad), even where the
    cotangent is inf or NaN (``g * 0`` would be NaN there)."""
    return tuple(zeros_like(d.g) for _ in d.srcs)


# ---- arithmetic ------------------------------------------------------------------------------
_ew(
    "add",
    2,
    _binary_ref(torch.add),
    _bool_or(either, "+"),
    lambda d: (d.g, d.g),
    accepts=ANY,
    symbol="+",
    precedence=5,
    front=Front(
        fn=binary_fn("add", "a + b", "a + b"),
        operators=("__add__", "__radd__"),
        torch={
            **{f: (lambda a, b, *, alpha=1: node("add", a, _scaled(b, alpha))) for f in torch_fns("add", "__add__")},
            torch.Tensor.__radd__: lambda a, b: node("add", b, a),
        },
        inplace=(torch.Tensor.add_, torch.Tensor.__iadd__),
        cpu_rounds_numbers=True,
    ),
)
_ew(
    "sub",
    2,
    _binary_ref(torch.sub),
    lambda c, a, b: f"{a} - {b}",
    lambda d: (d.g, node("neg", d.g)),
    symbol="-",
    precedence=5,
    front=Front(
        fn=binary_fn("sub", "a - b", "a - b"),
        operators=("__sub__", "__rsub__"),
        torch={
            **{
                f: (lambda a, b, *, alpha=1: node("sub", a, _scaled(b, alpha)))
                for f in torch_fns("sub", "subtract", "__sub__")
            },
            torch.Tensor.__rsub__: lambda a, b: node("sub", b, a),
            torch.rsub: lambda a, b, *, alpha=1: node("sub", b, _scaled(a, alpha)),
        },
        inplace=(torch.Tensor.sub_, torch.Tensor.__isub__),
        cpu_rounds_numbers=True,
    ),
)
_ew(
    "mul",
    2,
    _binary_ref(torch.mul),
    _bool_or(both, "*"),
    lambda d: (node("mul", d.g, d.b), node("mul", d.g, d.a)),
    accepts=ANY,
    symbol="*",
    precedence=6,
    front=Front(
        fn=binary_fn("mul", "a * b", "a * b"),
        operators=("__mul__", "__rmul__"),
        torch={
            **{f: (lambda a, b: node("mul", a, b)) for f in torch_fns("mul", "multiply", "__mul__")},
            torch.Tensor.__rmul__: lambda a, b: node("mul", b, a),
        },
        inplace=(torch.Tensor.mul_, torch.Tensor.__imul__),
    ),
)


def _div_builder(a: Any, b: Any, *, rounding_mode: str | None = None) -> Expr:
    if rounding_mode is None:
        return node("div", a, b)
    if rounding_mode == "floor":
        return node("floordiv", a, b)
    raise Unsupported


_ew(
    "div",
    2,
    _binary_ref(torch.true_divide),
    lambda c, a, b: f"{a} / {b}",
    lambda d: (node("div", d.g, d.b), node("neg", node("div", node("mul", d.g, d.y), d.b))),
    symbol="/",
    precedence=6,
    front=Front(
        fn=binary_fn("div", "a / b (true division: integers give floats)", "a / b"),
        operators=("__truediv__", "__rtruediv__"),
        torch={
            **dict.fromkeys(torch_fns("div", "divide", "true_divide", "__truediv__"), _div_builder),
            torch.Tensor.__rtruediv__: lambda a, b: node("div", b, a),
        },
        inplace=(torch.Tensor.div_, torch.Tensor.__itruediv__),
    ),
)
_ew(
    "floordiv",
    2,
    _binary_ref(torch.floor_divide),
    _floordiv,
    _zero,
    symbol="//",
    precedence=6,
    divisor_operand=1,
    front=Front(
        fn=binary_fn("floordiv", "a // b, rounding toward -inf (torch.floor_divide)", "a // b"),
        operators=("__floordiv__", "__rfloordiv__"),
        torch={
            **{f: (lambda a, b: a // b) for f in torch_fns("floor_divide", "__floordiv__")},
            torch.Tensor.__rfloordiv__: lambda a, b: b // a,
        },
    ),
)
_ew(
    "remainder",
    2,
    _binary_ref(torch.remainder),
    _remainder,
    lambda d: (d.g, node("neg", node("mul", d.g, node("floordiv", d.a, d.b)))),
    symbol="%",
    precedence=6,
    divisor_operand=1,
    front=Front(
        fn=binary_fn("remainder", "a % b with the sign of b (torch.remainder)", "a % b"),
        operators=("__mod__", "__rmod__"),
        torch={
            **{f: (lambda a, b: a % b) for f in torch_fns("remainder", "__mod__")},
            torch.Tensor.__rmod__: lambda a, b: b % a,
        },
        cpu_rounds_numbers=True,
    ),
)


def _pow_derivative(d: D) -> tuple:
    a, b = d.a, d.b
    ga = node("mul", d.g, node("mul", b, node("pow", a, node("sub", b, 1))))
    ga = node("where", node("eq", b, 0), 0.0, ga)  # d/da a**0 is 0 (torch's where), even at a = 0 or g = inf
    zero_base = node("and", node("eq", a, 0), node("ge", b, 0))
    gb = node("mul", d.g, node("where", zero_base, 0.0, node("mul", d.y, node("log", a))))
    return (ga, gb)


def _pow_fn(x: ExprLike, exponent: ExprLike) -> Expr:
    """``x ** exponent`` with torch's special values; integer powers are exact.

    Example:
        >>> import rtxdsl as rx
        >>> rx.pow(rx.var("x"), 2)
        x ** 2
    """
    if type(exponent) in (int, float) and abs(exponent) == 0.5:  # torch's kernel for a number ±0.5:
        return node("sqrt" if exponent > 0 else "rsqrt", x)  # sqrt(-0) = -0, sqrt(-inf) = NaN (C pow: +0, +inf)
    return node("pow", x, exponent)


_pow_fn.__name__ = _pow_fn.__qualname__ = "pow"
_ew(
    "pow",
    2,
    _binary_ref(torch.pow),
    _pow,
    _pow_derivative,
    symbol="**",
    precedence=8,
    front=Front(
        fn=_pow_fn,
        operators=("__pow__", "__rpow__"),
        methods={"pow": None},
        torch={
            **{f: (lambda a, b: a**b) for f in torch_fns("pow", "__pow__")},
            torch.Tensor.__rpow__: lambda a, b: b**a,
        },
        inplace=(torch.Tensor.pow_, torch.Tensor.__ipow__),
        cpu_rounds_numbers=True,
    ),
)


def _split_ties(d: D, loses: str) -> tuple:
    """torch.maximum/minimum: ``where(a == b, g / 2, g).masked_fill_(a loses, 0)`` for each
    operand: the winner's cotangent, halved on ties, exactly 0 for the loser (even an inf one);
    a NaN operand loses to nothing, so both get the whole cotangent."""
    half = node("mul", d.g, 0.5)
    tie = node("eq", d.a, d.b)
    ga = node("where", tie, half, node("where", node(loses, d.a, d.b), 0.0, d.g))
    gb = node("where", tie, half, node("where", node(loses, d.b, d.a), 0.0, d.g))
    return (ga, gb)


def _extreme(name: str, nan_pick: Callable[[str, str], str], loses: str) -> OpDef:
    int_fn, on_bools = ("tl.maximum", either) if name == "maximum" else ("tl.minimum", both)

    def emit(c: EmitCtx, a: str, b: str) -> str:
        if c.is_float:
            return nan_pick(a, b)
        return on_bools(a, b) if c.is_bool else f"{int_fn}({a}, {b})"

    return _ew(
        name,
        2,
        _binary_ref(getattr(torch, name), scalar_second=False),
        emit,
        lambda d: _split_ties(d, loses),
        accepts=ANY,
        front=Front(
            fn=binary_fn(name, f"Elementwise {name[:3]}; NaN in either operand gives NaN (torch.{name})."),
            methods={name: None},
            torch=dict.fromkeys(torch_fns(name), lambda a, b: node(name, a, b)),
        ),
    )


_extreme("maximum", nan_max, "lt")
_extreme("minimum", nan_min, "gt")

_ew(
    "neg",
    1,
    torch.neg,
    lambda c, a: f"-{a}",
    lambda d: (node("neg", d.g),),
    symbol="-",
    precedence=7,
    front=Front(
        fn=unary_fn("neg", "-x"),
        operators=("__neg__",),
        methods={"neg": None},
        torch={f: (lambda a: node("neg", a)) for f in torch_fns("neg", "negative", "__neg__")},
        inplace=(torch.Tensor.neg_,),
    ),
)
_ew(
    "abs",
    1,
    torch.abs,
    lambda c, a: f"tl.abs({a})" if c.dtype is not torch.bool else a,
    lambda d: (node("mul", d.g, node("sign", d.a)),),
    accepts=NUMERIC,
    front=Front(
        fn=unary_fn("abs", "absolute value"),
        operators=("__abs__",),
        methods={"abs": None},
        torch={f: (lambda a: node("abs", a)) for f in torch_fns("abs", "__abs__")},
        inplace=(torch.Tensor.abs_,),
    ),
)
_ew(
    "sign",
    1,
    torch.sign,
    lambda c, a: a if c.is_bool else f"(({a} > 0).to({TRITON_TYPE[c.dtype]}) - ({a} < 0).to({TRITON_TYPE[c.dtype]}))",
    _zero,
    accepts=ANY,
    front=Front(
        fn=unary_fn("sign", "-1, 0 or 1 (0 for 0 and for NaN, as torch)"),
        methods={"sign": None},
        torch={f: (lambda a: node("sign", a)) for f in torch_fns("sign")},
    ),
)
_ew(
    "reciprocal",
    1,
    torch.reciprocal,
    lambda c, a: f"1.0 / {a}",
    lambda d: (node("neg", node("mul", d.g, node("mul", d.y, d.y))),),
    front=Front(
        fn=unary_fn("reciprocal", "1 / x"),
        methods={"reciprocal": None},
        torch={f: (lambda a: node("reciprocal", a)) for f in torch_fns("reciprocal")},
        inplace=(torch.Tensor.reciprocal_,),
    ),
)


# ---- math functions of one operand (integer inputs compute in float, as torch) ----------------
def _math(
    name: str,
    emit: Callable[..., str],
    derivative: Callable[[D], tuple] | None,
    text: str,
    *,
    ref: Callable[..., Any] | None = None,
    accepts=ANY,
    pattern: Pattern | None = None,
    functional: bool = False,
    cost: int = 4,
) -> OpDef:
    torch_names = torch_fns(name) if not functional else [getattr(F, name)]
    inplace = getattr(torch.Tensor, f"{name}_", None)
    return _ew(
        name,
        1,
        ref or getattr(torch, name, None) or getattr(F, name),
        emit,
        derivative,
        accepts=accepts,
        pattern=pattern,
        cost=cost,
        front=Front(
            fn=unary_fn(name, text),
            methods={name: None},
            torch={f: (lambda a, inplace=False: _raise() if inplace else node(name, a)) for f in torch_names},
            inplace=(inplace,) if inplace is not None else (),
        ),
    )


_math("floor", lambda c, a: _float_only(c, a, f"tl.floor({a})"), _zero, "round down", cost=1)
_math("ceil", lambda c, a: _float_only(c, a, f"tl.ceil({a})"), _zero, "round up", cost=1)
_math(
    "trunc",
    lambda c, a: _float_only(c, a, f"tl.where({a} < 0, tl.ceil({a}), tl.floor({a}))"),
    _zero,
    "toward 0",
    cost=1,
)
_ew(
    "round",
    1,
    torch.round,
    lambda c, a: _float_only(c, a, _round(c, a)),
    _zero,
    front=Front(
        fn=unary_fn("round", "round half to even"),
        methods={"round": None},
        torch={
            f: (lambda a, *, decimals=0: node("round", a) if decimals == 0 else _raise()) for f in torch_fns("round")
        },
        inplace=(torch.Tensor.round_,),
    ),
)


def _raise() -> Expr:
    raise Unsupported


_math("exp", lambda c, a: f"tl.exp({a})", lambda d: (node("mul", d.g, d.y),), "e**x")
_math("exp2", lambda c, a: f"tl.exp2({a})", lambda d: (node("mul", d.g, node("mul", d.y, math.log(2))),), "2**x")
_math("expm1", _expm1, lambda d: (node("mul", d.g, node("add", d.y, 1.0)),), "exp(x) - 1, accurate near 0")
_math("log", lambda c, a: f"tl.log({a})", lambda d: (node("div", d.g, d.a),), "natural log")
_math("log2", lambda c, a: f"tl.log2({a})", lambda d: (node("div", d.g, node("mul", d.a, math.log(2))),), "base-2 log")
_math("log1p", _log1p, lambda d: (node("div", d.g, node("add", d.a, 1.0)),), "log(1 + x), accurate near 0")
_math("sqrt", lambda c, a: f"tl.sqrt({a})", lambda d: (node("div", node("mul", d.g, 0.5), d.y),), "square root")
_math(
    "rsqrt",
    lambda c, a: f"tl.rsqrt({a})",
    lambda d: (node("mul", node("mul", d.g, -0.5), node("mul", d.y, node("mul", d.y, d.y))),),
    "1 / sqrt(x)",
)
_math("sin", lambda c, a: f"tl.sin({a})", lambda d: (node("mul", d.g, node("cos", d.a)),), "sine")
_math("cos", lambda c, a: f"tl.cos({a})", lambda d: (node("neg", node("mul", d.g, node("sin", d.a))),), "cosine")
_math(
    "tan",
    lambda c, a: f"tl.sin({a}) / tl.cos({a})",
    lambda d: (node("mul", d.g, node("add", 1.0, node("mul", d.y, d.y))),),
    "tangent",
)


def _tanh_derivative(d: D) -> tuple:
    """``1 - tanh(x)**2`` from ``x``, as ``4t / (1 + t)**2`` with ``t = exp(-2|x|)``: from ``y``,
    ``1 - y * y`` keeps none of its digits where ``y`` rounds within an ulp of 1 (a softcap's
    gradient 7x eager's error at 9e-8 of 1e-5; model fuzzer seed 20275015, program 2027501500043)."""
    t = node("exp", node("mul", -2.0, node("abs", d.a)))
    one_t = node("add", 1.0, t)
    return (node("mul", d.g, node("div", node("mul", 4.0, t), node("mul", one_t, one_t))),)


_math("tanh", tanh_text, _tanh_derivative, "hyperbolic tangent", pattern=Pattern.ACTIVATION)
_math(
    "erf",
    lambda c, a: f"tl.erf({a})",
    lambda d: (node("mul", d.g, node("mul", 2 / math.sqrt(math.pi), node("exp", node("neg", node("mul", d.a, d.a))))),),
    "error function",
)
_math(
    "sigmoid",
    lambda c, a: f"1.0 / (1.0 + tl.exp(-{a}))",
    lambda d: (node("mul", d.g, node("mul", d.y, node("sub", 1.0, d.y))),),
    "1 / (1 + exp(-x))",
    pattern=Pattern.ACTIVATION,
)
_math(
    "relu",
    lambda c, a: f"tl.where({a} < 0, 0, {a})",
    # torch's threshold_backward: 0 where the input is <= 0 (even for an inf cotangent), else
    # the cotangent (a NaN input passes it through)
    lambda d: (node("where", node("le", d.a, 0), 0.0, d.g),),
    "max(x, 0), NaN kept",
    pattern=Pattern.ACTIVATION,
    cost=1,
)


def _silu_derivative(d: D) -> tuple:
    s = node("sigmoid", d.a)
    return (node("mul", d.g, node("mul", s, node("add", 1.0, node("mul", d.a, node("sub", 1.0, s))))),)


_math(
    "silu",
    lambda c, a: f"{a} / (1.0 + tl.exp(-{a}))",
    _silu_derivative,
    "x * sigmoid(x)",
    ref=F.silu,
    accepts=FLOATING,
    pattern=Pattern.ACTIVATION,
    functional=True,
)


def _gelu_text(ctx: EmitCtx, a: str) -> str:
    if ctx.attrs["approximate"] == "tanh":
        inner = ctx.tmp(f"0.7978845608028654 * ({a} + 0.044715 * {a} * {a} * {a})")
        return f"0.5 * {a} * (1.0 + {tanh_text(ctx, inner)})"
    return f"0.5 * {a} * (1.0 + tl.erf({a} * 0.7071067811865476))"


def _gelu_derivative(d: D) -> tuple:
    x = d.a
    if d.n.attr("approximate") == "tanh":
        k = math.sqrt(2 / math.pi)
        inner = node("mul", k, node("add", x, node("mul", 0.044715, node("mul", x, node("mul", x, x)))))
        t = node("tanh", inner)
        dinner = node("mul", k, node("add", 1.0, node("mul", 3 * 0.044715, node("mul", x, x))))
        left = node("mul", 0.5, node("add", 1.0, t))
        right = node("mul", node("mul", 0.5, x), node("mul", node("sub", 1.0, node("mul", t, t)), dinner))
        return (node("mul", d.g, node("add", left, right)),)
    cdf = node("mul", 0.5, node("add", 1.0, node("erf", node("mul", x, 1 / math.sqrt(2)))))
    pdf = node("mul", 1 / math.sqrt(2 * math.pi), node("exp", node("mul", -0.5, node("mul", x, x))))
    return (node("mul", d.g, node("add", cdf, node("mul", x, pdf))),)


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


_ew(
    "gelu",
    1,
    lambda a, approximate: F.gelu(a, approximate=approximate),
    _gelu_text,
    _gelu_derivative,
    accepts=FLOATING,
    pattern=Pattern.ACTIVATION,
    cost=8,  # erf (or tanh) and four multiplies
    front=Front(fn=gelu, methods={"gelu": None}, torch={F.gelu: gelu}),
)


# scalar parameters are operands (constants), so their values never enter a signature
def leaky_relu(x: ExprLike, negative_slope: float = 0.01) -> Expr:
    """``x`` if positive else ``x * negative_slope``.

    Example:
        >>> import rtxdsl as rx
        >>> rx.leaky_relu(rx.var("x"), 0.2)
        leaky_relu(x, 0.2)
    """
    return node("leaky_relu", x, scalar_arg(negative_slope, "leaky_relu", "negative_slope"))


_ew(
    "leaky_relu",
    2,
    lambda a, s: F.leaky_relu(a, s),
    lambda c, a, s: f"tl.where({a} > 0, {a}, {a} * {s})",
    lambda d: (node("where", node("gt", d.a, 0), d.g, node("mul", d.g, d.b)), None),
    accepts=FLOATING,
    pattern=Pattern.ACTIVATION,
    front=Front(
        fn=leaky_relu,
        torch={F.leaky_relu: lambda a, negative_slope=0.01, inplace=False: leaky_relu(a, negative_slope)},
    ),
)


def elu(x: ExprLike, alpha: float = 1.0) -> Expr:
    """``x`` if positive else ``alpha * (exp(x) - 1)``.

    Example:
        >>> import rtxdsl as rx
        >>> rx.elu(rx.var("x"))
        elu(x, 1.0)
    """
    return node("elu", x, scalar_arg(alpha, "elu", "alpha"))


_ew(
    "elu",
    2,
    lambda a, alpha: F.elu(a, alpha),
    lambda c, a, al: f"tl.where({a} > 0, {a}, {al} * {_expm1(c, a)})",
    # torch's elu_backward: x <= 0 takes the exponential's slope, anything else (NaN too) the cotangent
    lambda d: (node("where", node("le", d.a, 0), node("mul", d.g, node("mul", d.b, node("exp", d.a))), d.g), None),
    accepts=FLOATING,
    pattern=Pattern.ACTIVATION,
    front=Front(fn=elu, torch={F.elu: lambda a, alpha=1.0, inplace=False: elu(a, alpha)}),
)


def softplus(x: ExprLike, beta: float = 1.0, threshold: float = 20.0) -> Expr:
    """``log(1 + exp(beta * x)) / beta``, linear above ``threshold`` (torch's F.softplus).

    Example:
        >>> import rtxdsl as rx
        >>> rx.softplus(rx.var("x"))
        softplus(x, 1.0, 20.0)
    """
    return node("softplus", x, scalar_arg(beta, "softplus", "beta"), scalar_arg(threshold, "softplus", "threshold"))


_ew(
    "softplus",
    3,
    lambda a, beta, th: F.softplus(a, beta, th),
    lambda c, a, beta, th: f"tl.where({a} * {beta} > {th}, {a}, {_log1p(c, c.tmp(f'tl.exp({a} * {beta})'))} / {beta})",
    lambda d: (
        node(
            "where",
            node("gt", node("mul", d.a, d.srcs[1]), d.srcs[2]),
            d.g,
            node("mul", d.g, node("sigmoid", node("mul", d.a, d.srcs[1]))),
        ),
        None,
        None,
    ),
    accepts=FLOATING,
    pattern=Pattern.ACTIVATION,
    front=Front(fn=softplus, torch={F.softplus: softplus}),
)

# ---- comparison and logic ------------------------------------------------------------------
for _name, _sym, _aliases in (
    ("lt", "<", ("less",)),
    ("le", "<=", ("less_equal",)),
    ("gt", ">", ("greater",)),
    ("ge", ">=", ("greater_equal",)),
    ("eq", "==", ()),
    ("ne", "!=", ("not_equal",)),
):
    _ew(
        _name,
        2,
        _binary_ref(getattr(torch, _name)),
        (lambda s: lambda c, a, b: f"{a} {s} {b}")(_sym),
        no_grad,
        accepts=ANY,
        rule=DtypeRule.COMPARE,
        symbol=_sym,
        precedence=0,
        front=Front(
            fn=binary_fn(_name, f"a {_sym} b (bool)", f"a {_sym} b"),
            operators=(f"__{_name}__",),
            torch={f: (lambda n: lambda a, b: node(n, a, b))(_name) for f in torch_fns(_name, *_aliases)}
            | {getattr(torch.Tensor, f"__{_name}__"): (lambda n: lambda a, b: node(n, a, b))(_name)},
            cpu_rounds_numbers=True,
        ),
    )
_ON_BOOLS = {"and": both, "or": either, "xor": lambda a, b: f"{a} != {b}"}
for _name, _sym, _torch, _prec in (
    ("and", "&", "bitwise_and", 3),
    ("or", "|", "bitwise_or", 1),
    ("xor", "^", "bitwise_xor", 2),
):
    _ew(
        _name,
        2,
        _binary_ref(getattr(torch, _torch)),
        _bool_or(_ON_BOOLS[_name], _sym),
        no_grad,
        accepts=INTEGRAL,
        symbol=_sym,
        precedence=_prec,
        front=Front(
            fn=binary_fn(_name, f"a {_sym} b (bitwise; logical on bool)", f"a {_sym} b"),
            operators=(f"__{_name}__", f"__r{_name}__"),
            torch={f: (lambda n: lambda a, b: node(n, a, b))(_name) for f in torch_fns(_torch, f"__{_name}__")},
            inplace=(getattr(torch.Tensor, f"{_torch}_"), getattr(torch.Tensor, f"__i{_name}__")),
        ),
    )
_ew(
    "invert",
    1,
    torch.bitwise_not,
    lambda c, a: f"{a} == 0" if c.is_bool else f"~{a}",
    no_grad,
    accepts=INTEGRAL,
    symbol="~",
    precedence=7,
    front=Front(
        fn=unary_fn("invert", "~x (bitwise not; logical not on bool)"),
        names=("invert", "bitwise_not"),
        operators=("__invert__",),
        torch={f: (lambda a: ~a) for f in torch_fns("bitwise_not", "__invert__")}
        | {f: (lambda a: a == 0) for f in torch_fns("logical_not")},
    ),
)


def where(cond: ExprLike, a: ExprLike, b: ExprLike) -> Expr:
    """``a`` where ``cond`` is true, else ``b`` (cond must be bool).

    Example:
        >>> import rtxdsl as rx
        >>> x = rx.var("x"); rx.where(x > 0, x, 0.0)
        where(x > 0, x, 0.0)
    """
    return node("where", cond, a, b)


def _where_builder(c: Any, a: Any = None, b: Any = None) -> Expr:
    if a is None or b is None:
        raise Unsupported  # torch.where(cond): indices
    return where(c, a, b)


_ew(
    "where",
    3,
    lambda c, a, b: torch.where(torch.as_tensor(c), *as_tensors(a, b)),  # the condition takes no part in promotion
    lambda ctx, c, a, b: f"tl.where({c}, {a}, {b})",
    lambda d: (None, node("where", d.a, d.g, 0.0), node("where", d.a, 0.0, d.g)),
    accepts=ANY,
    rule=DtypeRule.WHERE,
    front=Front(
        fn=where,
        methods={"where": lambda self, cond, other: where(cond, self, other)},
        torch={torch.where: _where_builder, torch.Tensor.where: lambda a, c, b: where(c, a, b)},
    ),
)


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


def is_cast(n: Expr) -> bool:
    """Is ``n`` a conversion (``x.to(T)``): the same value, only its dtype changed?"""
    return n.op == "cast"


def _to_builder(a: Any, *args: Any, **kwargs: Any) -> Expr:
    dtype = kwargs.pop("dtype", None)
    kwargs.pop("non_blocking", None)
    rest = [x for x in args if not isinstance(x, torch.dtype)]
    dtype = next((x for x in args if isinstance(x, torch.dtype)), dtype)
    if rest or kwargs or dtype is None:
        raise Unsupported  # a device move or copy=True: a sync point
    return cast(a, dtype)


_CAST_METHODS = {
    "float": torch.float32,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "double": torch.float64,
    "int": torch.int32,
    "long": torch.int64,
    "short": torch.int16,
    "char": torch.int8,
    "byte": torch.uint8,
    "bool": torch.bool,
}
_ew(
    "cast",
    1,
    lambda a, dtype: a.to(dtype),
    _cast,
    lambda d: (d.g,),  # the VJP pass casts each input's gradient to the input's dtype
    accepts=ANY,
    rule=DtypeRule.CAST,
    front=Front(
        fn=cast,
        methods={"to": None},
        torch={torch.Tensor.to: _to_builder}
        | {
            getattr(torch.Tensor, m): (lambda dt: lambda a, memory_format=None: cast(a, dt))(dt)
            for m, dt in _CAST_METHODS.items()
        },
    ),
)

# x where finite, NaN where +-inf or NaN, gradient g likewise: a logsumexp guarded so, subtracted
# from its row, makes the row NaN exactly where torch's log_softmax does (a +inf logit, only -inf
# ones, a NaN), value and gradient; matched by the writer's shared-exp rule (softmax's one exp)
_ew(
    "finite_or_nan",
    1,
    lambda a: a * (1 + (a - a).detach()),  # autograd's gradient: g, NaN where a is not finite
    lambda c, a: f"{a} + ({a} - {a})",
    lambda d: (node("add", d.g, node("detach", node("sub", d.a, d.a))),),
    accepts=FLOATING,
    eager_launches=2,  # sub, add
)

# identity whose gradient is zero (the lazy stream's Tensor.detach, stop-gradient in composites)
_ew(
    "detach",
    1,
    lambda a: a.detach(),
    lambda c, a: a,
    no_grad,
    accepts=ANY,
    eager_launches=0,
    front=Front(fn=unary_fn("detach", "the value, with no gradient flowing back"), methods={"detach": None}),
)
