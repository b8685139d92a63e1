"""Block sparsity from the mask expression: the tiles a loop may skip.

A kernel that loops over tiles of a product's columns (a row kernel computing attention's scores
tile by tile) or over K slices of a GEMM whose A operand is a prologue (``P @ v``, ``dS @ k``,
``P.T @ dO``) computes nothing a tile contributes when a *guard* is false over the whole tile:
a condition of positions only (causal ``q_idx >= kv_idx``, a sliding window, a prefix) under
which every value the loop accumulates is its reduction's neutral value (0 for a sum or a
``tl.dot``, ``-inf`` for a max or a logsumexp). The generated kernel evaluates the guard over
each tile's ranges of positions (:func:`may_hold`, the writers' ``tile_scan``) and runs the loop
over the tiles where it may hold (``[lo, hi)``; a tile between two kept ones still runs).

The guard may also read integer or bool tensors (packed documents' ids, ``doc_q == doc_k``; a
key padding mask; a 2-D bool mask, or the guard that mask is itself: ``GemmTile.guard``): the
kernel loads each one's slice over the tile and takes its smallest and largest value as its range
(``load_range`` of the GEMM writer), on the device, at every sequence length, with nothing built
on the host (FlexAttention rebuilds a ``BlockMask`` there). The compute model, at plan time,
counts such tiles as kept.

A skipped tile's values are taken as the neutral ones, as FlashAttention and FlexAttention take
them: where the guard is false the decomposition multiplies ``0`` by values from its other
operands, which are assumed finite (an inf or NaN there, from ``q`` or ``k``, would give NaN in
eager torch, where a skipped tile gives nothing).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..expr import Expr
from ..registry import REGISTRY, OpKind
from .expand import Graph, is_leaf
from .roles import Role
from .spec import KernelSpec, Src

#: what an input of a reduction contributes nothing as (its tile may be skipped)
NEUTRAL = {"sum": 0.0, "amax": -math.inf, "logsumexp": -math.inf, "amin": math.inf}


def vanishing_guard(nodes: Iterable[Expr], graph: Graph, targets: list[tuple[Expr, float]]) -> Expr | None:
    """A condition of positions only (a ``where`` condition among ``nodes``, or one of its
    conjuncts) under which each target value is its neutral value; None when there is none."""
    seen: set[Expr] = set()
    for n in nodes:
        if n.op not in SELECTS:
            continue
        for g in _conjuncts(n.srcs[0]):
            if g in seen or not _positional(g, graph):
                continue
            seen.add(g)
            memo: dict[Expr, float | None] = {}
            if all(_off(t, g, memo) == want for t, want in targets):
                return g
    return None


def _conjuncts(c: Expr) -> list[Expr]:
    """``c`` and, through ``and``, each condition it requires."""
    out, stack = [], [c]
    while stack:
        x = stack.pop()
        out.append(x)
        if x.op in CONJUNCTIONS:
            stack.extend(x.srcs)
    return out


def _is_positions(x: Expr) -> bool:
    """An index-only movement op: positions along a dim, reading nothing."""
    op = REGISTRY[x.op]
    return op.kind is OpKind.MOVEMENT and not op.view


def _positional(c: Expr, graph: Graph) -> bool:
    """Is ``c`` computed from positions, scalars and integer or bool tensors only (document ids,
    a padding mask: the kernel scans a tile's range of their values, ``load_range``; one it cannot
    read at the tile leaves the tile undecided)?"""
    stack, seen = [c], set()
    while stack:
        x = stack.pop()
        if x in seen or x.is_const or _is_positions(x):
            continue
        seen.add(x)
        if is_leaf(x, graph.info):
            info = graph.of(x)
            if info.shape != () and (info.dtype.is_floating_point or info.dtype.is_complex):
                return False
            continue
        if REGISTRY[x.op].kind is not OpKind.ELEMENTWISE and not REGISTRY[x.op].view:  # (size-1 dims inserted)
            return False
        stack.extend(x.srcs)
    return True


Off = Callable[[Expr, Expr, Callable[[Expr], "float | None"]], "float | None"]


def _where_off(e: Expr, g: Expr, off: Callable[[Expr], float | None]) -> float | None:
    if any(c is g for c in _conjuncts(e.srcs[0])):  # false wherever g is
        return off(e.srcs[2])
    x, y = off(e.srcs[1]), off(e.srcs[2])
    return x if x is not None and x == y else None


def _sum_off(e: Expr, _g: Expr, off: Callable[[Expr], float | None]) -> float | None:
    x, y = off(e.srcs[0]), off(e.srcs[1])
    if (x == -math.inf and y != math.inf) or (e.op in COMMUTES and y == -math.inf and x != math.inf):
        return -math.inf  # -inf plus (or minus) a finite value
    return 0.0 if x == 0.0 and y == 0.0 else None


#: where guard ``g`` is false: an op's value from its operands' there (``off``), others taken as finite
OFF: dict[str, Off] = {
    "where": _where_off,
    "add": _sum_off,
    "sub": _sum_off,
    "mul": lambda e, _g, off: 0.0 if 0.0 in (off(e.srcs[0]), off(e.srcs[1])) else None,  # 0 times a finite value
    "div": lambda e, _g, off: 0.0 if off(e.srcs[0]) == 0.0 else None,
    "exp": lambda e, _g, off: 0.0 if off(e.srcs[0]) == -math.inf else None,
    "neg": lambda e, _g, off: None if (x := off(e.srcs[0])) is None else -x,
    "cast": lambda e, _g, off: off(e.srcs[0]),
    "detach": lambda e, _g, off: off(e.srcs[0]),
    "dropout": lambda e, _g, off: off(e.srcs[0]),  # a kept 0 scaled is 0
}
SELECTS = frozenset({"where"})  # ops whose first operand chooses between the other two
CONJUNCTIONS = frozenset({"and"})  # conditions true only where each operand is
COMMUTES = frozenset({"add"})


def _off(e: Expr, g: Expr, memo: dict[Expr, float | None]) -> float | None:
    """The value ``e`` takes wherever guard ``g`` is false (other operands taken as finite), or None."""
    if e not in memo:
        if e.is_const:
            value = e.attr("value")
            memo[e] = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        else:
            rule = OFF.get(e.op) if e.srcs else None
            memo[e] = None if rule is None else rule(e, g, lambda x: _off(x, g, memo))
    return memo[e]


# ---- the guard over a tile: intervals of positions ------------------------------------------------
#: An integer range is ``(lo, hi)``; a condition is ``(may, must)``: can it be true somewhere in the
#: tile, is it true everywhere. Each rule is written once over an algebra: the kernel's source text
#: (``TEXT``) or tensors of every tile at once (``TILES``, the compute model's count of kept tiles).
RANGES: dict[str, Callable[..., tuple[Any, Any]]] = {
    "add": lambda A, a, b: (A.add(a[0], b[0]), A.add(a[1], b[1])),
    "sub": lambda A, a, b: (A.sub(a[0], b[1]), A.sub(a[1], b[0])),
    "neg": lambda A, a: (A.neg(a[1]), A.neg(a[0])),
    "abs": lambda A, a: (A.max(A.max(a[0], A.neg(a[1])), 0), A.max(a[1], A.neg(a[0]))),
    "mul": lambda A, a, b: (
        A.min(A.min(A.mul(a[0], b[0]), A.mul(a[0], b[1])), A.min(A.mul(a[1], b[0]), A.mul(a[1], b[1]))),
        A.max(A.max(A.mul(a[0], b[0]), A.mul(a[0], b[1])), A.max(A.mul(a[1], b[0]), A.mul(a[1], b[1]))),
    ),
    "cast": lambda A, a: a,
}
COMPARES: dict[str, Callable[..., tuple[Any, Any]]] = {
    "ge": lambda A, a, b: (A.ge(a[1], b[0]), A.ge(a[0], b[1])),
    "gt": lambda A, a, b: (A.gt(a[1], b[0]), A.gt(a[0], b[1])),
    "le": lambda A, a, b: (A.ge(b[1], a[0]), A.ge(b[0], a[1])),
    "lt": lambda A, a, b: (A.gt(b[1], a[0]), A.gt(b[0], a[1])),
    "eq": lambda A, a, b: (A.both(A.ge(b[1], a[0]), A.ge(a[1], b[0])), A.both(A.ge(b[0], a[1]), A.ge(a[0], b[1]))),
}
LOGIC: dict[str, Callable[..., tuple[Any, Any]]] = {
    "and": lambda A, a, b: (A.both(a[0], b[0]), A.both(a[1], b[1])),
    "or": lambda A, a, b: (A.either(a[0], b[0]), A.either(a[1], b[1])),
    "invert": lambda A, a: (A.inv(a[1]), A.inv(a[0])),
}


class _Text:
    """The kernel's algebra: Triton source text of scalars."""

    TRUE, FALSE = "True", "False"
    add = staticmethod(lambda a, b: f"({a}) + ({b})")
    sub = staticmethod(lambda a, b: f"({a}) - ({b})")
    neg = staticmethod(lambda a: f"-({a})")
    mul = staticmethod(lambda a, b: f"({a}) * ({b})")
    min = staticmethod(lambda a, b: f"tl.minimum({a}, {b})")
    max = staticmethod(lambda a, b: f"tl.maximum({a}, {b})")
    ge = staticmethod(lambda a, b: f"({a}) >= ({b})")
    gt = staticmethod(lambda a, b: f"({a}) > ({b})")

    @staticmethod
    def both(a: str, b: str) -> str:
        if "False" in (a, b):  # (constants folded: a guard nothing decides is no scan)
            return "False"
        return b if a == "True" else a if b == "True" else f"({a}) & ({b})"

    @staticmethod
    def either(a: str, b: str) -> str:
        if "True" in (a, b):
            return "True"
        return b if a == "False" else a if b == "False" else f"({a}) | ({b})"

    @staticmethod
    def inv(a: str) -> str:
        return {"True": "False", "False": "True"}.get(a, f"({a}) == 0")


class _Tiles:
    """The compute model's algebra: int64 tensors over every tile at once."""

    TRUE, FALSE = True, False
    add = staticmethod(lambda a, b: a + b)
    sub = staticmethod(lambda a, b: a - b)
    neg = staticmethod(lambda a: -a)
    mul = staticmethod(lambda a, b: a * b)
    min = staticmethod(lambda a, b: torch.minimum(torch.as_tensor(a), torch.as_tensor(b)))
    max = staticmethod(lambda a, b: torch.maximum(torch.as_tensor(a), torch.as_tensor(b)))
    ge = staticmethod(lambda a, b: torch.as_tensor(a) >= b)
    gt = staticmethod(lambda a, b: torch.as_tensor(a) > b)
    both = staticmethod(lambda a, b: torch.as_tensor(a) & torch.as_tensor(b))
    either = staticmethod(lambda a, b: torch.as_tensor(a) | torch.as_tensor(b))
    inv = staticmethod(lambda a: ~torch.as_tensor(a))


TEXT, TILES = _Text(), _Tiles()


def batch_dim(d: int, nb: int) -> str:
    """``tile_dim``'s name of a GEMM's batch dim ``d`` of ``nb``: counted from the end of a value's
    dims (a matrix's two last), as values of fewer dims align."""
    return f"b{d - nb - 2}"


def tile_dim(spec: KernelSpec, i: int) -> str | None:
    """The tile dim positions node ``i`` of a guarded kernel runs along: a GEMM's ``"m"`` (the A
    tile's rows, its output rows) or ``"k"`` (the K slice), a row kernel's ``"rows"`` or
    ``"cols"``; ``"0"`` where it has size 1; a GEMM's batch dim ``"b-3"``, ``"b-4"``, ... (counted
    from the end of the value's dims: one position per program, a split of the keys); None along a
    row kernel's batch dims."""
    node = spec.nodes[i]
    rank = len(node.ones)
    axis = dict(node.attrs)["axis"] % rank
    if node.ones[axis]:
        return "0"
    if spec.kind != "gemm":
        return {rank - 2: "rows", rank - 1: "cols"}.get(axis)
    if axis < rank - 2:
        return batch_dim(axis, rank - 2)
    own = next(n for n in spec.nodes if REGISTRY[n.op].kind is OpKind.CONTRACTION and n.role is Role.FULL)
    dims = ("k", "m") if dict(own.attrs)["ta"] else ("m", "k")
    return {rank - 2: dims[0], rank - 1: dims[1]}.get(axis)


def may_hold(
    spec: KernelSpec,
    algebra: Any,
    bounds: Mapping[str, tuple[Any, Any]],
    slots: Sequence[Any],
    load_range: Callable[[int], tuple[Any, Any] | None] = lambda _: None,
) -> Any:
    """May the guard (``spec.gemm.guard``) hold anywhere in a tile whose dims span ``bounds``
    (``tile_dim``'s names), scalar argument ``k`` being ``slots[k]``, load ``k``'s values over the
    tile spanning ``load_range(k)`` (None: unknown, as at plan time)? In ``algebra``'s terms;
    ``algebra.TRUE`` when nothing about the tile decides it."""
    return guard_truth(spec, algebra, bounds, slots, load_range)[0]


def guard_truth(
    spec: KernelSpec,
    algebra: Any,
    bounds: Mapping[str, tuple[Any, Any]],
    slots: Sequence[Any],
    load_range: Callable[[int], tuple[Any, Any] | None] = lambda _: None,
) -> tuple[Any, Any]:
    """(may, must): does the guard hold somewhere in the tile (``may_hold``), and everywhere in it
    (a tile whose selects by it keep their first value: causal attention's below the diagonal)?
    ``algebra.FALSE`` for ``must`` where nothing about the tile decides it."""
    assert spec.gemm is not None

    def rng(ref: tuple) -> tuple[Any, Any] | None:
        kind, i = ref
        if kind is Src.SLOT:
            return slots[i], slots[i]
        if kind is Src.LOAD:  # data: the smallest and largest value the tile reads
            return load_range(i)
        if kind is not Src.NODE:
            return None
        node = spec.nodes[i]
        if REGISTRY[node.op].kind is OpKind.MOVEMENT and not REGISTRY[node.op].view:  # positions
            dim = tile_dim(spec, i)
            return (0, 0) if dim == "0" else bounds.get(dim) if dim is not None else None
        if REGISTRY[node.op].view:  # size-1 dims inserted (grouped attention's ids): the same values
            return rng(node.srcs[0])
        operands = [rng(r) for r in node.srcs]
        if node.op not in RANGES or any(o is None for o in operands):
            return None
        return RANGES[node.op](algebra, *operands)

    def truth(ref: tuple) -> tuple[Any, Any]:
        kind, i = ref
        if kind is Src.LOAD and (r := load_range(i)) is not None:  # a bool tensor (a key padding mask)
            return algebra.gt(r[1], 0), algebra.gt(r[0], 0)
        node = spec.nodes[i] if kind is Src.NODE else None
        if node is not None and node.op in COMPARES:
            a, b = (rng(r) for r in node.srcs)
            if a is not None and b is not None:
                return COMPARES[node.op](algebra, a, b)
        if node is not None and node.op in LOGIC:
            return LOGIC[node.op](algebra, *(truth(r) for r in node.srcs))
        return algebra.TRUE, algebra.FALSE

    assert spec.gemm.guard is not None
    return truth(spec.gemm.guard)


def guard_dims(spec: KernelSpec) -> set[str]:
    """The tile dims (``tile_dim``'s names) the positions under a GEMM's guard run along."""
    g = spec.gemm
    if g is None or g.guard is None or g.guard[0] is not Src.NODE:
        return set()
    dims, stack, seen = set(), [g.guard[1]], set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        node = spec.nodes[i]
        if REGISTRY[node.op].kind is OpKind.MOVEMENT and not REGISTRY[node.op].view:
            dims.add(tile_dim(spec, i))
        stack.extend(j for kind, j in node.srcs if kind is Src.NODE)
    return {d for d in dims if d is not None}


def kept_fraction(spec: KernelSpec, tiles: Mapping[str, tuple[int, int]], slots: Sequence[Any]) -> float:
    """The fraction of a guarded loop's tiles that run (the compute model's): ``tiles`` gives,
    per tile dim, its extent and block (a GEMM's ``m`` and ``k``, a row kernel's ``rows`` and
    ``cols``, a GEMM's batch dims ``b-3``, ... with block 1); each tile's range is evaluated as the
    kernel evaluates it."""
    if spec.gemm is None or spec.gemm.guard is None:
        return 1.0
    starts = [torch.arange(0, max(extent, 1), block) for extent, block in tiles.values()]
    grid = torch.meshgrid(*starts, indexing="ij")
    bounds = {d: (s, s + block - 1) for (d, (_, block)), s in zip(tiles.items(), grid)}
    keep = torch.as_tensor(may_hold(spec, TILES, bounds, slots))
    return float(keep.expand(grid[0].shape).double().mean())
