"""Rewrites of a kernel's body as a table: each rule a line, applied to a fixpoint.

A writer emits a kernel body as straight-line Triton statements (and the loops around them); this
pass reads them back as Python's AST, where a statement ``name = expr`` is a node keyed by its
structure, and rewrites them. What the rules may assume: a name assigned once in
the body holds one value wherever it is visible (a loop's running state, assigned again in the
loop, is never copied or dropped); an expression a name holds is forgotten where a name it reads
is assigned again; an expression is *pure* unless it calls one of ``EFFECTS`` (a load is kept
where it is: an in-place output's store may follow it).

=================  =========================================================================
rule               what it does
=================  =========================================================================
identity_cast      ``x.to(T)`` where ``x`` already is a ``T``: ``x``
common_subexpr     an expression a name still holds (visible here): that name
copy               ``a = b``, ``a`` assigned once, ``b`` not after it: ``a`` read as ``b``
load_other         ``tl.where(mask, a, c)``, ``a`` a load under ``mask`` read only there: ``other=c``
round_trip         ``b.to(H)``, ``b = a.to(H).to(W)`` with ``W`` wider than the half type ``H``: ``a.to(H)``
log_exp            ``tl.log(a * tl.exp(b))`` (or through a name holding it): ``tl.log(a) + b``
shape_pad          ``p + rows * 0`` (or ``p + 0``) in a pointer or an integer cast, ``p`` of ``rows``' shape: ``p``
narrow_compare     ``a.to(tl.int64) >= b.to(tl.int64)``, ``a`` and ``b`` signed integers: ``a >= b``
in_bounds          a mask or select of bounds checks the writer knows true (``offs_m < M``): dropped
sibling_sums       two ``tl.sum(x, axis=k)`` of full tiles, neither reading the other: one ``tl.reduce`` of both
dead               ``a = <pure>`` never read, a loop left empty: dropped
=================  =========================================================================
"""

from __future__ import annotations

import ast
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from copy import deepcopy as copy_tree

from ..log import log
from ..ops.reduction import ADD_PAIRS

#: calls with effects or an order (loads, stores, atomics, barriers): never merged, moved or dropped
EFFECTS = frozenset({"load", "store", "atomic_add", "atomic_xchg", "atomic_cas", "atomic_max", "debug_barrier"})


class Types(dict[str, str]):
    """A name -> its Triton dtype (``"tl.int64"``), where a cast or the writer says it; ``bounds``:
    the writer's facts ``(index, extent)``, each ``index < extent`` true everywhere (``offs_m < M``
    where ``M`` is a multiple of ``BLOCK_M``: ``GemmTile.even``)."""

    bounds: frozenset[tuple[str, str]] = frozenset()
    #: a 2-d kernel's index tiles defined outside its body -> the axes each spans (``rows``: 0);
    #: empty where the writer states none (``sibling_sums`` then applies nowhere)
    axes: Mapping[str, frozenset[int]] = {}
    #: names the writer computes as a float or an integer of 32 bits or more (``tl.sum`` adds them
    #: as they are, where it widens a narrower integer first)
    wide: frozenset[str] = frozenset()


#: the Triton type ``Types`` gives a name the writer's template defines as a signed integer whose
#: width it does not state (an index: ``rows``, ``offs_m``, ``ks``; int32, or int64 past 2**31)
SIGNED_INDEX = "signed"
_SIGNED = frozenset({"tl.int8", "tl.int16", "tl.int32", "tl.int64", SIGNED_INDEX})


def _calls(e: ast.AST) -> Iterator[str]:
    for n in ast.walk(e):
        if isinstance(n, ast.Call):
            f = n.func
            yield f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _pure(e: ast.AST) -> bool:
    return not any(c in EFFECTS for c in _calls(e))


def _names(e: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(e) if isinstance(n, ast.Name)}


def _assigned(body: Sequence[ast.stmt]) -> Counter[str]:
    """How often each name is assigned in ``body`` (loop variables and running states included)."""
    out: Counter[str] = Counter()
    for stmt in body:
        for n in ast.walk(stmt):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out[n.id] += 1
    return out


def _reads(body: Sequence[ast.stmt]) -> Counter[str]:
    """How often each name is read in ``body``."""
    return Counter(
        n.id for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    )


def _target(stmt: ast.stmt) -> str | None:
    """``name`` of a statement ``name = expr``; None for any other statement."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        return stmt.targets[0].id
    return None


class _Rename(ast.NodeTransformer):
    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if isinstance(node.ctx, ast.Load) and node.id in self.names:
            return ast.copy_location(ast.Name(self.names[node.id], ast.Load()), node)
        return node


def _cast(e: ast.expr) -> tuple[ast.expr, str] | None:
    """``(x, "tl.T")`` of ``x.to(tl.T)``; None for any other expression."""
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "to":
        if len(e.args) == 1 and not e.keywords:
            return e.func.value, ast.unparse(e.args[0])
    return None


def identity_cast(body: list[ast.stmt], once: Counter[str], types: Types) -> bool:
    """``x.to(tl.int64)`` where ``x`` is an int64 already (an integer op's result cast by habit)."""
    changed = False

    class Drop(ast.NodeTransformer):
        def visit_Call(self, node: ast.Call) -> ast.AST:
            nonlocal changed
            self.generic_visit(node)
            found = _cast(node)
            if found is not None and isinstance(found[0], ast.Name):
                x, dtype = found
                if once[x.id] == 1 and types.get(x.id) == dtype:
                    changed = True
                    return x
            return node

    for stmt in body:
        Drop().visit(stmt)
        name = _target(stmt)
        if name is not None and once[name] == 1:  # what the cast made: its type is known
            v = stmt.value
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "to" and v.args:
                types.setdefault(name, ast.unparse(v.args[0]))
            elif isinstance(v, ast.Name) and v.id in types:
                types.setdefault(name, types[v.id])
    return changed


class _Keys:
    """Structural keys of expressions: equal structures, one small int (each node's key built from its
    children's, so keying a statement costs its size, not its size times its depth)."""

    def __init__(self) -> None:
        self.table: dict[tuple, int] = {}
        self.memo: dict[ast.AST, int] = {}  # node -> its key (AST nodes hash by identity)

    def __call__(self, node: ast.AST) -> int:
        hit = self.memo.get(node)
        if hit is not None:
            return hit
        parts: list = [type(node).__name__]
        for f, v in ast.iter_fields(node):
            if isinstance(v, ast.AST):
                parts.append(self(v))
            elif isinstance(v, list):
                parts.append(tuple(self(x) if isinstance(x, ast.AST) else x for x in v))
            elif f != "ctx":
                parts.append(v)
        k = self.table.setdefault(tuple(parts), len(self.table))
        self.memo[node] = k
        return k


#: the expressions a name may hold (not names, constants or attributes such as ``tl.float32``)
_COMPUTED = (ast.Call, ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp, ast.Subscript, ast.IfExp)


def common_subexpr(body: list[ast.stmt], once: Counter[str], types: Types) -> bool:
    """An expression computed again where a name still holding it is visible: read the name."""
    changed = False

    def forget(held: dict[int, tuple[str, set[str]]], names: set[str]) -> None:
        """Names assigned: what mentions them, or is held by them, no longer holds."""
        for key in [k for k, (by, uses) in held.items() if by in names or uses & names]:
            del held[key]

    key = _Keys()

    def block(stmts: list[ast.stmt], held: dict[int, tuple[str, set[str]]]) -> None:
        nonlocal changed

        class Reuse(ast.NodeTransformer):
            def generic_visit(self, node: ast.AST) -> ast.AST:
                nonlocal changed
                if held and isinstance(node, _COMPUTED):
                    hit = held.get(key(node))
                    if hit is not None:
                        changed = True
                        return ast.copy_location(ast.Name(hit[0], ast.Load()), node)
                return super().generic_visit(node)

        for stmt in stmts:
            key.memo.clear()  # what the last statement's nodes were keyed: no longer needed
            if isinstance(stmt, (ast.For, ast.If, ast.While)):
                Reuse().visit(stmt.test if isinstance(stmt, (ast.If, ast.While)) else stmt.iter)
                inner = dict(held)  # a loop's body runs again: nothing it assigns holds at its top
                forget(inner, set(_assigned([stmt])))
                block(stmt.body, inner)
                block(stmt.orelse, dict(inner))
                forget(held, set(_assigned([stmt])))  # what the block assigned, after it
                continue
            name = _target(stmt)
            if name is None:
                Reuse().visit(stmt)
                forget(held, set(_assigned([stmt])))
                continue
            stmt.value = Reuse().generic_visit(stmt.value)  # the whole value is its own name's
            key.memo.clear()  # keys of nodes the reuse changed are stale
            forget(held, {name})
            v = stmt.value
            uses = _names(v)
            if isinstance(v, _COMPUTED) and _pure(v) and name not in uses and once[name] == 1:
                held.setdefault(key(v), (name, uses))  # (not a running state's start: two would be one)

    block(body, {})
    return changed


def _preorder(stmts: list[ast.stmt]) -> Iterator[ast.stmt]:
    for stmt in stmts:
        yield stmt
        for field in ("body", "orelse"):
            yield from _preorder(getattr(stmt, field, []))


def _through_names(
    body: list[ast.stmt],
    once: Counter[str],
    fold: Callable[[ast.stmt, dict[str, ast.expr]], None],
    holds: Callable[[ast.stmt, str], ast.expr | None],
) -> None:
    """Each block's statements in order, ``fold(stmt, held)`` on each: ``held`` maps a name assigned
    once to the value ``holds(stmt, name)`` kept of its statement, forgotten where the name or a
    name that value reads is assigned again (a rule that sees through names, in their own block)."""

    def block(stmts: list[ast.stmt]) -> None:
        held: dict[str, ast.expr] = {}
        for stmt in stmts:
            assigned = set(_assigned([stmt]))
            for n in [n for n, v in held.items() if n in assigned or _names(v) & assigned]:
                del held[n]
            fold(stmt, held)
            for field in ("body", "orelse"):
                block(getattr(stmt, field, []))
            name = _target(stmt)
            kept = holds(stmt, name) if name is not None and once[name] == 1 else None
            if kept is not None:
                held[name] = kept  # type: ignore[index]

    block(body)


def copy(body: list[ast.stmt], once: Counter[str], types: Types) -> bool:
    """``a = b`` (a self-copy: an identity op, a detach, a running state read off after its loop),
    ``a`` assigned once and ``b`` never again after it: every ``a`` reads ``b``; the line goes."""
    last: dict[str, int] = {}  # a name -> the last statement (in source order) assigning it
    order = list(_preorder(body))
    for k, stmt in enumerate(order):
        # a compound statement assigns its loop variable only (its body's statements follow in order)
        head = [stmt.target] if isinstance(stmt, ast.For) else [] if hasattr(stmt, "body") else [stmt]
        for n in (n for h in head for n in ast.walk(h)):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                last[n.id] = k
    at = {stmt: k for k, stmt in enumerate(order)}
    names: dict[str, str] = {}

    def drop(stmts: list[ast.stmt]) -> list[ast.stmt]:
        kept = []
        for stmt in stmts:
            name = _target(stmt)
            v = getattr(stmt, "value", None)
            if (
                name is not None
                and isinstance(v, ast.Name)
                and once[name] == 1
                and v.id != name
                and last.get(v.id, -1) < at[stmt]
            ):
                names[name] = names.get(v.id, v.id)
                continue
            for field in ("body", "orelse"):
                if hasattr(stmt, field):
                    setattr(stmt, field, drop(getattr(stmt, field)))
            kept.append(stmt)
        return kept

    body[:] = drop(body)
    if names:
        for stmt in body:
            _Rename(names).visit(stmt)
    return bool(names)


def dead(body: list[ast.stmt], once: Counter[str], types: Types) -> bool:
    """A pure value no statement reads: dropped (and a loop left with no statement)."""
    read = _reads(body)
    changed = False

    def drop(stmts: list[ast.stmt]) -> list[ast.stmt]:
        nonlocal changed
        kept = []
        for stmt in stmts:
            name = _target(stmt)
            if name is not None and once[name] == 1 and not read[name] and _pure(stmt.value):
                changed = True
                continue
            for field in ("body", "orelse"):
                if hasattr(stmt, field):
                    setattr(stmt, field, drop(getattr(stmt, field)))
            if isinstance(stmt, (ast.For, ast.While)) and not stmt.body and not stmt.orelse:
                changed = True  # a loop whose every statement was dead
                continue
            if isinstance(stmt, ast.If) and not stmt.body:
                stmt.body = [ast.Pass()]
            kept.append(stmt)
        return kept

    body[:] = drop(body)
    return changed


def _float_constant(e: ast.expr) -> bool:
    """``2.5``, ``float('-inf')``: a float a load may fill its masked lanes with."""
    if isinstance(e, ast.Constant):
        return isinstance(e.value, float)
    return (
        isinstance(e, ast.Call)
        and isinstance(e.func, ast.Name)
        and e.func.id == "float"
        and len(e.args) == 1
        and isinstance(e.args[0], ast.Constant)
        and isinstance(e.args[0].value, str)
    )


def _masked_load(e: ast.expr) -> ast.Call | None:
    """The ``tl.load(..., mask=..., other=...)`` call ``e`` is, bare or cast to a float type; else None."""
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "to":
        if not (len(e.args) == 1 and ast.unparse(e.args[0]) in ("tl.float32", "tl.float64")):
            return None
        e = e.func.value
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "load":
        words = {k.arg for k in e.keywords}
        return e if {"mask", "other"} <= words else None
    return None


def load_other(body: list[ast.stmt], once: Counter[str], types: Types) -> bool:
    """``b = tl.where(m, a, c)`` the only read of ``a = tl.load(p, mask=m, other=0)``, ``c`` a
    float: the load fills its masked lanes with ``c`` itself (``other=c``), and ``b = a``."""
    read = _reads(body)
    changed = False

    def block(stmts: list[ast.stmt]) -> None:
        nonlocal changed
        loads: dict[str, ast.Call] = {}
        for stmt in stmts:
            for field in ("body", "orelse"):
                block(getattr(stmt, field, []))
            name = _target(stmt)
            if name is None:
                continue
            v = stmt.value
            load = _masked_load(v)
            if load is not None and once[name] == 1:
                loads[name] = load
                continue
            if not (isinstance(v, ast.Call) and ast.unparse(v.func) == "tl.where" and len(v.args) == 3):
                continue
            cond, a, c = v.args
            if not (isinstance(a, ast.Name) and a.id in loads and read[a.id] == 1 and _float_constant(c)):
                continue
            load = loads.pop(a.id)
            mask = next(k for k in load.keywords if k.arg == "mask")
            if ast.dump(mask.value) != ast.dump(cond):
                continue
            next(k for k in load.keywords if k.arg == "other").value = c
            stmt.value = ast.Name(a.id, ast.Load())
            changed = True

    block(body)
    return changed


#: half types, and the float types that hold each of their values exactly
_WIDER = {"tl.bfloat16": ("tl.float32", "tl.float64"), "tl.float16": ("tl.float32", "tl.float64")}


def round_trip(body: list[ast.stmt], once: Counter[str], types: Types) -> bool:
    """``b.to(H)`` where ``b = a.to(H).to(W)``, ``H`` a half type and ``W`` a wider float: widening a
    half value is exact, so narrowing it back gives the same half value: ``a.to(H)`` (a gradient
    rounded to its dtype in fp32, then stored in that dtype, rounds once). Read after ``b`` in its
    own block, while nothing ``a`` reads has been assigned again."""
    changed = False

    class Narrow(ast.NodeTransformer):
        def __init__(self, rounded: dict[str, tuple[ast.expr, str]]) -> None:
            self.rounded = rounded

        def visit_Call(self, node: ast.Call) -> ast.AST:
            nonlocal changed
            self.generic_visit(node)
            found = _cast(node)
            if found is not None and isinstance(found[0], ast.Name) and found[0].id in self.rounded:
                half, dtype = self.rounded[found[0].id]
                if found[1] == dtype:
                    changed = True
                    return ast.copy_location(copy_tree(half), node)
            return node

    def block(stmts: list[ast.stmt]) -> None:
        rounded: dict[str, tuple[ast.expr, str]] = {}  # b -> (a.to(H), "H")
        for stmt in stmts:
            assigned = set(_assigned([stmt]))
            for b in [b for b, (half, _) in rounded.items() if b in assigned or _names(half) & assigned]:
                del rounded[b]  # ``b`` or what ``a`` reads is assigned here: its value is another one
            if rounded:
                Narrow(rounded).visit(stmt)
            for field in ("body", "orelse"):
                block(getattr(stmt, field, []))
            name = _target(stmt)
            outer = _cast(stmt.value) if name is not None and once[name] == 1 else None
            inner = _cast(outer[0]) if outer is not None else None
            if inner is not None and inner[1] in _WIDER and outer[1] in _WIDER[inner[1]]:
                rounded[name] = (outer[0], inner[1])  # type: ignore[index]

    block(body)
    return changed


def _scaled_exp(e: ast.expr | None) -> tuple[ast.expr, ast.expr] | None:
    """``(a, b)`` of ``a * tl.exp(b)`` or ``tl.exp(b) * a``; None for any other expression."""
    if not (isinstance(e, ast.BinOp) and isinstance(e.op, ast.Mult)):
        return None
    for a, x in ((e.left, e.right), (e.right, e.left)):
        if isinstance(x, ast.Call) and ast.unparse(x.func) == "tl.exp" and len(x.args) == 1 and not x.keywords:
            return a, x.args[0]
    return None


def log_exp(body: list[ast.stmt], once: Counter[str], types: Types) -> bool:
    """``tl.log(a * tl.exp(b))``: ``tl.log(a) + b``, the same value in every case (0, inf, NaN
    included) without the exp, and rounded once less: a softmax's total read off logsumexp's state
    (``s * exp(m - lse)``) whose log a cross-entropy adds. Also through a name assigned once holding
    the product, read later in its own block while nothing the product reads is assigned again."""
    changed = False

    class Fold(ast.NodeTransformer):
        def __init__(self, held: dict[str, ast.expr]) -> None:
            self.held = held

        def visit_Call(self, node: ast.Call) -> ast.AST:
            nonlocal changed
            self.generic_visit(node)
            if ast.unparse(node.func) != "tl.log" or len(node.args) != 1 or node.keywords:
                return node
            arg = node.args[0]
            found = _scaled_exp(self.held.get(arg.id) if isinstance(arg, ast.Name) else arg)
            if found is None:
                return node
            changed = True
            a, b = (copy_tree(e) for e in found)
            log_a = ast.Call(func=copy_tree(node.func), args=[a], keywords=[])
            return ast.copy_location(ast.BinOp(left=log_a, op=ast.Add(), right=b), node)

    def holds(stmt: ast.stmt, name: str) -> ast.expr | None:
        """The product a name holds."""
        value = stmt.value  # type: ignore[attr-defined]
        return value if _scaled_exp(value) is not None else None

    _through_names(body, once, lambda stmt, held: Fold(held).visit(stmt), holds)
    return changed


#: calls whose result has the broadcast shape of their arguments' (a load: its pointer's)
_ELEMENTWISE = frozenset(
    {"where", "maximum", "minimum", "exp", "exp2", "log", "log2", "abs", "sqrt", "rsqrt", "erf", "to"}
)


def _leaf(e: ast.expr) -> str | None:
    """The key of an index tile: a name, or a view of one (``offs_m[:, None]``: its own shape)."""
    if isinstance(e, ast.Name):
        return e.id
    if isinstance(e, ast.Subscript) and isinstance(e.value, ast.Name):
        parts = e.slice.elts if isinstance(e.slice, ast.Tuple) else [e.slice]
        if all(isinstance(x, ast.Slice) or (isinstance(x, ast.Constant) and x.value is None) for x in parts):
            return ast.unparse(e)
    return None


def _spans(e: ast.AST, spans: dict[str, set[str]]) -> set[str]:
    """The index tiles (``rows``, ``offs_m[:, None]``) whose shape ``e``'s shape includes, as far
    as its syntax says: arithmetic and elementwise calls broadcast their operands; a load has its
    pointer's shape; anything else (a reduction, another subscript) says nothing."""
    leaf = _leaf(e)  # type: ignore[arg-type]
    if leaf is not None:
        return {leaf} | spans.get(leaf, set())
    if isinstance(e, ast.BinOp):
        return _spans(e.left, spans) | _spans(e.right, spans)
    if isinstance(e, ast.UnaryOp):
        return _spans(e.operand, spans)
    if isinstance(e, ast.Compare):
        return set().union(*(_spans(x, spans) for x in (e.left, *e.comparators)))
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute):
        if e.func.attr == "load" and e.args:
            return _spans(e.args[0], spans)
        if e.func.attr in _ELEMENTWISE:
            args = [*e.args, *(k.value for k in e.keywords)] + ([e.func.value] if e.func.attr == "to" else [])
            return set().union(*(_spans(x, spans) for x in args))
    return set()


def _pad(e: ast.expr) -> set[str] | None:
    """The index tiles of a shape pad ``rows * 0`` (or a sum of pads, ``rows * 0 + cols * 0``);
    None for any other expression."""
    if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Mult) and _leaf(e.left) is not None:
        return {_leaf(e.left)} if isinstance(e.right, ast.Constant) and e.right.value == 0 else None  # type: ignore[misc]
    if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add):
        a, b = _pad(e.left), _pad(e.right)
        return a | b if a is not None and b is not None else None
    return None


def shape_pad(body: list[ast.stmt], once: Counter[str], types: Types) -> bool:
    """``p + rows * 0`` where ``p`` already has ``rows``' shape: ``p``. Only where the pad's int32
    zero cannot change what the sum is for: a load's or store's pointer, a value cast to an integer
    type, or a side of a compare of two signed integers, whose other side broadcasts with it (an
    int32 zero added to a float or a bool changes its sign of zero or its type)."""
    spans: dict[str, set[str]] = {}  # a name assigned once -> the index tiles its shape includes
    changed = False

    def fold(e: ast.expr, beside: frozenset[str] = frozenset()) -> ast.expr:
        """``e`` without its pads, ``beside``: tiles what ``e`` broadcasts with has already."""
        nonlocal changed
        if not (isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add)):
            return e
        e.left = fold(e.left, beside | _spans(e.right, spans))
        e.right = fold(e.right, beside | _spans(e.left, spans))
        for pad, other in ((e.right, e.left), (e.left, e.right)):
            if isinstance(pad, ast.Constant) and pad.value == 0 and type(pad.value) is int:
                changed = True  # ``p + 0``
                return other
            names = _pad(pad)
            if names is not None and _pad(other) is None and names <= _spans(other, spans) | beside:
                changed = True
                return other
        return e

    class Fold(ast.NodeTransformer):
        def visit_Call(self, node: ast.Call) -> ast.AST:
            self.generic_visit(node)
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in EFFECTS and node.args:
                node.args[0] = fold(node.args[0])  # the pointer
            elif _cast(node) is not None and _cast(node)[1].startswith(("tl.int", "tl.uint")):
                f.value = fold(f.value)  # type: ignore[attr-defined]
            return node

        def visit_Compare(self, node: ast.Compare) -> ast.AST:
            self.generic_visit(node)
            if len(node.ops) == 1 and _signed(node.left, types) and _signed(node.comparators[0], types):
                node.left = fold(node.left, frozenset(_spans(node.comparators[0], spans)))
                node.comparators[0] = fold(node.comparators[0], frozenset(_spans(node.left, spans)))
            return node

    for stmt in _preorder(body):
        if hasattr(stmt, "body"):
            continue  # a loop's or a branch's statements come next, in order
        Fold().visit(stmt)
        name = _target(stmt)
        if name is not None and once[name] == 1:
            spans[name] = _spans(stmt.value, spans)
    return changed


def _signed(e: ast.expr, types: Types) -> bool:
    """Is ``e`` a signed integer, as far as its syntax and ``types`` say? (A bool, an unsigned or a
    float value is not: a bool's compare is unsigned, a float's cast truncates.)"""
    if isinstance(e, ast.Name):
        return types.get(e.id) in _SIGNED
    if isinstance(e, ast.Constant):
        return type(e.value) is int
    if isinstance(e, ast.Subscript):  # ``offs_m[:, None]``: a view
        return _signed(e.value, types)
    if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Sub, ast.Mult)):
        return _signed(e.left, types) and _signed(e.right, types)
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
        return _signed(e.operand, types)
    found = _cast(e)
    return found is not None and found[1] in _SIGNED


def narrow_compare(body: list[ast.stmt], once: Counter[str], types: Types) -> bool:
    """``a.to(tl.int64) >= b.to(tl.int64)``, ``a`` and ``b`` signed integers (an int32 index, a
    position): ``a >= b``. Widening a signed integer keeps its order, and Triton compares two
    signed integers at the wider one's width: the same truth, without the 64-bit compares (two
    per element on a GPU: attention's causal mask per score). Also through a name assigned once
    holding the cast, read later in its own block while nothing the cast reads is assigned again."""
    changed = False

    def narrow(side: ast.expr, held: dict[str, ast.expr]) -> ast.expr | None:
        if isinstance(side, ast.Name) and side.id in held:
            side = held[side.id]
        found = _cast(side)
        if found is None or found[1] != "tl.int64" or not _signed(found[0], types):
            return None
        return copy_tree(found[0])

    class Fold(ast.NodeTransformer):
        def __init__(self, held: dict[str, ast.expr]) -> None:
            self.held = held

        def visit_Compare(self, node: ast.Compare) -> ast.AST:
            nonlocal changed
            self.generic_visit(node)
            if len(node.ops) != 1:
                return node
            a, b = narrow(node.left, self.held), narrow(node.comparators[0], self.held)
            if a is None or b is None:
                return node
            changed = True
            return ast.copy_location(ast.Compare(left=a, ops=node.ops, comparators=[b]), node)

    def holds(stmt: ast.stmt, name: str) -> ast.expr | None:
        """The int64 cast a name holds; a name holding a signed integer typed as one (``ks``)."""
        value = stmt.value  # type: ignore[attr-defined]
        if narrow(value, {}) is not None:
            return value
        if name not in types and _signed(value, types):
            types[name] = SIGNED_INDEX
        return None

    _through_names(body, once, lambda stmt, held: Fold(held).visit(stmt), holds)
    return changed


def in_bounds(body: list[ast.stmt], once: Counter[str], types: Types) -> bool:
    """A load's or store's mask, or a select's condition, made of bounds checks ``index < extent``
    the writer knows true everywhere (``types.bounds``: a GEMM whose extents fill their blocks):
    the load or store unmasked (its ``other`` dropped), the select its value. Only where what it
    masks has every index tile the mask has, so no shape changes (a mask broadcasts with its
    pointer; a select with its value)."""
    if not types.bounds:
        return False
    held: dict[str, ast.expr] = {}  # a name assigned once -> its value (``a_mask``, ``rows``)
    spans: dict[str, set[str]] = {}
    extents = {e for _, e in types.bounds}
    changed = False

    def index(e: ast.expr) -> str | None:
        e = held.get(e.id, e) if isinstance(e, ast.Name) else e
        if isinstance(e, ast.Subscript):
            e = e.value
        return e.id if isinstance(e, ast.Name) else None

    def true(e: ast.expr) -> bool:
        e = held.get(e.id, e) if isinstance(e, ast.Name) else e
        if isinstance(e, ast.BinOp) and isinstance(e.op, ast.BitAnd):
            return true(e.left) and true(e.right)
        if isinstance(e, ast.Compare) and len(e.ops) == 1 and isinstance(e.ops[0], ast.Lt):
            bound = e.comparators[0]
            return isinstance(bound, ast.Name) and (index(e.left), bound.id) in types.bounds
        return False

    def covers(e: ast.expr, mask: ast.expr) -> bool:
        return _spans(mask, spans) - extents <= _spans(e, spans) | {mask.id if isinstance(mask, ast.Name) else ""}

    class Drop(ast.NodeTransformer):
        def visit_Call(self, node: ast.Call) -> ast.AST:
            nonlocal changed
            self.generic_visit(node)
            f = node.func
            if not isinstance(f, ast.Attribute):
                return node
            mask = next((k.value for k in node.keywords if k.arg == "mask"), None)
            if f.attr in ("load", "store") and mask is not None and true(mask) and covers(node.args[0], mask):
                node.keywords = [k for k in node.keywords if k.arg not in ("mask", "other")]
                changed = True
            elif ast.unparse(f) == "tl.where" and len(node.args) == 3 and true(node.args[0]):
                if covers(node.args[1], node.args[0]):
                    changed = True
                    return node.args[1]
            return node

    for stmt in _preorder(body):
        if hasattr(stmt, "body"):
            continue
        Drop().visit(stmt)
        name = _target(stmt)
        if name is not None and once[name] == 1:
            held[name] = stmt.value
            spans[name] = _spans(stmt.value, spans)
    return changed


_WIDE = frozenset({"tl.float16", "tl.bfloat16", "tl.float32", "tl.float64", "tl.int32", "tl.int64", SIGNED_INDEX})
_FLOATING = frozenset({"exp", "exp2", "log", "log2", "sqrt", "rsqrt", "erf", "sigmoid", "sin", "cos", "fdiv"})


def _wide(e: ast.expr, wide: set[str]) -> bool:
    """Is ``e`` a float or an integer of 32 bits or more, as far as its syntax and the names in
    ``wide`` say? (``tl.sum`` adds such a tile as it is; a bool or an int8 it widens first.)"""
    if isinstance(e, ast.Constant):
        return type(e.value) in (int, float)
    if isinstance(e, ast.Name):
        return e.id in wide
    if isinstance(e, ast.UnaryOp):
        return isinstance(e.op, ast.USub) and _wide(e.operand, wide)
    if isinstance(e, ast.BinOp):  # Triton's true division of integers is a float
        both = isinstance(e.op, (ast.Add, ast.Sub, ast.Mult)) and _wide(e.left, wide) and _wide(e.right, wide)
        return isinstance(e.op, ast.Div) or both
    found = _cast(e)
    if found is not None:
        return found[1] in _WIDE
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute):
        if e.func.attr in _FLOATING:
            return True
        if e.func.attr in ("where", "maximum", "minimum", "abs"):  # (a select's values, not its condition)
            return all(_wide(x, wide) for x in e.args[e.func.attr == "where" :])
    return False


def _axes(e: ast.expr, axes: Mapping[str, frozenset[int]]) -> set[int]:
    """The axes ``e``'s shape spans, as far as its syntax and the index tiles' ``axes`` say (a lower
    bound: ``_spans``' walk): a range viewed as a row or a column (``tl.arange(0, B)[None, :]``)
    spans its slice's axis; a load, its pointer's and its mask's."""
    if isinstance(e, ast.Name):
        return set(axes.get(e.id, ()))
    if isinstance(e, ast.Subscript) and isinstance(e.value, ast.Call) and ast.unparse(e.value.func) == "tl.arange":
        parts = e.slice.elts if isinstance(e.slice, ast.Tuple) else [e.slice]
        return {k for k, part in enumerate(parts) if isinstance(part, ast.Slice)}
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in _ELEMENTWISE | {"load"}:
        parts = [*e.args, *(k.value for k in e.keywords if k.arg != "other")]
        return set().union(*(_axes(x, axes) for x in parts + ([e.func.value] if e.func.attr == "to" else [])))
    if isinstance(e, (ast.BinOp, ast.UnaryOp, ast.Compare)):
        return set().union(*(_axes(x, axes) for x in ast.iter_child_nodes(e) if isinstance(x, ast.expr)))
    return set()


def _tile_sum(stmt: ast.stmt) -> tuple[ast.expr, int, str | None] | None:
    """``(x, k, view)`` of ``name = tl.sum(x, axis=k)`` or ``name = tl.sum(x, axis=k)[view]``."""
    v = getattr(stmt, "value", None) if _target(stmt) is not None else None
    view = ast.unparse(v.slice).removeprefix("(").removesuffix(")") if isinstance(v, ast.Subscript) else None
    call = v.value if isinstance(v, ast.Subscript) else v
    if not (isinstance(call, ast.Call) and ast.unparse(call.func) == "tl.sum" and len(call.args) == 1):
        return None
    if [k.arg for k in call.keywords] != ["axis"] or not isinstance(call.keywords[0].value, ast.Constant):
        return None
    return call.args[0], call.keywords[0].value.value, view


def sibling_sums(body: list[ast.stmt], once: Counter[str], types: Types) -> bool:
    """Two sums of full tiles along one axis in one block (``a = tl.sum(x, axis=1)[:, None]``, then
    ``b = tl.sum(y, axis=1)[:, None]``), ``y`` not computed from ``a``: one ``tl.reduce`` of both,
    where ``b`` was, the lines between that read ``a`` after it. One pass through shared memory
    for both (a layer norm backward's two row sums; a mean's total and count): a barrier and a
    reduction tree fewer. Only in a 2-d kernel whose index tiles the writer states (``types.axes``)
    and where both tiles span both axes (``tl.reduce`` wants one shape), each a float or an integer
    of 32 bits or more (``tl.sum`` widens a narrower one first)."""
    views = (n.slice for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Subscript))
    if not types.axes or any(isinstance(v, ast.Tuple) and len(v.elts) > 2 for v in views):
        return False  # (no writer's axes, or a tile of three dims)
    axes, wide = dict(types.axes), set(types.wide) | {n for n, t in types.items() if t in _WIDE}
    # a name -> the values its statements assign, as text: one value (``cols`` set again per block
    # of a loop, as before it) is one tile wherever it is read
    values: dict[str, list[str]] = {}
    for stmt in _preorder(body):
        if _target(stmt) is not None:
            values.setdefault(_target(stmt), []).append(ast.dump(stmt.value))  # type: ignore[arg-type, attr-defined]
    for stmt in _preorder(body):
        name = _target(stmt)
        if name is not None and len(set(values[name])) == 1 and len(values[name]) == once[name]:
            axes[name] = frozenset(_axes(stmt.value, axes))  # type: ignore[attr-defined]
            if _wide(stmt.value, wide):
                wide.add(name)

    def full(x: ast.expr) -> bool:
        return _axes(x, axes) == {0, 1} and _wide(x, wide)

    def merge(stmts: list[ast.stmt]) -> bool:
        sums = {k: _tile_sum(s) for k, s in enumerate(stmts) if _tile_sum(s) is not None and once[_target(s)] == 1}
        sums = {k: s for k, s in sums.items() if full(s[0])}  # type: ignore[index]
        if len(sums) < 2:
            return any(merge(getattr(s, f)) for s in stmts for f in ("body", "orelse") if hasattr(s, f))
        names = [_names(s) for s in stmts]
        assigns = [set(_assigned([s])) for s in stmts]
        for j, (y, axis, view) in sums.items():  # type: ignore[misc]
            for i, (x, *how) in ((i, s) for i, s in sums.items() if i < j):  # type: ignore[misc]
                if how != [axis, view]:
                    continue
                a, b = _target(stmts[i]), _target(stmts[j])
                moved = _readers(stmts[i + 1 : j], a, _names(x), names[i + 1 : j], assigns[i + 1 : j])  # type: ignore[arg-type]
                if moved is None or once[f"{a}_{b}"] or b in _names(x):
                    continue
                if _names(y) & {a, *(_target(stmts[i + 1 + k]) for k in moved)}:
                    continue  # ``y`` is computed from ``a``
                between = stmts[i + 1 : j]
                kept = [s for k, s in enumerate(between) if k not in moved]
                stmts[i : j + 1] = kept + _sum_pair(a, b, x, y, axis, view) + [between[k] for k in moved]  # type: ignore[arg-type]
                return True
        return any(merge(getattr(s, f)) for s in stmts for f in ("body", "orelse") if hasattr(s, f))

    return merge(body)


def _sum_pair(a: str, b: str, x: ast.expr, y: ast.expr, axis: int, view: str | None) -> list[ast.stmt]:
    """``a_b = tl.reduce((x, y), axis, add_pairs)``, then ``a`` and ``b`` read off it (``view``)."""
    pair = f"{a}_{b}"
    tail = f"[{view}]" if view is not None else ""
    merged = ast.parse(f"{pair} = tl.reduce((x, y), {axis}, add_pairs)\n{a} = {pair}[0]{tail}\n{b} = {pair}[1]{tail}")
    merged.body[0].value.args[0].elts = [x, y]  # type: ignore[attr-defined]
    return merged.body


def _readers(
    between: list[ast.stmt], name: str, reads: set[str], names: list[set[str]], assigns: list[set[str]]
) -> list[int] | None:
    """The statements of ``between`` computed from ``name`` (transitively), to run after a sum
    moved past them all, in program order; None where they cannot move: an effect or a block reads
    ``name``'s results, a statement left in place after one assigns a name it reads or its own,
    or a name ``reads`` (the sum's operand) is assigned in ``between``. ``names`` and ``assigns``:
    each statement's names and assigned names (one pass over the body, not one per pair of sums)."""
    if reads & set().union(*assigns):
        return None
    held: set[str] = {name}
    moved: list[int] = []
    for k, stmt in enumerate(between):
        if names[k] & held:
            target = _target(stmt)
            if target is None or not _pure(stmt.value):  # type: ignore[attr-defined]
                return None
            held.add(target)
            moved.append(k)
    later: set[str] = set()  # what the statements left in place after each assign
    rest = list(moved)
    for k in reversed(range(len(between))):
        if rest and k == rest[-1]:
            rest.pop()
            if (names[k] - {name}) & later:  # (its own name among them)
                return None
        else:
            later |= assigns[k]
    return moved


Rule = Callable[[list[ast.stmt], Counter[str], Types], bool]

#: the rules, in the order each round applies them
RULES: tuple[Rule, ...] = (
    identity_cast,
    common_subexpr,
    load_other,
    round_trip,
    log_exp,
    shape_pad,
    narrow_compare,
    in_bounds,
    sibling_sums,
    copy,
    dead,
)

#: the module-level helpers a rule's rewrite may call, by name (``sibling_sums``' combine)
HELPERS = {"add_pairs": ADD_PAIRS}


def simplify(
    lines: Sequence[str],
    known: Mapping[str, str] | None = None,
    bounds: frozenset[tuple[str, str]] = frozenset(),
    axes: Mapping[str, frozenset[int]] | None = None,
    wide: frozenset[str] = frozenset(),
) -> list[str]:
    """A kernel body's ``lines`` rewritten by ``RULES`` until none applies; ``known``: the Triton
    dtypes of names the writer knows (a load of an int64 input, uncast), beside those casts say;
    ``bounds``, ``axes``, ``wide``: what it knows of bounds checks, index tiles and names (``Types``).
    A rewritten body may call a helper of ``HELPERS``.

    Example:
        >>> simplify(["a = x * 2", "b = x * 2", "c = b", "tl.store(p, c + a)"])
        ['a = x * 2', 'tl.store(p, a + a)']
    """
    body = ast.parse("\n".join(lines)).body
    before = set(read_before_assigned(body))  # (parameters a writer assigns again: ``a_ptr += ...``)
    types = Types(known or {})
    types.bounds, types.axes, types.wide = bounds, axes or {}, wide
    while True:
        changed = False
        for rule in RULES:
            changed |= rule(body, _assigned(body), types)
        if not changed:
            break
    early = [n for n in read_before_assigned(body) if n not in before]
    if early:  # a rule's fault (every rule is an optimization): the body as the writer wrote it
        log.warning("kernel body rewrite read %s before assigning it: kept unrewritten", early)
        return list(lines)
    return [line for stmt in body for line in ast.unparse(stmt).splitlines()]


def renamed(lines: Sequence[str], keep: set[str], suffix: str) -> list[str]:
    """``lines`` (whole statements under one indentation) with each name they assign, other than
    ``keep``, renamed with ``suffix`` wherever they use it: a loop's copy whose own values stay
    its own (a split K loop's second loop; its running state, assigned before it, kept).

    Example:
        >>> renamed(["    t = acc * 2", "    acc = acc + t"], {"acc"}, "_f")
        ['    t_f = acc * 2', '    acc = acc + t_f']
    """
    indent = lines[0][: len(lines[0]) - len(lines[0].lstrip())] if lines else ""
    body = ast.parse(textwrap.dedent("\n".join(lines))).body
    own = set(_assigned(body)) - keep

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.Name:
            return ast.copy_location(ast.Name(f"{node.id}{suffix}", node.ctx), node) if node.id in own else node

    return [indent + line for stmt in body for line in ast.unparse(Rename().visit(stmt)).splitlines()]


def assigned_names(lines: Sequence[str]) -> set[str]:
    """The names ``lines`` (whole statements under one indentation) assign."""
    return set(_assigned(ast.parse(textwrap.dedent("\n".join(lines))).body))


def read_before_assigned(body: Sequence[ast.stmt]) -> list[str]:
    """Names the body assigns that a statement reads before any statement assigns them (in
    source order: a loop's running state is assigned before its loop; a loop variable by its
    head). A rewrite that reorders statements must leave none.

    Example:
        >>> read_before_assigned(ast.parse("b = a + 1; a = 2; c = b").body)
        ['a']
    """
    assigned, seen, early = set(_assigned(body)), set(), []
    for stmt in _preorder(list(body)):
        parts: list[ast.AST] = [stmt.target, stmt.iter] if isinstance(stmt, ast.For) else []
        parts += [stmt.test] if isinstance(stmt, (ast.If, ast.While)) else []
        for node in (n for p in (parts if hasattr(stmt, "body") else [stmt]) for n in ast.walk(p)):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                if node.id in assigned and node.id not in seen and node.id not in early:
                    early.append(node.id)
        seen |= set(_assigned(parts if hasattr(stmt, "body") else [stmt]))
    return early
