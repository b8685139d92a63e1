"""Expansion: a bound user graph -> a graph of primitives the analyzer and code generator read.

* composites are replaced by their decompositions (cast back to torch's result dtype where
  the decomposition computes in another), and their nodes remember the composite they came
  from, which names the fusion pattern;
* reductions carry their axes normalized (a sorted tuple); a reduction over no axes (a 0-dim
  operand) is the operand itself, converted;
* scalar-only subexpressions (constants, element counts) are folded into constants: their
  values are kernel arguments like any constant;
* a constant the expansion makes (a composite's number operand, a folded count) is a node of its
  own, named after where it came from (``of``: a composite's parameter, ``eps``; ``folded``: the
  op folded, a reduction's ``rcount``): it never shares a kernel's
  scalar argument with an equal number written elsewhere, so which numbers share one (and the
  kernel's source) does not depend on their values, nor on sizes (a row of 8 beside ``* 8.0``);
* an output that is an input is copied (an output is always a fresh tensor).

The eager traffic model is charged on the user's graph: a composite costs what torch's own
kernel for it costs, not its decomposition.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from types import MappingProxyType
from typing import Any

import torch

from ..errors import RtxError
from ..expr import Expr, node, walk
from ..ops import REGISTRY, DtypeRule, OpKind
from ..ops.reduction import SINGLE
from .bind import Info, infer_all
from .online import normalized_after


@dataclass(frozen=True)
class Graph:
    """A typed graph of primitive ops for one input signature (dtypes and shapes)."""

    outputs: tuple[tuple[str, Expr], ...]  # output key -> primitive root
    inputs: tuple[Expr, ...]  # the kernel's var nodes, in call order
    nodes: tuple[Expr, ...]  # primitives reachable from the outputs, operands first
    info: Mapping[Expr, Info]
    origin: Mapping[Expr, str]  # node -> composite op it came from
    written: Mapping[Expr, Expr]  # node -> the outermost composite node it came from
    eager_launches: int
    eager_bytes: int

    def of(self, n: Expr) -> Info:
        return self.info[n]

    def ops(self, nodes: list[Expr]) -> int:
        """How many ops the user wrote among ``nodes``: a composite (softmax, sparsemax) is one,
        however many primitives it lowers to. ``FusionConfig``'s op limits count these."""
        return len({self.written.get(n, n) for n in nodes})


def is_leaf(n: Expr, info: Mapping[Expr, Info]) -> bool:
    """Loaded or passed, never computed by a fusion group: vars, constants, scalar-valued nodes
    (math on scalar inputs is recomputed by each kernel that reads it)."""
    return (n.is_var or n.is_const) or info[n].is_scalar


def _eager_cost(n: Expr, info: Mapping[Expr, Info]) -> tuple[int, int]:
    """Eager torch's launches and bytes for node ``n``: its op's own model (``OpDef.eager``), or
    ``eager_launches`` kernels reading each operand once and writing the result once."""
    opdef, srcs = REGISTRY[n.op], [info[s] for s in n.srcs]
    operands, result = [i.nbytes for i in srcs], info[n].nbytes
    if opdef.eager is not None:
        return opdef.eager(operands, result, [i.shape for i in srcs], [i.dtype for i in srcs], **n.attr_dict)
    return opdef.eager_launches, (result + sum(operands) if opdef.eager_launches else 0)


def expand(outputs: list[tuple[str, Expr]], inputs: tuple[Expr, ...], metas: tuple[Info, ...]) -> Graph:
    """Type ``outputs`` for inputs with ``metas`` (in ``inputs`` order) and lower them to primitives."""
    info: dict[Expr, Info] = {v: m for v, m in zip(inputs, metas)}
    typed: list[Expr] = list(inputs)
    roots = [e for _, e in outputs]
    infer_all(roots, info, typed)

    eager_launches = eager_bytes = 0
    for n in walk(roots):
        opdef = REGISTRY[n.op]
        me = info[n]
        if opdef.kind not in (OpKind.LEAF, OpKind.SCALAR) and not me.is_scalar:
            launches, nbytes = _eager_cost(n, info)
            eager_launches += launches
            eager_bytes += nbytes

    memo: dict[Expr, Expr] = {}
    origin: dict[Expr, str] = {}
    written: dict[Expr, Expr] = {}
    _lower_all(roots, info, typed, memo, origin, written)
    prim = [(k, _fold_scalars(memo[e], info, typed, origin, written)) for k, e in outputs]
    for k, p in prim:
        if info[p].symbolic:
            raise RtxError(f"output {k!r} depends only on scalar inputs: compute it in python")
    for i, (k, p) in enumerate(prim):
        if p.is_var:  # outputs that are leaves still need a kernel producing a fresh tensor
            c = node("cast", p, dtype=info[p].dtype)
            infer_all([c], info, typed)
            prim[i] = (k, c)
    return Graph(
        outputs=tuple(prim),
        inputs=tuple(inputs),
        nodes=tuple(walk([p for _, p in prim])),
        info=MappingProxyType(info),
        origin=MappingProxyType(origin),
        written=MappingProxyType(written),
        eager_launches=eager_launches,
        eager_bytes=eager_bytes,
    )


def _lower_all(
    roots: list[Expr],
    info: dict[Expr, Info],
    typed: list[Expr],
    memo: dict[Expr, Expr],
    origin: dict[Expr, str],
    written: dict[Expr, Expr],
) -> None:
    """Fill ``memo`` (node -> its primitive form) for every node reachable from ``roots``."""
    for n in walk(roots):
        if n in memo:
            continue
        srcs = tuple(memo[s] for s in n.srcs)
        opdef = REGISTRY[n.op]
        me = info[n]
        if opdef.kind is OpKind.COMPOSITE and not me.is_scalar:
            start = len(typed)
            types = (
                {"shapes": [info[x].shape for x in srcs], "dtypes": [info[x].dtype for x in srcs]}
                if opdef.typed_decompose
                else {}
            )
            srcs = _named_numbers(srcs, opdef.decompose)
            d = opdef.decompose(*srcs, **n.attr_dict, **types)
            infer_all([d], info, typed)
            _lower_all([d], info, typed, memo, origin, written)
            p = memo[d]
            if info[p].dtype != me.dtype:
                p = _typed(node("cast", p, dtype=me.dtype), info, typed)
            for m in typed[start:]:
                origin.setdefault(m, n.op)
            for m in _inside(p, srcs):  # its primitives, typed before too (interned: a saving plan's statistics)
                written[m] = n  # outermost last: a composite inside another counts as that one
        else:
            attrs = n.attr_dict
            if opdef.canonical is not None and not me.is_scalar:
                attrs = opdef.canonical([info[x].shape for x in srcs], **attrs)
            if opdef.kind is OpKind.REDUCTION and not me.is_scalar and not attrs["axis"]:
                # reducing a 0-dim tensor: the single element's reduction, converted
                single = SINGLE.get(n.op)
                p = _typed(single(srcs[0]), info, typed) if single is not None else srcs[0]
                if info[p].dtype != me.dtype:
                    p = _typed(node("cast", p, dtype=me.dtype), info, typed)
            elif opdef.rule is DtypeRule.CAST and info[srcs[0]].dtype == me.dtype:
                p = srcs[0]  # a cast to the dtype it has: nothing to compute
            elif all(a is b for a, b in zip(srcs, n.srcs)) and attrs == n.attr_dict:
                p = n
            else:
                p = _typed(Expr(n.op, srcs, attrs), info, typed)
            if opdef.regroups and not me.is_scalar:
                p = _flatten_rows_of_product(p, info, typed)
            if opdef.kind is OpKind.CONTRACTION:
                p = normalized_after(p, lambda e: info[e], lambda e: _typed(e, info, typed))
        memo[n] = p
        memo[p] = p


def _flatten_rows_of_product(p: Expr, info: dict[Expr, Info], typed: list[Expr]) -> Expr:
    """``reshape(f(a @ b), (..., n))`` that only regroups the product's rows, ``b`` a matrix and ``f``
    elementwise over the product (with scalars and per-column operands): ``f(reshape(a) @ b)``.

    The flattened logits of a causal LM's loss (``logits.view(-1, vocab)``) are then the product
    of the flattened hidden states (a free view of them), which a row kernel can reduce tile by
    tile without ever writing it; eager values are the same."""
    (x,) = p.srcs
    shape, have = info[p].shape, info[x].shape
    if len(shape) < 2 or not have or shape[-1] != have[-1] or shape == have:
        return p  # (a 1-d result: its operand would be 1-d too, not a product's rows)
    chain: list[Expr] = []
    c = x
    while REGISTRY[c.op].kind is OpKind.ELEMENTWISE:
        tensors = [s for s in c.srcs if not info[s].is_scalar and info[s].shape == have]
        narrow = [s for s in c.srcs if not info[s].is_scalar and info[s].shape != have]
        if len(tensors) != 1 or any(len(info[s].shape) > 1 for s in narrow):
            return p
        chain.append(c)
        c = tensors[0]
    if REGISTRY[c.op].kind is not OpKind.CONTRACTION or c.attr("sum_batch") or c.attr("ta"):
        return p
    if c.attr_dict.get("summed"):
        return p
    a, b = c.srcs
    if len(info[b].shape) != 2 or info[c].shape != have:
        return p
    k = info[a].shape[-1]
    flat = _typed(Expr(p.op, (a,), {**p.attr_dict, "shape": (*shape[:-1], k)}), info, typed)
    out = _typed(Expr(c.op, (flat, b), c.attr_dict), info, typed)
    for e in reversed(chain):  # rebuild f over the new product
        srcs = tuple(out if info[s].shape == have and not info[s].is_scalar else s for s in e.srcs)
        out = _typed(Expr(e.op, srcs, e.attr_dict), info, typed)
    return out


def own_const(value: bool | int | float, **origin: Any) -> Expr:
    """A constant the expansion made, keyed by where it came from (see the module docstring)."""
    return Expr("const", (), {"value": value, **origin})


@cache
def _parameters(decompose: Callable[..., Expr]) -> tuple[str, ...]:
    return tuple(inspect.signature(decompose).parameters)


def _named_numbers(srcs: tuple[Expr, ...], decompose: Callable[..., Expr]) -> tuple[Expr, ...]:
    """A composite's operands, each number given as a constant named after its parameter (``eps``)."""
    names = _parameters(decompose)
    return tuple(
        own_const(s.attr("value"), of=names[k]) if s.is_const and len(s.attrs) == 1 and k < len(names) else s
        for k, s in enumerate(srcs)
    )


def _inside(root: Expr, operands: tuple[Expr, ...]) -> list[Expr]:
    """The nodes of a composite's decomposition ``root``: reachable from it without passing through
    its ``operands`` (whose cones belong to the ops that made them)."""
    stop = set(operands)
    found: list[Expr] = []
    seen: set[Expr] = set()
    stack = [root]
    while stack:
        m = stack.pop()
        if m in seen or m in stop:
            continue
        seen.add(m)
        found.append(m)
        stack.extend(m.srcs)
    return found


def _typed(e: Expr, info: dict[Expr, Info], typed: list[Expr]) -> Expr:
    infer_all([e], info, typed)
    return e


def _fold_scalars(
    root: Expr, info: dict[Expr, Info], typed: list[Expr], origin: dict[Expr, str], written: dict[Expr, Expr]
) -> Expr:
    """Replace scalar-only subexpressions (constants, element counts) by constants of their value."""
    memo: dict[Expr, Expr] = {}
    for n in walk([root]):
        i = info[n]
        if i.is_scalar and not i.symbolic and not n.is_const:
            new = own_const(i.value, folded=n.op)
        else:
            srcs = tuple(memo[s] for s in n.srcs)
            new = n if all(a is b for a, b in zip(srcs, n.srcs)) else Expr(n.op, srcs, n.attr_dict)
        if new not in info:
            info[new] = i
            typed.append(new)
        for side in (origin, written):  # a node typed inside a composite may lie outside its cone
            if n in side:
                side.setdefault(new, side[n])
        memo[n] = new
    return memo[root]


def float_dtype_of(nodes: list[Expr], info: Mapping[Expr, Info]) -> torch.dtype:
    """fp64 when any node computes in float64, else fp32: the kernel's float scalar type."""
    return torch.float64 if any(info[n].dtype is torch.float64 for n in nodes) else torch.float32
