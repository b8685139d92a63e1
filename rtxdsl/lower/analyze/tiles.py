"""What a kernel computes tile by tile: products reduced in rows, values a GEMM's prologue recomputes."""

from __future__ import annotations

from ...expr import Expr
from ...ops import REGISTRY, OpKind
from ..expand import Graph, is_leaf
from .flow import read_srcs

#: the widest product a GEMM reading a tiled product as its A operand may have: one tile of its
#: columns, so the prologue recomputes each tile of the tiled product once (attention's ``P @ v``
#: over a head dim)
NARROW_PRODUCT = 256


def alone_in_rows(graph: Graph, c: Expr) -> bool:
    """Is ``c`` a product a row kernel computes in tiles (:func:`reduced_in_rows`) and no other with
    it: one whose right operand has batch dims (attention's keys), the kernel's rows kept to its
    batch? Products of a layer's weight share a row kernel (a student's and a teacher's logits,
    each tile of both computed where the loss reads them)."""
    return len(graph.of(c.srcs[1]).shape) > 2 and reduced_in_rows(graph, c)


def reduced_in_rows(graph: Graph, c: Expr) -> bool:
    """Is contraction ``c``'s product only reduced over its last axis, through elementwise ops of
    its shape, and never requested? A row kernel then computes it in tiles
    (:func:`fuse_product_rows`) and a backward recomputes it rather than the forward saving it.
    Where its right operand has batch dims (an activation: attention's keys), a value of it may
    also be the A operand of a narrow product (:data:`NARROW_PRODUCT`), whose prologue recomputes
    it: attention's probabilities, reduced to their row statistics and multiplied by ``v``."""
    shape = graph.of(c).shape
    if c.attr("sum_batch"):
        return False
    # a right operand with batch dims is an activation (attention's keys), not a layer's weight
    batched = len(graph.of(c.srcs[1]).shape) > 2
    requested = {e for _, e in graph.outputs}
    readers: dict[Expr, list[Expr]] = {}
    for n in graph.nodes:
        for s in read_srcs(n):
            readers.setdefault(s, []).append(n)
    stack, seen = [c], {c}
    while stack:
        n = stack.pop()
        if n in requested:
            return False
        for r in readers.get(n, ()):
            kind = REGISTRY[r.op].kind
            if kind is OpKind.REDUCTION and tuple(r.attr("axis")) == (len(shape) - 1,):
                continue
            if kind is OpKind.CONTRACTION and batched and _narrow_reader(graph, r, n):
                continue
            if kind is not OpKind.ELEMENTWISE or graph.of(r).shape != shape:
                return False
            if r not in seen:
                seen.add(r)
                stack.append(r)
    return True


def _narrow_reader(graph: Graph, r: Expr, n: Expr) -> bool:
    """Does contraction ``r`` read ``n`` only as its A operand, with at most :data:`NARROW_PRODUCT`
    columns: untransposed (``n``'s rows kept, its last axis contracted: attention's ``P @ v``,
    ``dS @ k``) or transposed (its columns kept, its rows contracted: ``P.T @ dO``, ``dS.T @ q``)?"""
    a, b = r.srcs
    kept = -1 if r.attr("ta") else -2  # the axis of ``n`` the product's rows run along
    out, shape = graph.of(r).shape, graph.of(n).shape
    summed = r.attr_dict.get("summed", 0)  # its last batch dims summed in the K loop: of one in ``out``
    batch = (*shape[: len(shape) - 2 - summed], *(1,) * summed)
    return (
        a is n
        and b is not n
        and not r.attr("sum_batch")
        and out[-1] <= NARROW_PRODUCT
        and out[:-2] == batch
        and out[-2] == shape[kept]
    )


def recomputable(x: Expr, n: Expr, graph: Graph) -> bool:
    """Is ``x`` (a reader of ``n``) a narrow GEMM reading it as its A operand
    (:func:`_narrow_reader`), any GEMM reading it as an operand where ``n`` is computed from a
    product marked ``recompute`` (a backward's: never written, whatever the GEMM's width), a sum
    of it over its rows (a mergeable reduction: a bias gradient, summed in the K loop of the GEMM
    reading it transposed, ``reduce_in_k_loop``), or elementwise on the way to such readers only?
    Their prologues recompute it from the product."""
    if REGISTRY[x.op].kind is OpKind.CONTRACTION:
        return _narrow_reader(graph, x, n) or (any(s is n for s in x.srcs) and not untiled(n, graph))
    if REGISTRY[x.op].kind is OpKind.REDUCTION:
        rank = len(graph.of(n).shape)
        leading = tuple(range(rank - 1))
        return REGISTRY[x.op].reduce is not None and rank >= 2 and tuple(sorted(x.attr("axis"))) == leading
    if REGISTRY[x.op].kind is not OpKind.ELEMENTWISE:
        return False
    readers = [r for r in graph.nodes if any(s is x for s in read_srcs(r))]
    return bool(readers) and all(recomputable(r, x, graph) for r in readers)


def tiled_cone(
    s: Expr, graph: Graph, needs_product: bool = True, bounded: frozenset[Expr] = frozenset()
) -> list[Expr] | None:
    """``s`` and what it is computed from, down to the graph's leaves, when that includes a product
    marked ``recompute`` (one the forward never wrote): elementwise ops, views of leaves and of
    one-element values, index-only movement ops (positions) and the product itself (its operands
    read from memory).
    None when ``s`` computes no such product (unless not ``needs_product``) or needs anything else
    (a reduction, a re-indexing). ``bounded`` (values kernels can write before the GEMMs read them):
    a smaller one not computed from leaves by elementwise ops alone (a per-row cotangent: a
    preference loss's per-sequence term, sliced and broadcast to its tokens; a distillation loss's
    row sum over the products' tiles, in a row kernel computing them) is read from memory like a
    leaf instead, that kernel writing it."""
    out: list[Expr] = []
    seen: set[Expr] = set()
    stack, found = [s], False
    size = graph.of(s).numel
    while stack:
        n = stack.pop()
        if n in seen or is_leaf(n, graph.info):
            continue
        seen.add(n)
        op = REGISTRY[n.op]
        if n in bounded and graph.of(n).numel < size and tiled_cone(n, graph, False) is None:
            continue  # a boundary: loaded where the cone reads it
        if op.kind is OpKind.CONTRACTION:  # its operands are read from memory, as a GEMM's are
            if not tileable(graph, n):
                return None
            found = True
            out.append(n)
            continue
        if op.kind is OpKind.MOVEMENT:
            # a view of a leaf is a load through its strides; a view of one element broadcasts as
            # it is; positions read nothing: anything else would need coordinates of its own
            views_ok = op.view and all(is_leaf(x, graph.info) or graph.of(x).numel == 1 for x in n.srcs)
            if not views_ok and read_srcs(n):
                return None
        elif op.kind is not OpKind.ELEMENTWISE:
            return None
        out.append(n)
        stack.extend(read_srcs(n))
    return out if found or not needs_product else None


def tileable(graph: Graph, n: Expr) -> bool:
    """Is ``n`` a product a kernel may compute in tiles where it is read, never written: one the
    forward did not save (``recompute``), or one only reduced over its rows or read by narrow
    products (:func:`reduced_in_rows`: attention's scores, and in its backward ``dO @ v.T``)?"""
    return REGISTRY[n.op].kind is OpKind.CONTRACTION and bool(n.attr_dict.get("recompute") or reduced_in_rows(graph, n))


def untiled(n: Expr, graph: Graph) -> bool:
    """Is ``n`` computed without a product marked ``recompute`` (so a kernel can write it before a
    GEMM that recomputes the product reads it)?"""
    stack, seen = [n], set()
    while stack:
        x = stack.pop()
        if x in seen or is_leaf(x, graph.info):
            continue
        seen.add(x)
        if REGISTRY[x.op].kind is OpKind.CONTRACTION and x.attr_dict.get("recompute"):
            return False
        stack.extend(x.srcs)
    return True
