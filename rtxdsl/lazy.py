"""The lazy stream (the seed's ``Fusion<B>``): ordinary torch code, queued, fused at sync points.

``Fusion.lazy(t)`` wraps a tensor in a :class:`LazyTensor`. Torch functions, ``F.*``,
Tensor methods and operators called on lazy tensors are *recorded* as expressions when
rtxdsl supports them (``TORCH_OPS`` below); anything else is a sync point: its lazy
inputs are materialized, the torch function runs eagerly, and its tensor results are
wrapped again. A flush compiles the pending expressions that someone still holds into one
:class:`~rtxdsl.runtime.Kernel` (cached by the segment's canonical structure, so a loop
replays its plans) and writes only those values: an intermediate nobody holds is never
written.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from . import dsl as rx
from .bind import Info, infer_all
from .config import FusionConfig, get_config
from .errors import RtxError
from .expr import Expr, node
from .runtime import Kernel
from .stats import GLOBAL_STATS, FusionStats, FusionStatsSnapshot

log = logging.getLogger("rtxdsl")
if os.environ.get("RTXDSL_LOG") in ("1", "2") and not log.handlers:
    log.addHandler(logging.StreamHandler())
    log.setLevel(logging.INFO if os.environ["RTXDSL_LOG"] == "1" else logging.DEBUG)

# ---- torch function -> expression builders ---------------------------------------------
#: builders take expressions (lazy tensors and plain tensors already converted) and torch's
#: own arguments; raising _Unsupported sends the call down the eager path instead.
TORCH_OPS: dict[Callable[..., Any], Callable[..., Expr]] = {}


class _Unsupported(Exception):
    """These arguments have no fused form (e.g. torch.sum(x, dtype=...)): run eagerly."""


def _ops(*fns: Any) -> Callable[[Callable[..., Expr]], Callable[..., Expr]]:
    def register(builder: Callable[..., Expr]) -> Callable[..., Expr]:
        for fn in fns:
            TORCH_OPS[fn] = builder
        return builder

    return register


def _names(*names: str) -> list[Any]:
    """torch.NAME, torch.Tensor.NAME and F.NAME, for those that exist."""
    out = []
    for n in names:
        for ns in (torch, torch.Tensor, F):
            if hasattr(ns, n):
                out.append(getattr(ns, n))
    return out


def _scaled(b: Any, alpha: Any) -> Any:
    return b if alpha == 1 else b * alpha


_ops(*_names("add", "__add__"))(lambda a, b, *, alpha=1: a + _scaled(b, alpha))
_ops(torch.Tensor.__radd__)(lambda a, b: b + a)
_ops(*_names("sub", "subtract", "__sub__"))(lambda a, b, *, alpha=1: a - _scaled(b, alpha))
_ops(torch.Tensor.__rsub__, torch.rsub)(lambda a, b, *, alpha=1: b - _scaled(a, alpha))
_ops(*_names("mul", "multiply", "__mul__"))(lambda a, b: a * b)
_ops(torch.Tensor.__rmul__)(lambda a, b: b * a)
_ops(torch.Tensor.__rtruediv__)(lambda a, b: b / a)
_ops(*_names("floor_divide", "__floordiv__"))(lambda a, b: a // b)
_ops(torch.Tensor.__rfloordiv__)(lambda a, b: b // a)
_ops(*_names("remainder", "__mod__"))(lambda a, b: a % b)
_ops(*_names("pow", "__pow__"))(lambda a, b: a**b)
_ops(torch.Tensor.__rpow__)(lambda a, b: b**a)
_ops(*_names("neg", "negative", "__neg__"))(lambda a: -a)
_ops(*_names("maximum"))(rx.maximum)
_ops(*_names("minimum"))(rx.minimum)
_ops(*_names("where"))(lambda c, a, b: rx.where(c, a, b))
for _cmp in ("lt", "le", "gt", "ge", "eq", "ne"):
    _ops(*_names(_cmp, f"__{_cmp}__"))((lambda n: lambda a, b: getattr(a, f"__{n}__")(b))(_cmp))
for _bit, _dunder in (("bitwise_and", "and"), ("bitwise_or", "or"), ("bitwise_xor", "xor")):
    _ops(*_names(_bit, f"__{_dunder}__"))((lambda d: lambda a, b: getattr(a, f"__{d}__")(b))(_dunder))
_ops(*_names("bitwise_not", "__invert__", "logical_not"))(lambda a: ~a)


@_ops(*_names("div", "divide", "true_divide", "__truediv__"))
def _div(a: Any, b: Any, *, rounding_mode: str | None = None) -> Expr:
    if rounding_mode is None:
        return a / b
    if rounding_mode == "floor":
        return a // b
    raise _Unsupported


for _name in rx.UNARY:  # F.silu is registered again below: it takes inplace positionally
    _ops(*_names(_name), *([torch.Tensor.__abs__] if _name == "abs" else []))(
        (lambda fn: lambda a, *, inplace=False: fn(a))(getattr(rx, _name))
    )
_ops(*_names("round"))(lambda a, *, decimals=0: rx.round(a) if decimals == 0 else _raise())
_ops(F.silu)(lambda a, inplace=False: rx.silu(a))
_ops(F.gelu)(lambda a, approximate="none": rx.gelu(a, approximate))
_ops(F.leaky_relu)(lambda a, negative_slope=0.01, inplace=False: rx.leaky_relu(a, negative_slope))
_ops(F.elu)(lambda a, alpha=1.0, inplace=False: rx.elu(a, alpha))
_ops(F.softplus)(lambda a, beta=1.0, threshold=20.0: rx.softplus(a, beta, threshold))
_ops(*_names("clamp", "clip"))(lambda a, min=None, max=None: rx.clamp(a, min, max))


@_ops(F.dropout, torch.dropout)
def _dropout(a: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Expr:
    if training and p > 0:
        raise _Unsupported  # random: runs eagerly
    return a  # evaluation mode: the identity, so it does not cut a fused segment


def _raise() -> Expr:
    raise _Unsupported


def _dim(dim: Any) -> Any:
    return tuple(dim) if isinstance(dim, (list, tuple)) else dim


def _reduction(fn: Callable[..., Expr]) -> Callable[..., Expr]:
    def build(a: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Expr:
        if dtype is not None:
            raise _Unsupported
        return fn(a, _dim(dim), keepdim)

    return build


for _name, _fn in (
    ("sum", rx.sum),
    ("mean", rx.mean),
    ("amax", rx.amax),
    ("amin", rx.amin),
    ("logsumexp", rx.logsumexp),
):
    _ops(*_names(_name))(_reduction(_fn))


def _spread(fn: Callable[..., Expr]) -> Callable[..., Expr]:
    def build(a: Any, dim: Any = None, unbiased: Any = None, keepdim: bool = False, *, correction: Any = None) -> Expr:
        if isinstance(unbiased, bool) or unbiased is None:
            corr = correction if correction is not None else (0 if unbiased is False else 1)
        else:  # torch.var(x, 0) passes dim positionally where unbiased would be
            raise _Unsupported
        return fn(a, _dim(dim), keepdim, correction=corr)

    return build


_ops(*_names("var"))(_spread(rx.variance))
_ops(*_names("std"))(_spread(rx.std))


@_ops(*_names("softmax"))
def _softmax(a: Any, dim: int | None = None, _stacklevel: int = 3, dtype: Any = None) -> Expr:
    if dim is None or dtype is not None:
        raise _Unsupported
    return rx.softmax(a, dim)


@_ops(*_names("log_softmax"))
def _log_softmax(a: Any, dim: int | None = None, _stacklevel: int = 3, dtype: Any = None) -> Expr:
    if dim is None or dtype is not None:
        raise _Unsupported
    return rx.log_softmax(a, dim)


@_ops(F.layer_norm)
def _layer_norm(a: Any, normalized_shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Expr:
    if len(tuple(normalized_shape)) != 1:
        raise _Unsupported  # rtxdsl normalizes over the last axis only
    return rx.layer_norm(a, weight, bias, eps)


@_ops(*_names("rms_norm"))
def _rms_norm(a: Any, normalized_shape: Any, weight: Any = None, eps: float | None = None) -> Expr:
    if len(tuple(normalized_shape)) != 1 or eps is None:
        raise _Unsupported  # eps=None means finfo(dtype).eps in torch: run it eagerly
    return rx.rms_norm(a, weight, eps)


def _cast_to(dtype: torch.dtype) -> Callable[..., Expr]:
    return lambda a, memory_format=None: rx.cast(a, dtype)


for _name, _dt in (
    ("float", torch.float32),
    ("half", torch.float16),
    ("bfloat16", torch.bfloat16),
    ("double", torch.float64),
    ("int", torch.int32),
    ("long", torch.int64),
    ("bool", torch.bool),
):
    _ops(getattr(torch.Tensor, _name))(_cast_to(_dt))


@_ops(torch.Tensor.to)
def _to(a: Any, *args: Any, **kwargs: Any) -> Expr:
    dtype = kwargs.pop("dtype", None)
    rest = [x for x in args if not isinstance(x, torch.dtype)]
    dtype = next((x for x in args if isinstance(x, torch.dtype)), dtype)
    if rest or kwargs or dtype is None:
        raise _Unsupported  # a device move or copy=True: a sync point
    return rx.cast(a, dtype)


#: views applied to materialized tensors without a flush
VIEWS = {
    getattr(torch.Tensor, n)
    for n in (
        "view",
        "reshape",
        "unsqueeze",
        "squeeze",
        "expand",
        "expand_as",
        "transpose",
        "permute",
        "t",
        "flatten",
        "unflatten",
        "contiguous",
        "__getitem__",
        "narrow",
        "select",
    )
}
VIEWS |= {getattr(torch, n) for n in ("reshape", "unsqueeze", "squeeze", "transpose", "permute", "t", "flatten")}

INPLACE = {
    torch.Tensor.add_: torch.Tensor.add,
    torch.Tensor.sub_: torch.Tensor.sub,
    torch.Tensor.mul_: torch.Tensor.mul,
    torch.Tensor.div_: torch.Tensor.div,
    torch.Tensor.__iadd__: torch.Tensor.add,
    torch.Tensor.__isub__: torch.Tensor.sub,
    torch.Tensor.__imul__: torch.Tensor.mul,
    torch.Tensor.__itruediv__: torch.Tensor.div,
    torch.Tensor.clamp_: torch.Tensor.clamp,
    torch.Tensor.relu_: torch.Tensor.relu,
    torch.Tensor.exp_: torch.Tensor.exp,
    torch.Tensor.neg_: torch.Tensor.neg,
    torch.Tensor.sqrt_: torch.Tensor.sqrt,
    torch.Tensor.sigmoid_: torch.Tensor.sigmoid,
    torch.Tensor.tanh_: torch.Tensor.tanh,
    torch.Tensor.pow_: torch.Tensor.pow,
}


# ---- the stream ---------------------------------------------------------------------------
class OperationStream:
    """Pending expressions of one device, the leaves they read, and the flush that runs them."""

    def __init__(self, fusion: Fusion, device: torch.device) -> None:
        self.fusion = fusion
        self.device = device
        self.info: dict[int, Info] = {}  # types of the nodes recorded since the last flush
        self.keep: list[Expr] = []  # ... kept alive while their ids are keys above
        self.leaves: dict[int, tuple[torch.Tensor, Expr]] = {}  # id(tensor) -> (tensor, var)
        self.holders: list[weakref.ref[LazyTensor]] = []
        # tensors written in place by pending values: id -> (tensor, writers in program order)
        self.homes: dict[int, tuple[torch.Tensor, list[LazyTensor]]] = {}
        self.queued = 0
        self._counter = 0

    # leaves and recording
    def leaf(self, t: torch.Tensor) -> Expr:
        home = self.homes.get(id(t))
        if home is not None and home[0] is t:  # t has a pending in-place value: read that
            return home[1][-1]._expr
        if self.homes and any(_overlaps(t, h) for h, _ in self.homes.values()):
            self.flush("read of a tensor aliased by a pending in-place write")
        hit = self.leaves.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        self._counter += 1
        v = rx.var(f"t{self._counter}")
        self.leaves[id(t)] = (t, v)
        self.info[id(v)] = Info.tensor(tuple(t.shape), t.dtype)
        self.keep.append(v)
        return v

    def record(self, expr: Expr) -> LazyTensor:
        self.keep.extend(infer_all([expr], self.info))
        self.queued += 1
        log.debug("rtxdsl: queued %s (%d pending)", expr, self.queued)
        lt = LazyTensor._pending(self, expr, self.info[id(expr)])
        self.holders.append(weakref.ref(lt))
        if self.queued >= self.fusion.config.max_queued_ops:
            self.flush(f"queue cap ({self.fusion.config.max_queued_ops} ops)")
        return lt

    def reads(self, t: torch.Tensor) -> bool:
        """Has an op recorded since the last flush read ``t``?"""
        hit = self.leaves.get(id(t))
        return hit is not None and hit[0] is t

    def write_home(self, home: torch.Tensor, writer: LazyTensor) -> None:
        """``writer``'s pending value is ``home``'s new content (an in-place op)."""
        entry = self.homes.setdefault(id(home), (home, []))
        if all(w is not writer for w in entry[1]):
            entry[1].append(writer)
        else:  # keep program order: the latest write last
            entry[1].remove(writer)
            entry[1].append(writer)

    # flushing
    def flush(self, reason: str) -> None:
        writers = [w for _, ws in self.homes.values() for w in ws]
        held = [lt for lt in (r() for r in self.holders) if lt is not None]
        live = list({id(lt): lt for lt in held + writers if lt._expr is not None}.values())
        if not live:
            self._reset()
            return
        kernel, tensors = self.fusion._plan([lt._expr for lt in live], self)
        outs = kernel(*tensors)
        outs = [outs] if not isinstance(outs, dict) else list(outs.values())
        for lt, out in zip(live, outs):
            lt._materialize(out)
        for home, ws in self.homes.values():  # in-place results land in their tensors, as in eager
            home.copy_(ws[-1]._value)
            nbytes = 2 * home.numel() * home.element_size()
            self.fusion._stats.record(1, 0, 1, nbytes, nbytes)
            for w in ws:
                w._value, w._home = home, None
        self.fusion._last = (reason, kernel, tuple(tensors))
        log.info("rtxdsl: flush (%s): %d queued ops, %d output(s)", reason, self.queued, len(live))
        self._reset()

    def _reset(self) -> None:
        self.info.clear()
        self.keep.clear()
        self.leaves.clear()
        self.holders.clear()
        self.homes.clear()
        self.queued = 0
        self._counter = 0  # leaves are named by first use within a segment


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class Fusion:
    """A lazy-execution front end: queues torch ops on :class:`LazyTensor` and fuses them at sync points.

    Example:
        >>> import torch, rtxdsl as rx
        >>> f = rx.Fusion()
        >>> a, b = f.lazy(torch.ones(4)), f.lazy(torch.full((4,), 2.0))
        >>> c = torch.relu((a + b) * a)
        >>> f.pending
        3
        >>> c.torch().tolist()
        [3.0, 3.0, 3.0, 3.0]
    """

    def __init__(self, config: FusionConfig | None = None, *, stats: FusionStats | None = None) -> None:
        if config is not None and not isinstance(config, FusionConfig):
            raise RtxError(f"Fusion(config) needs a FusionConfig, got {type(config).__name__}")
        self._config = config
        self._stats = stats or FusionStats()
        self._streams: dict[torch.device, OperationStream] = {}
        self._plans: OrderedDict[tuple, Kernel] = OrderedDict()
        self._last: tuple[str, Kernel, tuple] | None = None

    @property
    def config(self) -> FusionConfig:
        return self._config or get_config()

    def lazy(self, t: torch.Tensor) -> LazyTensor:
        """Wrap ``t``; nothing is copied and nothing runs."""
        if isinstance(t, LazyTensor):
            return t
        if not isinstance(t, torch.Tensor):
            raise RtxError(f"lazy() takes a torch.Tensor, got {type(t).__name__}")
        return LazyTensor._leaf(self.stream(t.device), t)

    def stream(self, device: torch.device) -> OperationStream:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = OperationStream(self, device)
        return s

    @property
    def pending(self) -> int:
        """Ops queued and not yet run, over every device."""
        return sum(s.queued for s in self._streams.values())

    def sync(self) -> None:
        """Run everything queued (an explicit sync point)."""
        for s in self._streams.values():
            s.flush("sync()")

    def stats(self) -> FusionStatsSnapshot:
        return self._stats.snapshot()

    def reset_stats(self) -> None:
        self._stats.reset()

    def explain(self) -> str:
        """The plan of the last flush, and why the segment closed."""
        if self._last is None:
            return "nothing flushed yet"
        reason, kernel, tensors = self._last
        return f"segment closed by: {reason}\n" + kernel.explain(*tensors)

    @property
    def plans(self) -> int:
        """Distinct segment structures planned (a steady loop stops adding to this)."""
        return len(self._plans)

    def _plan(self, roots: list[Expr], stream: OperationStream) -> tuple[Kernel, list[torch.Tensor]]:
        """The kernel for these roots, found by identity.

        Leaves are named by their order of first use in the segment and expressions are
        interned, so a loop that records the same sequence builds the very same root
        objects: the plan lookup is one dict probe, and the kernel (with its prepared
        launches) is reused without analysis. Sizes and scalar values are not in the key's
        structure beyond what the expressions hold (constants are part of an expression).
        """
        canon = tuple(roots)
        kernel = self._plans.get(canon)
        if kernel is None:
            kernel = Kernel({f"o{k}": r for k, r in enumerate(canon)}, self._config, stats=self._stats)
            self._plans[canon] = kernel
            while len(self._plans) > self.config.cache_size:
                self._plans.popitem(last=False)
        tensor_of = {id(v): t for t, v in stream.leaves.values()}
        return kernel, [tensor_of[id(v)] for v in kernel._vars]

    def _eager(self, func: Any, args: tuple, kwargs: dict, reason: str) -> Any:
        """A sync point: materialize lazy arguments, run ``func`` eagerly, wrap tensor results."""
        real_args, real_kwargs, streams = _materialize_all(args, kwargs, reason)
        out = func(*real_args, **real_kwargs)
        nbytes = sum(t.numel() * t.element_size() for t in _tensors((real_args, real_kwargs, out)))
        self._stats.record(1, 0, 1, nbytes, nbytes)
        log.debug("rtxdsl: eager %s (%s)", getattr(func, "__name__", func), reason)
        device = streams[0].device if streams else None
        return _wrap(out, self, device)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _materialize_all(args: tuple, kwargs: dict, reason: str) -> tuple[tuple, dict, list[OperationStream]]:
    streams: list[OperationStream] = []

    def real(x: Any) -> Any:
        if isinstance(x, LazyTensor):
            if all(x._stream is not s for s in streams):
                streams.append(x._stream)
            return x._real(reason)
        if isinstance(x, (list, tuple)):
            return type(x)(real(v) for v in x)
        return x

    return tuple(real(a) for a in args), {k: real(v) for k, v in kwargs.items()}, streams


def _wrap(out: Any, fusion: Fusion, device: torch.device | None) -> Any:
    if isinstance(out, torch.Tensor) and not isinstance(out, torch.nn.Parameter):
        return fusion.lazy(out)
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return tuple(_wrap(o, fusion, device) for o in out)
    if isinstance(out, list):
        return [_wrap(o, fusion, device) for o in out]
    return out


# ---- lazy tensors -------------------------------------------------------------------------
class LazyTensor:
    """A tensor whose value may still be pending in an :class:`OperationStream`.

    ``shape``, ``dtype``, ``device`` and ``ndim`` answer without running anything; data
    access (``.torch()``, ``.item()``, ``.tolist()``, ``.cpu()``, printing) is a sync point.
    """

    __slots__ = ("_stream", "_expr", "_value", "_info", "_home", "__weakref__")

    def __init__(self) -> None:
        raise RtxError("create lazy tensors with rx.lazy(tensor) or Fusion.lazy(tensor)")

    @classmethod
    def _leaf(cls, stream: OperationStream, t: torch.Tensor) -> LazyTensor:
        lt = object.__new__(cls)
        lt._stream, lt._expr, lt._value, lt._home = stream, None, t, None
        lt._info = Info.tensor(tuple(t.shape), t.dtype)
        return lt

    @classmethod
    def _pending(cls, stream: OperationStream, expr: Expr, info: Info) -> LazyTensor:
        lt = object.__new__(cls)
        lt._stream, lt._expr, lt._value, lt._info, lt._home = stream, expr, None, info, None
        return lt

    def _materialize(self, t: torch.Tensor) -> None:
        self._value, self._expr = t, None

    def _real(self, reason: str) -> torch.Tensor:
        if self._expr is not None:
            self._stream.flush(reason)
        assert self._value is not None
        return self._value

    def _as_expr(self) -> Expr:
        return self._expr if self._expr is not None else self._stream.leaf(self._value)

    # metadata without a flush
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._info.shape)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    @property
    def dtype(self) -> torch.dtype:
        return self._info.dtype

    @property
    def device(self) -> torch.device:
        return self._stream.device

    @property
    def ndim(self) -> int:
        return len(self._info.shape)

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return self._info.numel

    @property
    def is_pending(self) -> bool:
        return self._expr is not None

    # data access: sync points
    def torch(self) -> torch.Tensor:
        """The value as a plain tensor (runs whatever it still needs)."""
        return self._real("data access: .torch()")

    def item(self) -> Any:
        return self._real("data access: .item()").item()

    def tolist(self) -> Any:
        return self._real("data access: .tolist()").tolist()

    def numpy(self) -> Any:
        return self._real("data access: .numpy()").numpy()

    def cpu(self) -> torch.Tensor:
        return self._real("data access: .cpu()").cpu()

    def __repr__(self) -> str:
        return f"LazyTensor({self._real('data access: printing')!r})"

    def __bool__(self) -> bool:
        return bool(self._real("data access: bool()"))

    def __float__(self) -> float:
        return float(self._real("data access: float()"))

    def __int__(self) -> int:
        return int(self._real("data access: int()"))

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype: Any = None) -> Any:
        a = self._real("data access: numpy conversion").numpy()
        return a if dtype is None else a.astype(dtype)

    # dispatch
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        lazies = [a for a in args if isinstance(a, LazyTensor)]
        if kwargs or any(isinstance(a, (list, tuple, dict)) for a in args):  # nested or keyword tensors
            lazies = [a for a in _tensors_and_lazies((args, kwargs)) if isinstance(a, LazyTensor)]
        fusion = lazies[0]._stream.fusion
        if func in INPLACE:
            return _inplace(func, args, kwargs)
        if func in VIEWS:
            return _view(func, args, kwargs, fusion)
        builder = TORCH_OPS.get(func)
        stream = lazies[0]._stream
        mixed = len(lazies) > 1 and any(lt._stream is not stream for lt in lazies)
        if builder is None or mixed or not fusion.config.enabled:
            name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
            return fusion._eager(func, args, kwargs, f"unsupported {name}")
        try:
            expr = builder(*_exprs(args, stream), **{k: _exprs_one(v, stream) for k, v in kwargs.items()})
        except _Unsupported:
            name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
            return fusion._eager(func, args, kwargs, f"unsupported arguments of {name}")
        return stream.record(expr)

    def __getattr__(self, name: str) -> Any:
        fn = getattr(torch.Tensor, name, None)
        if fn is None or not callable(fn):
            raise AttributeError(f"LazyTensor has no attribute {name!r}")
        return lambda *args, **kwargs: LazyTensor.__torch_function__(fn, (LazyTensor,), (self, *args), kwargs)


def _tensors_and_lazies(obj: Any) -> list[Any]:
    if isinstance(obj, (LazyTensor, torch.Tensor)):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors_and_lazies(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors_and_lazies(o)]
    return []


def _exprs_one(x: Any, stream: OperationStream) -> Any:
    if isinstance(x, LazyTensor):
        return x._as_expr()
    if isinstance(x, torch.Tensor):
        if x.device != stream.device:
            raise _Unsupported
        return stream.leaf(x)
    return x


def _exprs(args: tuple, stream: OperationStream) -> list[Any]:
    return [_exprs_one(a, stream) for a in args]


def _view(func: Any, args: tuple, kwargs: dict, fusion: Fusion) -> Any:
    """Views of materialized values are free. Of a pending value, ``contiguous`` is the value
    itself (kernels write contiguous outputs) and ``unsqueeze`` is recorded; other views
    need the value first."""
    base = args[0]
    if isinstance(base, LazyTensor) and base.is_pending:
        name = func.__name__
        if name == "contiguous":
            return base
        if name == "unsqueeze":
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if isinstance(dim, int) and -base.ndim - 1 <= dim <= base.ndim:
                return base._stream.record(node("unsqueeze", base._expr, axes=(dim % (base.ndim + 1),)))
        base._real(f"view {name} of a pending value")
    real_args, real_kwargs, _ = _materialize_all(args, kwargs, "view")
    return _wrap(func(*real_args, **real_kwargs), fusion, None)


def _inplace(func: Any, args: tuple, kwargs: dict) -> Any:
    """``a.add_(b)``: ``a + b`` becomes a's pending value and, at the next flush, its tensor's content.

    A write to a tensor that pending ops read is a sync point (they run first, on the old
    content, as in eager); later reads of the tensor see the pending value; a read of
    another view of the same storage flushes first.
    """
    target = args[0]
    assert isinstance(target, LazyTensor)
    stream = target._stream
    if not target.is_pending and stream.reads(target._value):
        stream.flush("in-place write to a tensor with pending readers")
    result = LazyTensor.__torch_function__(INPLACE[func], (LazyTensor,), args, kwargs)
    if not isinstance(result, LazyTensor):
        raise RtxError(f"in-place {func.__name__} produced no tensor")
    if result.dtype != target.dtype or result.shape != target.shape:
        raise RtxError(
            f"in-place {func.__name__} cannot change {target.dtype}{list(target.shape)} into "
            f"{result.dtype}{list(result.shape)}"
        )
    home = target._home if target.is_pending else target._value
    if not result.is_pending:  # the op ran eagerly: write now
        if home is None:
            target._value = result._value
        else:
            home.copy_(result._value)
        return target
    target._expr, target._info, target._value = result._expr, result._info, None
    if home is not None:
        target._home = home
        stream.write_home(home, target)
    return target


# operators: dunders are looked up on the class, not through __getattr__
def _dunder(name: str) -> Callable[..., Any]:
    fn = getattr(torch.Tensor, name)
    return lambda self, *args: LazyTensor.__torch_function__(fn, (LazyTensor,), (self, *args))


for _d in (
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__rtruediv__",
    "__floordiv__",
    "__rfloordiv__",
    "__mod__",
    "__pow__",
    "__rpow__",
    "__neg__",
    "__abs__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__eq__",
    "__ne__",
    "__and__",
    "__or__",
    "__xor__",
    "__invert__",
    "__iadd__",
    "__isub__",
    "__imul__",
    "__itruediv__",
    "__getitem__",
    "__matmul__",
    "__rmatmul__",
):
    setattr(LazyTensor, _d, _dunder(_d))
LazyTensor.__hash__ = object.__hash__  # type: ignore[method-assign,assignment]


_default: Fusion | None = None


def default_fusion() -> Fusion:
    """The process-wide Fusion behind rx.lazy / rx.sync; its stats are rx.fusion_stats()."""
    global _default
    if _default is None:
        _default = Fusion(stats=GLOBAL_STATS)
    return _default


def lazy(t: torch.Tensor) -> LazyTensor:
    """Wrap ``t`` in the default stream.

    Example:
        >>> import torch, rtxdsl as rx
        >>> y = torch.sigmoid(rx.lazy(torch.zeros(2)) * 2)
        >>> y.torch().tolist()
        [0.5, 0.5]
    """
    return default_fusion().lazy(t)


def sync() -> None:
    """Run everything queued on the default stream."""
    default_fusion().sync()
