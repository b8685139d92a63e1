"""Elementwise ops: torch reference and Triton emitter side by side, one declaration each.

Emitters receive operand names already cast to the compute dtype (``ctx.dtype``) and
return one Triton expression. They use only core ``tl`` ops (no libdevice, no nested
``@triton.jit`` helpers), so the same source runs compiled and under the interpreter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dtypes import TRITON_TYPE
from . import (
    ANY,
    FLOAT,
    INTEGRAL,
    NUMERIC,
    DtypeRule,
    EmitCtx,
    OpDef,
    OpKind,
    as_tensors,
    register,
)


def _ew(
    name: str,
    arity: int,
    ref,
    emit,
    *,
    accepts=NUMERIC,
    rule=DtypeRule.PROMOTE,
    symbol=None,
    pattern=None,
    doc="",
) -> OpDef:
    return register(
        OpDef(
            name=name,
            kind=OpKind.ELEMENTWISE,
            arity=arity,
            ref=ref,
            emit=emit,
            eager_launches=1,
            rule=rule,
            accepts=accepts,
            symbol=symbol,
            pattern=pattern,
            doc=doc,
        )
    )


def _float_only(ctx: EmitCtx, a: str, expr: str) -> str:
    """``expr`` for float operands; integers and bools are already integral."""
    return expr if ctx.is_float else a


# ---- helpers shared by several emitters (source text builders, not ops) -------------


def nan_max(a: str, b: str) -> str:
    """torch.maximum: NaN in either operand wins."""
    return f"tl.where(({a} > {b}) | ({a} != {a}), {a}, {b})"


def nan_min(a: str, b: str) -> str:
    return f"tl.where(({a} < {b}) | ({a} != {a}), {a}, {b})"


def _expm1(ctx: EmitCtx, a: str) -> str:
    # exp(x) - 1 cancels near 0: a Taylor polynomial is exact to fp32 there.
    poly = f"{a} * (1.0 + {a} * (0.5 + {a} * (1.0 / 6.0 + {a} * (1.0 / 24.0 + {a} * (1.0 / 120.0 + {a} / 720.0)))))"
    return f"tl.where(tl.abs({a}) < 0.03125, {poly}, tl.exp({a}) - 1.0)"


def _log1p(ctx: EmitCtx, a: str) -> str:
    # Goldberg's trick: log(u) * x / (u - 1) with u = 1 + x is accurate for small x.
    u = ctx.tmp(f"1.0 + {a}")
    return f"tl.where({u} == 1.0, {a}, tl.where({a} == float('inf'), {a}, tl.log({u}) * ({a} / ({u} - 1.0))))"


def _tanh(ctx: EmitCtx, a: str) -> str:
    t = ctx.tmp(f"tl.exp(-2.0 * tl.abs({a}))")
    big = f"tl.where({a} < 0, -1.0, 1.0) * ((1.0 - {t}) / (1.0 + {t}))"
    a2 = ctx.tmp(f"{a} * {a}")
    small = f"{a} * (1.0 + {a2} * (-1.0 / 3.0 + {a2} * (2.0 / 15.0 + {a2} * (-17.0 / 315.0))))"
    return f"tl.where(tl.abs({a}) < 0.125, {small}, {big})"


def _sigmoid(a: str) -> str:
    return f"1.0 / (1.0 + tl.exp(-{a}))"


def _round(ctx: EmitCtx, a: str) -> str:
    # round half to even, as torch.round; values beyond 2**mantissa are integers already
    limit = "4503599627370496.0" if ctx.dtype is torch.float64 else "8388608.0"
    r = ctx.tmp(f"tl.floor({a} + 0.5)")
    fixed = f"tl.where(({r} - {a} == 0.5) & ({r} - 2.0 * tl.floor({r} * 0.5) != 0.0), {r} - 1.0, {r})"
    return f"tl.where(tl.abs({a}) >= {limit}, {a}, {fixed})"


def _pow(ctx: EmitCtx, a: str, b: str) -> str:
    # |a|**b through exp2/log2, then torch's rules for negative bases and zero exponents;
    # nested where rather than & / |, which the interpreter rejects on scalar operands
    mag = ctx.tmp(f"tl.exp2({b} * tl.log2(tl.abs({a})))")
    odd = f"tl.floor({b} * 0.5) * 2.0 != {b}"
    neg = f"tl.where(tl.floor({b}) == {b}, tl.where({odd}, -{mag}, {mag}), float('nan'))"
    return f"tl.where({b} == 0.0, 1.0, tl.where({a} == 1.0, 1.0, tl.where({a} < 0, {neg}, {mag})))"


def _floordiv(ctx: EmitCtx, a: str, b: str) -> str:
    if not ctx.is_float:
        q = ctx.tmp(f"{a} // {b}")
        return f"tl.where((({a} % {b}) != 0) & (({a} < 0) != ({b} < 0)), {q} - 1, {q})"
    # ATen's div_floor_floating
    mod = ctx.tmp(f"{a} % {b}")
    div = ctx.tmp(f"({a} - {mod}) / {b}")
    div = ctx.tmp(f"tl.where(({mod} != 0) & (({b} < 0) != ({mod} < 0)), {div} - 1.0, {div})")
    fl = ctx.tmp(f"tl.floor({div})")
    fl = ctx.tmp(f"tl.where({div} - {fl} > 0.5, {fl} + 1.0, {fl})")
    signed_zero = f"tl.where(({a} < 0) != ({b} < 0), -0.0, 0.0)"
    return f"tl.where({b} == 0, {a} / {b}, tl.where({div} != 0, {fl}, {signed_zero}))"


def _remainder(ctx: EmitCtx, a: str, b: str) -> str:
    r = ctx.tmp(f"{a} % {b}")
    return f"tl.where(({r} != 0) & (({r} < 0) != ({b} < 0)), {r} + {b}, {r})"


def to_storage(a: str, have: torch.dtype, want: torch.dtype) -> str:
    """Convert a computed value to a storage dtype, rounding to nearest even as torch does.

    fp32 -> bf16 rounds explicitly: Triton's interpreter would truncate otherwise.
    """
    if want is torch.bool:
        return a if have is torch.bool else f"{a} != 0"
    if have == want:
        return a
    if want is torch.bfloat16 and have in (torch.float32, torch.float64):
        f = a if have is torch.float32 else f"{a}.to(tl.float32)"
        bits = f"{f}.to(tl.uint32, bitcast=True)"
        rne = f"(({bits} + 0x7FFF + (({bits} >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)"
        return f"tl.where({f} != {f}, {f}, {rne}).to(tl.bfloat16)"
    return f"{a}.to({TRITON_TYPE[want]})"


def _cast(ctx: EmitCtx, a: str) -> str:
    target: torch.dtype = ctx.attrs["dtype"]
    if target in (torch.float16, torch.bfloat16) and ctx.dtype.is_floating_point:
        # round to the half type as asked, keep computing in fp32
        return f"{to_storage(a, ctx.dtype, target)}.to(tl.float32)"
    return to_storage(a, ctx.dtype, target)


def _bool_or(op_bool: str, op: str):
    return lambda ctx, a, b: f"{a} {op_bool if ctx.is_bool else op} {b}"


def _binary_ref(fn):
    return lambda a, b: fn(*as_tensors(a, b))


# ---- arithmetic ------------------------------------------------------------------------
_ew("add", 2, lambda a, b: torch.add(*as_tensors(a, b)), _bool_or("|", "+"), accepts=ANY, symbol="+")
_ew("sub", 2, lambda a, b: torch.sub(*as_tensors(a, b)), lambda c, a, b: f"{a} - {b}", symbol="-")
_ew("mul", 2, lambda a, b: torch.mul(*as_tensors(a, b)), _bool_or("&", "*"), accepts=ANY, symbol="*")
_ew("div", 2, lambda a, b: torch.true_divide(*as_tensors(a, b)), lambda c, a, b: f"{a} / {b}", symbol="/")
_ew("floordiv", 2, _binary_ref(torch.floor_divide), _floordiv, symbol="//")
_ew("remainder", 2, _binary_ref(torch.remainder), _remainder, symbol="%")
register(
    OpDef(
        name="pow",
        kind=OpKind.ELEMENTWISE,
        arity=2,
        ref=_binary_ref(torch.pow),
        emit=_pow,
        eager_launches=1,
        accepts=NUMERIC,
        results=frozenset({FLOAT}),
        symbol="**",
    )
)
_ew(
    "maximum",
    2,
    _binary_ref(torch.maximum),
    lambda c, a, b: nan_max(a, b) if c.is_float else f"tl.maximum({a}, {b})",
)
_ew(
    "minimum",
    2,
    _binary_ref(torch.minimum),
    lambda c, a, b: nan_min(a, b) if c.is_float else f"tl.minimum({a}, {b})",
)
_ew("neg", 1, torch.neg, lambda c, a: f"-{a}", symbol="-")
_ew("abs", 1, torch.abs, lambda c, a: f"tl.abs({a})")
_ew(
    "sign",
    1,
    torch.sign,
    lambda c, a: a if c.is_bool else f"(({a} > 0).to({TRITON_TYPE[c.dtype]}) - ({a} < 0).to({TRITON_TYPE[c.dtype]}))",
    accepts=ANY,
)
_ew("reciprocal", 1, torch.reciprocal, lambda c, a: f"1.0 / {a}")

# ---- rounding --------------------------------------------------------------------------
_ew("floor", 1, torch.floor, lambda c, a: _float_only(c, a, f"tl.floor({a})"))
_ew("ceil", 1, torch.ceil, lambda c, a: _float_only(c, a, f"tl.ceil({a})"))
_ew(
    "trunc",
    1,
    torch.trunc,
    lambda c, a: _float_only(c, a, f"tl.where({a} < 0, tl.ceil({a}), tl.floor({a}))"),
)
_ew("round", 1, torch.round, lambda c, a: _float_only(c, a, _round(c, a)))

# ---- transcendental (integer inputs compute in float, as torch) -------------------------
_ew("exp", 1, torch.exp, lambda c, a: f"tl.exp({a})")
_ew("exp2", 1, torch.exp2, lambda c, a: f"tl.exp2({a})")
_ew("expm1", 1, torch.expm1, _expm1)
_ew("log", 1, torch.log, lambda c, a: f"tl.log({a})")
_ew("log2", 1, torch.log2, lambda c, a: f"tl.log2({a})")
_ew("log1p", 1, torch.log1p, _log1p)
_ew("sqrt", 1, torch.sqrt, lambda c, a: f"tl.sqrt({a})")
_ew("rsqrt", 1, torch.rsqrt, lambda c, a: f"tl.rsqrt({a})")
_ew("sin", 1, torch.sin, lambda c, a: f"tl.sin({a})")
_ew("cos", 1, torch.cos, lambda c, a: f"tl.cos({a})")
_ew("tan", 1, torch.tan, lambda c, a: f"tl.sin({a}) / tl.cos({a})")
_ew("tanh", 1, torch.tanh, _tanh, pattern="Activation")
_ew("erf", 1, torch.erf, lambda c, a: f"tl.erf({a})")

# ---- activations -----------------------------------------------------------------------
_ew("relu", 1, torch.relu, lambda c, a: f"tl.where({a} < 0, 0, {a})", pattern="Activation")
_ew("sigmoid", 1, torch.sigmoid, lambda c, a: _sigmoid(a), pattern="Activation")
_ew("silu", 1, F.silu, lambda c, a: f"{a} / (1.0 + tl.exp(-{a}))", accepts=frozenset({FLOAT}), pattern="Activation")


def _gelu(ctx: EmitCtx, a: str) -> str:
    if ctx.attrs["approximate"] == "tanh":
        inner = ctx.tmp(f"0.7978845608028654 * ({a} + 0.044715 * {a} * {a} * {a})")
        return f"0.5 * {a} * (1.0 + {_tanh(ctx, inner)})"
    return f"0.5 * {a} * (1.0 + tl.erf({a} * 0.7071067811865476))"


_ew(
    "gelu",
    1,
    lambda a, approximate: F.gelu(a, approximate=approximate),
    _gelu,
    accepts=frozenset({FLOAT}),
    pattern="Activation",
)
# scalar parameters are operands (constants), so their values never enter a signature
_ew(
    "leaky_relu",
    2,
    lambda a, s: F.leaky_relu(a, s),
    lambda c, a, s: f"tl.where({a} > 0, {a}, {a} * {s})",
    accepts=frozenset({FLOAT}),
    pattern="Activation",
)
_ew(
    "elu",
    2,
    lambda a, alpha: F.elu(a, alpha),
    lambda c, a, al: f"tl.where({a} > 0, {a}, {al} * {_expm1(c, a)})",
    accepts=frozenset({FLOAT}),
    pattern="Activation",
)
_ew(
    "softplus",
    3,
    lambda a, beta, th: F.softplus(a, beta, th),
    lambda c, a, beta, th: f"tl.where({a} * {beta} > {th}, {a}, {_log1p(c, c.tmp(f'tl.exp({a} * {beta})'))} / {beta})",
    accepts=frozenset({FLOAT}),
    pattern="Activation",
)

# ---- comparison and logic ----------------------------------------------------------------
for _name, _sym, _fn in (
    ("lt", "<", torch.lt),
    ("le", "<=", torch.le),
    ("gt", ">", torch.gt),
    ("ge", ">=", torch.ge),
    ("eq", "==", torch.eq),
    ("ne", "!=", torch.ne),
):
    _ew(
        _name,
        2,
        _binary_ref(_fn),
        (lambda s: lambda c, a, b: f"{a} {s} {b}")(_sym),
        accepts=ANY,
        rule=DtypeRule.COMPARE,
        symbol=_sym,
    )
for _name, _sym, _fn in (
    ("and", "&", torch.bitwise_and),
    ("or", "|", torch.bitwise_or),
    ("xor", "^", torch.bitwise_xor),
):
    _ew(
        _name,
        2,
        _binary_ref(_fn),
        (lambda s: lambda c, a, b: f"{a} {s} {b}")(_sym),
        accepts=INTEGRAL,
        symbol=_sym,
    )
_ew(
    "invert",
    1,
    torch.bitwise_not,
    lambda c, a: f"{a} == 0" if c.is_bool else f"~{a}",
    accepts=INTEGRAL,
    symbol="~",
)
_ew(
    "where",
    3,
    lambda c, a, b: torch.where(c, *as_tensors(a, b)),
    lambda ctx, c, a, b: f"tl.where({c}, {a}, {b})",
    accepts=ANY,
    rule=DtypeRule.WHERE,
)
_ew("cast", 1, lambda a, dtype: a.to(dtype), _cast, accepts=ANY, rule=DtypeRule.CAST)


def _unsqueeze_ref(a: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    for ax in sorted(axes):
        a = a.unsqueeze(ax)
    return a


# size-1 dims inserted at ``axes`` (of the result): what a keepdim=False reduction's gradient
# needs to broadcast back; inside a row kernel it only turns a per-row value's role around
register(
    OpDef(
        name="unsqueeze",
        kind=OpKind.ELEMENTWISE,
        arity=1,
        ref=_unsqueeze_ref,
        emit=lambda c, a: a,
        eager_launches=0,
        accepts=ANY,
        view=True,
    )
)

# identity whose gradient is zero: the max shift of softmax / logsumexp cancels in the derivative
register(
    OpDef(
        name="detach",
        kind=OpKind.ELEMENTWISE,
        arity=1,
        ref=lambda a: a.detach(),
        emit=lambda c, a: a,
        eager_launches=0,
        accepts=ANY,
        view=False,
    )
)
