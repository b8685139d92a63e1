"""What op declarations share: DSL-function factories, argument checks, torch name lookup and
the input of derivative rules. Nothing here names a particular op."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import RtxError
from ..expr import Expr, Scalar, node

ExprLike = Expr | Scalar


def torch_fns(*names: str) -> list[Any]:
    """``torch.NAME``, ``torch.Tensor.NAME`` and ``F.NAME`` for every one that exists."""
    out = []
    for n in names:
        for ns in (torch, torch.Tensor, F):
            fn = getattr(ns, n, None)
            if fn is not None and fn not in out:
                out.append(fn)
    return out


def _doc(fn: Callable[..., Any], name: str, text: str, example: str, shown: str) -> Callable[..., Any]:
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"{text}\n\nExample:\n    >>> import rtxdsl as rx\n    >>> {example}\n    {shown}\n"
    return fn


def unary_fn(op: str, text: str) -> Callable[[ExprLike], Expr]:
    def fn(x: ExprLike) -> Expr:
        return node(op, x)

    return _doc(fn, op, text, f"rx.{op}(rx.var('x'))", f"{op}(x)")


def binary_fn(op: str, text: str, shown: str | None = None) -> Callable[[ExprLike, ExprLike], Expr]:
    def fn(a: ExprLike, b: ExprLike) -> Expr:
        return node(op, a, b)

    return _doc(fn, op, text, f"rx.{op}(rx.var('a'), rx.var('b'))", shown or f"{op}(a, b)")


def scalar_arg(v: Any, op: str, name: str) -> float:
    """A python number given for a scalar parameter (bools are not numbers here)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RtxError(f"{op}: {name} must be a python number, got {v!r}")
    return float(v)


def axis_arg(axis: Any, dim: Any, op: str) -> int | tuple[int, ...] | None:
    """``axis`` (or torch's ``dim``): None, an int or a tuple of ints; ``()`` means all, as in torch."""
    if dim is not None:
        if axis is not None:
            raise RtxError(f"{op}: give axis or dim, not both")
        axis = dim
    if axis is None:
        return None
    if isinstance(axis, bool) or not isinstance(axis, (int, tuple, list)):
        raise RtxError(f"{op}: axis must be None, an int or a tuple of ints, got {axis!r}")
    if isinstance(axis, (tuple, list)):
        if not all(isinstance(a, int) and not isinstance(a, bool) for a in axis):
            raise RtxError(f"{op}: axis must be a tuple of ints, got {axis!r}")
        return tuple(axis) if axis else None
    return axis


def int_axis(axis: Any, dim: Any, op: str, default: int | None = None) -> int:
    """One axis: ``axis`` or torch's ``dim`` (not both), ``default`` where neither is given."""
    if axis is None and dim is None and default is not None:
        return default
    a = axis_arg(axis, dim, op)
    if not isinstance(a, int):
        raise RtxError(f"{op}: axis must be an int, got {a!r}")
    return a


def tensor_arg(v: Any, op: str, name: str) -> Expr:
    """An expression given where a tensor is read (an index, a matrix): a python number is refused."""
    if type(v) is not Expr:
        raise RtxError(f"{op}: {name} must be a tensor expression, got {v!r}")
    return v


def ref_arg(ref: Any, op: str) -> tuple[Any, Any, Any]:
    """A reference model's head: ``(h, w, bias)``, bias None where it has none."""
    if not isinstance(ref, (tuple, list)) or len(ref) != 3:
        raise RtxError(f"{op}: ref must be the reference model's (h, w, bias), bias None if it has none; got {ref!r}")
    return ref[0], ref[1], ref[2]


def flag_arg(v: Any, op: str, name: str) -> bool:
    """A python bool given for a switch (``keepdim``): a string or a number is refused, not read as
    its truth value (``keepdim='no'`` would keep the dims)."""
    if not isinstance(v, bool):
        raise RtxError(f"{op}: {name} must be True or False, got {v!r}")
    return v


def int_arg(v: Any, op: str, name: str) -> int:
    """An integer given for a count, a size or an axis (anything with ``__index__``, as torch takes
    sizes; a float or a bool is refused, not truncated)."""
    if not isinstance(v, bool):
        try:
            return operator.index(v)
        except TypeError:
            pass
    raise RtxError(f"{op}: {name} must be an int, got {v!r}")


def ints_arg(v: Any, op: str, name: str) -> tuple[int, ...]:
    """One integer or a sequence of them: a shape, a permutation, axes (``(n,)`` for one)."""
    if isinstance(v, (tuple, list)):
        return tuple(int_arg(a, op, name) for a in v)
    return (int_arg(v, op, f"{name} (an int or a tuple of ints)"),)


def reduction_fn(op: str, text: str) -> Callable[..., Expr]:
    def fn(x: ExprLike, axis: Any = None, keepdim: bool = False, *, dim: Any = None) -> Expr:
        return node(op, x, axis=axis_arg(axis, dim, op), keepdim=flag_arg(keepdim, op, "keepdim"))

    return _doc(
        fn,
        op,
        f"{text} over ``axis`` (None or (): all), keeping reduced dims as size 1 if ``keepdim``.",
        f"rx.{op}(rx.var('x'), axis=-1)",
        f"{op}(x, axis=-1, keepdim=False)",
    )


@dataclass(frozen=True)
class D:
    """The input of a derivative rule.

    ``n`` is the forward node (operands ``a``, ``b``, ``srcs``), ``g`` the cotangent of its
    result and ``y`` the result itself — for reductions both in keepdim form, so they
    broadcast against the operand. ``g_ndim`` / ``n_ndim`` are the ranks of ``g`` and of the
    result. A rule returns one cotangent per operand (None where there is none); broadcast
    operands are summed back to their shape by the VJP pass, not by the rule.
    """

    n: Expr
    g: Expr
    y: Expr
    g_ndim: int = -1
    n_ndim: int = -1
    src_shapes: tuple[tuple[int, ...], ...] = ()
    #: per operand: the half dtype eager holds it in where a kernel may hold it wider (a computed
    #: fp16 / bf16 value, not an input or a view of one); None otherwise
    rounded: tuple[torch.dtype | None, ...] = ()

    def as_eager_holds(self, e: Expr, k: int = 0) -> Expr:
        """``e`` (operand ``k``, or a value of its dtype) rounded as eager's tensor holds operand
        ``k``: a kernel keeps a computed half value in fp32 between its ops, so a comparison with a
        statistic the forward took of the rounded value (a max over a stored half intermediate)
        rounds it too."""
        dtype = self.rounded[k] if k < len(self.rounded) else None
        return e if dtype is None else node("cast", node("cast", e, dtype=torch.float32), dtype=dtype)

    @property
    def a(self) -> Expr:
        return self.n.srcs[0]

    @property
    def b(self) -> Expr:
        return self.n.srcs[1]

    @property
    def srcs(self) -> tuple[Expr, ...]:
        return self.n.srcs


def zeros_like(g: Expr) -> Expr:
    """torch's ``zeros_like(grad)``: 0 at every element of ``g``'s shape and dtype, inf and NaN
    cotangents included (``g * 0`` is NaN there). ``g < g`` holds nowhere, NaN included.

    The derivative of a piecewise-constant op (floor, sign, ...): torch gives exactly 0 there.
    A mask keeps a cotangent where it holds and gives exactly 0 elsewhere: ``where(mask, g, 0)``,
    torch's ``where`` / ``masked_fill``; a product ``g * mask`` is right only where torch's own
    rule multiplies too (abs, amax / amin, dropout), NaN then as in torch."""
    return node("where", node("lt", g, g), g, 0.0)


def no_grad(d: D) -> tuple[None, ...]:
    """Comparisons, logic, detach: no operand receives a gradient."""
    return tuple(None for _ in d.n.srcs)
