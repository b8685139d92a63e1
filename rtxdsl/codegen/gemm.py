"""Triton source for a contraction kernel: Triton tutorial 03's tiled GEMM with the group's epilogue.

The K loop reads A and B tiles through their strides into an fp32 accumulator (``tl.dot``); the
epilogue is the :class:`~rtxdsl.codegen.source.Writer`'s own code for pointwise nodes, at the
tile's ``rows`` x ``cols`` coordinates, with ``acc`` as the contraction's value.
"""

from __future__ import annotations

import functools
import re

import torch

from ..dtypes import TRITON_TYPE, accumulator, compute_dtype
from ..lower.online import EXPS, SHIFTS, SUMS
from ..lower.params import (
    ACC_PTR,
    batch_stride_name,
    dim_stride_name,
    input_ptr,
    output_name,
    output_ptr,
    own_params,
    prologue_cost,
    shared_operands,
    stride_name,
    transposed_operands,
)
from ..lower.passes import reduce_dtype
from ..lower.roles import Role
from ..lower.schedule import CHEAP_SCORE_COST
from ..lower.sparsity import batch_dim
from ..lower.spec import BCAST, STRIDED, UNIT, KernelSpec, NodeSpec, Src
from ..ops import REGISTRY, Coords, DtypeRule, EmitCtx, OpKind, ReduceSpec, RemapCtx
from ..ops.elementwise import to_storage
from ..ops.reduction import exp_below
from .dot import k_loop, load_as, one_slice
from .rewrite import assigned_names, renamed, simplify
from .source import Scope, Writer, annotated, offset_terms, state_name
from .template import render

GEMM = """\
@triton.jit
def ${name}(
    ${params}
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    # grouped order: GROUP_M row blocks side by side reuse the same columns of B from L2
    num_pid_m = tl.cdiv(${m_span}, BLOCK_M)
    num_pid_n = tl.cdiv(${n_span}, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    offs_m = ${m_start}pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = ${n_start}pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    ${body}
"""

#: one batch's K loop: A [BLOCK_M, BLOCK_K] and B [BLOCK_K, BLOCK_N] tiles, masked at the edges
#: (an operand with a prologue is computed from its own loads instead, zero outside the mask)
K_LOOP = """\
for k_start in range(${k_start}, ${k_end}, BLOCK_K):
    ks = k_start + offs_k
    a_mask = (offs_m[:, None] < M) & (ks[None, :] < K)
    b_mask = (ks[:, None] < K) & (offs_n[None, :] < N)
"""

#: each dim of a GEMM's A tile, its range over the tile (block sparsity's bounds)
GEMM_RANGES = {"m": ("pid_m * BLOCK_M", "pid_m * BLOCK_M + BLOCK_M - 1"), "k": ("k_start", "k_start + BLOCK_K - 1")}

#: an accumulating chunk loop's kernel: its running sum (contiguous, the product's shape) at the tile
ACC_OFFSET = "(batch * M + offs_m[:, None]) * N + offs_n[None, :]"
#: (a scalar condition as a bound: the interpreter takes no scalar in a mask)
ACC_MASK = "(offs_m[:, None] < tl.where(W_LO > 0, M, 0)) & (offs_n[None, :] < N)"

#: the index vectors along an operand tile's rows and columns, with the extents that mask them
TILE_VECTORS = {"a": (("offs_m", "M"), ("ks", "K")), "b": (("ks", "K"), ("offs_n", "N"))}
#: the output tile's: where an epilogue computes a second product (a chunk loop's)
OUTPUT_VECTORS = (("offs_m", "M"), ("offs_n", "N"))

#: where each operand's tile lies: its (row, column) index vectors as a tile's, dims and mask
OPERAND_TILE = {
    op: ((f"{rows}[:, None]", f"{cols}[None, :]"), dims, f"{op}_mask")
    for (op, ((rows, _), (cols, _))), dims in zip(TILE_VECTORS.items(), ("mk", "kn"))
}


def _positions_op(node: NodeSpec) -> bool:
    """An index-only movement op (positions along a dim): computed from the tile's coordinates."""
    op = REGISTRY[node.op]
    return op.kind is OpKind.MOVEMENT and not op.view


def _matrix_offset(op: str, idx: tuple[str, str], dims: str, classes: tuple[str, str]) -> str:
    """An operand tile's offset: a unit stride is the index itself (vectorized loads along it)."""
    return " + ".join(i if c == UNIT else f"{i} * {dim_stride_name(op, d)}" for i, d, c in zip(idx, dims, classes))


class GemmWriter(Writer):
    """Parameters: the inputs' and outputs' pointers, ``M, N, K``, the batch sizes, A's and B's
    strides (batch dims, then ``m, k`` / ``k, n``), each epilogue load's and output's strides over
    the product's dims, the scalars (the order :func:`rtxdsl.lower.gemm.gemm_spec` passes them)."""

    @property
    def TILE_RANGES(self) -> dict[str, tuple[str, str]]:  # noqa: N802 (the Writer's name)
        """GEMM_RANGES and each batch dim's position, the program's own (``sparsity.tile_dim``)."""
        batch = getattr(self, "batch_idx", [])
        return GEMM_RANGES | {batch_dim(d, len(batch)): (ix, ix) for d, ix in enumerate(batch)}

    def __init__(self, spec: KernelSpec) -> None:
        super().__init__(spec)
        #: reductions of A merged in the K loop: (node, its reduction, context, running state)
        self.k_reductions: list[tuple[int, ReduceSpec, EmitCtx, tuple[str, ...]]] = []
        self.store_mask = "mask"  # an accumulating chunk loop's kernel stores its outputs in the last chunk
        #: the tile a product recomputed whole loads as the K loop moves (its right operand), by node
        self.moving: dict[int, str] = {}
        self.transposed = transposed_operands(spec)  # products whose right tile is one of those, transposed

    def build_params(self) -> None:
        g = self.spec.gemm
        assert g is not None
        self.nb = g.batch
        self.out_dims = (0 if g.sum_batch else g.batch) + 2
        self.params += [p.name for p in own_params(self.spec)]

    def gemm(self, name: str) -> str:
        g = self.spec.gemm
        assert g is not None
        self.build_params()
        self.top = Scope()
        self.top.add("batch = tl.program_id(1)")  # (dropped where nothing reads it)
        self._scalar_prelude(self.top)
        top = self.top
        if self.spec.big:
            top.add_all(["offs_m = offs_m.to(tl.int64)", "offs_n = offs_n.to(tl.int64)"])
        contraction = next(
            i
            for i, nd in enumerate(self.spec.nodes)
            if REGISTRY[nd.op].kind is OpKind.CONTRACTION and nd.role is Role.FULL
        )
        self.own = contraction
        attrs = dict(self.spec.nodes[contraction].attrs)
        # is the operand read transposed? (an epilogue's product is at the output tile as it is)
        self.swapped = {"a": attrs["ta"], "b": attrs["tb"], Role.FULL: False}
        operand_dtype = self.spec.nodes[contraction].cdt
        acc_dtype = accumulator(operand_dtype)
        window = g.window
        self._relative(top)
        if window is not None and window.accumulate is not None:  # the sum so far: every chunk's before this one
            top.add(f"acc = tl.load({ACC_PTR} + {ACC_OFFSET}, mask={ACC_MASK}, other=0.0)")
        else:
            top.add(f"acc = tl.zeros((BLOCK_M, BLOCK_N), dtype={TRITON_TYPE[acc_dtype]})")
        kept = self.nb - g.summed  # the output's batch dims (a summed product's last are summed in the loop)
        batches = Scope(indent="    ") if (g.sum_batch or g.summed) and self.nb else top  # into one accumulator
        if g.summed:  # the program's batch of the output, then each summed batch in the loop
            assert window is None, "a chunk loop's product sums no batch dims"
            outer = self._decompose(top, "batch", "b", "bsize", kept)
            self.batch_idx = outer + self._decompose(batches, "inner", "b", "bsize", g.summed, kept)
        else:
            self.batch_idx = self._decompose(batches, "batch", "b", "bsize", self.nb)  # the batch's coordinates
        k_scope = Scope(indent=batches.indent + "    ")
        self.hoist = batches  # what the K loop reads unchanged: before it
        srcs = self.spec.nodes[contraction].srcs
        tiles = [self._operand(op, j, ref, operand_dtype, k_scope) for op, j, ref in zip("ab", (g.a, g.b), srcs)]
        precision = f', input_precision="{g.precision}"' if operand_dtype == torch.float32 else ""
        k_scope.add(f"acc = tl.dot({tiles[0]}, {tiles[1]}, acc{precision})")
        siblings = self._siblings(tiles, k_scope, precision)
        self._k_loop(batches, k_scope, "W_LO" if window is not None and window.axis == "k" else "0")
        if batches is not top:
            loop, dims = ("inner", range(kept, self.nb)) if g.summed else ("batch", range(self.nb))
            top.add(f"for {loop} in range(0, {' * '.join(f'bsize{d}' for d in dims)}):")
            top.lines.extend(batches.lines)
        if g.online is not None:
            self._online_finish(top)
        for i, red, ctx, running in self.k_reductions:
            self._finish_reduction(i, red, ctx, running)
        self.out_idx = [] if g.sum_batch else self.batch_idx[:kept] + ["0"] * g.summed
        top.add_all(["rows = offs_m[:, None]", "cols = offs_n[None, :]", "mask = (rows < M) & (cols < N)"])
        for i, acc in {contraction: "acc", **siblings}.items():
            self.types[acc] = acc_dtype
            top.memo[(Src.NODE, i)] = self.round_stored(acc, i, top) if i in self.rounded else acc
        if window is not None and window.accumulate is not None:  # carried to the next chunk; stored by the last
            carried = "(rows < tl.where(W_LAST == 0, M, 0)) & (cols < N)"
            top.add(f"tl.store({ACC_PTR} + (batch * M + rows) * N + cols, acc, mask={carried})")
            self.store_mask = "(rows < tl.where(W_LAST != 0, M, 0)) & (cols < N)"
        top.add_all(self.stores(range(len(self.spec.outputs)), top))
        params = "\n".join(f"{p}," for p in self.params)
        spans = {
            d: (f"({e} - W_LO)", "W_LO + ") if window is not None and window.axis == d else (e, "")
            for d, e in (("m", "M"), ("n", "N"))
        }
        return render(
            GEMM,
            name=name,
            params=params,
            body="\n".join(annotated(self._rewritten(), self.spec.notes)),
            m_span=spans["m"][0],
            n_span=spans["n"][0],
            m_start=spans["m"][1],
            n_start=spans["n"][1],
        )

    def _rewritten(self) -> list[str]:
        """The body through the rewrite rules (a split K loop's second loop's own names end in
        ``_f``: the types and bounds checks the writer knows of its index vectors hold for theirs)."""
        known = self.known | {f"{name}_f": t for name, t in self.known.items()}
        bounds = self._in_bounds()
        return simplify(self.top.lines, known, bounds | {(f"{v}_f", e) for v, e in bounds})

    def _k_loop(self, batches: Scope, k_scope: Scope, k_start: str) -> None:
        """The K loop from ``k_start`` with ``k_scope``'s body: over the slices where the guard may
        hold (``tile_scan``), split where it holds over whole slices (``_split_loop``)."""
        g = self.spec.gemm
        assert g is not None
        k_end, guard = "K", None
        if g.guard is not None and g.guard[0] is Src.NODE and self._roomy():
            guard = k_scope.memo.get(g.guard)
        if self.tile_scan(batches, ("k_lo", "k_hi"), "k_start", "K", "BLOCK_K", full=guard is not None):
            k_start, k_end = "k_lo", "k_hi"  # only the K slices where the guard may hold
        if self.full_tiles and guard is not None:  # those where it must hold: a loop of their own
            self._split_loop(batches, k_scope, guard)
        else:
            batches.add_all(render(K_LOOP, k_start=k_start, k_end=k_end).rstrip("\n").splitlines())
            batches.lines.extend(k_scope.lines)

    def _roomy(self) -> bool:
        """Registers to spare for a split K loop (``_split_loop``): its loop without the guard's
        selects took up to 20 registers a thread more on sm_90 than the loop with them. On 4 warps
        a kernel without online softmax splits where it has one accumulator (dQ's: 135 and 187
        registers at head dims 64 and 128) or its prologues' math per score costs at most
        ``schedule.CHEAP_SCORE_COST`` (causal dK + dV at head dim 64: 197 registers, a sliding
        window's 223); split, a softcap's dK + dV (cost 39) spilled 4 bytes and grouped-query attention's
        forward at head dim 64 16, and the causal forward took 253 registers of 255. 8-warp kernels
        kept under 254."""
        g = self.spec.gemm
        assert g is not None
        if self.spec.num_warps >= 8:
            return True
        cheap = prologue_cost(self.spec.nodes) <= CHEAP_SCORE_COST
        return g.online is None and (not shared_operands(self.spec) or cheap)

    def _split_loop(self, batches: Scope, k_scope: Scope, guard: str) -> None:
        """The K loop as two (``tile_scan``'s ``full_lo``, ``full_hi``), as tutorial 06 runs causal
        attention: the tiles where the guard may fail (``k_start`` stepping over the full ones), then
        those where it holds everywhere, with ``guard`` true (``x | True``: Triton folds the
        compare and every select by it away). The second loop's own names end in ``_f`` (the
        rewrites take a name assigned once for one value); both carry the running state, assigned
        before them."""
        before = assigned_names(self.top.lines) | (assigned_names(batches.lines) if batches is not self.top else set())
        header = render(K_LOOP, k_start="k_lo", k_end="k_hi - (full_hi - full_lo)").rstrip("\n").splitlines()
        batches.add(header[0].replace("for k_start in", "for kp in"))
        batches.add("    k_start = kp + tl.where(kp >= full_lo, full_hi - full_lo, 0)  # (over the full tiles)")
        batches.add_all(header[1:])
        batches.lines.extend(k_scope.lines)
        full = render(K_LOOP, k_start="full_lo", k_end="full_hi").rstrip("\n").splitlines()
        batches.add(full[0])
        holds = re.compile(rf"^(\s*){guard} = (.*)$")
        body = [batches.indent + line for line in full[1:]]
        body += [holds.sub(rf"\g<1>{guard} = (\g<2>) | True", line) for line in k_scope.lines]
        batches.lines.extend(renamed(body, before, "_f"))

    def _in_bounds(self) -> frozenset[tuple[str, str]]:
        """The bounds checks true everywhere (``GemmTile.even``): ``(index, extent)``, each index
        vector the template or a recomputed product's K loop compares against that extent."""
        g = self.spec.gemm
        assert g is not None
        vectors = {e: (v,) for v, e in (*TILE_VECTORS["a"], *TILE_VECTORS["b"])}  # M, K, N
        out = set()
        for extent in g.even:
            for v in vectors.get(extent, ("kk", f"kk{extent[1:]}")):  # K<i>: a K loop's, or its one slice
                out.add((v, extent))
        return frozenset(out)

    def _siblings(self, tiles: list[str], scope: Scope, precision: str) -> dict[int, str]:
        """Each product sharing an operand with the kernel's own, summed in its K loop: its accumulator."""
        return {i: self._sibling(i, side, tiles, scope, precision) for i, side in shared_operands(self.spec).items()}

    def _sibling(self, i: int, side: int, tiles: list[str], scope: Scope, precision: str) -> str:
        """Product ``i``, sharing operand ``side`` with the kernel's own (``shared_operands``; none
        shared: both its operands): its other operand's tile loaded or computed beside the shared
        one, summed into an accumulator of its own in the same K loop (a gate and an up projection:
        the input's tile read once for both; dV's P beside dK's dS, the scores computed once)."""
        pair = list(tiles)
        for s in (s for s in (0, 1) if s != side):
            pair[s] = self._sibling_tile(i, s, scope)  # (b{d}: batch indices)
        acc = f"acc{i}"
        node = self.spec.nodes[i]
        self.top.add(f"{acc} = tl.zeros((BLOCK_M, BLOCK_N), dtype={TRITON_TYPE[accumulator(node.cdt)]})")
        scope.add(f"{acc} = tl.dot({pair[0]}, {pair[1]}, {acc}{precision})")
        return acc

    def _sibling_tile(self, i: int, side: int, scope: Scope) -> str:
        """Product ``i``'s operand ``side`` at the K loop's tile: its prologue's values (each node
        computed once in the loop, as the kernel's own operand's), or loaded through its strides."""
        node = self.spec.nodes[i]
        attrs = dict(node.attrs)
        kind, k = ref = node.srcs[side]
        op = "ab"[side]
        if kind is Src.NODE:  # its prologue, at the same tile as the kernel's own operand's
            v = self.value(ref, scope)
            v = to_storage(v, self.types[v], node.cdt)
            scope.add(f"{op}_tile{i} = {v if self._zero_outside(ref) else f'tl.where({op}_mask, {v}, 0)'}")
            return f"{op}_tile{i}"
        if op == "b":  # the product's right operand: a (k, n) tile
            dims, at = (("n", "k") if attrs["tb"] else ("k", "n")), {"k": "ks[:, None]", "n": "offs_n[None, :]"}
        else:  # its left operand: an (m, k) tile
            dims, at = (("k", "m") if attrs["ta"] else ("m", "k")), {"m": "offs_m[:, None]", "k": "ks[None, :]"}
        j = self.spec.loads[k].input
        tile = f"tl.load({input_ptr(j)} + {self._stored_offset(k, dims, at)}, mask={op}_mask, other=0)"
        shared = self._transposed(i) if op == "b" else None
        scope.add(f"{op}_tile{i} = {shared or load_as(tile, self.spec.in_dtypes[j], node.cdt)}")
        return f"{op}_tile{i}"

    def _transposed(self, c: int) -> str | None:
        """Product ``c``'s right tile as the transposed tile a recomputed product loaded in this
        iteration (``params.transposed_operands``), or None: load it."""
        i = self.transposed.get(c)
        return f"tl.trans({self.moving[i]})" if i in self.moving else None

    def _relative(self, top: Scope) -> None:
        """A chunk loop's buffers hold one chunk, its element 0 at ``W_LO`` of the windowed dim
        (their last, unit-stride dim): their pointers start ``W_LO`` elements early."""
        g = self.spec.gemm
        assert g is not None
        if g.window is None:
            return
        for j in g.window.relative:
            top.add(f"{input_ptr(j)} = {input_ptr(j)} - W_LO")
        for k in g.window.relative_out:
            top.add(f"{output_ptr(k)} = {output_ptr(k)} - W_LO")

    def _operand(self, op: str, j: int, ref: tuple, dtype: torch.dtype, scope: Scope) -> str:
        """Operand ``op``'s tile in the K loop: loaded through its strides, or its prologue computed
        from loads at the tile (cast to the operand's dtype, as the unfused kernel would store it;
        zero outside the mask, where the prologue of zeros need not be zero)."""
        (r, c), dims, mask = OPERAND_TILE[op]
        g = self.spec.gemm
        assert g is not None
        if op == "a" and g.online is not None:
            self._online_step(scope)
        if j >= 0:
            base = "".join(f"{i} * {batch_stride_name(op, d)} + " for d, i in enumerate(self.batch_idx))
            offset = base + _matrix_offset(op, (r, c), dims, g.a_classes if op == "a" else g.b_classes)
            tile = load_as(f"tl.load({input_ptr(j)} + {offset}, mask={mask}, other=0)", self.spec.in_dtypes[j], dtype)
            shared = self._transposed(self.own) if op == "b" else None
            scope.add(f"{op} = {shared or tile}")
            if self.spec.in_dtypes[j] == dtype:  # a reduction of the operand itself reads the tile
                for k, ld in enumerate(self.spec.loads):
                    if ld.input == j and ld.role == op:
                        scope.memo[(Src.LOAD, k)] = op
                self.types[op] = dtype
        else:
            value = self.value(ref, scope)
            v = to_storage(value, self.types[value], dtype)
            scope.add(f"{op} = {v if self._zero_outside(ref) else f'tl.where({mask}, {v}, 0)'}")
        online = g.online[0] if g.online is not None else -1
        for i, node in enumerate(self.spec.nodes):  # reductions of the operand's (prologue's) values over K
            if REGISTRY[node.op].kind is OpKind.REDUCTION and node.role == op and i != online:
                outside = node.op in SUMS and self._zero_outside(node.srcs[0])  # (a sum needs no mask then)
                self._k_reduction(i, self.value(node.srcs[0], scope), "" if outside else mask, scope)
        if op == "a" and g.online is not None:
            self._online_sum(scope)
        return op

    # ---- online softmax (``lower.online``): the logsumexp merged as the K loop runs ---------------
    def _online_names(self) -> tuple[str, str, str, str]:
        """The running max, the shift it gives, the running sum of ``exp(x - shift)`` (the row sum
        of A's own K reduction where it sums that very value), and the logsumexp's node."""
        g = self.spec.gemm
        assert g is not None and g.online is not None
        r, _ = g.online
        return state_name("m", r), f"shift_{r}", self._online_total() or state_name("s", r), f"v{r}"

    @functools.cached_property
    def _online_exp(self) -> int:
        """The node ``exp(x - shift)``: what the K loop sums, in proportion."""
        g = self.spec.gemm
        assert g is not None and g.online is not None
        r, shift = g.online
        x = self.spec.nodes[r].srcs[0]
        subs = {i for i, nd in enumerate(self.spec.nodes) if nd.op in SHIFTS and nd.srcs == (x, (Src.NODE, shift))}
        return next(i for i, nd in enumerate(self.spec.nodes) if nd.op in EXPS and nd.srcs[0][1] in subs)

    def _online_total(self) -> str | None:
        """The state of a K reduction summing ``exp(x - shift)`` itself (attention's row sum): the
        logsumexp's sum, computed once."""
        g = self.spec.gemm
        assert g is not None and g.online is not None
        e, rdt = self._online_exp, reduce_dtype(self.spec.nodes[g.online[0]])
        for i, nd in enumerate(self.spec.nodes):
            if nd.op in SUMS and nd.role == "a" and nd.srcs == ((Src.NODE, e),) and reduce_dtype(nd) == rdt:
                (state,) = REGISTRY[nd.op].reduce.state
                return state_name(state, i)
        return None

    def _rescaled(self) -> list[str]:
        """What the K loop sums in proportion to ``exp(x - shift)``: the accumulator and the
        states of A's K reductions reading it (``lower.online`` allows only sums there)."""
        g = self.spec.gemm
        assert g is not None and g.online is not None
        r, shift = g.online
        states = ["acc"]
        for i, nd in enumerate(self.spec.nodes):
            red = REGISTRY[nd.op]
            if red.kind is OpKind.REDUCTION and nd.role == "a" and i != r and self._reads_node(nd.srcs[0], shift):
                states += [state_name(c, i) for c in red.reduce.state]
        own = self._online_names()[2]
        return states if own in states else [*states, own]

    def _reads_node(self, ref: tuple, target: int) -> bool:
        if ref[0] is not Src.NODE:
            return False
        return ref[1] == target or any(self._reads_node(s, target) for s in self.spec.nodes[ref[1]].srcs)

    def _online_step(self, scope: Scope) -> None:
        """Before the prologue reads the shift: the running max over this K slice, the shift it
        gives (0 while the row holds no finite score), and what the loop has summed so far
        rescaled to it."""
        g = self.spec.gemm
        assert g is not None and g.online is not None
        r, shift = g.online
        rdt = reduce_dtype(self.spec.nodes[r])
        m, c, total, _ = self._online_names()
        ty = TRITON_TYPE[rdt]
        self.top.add(f"{m} = tl.full([BLOCK_M, 1], float('-inf'), dtype={ty})  # online softmax: the running max")
        self.top.add(f"{c} = tl.zeros([BLOCK_M, 1], dtype={ty})  # the shift the loop's sums are taken at")
        if total == state_name("s", r):
            self.top.add(f"{total} = tl.zeros([BLOCK_M, 1], dtype={ty})  # the sum of exp(x - shift)")
        x_ref = self.spec.nodes[r].srcs[0]
        x = self.cast(self.value(x_ref, scope), rdt)
        # the scores masked once: -inf outside the tile's rows and columns, so exp(x - shift) is 0 there
        scope.add(f"scores_{r} = tl.where(a_mask, {x}, float('-inf'))")
        scope.memo[x_ref] = f"scores_{r}"
        self.types[f"scores_{r}"] = rdt
        # rescaled from the previous running max, not the previous shift: -inf while nothing was
        # summed, so a first finite max under -88 rescales the zero sums by exp(-inf) = 0, never by
        # exp(0 - max) = inf (0 * inf: NaN rows under HF's finfo.min padding, ALiBi on long rows)
        scope.add(f"previous = {m}")
        scope.add(f"{m} = tl.maximum({m}, tl.max(scores_{r}, axis=1)[:, None])")
        scope.add(f"{c} = tl.where({m} > float('-inf'), {m}, 0.0)")
        scope.add(f"rescale = tl.exp(previous - {c})")
        scope.add_all([f"{v} = {v} * rescale" for v in self._rescaled()])
        scope.memo[(Src.NODE, shift)] = c
        self.types[c] = rdt

    def _zero_outside(self, ref: tuple) -> bool:
        """Is ``ref`` 0 outside the A tile's mask already: the online softmax's ``exp(x - shift)``
        (its scores masked to -inf there) or a cast of it?"""
        g = self.spec.gemm
        if g is None or g.online is None or ref[0] is not Src.NODE:
            return False
        node = self.spec.nodes[ref[1]]
        return ref[1] == self._online_exp or (
            REGISTRY[node.op].rule is DtypeRule.CAST and self._zero_outside(node.srcs[0])
        )

    def _online_exp_value(self, scope: Scope) -> str:
        """``exp(x - shift)`` in base 2 (``exp_below``: at most 1, as the shift is the running max;
        what it flushes lies under 2**-126 of the row's largest term). The difference first, not
        tutorial 06's one FMA ``x * log2(e) - shift * log2(e)``: scores at a padding mask's
        ``finfo.min`` overflow that product to -inf, and a row of them gave -inf - -inf = NaN."""
        g = self.spec.gemm
        assert g is not None and g.online is not None
        r, shift = g.online
        e = self._online_exp
        if (Src.NODE, e) not in scope.memo:
            x, c = self.value(self.spec.nodes[r].srcs[0], scope), self.value((Src.NODE, shift), scope)
            scope.add(f"v{e} = {exp_below(x, c)}")
            scope.memo[(Src.NODE, e)] = f"v{e}"
            self.types[f"v{e}"] = reduce_dtype(self.spec.nodes[r])
        return scope.memo[(Src.NODE, e)]

    def _online_sum(self, scope: Scope) -> None:
        """The logsumexp's sum over this K slice, where no K reduction of A sums the same values."""
        g = self.spec.gemm
        assert g is not None and g.online is not None
        _, _, total, _ = self._online_names()
        if total == state_name("s", g.online[0]):
            e = self.value((Src.NODE, self._online_exp), scope)
            scope.add(f"{total} = {total} + tl.sum({e}, axis=1)[:, None]")

    def _online_finish(self, top: Scope) -> None:
        """After the loop: the logsumexp, the graph's own shift from it, and the sums rescaled from
        the running shift to that one: the epilogue reads the two-pass values."""
        g = self.spec.gemm
        assert g is not None and g.online is not None
        r, shift = g.online
        _, c, total, name = self._online_names()
        top.add(f"{name} = {c} + tl.log({total})")
        self.types[name] = reduce_dtype(self.spec.nodes[r])
        self._row_value(r, name)
        want = self.value((Src.NODE, shift), top)
        # (exactly the graph's shift, rounding and all: the backward recomputes its probabilities
        # from it, so the row sum saved beside them must be taken at it too)
        top.add(f"rescale = tl.exp({c} - {want})")
        top.add_all([f"{v} = {v} * rescale" for v in self._rescaled()])

    def _shared_exp(self, node: NodeSpec, name: str, scope: Scope, operand) -> str | None:  # type: ignore[no-untyped-def]
        """None under an online softmax: its exp is the prologue's own, at the running shift."""
        g = self.spec.gemm
        if g is not None and g.online is not None:
            return None
        return super()._shared_exp(node, name, scope, operand)

    # ---- a prologue's own values at the operand's tile ------------------------------------------
    def value(self, ref: tuple, loop: Scope) -> str:
        """As the Writer's, plus what only a prologue holds: a product recomputed at the operand's
        tile, and positions (indices along a dim) there."""
        kind, i = ref
        node = self.spec.nodes[i] if kind is Src.NODE else None
        g = self.spec.gemm
        if (
            g is not None
            and g.online is not None
            and node is not None
            and node.role is Role.A
            and i == self._online_exp
        ):
            return self._online_exp_value(loop)
        if node is not None and node.role is Role.FULL and _positions_op(node) and ref not in loop.memo:
            loop.memo[ref] = self._positions(i, loop)  # the epilogue's positions: at the product's tile
        epilogue_product = node is not None and node.role is Role.FULL and REGISTRY[node.op].kind is OpKind.CONTRACTION
        if epilogue_product and i != self.own and ref not in self.top.memo:  # a second product at the output tile
            name = self._inner_product(i, self.top)
            self.top.memo[ref] = self.round_stored(name, i, self.top) if i in self.rounded else name
        if node is None or node.role not in OPERAND_TILE:
            return super().value(ref, loop)
        op = REGISTRY[node.op]
        if op.kind is not OpKind.CONTRACTION and (op.kind is not OpKind.MOVEMENT or op.view):
            return super().value(ref, loop)
        if ref not in loop.memo:
            name = self._inner_product(i, loop) if op.kind is OpKind.CONTRACTION else self._positions(i, loop)
            loop.memo[ref] = self.round_stored(name, i, loop) if i in self.rounded else name
        return loop.memo[ref]

    def _tile_index(self, role: str, rank: int) -> list[str]:
        """The index (source text) of each dim of a value of ``rank`` dims at operand ``role``'s tile:
        its batch dims at the batch's coordinates, its matrix dims along the tile's rows and columns
        (swapped when the kernel reads the operand transposed)."""
        if role is Role.FULL:  # the epilogue's: the product's tile
            (r, c), matrix, idx = ("rows", "cols"), ["rows", "cols"], list(self.out_idx)
        else:
            (r, c), _, _ = OPERAND_TILE[role]
            matrix, idx = ([c, r] if self.swapped[role] else [r, c]), list(self.batch_idx)
        batch = ["0"] * max(0, rank - 2 - len(idx)) + idx[max(0, len(idx) - (rank - 2)) :]
        return (batch + matrix)[-rank:] if rank else []

    def _positions(self, i: int, scope: Scope) -> str:
        """An index-only movement op (positions along a dim) at the operand's tile, by its own remap."""
        node = self.spec.nodes[i]
        idx = [("0" if one else ix) for ix, one in zip(self._tile_index(node.role, len(node.ones)), node.ones)]

        def unread(*_: object) -> str:
            raise AssertionError(f"{node.op} reads no operand")

        if node.role is Role.FULL:  # the epilogue's: broadcast against the product's tile where used
            zero = "tl.zeros((1, 1), dtype=tl.int32)"
        else:
            (r, c), _, _ = OPERAND_TILE[node.role]
            zero = f"({r} * 0 + {c} * 0)"  # the tile's shape, even where every index is 0
        ctx = RemapCtx(Coords(tuple(idx)), dict(node.attrs), (), (), unread, unread, unread, zero)  # type: ignore[arg-type]
        name = f"v{i}"
        # the epilogue's positions are int32 where offsets fit (a per-row compare then narrows its
        # other side once per row, ``Writer._positions_compare``)
        dtype = self.result_dtype(node) if node.role is Role.FULL else compute_dtype(node.dtype)
        scope.add(f"{name} = ({REGISTRY[node.op].remap(ctx)}).to({TRITON_TYPE[dtype]})")  # type: ignore[misc]
        self.types[name] = dtype
        return name

    def _row_constant(self, ref: tuple) -> bool:
        """As the Writer's, and a view of per-row values: an epilogue reads a view through its
        load's strides at the tile, so the view is its load there."""
        kind, i = ref
        if kind is Src.NODE and self.spec.nodes[i].role is Role.FULL and REGISTRY[self.spec.nodes[i].op].view:
            return all(self._row_constant(r) for r in self.spec.nodes[i].srcs)
        return super()._row_constant(ref)

    def _per_row_load(self, j: int) -> bool:
        """An epilogue load broadcast along the product's columns is one value per row."""
        ld = self.spec.loads[j]
        return ld.role is not Role.FULL or all(c == BCAST for c in ld.cols)

    def _inner_product(self, i: int, scope: Scope) -> str:
        """A product no kernel writes, at the operand's ``[rows, cols]`` tile (or the output tile,
        an epilogue's): a K loop of its own over ``BLOCK_K`` slices. Element ``(m, n)`` of the
        product sits at the tile's ``(m, n)``, or at ``(n, m)`` when the kernel reads the operand
        transposed: then the product's right operand gives the tile's rows and its left one the
        columns."""
        node = self.spec.nodes[i]
        attrs = dict(node.attrs)
        role = node.role
        (rv, r_size), (cv, c_size) = TILE_VECTORS[role] if role in TILE_VECTORS else OUTPUT_VECTORS
        (_, la), (_, lb) = node.srcs
        size = f"K{i}"
        g = self.spec.gemm
        assert g is not None
        block = dict(g.whole_k).get(i)
        kk = "kk" if block is None else f"kk{i}"  # one slice: its own index vector, set before the loop
        # each operand's stored (-2, -1) dims, named: the product's rows "m", columns "n", the sum "k"
        a_dims = ("k", "m") if attrs["ta"] else ("m", "k")
        b_dims = ("n", "k") if attrs["tb"] else ("k", "n")
        if not self.swapped[role]:  # rows are the product's m, columns its n
            left, right = (
                (la, a_dims, {"m": f"{rv}[:, None]", "k": f"{kk}[None, :]"}),
                (lb, b_dims, {"k": f"{kk}[:, None]", "n": f"{cv}[None, :]"}),
            )
        else:  # rows are the product's n, columns its m
            left, right = (
                (lb, b_dims, {"n": f"{rv}[:, None]", "k": f"{kk}[None, :]"}),
                (la, a_dims, {"m": f"{cv}[None, :]", "k": f"{kk}[:, None]"}),
            )
        shape = {"a": "(BLOCK_M, BLOCK_K)", "b": "(BLOCK_K, BLOCK_N)", Role.FULL: "(BLOCK_M, BLOCK_N)"}[role]
        masks = (
            f"({rv}[:, None] < {r_size}) & ({kk}[None, :] < {size})",
            f"({kk}[:, None] < {size}) & ({cv}[None, :] < {c_size})",
        )
        loads = [
            (f"{input_ptr(self.spec.loads[k].input)} + {self._stored_offset(k, dims, at)}", mask)
            for (k, dims, at), mask in zip((left, right), masks)
        ]
        acc = f"p{i}"
        stored = tuple(self.spec.in_dtypes[self.spec.loads[k].input] for k, _, _ in (left, right))
        if block is not None:  # the K loop moves the operand along its rows (A's) or columns (B's) only
            before, at = one_slice(acc, node.cdt, kk, block, loads, g.precision, stored, 0 if role == "a" else 1)
            self.hoist.add_all(before)
            scope.add_all(at)
            if role == "a":
                self.moving[i] = f"rhs_{acc}"  # (one_slice's name for the tile it loads per iteration)
        else:
            scope.add_all(k_loop(acc, shape, node.cdt, size, "kk", loads[0], loads[1], g.precision, stored))
        self.types[acc] = accumulator(node.cdt)
        return acc

    def _stored_offset(self, k: int, dims: tuple[str, str], at: dict[str, str]) -> str:
        """A recomputed product's operand ``k`` at index vectors ``at`` of its named stored dims."""
        ld, name = self.spec.loads[k], self.load_names[k]
        terms = [f"{b} * {batch_stride_name(name, d)}" for d, b in enumerate(self.batch_idx)]
        matrix = offset_terms(name, (*ld.rows, *ld.cols), [at[dim] for dim in dims], len(self.batch_idx))
        return " + ".join(terms + matrix)

    def _k_reduction(self, i: int, v: str, mask: str, scope: Scope) -> None:
        """Reduction ``i`` of A over its contracted dims: each K tile's states merged into one
        running state per row of the tile (initialized before the loops, finished after them)."""
        node = self.spec.nodes[i]
        red = REGISTRY[node.op].reduce
        rdt = reduce_dtype(node)
        running = tuple(state_name(c, i) for c in red.state)
        for name, ident in zip(running, red.identity(rdt)):
            self.top.add(f"{name} = tl.full([BLOCK_M, 1], {ident}, dtype={TRITON_TYPE[rdt]})")
        ctx = self._ctx(node, scope, rdt)
        lifted = self._lifted(ctx, node, rdt, self.cast(v, rdt), mask)
        staged = [ctx.tmp(expr) for expr in red.merge(ctx, running, red.tile(ctx, lifted))]
        scope.add_all([f"{name} = {expr}" for name, expr in zip(running, staged)])
        self.k_reductions.append((i, red, self._ctx(node, self.top, rdt), running))

    def _scope_of(self, role: str, loop: Scope) -> Scope:
        """Every value at a tile: the epilogue's at the product's, a prologue's in the K loop."""
        return self.top if role is Role.SCALAR else loop

    def _tile_offset(
        self, prefix: str, classes: tuple[str, ...], batch: list[str], index: tuple[str, str] = ("rows", "cols")
    ) -> str:
        """A tensor's offset at a tile: its strides over ``batch``'s coordinates, then the tile's
        two ``index`` vectors (the product's rows and columns, or an operand's)."""
        terms = [f"{b} * {stride_name(prefix, d)}" for d, b in enumerate(batch)]
        tile = offset_terms(prefix, classes, index, len(batch))
        # a block pointer even where the tensor is one element (per batch) broadcast over the tile
        return " + ".join(terms + (tile or [f"({index[0]} * 0 + {index[1]} * 0)"]))

    def _emit_load(self, k: int, scope: Scope) -> str:
        ld = self.spec.loads[k]
        dtype = self.spec.in_dtypes[ld.input]
        classes = (*ld.rows, *ld.cols)
        if ld.role in OPERAND_TILE:  # a prologue's load, at the operand's tile in the K loop
            index, _, mask = OPERAND_TILE[ld.role]
            offset = self._tile_offset(self.load_names[k], classes, self.batch_idx, index)
            # a value per row (column) of the tile is one column (row), masked along its own dim:
            # under the tile's mask it became a whole tile (attention's lse and row term per query:
            # a load, a compare and a select per score where one per query does); what the prologue
            # computes outside the tile the operand and the K loop's reductions mask
            (rv, rs), (cv, cs) = TILE_VECTORS[ld.role]
            mask = {(False, True): f"{rv}[:, None] < {rs}", (True, False): f"{cv}[None, :] < {cs}"}.get(
                (ld.rows == (BCAST,), ld.cols == (BCAST,)), mask
            )
        else:  # at the product's tile: a value per row (or per column) loads one column (row) of it
            offset = self._tile_offset(self.load_names[k], classes, self.out_idx)
            mask = {(False, True): "rows < M", (True, False): "cols < N"}.get(
                (ld.rows == (BCAST,), ld.cols == (BCAST,)), "mask"
            )
        if ld.role is Role.FULL and not self.out_idx and all(c == BCAST for c in classes):  # one element: a scalar
            text = f"tl.load({input_ptr(ld.input)})"
        else:
            text = f"tl.load({input_ptr(ld.input)} + {offset}, mask={mask}, other=0)"
        cdt = compute_dtype(dtype)
        if cdt != dtype:
            text += f".to({TRITON_TYPE[cdt]})"
        name = f"x{k}"
        scope.add(f"{name} = {text}")
        self.types[name] = cdt
        return name

    def load_range(self, k: int) -> tuple[str, str] | None:
        """Block sparsity over data (``lower.sparsity``): an A prologue's integer or bool load over
        the tile the scan is at (the program's rows, the K slice at ``k_start``), its smallest and
        largest value there: a load each (one value per row or per K index: a vector; a mask over
        both: the tile), the lanes past the edge filled so that they move neither (a tile wholly
        past it decides nothing)."""
        ld = self.spec.loads[k]
        dtype = self.spec.in_dtypes[ld.input]
        if ld.role != Role.A or len(ld.rows) != 1 or len(ld.cols) != 1 or dtype.is_floating_point:
            return None
        m, ks = "offs_m", "(k_start + offs_k)"
        index, mask, axes = {  # (rows, K) broadcast -> where the load lies, its mask, its dims
            (False, True): ((m, "0"), f"{m} < M", 1),
            (True, False): (("0", ks), f"{ks} < K", 1),
            (False, False): ((f"{m}[:, None]", f"{ks}[None, :]"), f"({m}[:, None] < M) & ({ks}[None, :] < K)", 2),
        }.get((ld.rows[0] == BCAST, ld.cols[0] == BCAST), (None, "", 0))
        if index is None:
            return None
        offset = self._tile_offset(self.load_names[k], (*ld.rows, *ld.cols), self.batch_idx, index)
        at = f"{input_ptr(ld.input)} + {offset}"
        info = torch.iinfo(torch.int32 if dtype == torch.bool else dtype)
        value = ".to(tl.int32)" if dtype == torch.bool else ""
        fill = {"min": 1 if dtype == torch.bool else info.max, "max": 0 if dtype == torch.bool else info.min}

        def reduced(how: str) -> str:
            text = f"tl.load({at}, mask={mask}, other={fill[how]}){value}"
            for axis in range(axes - 1, -1, -1):
                text = f"tl.{how}({text}, axis={axis})"
            return text

        return reduced("min"), reduced("max")

    def _store(self, k: int, loop: Scope) -> str:
        o = self.spec.outputs[k]
        v = self.value((Src.NODE, o.node), loop)
        val = self.storage(v, o.dtype)
        if o.role is not Role.FULL:  # a reduction of A, one value per row: the first column of tiles writes it
            rows = "batch * M + rows" if self.out_idx else "rows"  # each batch's rows (a contiguous buffer)
            return f"tl.store({output_ptr(k)} + {rows}, {val}, mask=rows < tl.where(pid_n == 0, M, 0))"
        offset = self._tile_offset(output_name(k), (STRIDED, UNIT), self.out_idx)
        return f"tl.store({output_ptr(k)} + {offset}, {val}, mask={self.store_mask})"
