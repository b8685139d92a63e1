"""The fusion analyzer: a typed primitive graph -> fusion groups, one kernel each.

Each group runs over a *domain*: a full shape ``S`` and the axes ``A`` it reduces (none for
pointwise groups). Inside a row group (``A`` non-empty) a node has a role: FULL (varies over
the whole domain), KEEP (one value per row, reduced dims kept as size 1) or DROP (one value
per row, reduced dims removed).

The analysis is a sequence of passes, each a function from (graph, groups) to new groups:

1. ``partition``: greedy, in topological order. An elementwise node joins its operands'
   groups when its shape and their roles fit (operand groups that fit are merged unless that
   would make a cycle between groups); a private pointwise producer of a smaller,
   broadcastable shape is absorbed and recomputed at the larger shape; a reduction takes its
   input's pointwise group as prologue or joins a row group over the same rows (softmax:
   logsumexp, then exp(x - lse)). ``min_fusion_ops`` re-runs it with small groups kept apart.
2. ``merge_siblings``: independent groups over the same domain become one kernel.
3. ``absorb_per_row``: math on leaves only is recomputed in every kernel that reads it.
4. ``recompute_elementwise``: a kernel reading another kernel's elementwise value recomputes
   it from leaves instead of reading it back.
5. ``fuse_product_rows``: a row kernel reducing GEMMs' products over their last axis computes
   each product tile by tile itself (never written: linear cross-entropy; a student's and a
   teacher's logits in one distillation loss).
6. ``absorb_prologues``: a GEMM recomputes an elementwise operand at load time (its prologue)
   where the traffic model says that is cheaper than writing the operand and reading it back.
   Then ``merge_products``: two GEMMs of one shape that share an operand (a gate and an up
   projection of one input, k and v of one hidden state) become one kernel summing both
   products in one K loop, the shared operand's tile loaded (or its prologue computed) once; two
   where one reads the other (``dg @ wg + du @ wu``) become one kernel with two K loops.
7. ``chunk_recomputed`` (``lower/chunk.py``): a product that GEMM prologues would recompute
   many times (linear cross-entropy's backward) is computed once instead, a chunk of its last
   dim at a time, by a GEMM of its own whose epilogue writes the prologue's value to a buffer
   of one chunk; the GEMMs read it there, in the same loop.
8. ``finish``: what each kernel reads and writes (a value is written only when requested or
   read by a kernel that does not compute it), its pattern, and a launch order.

Movement ops that re-index (slices, ``cat``, ``flip``, ``gather``) are evaluated inside the
kernel that consumes them: their operands' elementwise cones are recomputed at the remapped
coordinates from leaves and reductions (:class:`Flow`). A node only ever read through such
cones is *free*: no group owns it and nothing writes it.

Each pass is a module of this package (``partition``, ``siblings``, ``per_row``, ``recompute``,
``product_rows``, ``prologues`` with the K loop's reductions in ``kloop``, ``products``,
``finish``) over what they share: ``groups`` (``Group``, the mutable ``Work`` group a pass edits,
the groups' dependences), ``flow`` (data flow through movement ops) and ``tiles`` (what a kernel
computes tile by tile). Tables are keyed by nodes and groups themselves: an ``Expr`` is interned
(equal structure, one object) and hashes by identity, as groups do.
"""

from __future__ import annotations

from ...config import FusionConfig
from ..chunk import chunk_recomputed
from ..expand import Graph
from ..roles import Role
from .finish import finish
from .flow import flow, positions_only, read_srcs
from .groups import Group, Plan, broadcasts, contraction_of, views_of_inputs
from .partition import partition
from .per_row import absorb_per_row
from .product_rows import fuse_product_rows
from .products import merge_products
from .prologues import absorb_prologues
from .recompute import recompute_elementwise
from .siblings import merge_siblings
from .tiles import alone_in_rows, reduced_in_rows

__all__ = [
    "Group",
    "Plan",
    "Role",
    "alone_in_rows",
    "analyze",
    "broadcasts",
    "contraction_of",
    "positions_only",
    "read_srcs",
    "reduced_in_rows",
    "views_of_inputs",
]


def analyze(graph: Graph, config: FusionConfig) -> Plan:
    """Partition ``graph`` into fusion groups under ``config``'s limits."""
    fl = flow(graph)
    groups = partition(graph, fl, config, frozenset())
    small = frozenset(n for g in groups if graph.ops(g.nodes) < config.min_fusion_ops for n in g.nodes)
    if small:
        groups = partition(graph, fl, config, small)
    groups = merge_siblings(graph, fl, groups, config, small)
    groups = absorb_per_row(graph, fl, groups, config, small)
    groups = recompute_elementwise(graph, fl, groups, config, small)
    groups = fuse_product_rows(graph, fl, groups, small)
    groups = absorb_prologues(graph, fl, groups, config, small)
    groups = merge_products(graph, fl, groups, config, small)
    groups = chunk_recomputed(graph, groups, config)
    return finish(graph, fl, groups)
