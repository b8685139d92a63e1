"""Binding: expressions + input metadata -> every node's dtype and shape (or python value).

Dtypes and argument errors come from torch itself: each op's reference runs on a *probe*,
a one-element CPU tensor with the node's dtype and rank (promotion depends only on dtype,
category and rank, never on sizes). Shapes come from each op's declared shape rule
(broadcasting by default). Meta tensors would give both at once, but their first use costs
a second of lazy imports inside torch; probes keep a new process's first call fast.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..dtypes import SHORT_NAME, check_supported
from ..errors import RtxError, ShapeError, UnsupportedDtypeError, ZeroDivisorError
from ..expr import Expr
from ..lru import LRU
from ..ops import REGISTRY, OpKind, apply_ref, category


class Info(NamedTuple):
    """What binding learnt about one node: shape and dtype, or a python scalar value.

    (A NamedTuple, not a frozen dataclass: the lazy stream builds one per recorded op.)
    """

    value: Any = None  # python scalar, for scalar-only nodes
    shape: tuple[int, ...] = ()
    dtype_: torch.dtype | None = None  # None: a python scalar
    symbolic: bool = False  # a scalar known only at call time (a scalar input, or math on one)

    @staticmethod
    def tensor(shape: tuple[int, ...], dtype: torch.dtype) -> Info:
        return Info(None, tuple(shape), dtype)

    @staticmethod
    def scalar_input(value: bool | int | float) -> Info:
        """A python number given for a var: typed like a python scalar, its value an argument."""
        return Info(value, (), None, True)

    @property
    def is_scalar(self) -> bool:
        return self.dtype_ is None

    @property
    def dtype(self) -> torch.dtype:
        if self.dtype_ is not None:
            return self.dtype_
        v = self.value
        if isinstance(v, bool):
            return torch.bool
        return torch.int64 if isinstance(v, int) else torch.float32

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return 0 if self.is_scalar else self.numel * self.dtype.itemsize

    def like(self) -> Any:
        """What the torch reference sees for this node: a probe, or the scalar."""
        if self.dtype_ is None:
            return self.value
        return torch.ones((1,) * len(self.shape), dtype=self.dtype_)


@dataclass(frozen=True)
class Shaped:
    """Shape and dtype without data, for ops that read only those (``rcount``, ``eps_of``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)


def broadcast_shapes(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """torch's broadcasting rule (torch.broadcast_shapes imports sympy on first use: a second)."""
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        for d, size in enumerate(s, ndim - len(s)):
            if size != out[d] and size != 1:
                if out[d] != 1:
                    raise ShapeError(
                        f"shapes {' and '.join(str(tuple(x)) for x in shapes)} do not broadcast "
                        f"(size {out[d]} against {size} at dimension {d - ndim})"
                    )
                out[d] = size
    return tuple(out)


#: what torch's refusal on probes is about, by its words: the error class that says so (else RtxError)
_REFUSALS = (
    (ZeroDivisorError, ("ZeroDivisionError",)),  # a constant divisor of 0 (torch raises whatever the values)
    (ShapeError, ("size", "shape", "dimension", "broadcast", "range", "appears multiple times")),
    (UnsupportedDtypeError, ("dtype", "type", "not implemented for", "Long", "Float", "Half", "Bool")),
)


def _probe_dtype(n: Expr, srcs: list[Info]) -> Any:
    """torch's result for ``n`` on probes: a dtype, or a python value when every operand is a scalar."""
    opdef = REGISTRY[n.op]
    try:
        with warnings.catch_warnings():  # one-element probes make torch warn about e.g. var()'s dof
            warnings.simplefilter("ignore")
            out = apply_ref(opdef, [i.like() for i in srcs], n.attr_dict)
    except (RuntimeError, TypeError, IndexError, ValueError, AttributeError) as exc:
        if isinstance(exc, RtxError):
            raise
        _refuse_numbers(n, srcs)
        msg = str(exc).splitlines()[0]
        kind = next((k for k, words in _REFUSALS if any(w in msg for w in words)), RtxError)
        # torch was asked on one-element stand-ins of the operands' ranks: their shapes, not the probes'
        shapes = ", ".join(repr(i.value) if i.is_scalar else str(list(i.shape)) for i in srcs)
        raise kind(f"op {n.op!r} in {n!r} (operands {shapes}): torch refuses it: {msg}") from None
    if not isinstance(out, torch.Tensor):
        return ("value", out)
    return out.dtype


#: (op, attrs, operand dtypes and ranks) -> torch's answer on probes: a loop types each op once
_PROBES: LRU[tuple, Any] = LRU(8192)


def _probe_key(i: Info) -> Any:
    if not i.is_scalar:
        return (i.dtype, len(i.shape))
    if isinstance(i.value, int) and not i.symbolic:
        return (type(i.value), i.value)
    return type(i.value)


def _scalar_key(i: Info) -> Any:
    v = i.value
    return (type(v), v if isinstance(v, int) else None, i.symbolic)  # ints by value (int ** -1 raises)


#: (op, attrs, operand types) -> the node's Info: a loop, or the lazy stream recording the same op
#: over same-typed operands again, types it with one lookup
_TYPED: LRU[tuple, Info] = LRU(16384)


def infer(n: Expr, srcs: list[Info]) -> Info:
    """Type one node from its operands' infos."""
    if n.is_const:
        return Info(n.attr("value"))
    parts = []
    tensor = False
    for i in srcs:
        if i.dtype_ is not None:
            tensor = True
            parts.append((i.dtype_, i.shape))
        else:
            parts.append(_scalar_key(i))
    if not tensor:  # a python value: computed, not memoized
        return _infer(n, srcs)
    key = (n.op, n.attrs, tuple(parts))
    hit = _TYPED.get(key)
    if hit is None:
        hit = _infer(n, srcs)
        _TYPED.put(key, hit)
    return hit


def _infer(n: Expr, srcs: list[Info]) -> Info:
    opdef = REGISTRY[n.op]
    if opdef.kind is OpKind.SCALAR:
        return Info(opdef.ref(*[Shaped(i.shape, i.dtype) for i in srcs], **n.attr_dict))
    for k, (s, i) in enumerate(zip(n.srcs, srcs)):
        if not i.is_scalar and category(i.dtype) not in opdef.accepts:
            raise UnsupportedDtypeError(
                f"op {n.op!r} does not accept {SHORT_NAME.get(i.dtype, i.dtype)} operands "
                f"(operand {k}: {s!r}); it takes {', '.join(sorted(opdef.accepts))}"
            )
    if opdef.result_dtype is not None:
        try:
            answer = opdef.result_dtype([i.dtype for i in srcs], **n.attr_dict)
        except RtxError as exc:
            raise type(exc)(f"op {n.op!r} in {n!r}: {exc}") from None
    elif all(i.is_scalar for i in srcs) and srcs:
        answer = _probe_dtype(n, srcs)
    else:
        # integer constants key by value: torch's errors may depend on them (int ** -1)
        key = (n.op, n.attrs, tuple(_probe_key(i) for i in srcs))
        answer = _PROBES.get(key)
        if answer is None:
            answer = _probe_dtype(n, srcs)
            _PROBES.put(key, answer)
    if isinstance(answer, tuple):
        return Info(answer[1], symbolic=any(i.symbolic for i in srcs))
    check_supported(answer, f"the result of op {n.op!r}")
    if category(answer) not in opdef.results:
        raise UnsupportedDtypeError(
            f"op {n.op!r} in {n!r} would give a {SHORT_NAME[answer]} result; "
            f"rtxdsl computes it only for {', '.join(sorted(opdef.results))} results"
        )
    shapes = [i.shape for i in srcs if not i.is_scalar]
    try:
        shape = opdef.shape(shapes, **n.attr_dict) if opdef.shape is not None else broadcast_shapes(shapes)
    except RtxError as exc:
        raise type(exc)(f"op {n.op!r} in {n!r}: {exc}") from None
    except (IndexError, ValueError, TypeError, KeyError):  # a shape rule handed too few shapes
        _refuse_numbers(n, srcs)
        raise
    return Info.tensor(shape, answer)


def _refuse_numbers(n: Expr, srcs: list[Info]) -> None:
    """An op whose shape rule or torch reference failed where python numbers stand for some of its
    operands (``rx.cat([d, d])`` called with ``d=1.5``): a ShapeError naming them. A shape rule
    sees tensors' shapes only, so a number where a tensor belongs leaves it short of one."""
    named = (f"{s!r} = {i.value!r}" for s, i in zip(n.srcs, srcs) if i.is_scalar and not s.is_const)
    numbers = list(dict.fromkeys(named))
    if numbers:
        raise ShapeError(
            f"op {n.op!r} in {n!r} reads {', '.join(numbers)} as a tensor: pass a tensor (a python number "
            "is a scalar argument, for elementwise math)"
        )


def infer_all(roots: list[Expr], info: dict[Expr, Info], typed: list[Expr]) -> None:
    """Type every node reachable from ``roots`` that ``info`` does not know yet.

    Known nodes are not descended into, so typing a new op over a large typed DAG costs only
    the new nodes (the lazy stream records one op at a time). Typed nodes are appended to
    ``typed``, in the order they were typed (a composite's expansion reads which are its own).
    """
    stack: list[tuple[Expr, bool]] = [(r, False) for r in roots]
    while stack:
        n, ready = stack.pop()
        if n in info:
            continue
        if ready:
            info[n] = infer(n, [info[s] for s in n.srcs])
            typed.append(n)
            continue
        stack.append((n, True))
        stack.extend((s, False) for s in n.srcs if s not in info)
