"""Passes over the inputs (the honest traffic model): what a kernel spec loads in which pass.

A looped row reads its inputs once per reduction level (a softmax's max-and-sum pass, then its
output pass); a split row's partial kernel makes the reductions' pass and its finish kernel the
output pass. ``bytes_moved`` and the split kernels' buffers are read off these."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..ops import REGISTRY, OpKind
from .roles import Role
from .spec import KernelSpec, NodeSpec, Split, Src


def remaps(spec: KernelSpec) -> bool:
    """Does the kernel read values at remapped coordinates (a movement op other than a view, or a
    product's operands at its tiles)? A flat kernel reads everything at its own indices."""
    return spec.gemm is not None or any(
        REGISTRY[n.op].kind is OpKind.MOVEMENT and not REGISTRY[n.op].view for n in spec.nodes
    )


def is_reshape(spec: KernelSpec, i: int) -> bool:
    """A reduction of a per-row value (over size-1 dims) is the value itself, not a pass."""
    node = spec.nodes[i]
    if REGISTRY[node.op].kind is not OpKind.REDUCTION:
        return False
    kind, j = node.srcs[0]
    role = spec.nodes[j].role if kind is Src.NODE else spec.loads[j].role if kind is Src.LOAD else "const"
    return role is not Role.FULL


def _depth(spec: KernelSpec) -> Callable[[tuple], int]:
    """``depth(ref)``: how many reduction passes a value needs before it (0: none)."""
    memo: dict[int, int] = {}

    def depth(ref: tuple) -> int:
        if ref[0] is not Src.NODE:
            return 0
        i = ref[1]
        if i not in memo:
            d = max((depth(s) for s in spec.nodes[i].srcs), default=0)
            is_pass = REGISTRY[spec.nodes[i].op].kind is OpKind.REDUCTION and not is_reshape(spec, i)
            memo[i] = d + 1 if is_pass else d
        return memo[i]

    return depth


def levels(spec: KernelSpec) -> dict[int, int]:
    """Reduction node -> its pass (1 + the passes of the reductions it depends on)."""
    depth = _depth(spec)
    return {i: depth((Src.NODE, i)) for i in spec.reductions if not is_reshape(spec, i)}


def early_outputs(spec: KernelSpec) -> list[int]:
    """Full-size outputs of a looped row that need none of its reductions (``dx`` beside the
    ``db`` column sum of a bias gradient): stored in the first pass (a split row's partial kernel),
    so no later pass reads their inputs again."""
    if spec.kind != "row" or not spec.looped or spec.split is Split.TILE or not levels(spec):
        return []
    depth = _depth(spec)
    return [k for k, o in enumerate(spec.outputs) if o.role is Role.FULL and depth((Src.NODE, o.node)) == 0]


def input_scopes(spec: KernelSpec) -> list[set[Any]]:
    """Where each input is loaded: in which looped pass (its reduction level), in the output loop
    ("out"), or once per row ("top"). A kernel kept in registers loads everything once ("top")."""
    if spec.kind != "row" or not spec.looped:
        return [{"top"} for _ in spec.in_dtypes]
    lv = levels(spec)
    reads: list[set[Any]] = [set() for _ in spec.in_dtypes]

    def mark(ref: tuple, scope: Any, seen: set) -> None:
        if ref in seen:
            return
        seen.add(ref)
        kind, i = ref
        if kind is Src.LOAD:
            ld = spec.loads[i]
            reads[ld.input].add(scope if ld.role is Role.FULL else "top")
        elif kind is Src.NODE:
            if i in lv and lv[i] != scope:  # a finished reduction: a value on chip, read nothing
                return
            node = spec.nodes[i]
            op = REGISTRY[node.op]
            if op.index_operand is not None and node.role is not Role.FULL:  # one gathered element per row
                mark(node.srcs[op.index_operand], scope, seen)
                return
            for s in node.srcs:
                mark(s, scope, seen)

    for level in sorted(set(lv.values())):
        for i in (i for i, v in lv.items() if v == level):
            for s in spec.nodes[i].srcs:
                mark(s, level, set())
    early = early_outputs(spec)
    for k, o in enumerate(spec.outputs):
        mark((Src.NODE, o.node), 1 if k in early else "out" if o.role is Role.FULL else "top", set())
    return reads


def input_reads(spec: KernelSpec) -> list[int]:
    """How many times each input is read: once per looped pass that loads it (a split row's partial
    kernel makes the reductions' pass, its finish kernel the output pass)."""
    scopes = input_scopes(spec)
    if spec.split is Split.MERGE:  # partial states only
        return [0 for _ in scopes]
    if spec.split is Split.PARTIAL:
        return [int(1 in s) for s in scopes]
    if spec.split is Split.FINISH:
        return [len(s - {1}) for s in scopes]
    return [max(1, len(s)) for s in scopes]


def partial_states(spec: KernelSpec) -> list[tuple[int, int, torch.dtype]]:
    """The partial buffers a kernel stores or merges, (reduction node, state components, dtype) per
    reduction: a split row's, or a row kernel's column reductions (``KernelSpec.columns``); one
    per state (``state_twins``)."""
    twins = state_twins(spec)
    reductions = [i for i in spec.columns or sorted(levels(spec)) if i not in twins]
    return [(i, len(REGISTRY[spec.nodes[i].op].reduce.state), reduce_dtype(spec.nodes[i])) for i in reductions]


def state_twins(spec: KernelSpec) -> dict[int, int]:
    """Reduction -> the kernel's first reduction whose state it shares: the same declared state
    (lift, tile, merge) over the same operand, axes and dtype, read off another way (logsumexp and
    ``softmax_sum``). A kernel computes, merges and stores that state once."""
    first: dict[tuple, int] = {}
    twins = {}
    for i in sorted(spec.reductions):
        n = spec.nodes[i]
        red = REGISTRY[n.op].reduce
        key = (red.lift, red.tile, red.merge, red.tile_of, n.srcs[0], n.attrs, reduce_dtype(n), n.role)
        if key in first:
            twins[i] = first[key]
        else:
            first[key] = i
    return twins


def reduce_dtype(node: NodeSpec) -> torch.dtype:
    """The dtype a reduction's state is kept in (booleans are counted in int32)."""
    return torch.int32 if node.cdt is torch.bool else node.cdt
