"""The frozen result of lowering: :class:`KernelSpec` (what a kernel's source depends on) and
:class:`Program` (every kernel of a call with its buffers and arguments).

A spec holds structure, dtypes, stride classes and the launch-configuration bucket; sizes,
strides and scalar values are launch arguments. Its repr is the structural signature: one
compile serves every batch size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..registry import Word
from .roles import Role


class Stride(Word):
    """The stride class of a (coalesced) dimension: what its offset needs."""

    BCAST = "0"  # size 1 or stride 0: no offset at all
    UNIT = "1"  # stride 1: the index itself (vectorized loads along it), no argument
    STRIDED = "s"  # any other stride: a launch argument and a multiply


BCAST, UNIT, STRIDED = Stride.BCAST, Stride.UNIT, Stride.STRIDED


class Src(Word):
    """What a node spec's operand reference ``(Src, index)`` points at."""

    NODE = "n"  # another node of the kernel, by its index
    LOAD = "l"  # a load, by its index in ``loads``
    SLOT = "s"  # a scalar slot (a constant or a scalar input), by its index in ``scalars``
    SHAPE = "-"  # an operand read for its shape only (``arange_like``): no value


class Split(Word):
    """How a row kernel's rows are cut across programs (``KernelSpec.split``)."""

    WHOLE = ""  # each program reduces whole rows
    PARTIAL = "partial"  # each program reduces a chunk of a row and stores partial states
    FINISH = "finish"  # merges a row's partial states, then writes its chunk of the outputs
    TILE = "tile"  # pointwise over 2-D tiles: each program one block of columns of its rows
    #: merges the partial states each program of a row kernel stored for its column reductions
    #: (``KernelSpec.columns``), then writes the outputs: one program per block of rows
    MERGE = "merge"


@dataclass(frozen=True)
class LoadSpec:
    input: int
    role: Role
    rows: tuple[Stride, ...]  # stride class per dim the kernel indexes it by (a GEMM tile load: its rows)
    cols: tuple[Stride, ...]  # a GEMM tile load's column dims; () elsewhere


@dataclass(frozen=True)
class NodeSpec:
    op: str
    attrs: tuple
    srcs: tuple[tuple[Src, int], ...]
    dtype: torch.dtype  # result dtype
    cdt: torch.dtype  # operand compute dtype
    role: Role
    ones: tuple[bool, ...] = ()  # row and pointwise kernels: which dims of the value have size 1
    nargs: int = 0  # coordinate kernels: launch arguments of a movement op (offsets, sizes)


@dataclass(frozen=True)
class OutSpec:
    node: int
    dtype: torch.dtype
    role: Role
    rows: tuple[Stride, ...]  # stride class per domain dim (a GEMM's: its rows; () where written at offs)
    cols: tuple[Stride, ...]  # a GEMM tile's columns; () elsewhere


@dataclass(frozen=True)
class Chunk:
    """A group run once per chunk of one dim, in a loop with the other groups of ``loop``: the
    product a backward would recompute many times (linear cross-entropy's logits) computed once,
    one chunk of its last dim at a time (``FusionConfig.chunk_budget``; ``lower/chunk.py``)."""

    loop: int  # the groups of one loop run together, once per chunk, in launch order
    axis: str  # the GEMM dim the chunk windows: "n" (the product's columns), "m" (rows) or "k" (the sum)
    extent: int  # the dim's size
    size: int  # elements per chunk (a multiple of the GPU tile; the last chunk may be shorter)
    values: tuple[Any, ...] = ()  # the values stored one chunk at a time (each chunk at index 0)

    @property
    def chunks(self) -> int:
        return -(-self.extent // self.size)


@dataclass(frozen=True)
class Window:
    """A GEMM kernel's share of a chunk loop: its programs (or, for "k", its K loop) cover
    ``[W_LO, hi)`` of ``axis``, with ``hi`` passed as that dim's extent (``M``, ``N`` or ``K``)."""

    axis: str
    relative: tuple[int, ...] = ()  # inputs stored one chunk at a time: their pointers start at W_LO
    relative_out: tuple[int, ...] = ()  # outputs stored one chunk at a time
    #: "k": the sum goes on across chunks in a buffer of the accumulator's dtype (``acc_ptr``); the
    #: outputs are stored by the last chunk's launch (``W_LAST``)
    accumulate: torch.dtype | None = None


@dataclass(frozen=True)
class GemmTile:
    """A contraction kernel's tile and pipeline, and which inputs are its operands."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int  # row blocks side by side in the program order (they share B's columns in L2)
    num_warps: int
    num_stages: int
    a: int = -1  # input index of the left operand
    b: int = -1  # input index of the right operand
    batch: int = 0  # batch dims (broadcast over the operands)
    sum_batch: bool = False  # the batch dims are contracted too (a weight gradient)
    summed: int = 0  # the last batch dims summed in each program, kept as dims of one (``contract``'s)
    #: stride classes of A's (m, k) and B's (k, n) strides: a unit stride is no argument and no
    #: multiply, so the loads along it vectorize
    a_classes: tuple[Stride, Stride] = (STRIDED, STRIDED)
    b_classes: tuple[Stride, Stride] = (STRIDED, STRIDED)
    precision: str = "ieee"  # fp32 operands: "ieee" (exact products) or "tf32" (FusionConfig.allow_tf32)
    window: Window | None = None  # a kernel of a chunk loop
    #: block sparsity: the condition over whose tiles, where it is false everywhere, the loop
    #: computes nothing (``lower.sparsity``): a node (of positions, ids, masks), or a load (a bool
    #: tensor itself: a padding mask); None: every tile runs
    guard: tuple[Src, int] | None = None
    #: online softmax (``lower.online``): the logsumexp merged in the K loop as it runs and the shift
    #: node the prologue reads (the running max's in the loop); None: none
    online: tuple[int, int] | None = None
    #: the prologues' products computed as one slice of their contracted size: (node, the slice, a
    #: power of two >= 16 covering it); each operand tile the K loop does not move is loaded once
    whole_k: tuple[tuple[int, int], ...] = ()
    #: the extents (``M``, ``N``, ``K``, a recomputed product's ``K<i>``) that are multiples of
    #: their blocks at this call: the bounds checks against them are true everywhere, and the
    #: printed kernel has none (``rewrite.in_bounds``); a size class, as ``KernelSpec.even``
    even: tuple[str, ...] = ()


@dataclass(frozen=True)
class KernelSpec:
    kind: str  # "pointwise" | "row" | "gemm"
    in_dtypes: tuple[torch.dtype, ...]
    loads: tuple[LoadSpec, ...]
    nodes: tuple[NodeSpec, ...]
    outputs: tuple[OutSpec, ...]
    scalars: tuple[str, ...]  # "f32" | "f64" | "i" | "b"
    reductions: tuple[int, ...]  # node indices of reductions (row kernels)
    block: int  # row kernels: the row's power-of-two block bucket (0 for pointwise: a launch parameter)
    rows_per_program: int
    looped: bool
    big: bool  # int64 offsets
    num_warps: int
    #: per dim the kernel indexes (a flat kernel's coalesced ones), is it reduced? None: a GEMM's
    domain: tuple[bool, ...] | None = None
    flags: tuple[int, ...] = ()  # nodes that report an out-of-range index (one flag slot each)
    #: how rows are cut across programs (a split row's two kernels, or 2-D tiles)
    split: Split = Split.WHOLE
    #: a one-program row kernel the last program to finish runs (reading what every program stored)
    tail: KernelSpec | None = None
    #: a contraction kernel's tile (kind "gemm"): its nodes are the contraction and its epilogue
    gemm: GemmTile | None = None
    #: a row kernel's column reductions (role "column"): its programs loop over blocks of rows,
    #: each merging its rows' lanes, and store their partial states for a ``Split.MERGE`` kernel
    columns: tuple[int, ...] = ()
    #: a row kernel whose columns fill its blocks (the row a multiple of ``block``): no column mask,
    #: and a row reduction's lanes need no select (a masked row's values are never stored)
    even: bool = False
    #: what the printed source calls each input, output and scalar input ("" for a constant): the
    #: user's names (``lower.names``; ``codegen.names`` renames the positional ones)
    names: tuple[str, ...] = ()
    out_names: tuple[str, ...] = ()
    scalar_names: tuple[str, ...] = ()
    #: per node, the composite op it came from ("" for the user's own ops): the printed kernel marks
    #: where each composite's lines start (``codegen.source.annotated``). Part of the signature, as
    #: names are: a kernel's printed comments are its own code's, whatever else compiled it first
    notes: tuple[str, ...] = ()


#: a tail's own constexprs, passed to the kernel that runs it as ``T_<name>``
TAIL_CONSTEXPRS = ("ROWS", "BLOCK_SIZE")


def tail_constexprs(tail: KernelSpec) -> tuple[str, ...]:
    """The constexprs a tail kernel takes: a merge's partial lanes too."""
    return (*TAIL_CONSTEXPRS, "SPLIT_BLOCK") if tail.split is Split.MERGE else TAIL_CONSTEXPRS


@dataclass(frozen=True)
class Buffer:
    """A tensor a call allocates: an output, an intermediate another kernel reads, (``zero``) a
    kernel's index-check flags, or (``persistent``) a tail's ticket counter: zeroed once per
    prepared launch, left at zero by the kernel's last program (no per-call fill)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    zero: bool = False
    persistent: bool = False


@dataclass(frozen=True)
class KernelCall:
    """One launch of a :class:`Program`, with everything but the tensors precomputed."""

    spec: KernelSpec
    summary: str  # "Pattern: op, op, ..."
    grid: tuple[int, ...]
    buffers: tuple[int, ...]  # the slot of each pointer parameter, in ``lower.params`` order
    args: tuple[Any, ...]  # sizes, strides, scalar values
    meta: tuple[tuple[str, int], ...]  # constexprs and launch options
    ops: int
    bytes: int  # traffic model: every pass over each input, each output once
    flops: int  # compute model: tensor-core FLOPs of its products (``lower.flops``)
    passes: int  # reads of the most-read input (1: on chip, 2: looped statistics + output)
    empty: bool  # a zero-size domain: nothing to launch
    scalar_inputs: tuple[tuple[int, int, str], ...] = ()  # (position in args, input index, kind)
    checks: tuple[str, ...] = ()  # per flag slot: what an out-of-range index there means (its last buffer)
    group: int = 0  # the fusion group it runs (a split row runs as two kernels)
    reads: tuple[int, ...] = ()  # per input of the group: how many times this launch reads it
    #: the next kernel, run by this launch's last program (``lower.params`` orders its buffers)
    tail: KernelCall | None = None
    chunk: ChunkLoop | None = None  # a kernel of a chunk loop: launched once per chunk


@dataclass(frozen=True)
class ChunkLoop:
    """How the runtime launches a kernel of a chunk loop: once per chunk ``[lo, hi)`` of ``extent``,
    with ``hi`` at argument ``hi_arg`` (the windowed dim's extent), ``lo`` at ``lo_arg`` and, for
    an accumulating kernel, whether the chunk is the last at ``last_arg``."""

    loop: int
    extent: int
    size: int
    hi_arg: int
    lo_arg: int
    last_arg: int = -1

    @property
    def chunks(self) -> int:
        return -(-self.extent // self.size)


@dataclass(frozen=True)
class Program:
    """Everything a call with one input layout runs: buffers to allocate, kernels, results."""

    n_inputs: int
    buffers: tuple[Buffer, ...]  # slot n_inputs + i (index-check flags are int32 buffers zeroed per call)
    kernels: tuple[KernelCall, ...]
    outputs: tuple[tuple[str, int | None], ...]  # output key -> buffer slot (None: a scalar value)
    scalar_outputs: Mapping[str, tuple[Any, torch.dtype]]
    eager_launches: int
    eager_bytes: int
    minimum_bytes: int
    minimum_flops: int = 0  # each contraction of the graph once
    #: integer divisions whose divisors a CPU call checks for zeros first (``lower.schedule.DivisorCheck``)
    divisors: tuple[Any, ...] = ()

    @property
    def launched(self) -> tuple[KernelCall, ...]:
        return tuple(k for k in self.kernels if not k.empty)

    def launch_order(self) -> list[KernelCall]:
        """Each launch as it happens: a chunk loop's kernels once per chunk, in turn."""
        out: list[KernelCall] = []
        calls = list(self.launched)
        while calls:
            loop = calls[0].chunk
            members = [c for c in calls if loop is not None and c.chunk is not None and c.chunk.loop == loop.loop]
            if loop is None:
                out.append(calls.pop(0))
                continue
            out += members * loop.chunks
            calls = calls[len(members) :]
        return out

    @property
    def kernels_launched(self) -> int:
        return sum(k.chunk.chunks if k.chunk else 1 for k in self.launched)

    @property
    def fused(self) -> int:
        return sum(k.chunk.chunks if k.chunk else 1 for k in self.launched if k.ops >= 2)

    @property
    def bytes_moved(self) -> int:
        return sum(k.bytes for k in self.launched)

    @property
    def flops(self) -> int:
        """Tensor-core FLOPs of every launch (a tail computes no product)."""
        return sum(k.flops for k in self.launched)

    @property
    def scratch_bytes(self) -> int:
        """Bytes the call allocates beyond its inputs and its results (intermediates, statistics,
        flags): what running it costs in memory besides what it returns."""
        results = {slot for _, slot in self.outputs if slot is not None}
        return sum(
            math.prod(b.shape) * b.dtype.itemsize
            for i, b in enumerate(self.buffers)
            if self.n_inputs + i not in results
        )


def read_as(attrs: tuple[tuple[str, object], ...]) -> tuple[tuple[str, object], ...]:
    """How a contraction reads its operands (transposed, batch summed): its attributes but its dtype."""
    return tuple(kv for kv in attrs if kv[0] != "dtype")
