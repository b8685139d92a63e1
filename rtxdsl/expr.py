"""Expression nodes: immutable, interned, typed only when bound to tensors.

An :class:`Expr` is ``(op, attrs, srcs)``. Building the same expression twice gives the
same object, so structural equality is identity and subexpressions are shared. Dtypes and
shapes are not stored: they follow from the input tensors at call time (``lower/bind.py``).

Operators, torch-named methods and the printed form are not written here: each comes
from the op registry (``rtxdsl/ops``), where every op declares its own.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .errors import RtxError
from .registry import REGISTRY, OpDef

Scalar = bool | int | float

#: structure -> weak reference to the one node with it (a plain dict of weakrefs: C-speed lookups,
#: each entry removed by its reference's callback when the node dies)
_INTERN: dict[tuple, weakref.ref] = {}


def _forget(key: tuple) -> Any:
    def callback(ref: weakref.ref) -> None:
        if _INTERN.get(key) is ref:
            del _INTERN[key]

    return callback


def _attr_key(value: Any) -> Any:
    # 1, 1.0, True and -0.0 / 0.0 are different constants
    if isinstance(value, (bool, int, float)):
        return (type(value).__name__, repr(value))
    if isinstance(value, tuple):
        return tuple(_attr_key(v) for v in value)
    return value


#: Python operators an op may claim (``Front.operators``); ``__rX__`` are the reflected forms
BINARY_OPERATORS = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "matmul")
COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")
UNARY_OPERATORS = ("neg", "abs", "invert")


class Expr:
    """A node of an expression DAG. Build them with :func:`rtxdsl.var` and the ops.

    Example:
        >>> import rtxdsl as rx
        >>> x = rx.var("x")
        >>> rx.relu(x * 2.0 + 1.0)
        relu(x * 2.0 + 1.0)
    """

    __slots__ = ("op", "attrs", "srcs", "_digest", "__weakref__")
    op: str
    attrs: tuple[tuple[str, Any], ...]
    srcs: tuple[Expr, ...]

    def __new__(cls, op: str, srcs: tuple[Expr, ...] = (), attrs: dict[str, Any] | None = None) -> Expr:
        if attrs:
            items = tuple(sorted(attrs.items()))
            key = (op, tuple([(k, _attr_key(v)) for k, v in items]), tuple(map(id, srcs)))
        else:
            items = ()
            key = (op, (), tuple(map(id, srcs)))
        ref = _INTERN.get(key)
        node = ref() if ref is not None else None
        if node is None:
            node = object.__new__(cls)
            object.__setattr__(node, "op", op)
            object.__setattr__(node, "attrs", items)
            object.__setattr__(node, "srcs", srcs)
            object.__setattr__(node, "_digest", None)
            _INTERN[key] = weakref.ref(node, _forget(key))
        return node

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Expr is immutable")

    __hash__ = object.__hash__
    #: not iterable: ``x[0], x[1], ...`` would never end (an expression's length is known only
    #: once it is bound to inputs); ``list(e)`` raises TypeError
    __iter__ = None

    def attr(self, name: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == name:
                return v
        return default

    @property
    def is_var(self) -> bool:
        """A named input (``rx.var``)."""
        return self.op == "var"

    @property
    def is_const(self) -> bool:
        """A python number written in the expression."""
        return self.op == "const"

    @property
    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)

    @property
    def digest(self) -> str:
        """A structural hash, stable across processes: sha256 over (op, attrs, operand digests)."""
        d = self._digest
        if d is None:
            for n in walk([self]):
                if n._digest is None:
                    text = f"{n.op}|{_attr_text_key(n.attrs)}|{','.join(s._digest for s in n.srcs)}"
                    object.__setattr__(n, "_digest", hashlib.sha256(text.encode()).hexdigest()[:20])
            d = self._digest
        return d

    def __bool__(self) -> bool:
        raise RtxError(
            f"expression {self!r} has no truth value: use rx.where(...) instead of if/and/or, "
            "and write a < b and b < c as (a < b) & (b < c)"
        )

    def __repr__(self) -> str:
        return format_expr(self)

    def __pos__(self) -> Expr:
        return self

    @property
    def mT(self) -> Expr:  # noqa: N802 - torch's name
        """The last two dims swapped, as ``torch.Tensor.mT`` (``q @ k.mT``)."""
        return self.transpose(-2, -1)

    @property
    def mH(self) -> Expr:  # noqa: N802 - torch's name
        """``mT`` (the values are real), as ``torch.Tensor.mH``."""
        return self.transpose(-2, -1)

    def __getattr__(self, name: str) -> Any:
        """Torch-named methods (``e.exp()``, ``e.sum(-1)``, ``e.var()``) from the registry."""
        entry = REGISTRY.methods.get(name)
        if entry is None:
            raise AttributeError(f"Expr has no attribute or method {name!r}")
        op, adapter = entry
        fn = adapter if adapter is not None else op.front.fn
        return functools.partial(fn, self)

    def __dir__(self) -> list[str]:
        return sorted({*object.__dir__(self), *REGISTRY.methods})


def _attr_text_key(attrs: tuple) -> str:
    return ";".join(f"{k}={_attr_key(v)!r}" for k, v in attrs)


def _operator(dunder: str, reflected: bool) -> Any:
    binary = dunder != "__getitem__"  # (an index is no operand: the op's own check names a bad key)

    def method(self: Expr, *args: Any) -> Any:
        op = REGISTRY.operators.get(dunder)
        if op is None or binary and any(isinstance(a, str) for a in args):
            # (a string is no operand: ``approximate not in ("none", "tanh")`` given an expression
            # is then False, and the op's own check names the argument)
            return NotImplemented
        if reflected:
            return op.front.fn(args[0], self)
        return op.front.fn(self, *args)

    method.__name__ = dunder
    return method


for _name in BINARY_OPERATORS:
    setattr(Expr, f"__{_name}__", _operator(f"__{_name}__", False))
    setattr(Expr, f"__r{_name}__", _operator(f"__r{_name}__", True))
for _name in (*COMPARISONS, *UNARY_OPERATORS, "getitem"):
    setattr(Expr, f"__{_name}__", _operator(f"__{_name}__", False))


def node(op: str, *srcs: Expr | Scalar, **attrs: Any) -> Expr:
    """Build ``op`` over ``srcs`` (python scalars become constants) after checking arity."""
    opdef = REGISTRY.ops.get(op)
    if opdef is None:
        raise RtxError(f"unknown op {op!r}")
    if opdef.arity is not None and len(srcs) != opdef.arity:
        raise RtxError(f"op {op!r} takes {opdef.arity} operands, got {len(srcs)}")
    return Expr(op, tuple([s if type(s) is Expr else as_expr(s, op) for s in srcs]), attrs)


#: (type, value, sign) -> weak reference to the constant node: python numbers recur constantly
_CONSTS: dict[tuple, weakref.ref] = {}


def _const(value: bool | int | float) -> Expr:
    key = (type(value), value, math.copysign(1.0, value) if type(value) is float else 0)
    ref = _CONSTS.get(key)
    node = ref() if ref is not None else None
    if node is None:  # (NaN never equals itself: it always takes this way, which is correct)
        node = Expr("const", (), {"value": value})
        _CONSTS[key] = weakref.ref(node, _forget_const(key))
    return node


def _forget_const(key: tuple) -> Any:
    def callback(ref: weakref.ref) -> None:
        if _CONSTS.get(key) is ref:
            del _CONSTS[key]

    return callback


def as_expr(value: Any, where: str = "expression") -> Expr:
    """An :class:`Expr` for ``value``: expressions pass through, python scalars become constants."""
    if type(value) is Expr:
        return value
    if isinstance(value, (bool, int, float)):
        return _const(value)
    if isinstance(value, torch.Tensor):
        raise RtxError(
            f"{where}: a torch.Tensor cannot be embedded in an expression; "
            "declare it with rx.var(name) and pass it when calling the kernel"
        )
    raise RtxError(f"{where}: cannot use {type(value).__name__} {value!r} as an expression")


def walk(roots: list[Expr]) -> list[Expr]:
    """Every node reachable from ``roots``, operands before their users."""
    order: list[Expr] = []
    seen: set[Expr] = set()
    stack: list[tuple[Expr, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        n, expanded = stack.pop()
        if expanded:
            order.append(n)
            continue
        if n in seen:
            continue
        seen.add(n)
        stack.append((n, True))
        stack.extend((s, False) for s in reversed(n.srcs) if s not in seen)
    return order


def substitute(roots: list[Expr], replace: Callable[[Expr], Expr | None]) -> list[Expr]:
    """``roots`` rebuilt with each node for which ``replace`` gives an expression replaced by it
    (what it stood on is dropped); nodes whose operands are unchanged are kept as they are.

    Example:
        >>> import rtxdsl as rx
        >>> x, y = rx.var("x"), rx.var("y")
        >>> substitute([rx.exp(x) + x], lambda n: y if n is x else None)
        [exp(y) + y]
    """
    memo: dict[Expr, Expr] = {}
    for n in walk(roots):
        new = replace(n)
        if new is None:
            srcs = tuple(memo[s] for s in n.srcs)
            new = n if all(a is b for a, b in zip(srcs, n.srcs)) else Expr(n.op, srcs, n.attr_dict)
        memo[n] = new
    return [memo[r] for r in roots]


def variables(roots: list[Expr]) -> tuple[Expr, ...]:
    """The ``var`` leaves of ``roots`` in first-appearance order (left to right, depth first)."""
    found: dict[str, Expr] = {}
    for n in walk(roots):
        if n.is_var:
            name = n.attr("name")
            prev = found.get(name)
            if prev is not None and prev is not n:
                raise RtxError(
                    f"input {name!r} is declared twice with different dtypes "
                    f"({prev.attr('dtype')} and {n.attr('dtype')})"
                )
            found.setdefault(name, n)
    return tuple(found.values())


# ---- printing ------------------------------------------------------------------------------
def _attr_text(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return repr(value)


#: a shared subexpression whose text is longer than this is printed once, as a binding
#: ``(_1 := ...)`` at its first use and by name after it (a DAG never prints as its tree)
SHARED_TEXT = 12
_HOLE = re.compile("\x00(\\d+)\x00")


def format_expr(e: Expr) -> str:
    """Readable text: infix where the op declares a symbol, calls elsewhere (parseable by rx.parse).

    A subexpression used more than once is bound to a name at its first use, with Python's
    ``:=`` (``(_1 := exp(x - amax(x))) / sum(_1)``), so the text grows with the DAG, not with
    the tree it unfolds to.
    """
    nodes = walk([e])
    uses: dict[Expr, int] = {}
    for n in nodes:
        for s in n.srcs:
            uses[s] = uses.get(s, 0) + 1
    text: dict[Expr, tuple[str, int]] = {}
    shared: list[str] = []  # the text of each named node, by its hole number
    for n in nodes:
        t, p = _format_one(n, [text[s] for s in n.srcs])
        if uses.get(n, 0) > 1 and not (n.is_var or n.is_const) and len(t) > SHARED_TEXT:
            shared.append(t)
            t, p = f"\x00{len(shared) - 1}\x00", 99
        text[n] = (t, p)
    return _bind_shared(text[e][0], shared, {v.attr("name") for v in nodes if v.is_var})


def _bind_shared(root: str, shared: list[str], taken: set[str]) -> str:
    """Fill the holes left to right: a binding at each named node's first use, its name after."""
    names: dict[int, str] = {}
    out: list[str] = []
    stack = [enumerate(_HOLE.split(root))]  # split alternates literal text and hole numbers
    while stack:
        i, piece = next(stack[-1], (-1, ""))
        if i < 0:
            stack.pop()
            out.append(")" if stack else "")
        elif i % 2 == 0:
            out.append(piece)
        elif int(piece) in names:
            out.append(names[int(piece)])
        else:
            name = _fresh_name(len(names) + 1, taken)
            names[int(piece)] = name
            out.append(f"({name} := ")
            stack.append(enumerate(_HOLE.split(shared[int(piece)])))
    return "".join(out)


def _fresh_name(k: int, taken: set[str]) -> str:
    name = f"_{k}"
    while name in taken:
        name = f"_{name}"
    return name


def _format_one(n: Expr, parts: list[tuple[str, int]]) -> tuple[str, int]:
    if n.is_var:
        return n.attr("name"), 99
    if n.is_const:
        return repr(n.attr("value")), 99
    opdef: OpDef = REGISTRY[n.op]
    sym, prec = opdef.symbol, opdef.precedence
    if sym is not None and len(parts) == 1:
        inner, p = parts[0]
        return f"{sym}{inner if p >= prec else f'({inner})'}", prec
    if sym is not None and len(parts) == 2:
        (lt, lp), (rt, rp) = parts
        chained = prec == 0  # comparisons chain in Python: never print a < b < c
        left = lt if lp > prec or (lp == prec and sym != "**" and not chained) else f"({lt})"
        right = rt if rp > prec or (rp == prec and sym in ("+", "*", "**")) else f"({rt})"
        return f"{left} {sym} {right}", prec
    args = [t for t, _ in parts] + [f"{k}={_attr_text(v)}" for k, v in n.attrs]
    name = opdef.public[0] if opdef.public and opdef.front.parse else n.op
    return f"{name}({', '.join(args)})", 99
