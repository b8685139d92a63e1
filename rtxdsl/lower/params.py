"""A kernel's parameters, in order: the one place that knows it.

Code generation renders the signature from :func:`kernel_params`; the spec builders give each
launch argument's value by its parameter's name (:func:`launch_ints` orders them); the program
lists a launch's buffers by the pointer parameters (:func:`buffer_order`). A tail kernel folded
into the launch before it (``KernelSpec.tail``) adds its pointers after the head's, then the
ticket counter, then its other parameters after the head's, each named ``t_<name>``.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass

from ..ops import REGISTRY, OpKind
from .passes import partial_states
from .roles import Role
from .spec import STRIDED, KernelCall, KernelSpec, LoadSpec, NodeSpec, Split, Src, Stride, read_as

#: the operand tiles a GEMM prologue reads at (a load with another role is read at the product's)
OPERAND_ROLES = (Role.A, Role.B)


def prologue_cost(nodes: tuple[NodeSpec, ...]) -> int:
    """What a GEMM's prologues compute per score, in ``OpDef.cost`` (1 an arithmetic op, 4 a
    transcendental one): attention's causal dK + dV 20 (an exp, a mask, the row terms)."""
    return sum(REGISTRY[n.op].cost for n in nodes if n.role in OPERAND_ROLES)


class ParamKind(enum.Enum):
    """What a kernel parameter is, and so where its value comes from."""

    INPUT = "input"  # ``in{j}_ptr``: the group's j-th input
    OUTPUT = "output"  # ``out{k}_ptr``: its k-th output
    PARTIAL = "partial"  # ``part{i}_ptr``: a split row's partial states of reduction i (a chunk loop's ``acc_ptr``)
    FLAGS = "flags"  # ``flag_ptr``: gathers' index-check flags
    COUNTER = "counter"  # ``count_ptr``: the ticket counter of a tail's head
    INT = "int"  # a size, stride, split or movement argument: a launch integer
    SCALAR = "scalar"  # ``s{k}``: a constant or a scalar input


POINTERS = (ParamKind.INPUT, ParamKind.OUTPUT, ParamKind.PARTIAL, ParamKind.FLAGS, ParamKind.COUNTER)

# ---- parameter names: spelled here only (the code generators and the launch ask for them) ----------
#: the pointer of gathers' index-check flags, a tail's ticket counter, a chunk loop's accumulator
FLAG_PTR, COUNT_PTR, ACC_PTR = "flag_ptr", "count_ptr", "acc_ptr"


def input_name(j: int) -> str:
    """The positional name of a group's ``j``-th input (``in{j}``; ``codegen.names`` renames it
    after the user's input in the printed module)."""
    return f"in{j}"


def output_name(k: int) -> str:
    """The positional name of a group's ``k``-th output (``out{k}``)."""
    return f"out{k}"


def input_ptr(j: int) -> str:
    return f"{input_name(j)}_ptr"


def output_ptr(k: int) -> str:
    return f"{output_name(k)}_ptr"


def partial_ptr(i: int) -> str:
    """The pointer of a split row's partial states of reduction ``i``."""
    return f"part{i}_ptr"


def stride_name(prefix: str, d: int) -> str:
    """The stride of dim ``d`` of what ``prefix`` names (a load, an output, a GEMM operand's tile
    dims numbered after its batch dims)."""
    return f"{prefix}_stride{d}"


def batch_stride_name(prefix: str, d: int) -> str:
    """A GEMM operand's stride along its ``d``-th batch dim."""
    return f"{prefix}_stride_b{d}"


def dim_stride_name(prefix: str, dim: str) -> str:
    """A GEMM operand's stride along its matrix dim ``dim`` (``m``, ``n`` or ``k``)."""
    return f"{prefix}_stride_{dim}"


@dataclass(frozen=True)
class Param:
    name: str
    kind: ParamKind
    index: int = 0  # which input, output or partial state a pointer is


def load_names(loads: tuple[LoadSpec, ...]) -> list[str]:
    """Each load's name in parameters (``in{j}``; ``in{j}_{k}`` for an input loaded again, re-laid-out)."""
    names, seen = [], set()
    for k, ld in enumerate(loads):
        base = input_name(ld.input)
        names.append(base if ld.input not in seen else f"{base}_{k}")
        seen.add(ld.input)
    return names


def _ints(names: list[str]) -> list[Param]:
    return [Param(n, ParamKind.INT) for n in names]


def _pointers(spec: KernelSpec, parts: bool, flags: bool) -> list[Param]:
    out = [Param(input_ptr(j), ParamKind.INPUT, j) for j in range(len(spec.in_dtypes))]
    out += [Param(output_ptr(k), ParamKind.OUTPUT, k) for k in range(len(spec.outputs))]
    if parts:
        out += [Param(partial_ptr(i), ParamKind.PARTIAL, k) for k, (i, _, _) in enumerate(partial_states(spec))]
    return out + ([Param(FLAG_PTR, ParamKind.FLAGS)] if flags else [])


def _scalars(spec: KernelSpec) -> list[Param]:
    return [Param(f"s{k}", ParamKind.SCALAR, k) for k in range(len(spec.scalars))]


def strided(prefix: str, classes: tuple[Stride, ...], first: int = 0) -> list[str]:
    """An operand's stride parameters, in every kernel family: ``<prefix>_stride<d>`` for each
    strided dim ``d`` of those the kernel indexes it by (a flat kernel's rows then columns, a
    coordinate kernel's own dims, a GEMM tile's dims after ``first`` batch dims)."""
    return [stride_name(prefix, first + d) for d, c in enumerate(classes) if c == STRIDED]


def _extent_names(spec: KernelSpec, nr: int, nc: int) -> list[str]:
    """A row kernel's rows and columns (each side's dims when several) and a split row's splits;
    a pointwise kernel's element count (and its dims when several)."""
    if spec.kind != "row":
        return ["n_elements"] + ([f"size{d}" for d in range(nr)] if nr > 1 else [])
    names = ["n_rows", "n_cols"] + ([f"rsize{d}" for d in range(nr)] if nr > 1 else [])
    names += [f"csize{d}" for d in range(nc)] if nc > 1 else []
    if spec.split is Split.MERGE:  # the programs whose partial states it merges
        return [*names, "n_split"]
    return names + (["n_split", "chunk"] if spec.split else [])


def _indexed(spec: KernelSpec) -> list[Param]:
    """A row or pointwise kernel's (flat ones are coordinate kernels over coalesced dims)."""
    assert spec.domain is not None
    nr = sum(1 for red in spec.domain if not red)
    nc = len(spec.domain) - nr
    params = _pointers(spec, bool(spec.split or spec.columns), bool(spec.flags))
    names = _extent_names(spec, nr, nc)
    for name, ld in zip(load_names(spec.loads), spec.loads):
        names += strided(name, ld.rows)
    for k, o in enumerate(spec.outputs):
        names += strided(output_name(k), o.rows)
    for i, n in enumerate(spec.nodes):
        names += [f"m{i}_{k}" for k in range(n.nargs)]
    return params + _ints(names) + _scalars(spec)


def tile_loads(nodes: tuple[NodeSpec, ...]) -> list[int]:
    """The loads a GEMM's epilogue and prologues read, each at its own tile (its role: "full" at the
    product's, "a" / "b" at an operand's). A plain operand is read by the K loop through its own strides."""
    used = {
        i for nd in nodes if REGISTRY[nd.op].kind is not OpKind.CONTRACTION for kind, i in nd.srcs if kind is Src.LOAD
    }
    return sorted(used)


def inner_products(nodes: tuple[NodeSpec, ...]) -> list[int]:
    """The products a GEMM computes beside its own (the first of its output tile's), each with a K
    loop of its own: a prologue's at an operand's tiles, an epilogue's at the output tile (a chunk
    loop's second product)."""
    products = [i for i, nd in enumerate(nodes) if REGISTRY[nd.op].kind is OpKind.CONTRACTION]
    own = next((i for i in products if nodes[i].role is Role.FULL), None)
    return [i for i in products if i != own]


#: a product summed in the kernel's K loop that shares no operand with its own: both are prologues
#: at A's tile, computed once where they share a node (``analyze.merge_products``: dK beside dV)
NONE_SHARED = -1


def shared_operands(spec: KernelSpec) -> dict[int, int]:
    """The products a GEMM's epilogue computes beside its own in its K loop
    (``analyze.merge_products``), each with the side it shares, read the same way (0: A, 1: B: a gate
    and an up projection of one input; :data:`NONE_SHARED`: attention's dV beside dK, both A
    operands prologues at the loop's tile). Their other operands are loaded or computed at the
    loop's tile; they have no K loop (nor ``K{i}``) of their own. Not in a chunk loop's,
    online-softmax or batch-summing kernel, whose K loops are their own product's, nor, sharing an
    operand, in a block-sparse one (its guard is the prologues')."""
    g = spec.gemm
    if g is None or g.window is not None or g.online is not None or g.sum_batch:
        return {}
    own = next(nd for nd in spec.nodes if REGISTRY[nd.op].kind is OpKind.CONTRACTION and nd.role is Role.FULL)
    shared: dict[int, int] = {}
    for i in inner_products(spec.nodes):
        nd = spec.nodes[i]
        if nd.role is not Role.FULL:
            continue
        side = next((s for s in (0, 1) if nd.srcs[s] == own.srcs[s]), None)
        # an operand shared: read the same way, one dtype (as matmul's), a K loop of the kernel's own
        # only (a block-sparse guard or a summed batch: summed beside it as none shared, if at all)
        if nd.attrs != own.attrs or g.guard is not None or g.summed:
            side = None
        if side is not None and _at_tile(spec, nd.srcs[1 - side], OPERAND_ROLES[1 - side]):
            shared[i] = side
        elif side is None and read_as(nd.attrs) == read_as(own.attrs):
            if _prologue(spec, nd.srcs[0]) and _prologue(spec, own.srcs[0]):
                shared[i] = NONE_SHARED
    return shared


def transposed_operands(spec: KernelSpec) -> dict[int, int]:
    """The products of the K loop (the kernel's own, and those summed beside it: ``shared_operands``)
    whose right operand's tile is, transposed, the tile a product its A prologue recomputes whole
    (``GemmTile.whole_k``) loads as the K loop moves, ``X[ks, kk]`` at ``[kk, ks]``: each such
    product -> the recomputed one. Attention's backward: dK + dV's ``dS.T @ q`` and ``P.T @ dO``
    read ``q`` and ``dO`` where the scores and ``dO @ v.T`` read them transposed (dQ's ``dS @ k``
    likewise ``k``). Both read one input in one dtype; the product's columns are the recomputed
    product's contracted size (that input's last dim), one block of ``BLOCK_N`` = the slice
    (autotune keeps it: ``schedule.candidates``), so ``offs_n`` is the slice's index vector."""
    g = spec.gemm
    own = next(
        (i for i, nd in enumerate(spec.nodes) if REGISTRY[nd.op].kind is OpKind.CONTRACTION and nd.role is Role.FULL),
        None,
    )
    if g is None or own is None or not g.whole_k:
        return {}
    # the moving tile: the product's right operand read transposed, or, where the kernel reads A
    # transposed (its products' tiles swapped), its left operand read as stored
    side, flag, want = (0, "ta", False) if dict(spec.nodes[own].attrs)["ta"] else (1, "tb", True)
    moving: dict[tuple[int, object], int] = {}
    for i, _ in g.whole_k:
        nd = spec.nodes[i]
        kind, k = nd.srcs[side]
        if nd.role is Role.A and kind is Src.LOAD and dict(nd.attrs)[flag] is want:
            moving.setdefault((spec.loads[k].input, nd.cdt), i)
    found = {}
    for c in (own, *shared_operands(spec)):
        kind, k = spec.nodes[c].srcs[1]
        key = (spec.loads[k].input, spec.nodes[c].cdt) if kind is Src.LOAD else None
        if key in moving and not dict(spec.nodes[c].attrs)["tb"]:
            found[c] = moving[key]
    return found


def _prologue(spec: KernelSpec, ref: tuple[Src, int]) -> bool:
    """Is ``ref`` computed by A's prologue (a product recomputed at its tile)?"""
    kind, i = ref
    return kind is Src.NODE and spec.nodes[i].role is Role.A


def _at_tile(spec: KernelSpec, ref: tuple[Src, int], role: Role) -> bool:
    """Is ``ref`` read from memory, or computed by a prologue at operand ``role``'s tile?"""
    kind, i = ref
    return kind is Src.LOAD or spec.nodes[i].role is role


def product_loads(spec: KernelSpec, i: int, shared: Mapping[int, int]) -> tuple[int, ...]:
    """The loads whose strides recomputed product ``i`` reads: both operands', or, summed in the
    kernel's own K loop (``shared``), its unshared operand's where read from memory (a prologue's
    loads are at its tile)."""
    if i not in shared:
        return tuple(k for _, k in spec.nodes[i].srcs)
    return tuple(k for s, (kind, k) in enumerate(spec.nodes[i].srcs) if s != shared[i] and kind is Src.LOAD)


def _gemm(spec: KernelSpec) -> list[Param]:
    g = spec.gemm
    assert g is not None
    nb, out_dims = g.batch, (0 if g.sum_batch else g.batch) + 2
    names = load_names(spec.loads)
    params = _pointers(spec, False, False)
    ints = ["M", "N", "K", *(f"bsize{d}" for d in range(nb))]
    for op, dims, classes, j in (("a", "mk", g.a_classes, g.a), ("b", "kn", g.b_classes, g.b)):
        if j >= 0:  # read from memory (a prologue reads its own loads)
            ints += [batch_stride_name(op, d) for d in range(nb)]
            ints += [dim_stride_name(op, dim) for dim, c in zip(dims, classes) if c == STRIDED]
    for k in tile_loads(spec.nodes):
        ld = spec.loads[k]
        n_b = nb if ld.role in OPERAND_ROLES else out_dims - 2
        ints += [stride_name(names[k], d) for d in range(n_b)]
        ints += strided(names[k], (*ld.rows, *ld.cols), n_b)
    for k, o in enumerate(spec.outputs):
        if o.role is Role.FULL:  # a reduction of A is contiguous: one value per row of the product
            ints += [stride_name(output_name(k), d) for d in range(out_dims - 1)]  # columns: stride 1
    shared = shared_operands(spec)
    for i in inner_products(spec.nodes):  # a recomputed product: its contracted size, its operands' strides
        if i not in shared:
            ints.append(f"K{i}")
        for k in product_loads(spec, i, shared):
            ld = spec.loads[k]
            ints += [batch_stride_name(names[k], d) for d in range(nb)]
            # numbered past the batch dims, as a load at a tile numbers them: one read both ways
            # (``(g.mT @ s) * exp(s)``) has one name per stride (``s_stride0`` was its batch stride
            # at the tile and its row stride in the product: one value for both, the product wrong)
            ints += strided(names[k], (*ld.rows, *ld.cols), nb)
    if g.window is not None:  # a chunk loop's kernel: where its chunk starts; accumulating, is it the last
        ints += ["W_LO", *(["W_LAST"] if g.window.accumulate is not None else [])]
        if g.window.accumulate is not None:
            params.append(Param(ACC_PTR, ParamKind.PARTIAL, 0))
    # a load two products read (attention's ``q @ k.mT`` with q and k one tensor: both operands of
    # one product) has its strides once
    return params + _ints(list(dict.fromkeys(ints))) + _scalars(spec)


@functools.lru_cache(maxsize=4096)
def own_params(spec: KernelSpec) -> tuple[Param, ...]:
    """The kernel's own parameters (without a tail's); built once per spec."""
    if spec.kind == "gemm":
        return tuple(_gemm(spec))
    return tuple(_indexed(spec))


@functools.lru_cache(maxsize=4096)
def kernel_params(spec: KernelSpec) -> tuple[Param, ...]:
    """Every parameter of the kernel, in signature order: its pointers, a tail's pointers and the
    counter, its other parameters, a tail's other parameters (the ``tl.constexpr`` meta-parameters
    follow them in the source)."""
    own = own_params(spec)
    if spec.tail is None:
        return own
    tail = [Param(f"t_{p.name}", p.kind, p.index) for p in own_params(spec.tail)]
    ptrs = [p for p in own if p.kind in POINTERS]
    tptrs = [p for p in tail if p.kind in POINTERS]
    rest = [p for p in own if p.kind not in POINTERS]
    trest = [p for p in tail if p.kind not in POINTERS]
    return (*ptrs, *tptrs, Param(COUNT_PTR, ParamKind.COUNTER), *rest, *trest)


def pointer_slots(spec: KernelSpec, slots: Mapping[ParamKind, tuple[int, ...]]) -> tuple[int, ...]:
    """The buffer slot each pointer parameter of ``spec`` (its own, no tail's) is bound to, in order,
    from the slots of its inputs, outputs, partial states and flags by kind."""
    return tuple(slots[p.kind][p.index] for p in own_params(spec) if p.kind in POINTERS)


def with_tail_slots(spec: KernelSpec, head: tuple[int, ...], tail: tuple[int, ...], counter: int) -> tuple[int, ...]:
    """The buffer slots of a head kernel with a tail (``spec.tail``): each pointer parameter's,
    the head's from ``head``, the tail's from ``tail``, the counter's."""
    heads, tails = iter(head), iter(tail)
    pointers = [p for p in kernel_params(spec) if p.kind in POINTERS]
    return tuple(
        counter if p.kind is ParamKind.COUNTER else next(tails) if p.name.startswith("t_") else next(heads)
        for p in pointers
    )


def pointers(call: KernelCall) -> list[tuple[Param, int]]:
    """Each pointer parameter of a launch (a tail's named ``t_...``) with the buffer slot it is bound to."""
    params = [p for p in kernel_params(call.spec) if p.kind in POINTERS]
    assert len(params) == len(call.buffers)
    return list(zip(params, call.buffers))


def slots(call: KernelCall, kind: ParamKind) -> tuple[int, ...]:
    """The buffer slots of a launch's own pointer parameters of ``kind`` (not its tail's)."""
    return tuple(s for p, s in pointers(call) if p.kind is kind and not p.name.startswith("t_"))


def launch_ints(spec: KernelSpec, values: Mapping[str, int]) -> tuple[int, ...]:
    """The launch's integer arguments in parameter order, from their values by name (every one
    given, none left over: a builder and the signature cannot disagree)."""
    names = [p.name for p in own_params(spec) if p.kind is ParamKind.INT]
    missing, extra = set(names) - set(values), set(values) - set(names)
    assert not missing and not extra, f"launch values do not match the parameters: {missing} {extra}"
    return tuple(values[n] for n in names)
