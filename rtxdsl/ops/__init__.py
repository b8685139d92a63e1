"""The op registry: every op is declared once, here and in the modules beside this one.

An :class:`OpDef` carries everything rtxdsl knows about an op — its torch reference
(the oracle and the shape/dtype rule, run on meta tensors), its Triton emitter or
reduction spec or decomposition, the dtype categories it accepts, how many kernels
eager torch launches for it, and its derivative slot. Nothing outside this package
switches on op names.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class OpKind(enum.Enum):
    LEAF = "leaf"  # var, const: no computation
    SCALAR = "scalar"  # a per-call scalar derived from shapes (reduced element count)
    ELEMENTWISE = "elementwise"
    REDUCTION = "reduction"
    COMPOSITE = "composite"  # defined by a decomposition into other ops


class DtypeRule(enum.Enum):
    """How an op's operands are typed inside a kernel."""

    PROMOTE = "promote"  # operands cast to the compute dtype of the result
    COMPARE = "compare"  # operands cast to their common compute dtype; result is bool
    WHERE = "where"  # first operand is a bool condition; the rest as PROMOTE
    CAST = "cast"  # the operand keeps its own dtype; the emitter converts


@dataclass(frozen=True)
class EmitCtx:
    """What an emitter may ask about the node it is emitting.

    ``dtype`` is the torch compute dtype of the operands (after the rule's casts),
    ``out`` the node's result dtype, ``attrs`` its attributes, and ``tmp`` binds a
    sub-expression to a fresh local so an emitter can use it twice.
    """

    dtype: torch.dtype
    out: torch.dtype
    attrs: dict[str, Any]
    tmp: Callable[[str], str]

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def is_bool(self) -> bool:
        return self.dtype is torch.bool


@dataclass(frozen=True)
class ReduceSpec:
    """A reduction as identity + running combine + final tile reduction (all source text)."""

    identity: Callable[[torch.dtype], str]
    combine: Callable[[EmitCtx, str, str], str]  # (ctx, acc, value) -> new acc
    final: Callable[[EmitCtx, str], str]  # (ctx, acc tile) -> [ROWS, 1] value


#: categories an op accepts for its tensor operands
FLOAT, INT, BOOL = "float", "int", "bool"
ANY = frozenset({FLOAT, INT, BOOL})
NUMERIC = frozenset({FLOAT, INT})
INTEGRAL = frozenset({INT, BOOL})


@dataclass(frozen=True)
class OpDef:
    name: str
    kind: OpKind
    arity: int
    ref: Callable[..., Any]
    eager_launches: int
    rule: DtypeRule = DtypeRule.PROMOTE
    accepts: frozenset[str] = ANY
    #: categories the op may produce (pow has no integer kernel)
    results: frozenset[str] = ANY
    emit: Callable[..., str] | None = None
    reduce: ReduceSpec | None = None
    decompose: Callable[..., Any] | None = None
    #: derivative rule (filled by the autograd work, issue 6); None means "not yet"
    derivative: Callable[..., Any] | None = None
    #: FusionPattern name a group containing this op is labelled with
    pattern: str | None = None
    #: a view (size-1 dims inserted): no data moves; loads read the operand re-laid-out
    view: bool = False
    #: infix operator for printing, e.g. "+"
    symbol: str | None = None
    doc: str = ""


REGISTRY: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    if op.name in REGISTRY:
        raise RuntimeError(f"op {op.name!r} declared twice")
    REGISTRY[op.name] = op
    return op


def get(name: str) -> OpDef:
    return REGISTRY[name]


def category(dtype: torch.dtype) -> str:
    if dtype is torch.bool:
        return BOOL
    return FLOAT if dtype.is_floating_point else INT


def as_tensors(*vals: Any) -> list[Any]:
    """Python scalars as 0-dim tensors beside the tensors among ``vals`` (same promotion)."""
    like = next((v for v in vals if isinstance(v, torch.Tensor)), None)
    device = like.device if like is not None else "cpu"
    return [v if isinstance(v, torch.Tensor) else torch.tensor(v, device=device) for v in vals]


def apply_ref(op: OpDef, vals: list[Any], attrs: dict[str, Any]) -> Any:
    """Run ``op``'s torch reference; all-scalar operands give a python scalar, as python would."""
    if op.kind is not OpKind.SCALAR and not any(isinstance(v, torch.Tensor) for v in vals):
        out = op.ref(*[torch.tensor(v) for v in vals], **attrs)
        return out.item() if isinstance(out, torch.Tensor) else out
    return op.ref(*vals, **attrs)


def _leaf_ref(*_: Any, **__: Any) -> Any:
    raise AssertionError("leaves are bound, not evaluated")


register(OpDef(name="var", kind=OpKind.LEAF, arity=0, ref=_leaf_ref, eager_launches=0, doc="a named input tensor"))
register(
    OpDef(
        name="const",
        kind=OpKind.LEAF,
        arity=0,
        ref=_leaf_ref,
        eager_launches=0,
        doc="a python scalar, passed as a kernel argument",
    )
)

from . import composite, elementwise, reduction  # noqa: E402,F401,I001  (fill REGISTRY)

# derivative rules are written with the ops above, so they come last
from . import derivatives  # noqa: E402,F401,I001
