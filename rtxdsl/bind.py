"""Binding: expressions + concrete input tensors -> a typed, shaped graph of primitives.

Dtypes, shapes and errors come from running each op's torch reference on meta tensors,
so broadcasting, type promotion and argument checks are torch's own. Composites are then
expanded into primitives, and each primitive node is typed the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .dtypes import SHORT_NAME, check_supported
from .errors import ShapeError, UnsupportedDtypeError
from .expr import Expr, node, walk
from .ops import REGISTRY, OpKind, apply_ref, category


@dataclass
class Info:
    """What binding learnt about one node: a meta tensor, or a python scalar value."""

    value: Any  # meta torch.Tensor, or python scalar for scalar-only nodes

    @property
    def is_scalar(self) -> bool:
        return not isinstance(self.value, torch.Tensor)

    @property
    def dtype(self) -> torch.dtype:
        v = self.value
        if isinstance(v, torch.Tensor):
            return v.dtype
        if isinstance(v, bool):
            return torch.bool
        return torch.int64 if isinstance(v, int) else torch.float32

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape) if isinstance(self.value, torch.Tensor) else ()

    @property
    def numel(self) -> int:
        return self.value.numel() if isinstance(self.value, torch.Tensor) else 1


@dataclass
class Bound:
    """A typed graph of primitive ops for one set of input metadata."""

    outputs: list[tuple[str, Expr]]  # output key -> primitive root
    nodes: list[Expr]  # primitives reachable from the outputs, operands first
    info: dict[int, Info]
    var_index: dict[str, int]  # input name -> position in the call's tensors
    origin: dict[int, str] = field(default_factory=dict)  # node id -> composite it came from
    eager_launches: int = 0
    eager_bytes: int = 0
    contiguous: tuple[bool, ...] = ()  # per input tensor

    def of(self, n: Expr) -> Info:
        return self.info[id(n)]


def _describe(n: Expr) -> str:
    return f"input {n.attr('name')!r}" if n.op == "var" else f"op {n.op!r}"


def _infer(n: Expr, info: dict[int, Info]) -> Info:
    if n.op == "const":
        return Info(n.attr("value"))
    opdef = REGISTRY[n.op]
    vals = [info[id(s)].value for s in n.srcs]
    if opdef.kind is not OpKind.SCALAR:
        for i, (s, v) in enumerate(zip(n.srcs, vals)):
            if isinstance(v, torch.Tensor) and category(v.dtype) not in opdef.accepts:
                raise UnsupportedDtypeError(
                    f"op {n.op!r} does not accept {SHORT_NAME.get(v.dtype, v.dtype)} operands "
                    f"(operand {i}: {s!r}); it takes {', '.join(sorted(opdef.accepts))}"
                )
    try:
        out = apply_ref(opdef, vals, n.attr_dict)
    except (RuntimeError, TypeError, IndexError, ValueError) as exc:
        msg = str(exc).splitlines()[0]
        kind = (
            ShapeError
            if any(w in msg for w in ("size", "shape", "dimension", "broadcast", "range"))
            else UnsupportedDtypeError
        )
        raise kind(f"op {n.op!r} in {n!r}: {msg}") from None
    if isinstance(out, torch.Tensor):
        check_supported(out.dtype, f"the result of op {n.op!r}")
        if category(out.dtype) not in opdef.results:
            raise UnsupportedDtypeError(
                f"op {n.op!r} in {n!r} would give a {SHORT_NAME[out.dtype]} result; "
                f"rtxdsl computes it only for {', '.join(sorted(opdef.results))} results"
            )
    return Info(out)


def infer_all(roots: list[Expr], info: dict[int, Info]) -> None:
    """Type every node reachable from ``roots`` that ``info`` does not know yet."""
    for n in walk(roots):
        if id(n) not in info:
            info[id(n)] = _infer(n, info)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def bind(outputs: list[tuple[str, Expr]], inputs: tuple[Expr, ...], tensors: tuple[torch.Tensor, ...]) -> Bound:
    """Type ``outputs`` for ``tensors`` (already validated, in ``inputs`` order) and expand composites."""
    info: dict[int, Info] = {}
    for v, t in zip(inputs, tensors):
        info[id(v)] = Info(_meta(t))
    infer_all([e for _, e in outputs], info)

    eager_launches = eager_bytes = 0
    prim: dict[int, Expr] = {}
    origin: dict[int, str] = {}
    for n in walk([e for _, e in outputs]):
        opdef = REGISTRY[n.op]
        me = info[id(n)]
        if opdef.kind in (OpKind.ELEMENTWISE, OpKind.REDUCTION, OpKind.COMPOSITE) and not me.is_scalar:
            eager_launches += opdef.eager_launches
            eager_bytes += _bytes(me) + sum(_bytes(info[id(s)]) for s in n.srcs)
        srcs = [prim[id(s)] for s in n.srcs]
        if opdef.kind is not OpKind.COMPOSITE:
            p = n if all(a is b for a, b in zip(srcs, n.srcs)) else Expr(n.op, tuple(srcs), n.attr_dict)
        else:
            known = set(info)
            p = opdef.decompose(*srcs, **n.attr_dict)
            infer_all([p], info)
            if info[id(p)].dtype != me.dtype:
                p = node("cast", p, dtype=me.dtype)
                infer_all([p], info)
            for m in walk([p]):
                if id(m) not in known and opdef.pattern:
                    origin.setdefault(id(m), n.op)
        if id(p) not in info:
            infer_all([p], info)
        prim[id(n)] = p
    prim_outputs = [(k, _fold_scalars(prim[id(e)], info, origin)) for k, e in outputs]
    # outputs that are leaves still need a kernel to produce a fresh tensor
    for i, (k, p) in enumerate(prim_outputs):
        if p.op == "var":
            c = node("cast", p, dtype=info[id(p)].dtype)
            infer_all([c], info)
            prim_outputs[i] = (k, c)
    nodes = walk([p for _, p in prim_outputs])
    return Bound(
        outputs=prim_outputs,
        nodes=nodes,
        info=info,
        var_index={v.attr("name"): i for i, v in enumerate(inputs)},
        origin=origin,
        eager_launches=eager_launches,
        eager_bytes=eager_bytes,
        contiguous=tuple(t.is_contiguous() for t in tensors),
    )


def _fold_scalars(root: Expr, info: dict[int, Info], origin: dict[int, str]) -> Expr:
    """Replace scalar-only subexpressions (constants, element counts) by constants of their value.

    Their values become kernel arguments like any constant, so sizes still never enter source.
    """
    memo: dict[int, Expr] = {}
    for n in walk([root]):
        i = info[id(n)]
        if i.is_scalar and n.op != "const":
            new = Expr("const", (), {"value": i.value})
        else:
            srcs = tuple(memo[id(s)] for s in n.srcs)
            new = n if all(a is b for a, b in zip(srcs, n.srcs)) else Expr(n.op, srcs, n.attr_dict)
        info.setdefault(id(new), Info(i.value) if i.is_scalar else i)
        if id(n) in origin:
            origin.setdefault(id(new), origin[id(n)])
        memo[id(n)] = new
    return memo[id(root)]


def _bytes(i: Info) -> int:
    return 0 if i.is_scalar else i.numel * i.dtype.itemsize
