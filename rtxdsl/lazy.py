"""The lazy stream (the seed's ``Fusion<B>``): ordinary torch code, queued, fused at sync points.

``Fusion.lazy(t)`` wraps a tensor in a :class:`LazyTensor`. Torch functions, ``F.*``, Tensor
methods and operators called on lazy tensors are *recorded* as expressions when an op in the
registry maps them (``Front.torch``); anything else is a sync point: its lazy inputs are
materialized, the torch function runs eagerly, and its tensor results are wrapped again.

A flush compiles the pending values that someone still holds into one
:class:`~rtxdsl.runtime.Kernel` and writes only those values: an intermediate nobody holds is
never written. Plans are keyed by *structure*: leaves are named by first use in the segment
and python numbers become scalar inputs (constants 0, 1 and -1 stay constants), so a loop whose
learning rate changes every step replays one plan and compiles nothing.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .config import FusionConfig, get_config
from .dsl import var
from .errors import RtxError
from .expr import Expr, walk
from .log import log
from .lower.bind import Info, infer, infer_all
from .lru import LRU
from .ops import REGISTRY, Unsupported
from .runtime import Kernel
from .stats import GLOBAL_STATS, FusionStats, FusionStatsSnapshot

#: views applied to materialized tensors without a flush (torch makes them without copying)
VIEWS = {
    getattr(torch.Tensor, n)
    for n in (
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "unsqueeze",
        "squeeze",
        "expand",
        "expand_as",
        "transpose",
        "permute",
        "t",
        "T",
        "mT",
        "flatten",
        "unflatten",
        "contiguous",
        "__getitem__",
        "narrow",
        "select",
        "unbind",
        "split",
        "chunk",
    )
    if isinstance(getattr(torch.Tensor, n, None), Callable)
}
VIEWS |= {getattr(torch, n) for n in ("reshape", "unsqueeze", "squeeze", "transpose", "permute", "t", "flatten")}

#: python numbers that stay constants in a recorded segment (they rarely change between steps)
STRUCTURAL = frozenset(
    {("int", "0"), ("int", "1"), ("int", "-1"), ("float", "0.0"), ("float", "1.0"), ("float", "-1.0")}
)


# ---- tensors with pending in-place writes -------------------------------------------------------
#: Tensor attributes that read metadata, not data: a guarded tensor answers them without a flush
METADATA = {
    "shape", "dtype", "device", "size", "dim", "ndim", "stride", "is_contiguous", "numel", "requires_grad",
    "data_ptr", "untyped_storage", "element_size", "layout", "is_cuda", "grad_fn", "is_leaf", "names", "__len__",
    "_base", "_version",
}  # fmt: skip
_GUARDED: dict[type, type] = {}  # plain class -> its guarded subclass


def _guarded_class(base: type) -> type:
    """A subclass of ``base`` whose every torch call on a tensor flushes that tensor's pending writes."""
    cls = _GUARDED.get(base)
    if cls is None:

        def __torch_function__(cls: type, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            name = getattr(func, "__name__", "")
            if name == "__get__":  # a property (t.shape): the descriptor's name
                name = getattr(getattr(func, "__self__", None), "__name__", name)
            if name not in METADATA:
                for t in _tensors_and_lazies((args, kwargs or {})):
                    stream = _PENDING_HOMES.get(id(t))
                    if stream is not None:
                        stream.flush(f"torch.{name} on a tensor with a pending in-place write")
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

        cls = _GUARDED[base] = type(
            f"Pending{base.__name__}", (base,), {"__torch_function__": classmethod(__torch_function__)}
        )
    return cls


#: id(tensor) -> the stream whose pending in-place write will land in it
_PENDING_HOMES: dict[int, OperationStream] = {}


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
        self.cap = fusion.config.max_queued_ops  # read again at each flush
        self.epoch = 0  # flushes so far: a conversion that straddles one is redone
        self.guarded: list[tuple[torch.Tensor, type]] = []  # tensors guarded while writes are pending
        # views recorded of pending values (unsqueeze): (view, base, torch function, its other arguments)
        self.views: list[tuple[weakref.ref[LazyTensor], weakref.ref[LazyTensor], Any, tuple, dict]] = []

    # leaves and recording
    def leaf(self, t: torch.Tensor) -> Expr:
        home = self.homes.get(id(t))
        if home is not None and home[0] is t:  # t has a pending in-place value: read that
            return home[1][-1]._expr  # type: ignore[return-value]
        with torch._C.DisableTorchFunctionSubclass():
            aliased = self.overlaps_pending_write([t])
        if aliased:
            self.flush("read of a tensor aliased by a pending in-place write")
        hit = self.leaves.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        v = var(f"t{len(self.leaves) + 1}")
        self.leaves[id(t)] = (t, v)
        self.info[id(v)] = Info.tensor(tuple(t.shape), t.dtype)
        self.keep.append(v)
        return v

    def record(self, expr: Expr) -> LazyTensor:
        info = self.info
        typed = info.get(id(expr))
        if typed is None:
            srcs = []
            for s in expr.srcs:  # the common case: one new node over known operands and constants
                i = info.get(id(s))
                if i is None:
                    if s.op != "const":
                        break
                    i = Info(s.attrs[0][1])
                srcs.append(i)
            else:
                typed = info[id(expr)] = infer(expr, srcs)
                self.keep.append(expr)
            if typed is None:  # operands a builder made itself: type the whole new subtree
                infer_all([expr], info, self.keep)
                typed = info[id(expr)]
        self.queued += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("queued %s (%d pending)", expr, self.queued)
        lt = _new(LazyTensor)
        lt._stream, lt._expr, lt._value, lt._info, lt._home = self, expr, None, typed, None
        self.holders.append(weakref.ref(lt))
        if self.queued >= self.cap:
            self.flush(f"queue cap ({self.cap} ops)")
        return lt

    def reads(self, t: torch.Tensor) -> bool:
        """Has an op recorded since the last flush read ``t``?"""
        hit = self.leaves.get(id(t))
        return hit is not None and hit[0] is t

    def write_home(self, home: torch.Tensor, writer: LazyTensor) -> None:
        """``writer``'s pending value is ``home``'s new content (an in-place op).

        Until the flush, ``home``'s class is a guarded subclass: a torch call that reads or
        writes it directly (not through the stream) flushes first, so it never sees stale data.
        """
        entry = self.homes.setdefault(id(home), (home, []))
        if any(w is writer for w in entry[1]):  # keep program order: the latest write last
            entry[1].remove(writer)
        entry[1].append(writer)
        if type(home) not in (torch.Tensor, torch.nn.Parameter, *_GUARDED.values()):
            self.flush(f"in-place write to a {type(home).__name__}")  # a subclass of its own: write now
            return
        with torch._C.DisableTorchFunctionSubclass():
            base = home._base
        for t in (home, base):  # the tensor written and, for a view, the tensor it views
            if t is not None and id(t) not in _PENDING_HOMES and type(t) in (torch.Tensor, torch.nn.Parameter):
                _PENDING_HOMES[id(t)] = self
                self.guarded.append((t, type(t)))
                t.__class__ = _guarded_class(type(t))

    def _unguard(self) -> None:
        for t, cls in self.guarded:
            t.__class__ = cls
            _PENDING_HOMES.pop(id(t), None)
        self.guarded.clear()

    def overlaps_pending_write(self, tensors: list[torch.Tensor]) -> bool:
        return bool(self.homes) and any(_overlaps(t, h) for t in tensors for h, _ in self.homes.values())

    # flushing
    def flush(self, reason: str) -> None:
        self._unguard()
        writers = [w for _, ws in self.homes.values() for w in ws]
        held = [lt for lt in (r() for r in self.holders) if lt is not None]
        live = list({id(lt): lt for lt in held + writers if lt._expr is not None}.values())
        self.epoch += 1
        if not live:
            self._reset()
            return
        kernel, args = self.fusion._plan([lt._expr for lt in live], self)  # type: ignore[misc]
        outs = kernel(*args)
        outs = [outs] if not isinstance(outs, dict) else list(outs.values())
        for lt, out in zip(live, outs):
            lt._materialize(out)
        dry = kernel.config.dry_run
        for home, ws in self.homes.values():  # in-place results land in their tensors, as in eager
            if not dry:  # a dry run computed nothing: never write it into a user tensor
                home.copy_(ws[-1]._value)
                nbytes = 2 * home.numel() * home.element_size()
                self.fusion._stats.record(1, 0, 1, nbytes, nbytes)
            for w in ws:
                w._value, w._home = home, None
        self.fusion._last = (reason, kernel, tuple(args))
        log.info("flush (%s): %d queued ops, %d output(s)", reason, self.queued, len(live))
        self._reset()

    def _reset(self) -> None:
        self.info.clear()
        self.keep.clear()
        self.leaves.clear()
        self.holders.clear()
        self.homes.clear()
        self.queued = 0
        self.cap = self.fusion.config.max_queued_ops


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


#: the canonical inputs a0, a1, ...: one interned var each, built once
_ARGS: list[Expr] = []


def _arg(k: int) -> Expr:
    while len(_ARGS) <= k:
        _ARGS.append(Expr("var", (), {"name": f"a{len(_ARGS)}", "dtype": None}))
    return _ARGS[k]


def canonical(roots: tuple[Expr, ...]) -> tuple[tuple[Expr, ...], tuple[Expr, ...]]:
    """The segment's structure and the nodes that feed it: leaves renamed by first use and python
    numbers as scalar inputs (except 0, 1, -1). Interned, so the same structure gives the same
    roots; the second result lists, in argument order, the var or const node each input comes from."""
    memo: dict[int, Expr] = {}
    params: list[Expr] = []
    for n in walk(list(roots)):
        value = n.attr("value")
        if n.op == "var" or n.op == "const" and (type(value).__name__, repr(value)) not in STRUCTURAL:
            memo[id(n)] = _arg(len(params))
            params.append(n)
        elif n.srcs:
            srcs = tuple(memo[id(s)] for s in n.srcs)
            memo[id(n)] = n if all(a is b for a, b in zip(srcs, n.srcs)) else Expr(n.op, srcs, n.attr_dict)
        else:
            memo[id(n)] = n
    return tuple(memo[id(r)] for r in roots), tuple(params)


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
        self._plans: LRU[tuple[Expr, ...], Kernel] = LRU(self.config.cache_size)
        # the last few segments' recorded roots (interned: a steady loop records the same ones) -> their
        # canonical form; a loop whose constants change misses here and pays one walk per flush
        self._canon: LRU[tuple[Expr, ...], tuple[tuple[Expr, ...], tuple[Expr, ...]]] = LRU(16)
        self._last: tuple[str, Kernel, tuple] | None = None
        self.eager_ops = 0  # ops run eagerly at sync points (matmuls, attention, unsupported calls)

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
        reason, kernel, args = self._last
        return f"segment closed by: {reason}\n" + kernel.explain(*args)

    @property
    def plans(self) -> int:
        """Distinct segment structures held (a steady loop stops adding to this)."""
        return len(self._plans)

    def _plan(self, roots: list[Expr], stream: OperationStream) -> tuple[Kernel, list[Any]]:
        """The kernel for this segment's structure, and the tensors and numbers to call it with.

        Two lookups: the recorded roots themselves (a steady loop records the very same interned
        nodes), then their canonical structure (a loop whose constants change maps to one plan).
        """
        key = tuple(roots)
        hit = self._canon.get(key)
        if hit is None:
            hit = canonical(key)
            self._canon.put(key, hit)
        canon, params = hit
        tensor_of = {id(v): t for t, v in stream.leaves.values()}
        args = [tensor_of[id(p)] if p.op == "var" else p.attr("value") for p in params]
        kernel = self._plans.get(canon)
        if kernel is None:
            kernel = Kernel({f"o{k}": r for k, r in enumerate(canon)}, self._config, stats=self._stats)
            self._plans.put(canon, kernel)
        return kernel, args

    def _eager(self, func: Any, args: tuple, kwargs: dict, reason: str) -> Any:
        """A sync point: materialize lazy arguments, land pending writes they alias, run ``func``
        eagerly, wrap tensor results."""
        real_args, real_kwargs = _materialize_all(args, kwargs, reason)
        reals = [t for t in _tensors((real_args, real_kwargs))]
        for s in self._streams.values():
            with torch._C.DisableTorchFunctionSubclass():
                aliased = s.overlaps_pending_write(reals)
            if aliased:
                s.flush(f"{reason}: it reads a tensor with a pending in-place write")
        out = func(*real_args, **real_kwargs)
        self.eager_ops += 1
        nbytes = sum(t.numel() * t.element_size() for t in _tensors((real_args, real_kwargs, out)))
        self._stats.record(1, 0, 1, nbytes, nbytes)
        log.debug("eager %s (%s)", getattr(func, "__name__", func), reason)
        return _wrap(out, self)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _materialize_all(args: tuple, kwargs: dict, reason: str) -> tuple[tuple, dict]:
    def real(x: Any) -> Any:
        if isinstance(x, LazyTensor):
            return x._real(reason)
        if isinstance(x, (list, tuple)):
            return type(x)(real(v) for v in x)
        return x

    return tuple(real(a) for a in args), {k: real(v) for k, v in kwargs.items()}


def _wrap(out: Any, fusion: Fusion) -> Any:
    if isinstance(out, torch.Tensor) and not isinstance(out, torch.nn.Parameter):
        return fusion.lazy(out)
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return tuple(_wrap(o, fusion) for o in out)
    if isinstance(out, list):
        return [_wrap(o, fusion) for o in out]
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
        lt = _new(cls)
        lt._stream, lt._expr, lt._value, lt._info, lt._home = stream, expr, None, info, None
        return lt

    def _materialize(self, t: torch.Tensor) -> None:
        self._value, self._expr = t, None

    def _real(self, reason: str) -> torch.Tensor:
        if self._expr is not None:
            self._stream.flush(reason)
        elif self._stream.homes:  # a view of storage that a pending in-place write will change
            with torch._C.DisableTorchFunctionSubclass():
                aliased = self._stream.overlaps_pending_write([self._value])  # type: ignore[list-item]
            if aliased:
                self._stream.flush(f"{reason}: it aliases a pending in-place write")
        assert self._value is not None
        return self._value

    def _as_expr(self) -> Expr:
        return self._expr if self._expr is not None else self._stream.leaf(self._value)  # type: ignore[arg-type]

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

    @property
    def requires_grad(self) -> bool:
        return self._value.requires_grad if self._value is not None else False

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
        entry = _TORCH.get(func)
        if entry is not None and not kwargs and func not in VIEWS:
            # the hot path: a mapped op over lazy values (one stream) and python numbers
            stream = None
            operands = []
            for a in args:
                if type(a) is LazyTensor:
                    if stream is None:
                        stream, epoch = a._stream, a._stream.epoch
                    elif a._stream is not stream:
                        break
                    operands.append(a._expr if a._expr is not None else stream.leaf(a._value))
                elif isinstance(a, (bool, int, float)):
                    operands.append(a)
                else:
                    break
            else:  # (a conversion that flushed the stream takes the careful path below)
                if stream is not None and stream.epoch == epoch and stream.fusion.config.enabled:
                    try:
                        out = entry[1](*operands)
                    except Unsupported:
                        pass
                    else:  # an identity (eval-mode dropout) gives its operand back
                        return args[0] if out is operands[0] else stream.record(out)
        return _dispatch(func, args, kwargs or {})

    def __getattr__(self, name: str) -> Any:
        fn = getattr(torch.Tensor, name, None)
        if fn is None or not callable(fn):
            raise AttributeError(f"LazyTensor has no attribute {name!r}")
        return lambda *args, **kwargs: LazyTensor.__torch_function__(fn, (LazyTensor,), (self, *args), kwargs)


def _dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """Every call the hot path does not take: in-place ops, views, mixed operands, sync points."""
    lazies = [a for a in args if isinstance(a, LazyTensor)]
    if kwargs or any(isinstance(a, (list, tuple, dict)) for a in args):  # nested or keyword tensors
        lazies = [a for a in _tensors_and_lazies((args, kwargs)) if isinstance(a, LazyTensor)]
    stream = lazies[0]._stream
    fusion = stream.fusion
    if func in REGISTRY.inplace:
        return _inplace(func, args, kwargs)
    if func in VIEWS:
        return _view(func, args, kwargs, fusion)
    entry = REGISTRY.torch.get(func)
    builder = entry[1] if entry is not None else None
    mixed = any(lt._stream is not stream for lt in lazies)
    if builder is None or mixed or not fusion.config.enabled:
        return fusion._eager(func, args, kwargs, f"unsupported {_name(func)}")
    try:
        expr = _build(builder, args, kwargs, stream)
    except Unsupported:
        return fusion._eager(func, args, kwargs, f"unsupported arguments of {_name(func)}")
    for a in args:  # an identity (eval-mode dropout) gave its operand back
        if isinstance(a, LazyTensor) and a._expr is not None and a._expr is expr:
            return a
    return stream.record(expr)


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", getattr(func, "__name__", str(func)))


#: the registry's torch mappings, read once per call on the hot path
_TORCH = REGISTRY.torch
_new = object.__new__


def _build(builder: Callable[..., Any], args: tuple, kwargs: dict, stream: OperationStream) -> Any:
    """Operands as expressions, then the op's builder; redone if converting an operand flushed the
    stream (a read of a tensor with a pending in-place write): no operand keeps a stale leaf."""
    while True:
        epoch = stream.epoch
        exprs = [_expr_of(a, stream) for a in args]
        kw = {k: _expr_of(v, stream) for k, v in kwargs.items()}
        if stream.epoch == epoch:
            return builder(*exprs, **kw)


def _tensors_and_lazies(obj: Any) -> list[Any]:
    if isinstance(obj, (LazyTensor, torch.Tensor)):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors_and_lazies(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors_and_lazies(o)]
    return []


def _expr_of(x: Any, stream: OperationStream) -> Any:
    if isinstance(x, LazyTensor):
        return x._as_expr()
    if isinstance(x, torch.Tensor):
        if x.device != stream.device:
            raise Unsupported
        return stream.leaf(x)
    if isinstance(x, (list, tuple)) and any(isinstance(v, (LazyTensor, torch.Tensor)) for v in x):
        return type(x)(_expr_of(v, stream) for v in x)
    return x


def _view(func: Any, args: tuple, kwargs: dict, fusion: Fusion) -> Any:
    """Views of materialized values are free. Of a pending value, ``contiguous`` is the value
    itself (kernels write contiguous outputs), ``unsqueeze`` is recorded; other views (slices,
    ``narrow``, ``chunk``) need the value first, so they alias it as in eager torch."""
    base = args[0]
    if isinstance(base, LazyTensor) and base.is_pending:
        name = getattr(func, "__name__", "")
        if name == "contiguous":
            return base
        entry = REGISTRY.torch.get(func)
        # only views that insert size-1 dims are recorded: any other recorded view (a slice) would
        # be a copy, and a later in-place write to its base or to it would not reach the other
        if entry is not None and entry[0].view:
            try:
                view = base._stream.record(_build(entry[1], args, kwargs, base._stream))
            except Unsupported:
                pass
            else:  # an in-place write to either later makes it a real view of the other first
                base._stream.views.append((weakref.ref(view), weakref.ref(base), func, args[1:], kwargs))
                return view
        base._real(f"view {name} of a pending value")
    real_args, real_kwargs = _materialize_all(args, kwargs, "view")
    return _wrap(func(*real_args, **real_kwargs), fusion)


def _realize_views(stream: OperationStream) -> None:
    """Before an in-place write to a viewed value (or to a recorded view): flush, then make every
    recorded view a real view of its base's tensor, so the write reaches both, as in eager."""
    stream.flush("in-place write to a value with recorded views")
    entries, stream.views = stream.views, []
    for view_ref, base_ref, func, rest, kwargs in entries:
        view, base = view_ref(), base_ref()
        if view is None or base is None or base._value is None:
            continue
        with torch._C.DisableTorchFunctionSubclass():
            view._value = func(base._value, *rest, **kwargs)
        view._expr = None


def _out_of_place(func: Any) -> Any:
    """``Tensor.add_`` -> ``Tensor.add``; ``Tensor.__iadd__`` -> ``Tensor.__add__``."""
    name = func.__name__
    plain = f"__{name[3:]}" if name.startswith("__i") else name[:-1]
    return getattr(torch.Tensor, plain)


def _inplace(func: Any, args: tuple, kwargs: dict) -> Any:
    """``a.add_(b)``: ``a + b`` becomes a's pending value and, at the next flush, its tensor's content.

    A write to a tensor that pending ops read is a sync point (they run first, on the old
    content, as in eager); later reads of the tensor see the pending value; a read of
    another view of the same storage flushes first.
    """
    target = args[0]
    assert isinstance(target, LazyTensor)
    stream = target._stream
    if any(target is r() for v, b, *_ in stream.views for r in (v, b)):
        _realize_views(stream)
    if not target.is_pending and stream.reads(target._value):  # type: ignore[arg-type]
        stream.flush("in-place write to a tensor with pending readers")
    result = LazyTensor.__torch_function__(_out_of_place(func), (LazyTensor,), args, kwargs)
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
            home.copy_(result._value)  # type: ignore[arg-type]
        return target
    target._expr, target._info, target._value = result._expr, result._info, None
    if home is not None:
        target._home = home
        stream.write_home(home, target)
    return target


# operators: dunders are looked up on the class, not through __getattr__
def _dunder(name: str) -> Callable[..., Any]:
    fn = getattr(torch.Tensor, name)
    dispatch = LazyTensor.__torch_function__
    return lambda self, *args: dispatch(fn, _TYPES, (self, *args))


_TYPES = (LazyTensor,)


for _d in (
    *(f"__{n}__" for n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "matmul")),
    *(f"__r{n}__" for n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "matmul")),
    *(f"__i{n}__" for n in ("add", "sub", "mul", "truediv", "pow", "and", "or", "xor")),
    *(f"__{n}__" for n in ("neg", "abs", "invert", "lt", "le", "gt", "ge", "eq", "ne", "getitem")),
):
    if hasattr(torch.Tensor, _d):
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


__all__ = ["Fusion", "LazyTensor", "OperationStream", "canonical", "default_fusion", "lazy", "sync"]
