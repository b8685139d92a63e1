"""KernelSpec: everything a generated kernel's source depends on, and nothing else.

The spec is built from a fusion group and the input layouts. Sizes, strides and scalar
values are *launch arguments*; only their classes (broadcast, unit stride, general
stride), the dtypes, the structure and the block bucket enter the spec, so the spec's
hash is the structural signature: one compile serves every batch size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..analyzer import FusionGroup, Role
from ..bind import Bound
from ..dtypes import compute_dtype
from ..expr import Expr
from ..ops import REGISTRY, DtypeRule, OpKind

POINTWISE_BLOCK = 1024
MAX_ROW_BLOCK = 16384  # longest row kept whole in registers
LOOP_BLOCK = 4096  # block of a looped row
ROW_TILE = 4096  # elements per program for short rows (several rows each)
INT32_LIMIT = 2**31

# stride classes
BCAST, UNIT, STRIDED = "0", "1", "s"


@dataclass(frozen=True)
class LoadSpec:
    input: int
    role: str  # "full" | "keep" | "drop"
    rows: tuple[str, ...]  # stride class per coalesced row (or flat) dim
    cols: tuple[str, ...]


@dataclass(frozen=True)
class NodeSpec:
    op: str
    attrs: tuple
    srcs: tuple[tuple, ...]  # ("n", i) node, ("l", k) load, ("s", k) scalar slot
    dtype: torch.dtype  # result dtype
    cdt: torch.dtype  # operand compute dtype
    role: str  # "full" | "keep" | "drop"


@dataclass(frozen=True)
class OutSpec:
    node: int
    dtype: torch.dtype
    role: str
    rows: tuple[str, ...]
    cols: tuple[str, ...]


@dataclass(frozen=True)
class KernelSpec:
    kind: str  # "pointwise" | "row"
    in_dtypes: tuple[torch.dtype, ...]
    loads: tuple[LoadSpec, ...]
    nodes: tuple[NodeSpec, ...]
    outputs: tuple[OutSpec, ...]
    scalars: tuple[str, ...]  # "f32" | "f64" | "i" | "b"
    reductions: tuple[int, ...]  # node indices of reductions (row kernels)
    block: int
    rows_per_program: int
    looped: bool
    big: bool  # int64 offsets
    num_warps: int


@dataclass
class Layout:
    """Shape and strides of a tensor a kernel reads or writes."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class LaunchArgs:
    ints: list[int]  # sizes and strides, in signature order
    scalars: list[Any]
    grid: tuple[int, ...]
    empty: bool  # nothing to compute (a zero-size domain)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


def expand_strides(layout: Layout, target: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of ``layout`` broadcast to ``target`` (0 where broadcast)."""
    pad = len(target) - len(layout.shape)
    out = []
    for d, size in enumerate(target):
        sd = d - pad
        if sd < 0 or (layout.shape[sd] == 1 and size != 1):
            out.append(0)
        else:
            out.append(layout.strides[sd])
    return tuple(out)


def coalesce(sizes: list[int], strides: list[tuple[int, ...]]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours that every operand walks contiguously."""
    keep = [d for d, s in enumerate(sizes) if s != 1]
    if not keep and sizes:  # one element along these dims: keep the last so its classes match longer extents
        keep = [len(sizes) - 1]
    sz = [sizes[d] for d in keep]
    st = [[s[d] for d in keep] for s in strides]
    d = len(sz) - 2
    while d >= 0:
        if all(s[d] == s[d + 1] * sz[d + 1] for s in st):
            sz[d] *= sz[d + 1]
            for s in st:
                s[d] = s[d + 1]
                del s[d + 1]
            del sz[d + 1]
        d -= 1
    if not sz:
        sz, st = [1], [[0] for _ in st]
    return sz, st


def _cls(stride: int) -> str:
    return BCAST if stride == 0 else UNIT if stride == 1 else STRIDED


def _role_name(role: Role | None) -> str:
    return "full" if role is None else role.value


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def build(group: FusionGroup, bound: Bound, layouts: dict[int, Layout]) -> tuple[KernelSpec, LaunchArgs]:
    """Spec and launch arguments for ``group``; ``layouts`` maps id(input node) -> its tensor layout."""
    index = {id(n): i for i, n in enumerate(group.nodes)}
    slots: list[Expr] = []  # constants (scalar subexpressions are folded into them at bind)
    loads: list[tuple[int, Role, tuple[int, ...] | None]] = []
    inputs = {id(n): i for i, n in enumerate(group.inputs)}
    kernel_float = (
        torch.float64
        if any(bound.of(n).dtype is torch.float64 for n in [*group.nodes, *group.inputs])
        else torch.float32
    )

    def slot(s: Expr) -> tuple:
        if all(s is not o for o in slots):
            slots.append(s)
        return ("s", next(i for i, o in enumerate(slots) if o is s))

    def ref(s: Expr, consumer_role: Role, view: tuple[int, ...] | None = None) -> tuple:
        if id(s) in index:
            return ("n", index[id(s)])
        if s.op == "const":
            return slot(s)
        key = (inputs[id(s)], consumer_role, view)
        if key not in loads:
            loads.append(key)
        return ("l", loads.index(key))

    node_specs: list[NodeSpec] = []
    for n in group.nodes:
        role = group.role(n)
        opdef = REGISTRY[n.op]
        load_role = Role.FULL if opdef.kind is OpKind.REDUCTION else role
        view = tuple(sorted(n.attr("axes"))) if opdef.view else None
        srcs = tuple(ref(s, load_role, view) for s in n.srcs)
        node_specs.append(NodeSpec(n.op, n.attrs, srcs, bound.of(n).dtype, _cdt(n, bound), role.value))

    # ---- layouts: every operand as strides over the domain --------------------------
    domain = group.shape
    row_dims = [d for d in range(len(domain)) if d not in group.axes]
    col_dims = list(group.axes)
    keep_shape, drop_shape = group.keep_shape(), group.drop_shape()

    def over_domain(strides_of_role: tuple[int, ...], role: Role) -> tuple[int, ...]:
        if role is Role.DROP:  # strides over drop_shape -> strides over domain (0 on reduced dims)
            it = iter(strides_of_role)
            return tuple(0 if d in group.axes else next(it) for d in range(len(domain)))
        return strides_of_role

    operand_strides: list[tuple[int, ...]] = []
    for j, role, view in loads:
        lay = layouts[id(group.inputs[j])]
        if view is not None:  # an unsqueezed operand: the same memory with size-1 dims inserted
            shape, strides = list(lay.shape), list(lay.strides)
            for ax in view:
                shape.insert(ax, 1)
                strides.insert(ax, 0)
            lay = Layout(tuple(shape), tuple(strides), lay.dtype)
        target = {Role.FULL: domain, Role.KEEP: keep_shape, Role.DROP: drop_shape}[role]
        operand_strides.append(over_domain(expand_strides(lay, target), role))
    out_roles = [group.role(o) for o in group.outputs]
    for o, role in zip(group.outputs, out_roles):
        shape = bound.of(o).shape
        operand_strides.append(
            over_domain(contiguous_strides(shape), role)
            if role is not Role.KEEP
            else over_domain(contiguous_strides(drop_shape), Role.DROP)
        )

    row_sizes, row_strides = coalesce(
        [domain[d] for d in row_dims], [tuple(s[d] for d in row_dims) for s in operand_strides]
    )
    if group.is_row:
        col_sizes, col_strides = coalesce(
            [domain[d] for d in col_dims], [tuple(s[d] for d in col_dims) for s in operand_strides]
        )
        n_rows, n_cols = math.prod(drop_shape), math.prod(domain[d] for d in col_dims)
    else:
        col_sizes, col_strides = [], [[] for _ in operand_strides]
        n_rows, n_cols = math.prod(domain), 1
    numel = n_rows * n_cols
    reach = max(
        [numel]
        + [
            sum(abs(st) * (sz - 1) for st, sz in zip(s, row_sizes))
            + sum(abs(st) * (sz - 1) for st, sz in zip(c, col_sizes))
            for s, c in zip(row_strides, col_strides)
        ]
    )
    big = reach >= INT32_LIMIT

    classes = [(tuple(_cls(s) for s in r), tuple(_cls(s) for s in c)) for r, c in zip(row_strides, col_strides)]
    load_specs = tuple(LoadSpec(j, role.value, *classes[k]) for k, (j, role, _) in enumerate(loads))
    if not group.is_row:  # pointwise outputs are contiguous over the domain: written at offs
        classes[len(loads) :] = [((), ())] * len(group.outputs)
        row_strides, col_strides = row_strides[: len(loads)], col_strides[: len(loads)]
    out_specs = tuple(
        OutSpec(index[id(o)], bound.of(o).dtype, role.value, *classes[len(loads) + k])
        for k, (o, role) in enumerate(zip(group.outputs, out_roles))
    )

    ints: list[int] = []
    if group.is_row:
        ints += [n_rows, n_cols] + (row_sizes if len(row_sizes) > 1 else []) + (col_sizes if len(col_sizes) > 1 else [])
    else:
        ints += [numel] + (row_sizes if len(row_sizes) > 1 else [])
    for r, c in zip(row_strides, col_strides):
        ints += [s for s in r if _cls(s) == STRIDED] + [s for s in c if _cls(s) == STRIDED]

    scalar_kinds, scalar_vals = [], []
    for s in slots:
        v = bound.of(s).value
        if isinstance(v, bool):
            scalar_kinds.append("b")
            scalar_vals.append(int(v))
        elif isinstance(v, int):
            scalar_kinds.append("i")
            scalar_vals.append(v)
        else:
            scalar_kinds.append("f64" if kernel_float is torch.float64 else "f32")
            scalar_vals.append(_f64_bits(v) if kernel_float is torch.float64 else float(v))

    if group.is_row:
        looped = n_cols > MAX_ROW_BLOCK
        block = LOOP_BLOCK if looped else _pow2(max(n_cols, 1))
        rows_per_program = 1 if looped else max(1, ROW_TILE // block)
        grid = (max(1, -(-n_rows // rows_per_program)),)
        tile = block * rows_per_program
    else:
        looped, block, rows_per_program = False, POINTWISE_BLOCK, 1
        grid = (max(1, -(-numel // block)),)
        tile = block
    num_warps = 4 if tile <= 2048 else 8 if tile <= 8192 else 16
    reductions = tuple(i for i, n in enumerate(group.nodes) if REGISTRY[n.op].kind is OpKind.REDUCTION)
    spec = KernelSpec(
        kind="row" if group.is_row else "pointwise",
        in_dtypes=tuple(layouts[id(n)].dtype for n in group.inputs),
        loads=load_specs,
        nodes=tuple(node_specs),
        outputs=out_specs,
        scalars=tuple(scalar_kinds),
        reductions=reductions,
        block=block,
        rows_per_program=rows_per_program,
        looped=looped,
        big=big,
        num_warps=num_warps,
    )
    return spec, LaunchArgs(ints=ints, scalars=scalar_vals, grid=grid, empty=numel == 0)


def _cdt(n: Expr, bound: Bound) -> torch.dtype:
    """The dtype ``n``'s operands are computed in."""
    info = bound.of(n)
    rule = REGISTRY[n.op].rule
    if rule is DtypeRule.CAST:
        return compute_dtype(bound.of(n.srcs[0]).dtype)
    if rule is DtypeRule.COMPARE:
        a, b = (bound.of(s).like for s in n.srcs)
        return compute_dtype(torch.result_type(a, b))
    return compute_dtype(info.dtype)


def _f64_bits(v: float) -> int:
    import struct

    return struct.unpack("<q", struct.pack("<d", float(v)))[0]
