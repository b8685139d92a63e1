"""Random numbers: Philox in the kernel, keyed by a seed and each element's linear index.

``rand_like(e, seed)`` is uniform in [0, 1) at every element of ``e``'s shape; the seed and the
shape's strides are kernel arguments (never constants: a new seed compiles nothing). With
``seed=None`` every call draws a fresh seed from torch's default CPU generator (no device
sync; ``torch.manual_seed`` makes runs reproducible), and autograd hands the same seed to the
backward, which regenerates the numbers instead of storing a mask.

The torch reference (``backend="torch"``) draws from ``torch.Generator().manual_seed(seed)``:
the same distribution, not the same numbers as Philox.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ..errors import RtxError
from ..expr import Expr, node
from ..registry import FLOATING, AxisRule, DtypeRule, Front, OpDef, OpKind, RemapCtx, Unsupported, register
from .helpers import ExprLike, scalar_arg, torch_fns

#: hidden inputs holding a per-call seed: ``Kernel`` draws them, users never pass them
SEED_PREFIX = "_rng"
_seed_ids = itertools.count()


def seed_operand(seed: Any, op: str) -> Any:
    """The seed as an operand: an int, or a fresh hidden input drawn on every call."""
    if seed is None:
        return Expr("var", (), {"name": f"{SEED_PREFIX}{next(_seed_ids)}", "dtype": None})
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise RtxError(f"{op}: seed must be None or a non-negative int, got {seed!r}")
    return seed


def draw_seed() -> int:
    """A seed from torch's default CPU generator (reproducible under ``torch.manual_seed``)."""
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64))


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(seed))


def rand_like(e: ExprLike, seed: int | None = None) -> Expr:
    """Uniform [0, 1) numbers shaped and typed like ``e`` (Philox; see the module docstring).

    Example:
        >>> import rtxdsl as rx
        >>> rx.rand_like(rx.var("x"), seed=7)
        rand_like(x, 7)
    """
    return node("rand_like", e, seed_operand(seed, "rand_like"))


def _rand_ref(x: torch.Tensor, seed: int) -> torch.Tensor:
    # torch.rand's own draws (it is empty + uniform_), written so fake tensors of symbolic sizes run
    # it too (torch.rand with a generator needs concrete sizes): torch.compile's fakes run this
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    return out.uniform_(0.0, 1.0, generator=_generator(seed, x.device))


def _rand_remap(c: RemapCtx) -> str:
    """Philox at each element's linear index (the shape's contiguous strides are arguments)."""
    seed = c.value(1, c.out)
    linear = " + ".join([f"{i} * {stride}" for i, stride in zip(c.out.idx, c.args)] + [c.zero])
    return f"tl.rand({seed}, {linear})"


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


def _rand_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    if not dtypes[0].is_floating_point:
        raise RtxError(f"rand_like: the shape operand must be floating point (the result's dtype), got {dtypes[0]}")
    if dtypes[1].is_floating_point or dtypes[1] is torch.bool:
        raise RtxError("rand_like: seed must be an int")
    return dtypes[0]


register(
    OpDef(
        name="rand_like",
        kind=OpKind.MOVEMENT,
        arity=2,
        ref=_rand_ref,
        remap=_rand_remap,
        shape=lambda shapes: shapes[0],
        launch_args=lambda shapes, out: _contiguous(out),
        result_dtype=_rand_dtype,
        shape_only=(0,),
        axes=AxisRule.RANDOM,
        rule=DtypeRule.KEEP,
        derivative=lambda d: (None, None),
        eager_launches=1,
        front=Front(fn=rand_like, torch={torch.rand_like: lambda a, **kw: _torch_rand_like(a, **kw)}),
    )
)


def _torch_rand_like(a: Any, *, dtype: Any = None, layout: Any = None, device: Any = None, **kw: Any) -> Expr:
    if dtype is not None or layout is not None or device is not None or kw.get("requires_grad"):
        raise Unsupported
    return rand_like(a, seed=draw_seed())


# ---- dropout --------------------------------------------------------------------------------
def dropout(e: ExprLike, p: float = 0.5, training: bool = True, seed: int | None = None) -> Expr:
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)``
    (``F.dropout``); the identity when not ``training`` or ``p == 0``. The mask is never stored:
    the backward regenerates it from the seed.

    Example:
        >>> import rtxdsl as rx
        >>> rx.dropout(rx.var("x"), 0.1, seed=3)
        dropout(x, 3, p=0.1)
    """
    prob = scalar_arg(p, "dropout", "p")
    if not 0.0 <= prob <= 1.0:
        raise RtxError(f"dropout: p must be in [0, 1], got {p!r}")
    if not isinstance(training, bool):
        raise RtxError(f"dropout: training must be a bool, got {training!r}")
    if not training or prob == 0.0:
        return e if isinstance(e, Expr) else node("cast", e, dtype=torch.get_default_dtype())
    if prob == 1.0:  # torch: input * 0 (NaN and inf stay NaN), no random draw
        return node("mul", e, 0.0)
    return node("dropout", e, seed_operand(seed, "dropout"), p=prob)


def _dropout_ref(x: torch.Tensor, seed: int, p: float) -> torch.Tensor:
    keep = _rand_ref(x, seed) >= p
    return torch.where(keep, x, x * 0) * (1.0 / (1.0 - p))


def _dropout_decompose(x: Expr, seed: Expr, p: float) -> Expr:
    # torch multiplies by the mask, forward (``input * noise``) and backward (``grad * mask *
    # scale``): an inf or NaN input, or cotangent, at a dropped element is NaN there, not 0
    keep = node("ge", node("rand_like", x, seed), p)
    return node("mul", node("where", keep, x, node("mul", x, 0.0)), 1.0 / (1.0 - p))


def _torch_dropout(a: Any, p: float = 0.5, training: bool = True, inplace: bool = False, *, train: Any = None) -> Expr:
    if inplace or not isinstance(training if train is None else train, bool):
        raise Unsupported
    # recorded by the lazy stream: the seed is drawn now, in program order (a scalar input there)
    return dropout(a, p, training if train is None else train, seed=draw_seed())


register(
    OpDef(
        name="dropout",
        kind=OpKind.COMPOSITE,
        arity=2,
        ref=_dropout_ref,
        decompose=_dropout_decompose,
        result_dtype=lambda dtypes, p: dtypes[0],
        eager_launches=1,
        accepts=FLOATING,
        front=Front(fn=dropout, torch=dict.fromkeys(torch_fns("dropout"), _torch_dropout)),
    )
)
