"""Pass 4: a kernel recomputes another kernel's elementwise value from leaves instead of reading it back."""

from __future__ import annotations

from ...config import FusionConfig
from ...expr import Expr
from ...ops import REGISTRY, OpKind
from ..expand import Graph, is_leaf
from ..roles import Role
from .flow import Flow, positions_only, read_srcs
from .groups import Group, Work, broadcasts, consumers_of, cyclic, homes_of, order_of, per_row_role_of, still_writes
from .tiles import tileable


def recompute_elementwise(
    graph: Graph, fl: Flow, groups: tuple[Group, ...], config: FusionConfig, solo: frozenset[Expr]
) -> tuple[Group, ...]:
    """A kernel reading another's elementwise value recomputes it from leaves instead.

    E.g. layer_norm's backward: the weight-gradient column reduction recomputes ``g * xhat``
    rather than have the row kernel write it and read it back.
    """
    work = [Work.of(g) for g in groups]
    homes = homes_of(work)
    requested = {e for _, e in graph.outputs}
    # operands of a product recomputed in tiles are read from memory wherever it is computed: their
    # home writes them, and a copy here would shadow that load in a GEMM that later takes the
    # product into its prologue (linear cross-entropy over tanh(h): d/dh's epilogue recomputing
    # tanh(h) made the recomputed logits read it at the output's coordinates, d/dh wrong)
    stored = {x for n in graph.nodes if tileable(graph, n) for x in n.srcs}
    consumers = consumers_of(graph, fl)

    def ancestry(s: Expr, r1: Work, r2: Work) -> list[Expr] | None:
        """``s`` and what it needs inside ``r1``, if all of it is elementwise over leaves and fits ``r2``
        (a requested value is written anyway: it is read back, and its home stays the kernel that writes it)."""
        out: list[Expr] = []
        stack, seen = [s], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            kind = REGISTRY[n.op].kind
            if (
                n in solo
                or n in requested
                or n in stored
                or (kind is not OpKind.ELEMENTWISE and not positions_only(n))  # positions read nothing
                or r1.role(n) is Role.DROP
                or not broadcasts(graph.of(n).shape, r2.shape)
            ):
                return None
            out.append(n)
            for src in read_srcs(n):
                if src in homes and work[homes[src]] is r1:
                    stack.append(src)
                elif not is_leaf(src, graph.info):
                    return None  # another kernel's output: reading it here could order kernels in a cycle
        return out

    for r2 in work:
        for m in list(r2.nodes):
            if REGISTRY[m.op].view or REGISTRY[m.op].kind is OpKind.CONTRACTION:
                continue  # a view of the value is not the value broadcast; a GEMM loads its operands
            for s in fl.reads[m]:
                if s not in homes:
                    continue
                r1 = work[homes[s]]
                if r1 is r2 or s in set(r2.nodes):
                    continue
                chain = ancestry(s, r1, r2)
                if chain is None or graph.ops(r2.nodes + list(chain)) > config.max_fusion_ops:
                    continue
                c = r2.contraction
                if c is not None and any(x is n for n in chain for x in c.srcs):
                    continue  # the GEMM loads that operand: its epilogue reads it back too (``a + a @ w``)
                roles = dict(r2.roles)
                for n in chain:
                    r2.roles[n] = per_row_role_of(r2, graph.of(n).shape)
                r2.nodes[:0] = chain
                if cyclic(graph, work, [], fl, requested, consumers):  # the copy would be read from r2
                    r2.nodes[: len(chain)], r2.roles = [], roles  # (a [4, 1] value at r2's domain exactly)
    # a kernel whose every value its readers now recompute (a causal mask's positions) is gone
    order = order_of(graph)
    return tuple(g.freeze(order) for g in work if still_writes(g, work, requested, consumers))
