"""Reduction primitives (sum, amax, amin) and the reduced-element count.

mean, variance, std and logsumexp are composites built on these (see composite.py).
Accumulation runs in fp32 for half types (the compute dtype); NaN wins in amax/amin.
"""

from __future__ import annotations

import math

import torch

from ..dtypes import highest, lowest
from . import ANY, FLOAT, NUMERIC, EmitCtx, OpDef, OpKind, ReduceSpec, register
from .elementwise import nan_max, nan_min


def _axes(axis, ndim: int) -> tuple[int, ...]:
    """Normalized, sorted reduction axes; ``None`` means all."""
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(sorted({a % ndim if ndim else 0 for a in axes}))


def _torch_dims(axis):
    return () if axis is None else axis


def _sum_final(ctx: EmitCtx, acc: str) -> str:
    return f"tl.sum({acc}, axis=1)[:, None]"


def _extreme_final(which: str):
    def final(ctx: EmitCtx, acc: str) -> str:
        red = f"tl.{which}({acc}, axis=1)[:, None]"
        if not ctx.is_float:
            return red
        # tl.max/tl.min may drop NaN; the running combine kept it, so look for it
        has_nan = f"tl.max(({acc} != {acc}).to(tl.int32), axis=1)[:, None] > 0"
        return f"tl.where({has_nan}, float('nan'), {red})"

    return final


def _reduction(name: str, ref, spec: ReduceSpec, accepts=ANY) -> OpDef:
    return register(
        OpDef(
            name=name,
            kind=OpKind.REDUCTION,
            arity=1,
            ref=ref,
            reduce=spec,
            eager_launches=1,
            accepts=accepts,
            pattern="Reduction",
        )
    )


_reduction(
    "sum",
    lambda x, axis, keepdim: torch.sum(x, dim=_torch_dims(axis), keepdim=keepdim),
    ReduceSpec(identity=lambda dt: "0", combine=lambda c, acc, v: f"{acc} + {v}", final=_sum_final),
)
_reduction(
    "amax",
    lambda x, axis, keepdim: torch.amax(x, dim=_torch_dims(axis), keepdim=keepdim),
    ReduceSpec(
        identity=lowest,
        combine=lambda c, acc, v: nan_max(v, acc) if c.is_float else f"tl.maximum({acc}, {v})",
        final=_extreme_final("max"),
    ),
    accepts=NUMERIC | {"bool"},
)
_reduction(
    "amin",
    lambda x, axis, keepdim: torch.amin(x, dim=_torch_dims(axis), keepdim=keepdim),
    ReduceSpec(
        identity=highest,
        combine=lambda c, acc, v: nan_min(v, acc) if c.is_float else f"tl.minimum({acc}, {v})",
        final=_extreme_final("min"),
    ),
    accepts=NUMERIC | {"bool"},
)


def rcount_value(x, axis) -> float:
    """How many elements a reduction over ``axis`` combines (a per-call kernel argument)."""
    if not hasattr(x, "shape") or not x.shape:
        return 1.0
    return float(math.prod(x.shape[a] for a in _axes(axis, x.ndim)))


register(
    OpDef(
        name="rcount",
        kind=OpKind.SCALAR,
        arity=1,
        eager_launches=0,
        accepts=frozenset({FLOAT, "int", "bool"}),
        ref=rcount_value,
        doc="number of elements reduced over axis (a scalar argument)",
    )
)

axes_of = _axes
