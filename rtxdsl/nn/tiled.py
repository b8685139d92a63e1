"""Sequence-tiled MLPs (DeepSpeed's TiledMLP, Liger's ``LigerTiledSwiGLUMLP``): an MLP over a long
sequence computed a slice of tokens at a time, so its ``[tokens, intermediate]`` activations exist
for one slice only, in the forward and in the backward (which recomputes each slice's forward).

Unlike a backward that calls ``torch.autograd.backward`` inside itself (writing ``.grad`` behind
autograd's back), the gradients of the parameters are outputs of the autograd node: summed over
the slices in float32, and returned, so ``torch.autograd.grad``, hooks and gradient accumulation
see them as any other op's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import RtxError
from ..lazy import LazyTensor


def shard_count(x: torch.Tensor, shards: int | None) -> int:
    """The number of slices: ``shards``, or ``ceil(tokens / hidden)`` for None (Liger's default), at
    least 1; an :class:`~rtxdsl.errors.RtxError` for anything but a positive int or None."""
    if shards is None:
        hidden = max(x.shape[-1], 1)
        return max(1, math.ceil(x.numel() // hidden / hidden))
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise RtxError(f"tiled_mlp: shards must be a positive int or None, got {shards!r}")
    return shards


def _bounds(rows: int, shards: int) -> list[tuple[int, int]]:
    step = max(1, math.ceil(rows / shards))
    return [(lo, min(rows, lo + step)) for lo in range(0, rows, step)]


class _Tiled(torch.autograd.Function):
    """``fn`` over slices of ``x``'s rows; the backward recomputes each slice under grad mode."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, shards: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.shards, ctx.params = fn, shards, params
        ctx.save_for_backward(x)
        rows = x.reshape(-1, x.shape[-1])
        with torch.no_grad():
            parts = [fn(rows[lo:hi]) for lo, hi in _bounds(rows.shape[0], shards)]
        if not parts:  # no tokens: one call on the empty rows gives the result's shape and dtype
            with torch.no_grad():
                parts = [fn(rows)]
        out = torch.cat(parts, 0)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        want_x = ctx.needs_input_grad[2]
        wanted = [p for p, need in zip(ctx.params, ctx.needs_input_grad[3:]) if need]
        rows, grad_rows = x.detach().reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        gx = torch.zeros_like(rows) if want_x else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        for lo, hi in _bounds(rows.shape[0], ctx.shards):
            part = rows[lo:hi].detach().requires_grad_(want_x)
            with torch.enable_grad():
                out = ctx.fn(part)
            got = torch.autograd.grad(out, ([part] if want_x else []) + wanted, grad_rows[lo:hi], allow_unused=True)
            if want_x:
                gx[lo:hi] = got[0] if got[0] is not None else 0
                got = got[1:]
            for i, g in enumerate(got):  # summed over the slices in float32 (or wider), rounded once
                if g is not None:
                    wide = g.to(torch.promote_types(g.dtype, torch.float32))
                    sums[i] = wide if sums[i] is None else sums[i] + wide
        it = iter(None if s is None else s.to(p.dtype) for s, p in zip(sums, wanted))
        params = [next(it) if need else None for need in ctx.needs_input_grad[3:]]
        return (None, None, None if gx is None else gx.reshape(x.shape), *params)


def tiled_mlp(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, shards: int | None = None,
    params: Sequence[torch.Tensor] = (),
) -> torch.Tensor:  # fmt: skip
    """``fn(x)`` for a row-wise ``fn`` (an MLP: each token's result depends on that token alone),
    computed over ``shards`` slices of ``x``'s tokens (``None``: ``ceil(tokens / hidden)``, Liger's
    default), so ``fn``'s intermediate activations exist for one slice at a time; the backward
    recomputes each slice. ``params``: the tensors ``fn`` reads that take gradients (a module's
    parameters); their gradients, and ``x``'s, are this op's, summed over the slices in float32.

    Example:
        >>> import torch, rtxdsl as rx
        >>> mlp = rx.nn.SwiGLU(8, 16)
        >>> x = torch.randn(3, 10, 8)
        >>> out = rx.nn.tiled_mlp(mlp, x, shards=4, params=list(mlp.parameters()))
        >>> torch.allclose(out, mlp(x), atol=1e-6)
        True
    """
    if not isinstance(x, (torch.Tensor, LazyTensor)) or x.dim() == 0:  # (a lazy value materializes at apply)
        raise RtxError(f"tiled_mlp: x must be a tensor with a hidden axis, got {getattr(x, 'shape', type(x))}")
    if not callable(fn):
        raise RtxError(f"tiled_mlp: fn must be a function of the rows (an MLP), got {fn!r}")
    return _Tiled.apply(fn, shard_count(x, shards), x, *params)
