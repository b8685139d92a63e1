"""Expression nodes: immutable, interned, and typed only when bound to tensors.

An :class:`Expr` is ``(op, attrs, srcs)``. Building the same expression twice gives the
same object, so structural equality is identity and subexpressions are shared. Dtypes and
shapes are not stored: they follow from the input tensors at call time (see ``bind.py``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .errors import RtxError

Scalar = bool | int | float

_INTERN: weakref.WeakValueDictionary[tuple, Expr] = weakref.WeakValueDictionary()


def _attr_key(value: Any) -> Any:
    # 1, 1.0, True and -0.0 / 0.0 are different constants
    if isinstance(value, (bool, int, float)):
        return (type(value).__name__, repr(value))
    return value


class Expr:
    """A node of an expression DAG. Build them with :func:`rtxdsl.var` and the ops.

    Example:
        >>> import rtxdsl as rx
        >>> x = rx.var("x")
        >>> rx.relu(x * 2.0 + 1.0)
        relu(x * 2.0 + 1.0)
    """

    __slots__ = ("op", "attrs", "srcs", "__weakref__")
    op: str
    attrs: tuple[tuple[str, Any], ...]
    srcs: tuple[Expr, ...]

    def __new__(cls, op: str, srcs: tuple[Expr, ...] = (), attrs: dict[str, Any] | None = None) -> Expr:
        items = tuple(sorted(attrs.items())) if attrs else ()
        key = (op, tuple([(k, _attr_key(v)) for k, v in items]) if items else (), tuple(map(id, srcs)))
        node = _INTERN.get(key)
        if node is None:
            node = object.__new__(cls)
            object.__setattr__(node, "op", op)
            object.__setattr__(node, "attrs", items)
            object.__setattr__(node, "srcs", srcs)
            _INTERN[key] = node
        return node

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Expr is immutable")

    __hash__ = object.__hash__

    def attr(self, name: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == name:
                return v
        return default

    @property
    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)

    def __bool__(self) -> bool:
        raise RtxError(
            f"expression {self!r} has no truth value: use rx.where(...) instead of if/and/or, "
            "and write a < b and b < c as (a < b) & (b < c)"
        )

    def __repr__(self) -> str:
        from .printer import format_expr

        return format_expr(self)

    # Operators and torch-named methods are attached by dsl.py from the op registry.


def node(op: str, *srcs: Expr | Scalar, **attrs: Any) -> Expr:
    """Build ``op`` over ``srcs`` (python scalars become constants) after checking arity."""
    opdef = _registry().get(op)
    if opdef is None:
        raise RtxError(f"unknown op {op!r}")
    if len(srcs) != opdef.arity:
        raise RtxError(f"op {op!r} takes {opdef.arity} operands, got {len(srcs)}")
    return Expr(op, tuple(as_expr(s, op) for s in srcs), attrs)


def _registry() -> dict:
    from .ops import REGISTRY  # imported on first use: ops/ builds expressions too

    globals()["_registry"] = lambda: REGISTRY
    return REGISTRY


def as_expr(value: Any, where: str = "expression") -> Expr:
    """An :class:`Expr` for ``value``: expressions pass through, python scalars become constants."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, (bool, int, float)):
        return Expr("const", (), {"value": value})
    if isinstance(value, torch.Tensor):
        raise RtxError(
            f"{where}: a torch.Tensor cannot be embedded in an expression; "
            "declare it with rx.var(name) and pass it when calling the kernel"
        )
    raise RtxError(f"{where}: cannot use {type(value).__name__} {value!r} as an expression")


def walk(roots: list[Expr]) -> list[Expr]:
    """Every node reachable from ``roots``, operands before their users."""
    order: list[Expr] = []
    seen: set[int] = set()
    stack: list[tuple[Expr, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        n, expanded = stack.pop()
        if expanded:
            order.append(n)
            continue
        if id(n) in seen:
            continue
        seen.add(id(n))
        stack.append((n, True))
        stack.extend((s, False) for s in reversed(n.srcs) if id(s) not in seen)
    return order


def variables(roots: list[Expr]) -> tuple[Expr, ...]:
    """The ``var`` leaves of ``roots`` in first-appearance order (left to right, depth first)."""
    found: dict[str, Expr] = {}
    for n in walk(roots):
        if n.op == "var":
            name = n.attr("name")
            prev = found.get(name)
            if prev is not None and prev is not n:
                raise RtxError(
                    f"input {name!r} is declared twice with different dtypes "
                    f"({prev.attr('dtype')} and {n.attr('dtype')})"
                )
            found.setdefault(name, n)
    return tuple(found.values())
