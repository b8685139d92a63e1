"""The op table: :class:`OpDef`, the :class:`Registry` and what an emitter sees.

This module is the bottom of the pipeline (expressions, lowering and every front end read
it; it reads nothing of theirs). An op is declared once (``rtxdsl/ops/*.py``) as an
:class:`OpDef`: its torch reference (the oracle and torch's own dtype and argument rules),
its kernel lowering (an emitter, a
reduction state, a movement rule or a decomposition), its derivative, how many kernels
eager torch launches for it, and how users reach it — public function names, ``Expr``
methods and operators, the torch functions the lazy stream records as it, and whether
``rx.parse`` knows it. Every front end reads this table; nothing else switches on op names.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class OpKind(enum.Enum):
    LEAF = "leaf"  # var, const: no computation
    SCALAR = "scalar"  # a per-call scalar derived from shapes (reduced element count)
    ELEMENTWISE = "elementwise"
    REDUCTION = "reduction"
    MOVEMENT = "movement"  # re-indexes its first operand; evaluated inside the consuming kernel
    COMPOSITE = "composite"  # defined by a decomposition into other ops
    CONTRACTION = "contraction"  # a product summed over a shared axis (GEMM): a tiled kernel of its own


class DtypeRule(enum.Enum):
    """How an op's operands are typed inside a kernel."""

    PROMOTE = "promote"  # operands cast to the compute dtype of the result
    COMPARE = "compare"  # operands cast to their common compute dtype; result is bool
    WHERE = "where"  # first operand is a bool condition; the rest as PROMOTE
    CAST = "cast"  # the operand keeps its own dtype; the emitter converts
    KEEP = "keep"  # movement: the data operand keeps its dtype, index operands stay integers


class Word(str, enum.Enum):
    """A word of rtxdsl's internal vocabulary: an enum whose members are their string values
    (equal to them, hashed as them, formatted as them in generated source and reports)."""

    __str__ = str.__str__
    __format__ = str.__format__


class Pattern(Word):
    """The fusion pattern a kernel is named by (``OpDef.pattern`` of its ops), in priority order:
    a group holding several is named by the first."""

    LINEAR_CROSS_ENTROPY = "LinearCrossEntropy"
    ATTENTION = "Attention"
    CONTRACTION = "Contraction"
    CROSS_ENTROPY = "CrossEntropy"
    LAYER_NORM = "LayerNorm"
    RMS_NORM = "RMSNorm"
    ROPE = "RoPE"
    SOFTMAX = "Softmax"
    REDUCTION = "Reduction"
    ACTIVATION = "Activation"
    ELEMENTWISE_CHAIN = "ElementwiseChain"
    SINGLE = "Single"


class AxisRule(enum.Enum):
    """What a movement op does to its operand's axes: how the sharding analysis labels them
    (``lower.shard``) and how a piece of an axis computes it (``lower.pieces``)."""

    OPAQUE = "opaque"  # every axis re-indexed (reshape, permute, a plugin): nothing lines up
    VIEW = "view"  # only size-1 dims inserted (unsqueeze)
    ALONG_AXIS = "along_axis"  # the ``axis`` attribute re-indexed, the others passed through
    GATHER = "gather"  # shaped like the index; read whole along ``axis``
    POSITIONS = "positions"  # positions along ``axis``: a piece's are offset by its start
    RANDOM = "random"  # numbers tied to every position: nothing splits
    SIZES = "sizes"  # sizes baked in (expand): a piece's are its own


class Unsupported(Exception):
    """Raised by a torch-function builder: these arguments have no fused form (run eagerly)."""


@dataclass(frozen=True)
class EmitCtx:
    """What an emitter may ask about the node it is emitting.

    ``dtype`` is the torch compute dtype of the operands (after the rule's casts), ``out``
    the node's result dtype, ``attrs`` its attributes, ``tmp`` binds a sub-expression to a
    fresh local so an emitter can use it twice, and ``helper(name, source)`` adds a
    module-level ``@triton.jit`` function (loops an expression cannot hold) and returns its name.
    """

    dtype: torch.dtype
    out: torch.dtype
    attrs: dict[str, Any]
    tmp: Callable[[str], str]
    helper: Callable[[str, str], str]
    #: sub-results an emitter publishes for the writer's rules (a logsumexp tile's ``exp``, ``shift``)
    facts: dict[str, str] = field(default_factory=dict)

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def is_bool(self) -> bool:
        return self.dtype is torch.bool


@dataclass(frozen=True)
class ReduceSpec:
    """A reduction as a mergeable per-row *state* (source text), so a row can be reduced whole
    in registers, in a loop over blocks, or split across programs and combined later.

    ``lift`` gives one element's state, ``tile`` reduces the states of a ``[ROWS, BLOCK]``
    tile along axis 1 to ``[ROWS, 1]`` states, ``merge`` combines two row states (the
    loop's running state and a block's, or partial results of a split row), and ``value``
    reads the result off a state. Masked lanes hold ``identity``. ``single`` is the reduction
    of one element (a per-row value reduced over its size-1 dims). With ``lanes`` a looped row
    keeps one state per lane and reduces the tile once at the end (cheap merges: sum, max);
    otherwise each block is reduced and merged into one state per row (logsumexp, Welford).
    ``of_values``: the reduction of the values of pieces is the value of the whole (a sum of
    sums, a max of maxima, a logsumexp of logsumexps; not Welford's sum of squared deviations),
    so pieces computed apart (on different devices) merge by the same op.
    """

    state: tuple[str, ...]  # component names, e.g. ("acc",), ("m", "s"), ("n", "mean", "m2")
    identity: Callable[[torch.dtype], tuple[str, ...]]
    lift: Callable[[EmitCtx, str], tuple[str, ...]]
    tile: Callable[[EmitCtx, tuple[str, ...]], tuple[str, ...]]
    merge: Callable[[EmitCtx, tuple[str, ...], tuple[str, ...]], tuple[str, ...]]
    value: Callable[[EmitCtx, tuple[str, ...]], str]
    single: Callable[[EmitCtx, str], str]
    lanes: bool = False
    of_values: bool = True
    #: its derivative compares its operand with its value (amax, amin: the elements equal to it):
    #: a backward recomputes it from the operand it recomputes, never reads the forward's, which
    #: code of another form may have computed from other bits (a softmax's shared exp)
    exact: bool = False
    #: ``tile_of(ctx, x, mask, count)``: a tile's states straight from its elements (``count`` of
    #: them valid per row, an expression; ``mask`` "": every lane is), where that beats lifting each
    #: element and reducing the states (logsumexp: one exp per element; Welford: the mean, then
    #: squared deviations from it)
    tile_of: Callable[[EmitCtx, str, str, str], tuple[str, ...]] | None = None
    #: ``lanes`` states of a ``[ROWS, BLOCK]`` tile reduced along its rows to ``[1, BLOCK]``: a
    #: column reduction a row kernel merges over its rows (``Role.COLUMN``); None: none such
    columns: Callable[[EmitCtx, tuple[str, ...]], tuple[str, ...]] | None = None
    #: the reduce op of DTensor's ``Partial`` placement holding pieces' values not yet merged (a
    #: sum's "sum"), where a sharded output may stay so; None: the pieces are merged in the kernel
    partial: str | None = None
    #: not ``of_values``, but merged from its pieces' values beside a twin's: ``(the twin op over
    #: the same operand and axes, merge(stack, twin's stack, twin's merged value))`` (a softmax's
    #: total beside its logsumexp, ``lower/pieces.py``); None: no such merge
    merged_with: tuple[str, Callable[[Any, Any, Any], Any]] | None = None


@dataclass(frozen=True)
class Coords:
    """Where a movement op's value is read: an index expression per dimension (source text),
    plus the predicates (masks) a load there must also satisfy."""

    idx: tuple[str, ...]
    pred: tuple[str, ...] = ()

    def at(self, axis: int, index: str) -> Coords:
        """These coordinates with ``index`` on ``axis`` (parenthesized: remaps compose as text)."""
        if not index.replace("_", "").isalnum():
            index = f"({index})"
        return Coords(self.idx[:axis] + (index,) + self.idx[axis + 1 :], self.pred)

    def where(self, *pred: str) -> Coords:
        return Coords(self.idx, self.pred + pred)


@dataclass(frozen=True)
class RemapCtx:
    """What a movement op's ``remap`` sees: its output coordinates, its attributes, the names of
    its launch arguments, its operands' ranks, and ways to read operands at other coordinates
    (``value(k, coords)``), bind a temporary (``tmp``) and report an out-of-range index (``flag``)."""

    out: Coords
    attrs: dict[str, Any]
    args: tuple[str, ...]
    src_ranks: tuple[int, ...]
    value: Callable[[int, Coords], str]
    tmp: Callable[[str], str]
    flag: Callable[[str], None]
    zero: str  # a name holding 0 with the shape of the kernel's index tile (for index-only values)


#: categories an op accepts for its tensor operands
FLOAT, INT, BOOL = "float", "int", "bool"
ANY = frozenset({FLOAT, INT, BOOL})
NUMERIC = frozenset({FLOAT, INT})
INTEGRAL = frozenset({INT, BOOL})
FLOATING = frozenset({FLOAT})


def category(dtype: torch.dtype) -> str:
    if dtype is torch.bool:
        return BOOL
    return FLOAT if dtype.is_floating_point else INT


@dataclass(frozen=True)
class Front:
    """How users reach an op: the DSL function and the names, methods, operators and torch
    functions that lead to it. An op with no ``fn`` is internal (built by other ops only)."""

    fn: Callable[..., Any] | None = None
    #: public names (``rx.<name>``, ``rx.parse``); empty: the op's own name when ``fn`` is set
    names: tuple[str, ...] = ()
    #: ``Expr`` method name -> adapter ``(self, *args, **kwargs)``, or None to call ``fn(self, ...)``
    methods: dict[str, Callable[..., Any] | None] = field(default_factory=dict)
    #: Python operator dunders on ``Expr``; ``__rX__`` calls ``fn(other, self)``
    operators: tuple[str, ...] = ()
    #: torch callables (functions, Tensor methods, F.*) -> builder taking torch's arguments,
    #: with tensors already turned into expressions; a builder raises Unsupported to decline
    torch: dict[Any, Callable[..., Any]] = field(default_factory=dict)
    #: in-place torch methods (``Tensor.add_``) whose out-of-place value this op computes
    inplace: tuple[Any, ...] = ()
    parse: bool = True
    #: CPU eager casts a Python number operand to the dtype of the op's float16 / bfloat16 tensor
    #: operands before the op (TensorIterator's wrapped scalars: ``x - s`` is exactly 0 where ``x``
    #: holds ``s`` rounded, ``x == s`` is True there), where CUDA computes with it in float32: the
    #: lazy stream rounds such a number on CPU tensors too (``lazy.scalars_as_cpu_eager``)
    cpu_rounds_numbers: bool = False


@dataclass(frozen=True)
class OpDef:
    name: str
    kind: OpKind
    #: operand count; None: any number (``cat``)
    arity: int | None
    ref: Callable[..., Any]
    eager_launches: int
    rule: DtypeRule = DtypeRule.PROMOTE
    accepts: frozenset[str] = ANY
    #: categories the op may produce (pow has no integer-to-float rule of its own)
    results: frozenset[str] = ANY
    emit: Callable[..., str] | None = None
    reduce: ReduceSpec | None = None
    decompose: Callable[..., Any] | None = None
    #: the decomposition also takes ``shapes=`` and ``dtypes=`` of its operands (rank- or
    #: dtype-dependent lowering: cross_entropy's class axis and target kind)
    typed_decompose: bool = False
    #: result shape from operand shapes and attributes; None: broadcasting
    shape: Callable[..., tuple[int, ...]] | None = None
    #: attributes in canonical form, from operand shapes (normalized axes): (shapes, **attrs) -> attrs
    canonical: Callable[..., dict[str, Any]] | None = None
    #: movement ops: the value at ``ctx.out`` from operands read at other coordinates (source text)
    remap: Callable[[RemapCtx], str] | None = None
    #: movement ops: attributes whose values are launch arguments, not part of the signature
    launch_attrs: tuple[str, ...] = ()
    #: movement ops (and a contraction inside a row kernel: its contracted size): int launch
    #: arguments from (operand shapes, output shape, **attrs)
    launch_args: Callable[..., tuple[int, ...]] | None = None
    #: movement ops that only insert size-1 dims: flat kernels address them in place
    view: bool = False
    #: movement ops that keep the elements in order and only regroup the dims (``reshape``): of
    #: contiguous memory, a view; of a product, the product of its left operand regrouped
    regroups: bool = False
    #: operand positions read for their shape only (``arange_like``): never loaded
    shape_only: tuple[int, ...] = ()
    #: composites whose backward reads their own output back, as eager's saves it (attention:
    #: SDPA's ``rowsum(dO * O)``), where recomputing the value before its rounding would need a
    #: saved product of its own
    reads_output: bool = False
    #: movement ops: what they do to their operand's axes (sharding, pieces)
    axes: AxisRule = AxisRule.OPAQUE
    #: result dtype from operand dtypes and attributes, where probing torch cannot tell (an op
    #: whose reference reads index values); None: torch's answer on one-element probes
    result_dtype: Callable[..., torch.dtype] | None = None
    #: movement ops reading at loaded positions (``gather``): the operand holding the indices,
    #: checked against bounds in the kernel
    index_operand: int | None = None
    #: integer division (``//``, ``%``): the operand whose zero makes torch raise ZeroDivisionError
    #: on CPU, checked on the host before a CPU launch (``lower.schedule.DivisorCheck``)
    divisor_operand: int | None = None
    #: derivative rule (see ops/helpers.D); None: not differentiable yet
    derivative: Callable[..., Any] | None = None
    #: eager torch's (launches, bytes) where they are not ``eager_launches`` kernels that read each
    #: operand once and write the result once (a composite whose eager form writes an intermediate,
    #: linear cross-entropy's logits): ``(operand bytes, result bytes, shapes, dtypes, **attrs)``
    eager: Callable[..., tuple[int, int]] | None = None
    #: composites whose decomposition range-checks an index it builds (cross-entropy's target): the
    #: error an out-of-range value raises, from (the inputs the index reads, the valid size)
    range_error: Callable[[str, int], str] | None = None
    #: ALU ops per element a kernel spends on it: what recomputing it costs in the traffic model
    #: (1: plain arithmetic; 4: transcendental math, a special-function unit at a quarter of the
    #: FMA rate or a short instruction sequence)
    cost: int = 1
    #: the fusion pattern a group containing this op is labelled with
    pattern: Pattern | None = None
    #: infix operator for printing (``+``) and its precedence
    symbol: str | None = None
    precedence: int = 10
    front: Front = field(default_factory=Front)

    @property
    def public(self) -> tuple[str, ...]:
        if self.front.names:
            return self.front.names
        return (self.name,) if self.front.fn is not None else ()


class Registry:
    """Every op by name, plus the indices the front ends read (kept in step by :meth:`register`)."""

    def __init__(self) -> None:
        self.ops: dict[str, OpDef] = {}
        self.functions: dict[str, Callable[..., Any]] = {}  # public name -> DSL function
        self.named: dict[str, OpDef] = {}  # public name -> op
        self.methods: dict[str, tuple[OpDef, Callable[..., Any] | None]] = {}
        self.operators: dict[str, OpDef] = {}
        self.torch: dict[Any, tuple[OpDef, Callable[..., Any]]] = {}
        self.inplace: dict[Any, OpDef] = {}

    def register(self, op: OpDef) -> OpDef:
        if op.name in self.ops:
            raise RuntimeError(f"op {op.name!r} declared twice")
        fr = op.front
        for table, keys in (
            (self.functions, op.public),
            (self.methods, fr.methods),
            (self.operators, fr.operators),
            (self.torch, fr.torch),
            (self.inplace, fr.inplace),
        ):
            clash = [k for k in keys if k in table]
            if clash:
                raise RuntimeError(f"op {op.name!r}: {clash[0]!r} already belongs to another op")
        self.ops[op.name] = op
        for name in op.public:
            assert fr.fn is not None, f"op {op.name!r} has public names but no function"
            self.functions[name] = fr.fn
            self.named[name] = op
        for m, adapter in fr.methods.items():
            self.methods[m] = (op, adapter)
        for d in fr.operators:
            self.operators[d] = op
        for t, builder in fr.torch.items():
            self.torch[t] = (op, builder)
        for t in fr.inplace:
            self.inplace[t] = op
        return op

    def unregister(self, name: str) -> None:
        """Remove an op and every index entry it owns (tests declaring temporary ops)."""
        op = self.ops.pop(name)
        for table in (self.named, self.methods, self.operators, self.torch, self.inplace):
            for k in [k for k, v in table.items() if v is op or (isinstance(v, tuple) and v[0] is op)]:
                del table[k]
        for k in op.public:
            self.functions.pop(k, None)

    def __getitem__(self, name: str) -> OpDef:
        return self.ops[name]

    def __contains__(self, name: object) -> bool:
        return name in self.ops

    def get(self, name: str) -> OpDef | None:
        return self.ops.get(name)

    def values(self) -> list[OpDef]:
        return list(self.ops.values())


REGISTRY = Registry()
register = REGISTRY.register


def as_tensors(*vals: Any) -> list[Any]:
    """Python scalars as 0-dim tensors beside the tensors among ``vals``, promoting as torch
    promotes a python scalar: when every tensor is 0-dim, a 0-dim tensor would take part in
    promotion, so the scalar takes the tensors' dtype unless its category is higher."""
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    device = tensors[0].device if tensors else "cpu"
    dtype = None
    if tensors and all(t.dim() == 0 for t in tensors):
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)

    def wrap(v: Any) -> torch.Tensor:
        kind = torch.bool if isinstance(v, bool) else torch.int64 if isinstance(v, int) else torch.get_default_dtype()
        if dtype is not None and _rank(kind) <= _rank(dtype):
            return torch.tensor(v, dtype=dtype, device=device)
        return torch.tensor(v, device=device)

    return [v if isinstance(v, torch.Tensor) else wrap(v) for v in vals]


def _rank(dtype: torch.dtype) -> int:
    """bool < integer < floating (torch's promotion categories)."""
    return 0 if dtype == torch.bool else 2 if dtype.is_floating_point or dtype.is_complex else 1


def apply_ref(op: OpDef, vals: list[Any], attrs: dict[str, Any]) -> Any:
    """Run ``op``'s torch reference; all-scalar operands give a python scalar, as python would."""
    if op.kind is not OpKind.SCALAR and not any(isinstance(v, torch.Tensor) for v in vals):
        out = op.ref(*[torch.tensor(v) for v in vals], **attrs)
        return out.item() if isinstance(out, torch.Tensor) else out
    return op.ref(*vals, **attrs)
