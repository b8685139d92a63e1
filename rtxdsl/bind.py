"""Binding: expressions + concrete input tensors -> a typed, shaped graph of primitives.

Dtypes and argument errors come from torch itself: each op's reference runs on a *probe*,
a one-element CPU tensor with the node's dtype and rank (promotion depends only on dtype,
category and rank, never on sizes). Shapes follow broadcasting and the reduction rule.
Meta tensors would give both at once, but their first use costs a second of lazy imports
inside torch; probes keep a new process's first call fast. Composites are then expanded
into primitives, and each primitive node is typed the same way.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from .dtypes import SHORT_NAME, check_supported
from .errors import ShapeError, UnsupportedDtypeError
from .expr import Expr, node, walk
from .ops import REGISTRY, OpKind, apply_ref, category


@dataclass
class Info:
    """What binding learnt about one node: shape and dtype (with a probe), or a python scalar."""

    value: Any = None  # python scalar, for scalar-only nodes
    shape: tuple[int, ...] = ()
    probe: torch.Tensor | None = None  # ones((1,) * rank) in the node's dtype

    @staticmethod
    def tensor(shape: tuple[int, ...], dtype: torch.dtype) -> Info:
        return Info(None, tuple(shape), torch.ones((1,) * len(shape), dtype=dtype))

    @property
    def is_scalar(self) -> bool:
        return self.probe is None

    @property
    def dtype(self) -> torch.dtype:
        if self.probe is not None:
            return self.probe.dtype
        v = self.value
        if isinstance(v, bool):
            return torch.bool
        return torch.int64 if isinstance(v, int) else torch.float32

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def like(self) -> Any:
        """What the torch reference sees for this node: its probe or its scalar."""
        return self.value if self.probe is None else self.probe


@dataclass(frozen=True)
class Shaped:
    """Shape without data, for ops that read only sizes (``rcount``)."""

    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)


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
    keep: list[Expr] = field(default_factory=list)  # nodes keyed by id in ``info``: kept alive

    def of(self, n: Expr) -> Info:
        return self.info[id(n)]


def _describe(n: Expr) -> str:
    return f"input {n.attr('name')!r}" if n.op == "var" else f"op {n.op!r}"


def _infer(n: Expr, info: dict[int, Info]) -> Info:
    if n.op == "const":
        return Info(n.attr("value"))
    opdef = REGISTRY[n.op]
    srcs = [info[id(s)] for s in n.srcs]
    if opdef.kind is OpKind.SCALAR:
        return Info(opdef.ref(*[Shaped(i.shape) for i in srcs], **n.attr_dict))
    for k, (s, i) in enumerate(zip(n.srcs, srcs)):
        if not i.is_scalar and category(i.dtype) not in opdef.accepts:
            raise UnsupportedDtypeError(
                f"op {n.op!r} does not accept {SHORT_NAME.get(i.dtype, i.dtype)} operands "
                f"(operand {k}: {s!r}); it takes {', '.join(sorted(opdef.accepts))}"
            )
    try:
        with warnings.catch_warnings():  # one-element probes make torch warn about e.g. var()'s dof
            warnings.simplefilter("ignore")
            out = apply_ref(opdef, [i.like for i in srcs], n.attr_dict)
        if not isinstance(out, torch.Tensor):
            return Info(out)
        shape = _shape(n, srcs)
    except (RuntimeError, TypeError, IndexError, ValueError) as exc:
        msg = str(exc).splitlines()[0]
        words = ("size", "shape", "dimension", "broadcast", "range")
        kind = ShapeError if any(w in msg for w in words) else UnsupportedDtypeError
        raise kind(f"op {n.op!r} in {n!r}: {msg}") from None
    check_supported(out.dtype, f"the result of op {n.op!r}")
    if category(out.dtype) not in opdef.results:
        raise UnsupportedDtypeError(
            f"op {n.op!r} in {n!r} would give a {SHORT_NAME[out.dtype]} result; "
            f"rtxdsl computes it only for {', '.join(sorted(opdef.results))} results"
        )
    return Info.tensor(shape, out.dtype)


def _shape(n: Expr, srcs: list[Info]) -> tuple[int, ...]:
    """Broadcasting for elementwise ops, the reduction rule for ops with ``axis``/``keepdim``."""
    if n.op == "unsqueeze":
        out = list(srcs[0].shape)
        for ax in sorted(n.attr("axes")):
            out.insert(ax, 1)
        return tuple(out)
    if "keepdim" in dict(n.attrs):
        from .ops.reduction import axes_of

        x = srcs[0].shape
        axes = set(axes_of(n.attr("axis"), len(x))) if x else set()
        if n.attr("keepdim"):
            return tuple(1 if d in axes else s for d, s in enumerate(x))
        return tuple(s for d, s in enumerate(x) if d not in axes)
    return broadcast_shapes([i.shape for i in srcs if not i.is_scalar])


def broadcast_shapes(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """torch's broadcasting rule (torch.broadcast_shapes imports sympy on first use: a second)."""
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        for d, size in enumerate(s, ndim - len(s)):
            if size != out[d] and size != 1:
                if out[d] != 1:
                    raise ValueError(
                        f"shapes {' and '.join(str(tuple(x)) for x in shapes)} do not broadcast "
                        f"(size {out[d]} against {size} at dimension {d - ndim})"
                    )
                out[d] = size
    return tuple(out)


def infer_all(roots: list[Expr], info: dict[int, Info]) -> list[Expr]:
    """Type every node reachable from ``roots`` that ``info`` does not know yet; return those nodes.

    Known nodes are not descended into, so typing a new op over a large typed DAG costs
    only the new nodes (the lazy stream records one op at a time).
    """
    new: list[Expr] = []
    stack: list[tuple[Expr, bool]] = [(r, False) for r in roots]
    while stack:
        n, ready = stack.pop()
        if id(n) in info:
            continue
        if ready:
            info[id(n)] = _typed(n, info)
            new.append(n)
            continue
        stack.append((n, True))
        stack.extend((s, False) for s in n.srcs if id(s) not in info)
    return new


_MEMO: dict[tuple, Info] = {}


def _typed(n: Expr, info: dict[int, Info]) -> Info:
    """``_infer`` memoized on (op, attributes, operand dtypes and shapes): a loop types each op once."""
    srcs = [info[id(s)] for s in n.srcs]
    if n.op == "const" or all(i.is_scalar for i in srcs):
        return _infer(n, info)
    key = (n.op, n.attrs, tuple((i.dtype, i.shape) if not i.is_scalar else type(i.value) for i in srcs))
    hit = _MEMO.get(key)
    if hit is None:
        if len(_MEMO) > 4096:
            _MEMO.clear()
        hit = _MEMO[key] = _infer(n, info)
    return hit


def bind(outputs: list[tuple[str, Expr]], inputs: tuple[Expr, ...], tensors: tuple[torch.Tensor, ...]) -> Bound:
    """Type ``outputs`` for ``tensors`` (already validated, in ``inputs`` order) and expand composites."""
    info: dict[int, Info] = {}
    keep: list[Expr] = list(inputs)  # every node whose id keys ``info`` stays alive with the Bound
    for v, t in zip(inputs, tensors):
        info[id(v)] = Info.tensor(tuple(t.shape), t.dtype)
    keep += infer_all([e for _, e in outputs], info)

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
        if opdef.kind is OpKind.REDUCTION and info[id(srcs[0])].shape == ():
            p = node("cast", srcs[0], dtype=me.dtype)  # reducing a 0-dim tensor only converts it
        elif opdef.kind is not OpKind.COMPOSITE:
            p = n if all(a is b for a, b in zip(srcs, n.srcs)) else Expr(n.op, tuple(srcs), n.attr_dict)
        else:
            known = set(info)
            p = opdef.decompose(*srcs, **n.attr_dict)
            keep += infer_all([p], info)
            if info[id(p)].dtype != me.dtype:
                p = node("cast", p, dtype=me.dtype)
                keep += infer_all([p], info)
            for m in walk([p]):
                if id(m) not in known and opdef.pattern:
                    origin.setdefault(id(m), n.op)
        if id(p) not in info:
            keep += infer_all([p], info)
        prim[id(n)] = p
    prim_outputs = [(k, _fold_scalars(prim[id(e)], info, origin, keep)) for k, e in outputs]
    # outputs that are leaves still need a kernel to produce a fresh tensor
    for i, (k, p) in enumerate(prim_outputs):
        if p.op == "var":
            c = node("cast", p, dtype=info[id(p)].dtype)
            keep += infer_all([c], info)
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
        keep=keep,
    )


def _fold_scalars(root: Expr, info: dict[int, Info], origin: dict[int, str], keep: list[Expr]) -> Expr:
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
        info.setdefault(id(new), i)
        keep.append(new)
        if id(n) in origin:
            origin.setdefault(id(new), origin[id(n)])
        memo[id(n)] = new
    return memo[id(root)]


def _bytes(i: Info) -> int:
    return 0 if i.is_scalar else i.numel * i.dtype.itemsize
