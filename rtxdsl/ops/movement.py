"""Movement ops: they re-index their operands, and a kernel evaluates them inside the consumer.

Each declares a ``remap``: given the coordinates its value is wanted at (index expressions per
output dimension), it reads its operands at other coordinates — a slice shifts and strides an
index, a flip mirrors it, ``cat`` picks the operand whose range holds it, ``take`` (gather)
replaces one index with a loaded value, ``reshape`` ravels and unravels. Nothing is copied:
the loads happen at the remapped addresses inside the kernel that consumes the value.
Offsets, steps and sizes are launch arguments (``launch_attrs`` / ``launch_args``), so other
slices or sizes compile nothing new.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..errors import RtxError, ShapeError
from ..expr import Expr, node
from ..registry import ANY, AxisRule, Coords, DtypeRule, Front, OpDef, OpKind, RemapCtx, Unsupported, register
from .helpers import D, ExprLike, int_axis, ints_arg, tensor_arg, torch_fns


def _axis(axis: int, rank: int, op: str) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise RtxError(f"{op}: axis must be an int, got {axis!r}")
    if not -max(rank, 1) <= axis < max(rank, 1):
        raise ShapeError(f"{op}: axis {axis} is out of range for rank {rank}")
    return axis % rank if rank else 0


def _promoted(dtypes: list[torch.dtype], **attrs: Any) -> torch.dtype:
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def _movement(
    name: str,
    arity: int | None,
    ref: Callable[..., Any],
    shape: Callable[..., tuple[int, ...]],
    remap: Callable[[RemapCtx], str],
    derivative: Callable[[D], tuple] | None,
    *,
    canonical: Callable[..., dict[str, Any]] | None = None,
    launch_attrs: tuple[str, ...] = (),
    launch_args: Callable[..., tuple[int, ...]] | None = None,
    rule: DtypeRule = DtypeRule.KEEP,
    front: Front | None = None,
    **more: Any,
) -> OpDef:
    # the result has the data operand's dtype (cat: the operands' promoted one); torch's answer on
    # one-element probes would depend on the index values (select(1) of a probe is out of range)
    if "result_dtype" not in more:
        more["result_dtype"] = _promoted if rule is DtypeRule.PROMOTE else lambda dtypes, **attrs: dtypes[0]
    return register(
        OpDef(
            name=name,
            kind=OpKind.MOVEMENT,
            arity=arity,
            ref=ref,
            shape=shape,
            remap=remap,
            derivative=derivative,
            canonical=canonical,
            launch_attrs=launch_attrs,
            launch_args=launch_args,
            eager_launches=0,
            accepts=ANY,
            rule=rule,
            front=front or Front(),
            **more,
        )
    )


# ---- unsqueeze: size-1 dims inserted ------------------------------------------------------------
def _unsqueeze_ref(a: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    for ax in sorted(axes):
        a = a.unsqueeze(ax)
    return a


def _unsqueeze_shape(shapes: list[tuple[int, ...]], axes: tuple[int, ...]) -> tuple[int, ...]:
    out = list(shapes[0])
    rank = len(out) + len(axes)
    for a in axes:  # (an axis past the result's rank is refused, not wrapped around)
        if not -rank <= a < rank:
            raise ShapeError(f"unsqueeze: axis {a} is out of range for a result of rank {rank}")
    for ax in sorted(a % rank for a in axes):
        if ax > len(out):
            raise ShapeError(f"unsqueeze axis {ax} is out of range for rank {rank}")
        out.insert(ax, 1)
    return tuple(out)


def _unsqueeze_canonical(shapes: list[tuple[int, ...]], axes: tuple[int, ...]) -> dict[str, Any]:
    rank = len(shapes[0]) + len(axes)
    return {"axes": tuple(sorted(a % rank for a in axes))}


def _unsqueeze_remap(c: RemapCtx) -> str:
    axes = set(c.attrs["axes"])
    return c.value(0, Coords(tuple(i for d, i in enumerate(c.out.idx) if d not in axes), c.out.pred))


def _squeeze_back(d: D) -> tuple[Any, ...]:
    """Drop the inserted size-1 dims from g (those g has: it may broadcast with fewer dims)."""
    pad = d.n_ndim - d.g_ndim
    present = tuple(a - pad for a in d.n.attr("axes") if a - pad >= 0)
    return (node("sum", d.g, axis=present, keepdim=False) if present else d.g,)


def _torch_unsqueeze(a: Any, dim: Any) -> Any:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise Unsupported
    return node("unsqueeze", a, axes=(dim,))


_movement(
    "unsqueeze",
    1,
    _unsqueeze_ref,
    _unsqueeze_shape,
    _unsqueeze_remap,
    _squeeze_back,
    canonical=_unsqueeze_canonical,
    view=True,
    emit=lambda c, a: a,  # flat kernels address the operand with the size-1 dims' strides
    front=Front(torch={torch.Tensor.unsqueeze: _torch_unsqueeze, torch.unsqueeze: _torch_unsqueeze}),
    axes=AxisRule.VIEW,
)


# ---- expand: broadcast to a shape (the cotangent of a movement op, at the op's full shape) ------
def _expand_shape(shapes: list[tuple[int, ...]], shape: tuple[int, ...]) -> tuple[int, ...]:
    x = shapes[0]
    pad = len(shape) - len(x)
    if pad < 0 or any(s not in (1, t) for s, t in zip(x, shape[pad:])):
        raise ShapeError(f"expand: shape {list(x)} does not broadcast to {list(shape)}")
    return tuple(shape)


_movement(
    "expand",
    1,
    lambda x, shape: x.expand(shape),
    _expand_shape,
    lambda c: c.value(0, c.out),  # the reader's coordinates, broadcast: 0 on size-1 dims
    lambda d: (d.g,),  # the VJP pass sums the cotangent back to the operand's shape
    launch_attrs=("shape",),
    axes=AxisRule.SIZES,
)


# ---- slice: start + step * i along one axis ---------------------------------------------------
def _slice_bounds(n: int, start: int | None, stop: int | None, step: int, chunk: tuple[int, int] | None):
    if chunk is not None:  # rx.chunk: piece k of n, torch's chunk size (the trailing ones may be empty)
        pieces, k = chunk
        size = -(-n // pieces) if n else 0
        start, stop = min(k * size, n), min((k + 1) * size, n)
    if step < 1:
        raise ShapeError(f"slice step must be positive, got {step} (use rx.flip to reverse)")
    s, e, st = slice(start, stop, step).indices(n)
    return s, len(range(s, e, st))


def _slice_shape(shapes: list[tuple[int, ...]], axis: int, start: Any, stop: Any, step: int, chunk: Any = None):
    x = shapes[0]
    a = _axis(axis, len(x), "slice")
    if not x:
        raise ShapeError("cannot slice a 0-dim expression")
    _, length = _slice_bounds(x[a], start, stop, step, chunk)
    return x[:a] + (length,) + x[a + 1 :]


def _slice_canonical(shapes: list[tuple[int, ...]], axis: int, start: Any, stop: Any, step: int, chunk: Any = None):
    x = shapes[0]
    a = _axis(axis, len(x), "slice")
    s, length = _slice_bounds(x[a], start, stop, step, chunk)
    return {"axis": a, "start": s, "stop": s + step * length, "step": step}


def _slice_ref(x: torch.Tensor, axis: int, start: Any, stop: Any, step: int, chunk: Any = None) -> torch.Tensor:
    a = axis % x.ndim
    s, length = _slice_bounds(x.shape[a], start, stop, step, chunk)
    return x.narrow(a, s, step * (length - 1) + 1 if length else 0)[(slice(None),) * a + (slice(None, None, step),)]


def _slice_remap(c: RemapCtx) -> str:
    a = c.attrs["axis"]
    start, step = c.args
    return c.value(0, c.out.at(a, f"{start} + {step} * {c.out.idx[a]}"))


def _slice_back(d: D) -> tuple[Any, ...]:
    at = d.n.attr_dict
    n = d.src_shapes[0][at["axis"]]
    return (node("unslice", d.g, axis=at["axis"], start=at["start"], step=at["step"], size=n),)


def _unslice_back(d: D) -> tuple[Any, ...]:
    at = d.n.attr_dict
    length = d.src_shapes[0][at["axis"]]
    stop = at["start"] + at["step"] * length
    return (node("slice", d.g, axis=at["axis"], start=at["start"], stop=stop, step=at["step"]),)


def chunk(e: ExprLike, chunks: int, axis: int = 0) -> tuple[Expr, ...]:
    """``chunks`` pieces of ``e`` along ``axis`` with torch.chunk's sizes; where torch returns fewer
    pieces (e.g. 5 elements in 4 chunks gives 3), the trailing ones here are empty.

    Example:
        >>> import rtxdsl as rx
        >>> len(rx.chunk(rx.var("x"), 2, -1))
        2
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise RtxError(f"chunk: chunks must be a positive int, got {chunks!r}")
    return tuple(node("slice", e, axis=axis, start=None, stop=None, step=1, chunk=(chunks, k)) for k in range(chunks))


_movement(
    "slice",
    1,
    _slice_ref,
    _slice_shape,
    _slice_remap,
    _slice_back,
    canonical=_slice_canonical,
    launch_attrs=("start", "stop", "step"),
    launch_args=lambda shapes, out, axis, start, stop, step, chunk=None: (start, step),
    front=Front(fn=chunk, names=("chunk",), methods={"chunk": None}, parse=False),
    axes=AxisRule.ALONG_AXIS,
)


def narrow(e: ExprLike, axis: int, start: int, length: int) -> Expr:
    """``length`` elements of ``e`` along ``axis`` from ``start`` (torch.narrow); read in place.

    Example:
        >>> import rtxdsl as rx
        >>> rx.narrow(rx.var("x"), -1, 2, 4)
        narrow(x, axis=-1, length=4, start=2)
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise RtxError(f"narrow: length must be a non-negative int, got {length!r}")
    if isinstance(start, bool) or not isinstance(start, int):
        raise RtxError(f"narrow: start must be an int, got {start!r}")
    return node("narrow", e, axis=axis, start=start, length=length)


def _narrow_shape(shapes: list[tuple[int, ...]], axis: int, start: int, length: int) -> tuple[int, ...]:
    x = shapes[0]
    a = _axis(axis, len(x), "narrow")
    if not -x[a] <= start <= x[a] or (start % x[a] if x[a] and start < 0 else start) + length > x[a]:
        raise ShapeError(f"narrow: start {start} + length {length} exceeds dimension {a} of size {x[a]}")
    return x[:a] + (length,) + x[a + 1 :]


def _torch_narrow(a: Any, dim: Any, start: Any, length: Any) -> Expr:
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (dim, start, length)):
        raise Unsupported
    return narrow(a, dim, start, length)


# narrow is a slice whose stop follows from a possibly negative start: resolved at binding
register(
    OpDef(
        name="narrow",
        kind=OpKind.COMPOSITE,
        arity=1,
        ref=lambda x, axis, start, length: x.narrow(axis, start, length),
        decompose=lambda x, axis, start, length: node(
            "slice",
            x,
            axis=axis,
            start=start,
            stop=(start + length) if start >= 0 else (start + length or None),
            step=1,
        ),
        shape=_narrow_shape,
        result_dtype=lambda dtypes, **attrs: dtypes[0],
        eager_launches=0,
        accepts=ANY,
        front=Front(fn=narrow, methods={"narrow": None}, torch=dict.fromkeys(torch_fns("narrow"), _torch_narrow)),
    )
)


def unslice_shape(shapes: list[tuple[int, ...]], axis: int, start: int, step: int, size: int) -> tuple[int, ...]:
    g = shapes[0]
    return g[:axis] + (size,) + g[axis + 1 :]


def _unslice_ref(g: torch.Tensor, axis: int, start: int, step: int, size: int) -> torch.Tensor:
    shape = list(g.shape)
    shape[axis] = size
    out = torch.zeros(shape, dtype=g.dtype, device=g.device)
    out.narrow(axis, start, size - start)[(slice(None),) * axis + (slice(None, None, step),)][
        (slice(None),) * axis + (slice(0, g.shape[axis]),)
    ] = g
    return out


def _unslice_remap(c: RemapCtx) -> str:
    """The gradient of a slice: g where an index was sliced, 0 elsewhere."""
    a = c.attrs["axis"]
    start, step, length = c.args
    d = c.tmp(f"{c.out.idx[a]} - {start}")
    k = c.tmp(f"{d} // {step}")
    hit = c.tmp(f"({d} >= 0) & ({d} % {step} == 0) & ({k} < {length})")
    return f"tl.where({hit}, {c.value(0, c.out.at(a, k).where(hit))}, 0)"


_movement(
    "unslice",
    1,
    _unslice_ref,
    unslice_shape,
    _unslice_remap,
    _unslice_back,
    launch_attrs=("start", "step", "size"),
    launch_args=lambda shapes, out, axis, start, step, size: (start, step, shapes[0][axis]),
    axes=AxisRule.ALONG_AXIS,
)


# ---- flip ---------------------------------------------------------------------------------------
def flip(e: ExprLike, axis: int | tuple[int, ...]) -> Expr:
    """``e`` reversed along ``axis`` (or each axis of a tuple), as torch.flip; read in place.

    Example:
        >>> import rtxdsl as rx
        >>> rx.flip(rx.var("x"), -1)
        flip(x, axis=-1)
    """
    axes = ints_arg(axis, "flip", "axis")
    if len(set(axes)) < len(axes):
        raise ShapeError(f"flip: axis {list(axes)} names a dim more than once")
    out = e
    for a in axes:
        out = node("flip", out, axis=a)
    return out  # type: ignore[return-value]


def _flip_remap(c: RemapCtx) -> str:
    """Index ``size - 1 - i`` along the axis (a 0-dim operand is its own flip)."""
    if not c.out.idx:
        return c.value(0, c.out)
    a = c.attrs["axis"]
    return c.value(0, c.out.at(a, f"{c.args[0]} - {c.out.idx[a]}"))


def _torch_flip(a: Any, dims: Any) -> Expr:
    if isinstance(dims, int):
        dims = (dims,)
    if not all(isinstance(d, int) for d in dims):
        raise Unsupported
    return flip(a, tuple(dims))


_movement(
    "flip",
    1,
    lambda x, axis: torch.flip(x, (axis,)),
    lambda shapes, axis: (_axis(axis, len(shapes[0]), "flip"), shapes[0])[1],
    _flip_remap,
    lambda d: (node("flip", d.g, axis=d.n.attr("axis")),),
    canonical=lambda shapes, axis: {"axis": _axis(axis, len(shapes[0]), "flip")},
    launch_args=lambda shapes, out, axis: (shapes[0][axis] - 1 if shapes[0] else 0,),
    front=Front(fn=flip, methods={"flip": None}, torch=dict.fromkeys(torch_fns("flip"), _torch_flip)),
    axes=AxisRule.ALONG_AXIS,
)


# ---- permute -------------------------------------------------------------------------------------
def permute(e: ExprLike, dims: tuple[int, ...] | list[int]) -> Expr:
    """``e`` with its dims reordered, as torch.permute (``out.shape[i] == e.shape[dims[i]]``).

    Read in place: a consumer reads ``e`` at the permuted coordinates. The lazy stream uses it to
    compute a value in eager's memory order (then views it back), so no copy restrides it.

    Example:
        >>> import rtxdsl as rx
        >>> rx.permute(rx.var("x"), (1, 0))
        permute(x, dims=(1, 0))
    """
    return node("permute", e, dims=ints_arg(dims, "permute", "dims"))


def _permute_dims(shapes: list[tuple[int, ...]], dims: tuple[int, ...]) -> tuple[int, ...]:
    rank = len(shapes[0])
    if len(dims) != rank:
        raise ShapeError(f"permute: dims {dims} do not match rank {rank}")
    canon = tuple(_axis(d, rank, "permute") for d in dims)
    if sorted(canon) != list(range(rank)):
        raise ShapeError(f"permute: dims {dims} are not a permutation of range({rank})")
    return canon


def _permute_remap(c: RemapCtx) -> str:
    """The operand's dim ``dims[p]`` is read at the output's index ``p``."""
    src = [""] * len(c.out.idx)
    for p, k in enumerate(c.attrs["dims"]):
        src[k] = c.out.idx[p]
    return c.value(0, Coords(tuple(src), c.out.pred))


def _permute_back(d: D) -> tuple[Any, ...]:
    dims = d.n.attr("dims")
    return (node("permute", d.g, dims=tuple(sorted(range(len(dims)), key=dims.__getitem__))),)


def _ints(values: tuple[Any, ...]) -> tuple[int, ...]:
    """Dims or sizes as torch's view calls take them (``x.view(2, 3)`` or ``x.view((2, 3))``): ints,
    else no fused form (``x.view(torch.float16)`` reinterprets bytes; symbolic sizes)."""
    out = _shape_arg(values)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in out):
        raise Unsupported
    return out


_movement(
    "permute",
    1,
    lambda x, dims: x.permute(dims),
    lambda shapes, dims: tuple(shapes[0][k] for k in _permute_dims(shapes, dims)),
    _permute_remap,
    _permute_back,
    canonical=lambda shapes, dims: {"dims": _permute_dims(shapes, dims)},
    front=Front(
        fn=permute,
        methods={"permute": lambda self, *dims: permute(self, _shape_arg(dims))},
        torch=dict.fromkeys(torch_fns("permute"), lambda a, *dims: permute(a, _ints(dims))),
    ),
)


def transpose(e: ExprLike, dim0: int, dim1: int) -> Expr:
    """``torch.transpose``: dims ``dim0`` and ``dim1`` swapped (a permute, resolved at binding).

    Example:
        >>> import rtxdsl as rx
        >>> rx.transpose(rx.var("x"), 0, -1)
        transpose(x, dim0=0, dim1=-1)
    """
    return node("transpose", e, dim0=dim0, dim1=dim1)


def _transposed(rank: int, dim0: int, dim1: int) -> tuple[int, ...]:
    a, b = (_axis(d, max(rank, 1), "transpose") for d in (dim0, dim1))
    dims = list(range(rank))
    if rank:
        dims[a], dims[b] = dims[b], dims[a]
    return tuple(dims)


def _torch_transpose(a: Any, dim0: Any, dim1: Any) -> Expr:
    (d0, d1) = _ints((dim0, dim1))
    return transpose(a, d0, d1)


register(
    OpDef(
        name="transpose",
        kind=OpKind.COMPOSITE,
        arity=1,
        ref=lambda x, dim0, dim1: x.transpose(dim0, dim1),
        decompose=lambda x, dim0, dim1, shapes, dtypes: permute(x, _transposed(len(shapes[0]), dim0, dim1)),
        typed_decompose=True,
        shape=lambda shapes, dim0, dim1: tuple(shapes[0][k] for k in _transposed(len(shapes[0]), dim0, dim1)),
        result_dtype=lambda dtypes, **attrs: dtypes[0],
        eager_launches=0,
        accepts=ANY,
        front=Front(
            fn=transpose,
            methods={"transpose": None, "swapaxes": None, "t": lambda self: transpose(self, 0, -1)},
            torch=dict.fromkeys(torch_fns("transpose", "swapaxes", "swapdims"), _torch_transpose)
            | dict.fromkeys(torch_fns("t"), lambda a: transpose(a, 0, -1)),
        ),
    )
)


# ---- reshape ---------------------------------------------------------------------------------------
def reshape(e: ExprLike, shape: tuple[int, ...] | list[int]) -> Expr:
    """``e`` with the same elements in row-major order and a new ``shape`` (one dim may be -1), as
    torch.reshape of a contiguous tensor; read in place (each output index is linearized, then
    split over the input's sizes).

    Example:
        >>> import rtxdsl as rx
        >>> rx.reshape(rx.var("x"), (2, -1))
        reshape(x, shape=(2, -1))
    """
    return node("reshape", e, shape=ints_arg(shape, "reshape", "shape"))


def _reshape_shape(shapes: list[tuple[int, ...]], shape: tuple[int, ...]) -> tuple[int, ...]:
    n = math.prod(shapes[0])
    if sum(d == -1 for d in shape) > 1 or any(d < -1 for d in shape):
        raise ShapeError(f"reshape: shape {list(shape)} may hold one -1 and no other negative size")
    known = math.prod(d for d in shape if d != -1)
    if -1 in shape:
        if known == 0 or n % known:
            raise ShapeError(f"reshape: shape {list(shape)} is invalid for {n} elements")
        shape = tuple(n // known if d == -1 else d for d in shape)
    if math.prod(shape) != n:
        raise ShapeError(f"reshape: shape {list(shape)} is invalid for an input of {n} elements")
    return shape


def _reshape_runs(src: tuple[int, ...], out: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """The smallest runs of output and input dims (size-1 dims left out) with equal products, in
    order: (output dims, input dims) per run. A run of one input dim only splits it (its index is
    linear in the output's), a run of one output dim only merges input dims; only a run of several
    of both regroups. An input dim of size 1 is in no run (its index is 0); an empty tensor is
    one run of every dim."""
    if 0 in src or 0 in out:
        return ((tuple(range(len(out))), tuple(range(len(src)))),)
    o = [k for k, s in enumerate(out) if s != 1]
    n = [k for k, s in enumerate(src) if s != 1]
    runs = []
    a = b = 0
    while a < len(o):
        ra, rb, po, pi = [o[a]], [n[b]], out[o[a]], src[n[b]]
        a, b = a + 1, b + 1
        while po != pi:  # the side with the smaller product takes its next dim
            if po < pi:
                ra.append(o[a])
                po, a = po * out[o[a]], a + 1
            else:
                rb.append(n[b])
                pi, b = pi * src[n[b]], b + 1
        runs.append((tuple(ra), tuple(rb)))
    return tuple(runs)


def _reshape_remap(c: RemapCtx) -> str:
    """Per run of dims (``_reshape_runs``): linearize the run's output indices over their sizes,
    then split that over the run's input dims (a run of one input dim: no split)."""
    rank_out = len(c.out.idx)
    outs, ins = c.args[:rank_out], c.args[rank_out:]
    if not ins:
        return c.value(0, Coords((), c.out.pred))
    src = [c.zero] * len(ins)
    for ra, rb in c.attrs.get("runs") or ((tuple(range(rank_out)), tuple(range(len(ins)))),):
        flat = c.out.idx[ra[0]] if ra else c.zero
        for k in ra[1:]:
            flat = f"({flat}) * {outs[k]} + ({c.out.idx[k]})"
        rest = c.tmp(flat) if len(ra) > 1 else flat
        for k in reversed(rb[1:]):
            src[k] = c.tmp(f"{rest} % {ins[k]}")
            rest = c.tmp(f"{rest} // {ins[k]}")
        src[rb[0]] = rest
    return c.value(0, Coords(tuple(src), c.out.pred))


_movement(
    "reshape",
    1,
    lambda x, shape, runs=None: x.reshape(shape),
    lambda shapes, shape, runs=None: _reshape_shape(shapes, shape),
    _reshape_remap,
    lambda d: (node("reshape", d.g, shape=d.src_shapes[0]),),
    # the runs of dims are structure (a split is linear where a regroup divides): in the signature
    canonical=lambda shapes, shape, runs=None: {
        "shape": (out := _reshape_shape(shapes, shape)),
        "runs": _reshape_runs(shapes[0], out),
    },
    launch_attrs=("shape",),
    launch_args=lambda shapes, out, shape, runs=None: (*out, *shapes[0]),
    regroups=True,
    front=Front(
        fn=reshape,
        methods=dict.fromkeys(("reshape", "view"), lambda self, *shape: reshape(self, _shape_arg(shape))),
        # a view is the reshape of the same layout (the lazy stream checks eager's layout agrees)
        torch=dict.fromkeys([*torch_fns("reshape"), torch.Tensor.view], lambda a, *shape: reshape(a, _ints(shape))),
    ),
)


def _shape_arg(shape: tuple[Any, ...]) -> tuple[int, ...]:
    """``x.reshape(2, 3)`` and ``x.reshape((2, 3))`` alike."""
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)


# ---- cat / stack --------------------------------------------------------------------------------
def _cat_shape(shapes: list[tuple[int, ...]], axis: int) -> tuple[int, ...]:
    live = [s for s in shapes if s != (0,)] or shapes[:1]  # torch skips legacy empty 1-d operands
    rank = len(live[0])
    if not rank:
        raise ShapeError("cat: zero-dimensional expressions cannot be concatenated")
    a = _axis(axis, rank, "cat")
    for k, s in enumerate(live):
        if len(s) != rank or any(x != y for d, (x, y) in enumerate(zip(s, live[0])) if d != a):
            raise ShapeError(f"cat: operand {k} has shape {list(s)}, which does not match {list(live[0])} off axis {a}")
    return live[0][:a] + (sum(s[a] for s in live),) + live[0][a + 1 :]


def _cat_remap(c: RemapCtx) -> str:
    """Nested where over the operands' ranges; each operand's loads masked to its own range."""
    a = c.attrs["axis"]
    i = c.out.idx[a]
    parts = [k for k, r in enumerate(c.src_ranks) if r == len(c.out.idx)]  # legacy empty 1-d operands: none
    bounds = dict(zip(parts, c.args))  # end offset of each live operand but the last
    lo = None
    branches = []
    for k in parts:
        hi = bounds.get(k)
        coords = c.out.at(a, f"{i} - {lo}" if lo else i)
        coords = coords.where(*([f"{i} >= {lo}"] if lo else []), *([f"{i} < {hi}"] if hi else []))
        branches.append((hi, c.value(k, coords)))
        lo = hi
    expr = branches[-1][1]
    for hi, v in reversed(branches[:-1]):
        expr = f"tl.where({i} < {hi}, {v}, {expr})"
    return expr


def _cat_args(shapes: list[tuple[int, ...]], out: tuple[int, ...], axis: int) -> tuple[int, ...]:
    live = [s for s in shapes if len(s) == len(out)]
    ends, acc = [], 0
    for s in live[:-1]:
        acc += s[axis]
        ends.append(acc)
    return tuple(ends)


def _cat_back(d: D) -> tuple[Any, ...]:
    a = d.n.attr("axis")
    out, lo = [], 0
    for s in d.src_shapes:
        if len(s) != d.n_ndim:
            out.append(None)
            continue
        out.append(node("slice", d.g, axis=a, start=lo, stop=lo + s[a], step=1))
        lo += s[a]
    return tuple(out)


def cat(exprs: Any, axis: int | None = None, *, dim: int | None = None) -> Expr:
    """Concatenation along ``axis`` (torch.cat); each operand is read in place by the consumer.

    Example:
        >>> import rtxdsl as rx
        >>> rx.cat([rx.var("a"), rx.var("b")], -1)
        cat(a, b, axis=-1)
    """
    if not isinstance(exprs, (list, tuple)) or not exprs:
        raise RtxError("cat: needs a non-empty list of expressions")
    return node("cat", *exprs, axis=int_axis(axis, dim, "cat", 0))


def stack(exprs: Any, axis: int | None = None, *, dim: int | None = None) -> Expr:
    """Stacking along a new ``axis`` (torch.stack): cat of the operands, each with a size-1 dim inserted.

    Example:
        >>> import rtxdsl as rx
        >>> rx.stack([rx.var("a"), rx.var("b")], 0)
        stack(a, b, axis=0)
    """
    if not isinstance(exprs, (list, tuple)) or not exprs:
        raise RtxError("stack: needs a non-empty list of expressions")
    return node("stack", *exprs, axis=int_axis(axis, dim, "stack", 0))


def _torch_cat(tensors: Any, dim: int = 0, *, out: Any = None) -> Expr:
    if out is not None or not isinstance(dim, int):
        raise Unsupported
    return cat(list(tensors), dim)


def _torch_stack(tensors: Any, dim: int = 0, *, out: Any = None) -> Expr:
    if out is not None or not isinstance(dim, int):
        raise Unsupported
    return stack(list(tensors), dim)


_movement(
    "cat",
    None,
    lambda *xs, axis: torch.cat(xs, axis),
    _cat_shape,
    _cat_remap,
    _cat_back,
    canonical=lambda shapes, axis: {"axis": _axis(axis, len(_cat_shape(shapes, axis)), "cat")},
    launch_args=_cat_args,
    rule=DtypeRule.PROMOTE,
    front=Front(
        fn=cat, names=("cat", "concat", "concatenate"), torch=dict.fromkeys(torch_fns("cat", "concat"), _torch_cat)
    ),
    axes=AxisRule.ALONG_AXIS,
)


def _stack_shape(shapes: list[tuple[int, ...]], axis: int) -> tuple[int, ...]:
    first = shapes[0]
    for k, s in enumerate(shapes):
        if s != first:
            raise ShapeError(f"stack: operand {k} has shape {list(s)}, expected {list(first)}")
    a = _axis(axis, len(first) + 1, "stack")
    return first[:a] + (len(shapes),) + first[a:]


register(
    OpDef(
        name="stack",
        kind=OpKind.COMPOSITE,
        arity=None,
        ref=lambda *xs, axis: torch.stack(xs, axis),
        decompose=lambda *xs, axis: node("cat", *[node("unsqueeze", x, axes=(axis,)) for x in xs], axis=axis),
        shape=_stack_shape,
        eager_launches=1,
        accepts=ANY,
        front=Front(fn=stack, torch=dict.fromkeys(torch_fns("stack"), _torch_stack)),
    )
)


# ---- select: one index along an axis, the axis dropped (integer indexing) ------------------------
def _select_shape(shapes: list[tuple[int, ...]], axis: int, index: int) -> tuple[int, ...]:
    x = shapes[0]
    if not x:
        raise ShapeError("cannot index a 0-dim expression with an integer")
    a = _axis(axis, len(x), "index")
    if not -x[a] <= index < x[a]:
        raise ShapeError(f"index {index} is out of range for dimension {a} of size {x[a]}")
    return x[:a] + x[a + 1 :]


def _select_canonical(shapes: list[tuple[int, ...]], axis: int, index: int) -> dict[str, Any]:
    x = shapes[0]
    a = _axis(axis, len(x), "index")
    return {"axis": a, "index": index % x[a]}


def _select_remap(c: RemapCtx) -> str:
    """The index inserted at the axis, as a tile (masks built from scalars alone mistype)."""
    a = c.attrs["axis"]
    return c.value(0, Coords(c.out.idx[:a] + (f"({c.args[0]} + {c.zero})",) + c.out.idx[a:], c.out.pred))


def _select_back(d: D) -> tuple[Any, ...]:
    a, i = d.n.attr("axis"), d.n.attr("index")
    g = node("unsqueeze", d.g, axes=(a,))
    return (node("unslice", g, axis=a, start=i, step=1, size=d.src_shapes[0][a]),)


_movement(
    "select",
    1,
    lambda x, axis, index: x.select(axis, index),
    _select_shape,
    _select_remap,
    _select_back,
    canonical=_select_canonical,
    launch_attrs=("index",),
    launch_args=lambda shapes, out, axis, index: (index,),
    front=Front(
        fn=lambda e, key: getitem(e, key),
        names=("getitem",),
        operators=("__getitem__",),
        torch={torch.Tensor.__getitem__: lambda a, key: _torch_getitem(a, key)},
        parse=False,
    ),
    axes=AxisRule.ALONG_AXIS,
)


# ---- Python indexing: e[..., 1:, None, 0] --------------------------------------------------------
def getitem(e: ExprLike, key: Any) -> Expr:
    """``e[key]`` with slices (positive steps), integers, ``None`` and ``...``, read in place.

    Example:
        >>> import rtxdsl as rx
        >>> rx.var("x")[..., 1:]
        slice(x, axis=-1, start=1, step=1, stop=None)
    """
    items = list(key) if isinstance(key, tuple) else [key]
    for it in items:
        ok = it is None or it is Ellipsis or isinstance(it, slice) or (isinstance(it, int) and not isinstance(it, bool))
        if not ok:
            raise RtxError(f"indexing: only slices, integers, None and ... are supported, got {it!r}")
    if sum(it is Ellipsis for it in items) > 1:
        raise RtxError("indexing: an index can only have a single ellipsis ('...')")
    cut = items.index(Ellipsis) if Ellipsis in items else len(items)
    head, tail = items[:cut], items[cut + 1 :]
    out = e
    # axes of the operand: counted from the front before the ellipsis, from the back after it
    placed: list[tuple[int, Any]] = []
    k = 0
    for it in head:
        if it is not None:
            placed.append((k, it))
            k += 1
    k = -1
    for it in reversed(tail):
        if it is not None:
            placed.append((k, it))
            k -= 1
    for axis, it in placed:
        if isinstance(it, slice):
            for name in ("start", "stop", "step"):
                v = getattr(it, name)
                if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                    raise RtxError(f"indexing: slice {name} must be an int, got {v!r}")
            if it != slice(None):
                out = node(
                    "slice", out, axis=axis, start=it.start, stop=it.stop, step=1 if it.step is None else it.step
                )
    ints = [(a, it) for a, it in placed if not isinstance(it, slice)]
    # drop integer-indexed axes so the others keep their numbers: front ones last-first, back ones first-last
    for axis, it in sorted((p for p in ints if p[0] >= 0), reverse=True) + sorted(p for p in ints if p[0] < 0):
        out = node("select", out, axis=axis, index=it)
    new: list[int] = []
    k = 0
    for it in head:
        if it is None:
            new.append(k)
        if not isinstance(it, int) or it is None:
            k += 1
    k = -1
    for it in reversed(tail):
        if it is None:
            new.append(k)
        if not isinstance(it, int) or it is None:
            k -= 1
    if new:
        out = node("unsqueeze", out, axes=tuple(new))
    return out  # type: ignore[return-value]


def _torch_getitem(a: Any, key: Any) -> Expr:
    try:
        return getitem(a, key)
    except RtxError:
        raise Unsupported from None


# ---- gather ---------------------------------------------------------------------------------------
def gather(x: ExprLike, index: ExprLike, axis: int | None = None, *, dim: int | None = None) -> Expr:
    """``torch.gather``: ``out[..., i, ...] = x[..., index[..., i, ...], ...]`` along ``axis``.

    ``index`` (int32 or int64) has the rank of ``x`` and is no larger off ``axis``; the result has
    its shape. An out-of-range index raises RtxError (see ``FusionConfig.check_indices``).

    Example:
        >>> import rtxdsl as rx
        >>> rx.gather(rx.var("logits"), rx.var("target"), -1)
        gather(logits, target, axis=-1)
    """
    tensor_arg(index, "gather", "index")
    return node("gather", x, index, axis=int_axis(axis, dim, "gather", -1))


def _gather_shape(shapes: list[tuple[int, ...]], axis: int) -> tuple[int, ...]:
    x, i = shapes
    if not x and len(i) <= 1 and math.prod(i) <= 1:  # torch reads a 0-dim input as one element
        _axis(axis, 1, "gather")
        return i
    if len(i) != len(x):
        raise ShapeError(f"gather: index has rank {len(i)}, but the input has rank {len(x)}: they must match")
    a = _axis(axis, len(x), "gather")
    for d, (xs, js) in enumerate(zip(x, i)):
        if d != a and js > xs:
            raise ShapeError(f"gather: index has size {js} at dimension {d}, larger than the input's {xs}")
    return i


def _gather_dtype(dtypes: list[torch.dtype], axis: int) -> torch.dtype:
    if dtypes[1] not in (torch.int32, torch.int64):
        raise RtxError(f"gather: index must be int32 or int64, got {dtypes[1]}")
    return dtypes[0]


def _gather_ref(x: torch.Tensor, index: torch.Tensor, axis: int) -> torch.Tensor:
    # torch.gather raises for an index outside [0, size) itself ("index 9 is out of bounds for
    # dimension 1 with size 7"); no check here reads the index: torch.compile's fakes run this
    return torch.gather(x, axis, index)


def _gather_remap(c: RemapCtx) -> str:
    a = c.attrs["axis"]
    (size,) = c.args
    idx = c.tmp(f"{c.value(1, c.out)}.to(tl.int64)")  # an int32 index times a stride: 64-bit addresses
    inb = c.tmp(f"({idx} >= 0) & ({idx} < {size})")
    c.flag(f"~{inb}")
    at = c.out.at(a, idx) if c.out.idx else c.out
    return f"tl.where({inb}, {c.value(0, at.where(inb))}, 0)"


def _gather_back(d: D) -> tuple[Any, ...]:
    """Scatter-add as a comparison: dx[.., j, ..] = sum_k (index[.., k, ..] == j) * g[.., k, ..]."""
    a = d.n.attr("axis")
    x, idx = d.srcs
    xs, ks = d.src_shapes
    if not xs:  # a 0-dim input: the gradient of its one element (the index may be 1-d)
        return (node("sum", d.g, axis=None, keepdim=False) if ks else d.g, None)
    if ks[a] == 1:  # one index per row (cross-entropy's target): no sum
        gx = node("where", node("eq", idx, node("arange_like", x, axis=a)), d.g, 0)
    else:
        spread = node("arange_like", node("unsqueeze", x, axes=(a + 1,)), axis=a)
        hit = node("eq", node("unsqueeze", idx, axes=(a,)), spread)
        gx = node("sum", node("where", hit, node("unsqueeze", d.g, axes=(a,)), 0), axis=(a + 1,), keepdim=False)
    for dim, (n, k) in enumerate(zip(xs, ks)):
        if dim != a and k < n:  # the index covers a corner of x off the gathered axis
            gx = node("unslice", gx, axis=dim, start=0, step=1, size=n)
    return (gx, None)


def _torch_gather(a: Any, dim: Any, index: Any, *, sparse_grad: bool = False, out: Any = None) -> Expr:
    if out is not None or sparse_grad or not isinstance(dim, int):
        raise Unsupported
    return gather(a, index, dim)


_movement(
    "gather",
    2,
    _gather_ref,
    _gather_shape,
    _gather_remap,
    _gather_back,
    canonical=lambda shapes, axis: {"axis": _axis(axis, len(shapes[0]), "gather")},
    launch_args=lambda shapes, out, axis: (shapes[0][axis] if shapes[0] else 1,),
    result_dtype=_gather_dtype,
    index_operand=1,
    front=Front(fn=gather, methods={"gather": None}, torch=dict.fromkeys(torch_fns("gather"), _torch_gather)),
    axes=AxisRule.GATHER,
)


# ---- positions --------------------------------------------------------------------------------
def arange_like(e: ExprLike, axis: int = -1) -> Expr:
    """int64 positions ``0 .. e.shape[axis] - 1`` along ``axis``, size 1 elsewhere (broadcasts against ``e``).

    Example:
        >>> import rtxdsl as rx
        >>> rx.arange_like(rx.var("x"), -1)
        arange_like(x, axis=-1)
    """
    return node("arange_like", e, axis=axis)


def positions_compared(node: Any, node_at: Any) -> tuple[int, str] | None:
    """``positions == b`` or ``positions != b`` (cross-entropy's target against the class
    positions): ``(the positions operand's place in node.srcs, the Python operator)``; None for any
    other node. ``node_at(ref)`` is ``(index, node)`` for a node's ref, else None. A writer whose
    positions fit 32 bits compares them in int32 against ``b`` narrowed once per row."""
    operator = {"eq": "==", "ne": "!="}.get(node.op)
    found = [node_at(r) for r in node.srcs] if operator else []
    at = [k for k, f in enumerate(found) if f is not None and f[1].op == "arange_like"]
    return (at[0], operator) if len(at) == 1 else None  # type: ignore[return-value]


def _arange_shape(shapes: list[tuple[int, ...]], axis: int) -> tuple[int, ...]:
    x = shapes[0]
    a = _axis(axis, len(x), "arange_like")
    return tuple(s if d == a else 1 for d, s in enumerate(x))


def _arange_ref(x: torch.Tensor, axis: int) -> torch.Tensor:
    shape = _arange_shape([tuple(x.shape)], axis)
    return torch.arange(x.shape[axis] if x.ndim else 1, device=x.device).reshape(shape)


_movement(
    "arange_like",
    1,
    _arange_ref,
    _arange_shape,
    lambda c: f"{c.out.idx[c.attrs['axis']] if c.out.idx else 0} + {c.zero}",
    lambda d: (None,),
    canonical=lambda shapes, axis: {"axis": _axis(axis, len(shapes[0]), "arange_like")},
    result_dtype=lambda dtypes, axis: torch.int64,
    shape_only=(0,),
    front=Front(fn=arange_like),
    axes=AxisRule.POSITIONS,
)
