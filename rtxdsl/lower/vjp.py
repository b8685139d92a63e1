"""The VJP pass: a primitive graph -> forward and backward expressions, lowered like any other.

* The forward computes the outputs plus every reduction the backward reads (max, logsumexp,
  mean, m2...): row statistics are saved, in the compute dtype (fp32 for half inputs, so a
  row whose sum overflows fp16 still has finite statistics), not recomputed.
* The backward computes each needed input gradient from the forward's inputs, those
  statistics and the output cotangents (``_g<k>``). Cheap elementwise values are recomputed
  inside it, not saved; broadcast operands get their gradient summed back to their shape.

Derivative rules live with each op's declaration (``OpDef.derivative``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass

import torch

from ..dtypes import compute_dtype
from ..errors import RtxError
from ..expr import Expr, node, walk
from ..ops import REGISTRY, DtypeRule, OpKind
from ..ops.helpers import D
from ..ops.reduction import factors
from .analyze import reduced_in_rows
from .bind import Info, infer_all
from .expand import Graph, is_leaf

#: names of the backward's extra inputs and outputs (user inputs may not use them)
#: placeholder input and output names of gradient kernels: cotangents, saved statistics,
#: gradients, the unit gradients a loss computed with ``grad_in_forward`` keeps, and what such a
#: loss's gradients read of its other inputs, computed first
COTANGENT, SAVED, GRADIENT, KEPT, PRE = "_g", "_s", "_d", "_j", "_p"


@dataclass(frozen=True)
class Gradients:
    """Expressions of a differentiated graph."""

    forward: tuple[tuple[str, Expr], ...]  # user outputs, then saved statistics
    backward: tuple[tuple[str, Expr], ...]  # one gradient per input that needs it
    user_keys: tuple[str, ...]
    saved_keys: tuple[str, ...]
    grad_of: tuple[tuple[str, str], ...]  # input name -> backward output key
    float_outputs: tuple[bool, ...]  # which user outputs carry a gradient
    #: saved keys that are a user output itself (``_read_back``): the forward returns its buffer once
    shared_keys: tuple[str, ...] = ()


def sum_to(c: Expr, have: tuple[int, ...], want: tuple[int, ...], full: tuple[int, ...] | None = None) -> Expr:
    """Sum a cotangent over the dims its operand was broadcast along.

    ``have`` is the cotangent's shape, ``full`` the shape it stands for (an elementwise node's:
    a sum's cotangent broadcasts to it unexpanded); a dim summed where the cotangent only
    broadcasts is expanded first (a bias added before a mean over rows gets the rows' sum, not
    one row). A cotangent smaller than its operand (it broadcasts to it) is left as it is: it is
    expanded on the host, for free, when handed back to autograd.
    """
    full = tuple(torch.broadcast_shapes(have, full)) if full is not None else tuple(have)
    if len(full) < len(want):
        full = (1,) * (len(want) - len(full)) + full
    lead = len(full) - len(want)
    keep = tuple(lead + i for i, s in enumerate(want) if s == 1 and full[lead + i] != 1)
    if not keep and not lead:
        return c
    if not lead and tuple(have) == full and _sums_inner_batch(c, keep, len(full)):
        # a product's last batch dims: summed in its own K loop, never written per batch
        return Expr(c.op, c.srcs, {**c.attr_dict, "summed": len(keep)})
    if tuple(have) != full:
        c = node("expand", c, shape=full)
    if keep:
        c = node("sum", c, axis=keep, keepdim=True)
    if lead:
        c = node("sum", c, axis=tuple(range(lead)), keepdim=False)
    return c


def _sums_inner_batch(c: Expr, keep: tuple[int, ...], rank: int) -> bool:
    """Is ``c`` a product whose sum over ``keep`` is over its last batch dims only?"""
    if REGISTRY[c.op].kind is not OpKind.CONTRACTION or c.attr("sum_batch") or c.attr_dict.get("summed"):
        return False
    return keep == tuple(range(rank - 2 - len(keep), rank - 2))


class _Cotangents:
    """The gradients accumulated so far (by node), and the types of the nodes they build."""

    def __init__(self, graph: Graph) -> None:
        self.info: dict[Expr, Info] = dict(graph.info)
        self.keep: list[Expr] = []  # new nodes, alive while they key ``info``
        # per node, its cotangent in parts by where they come from: the composite (layer_norm,
        # softmax) whose primitives read the node, or None. A composite's parts are summed among
        # themselves first, as eager's one backward for it sums them: a layer norm over one element
        # gives exactly 0 so, where summed with another branch's cotangent first it took that
        # branch's value with it (w + big - big: 0, not w)
        self.parts: dict[Expr, dict[Expr | None, Expr]] = {}
        self.written = graph.written

    def total(self, target: Expr) -> Expr | None:
        """``target``'s cotangent: its parts, each summed first, then added in the order they came."""
        parts = self.parts.get(target)
        if not parts:
            return None
        out = None
        for p in parts.values():
            out = p if out is None else node("add", out, p)
        return out

    def typed(self, e: Expr) -> Info:
        infer_all([e], self.info, self.keep)
        return self.info[e]

    def accumulate(self, target: Expr, c: Expr, origin: Expr | None = None) -> None:
        """Add cotangent ``c`` (from a primitive of composite ``origin``, or None) to ``target``'s
        part from there; two products by one factor add their other factors first,
        ``a * f + b * f = (a + b) * f`` (softmax's two paths into its exp: one product per element
        fewer)."""
        parts = self.parts.setdefault(target, {})
        old = parts.get(origin)
        shared = _common_factor(old, c) if old is not None else None
        if shared is not None:
            f, a, b = shared
            parts[origin] = node("mul", node("add", a, b), f)
        else:
            parts[origin] = c if old is None else node("add", old, c)

    def seed(self, graph: Graph, absent: Set[int] = frozenset()) -> list[bool]:
        """One cotangent input per floating-point output but those in ``absent`` (outputs the loss
        does not use: none of their paths is built); which outputs are floating-point."""
        floats = []
        for k, (_, root) in enumerate(graph.outputs):
            ri = graph.of(root)
            floats.append(not ri.is_scalar and ri.dtype.is_floating_point)
            if floats[-1] and k not in absent:
                g = Expr("var", (), {"name": f"{COTANGENT}{k}", "dtype": None})
                self.info[g] = Info.tensor(ri.shape, ri.dtype)
                self.keep.append(g)
                self.accumulate(root, g)
        return floats

    def propagate(self, graph: Graph, n: Expr) -> None:
        """Apply ``n``'s derivative rule to its cotangent, accumulating into its operands'."""
        g = self.total(n)
        if g is None or is_leaf(n, graph.info):
            return
        opdef = REGISTRY[n.op]
        if opdef.derivative is None:
            raise RtxError(f"op {n.op!r} has no derivative rule")
        y, info, factor = n, self.info, None
        if opdef.kind is OpKind.REDUCTION and not n.attr("keepdim"):
            axes = n.attr("axis")
            g, y = node("unsqueeze", g, axes=axes), node("unsqueeze", n, axes=axes)
        elif opdef.kind is OpKind.MOVEMENT and self.typed(g).shape != info[n].shape:
            g = node("expand", g, shape=info[n].shape)  # re-indexing needs the cotangent at every element
        elif opdef.kind is OpKind.CONTRACTION:
            # a GEMM's operands share one dtype: the cotangent is the product's, as eager autograd's
            # (always written: saved statistics replace reductions in wider dtypes after this
            # typing; a cast to the dtype a value already has is dropped when the backward expands);
            # and it multiplies a whole matrix: one that broadcasts (a sum's) is expanded first
            if self.typed(g).shape != info[n].shape:
                g = node("expand", g, shape=info[n].shape)
            g, factor = _constant_factor(g)  # (h * c) @ w = (h @ w) * c: c scales each product once
            g = node("cast", g, dtype=info[n.srcs[0]].dtype)  # (a product kept in fp32: its operands')
        rule_in = D(
            n,
            g,
            y,
            g_ndim=len(self.typed(g).shape),
            n_ndim=len(info[n].shape),
            src_shapes=tuple(info[s].shape for s in n.srcs),
            rounded=tuple(_held_rounded(s, info) for s in n.srcs),
        )
        for s, c in zip(n.srcs, opdef.derivative(rule_in)):
            si = info[s]
            if c is None or si.is_scalar or not si.dtype.is_floating_point:
                continue
            full = info[n].shape if opdef.kind is OpKind.ELEMENTWISE else None
            c = sum_to(c, self.typed(c).shape, si.shape, full)  # (a product summing its batch: still one)
            self.accumulate(s, c if factor is None else node("mul", c, factor), self.written.get(n))


def _held_rounded(s: Expr, info: Mapping[Expr, Info]) -> torch.dtype | None:
    """The half dtype eager holds ``s`` in where a kernel may hold it in fp32 (a computed fp16 /
    bf16 value); None for wider dtypes and for inputs and their views (loaded as stored)."""
    dtype = info[s].dtype
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    while REGISTRY[s.op].kind is OpKind.MOVEMENT and s.srcs:
        s = s.srcs[0]
    return None if is_leaf(s, info) else dtype


def _constant_factor(g: Expr) -> tuple[Expr, Expr | None]:
    """``(h, c)`` where cotangent ``g = h * c`` for a finite nonzero constant ``c`` (a product's
    scale: attention's ``dS * scale``), else ``(g, None)``: a contraction's operand gradients take
    ``c`` as a factor of their products, once per element of each (in the GEMM's epilogue), where
    ``h * c`` cost a multiply per element of the cotangent (each score: in the K loop)."""
    pair = factors(g)
    for h, c in (pair, pair[::-1]) if pair else ():
        if c.is_const and math.isfinite(c.attr("value")) and c.attr("value") != 0:
            return h, c
    return g, None


def _common_factor(p: Expr, q: Expr) -> tuple[Expr, Expr, Expr] | None:
    """``(f, a, b)`` where ``p = a * f`` and ``q = b * f`` (either order), else None."""
    ps, qs = factors(p), factors(q)
    for f in ps:
        if any(f is g for g in qs):
            a = ps[1] if ps[0] is f else ps[0]
            b = qs[1] if qs[0] is f else qs[0]
            return f, a, b
    return None


def differentiate(
    graph: Graph, user: tuple[tuple[str, Expr], ...], needs: tuple[bool, ...], absent: Set[int] = frozenset()
) -> Gradients:
    """Gradients of ``graph`` (lowered from ``user``) with respect to the inputs flagged in ``needs``;
    ``absent``: the outputs (by position) whose cotangents the loss does not give. A backward for
    fewer outputs reads a subset of the saved statistics, under the same names."""
    cot = _Cotangents(graph)
    floats = cot.seed(graph, absent)
    for n in reversed(graph.nodes):
        cot.propagate(graph, n)
    # the forward saves its row statistics and its contractions' products (a GEMM is not
    # recomputed), but for products it only reduces over their rows and never writes: those the
    # backward recomputes in tiles (marked ``recompute``), never a tokens x vocabulary buffer
    tiled = {n for n in graph.nodes if REGISTRY[n.op].kind is OpKind.CONTRACTION and reduced_in_rows(graph, n)}
    # (an extreme's derivative compares its operand with it: both recomputed alike, never saved)
    reductions = [
        n
        for n in graph.nodes
        if REGISTRY[n.op].kind in (OpKind.REDUCTION, OpKind.CONTRACTION)
        and n not in tiled
        and not (REGISTRY[n.op].reduce is not None and REGISTRY[n.op].reduce.exact)
    ]
    reductions += _multiplied(graph, tiled, set(reductions))
    saved = {r: Expr("var", (), {"name": f"{SAVED}{k}", "dtype": None}) for k, r in enumerate(reductions)}
    read_back = _read_back(graph, reductions)
    saved |= {i: e for i, (_, _, e) in read_back.items()}
    backward: list[tuple[str, Expr]] = []
    grad_of: list[tuple[str, str]] = []
    for v, need in zip(graph.inputs, needs):
        e = cot.total(v)
        if not need or e is None:
            continue
        # the gradient in its input's dtype, also where it is computed from saved statistics (fp32
        # for half inputs), which widen it: else autograd's engine casts it in a launch of its own,
        # after twice the bytes written (a cast to its own dtype is dropped when the backward
        # expands; a cotangent handed on as it is, a residual's, is its output's dtype already)
        if not e.is_var or cot.typed(e).dtype != graph.of(v).dtype:
            e = _cast_under_regroups(e, graph.of(v).dtype)
        key = f"{GRADIENT}{len(backward)}"
        grad_of.append((v.attr("name"), key))
        backward.append((key, _substitute(e, saved, tiled, lambda s: cot.typed(s).dtype)))
    if not backward:
        raise RtxError("no input that requires grad reaches a floating-point output")
    forward, saved_keys = _saving(graph, user, backward, reductions, saved, read_back)
    return Gradients(
        forward=tuple(forward),
        backward=tuple(backward),
        user_keys=tuple(k for k, _ in user),
        saved_keys=tuple(saved_keys),
        grad_of=tuple(grad_of),
        float_outputs=tuple(floats),
        shared_keys=tuple(key for key, _, _ in read_back.values() if key in saved_keys),
    )


def _read_back(graph: Graph, reductions: list[Expr]) -> dict[Expr, tuple[str, Expr, Expr]]:
    """The values the backward reads back from an output (``OpDef.reads_output``, or a computed
    half output: :func:`_half_output`): node ->
    (saved key, the output's root, the value as the backward reads it: the output's views undone,
    widened to the value's dtype). An output ``cast(y)``, or a view of it, of such a composite
    gives ``y``, whose recompute would read a saved product (attention's unnormalized ``P @ v``:
    the training forward saved it beside the output it divides, 33.5 MB at 32 heads x 4096 x 128
    in bf16); the output is saved instead, the very tensor returned (eager SDPA saves its own)."""
    out: dict[Expr, tuple[str, Expr, Expr]] = {}
    reduced = {n for n in walk([s for r in reductions for s in r.srcs])}  # what saved statistics reduce
    for _, root in graph.outputs:
        y = _under(root, casts=True)
        if not _composite_output(y, graph):
            # a half output as stored: its views undone, never its cast (the value under ``h =
            # y.half()`` is ``y``, unrounded, wherever else it is read)
            y = _under(root, casts=False)
            if not _half_output(y, graph, reduced):
                continue
        if y in out:
            continue
        key = f"{SAVED}{len(reductions) + len(out)}"
        back = Expr("var", (), {"name": key, "dtype": None})
        if graph.of(root).shape != graph.of(y).shape:
            back = node("reshape", back, shape=graph.of(y).shape)
        out[y] = (key, root, node("cast", back, dtype=graph.of(y).dtype))
    return out


def _composite_output(y: Expr, graph: Graph) -> bool:
    """Is ``y`` the output of a composite that reads it back (``OpDef.reads_output``) over a product?"""
    composite = graph.origin.get(y)
    if composite is None or not REGISTRY[composite].reads_output:
        return False
    return any(REGISTRY[n.op].kind is OpKind.CONTRACTION for n in walk([y]))


def _cast_under_regroups(e: Expr, dtype: torch.dtype) -> Expr:
    """``cast(e, dtype)`` taken under the reshapes ``e`` ends with (grouped-query attention's dq,
    ``[B, Hkv, G, T, D]`` regrouped to ``[B, Hq, T, D]``): the product's epilogue rounds it and the
    regrouped buffer is a view, where a cast after the reshape was a launch of its own (and the
    product written in fp32)."""
    if REGISTRY[e.op].regroups:
        return Expr(e.op, (_cast_under_regroups(e.srcs[0], dtype), *e.srcs[1:]), e.attr_dict)
    return node("cast", e, dtype=dtype)


def _under(root: Expr, casts: bool) -> Expr:
    """The value output ``root`` views (and, with ``casts``, casts)."""
    y = root
    while REGISTRY[y.op].regroups or (casts and REGISTRY[y.op].rule is DtypeRule.CAST):
        y = y.srcs[0]
    return y


def _half_output(y: Expr, graph: Graph, reduced: Set[Expr]) -> bool:
    """Is ``y`` (an output, its views undone) a computed half value that a statistic the forward
    saves reduces (one in ``reduced``)? The forward's kernels read it rounded, as it is stored
    (``codegen.source.rounded_values``): the statistic is of the rounded value (attention's
    logsumexp over scores also returned in fp16, a norm's over a residual kept by the lazy
    stream), so the backward reads the output back, as stored, rather than recompute it unrounded
    (rows whose probabilities no longer sum to one: fp16 scores at ``finfo.min`` gave gradients
    100x eager's error; model fuzzer program 2026122400033). An output no saved statistic reduces
    (a logsumexp returned itself) is recomputed unrounded."""
    return graph.of(y).dtype in (torch.float16, torch.bfloat16) and not is_leaf(y, graph.info) and y in reduced


def _multiplied(graph: Graph, tiled: Set[Expr], saved: Set[Expr]) -> list[Expr]:
    """The half operands of the products recomputed in tiles that the backward could compute
    otherwise than the forward did: those computed by more than one op. The forward saves them and
    the backward multiplies what the forward multiplied. Its saved logsumexp is of the forward's
    logits, and logits recomputed from an operand rounded elsewhere (``round(round(a + b) + c)``
    in one kernel, ``round(a + b + c)`` in another) no longer sum to one under it: a tied
    embedding's gradient through ``linear_cross_entropy(norm(h) @ w + h, E)`` in bf16 was ten
    times eager's error. A leaf, a view of one, or one op of leaves (a cast) is recomputed alike
    anywhere, and not saved (a weight's copy would cost its size)."""
    out: list[Expr] = []
    for c in graph.nodes:
        if c not in tiled:
            continue
        for s in c.srcs:
            half = graph.of(s).dtype in (torch.float16, torch.bfloat16)
            if half and s not in saved and not _recomputed_alike(s, graph) and all(s is not o for o in out):
                out.append(s)
    return out


def _recomputed_alike(s: Expr, graph: Graph) -> bool:
    """Is ``s`` a leaf, a view of leaves, or one elementwise op of those (one rounding)?"""
    ops = 0
    for n in walk([s]):
        if is_leaf(n, graph.info):
            continue
        kind = REGISTRY[n.op].kind
        if kind is OpKind.MOVEMENT:
            continue
        if kind is not OpKind.ELEMENTWISE:
            return False
        ops += 1
    return ops <= 1


def _saving(
    graph: Graph,
    user: tuple[tuple[str, Expr], ...],
    backward: list[tuple[str, Expr]],
    reductions: list[Expr],
    saved: dict[Expr, Expr],
    read_back: dict[Expr, tuple[str, Expr, Expr]],
) -> tuple[list[tuple[str, Expr]], list[str]]:
    """The forward's outputs: the user's, then each statistic the backward reads (in its compute
    dtype; a product, or a product's operand, in its own dtype, as eager autograd saves it)."""
    used = {n for _, e in backward for n in walk([e])}
    forward = list(user)
    saved_keys = []
    for k, r in enumerate(reductions):
        if saved[r] in used:
            dt = graph.of(r).dtype
            own = REGISTRY[r.op].kind is not OpKind.REDUCTION  # a product or an operand: as multiplied
            stat = r if own or compute_dtype(dt) == dt else node("cast", r, dtype=compute_dtype(dt))
            forward.append((f"{SAVED}{k}", stat))
            saved_keys.append(f"{SAVED}{k}")
    for key, root, back in read_back.values():
        if back in used:
            forward.append((key, root))
            saved_keys.append(key)
    return forward, saved_keys


def _substitute(
    e: Expr,
    repl: dict[Expr, Expr],
    recompute: Set[Expr] = frozenset(),
    dtype_of: Callable[[Expr], torch.dtype] | None = None,
) -> Expr:
    """``e`` with the nodes in ``repl`` replaced (saved values) and those in ``recompute`` marked.

    A saved statistic may be wider than the reduction it replaces (fp32 for a half row), which
    widens what is recomputed from it; a contraction's operand is cast back to its forward dtype
    (``dtype_of``: the dtype the forward multiplied in, as a GEMM's operands share one)."""
    memo: dict[Expr, Expr] = {}
    for n in walk([e]):
        if n in repl:
            memo[n] = repl[n]
            continue
        srcs = tuple(memo[s] for s in n.srcs)
        if dtype_of is not None and REGISTRY[n.op].kind is OpKind.CONTRACTION:
            srcs = tuple(m if m is s else node("cast", m, dtype=dtype_of(s)) for m, s in zip(srcs, n.srcs))
        if n in recompute:
            memo[n] = Expr(n.op, srcs, {**n.attr_dict, "recompute": True})
        elif all(a is b for a, b in zip(srcs, n.srcs)):
            memo[n] = n
        else:
            memo[n] = Expr(n.op, srcs, n.attr_dict)
    return memo[e]
