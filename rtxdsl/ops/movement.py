"""Movement ops: re-index their first operand; a kernel evaluates them inside the consumer.

``unsqueeze`` inserts size-1 dims (what a keepdim=False reduction's gradient needs to
broadcast back); inside a row kernel it only turns a per-row value's role around.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ShapeError
from ..expr import node
from ..registry import ANY, DtypeRule, Front, OpDef, OpKind, Unsupported, register
from .helpers import D


def _unsqueeze_ref(a: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    for ax in sorted(axes):
        a = a.unsqueeze(ax)
    return a


def _unsqueeze_shape(shapes: list[tuple[int, ...]], axes: tuple[int, ...]) -> tuple[int, ...]:
    out = list(shapes[0])
    rank = len(out) + len(axes)
    for ax in sorted(a % rank for a in axes):
        if ax > len(out):
            raise ShapeError(f"unsqueeze axis {ax} is out of range for rank {rank}")
        out.insert(ax, 1)
    return tuple(out)


def _unsqueeze_canonical(shapes: list[tuple[int, ...]], axes: tuple[int, ...]) -> dict[str, Any]:
    rank = len(shapes[0]) + len(axes)
    return {"axes": tuple(sorted(a % rank for a in axes))}


def _torch_unsqueeze(a: Any, dim: Any) -> Any:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise Unsupported
    return node("unsqueeze", a, axes=(dim,))


def _squeeze_back(d: D) -> tuple[Any, ...]:
    """Drop the inserted size-1 dims from g (those g has: it may broadcast with fewer dims)."""
    pad = d.n_ndim - d.g_ndim
    present = tuple(a - pad for a in d.n.attr("axes") if a - pad >= 0)
    return (node("sum", d.g, axis=present, keepdim=False) if present else d.g,)


register(
    OpDef(
        name="unsqueeze",
        kind=OpKind.MOVEMENT,
        arity=1,
        ref=_unsqueeze_ref,
        emit=lambda c, a: a,
        shape=_unsqueeze_shape,
        canonical=_unsqueeze_canonical,
        derivative=_squeeze_back,
        eager_launches=0,
        accepts=ANY,
        rule=DtypeRule.KEEP,
        front=Front(torch={torch.Tensor.unsqueeze: _torch_unsqueeze, torch.unsqueeze: _torch_unsqueeze}),
    )
)
