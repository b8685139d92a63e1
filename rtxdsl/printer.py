"""Readable text of an expression: infix where the op has a symbol, calls elsewhere."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .expr import Expr

_PRECEDENCE = {
    "|": 1,
    "^": 2,
    "&": 3,
    "<": 4,
    "<=": 4,
    ">": 4,
    ">=": 4,
    "==": 4,
    "!=": 4,
    "+": 5,
    "-": 5,
    "*": 6,
    "/": 6,
    "//": 6,
    "%": 6,
    "**": 8,
}


def _attr_text(value) -> str:
    return str(value).removeprefix("torch.") if not isinstance(value, str) else repr(value)


def format_expr(e: Expr) -> str:
    text, _ = _fmt(e)
    return text


def _fmt(e: Expr) -> tuple[str, int]:
    from .ops import REGISTRY

    if e.op == "var":
        return e.attr("name"), 10
    if e.op == "const":
        return repr(e.attr("value")), 10
    sym = REGISTRY[e.op].symbol
    parts = [_fmt(s) for s in e.srcs]
    if sym is not None and len(parts) == 1:
        inner, p = parts[0]
        return f"{sym}{inner if p >= 7 else f'({inner})'}", 7
    if sym is not None and len(parts) == 2:
        prec = _PRECEDENCE[sym]
        (lt, lp), (rt, rp) = parts
        left = lt if lp >= prec else f"({lt})"
        right = rt if rp > prec or (rp == prec and sym in "+*") else f"({rt})"
        return f"{left} {sym} {right}", prec
    args = [t for t, _ in parts] + [f"{k}={_attr_text(v)}" for k, v in e.attrs]
    return f"{e.op}({', '.join(args)})", 10
