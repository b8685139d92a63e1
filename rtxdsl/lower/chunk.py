"""The chunk loop: a product a backward would recompute in many GEMM tiles, computed once.

Linear cross-entropy's backward reads ``dP`` (the gradient of the logits, from the recomputed
product, the saved logsumexp, the targets and the cotangent) in two GEMMs: ``dh = dP @ w`` and
``dw = dP.T @ h``. The analyzer makes ``dP`` their prologue (``analyze.prologues._recompute_in_prologues``):
no tokens x vocabulary buffer, but each output tile of each GEMM recomputes every logit tile it
reads, hidden / 128 times per GEMM at sm_90's tiles (66x the logits GEMM's FLOPs at hidden 4096).

Where the prologues would compute the product more than twice, and ``FusionConfig.chunk_budget``
allows a buffer, this pass computes it once instead, one chunk of its last dim (the vocabulary)
at a time, in a loop of three kernels (Cut Cross-Entropy's order of work, without its atomics):

1. a GEMM of its own computes the chunk's product and, in its epilogue, the value the readers
   need (``dP``; or the fp32 value ``dP`` casts, when a bias gradient sums it) into a buffer of
   one chunk, ``tokens x chunk``;
2. ``dh``'s GEMM runs its K loop over the chunk and carries its sum across chunks in an fp32
   accumulator; the last chunk's launch stores ``dh`` through the epilogue;
3. ``dw``'s GEMM runs its programs over the chunk's rows of ``dw`` (a bias gradient's column sum
   merged in its K loop, as before).

A second product of the same shape in the readers' prologues (a distillation loss's teacher logits
beside the student's) joins the chunk: the first kernel computes it at its output tile, in a K
loop of its own in the epilogue (``codegen.gemm``'s ``_inner_product`` at ``OUTPUT_VECTORS``).

Every element is summed by one program in a fixed order (chunks in order): bit-identical reruns.
The backward computes the product once (3x the logits GEMM in all); it costs the chunk buffer
(at most ``chunk_budget`` of the product's bytes, at least one 128-wide tile) and ``dh``'s fp32
accumulator (tokens x hidden x 4 bytes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Protocol, TypeVar

from ..config import FusionConfig
from ..expr import Expr
from ..ops import REGISTRY, OpKind
from ..ops.elementwise import is_cast
from .expand import Graph
from .prologue import reloads
from .roles import Role
from .spec import Chunk


class _Group(Protocol):
    """What this pass reads of ``analyze.Group`` (which calls it, so it cannot import it)."""

    @property
    def nodes(self) -> tuple[Expr, ...]: ...
    @property
    def roles(self) -> Mapping[Expr, Role]: ...
    @property
    def notes(self) -> tuple[str, ...]: ...
    @property
    def chunk(self) -> Chunk | None: ...
    @property
    def is_row(self) -> bool: ...
    @property
    def contraction(self) -> Expr | None: ...


Group = TypeVar("Group", bound=_Group)

#: a chunk is whole GPU tiles along each dim it windows (sm_90's GEMM tiles are 128 x 128, K in 64s)
CHUNK_TILE = 128
#: the prologues' computations of the product above which one chunked computation pays for its buffer
MAX_RECOMPUTES = 2


def chunk_recomputed(graph: Graph, groups: tuple[Group, ...], config: FusionConfig) -> tuple[Group, ...]:
    """``groups`` with each product that GEMM prologues recompute more than :data:`MAX_RECOMPUTES`
    times computed once per chunk instead (see the module docstring)."""
    if config.chunk_budget == 0:
        return groups
    out = list(groups)
    for p in _recomputed(groups):
        readers = [g for g in out if _reads(g, p)]
        made = _chunked(
            p, readers, graph, config.chunk_budget, loop=len({g.chunk.loop for g in out if g.chunk is not None})
        )
        if made is None:
            continue
        first, chunked = made
        at = min(k for k, g in enumerate(out) if any(g is r for r in readers))
        out = [chunked.get(g, g) for g in out]
        out.insert(at, first)
    return tuple(out)


def _recomputed(groups: tuple[Group, ...]) -> list[Expr]:
    """The products GEMM prologues recompute at their operands' tiles, each once."""
    found: dict[Expr, Expr] = {}
    for g in groups:
        for m in g.nodes:
            if REGISTRY[m.op].kind is OpKind.CONTRACTION and g.roles[m] in (Role.A, Role.B) and not g.is_row:
                found.setdefault(m, m)
    return list(found.values())


def _reads(g: Group, p: Expr) -> bool:
    """Does GEMM ``g`` recompute product ``p`` in a prologue?"""
    return not g.is_row and g.contraction is not None and any(m is p for m in g.nodes) and g.roles[p] is Role.A


def _chunked(
    p: Expr, readers: list[Group], graph: Graph, budget: float, loop: int
) -> tuple[Group, dict[Group, Group]] | None:
    """The chunk loop's first kernel (the product and the stored value) and each reader run over
    the chunk, keyed by the reader; None where the loop does not apply or would not pay."""
    shape = graph.of(p).shape
    if len(shape) < 2 or math.prod(shape) == 0 or not readers:
        return None
    chain: dict[Expr, Expr] = {}
    frontier: list[Expr] = []
    axes: dict[Group, str] = {}
    for g in readers:
        reading = _reader(g, p, shape, graph)
        if reading is None:
            return None
        axes[g], values, needed = reading
        chain.update((m, m) for m in values)
        frontier += needed
    stored = _stored(frontier, chain)
    if len(stored) != 1:
        return None
    u = stored[0]
    recomputes = sum(
        reloads("A", graph.of(g.contraction).shape, shape, g.contraction.attr("sum_batch")) for g in readers
    )  # type: ignore[union-attr]
    if recomputes <= MAX_RECOMPUTES:
        return None
    tokens, extent = math.prod(shape[:-1]), shape[-1]
    # the budget is a fraction of the product as eager stores it, in its operands' dtype (a half
    # linear with a bias keeps its product at the accumulator's float32: its logits are still half)
    size = _size(extent, budget * graph.of(p.srcs[0]).dtype.itemsize / graph.of(u).dtype.itemsize)
    cone = _cone(u, chain)
    first_reader = readers[0]
    nodes = tuple(m for m in first_reader.nodes if m in cone)
    chunks = -(-extent // size)
    nbytes = tokens * size * graph.of(u).dtype.itemsize
    note = (
        f"product {list(shape)}: computed once, in {chunks} chunk(s) of {size} of its {extent} columns, "
        f"written one chunk at a time ({' x '.join(map(str, shape[:-1]))} x {size} buffer, {nbytes} bytes = "
        f"{nbytes / max(1, graph.of(p).nbytes):.1%} of the product) for {len(readers)} GEMM(s) in the same loop; "
        f"their prologues would compute it {recomputes} times"
    )
    first = replace(
        first_reader,
        shape=tuple(shape),
        axes=(),
        nodes=nodes,
        roles=MappingProxyType(
            {m: Role.FULL if first_reader.roles[m] is Role.A else first_reader.roles[m] for m in nodes}
        ),
        cone=(),
        notes=(note,),
        chunk=Chunk(loop, "n", extent, size, (u,)),
    )
    chunked = {}
    for g in readers:
        axis = axes[g]
        keep = tuple(m for m in g.nodes if m not in cone)
        how = (
            "sums the chunks in an fp32 accumulator (the last chunk's launch stores)"
            if axis == "k"
            else "writes the chunk's rows"
        )
        notes = (*(n for n in g.notes if "recomputed in tiles" not in n), f"reads the chunk loop's buffer: {how}")
        chunked[g] = replace(
            g,
            nodes=keep,
            roles=MappingProxyType({m: g.roles[m] for m in keep}),
            notes=notes,
            chunk=Chunk(loop, axis, extent, size, (u,)),
        )
    return first, chunked


def _reader(g: Group, p: Expr, shape: tuple[int, ...], graph: Graph) -> tuple[str, list[Expr], list[Expr]] | None:
    """How GEMM ``g`` reads product ``p`` through its A prologue: the window axis of its own
    product that is ``p``'s last dim ("k": it sums over it; "m": its rows), the prologue's values,
    and those its other nodes read (the operand, the inputs of reductions merged in the K loop).
    Another product of ``p``'s shape recomputed beside it (a teacher's logits beside a student's)
    joins the chunk: the first kernel computes it at its output tile. None for readers the loop
    does not handle: a B prologue, another product of another shape, a reduction over the
    chunked dim (it would need an accumulator of its own), a product summing batch dims in its
    programs (grouped-query attention's dK and dV at head dim 256: the chunk's kernels keep one
    batch per program; an AssertionError in codegen)."""
    c = g.contraction
    assert c is not None
    if graph.of(c.srcs[0]).shape != shape or c.attr_dict.get("summed"):
        return None
    prologue = [m for m in g.nodes if g.roles[m] in (Role.A, Role.B)]
    if any(g.roles[m] is Role.B for m in prologue):
        return None
    kinds = [REGISTRY[m.op].kind for m in prologue]
    values = [m for m, k in zip(prologue, kinds) if k is not OpKind.REDUCTION]
    reductions = [m for m, k in zip(prologue, kinds) if k is OpKind.REDUCTION]
    if any(k is OpKind.CONTRACTION and m is not p and graph.of(m).shape != shape for m, k in zip(prologue, kinds)):
        return None
    axis = "m" if c.attr("ta") else "k"
    if axis == "k" and reductions:
        return None
    return axis, values, [c.srcs[0], *(r.srcs[0] for r in reductions)]


def _stored(frontier: list[Expr], chain: dict[Expr, Expr]) -> list[Expr]:
    """The values to store, one each: those read outside the prologue, less any that only converts
    another of them (the readers convert it again, from the stored one)."""
    unique = list(dict.fromkeys(frontier))
    ids = set(unique)

    def converts_another(f: Expr) -> bool:
        while is_cast(f) and f.srcs[0] in chain:
            f = f.srcs[0]
            if f in ids:
                return True
        return False

    return [f for f in unique if not converts_another(f)]


def _cone(u: Expr, chain: dict[Expr, Expr]) -> set[Expr]:
    """The prologue's nodes ``u`` is computed from (``u`` included): the first kernel's."""
    seen: set[Expr] = set()
    stack = [u]
    while stack:
        n = stack.pop()
        if n in seen or n not in chain:
            continue
        seen.add(n)
        stack.extend(n.srcs)
    return seen


def _size(extent: int, budget: float) -> int:
    """Elements per chunk: ``budget`` (a fraction of the product's bytes, in the stored value's
    units) of ``extent``, in whole :data:`CHUNK_TILE` tiles, at least one; the whole extent when
    that is smaller."""
    size = max(CHUNK_TILE, int(budget * extent) // CHUNK_TILE * CHUNK_TILE)
    return min(size, extent)
