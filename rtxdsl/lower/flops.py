"""The compute model beside the traffic model: tensor-core FLOPs of the contractions each kernel
computes, a product a GEMM's prologue recomputes counted once per output tile that loads it.

Elementwise math is not counted here: a memory-bound kernel's cost is its bytes (the traffic
model); what a plan can multiply many times over is a contraction. The minimum is each
contraction of the graph computed once.

    2 * m * n * k        FLOPs of one product (times its batches)
    x reloads(side)      a product recomputed in a GEMM's prologue, per output tile loading it
"""

from __future__ import annotations

import math

import torch

from ..expr import Expr
from ..ops import REGISTRY, OpKind
from .analyze import Group
from .expand import Graph
from .prologue import reloads
from .roles import Role


def product_flops(c: Expr, graph: Graph) -> int:
    """``2 * m * n * k`` for contraction ``c``, times its batches (a contracted batch too)."""
    a, b = (graph.of(s).shape for s in c.srcs)
    k = a[-2] if c.attr("ta") else a[-1]
    out = graph.of(c).shape
    full = torch.broadcast_shapes(a[:-2], b[:-2])  # a product's summed batch dims are computed too
    batches = math.prod(a[:-2]) if c.attr("sum_batch") else math.prod(full)
    return 2 * math.prod(out[-2:]) * k * batches


def kernel_flops(group: Group, graph: Graph) -> list[int]:
    """Tensor-core FLOPs of ``group``'s kernel, one entry per product it computes in tiles of its
    own: a row kernel's products (in graph order: each computed once per pass that reads it,
    ``lower._product_passes``), or a GEMM's product and any its epilogue computes at the output
    tile once, plus each product its prologues recompute once per output tile that loads its
    operand (``prologue.reloads``: the tiles along the GEMM's other dim)."""
    products = [n for n in group.nodes if REGISTRY[n.op].kind is OpKind.CONTRACTION]
    if group.is_row:
        return [product_flops(n, graph) for n in products]
    own = group.contraction
    total = product_flops(own, graph) if own is not None else 0
    for n in products:
        if n is own:
            continue
        side = group.role(n)
        assert own is not None
        if side is Role.FULL:  # an epilogue's, at the output tile: once
            total += product_flops(n, graph)
            continue
        operand = own.srcs[0 if side is Role.A else 1]
        times = reloads(side.value.upper(), graph.of(own).shape, graph.of(operand).shape, own.attr("sum_batch"))
        total += product_flops(n, graph) * times
    return [total]


def minimum_flops(graph: Graph) -> int:
    """Each contraction of ``graph`` computed once."""
    return sum(product_flops(n, graph) for n in graph.nodes if REGISTRY[n.op].kind is OpKind.CONTRACTION)
