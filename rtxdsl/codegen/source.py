"""Triton source for a KernelSpec, written to read like the Triton tutorials: what every
writer shares (``coords.CoordWriter`` renders row and pointwise kernels, ``gemm.GemmWriter``
contractions).

Two families: *pointwise* (a flat block of ``offs``, decomposed into coordinates when an
operand is strided or broadcast) and *row* (a ``[ROWS, BLOCK_SIZE]`` tile of rows by reduced
columns, kept whole in registers or looped over column blocks, one pass per reduction level).
Reductions are states from the op registry: lifted per element, reduced per tile, merged
across loop iterations, read off at the end.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

import torch

from ..dtypes import TRITON_TYPE, compute_dtype
from ..lower.params import (
    COUNT_PTR,
    kernel_params,
    load_names,
    partial_ptr,
    stride_name,
)
from ..lower.passes import early_outputs, is_reshape, levels, partial_states, reduce_dtype, state_twins
from ..lower.roles import Role
from ..lower.sparsity import TEXT, guard_truth
from ..lower.spec import BCAST, UNIT, KernelSpec, NodeSpec, Split, Src, Stride, tail_constexprs
from ..ops import REGISTRY, AxisRule, DtypeRule, EmitCtx, OpKind, ReduceSpec
from ..ops.elementwise import to_storage
from ..ops.movement import positions_compared
from ..ops.reduction import exp_below, exp_of_logsumexp, exp_of_shift, factors, reciprocal_of
from .rewrite import HELPERS, SIGNED_INDEX, simplify
from .template import render

POINTWISE = """\
@triton.jit
def ${name}(
    ${params}
    BLOCK_SIZE: tl.constexpr,
):
    pid = ${program}
    offs = ${pid} * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n_elements
    ${body}
"""

ROW = """\
@triton.jit
def ${name}(
    ${params}
    ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ${constexprs}
):
    pid = ${program}
    ${split}
    ${rows}
    ${body}
"""

#: a row kernel's rows: consecutive blocks of ``ROWS``
ROWS = """\
rows = ${pid} * ROWS + tl.arange(0, ROWS)[:, None]
row_mask = rows < n_rows"""

#: the axes of the row kernel's index tiles ``ROWS`` and ``BATCH_ROWS`` define (its body defines
#: ``cols`` from ``tl.arange``): the rewrites' ``Types.axes``
ROW_AXES = {"rows": frozenset({0}), "rows_m": frozenset({0}), "row_mask": frozenset({0})}

#: a row kernel with column reductions: each program loops over blocks of rows, the grid apart, and
#: its column reductions' lanes run across the loop (``Writer.column_lanes``)
ROW_LOOP = """\
for row_block in range(pid, tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
    ${rows}
    ${body}"""

#: a row kernel's rows kept to one batch (a product whose right operand has batch dims): the
#: program's batch, then a block of the ``${m}`` rows of its last row dim
BATCH_ROWS = """\
m_blocks = tl.cdiv(${m}, ROWS)
batch = ${pid} // m_blocks
rows_m = (${pid} % m_blocks) * ROWS + tl.arange(0, ROWS)[:, None]
rows = batch * ${m} + rows_m
row_mask = rows_m < ${m}"""

#: block sparsity: a loop's tiles where the guard may hold, ``[${lo}, ${hi})`` (a scan of scalars)
TILE_SCAN = """\
${lo} = tl.zeros((), dtype=tl.int32) + ${extent}
${hi} = tl.zeros((), dtype=tl.int32)
for ${start} in range(0, ${extent}, ${block}):
    tile_keep = ${keep}
    ${lo} = tl.minimum(${lo}, tl.where(tile_keep, ${start}, ${extent}))
    ${hi} = tl.maximum(${hi}, tl.where(tile_keep, ${start} + ${block}, 0))
"""

#: beside ``TILE_SCAN``: the tiles where the guard holds everywhere, ``[full_lo, full_hi)`` where
#: they are contiguous (else none), whose loop drops the guard's selects (split from the others:
#: causal attention's tiles below the diagonal, as tutorial 06 runs them)
FULL_INIT = """full_lo = tl.zeros((), dtype=tl.int32) + ${extent}
full_hi = tl.zeros((), dtype=tl.int32)
n_full = tl.zeros((), dtype=tl.int32)
"""
FULL_STEP = """    tile_full = ${full}
    full_lo = tl.minimum(full_lo, tl.where(tile_full, ${start}, ${extent}))
    full_hi = tl.maximum(full_hi, tl.where(tile_full, ${start} + ${block}, 0))
    n_full += tl.where(tile_full, 1, 0)
full_hi = tl.where(n_full * ${block} == full_hi - full_lo, full_hi, full_lo)
"""

#: each dim of a product row kernel's tile (rows kept to one batch), its range over the tile:
#: block sparsity's bounds
ROW_RANGES = {
    "rows": ("(pid % m_blocks) * ROWS", "(pid % m_blocks) * ROWS + ROWS - 1"),
    "cols": ("col_start", "col_start + BLOCK_SIZE - 1"),
}

#: a split row: programs ``split`` of ``n_split`` per row block, each over ``chunk`` reduced elements
SPLIT = """\
row_block = pid // n_split
split = pid % n_split
col_lo = ${split_idx} * chunk
col_hi = tl.minimum(col_lo + chunk, n_cols)
${parts}"""

#: after its stores, each program takes a ticket; the last one runs the tail kernel, which reads
#: what every program stored (release / acquire at GPU scope order those stores before its
#: loads), then leaves the counter at zero for the next launch: a plain store, as every other
#: program has taken its ticket and the next launch on the stream starts after this one ends (an
#: ``atomic_xchg`` passes its unused result through shared memory: two barriers on sm_90)
TAIL = """\
tl.debug_barrier()
ticket = tl.atomic_add(${count}, 1, sem="acq_rel", scope="gpu")
if ticket == tl.num_programs(0) - 1:
    ${tail}(${args})
    tl.store(${count}, 0)"""

MODULE = """\
# Generated by rtxdsl: do not edit. Signature ${signature}
# ${summary}
import triton
import triton.language as tl


${helpers}
${kernel}"""


def offset_terms(prefix: str, classes: Sequence[Stride], index: Sequence[str], first: int = 0) -> list[str]:
    """An operand's offset at ``index`` (an index expression per dim, "0" where the dim is not
    walked), in every writer: a unit-stride dim adds its index, a strided one its index times
    ``<prefix>_stride<d>`` (the parameter :func:`~rtxdsl.lower.params.strided` names, ``d`` counted
    from ``first``), a broadcast one nothing."""
    terms = []
    for d, (c, idx) in enumerate(zip(classes, index)):
        if c == BCAST or idx == "0":
            continue
        ix = f"({idx})" if any(op in idx for op in "+-*/%") else idx  # an expression: keep it whole
        terms.append(ix if c == UNIT else f"{ix} * {stride_name(prefix, first + d)}")
    return terms


def state_name(component: str, node: int) -> str:
    """A reduction state's variable: ``s_3`` never shadows the scalar argument ``s3``."""
    return f"{component}_{node}"


def rounded_values(spec: KernelSpec) -> dict[int, torch.dtype]:
    """Node index -> the half dtype its value is rounded to where it is computed, for the fp16 /
    bf16 values a kernel reads itself. A kernel computes in fp32; two kinds of half values would
    otherwise be seen unrounded by this kernel only:

    * a value the kernel also stores (a residual stored and normed, a product stored for a backward
      and cast): every later kernel reads it back rounded;
    * a product: one plan writes it (rounded by its store), another computes its tiles where they
      are read (a backward recomputing logits). The logsumexp a forward saves must be of the very
      logits the backward recomputes, or their softmax no longer sums to one.

    A value only stored is rounded by its store.
    """
    read = {j for nd in spec.nodes for kind, j in nd.srcs if kind is Src.NODE}
    halves = (torch.float16, torch.bfloat16)
    out = {o.node: o.dtype for o in spec.outputs}
    products = {i: nd.dtype for i, nd in enumerate(spec.nodes) if REGISTRY[nd.op].kind is OpKind.CONTRACTION}
    return {i: dt for i, dt in {**products, **out}.items() if dt in halves and i in read}


#: the note of a run of the user's own ops after a composite's
OWN = "(as written)"


def annotated(lines: Sequence[str], notes: Sequence[str]) -> list[str]:
    """``lines`` (a kernel body, rewritten) with a comment where each run of a composite's nodes
    (``v<i> = ...``, ``notes[i]``) starts, as the Triton tutorials comment their steps: where a
    layer norm's lines start (its statistics' temporaries just before its first node, included),
    and ``# (as written)`` where the user's own ops take over after one.

    Example:
        >>> annotated(["x = tl.load(p)", "t1 = x * x", "v0 = t1 + 1", "v1 = v0 * 2"], ["gelu", ""])
        ['x = tl.load(p)', '# gelu', 't1 = x * x', 'v0 = t1 + 1', '# (as written)', 'v1 = v0 * 2']
    """
    out: list[str] = []
    current = ""
    for line in lines:
        body = line.lstrip()
        head = body.split(" = ", 1)[0] if " = " in body else ""
        if head[:1] == "v" and head[1:].isdigit() and int(head[1:]) < len(notes):
            note = notes[int(head[1:])] or (OWN if current else "")
            if note != current:
                indent = line[: len(line) - len(body)]
                at = len(out)
                while (
                    at
                    and out[at - 1].startswith(f"{indent}t")
                    and out[at - 1][len(indent) + 1 : len(indent) + 2].isdigit()
                ):
                    at -= 1  # the temporaries its first node's emitter made (a reduction's) belong to it
                out.insert(at, f"{indent}# {note}")
            current = note
        out.append(line)
    return out


#: the index tiles the row, pointwise and GEMM templates define: signed integers (int32, or int64
#: where a size passes 2**31)
INDICES = ("pid", "offs", "rows", "cols", "rows_m", "batch", "row_block", "offs_m", "offs_n", "offs_k", "ks", "k_start")


class Scope:
    def __init__(self, indent: str = "") -> None:
        self.lines: list[str] = []
        self.memo: dict[tuple, str] = {}
        self.indent = indent

    def add(self, line: str) -> None:
        self.lines.append(self.indent + line)

    def add_all(self, lines: Sequence[str]) -> None:
        for line in lines:
            self.add(line)


class Writer:
    #: block sparsity: each dim of the guarded loop's tile, its range over the tile (``tile_scan``)
    TILE_RANGES: Mapping[str, tuple[str, str]] = ROW_RANGES

    def __init__(self, spec: KernelSpec) -> None:
        self.spec = spec
        self.row = spec.kind == "row"
        self.types: dict[str, torch.dtype] = {}
        #: Triton dtypes of names no cast in the body states (a load of an int64 input; the templates'
        #: indices, signed integers): the rewrites' types
        self.known: dict[str, str] = dict.fromkeys(INDICES, SIGNED_INDEX)
        self.tmp_ids = itertools.count()
        self.params: list[str] = []
        self.helpers: dict[str, str] = {}  # module-level @triton.jit helpers the emitters asked for
        self.load_names = load_names(spec.loads)
        self.program = "tl.program_id(0)"  # a tail runs as program 0 of its own one-program grid
        self.tail: tuple[str, list[str]] | None = None  # (function, its parameters): run by the last program
        #: half values rounded where computed (see ``rounded_values``)
        self.rounded = rounded_values(spec)
        self.half_copy: dict[str, str] = {}  # a rounded fp32 value's name -> its half value's name
        self.twins = state_twins(spec)  # reductions sharing another's state
        #: a logsumexp computed whole -> its tile x, exp(x - shift), shift and state (``_shared_exp``)
        self.shared_exp: dict[int, tuple[str, str, str, tuple[str, ...]]] = {}
        self.reduced_from: dict[int, bool] = {}  # node index -> computed from a reduction (``_after_reduction``)
        self.scalar_args: set[str] = set()  # the scalar arguments' names (``_scalar_prelude``)

    # ---- what each family's writer says ----------------------------------------------
    def build_params(self) -> None:
        """The signature's parameters (their order is ``lower.params``'), and the dims indexed."""
        raise NotImplementedError

    def _emit_load(self, k: int, scope: Scope) -> str:
        """Load ``k`` where the kernel's values are (a GEMM's tiles)."""
        raise NotImplementedError

    def _store(self, k: int, loop: Scope) -> str:
        """The store of output ``k``."""
        raise NotImplementedError

    # ---- indexing ---------------------------------------------------------------------
    def _decompose(self, scope: Scope, flat: str, prefix: str, size: str, n: int, first: int = 0) -> list[str]:
        """The coordinates of dims ``first .. first + n - 1`` (sizes ``{size}{d}``, the last
        fastest) of the flat index ``flat``, as names ``{prefix}{d}``."""
        if n == 0:
            return []
        if n == 1:
            return [flat]
        names = [f"{prefix}{first + d}" for d in range(n)]
        rem, tmp = flat, f"{prefix}rem{first or ''}"
        for d in range(n - 1, 0, -1):
            scope.add(f"{names[d]} = {rem} % {size}{first + d}")
            scope.add(f"{tmp} = {rem} // {size}{first + d}")
            rem = tmp
        scope.add(f"{names[0]} = {rem}")
        return names

    # ---- values -----------------------------------------------------------------------
    def cast(self, name: str, want: torch.dtype) -> str:
        have = self.types[name]
        if have == want:
            return name
        if want is torch.bool:
            return f"({name} != 0)"
        if name in self.scalar_args:  # a scalar argument equal to 1 is a Python int (a constexpr) on the GPU
            return f"tl.cast({name}, {TRITON_TYPE[want]})"
        return f"{name}.to({TRITON_TYPE[want]})"

    def value(self, ref: tuple, loop: Scope) -> str:
        kind, i = ref
        if kind is Src.SLOT:
            return f"s{i}"
        scope = self._scope_of(self.spec.loads[i].role if kind is Src.LOAD else self.spec.nodes[i].role, loop)
        if ref in scope.memo:
            return scope.memo[ref]
        if kind is Src.LOAD:
            name = self._emit_load(i, scope)
        else:
            node = self.spec.nodes[i]
            if is_reshape(self.spec, i):
                name = self._emit_single(node, f"v{i}", scope, loop)
            elif REGISTRY[node.op].kind is OpKind.REDUCTION:
                if self.spec.looped:
                    raise AssertionError(f"reduction v{i} used before its pass finished")
                name = self._emit_reduction_whole(i, scope)
            else:
                self._reductions_first(node, lambda r: self.value(r, loop))
                name = self._shared_exp(node, f"v{i}", scope, lambda r: self.value(r, loop))
                name = name or self._emit_node(node, f"v{i}", scope, loop)
            if i in self.rounded:
                name = self.round_stored(name, i, scope)
        scope.memo[ref] = name
        return name

    def _reductions_first(self, node: NodeSpec, operand: Callable[[tuple], str]) -> None:
        """Compute ``node``'s operands that come from the row's reductions before the others: the
        tiles those read are reduced before any other tile is made (a tile made first would be held
        across the reduction, and a 32K row has registers for few)."""
        for r in node.srcs:
            if self._after_reduction(r):
                operand(r)

    def _row_constant(self, ref: tuple) -> bool:
        """Is ``ref`` one value per row: a per-row load, a per-row node, or elementwise math on those
        and scalars (a broadcast operand's producer runs at the full shape, role FULL, yet reads
        only per-row values)?"""
        kind, i = ref
        if kind is Src.SLOT:
            return True
        if kind is Src.LOAD:
            return self._per_row_load(i)
        if kind is not Src.NODE:
            return False
        node = self.spec.nodes[i]
        if node.role in (Role.KEEP, Role.DROP):
            return True
        elementwise = REGISTRY[node.op].kind is OpKind.ELEMENTWISE and bool(node.srcs)
        return node.role is Role.FULL and elementwise and all(self._row_constant(r) for r in node.srcs)

    def _per_row_load(self, j: int) -> bool:
        """Is load ``j`` one value per row: broadcast along every reduced dim of the domain (its
        dims aligned with the domain's trailing ones, as broadcasting aligns them)?"""
        ld, domain = self.spec.loads[j], self.spec.domain
        if ld.role is not Role.FULL:
            return True
        if domain is None or not any(domain) or len(ld.rows) > len(domain):
            return False
        return all(c == BCAST for c, reduced in zip(ld.rows, domain[len(domain) - len(ld.rows) :]) if reduced)

    def _after_reduction(self, ref: tuple) -> bool:
        """Is ``ref`` a node computed from a reduction of this kernel?"""
        if ref[0] is not Src.NODE:
            return False
        hit = self.reduced_from.get(ref[1])
        if hit is None:
            node = self.spec.nodes[ref[1]]
            hit = REGISTRY[node.op].kind is OpKind.REDUCTION or any(self._after_reduction(r) for r in node.srcs)
            self.reduced_from[ref[1]] = hit
        return hit

    def _node_at(self, ref: tuple) -> tuple[int, NodeSpec] | None:
        return (ref[1], self.spec.nodes[ref[1]]) if ref[0] is Src.NODE else None

    def _shared_exp(self, node: NodeSpec, name: str, scope: Scope, operand: Callable[[tuple], str]) -> str | None:
        """``exp(x - lse)`` where this kernel reduced ``lse = logsumexp(x)`` whole, over the very
        tile ``x`` (``operand`` reads a source where ``node`` is): the tile's ``exp(x - shift)``
        rescaled per row by ``exp(shift - lse)``, so a softmax computes one exp per element, as the
        tutorial's ``exp(x - max) / sum`` does; times a per-row factor, the two factors multiply
        once per row: one product per element. Softmax's factor, ``1 / total`` with the total read
        off the logsumexp's own state (``softmax_sum``), makes that ``exp(x - max) / sum``
        exactly: ``1 / sum`` per row (NaN where the logsumexp is not finite, as the graph's). Where
        that tile is gone (a looped row's output pass reads ``x`` again), ``exp(x - lse)`` in the
        flush-to-zero form the tile's exp has: its value is at most 1, and what it flushes lies
        under 2**-126. None where the rule does not apply."""
        other = None
        pair = () if self.spec.looped else factors(node)
        for ref, by in zip(pair, pair[::-1]):
            inner = self._node_at(ref)
            if inner is not None and self._row_constant(by) and inner[1].cdt == node.cdt:
                if exp_of_logsumexp(inner[1], self._node_at) is not None:
                    node, other = inner[1], by
                    break
        found = exp_of_logsumexp(node, self._node_at)
        if found is None:
            return self._shifted_exp(node, name, scope, operand) if other is None else None
        x_ref, lse, y_ref = found
        if reduce_dtype(self.spec.nodes[lse]) != node.cdt or self.spec.nodes[node.srcs[0][1]].cdt != node.cdt:
            return None
        operand((Src.NODE, lse))  # the reduction, with its tile's exp
        x = self.cast(operand(x_ref), node.cdt)
        y = self.cast(operand(y_ref), node.cdt)
        if lse not in self.shared_exp or self.shared_exp[lse][0] != x or self.spec.looped:
            if other is not None:
                return None
            scope.add(f"{name} = {exp_below(x, y)}")
        else:
            _, e, shift, state = self.shared_exp[lse]
            factor = f"tl.exp({shift} - {y})"
            if other is not None:
                total = self._node_at(other)
                over = None if total is None else reciprocal_of(total[1])
                if over is not None and over[0] is Src.NODE and self.twins.get(over[1]) == self.twins.get(lse, lse):
                    factor = f"1.0 / {state[1]} + ({y} - {y})"  # exp(x - max) / sum
                else:
                    factor = f"{factor} * {self.cast(operand(other), node.cdt)}"
                factor = self.tmp(self.top, factor)
            scope.add(f"{name} = {e} * {factor}")
        self.types[name] = node.cdt
        return name

    def _shifted_exp(self, node: NodeSpec, name: str, scope: Scope, operand: Callable[[tuple], str]) -> str | None:
        """``exp(x - detach(c))`` in fp32 (``exp_of_shift``: a probability recomputed from a saved
        logsumexp), as ``exp_below`` computes it; None for any other node."""
        found = exp_of_shift(node, self._node_at)
        if found is None or node.cdt != torch.float32:
            return None
        x, y = (self.cast(operand(r), node.cdt) for r in found)
        scope.add(f"{name} = {exp_below(x, y)}")
        self.types[name] = node.cdt
        return name

    def round_stored(self, name: str, i: int, scope: Scope) -> str:
        """Value ``i`` rounded to its half dtype, computed on in fp32 (see ``rounded_values``)."""
        half = self.rounded[i]
        scope.add(f"{name}_h = {to_storage(name, self.types[name], half)}")
        scope.add(f"{name}_r = {name}_h.to(tl.float32)")
        self.types[f"{name}_h"], self.types[f"{name}_r"] = half, torch.float32
        self.half_copy[f"{name}_r"] = f"{name}_h"
        return f"{name}_r"

    def storage(self, v: str, dtype: torch.dtype) -> str:
        """Value ``v`` converted to the storage ``dtype`` (a rounded value's half copy as it is)."""
        half = self.half_copy.get(v)
        if half is not None and self.types[half] == dtype:
            return half
        return to_storage(v, self.types[v], dtype)

    def _scope_of(self, role: str, loop: Scope) -> Scope:
        """Where a value of ``role`` is computed: full-size values in the loop, per-row ones once."""
        return loop if role is Role.FULL else self.top

    def tmp(self, scope: Scope, expr: str) -> str:
        """``expr`` bound to a fresh local in ``scope`` (an emitter reads it twice)."""
        t = f"t{next(self.tmp_ids)}"
        scope.add(f"{t} = {expr}")
        return t

    def _ctx(self, node: NodeSpec, scope: Scope, cdt: torch.dtype) -> EmitCtx:
        return EmitCtx(
            dtype=cdt, out=node.dtype, attrs=dict(node.attrs), tmp=lambda e: self.tmp(scope, e), helper=self.helper
        )

    def helper(self, name: str, source: str) -> str:
        if self.helpers.setdefault(name, source) != source:
            raise AssertionError(f"two different helpers named {name!r}")
        return name

    def _operands(self, node: NodeSpec, names: list[str]) -> list[str]:
        rule = REGISTRY[node.op].rule
        if rule is DtypeRule.CAST:
            return names
        wants = [node.cdt] * len(names)
        if rule is DtypeRule.WHERE:
            wants[0] = torch.bool
        return [self.cast(n, w) for n, w in zip(names, wants)]

    def _emit_node(self, node: NodeSpec, name: str, scope: Scope, loop: Scope) -> str:
        return self._emit_with(node, name, scope, [self.value(r, loop) for r in node.srcs])

    def _emit_with(self, node: NodeSpec, name: str, scope: Scope, operands: list[str]) -> str:
        args = self._operands(node, operands)
        expr = self._positions_compare(node, operands, scope) or REGISTRY[node.op].emit(
            self._ctx(node, scope, node.cdt), *args
        )
        result = self.result_dtype(node)
        if result is not torch.bool and not result.is_floating_point:
            expr = f"({expr}).to({TRITON_TYPE[result]})"
        scope.add(f"{name} = {expr}")
        self.types[name] = result
        return name

    def result_dtype(self, node: NodeSpec) -> torch.dtype:
        """The dtype ``node``'s value has in the kernel: its compute dtype, but positions stay int32
        where the kernel's offsets fit 32 bits (a consumer wanting int64 casts them)."""
        if REGISTRY[node.op].axes is AxisRule.POSITIONS and not self.spec.big:
            return torch.int32
        return compute_dtype(node.dtype)

    def _positions_compare(self, node: NodeSpec, operands: list[str], scope: Scope) -> str | None:
        """``positions == b`` (or ``!=``), ``b`` an integer per row, positions at the kernel's own
        coordinates in int32 (``result_dtype``): they lie in ``[0, 2**31)``, so the comparison runs
        in int32 against ``b`` narrowed once per row (-1, which no position equals, where ``b`` lies
        outside): one 32-bit compare per element (``ops.movement.positions_compared``)."""
        found = positions_compared(node, self._node_at)
        if found is None or node.cdt.is_floating_point or self.types.get(operands[found[0]]) is not torch.int32:
            return None  # (positions against a float compare as floats: 2 != 2.5)
        k, operator = found
        other = node.srcs[1 - k]
        if other[0] is Src.SLOT or not self._row_constant(other):  # (narrowing every element gains nothing)
            return None
        b = self.cast(operands[1 - k], torch.int64)
        narrow = self.tmp(scope, f"tl.where(({b} >= 0) & ({b} <= 2147483647), {b}, -1).to(tl.int32)")
        return f"{operands[k]} {operator} {narrow}"

    # ---- reductions ------------------------------------------------------------------------
    def _reduce_input(self, i: int, scope: Scope, loop: Scope) -> tuple[NodeSpec, torch.dtype, EmitCtx, str]:
        node = self.spec.nodes[i]
        rdt = reduce_dtype(node)
        x = self.cast(self.value(node.srcs[0], loop), rdt)
        return node, rdt, self._ctx(node, scope, rdt), x

    def _lifted(self, ctx: EmitCtx, node: NodeSpec, rdt: torch.dtype, x: str, mask: str = "mask") -> tuple[str, ...]:
        """One element's state per lane, the identity where the lane is masked (``mask`` "": none is)."""
        red = REGISTRY[node.op].reduce
        if not mask:
            return tuple(red.lift(ctx, x))
        states = zip(red.lift(ctx, x), red.identity(rdt))
        return tuple(ctx.tmp(f"tl.where({mask}, {c}, {ident})") for c, ident in states)

    def _lane_mask(self, i: int) -> str:
        """What masks row reduction ``i``'s lanes: the tile's mask; where the row fills its blocks
        (``KernelSpec.even``: ``mask`` is the rows' alone, and a masked row's value is never stored)
        nothing for a value known to fill the tile, and a select that broadcasts any other (one
        value per row, or one a movement op reads at other coordinates: ``sum(expand(g), 0)`` of
        a bias's gradient) to the tile's lanes, so each lane counts."""
        if not self.spec.even:
            return "mask"
        return "" if self._full_tile(self.spec.nodes[i].srcs[0]) else "(row_mask & col_mask)"

    def _full_tile(self, ref: tuple) -> bool:
        """Is ``ref`` emitted at the whole tile's shape: a load that varies along a reduced dim, or
        elementwise math (or a product) of the kernel's domain with such an operand? Conservative:
        movement ops, scalars and per-row values are not."""
        kind, i = ref
        if kind is Src.LOAD:
            return self.spec.loads[i].role is Role.FULL and not self._per_row_load(i)
        if kind is not Src.NODE:
            return False
        node = self.spec.nodes[i]
        if node.role is not Role.FULL or REGISTRY[node.op].kind not in (OpKind.ELEMENTWISE, OpKind.CONTRACTION):
            return False
        return REGISTRY[node.op].kind is OpKind.CONTRACTION or any(self._full_tile(r) for r in node.srcs)

    def _emit_single(self, node: NodeSpec, name: str, scope: Scope, loop: Scope) -> str:
        rdt = reduce_dtype(node)
        x = self.cast(self.value(node.srcs[0], loop), rdt)
        scope.add(f"{name} = {REGISTRY[node.op].reduce.single(self._ctx(node, scope, rdt), x)}")
        self.types[name] = rdt
        return name

    def _tile_state(self, i: int, ctx: EmitCtx, x: str, count: str | None, scope: Scope) -> tuple[str, ...]:
        """Reduction ``i``'s state over one tile of its input ``x``: from the elements where the
        op says how and ``count``, the valid lanes per row, is known; else lifted and reduced.
        Two reductions of one tile with the same state (logsumexp and ``softmax_sum``, which only
        read it off differently) share it: computed once, in named locals."""
        node = self.spec.nodes[i]
        red = REGISTRY[node.op].reduce
        mask = self._lane_mask(i)
        key = ("state", self.twins.get(i, i), count)
        if key in scope.memo:
            state, facts = scope.memo[key]
            if facts is not None:
                self.shared_exp[i] = facts
            return state
        facts = None
        if red.tile_of is not None and count is not None:
            state = red.tile_of(ctx, x, mask, count)
        else:
            state = red.tile(ctx, self._lifted(ctx, node, ctx.dtype, x, mask))
        if i in self.twins.values():  # read by its twins too: each component computed once
            state = tuple(c if c.isidentifier() else ctx.tmp(c) for c in state)
        if "exp" in ctx.facts:
            facts = self.shared_exp[i] = (x, ctx.facts["exp"], ctx.facts["shift"], state)
        scope.memo[key] = (state, facts)
        return state

    def _direct(self, i: int) -> str | None:
        """Reduction ``i`` computed once per row, at the top, without reducing a tile, where the
        writer knows how (a coordinate writer's picked logit); None elsewhere."""
        return None

    def _emit_reduction_whole(self, i: int, scope: Scope) -> str:
        direct = self._direct(i)
        if direct is not None:
            return direct
        node, rdt, ctx, x = self._reduce_input(i, scope, scope)
        red = REGISTRY[node.op].reduce
        state = self._tile_state(i, ctx, x, "n_cols" if self.row and not self.spec.split else None, scope)
        name = f"v{i}"
        scope.add(f"{name} = {red.value(ctx, state)}")
        self.types[name] = rdt
        return name

    def _pass(self, reductions: list[int], stores: Sequence[int] = ()) -> None:
        """One loop over the row's column blocks, advancing every reduction of this level (and
        storing ``stores``, full outputs that need no reduction)."""
        looped = []
        for i in reductions:  # those read directly: once per row, before the loop
            direct = self._direct(i)
            if direct is None:
                looped.append(i)
            else:
                self._row_value(i, direct)
        reductions = looped
        if not reductions and not stores:
            return
        loop = self._open_loop()
        stored = self.stores(stores, loop)
        finals = []
        for i in reductions:
            if i in self.twins:  # read off its twin's state after the loop
                continue
            node = self.spec.nodes[i]
            red = REGISTRY[node.op].reduce
            rdt = reduce_dtype(node)
            tt = TRITON_TYPE[rdt]
            top = self._ctx(node, self.top, rdt)
            shape = "[ROWS, BLOCK_SIZE]" if red.lanes else "[ROWS, 1]"
            running = tuple(state_name(c, i) for c in red.state)
            for name, ident in zip(running, red.identity(rdt)):
                self.top.add(f"{name} = tl.full({shape}, {ident}, dtype={tt})")
            _, _, ctx, x = self._reduce_input(i, loop, loop)
            if red.lanes:
                new = red.merge(ctx, running, self._lifted(ctx, node, rdt, x, self._lane_mask(i)))
            else:
                count = f"tl.minimum({'col_hi' if self.spec.split else 'n_cols'} - col_start, BLOCK_SIZE)"
                new = red.merge(ctx, running, self._tile_state(i, ctx, x, count, loop))
            staged = [ctx.tmp(expr) for expr in new]
            for name, expr in zip(running, staged):
                loop.add(f"{name} = {expr}")
            finals.append((i, red, top, running))
        loop.add_all(stored)
        self._close_loop(loop)
        for i, red, top, running in finals:
            state = red.tile(top, running) if red.lanes else running
            if self.spec.split is Split.PARTIAL:  # this program's share of the row: stored, merged later
                for k, comp in enumerate(state):
                    at = self._partial_at(k, "split", "rows")
                    self.top.add(f"tl.store({partial_ptr(i)} + {at}, {comp}, mask=row_mask)")
                continue
            self._finish_twins(i, red, top, state, reductions)

    def _finish_twins(
        self, i: int, red: ReduceSpec, ctx: EmitCtx, state: tuple[str, ...], among: Sequence[int]
    ) -> None:
        """Reduction ``i``'s value from its merged ``state``, and that of each twin in ``among``."""
        self._finish_reduction(i, red, ctx, state)
        for t in among:
            if self.twins.get(t) == i:
                node = self.spec.nodes[t]
                self._finish_reduction(t, REGISTRY[node.op].reduce, self._ctx(node, self.top, ctx.dtype), state)

    def _finish_reduction(self, i: int, red: ReduceSpec, ctx: EmitCtx, state: tuple[str, ...]) -> None:
        self.top.add(f"v{i} = {red.value(ctx, state)}")
        self.types[f"v{i}"] = reduce_dtype(self.spec.nodes[i])
        self._row_value(i, f"v{i}")

    def _row_value(self, i: int, name: str) -> None:
        """Reduction ``i``'s value, computed as ``name`` at the top: what the rest of the kernel reads."""
        self.top.memo[(Src.NODE, i)] = self.round_stored(name, i, self.top) if i in self.rounded else name

    def _partial_at(self, k: int, part: str, at: str, count: str = "n_rows") -> str:
        """The offset of state component ``k`` of partial ``part`` at ``at`` in a partial buffer:
        per component, a block of ``count`` states per part (a part's states are contiguous, so
        its program stores them side by side)."""
        part = f"{part}.to(tl.int64)" if self.spec.big else part
        return f"{k} * n_part + {part} * {count} + {at}"

    def _merge_partials(self) -> None:
        """A split row's finish (or a merge of a row kernel's column reductions): every program
        merges its rows' partial states (in a fixed order: the result does not depend on which
        program finished first)."""
        if self.spec.split is Split.MERGE:
            self.top.add("n_part = n_rows * n_split")
        self.top.add("parts = tl.arange(0, SPLIT_BLOCK)[None, :]")
        self.top.add("part_mask = row_mask & (parts < n_split)")
        for i, _, rdt in partial_states(self.spec):
            node = self.spec.nodes[i]
            red = REGISTRY[node.op].reduce
            ctx = self._ctx(node, self.top, rdt)
            lanes = []
            for k, (comp, ident) in enumerate(zip(red.state, red.identity(rdt))):
                name = state_name(comp, i)
                at = self._partial_at(k, "parts", "rows")
                self.top.add(f"{name} = tl.load({partial_ptr(i)} + {at}, mask=part_mask, other={ident})")
                lanes.append(name)
            self._finish_twins(i, red, ctx, red.tile(ctx, tuple(lanes)), self.spec.reductions)

    def column_lanes(self) -> None:
        """A row kernel's column reductions (``KernelSpec.columns``): each merges its input's lanes
        over the program's blocks of rows (``ROW_LOOP``), and after the loop their states, reduced
        along the tile's rows, are stored as the program's partial states, column by column, for
        a merge kernel (``Split.MERGE``) to finish."""
        if self.spec.columns:  # (the loop's columns are its own: the stores index them again)
            self.after.add("n_part = tl.num_programs(0) * n_cols")
            self._col_setup(self.after, None, "col_mask")
        for i in self.spec.columns:
            node = self.spec.nodes[i]
            red = REGISTRY[node.op].reduce
            assert red.lanes and red.columns is not None
            rdt = reduce_dtype(node)
            running = tuple(state_name(c, i) for c in red.state)
            for name, ident in zip(running, red.identity(rdt)):
                self.before.add(f"{name} = tl.full([ROWS, BLOCK_SIZE], {ident}, dtype={TRITON_TYPE[rdt]})")
            ctx = self._ctx(node, self.top, rdt)
            x = self.cast(self.value(node.srcs[0], self.top), rdt)
            staged = [ctx.tmp(e) for e in red.merge(ctx, running, self._lifted(ctx, node, rdt, x))]
            for name, e in zip(running, staged):
                self.top.add(f"{name} = {e}")
            after = self._ctx(node, self.after, rdt)
            for k, comp in enumerate(red.columns(after, running)):
                at = self._partial_at(k, "pid", "cols", "n_cols")
                self.after.add(f"tl.store({partial_ptr(i)} + {at}, {comp}, mask=col_mask)")

    # ---- stores -----------------------------------------------------------------------
    @property
    def row_store_mask(self) -> str:
        """Where a per-row value is written: every program of a split row holds it, the first writes it."""
        split = self.spec.split in (Split.PARTIAL, Split.FINISH)
        return "rows < tl.where(split == 0, n_rows, 0)" if split else "row_mask"

    def stores(self, ks: Sequence[int], scope: Scope) -> list[str]:
        """The stores of outputs ``ks`` in ``scope``, every value computed first: the caller adds
        them (:meth:`Scope.add_all`) after all of the scope's loads, so an output written into
        an input's memory (``into``) never lands before a load of that input."""
        return [self._store(k, scope) for k in ks]

    # ---- kernels ----------------------------------------------------------------------
    def _scalar_prelude(self, scope: Scope) -> None:
        """The scalar arguments as the kernel computes with them (once: ``scope`` is outside any loop)."""
        self.scalar_args = {f"s{k}" for k in range(len(self.spec.scalars))}
        for k, kind in enumerate(self.spec.scalars):
            if kind == "f64":  # its bits, as an int64 (tl.cast: an argument equal to 1 is a constexpr)
                scope.add(f"s{k} = tl.cast(tl.cast(s{k}, tl.int64), tl.float64, bitcast=True)")
                self.types[f"s{k}"] = torch.float64
            else:
                self.types[f"s{k}"] = {"f32": torch.float32, "i": torch.int64, "b": torch.bool}[kind]
                if kind == "b":
                    scope.add(f"s{k} = s{k} != 0")

    def _begin(self, flat: str, prefix: str, size: str) -> None:
        """Parameters, the kernel's top scope, scalar arguments and the row (or flat) index."""
        self.build_params()
        self.cidx: list[str] = []  # the column index per reduced dim (a row kernel's, once its loop opens)
        self.scanned = False  # block sparsity: the row's column tiles scanned (``tile_scan``)
        self.top = Scope()
        # a row kernel with column reductions: what runs before its loop over blocks of rows and after
        self.before, self.after = Scope(), Scope()
        self._scalar_prelude(self.before if self.spec.columns else self.top)
        self.ridx = self._decompose(self.top, flat, prefix, size, self.nr)

    def _tail_call(self) -> None:
        """Parameters and closing lines of a kernel whose last program runs ``self.tail``."""
        assert self.tail is not None
        fn, _ = self.tail
        params = kernel_params(self.spec)  # the head's and the tail's, in signature order
        self.params = [p.name for p in params]
        targs = [p.name for p in params if p.name.startswith("t_")]
        assert self.spec.tail is not None
        constexprs = [f"T_{c}" for c in tail_constexprs(self.spec.tail)]
        self.params += [f"{c}: tl.constexpr" for c in constexprs]
        tail = render(TAIL, tail=fn, args=", ".join([*targs, *constexprs]), count=COUNT_PTR)
        self.top.lines.extend(tail.splitlines())

    def _loop_rows(self) -> None:
        """A row kernel with column reductions: its body in a loop over blocks of rows (``ROW_LOOP``),
        between what runs before it and after it (``column_lanes``)."""
        block = "row_block.to(tl.int64)" if self.spec.big else "row_block"
        loop = render(ROW_LOOP, rows=render(ROWS, pid=block).rstrip("\n"), body="\n".join(self.top.lines))
        self.top.lines = [*self.before.lines, *loop.rstrip("\n").splitlines(), *self.after.lines]

    def _render(self, template: str, name: str) -> str:
        if self.spec.columns:
            self._loop_rows()
        if self.tail is not None:
            self._tail_call()
        split_rows = self.spec.split in (Split.PARTIAL, Split.FINISH, Split.TILE)  # (SPLIT's programs)
        pid = "row_block" if split_rows else "pid"
        pid = f"{pid}.to(tl.int64)" if self.spec.big else pid
        extra = {"pid": pid}
        if template is ROW:
            split_idx = "split.to(tl.int64)" if self.spec.big else "split"
            parts = "n_part = n_rows * n_split" if self.spec.split in (Split.PARTIAL, Split.FINISH) else ""
            batched = self.spec.gemm is not None and self.spec.gemm.batch
            rows = render(BATCH_ROWS, pid=pid, m=f"rsize{self.nr - 1}") if batched else render(ROWS, pid=pid)
            extra = {
                "rows": "" if self.spec.columns else rows.rstrip("\n"),  # (``_loop_rows``: in its loop)
                "split": render(SPLIT, split_idx=split_idx, parts=parts).rstrip("\n") if split_rows else "",
                "constexprs": "\n".join(f"{c}: tl.constexpr," for c in self._row_constexprs()),
            }
        return render(
            template,
            name=name,
            params="\n".join(f"{p}," for p in self.params),
            program=self.program,
            body="\n".join(annotated(self._simplified(template), self.spec.notes)),
            **extra,
        )

    def _simplified(self, template: str) -> list[str]:
        """The body rewritten (``rewrite.simplify``), told a row kernel's index tiles (a product's
        row kernel has 3-d tiles: none) and which names are floats or wide integers; the helpers
        the rewritten body calls, added."""
        axes = ROW_AXES if template is ROW and self.spec.gemm is None else None
        ints = (torch.int32, torch.int64)
        wide = frozenset(n for n, dt in self.types.items() if dt.is_floating_point or dt in ints)
        lines = simplify(self.top.lines, self.known, axes=axes, wide=wide)
        for name, source in HELPERS.items():
            if any(name in line for line in lines):
                self.helper(name, source)
        return lines

    def _row_constexprs(self) -> list[str]:
        """A row kernel's constexprs beyond ``ROWS`` and ``BLOCK_SIZE``: a split row's finish lanes,
        a product's K slice."""
        merges = self.spec.split in (Split.FINISH, Split.MERGE)
        return (["SPLIT_BLOCK"] if merges else []) + (["BLOCK_K"] if self.spec.gemm else [])

    def pointwise(self, name: str) -> str:
        self._begin("offs", "i", "size")
        self.top.add_all(self.stores(range(len(self.spec.outputs)), self.top))
        return self._render(POINTWISE, name)

    def _col_setup(self, scope: Scope, start: str | None, upto: str = "mask") -> None:
        """The columns of a tile (from ``start``), their mask and the tile's (``upto="col_mask"``:
        not the rows')."""
        base = "tl.arange(0, BLOCK_SIZE)[None, :]"
        scope.add(f"cols = {start} + {base}" if start else f"cols = {base}")
        if self.spec.big:
            scope.add("cols = cols.to(tl.int64)")
        scope.add(f"col_mask = cols < {'col_hi' if self.spec.split else 'n_cols'}")
        if upto == "col_mask":
            return
        scope.add("mask = row_mask" if self.spec.even else "mask = row_mask & col_mask")  # (even: every column is)
        self.cidx = self._decompose(scope, "cols", "c", "csize", self.nc)

    def row_kernel(self, name: str) -> str:
        self._begin("rows", "r", "rsize")
        outs = list(range(len(self.spec.outputs)))
        full_outs = [k for k in outs if self.spec.outputs[k].role is Role.FULL]
        row_outs = [k for k in outs if self.spec.outputs[k].role is not Role.FULL]
        if self.spec.split is Split.MERGE:  # a row kernel's column reductions, finished
            self._merge_partials()
            self.top.add_all(self.stores(outs, self.top))
        elif not self.spec.looped:
            if self.spec.columns:  # per-column loads come before the loop over rows
                self._col_setup(self.before, None, "col_mask")
            self._col_setup(self.top, None)
            self.top.add_all(self.stores(full_outs + row_outs, self.top))
            self.column_lanes()
        elif self.spec.split is Split.TILE:  # pointwise over a 2-D tile: one block of columns
            self._output_loop(full_outs)
        elif self.spec.split is Split.PARTIAL:
            self._pass(sorted(levels(self.spec)), early_outputs(self.spec))
        else:
            early = early_outputs(self.spec)
            if self.spec.split is Split.FINISH:
                self._merge_partials()
            else:
                lv = levels(self.spec)
                for level in range(1, max(lv.values(), default=0) + 1):
                    self._pass([i for i, v in lv.items() if v == level], early if level == 1 else [])
            self._output_loop([k for k in full_outs if k not in early])
            self.top.add_all(self.stores(row_outs, self.top))
        return self._render(ROW, name)

    def _output_loop(self, outs: list[int]) -> None:
        if outs:
            loop = self._open_loop()
            loop.add_all(self.stores(outs, loop))
            self._close_loop(loop)

    def _open_loop(self) -> Scope:
        loop = Scope(indent="    ")
        self._col_setup(loop, "col_start")
        return loop

    def _close_loop(self, loop: Scope) -> None:
        span = "col_lo, col_hi" if self.spec.split else "0, n_cols"
        # block sparsity: only the column tiles where the guard may hold (scanned before the first pass)
        self.scanned = self.scanned or self.tile_scan(self.top, ("c_lo", "c_hi"), "col_start", "n_cols", "BLOCK_SIZE")
        if self.scanned:
            span = "c_lo, c_hi"
        self.top.add(f"for col_start in range({span}, BLOCK_SIZE):")
        self.top.lines.extend(loop.lines)

    def load_range(self, k: int) -> tuple[str, str] | None:
        """Block sparsity over data: load ``k``'s smallest and largest value over the tile being
        scanned, or None where this writer cannot tell (see ``GemmWriter.load_range``)."""
        return None

    def tile_scan(
        self, scope: Scope, bounds: tuple[str, str], start: str, extent: str, block: str, full: bool = False
    ) -> bool:
        """Block sparsity (``lower.sparsity``): where the kernel has a guard, scan the loop's tiles
        (``start`` over ``extent`` in steps of ``block``) into ``bounds``, the first and past-the-last
        tile where the guard may hold over the tile's ranges (``TILE_RANGES``), and with ``full``
        the tiles where it must (``FULL_INIT``; ``self.full_tiles``). Was a scan added?"""
        g = self.spec.gemm
        self.full_tiles = False
        if g is None or g.guard is None:
            return False
        slots = [f"s{k}" for k in range(len(self.spec.scalars))]
        keep, must = guard_truth(self.spec, TEXT, self.TILE_RANGES, slots, self.load_range)
        if keep == TEXT.TRUE:
            return False
        tiles = {"start": start, "extent": extent, "block": block}
        self.full_tiles = full and must != TEXT.FALSE
        if self.full_tiles:
            scope.add_all(render(FULL_INIT, extent=extent).rstrip("\n").splitlines())
        scope.add_all(render(TILE_SCAN, keep=keep, lo=bounds[0], hi=bounds[1], **tiles).rstrip("\n").splitlines())
        if self.full_tiles:
            scope.add_all(render(FULL_STEP, full=must, **tiles).rstrip("\n").splitlines())
        return True
