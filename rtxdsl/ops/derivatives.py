"""Derivative rules, one per primitive, written in DSL ops (a table keyed by op name).

A rule gets ``d``: ``d.n`` the forward node (its operands ``d.a``, ``d.b``...), ``d.g`` the
cotangent of its result and ``d.y`` the result itself (for reductions both in keepdim form,
so they broadcast against the operand), and returns one cotangent per operand (None where
there is none: integer results, comparisons, constants). Broadcast operands are summed back
to their shape by the VJP builder, not here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..expr import Expr, node
from . import REGISTRY


@dataclass(frozen=True)
class D:
    n: Expr
    g: Expr
    y: Expr
    g_ndim: int = -1  # rank of g, which may be lower than n's when g broadcasts to it
    n_ndim: int = -1

    @property
    def a(self) -> Expr:
        return self.n.srcs[0]

    @property
    def b(self) -> Expr:
        return self.n.srcs[1]


def _zero(d: D) -> tuple:
    return (node("mul", d.g, 0.0),)  # piecewise-constant: zero gradient, NaN kept as torch


def _gelu(d: D) -> tuple:
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


def _silu(d: D) -> tuple:
    s = node("sigmoid", d.a)
    return (node("mul", d.g, node("mul", s, node("add", 1.0, node("mul", d.a, node("sub", 1.0, s))))),)


def _split_ties(d: D, first_wins: str) -> tuple:
    """torch.maximum/minimum: the gradient goes to the winner, halved on ties."""
    half = node("mul", d.g, 0.5)
    win_a = node(first_wins, d.a, d.b)
    tie = node("eq", d.a, d.b)
    ga = node("where", tie, half, node("where", win_a, d.g, 0.0))
    gb = node("where", tie, half, node("where", win_a, 0.0, d.g))
    return (ga, gb)


def _extreme(d: D) -> tuple:
    """amax/amin: spread evenly over the elements equal to the result."""
    hit = node("cast", node("eq", d.a, d.y), dtype=torch.float32)
    count = node("sum", hit, axis=d.n.attr("axis"), keepdim=True)
    return (node("div", node("mul", d.g, hit), count),)


def _pow(d: D) -> tuple:
    a, b = d.a, d.b
    ga = node("mul", d.g, node("mul", b, node("pow", a, node("sub", b, 1.0))))
    zero_base = node("and", node("eq", a, 0.0), node("ge", b, 0.0))
    gb = node("mul", d.g, node("where", zero_base, 0.0, node("mul", d.y, node("log", a))))
    return (ga, gb)


def _squeeze(d: D) -> Expr:
    """Drop the inserted size-1 dims from g (those g has: it may broadcast with fewer dims)."""
    pad = d.n_ndim - d.g_ndim
    present = tuple(a - pad for a in d.n.attr("axes") if a - pad >= 0)
    return node("sum", d.g, axis=present, keepdim=False) if present else d.g


RULES = {
    "add": lambda d: (d.g, d.g),
    "sub": lambda d: (d.g, node("neg", d.g)),
    "mul": lambda d: (node("mul", d.g, d.b), node("mul", d.g, d.a)),
    "div": lambda d: (node("div", d.g, d.b), node("neg", node("div", node("mul", d.g, d.y), d.b))),
    "neg": lambda d: (node("neg", d.g),),
    "abs": lambda d: (node("mul", d.g, node("sign", d.a)),),
    "exp": lambda d: (node("mul", d.g, d.y),),
    "exp2": lambda d: (node("mul", d.g, node("mul", d.y, math.log(2))),),
    "expm1": lambda d: (node("mul", d.g, node("add", d.y, 1.0)),),
    "log": lambda d: (node("div", d.g, d.a),),
    "log2": lambda d: (node("div", d.g, node("mul", d.a, math.log(2))),),
    "log1p": lambda d: (node("div", d.g, node("add", d.a, 1.0)),),
    "sqrt": lambda d: (node("div", node("mul", d.g, 0.5), d.y),),
    "rsqrt": lambda d: (node("mul", node("mul", d.g, -0.5), node("mul", d.y, node("mul", d.y, d.y))),),
    "sin": lambda d: (node("mul", d.g, node("cos", d.a)),),
    "cos": lambda d: (node("neg", node("mul", d.g, node("sin", d.a))),),
    "tan": lambda d: (node("mul", d.g, node("add", 1.0, node("mul", d.y, d.y))),),
    "tanh": lambda d: (node("mul", d.g, node("sub", 1.0, node("mul", d.y, d.y))),),
    "sigmoid": lambda d: (node("mul", d.g, node("mul", d.y, node("sub", 1.0, d.y))),),
    "relu": lambda d: (node("where", node("gt", d.a, 0), d.g, 0.0),),
    "gelu": _gelu,
    "silu": _silu,
    "erf": lambda d: (
        node("mul", d.g, node("mul", 2 / math.sqrt(math.pi), node("exp", node("neg", node("mul", d.a, d.a))))),
    ),
    "reciprocal": lambda d: (node("neg", node("mul", d.g, node("mul", d.y, d.y))),),
    "leaky_relu": lambda d: (node("where", node("gt", d.a, 0), d.g, node("mul", d.g, d.b)), None),
    "elu": lambda d: (
        node("where", node("gt", d.a, 0), d.g, node("mul", d.g, node("mul", d.b, node("exp", d.a)))),
        None,
    ),
    "softplus": lambda d: (
        node(
            "where",
            node("gt", node("mul", d.a, d.n.srcs[1]), d.n.srcs[2]),
            d.g,
            node("mul", d.g, node("sigmoid", node("mul", d.a, d.n.srcs[1]))),
        ),
        None,
        None,
    ),
    "pow": _pow,
    "maximum": lambda d: _split_ties(d, "gt"),
    "minimum": lambda d: _split_ties(d, "lt"),
    "floor": _zero,
    "ceil": _zero,
    "round": _zero,
    "trunc": _zero,
    "sign": _zero,
    "floordiv": lambda d: (node("mul", d.g, 0.0), node("mul", d.g, 0.0)),
    "remainder": lambda d: (d.g, node("neg", node("mul", d.g, node("floordiv", d.a, d.b)))),
    "where": lambda d: (None, node("where", d.a, d.g, 0.0), node("where", d.a, 0.0, d.g)),
    "cast": lambda d: (d.g,),  # the builder casts each input's gradient to the input's dtype
    "sum": lambda d: (d.g,),
    "amax": _extreme,
    "amin": _extreme,
    "unsqueeze": lambda d: (_squeeze(d),),
}
NONDIFFERENTIABLE = {"detach", "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "xor", "invert"}

for _name, _rule in RULES.items():
    REGISTRY[_name] = replace(REGISTRY[_name], derivative=_rule)
for _name in NONDIFFERENTIABLE:
    REGISTRY[_name] = replace(REGISTRY[_name], derivative=lambda d: tuple(None for _ in d.n.srcs))
