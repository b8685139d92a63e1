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

**Aliasing model** (eager-exact). A lazy value is *materialized* (a real tensor, possibly a view
of another) or *pending*: an expression whose value a flush writes into a fresh buffer, or into
a real tensor (its *home*) for an in-place write. A pending value never shares memory with a
real tensor, except through its home. Views of a pending value are recorded as *aliases*: they
keep their root value and the torch view calls from it; reads use the recorded expression, and
the flush makes them real views of the root's buffer, so they alias it as in eager. Ops that
return ``self`` in eager (``float()`` of a float, ``contiguous()`` of a contiguous value,
identity dropout) return the same lazy tensor; ops that copy in eager give a value of its own.
Writes: an in-place op the registry computes on a value that nothing else aliases is recorded
(it becomes the value's pending content); any other write (unrecorded ops, item assignment,
``out=``, a write to a value with views, a partly overlapping operand) is a sync point: the
stream flushes, torch runs the write on the real tensors. Plain tensors the stream reads or will
write are *guarded* (their class is swapped for a subclass until the flush): a plain torch write
to one, or a view of it, flushes first, and so does any plain access to a tensor with a pending
write. Eager strides are tracked for values made from non-contiguous inputs (on meta tensors),
so ``contiguous()``, ``reshape`` and friends copy exactly when eager copies. A plain tensor that
a tensor the stream never saw also holds (a view made before it was read) is read as a copy: a
write through that view cannot change what pending ops read.

**Autograd** as in eager: a pending value knows whether it requires grad (``requires_grad``,
``grad_fn is None`` and ``is_leaf`` answer without a flush); leaves read under ``no_grad`` or
through ``detach`` are read as detached aliases, so no gradient flows where eager's does not; a
flush runs its kernel with gradients where a value needs them. A kernel saves only the inputs its
backward reads, and what it saved is copied before the stream writes that memory (eager's ops
save their results, or a copy of what they overwrite, where rtxdsl's backward recomputes); a
plain input that requires no grad stays guarded while its saved value lives, so an eager write to
it after the flush copies the value too, and so does one that requires grad where every op that
read it is one whose eager backward saves none of its values (``torchsem.saves``: ``where``, ``+``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import torchsem
from .config import FusionConfig, get_config
from .dsl import var
from .dtypes import SHORT_NAME, check_dense
from .errors import RtxError, ZeroDivisorError
from .expr import BINARY_OPERATORS, COMPARISONS, UNARY_OPERATORS, Expr, as_expr, substitute, walk
from .log import log
from .lower.bind import Info, infer, infer_all
from .lru import LRU
from .ops import REGISTRY, Unsupported
from .ops.movement import permute
from .runtime import Kernel
from .stats import FusionStats, FusionStatsSnapshot

#: python numbers that stay constants in a recorded segment (they rarely change between steps)
STRUCTURAL = frozenset(
    {("int", "0"), ("int", "1"), ("int", "-1"), ("float", "0.0"), ("float", "1.0"), ("float", "-1.0")}
)


# ---- guarded plain tensors ----------------------------------------------------------------------
def _version_of(t: torch.Tensor) -> int:
    """``t``'s version counter; -1 for an inference tensor (``torch.inference_mode``), which keeps none
    and cannot be written outside inference mode."""
    try:
        return t._version
    except RuntimeError:
        return -1


#: Tensor attributes that read metadata, not data: a guarded tensor answers them without a flush
METADATA = {
    "shape", "dtype", "device", "size", "dim", "ndim", "stride", "is_contiguous", "numel", "requires_grad",
    "data_ptr", "untyped_storage", "element_size", "layout", "is_cuda", "grad_fn", "is_leaf", "names", "__len__",
    "_base", "_version", "storage_offset", "is_floating_point", "is_complex", "__hash__", "__eq__",
}  # fmt: skip
READ, WRITE = 1, 2  # guard levels: pending ops read the tensor / a pending write will land in it
_GUARDED: dict[type, type] = {}  # plain class -> its guarded subclass
#: id(tensor) -> (stream, level) while guarded; (its failure, WRITE) while a failed flush left it undefined
_GUARDS: dict[int, tuple[OperationStream | _Failed, int]] = {}
#: writes that replace every element without reading one: they make an undefined tensor usable again
_OVERWRITES = frozenset({torch.Tensor.copy_, torch.Tensor.fill_, torch.Tensor.zero_})


class _Failed:
    """What is left of a flush that raised. The values it was to compute take it as their stream,
    and a user tensor it had begun writing in place is guarded by it: any use but metadata (a
    stream attribute, a torch call on the tensor) raises an ``RtxError`` saying so."""

    __slots__ = ("device", "message")

    def __init__(self, device: torch.device, message: str) -> None:
        self.device, self.message = device, message

    def __getattr__(self, name: str) -> Any:  # (slots are found first: device and message answer)
        raise RtxError(self.message)


def _poison(t: torch.Tensor, message: str) -> bool:
    """``t`` may hold part of what a failed flush wrote: guarded so that every torch call on it but
    metadata and a whole overwrite (``_OVERWRITES``) raises ``message``. False where its class
    cannot be guarded (a tensor subclass of its own)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return False
    failed = _Failed(t.device, message)
    _GUARDS[id(t)] = (failed, WRITE)
    t.__class__ = _guarded_class(type(t))
    weakref.finalize(t, _forget_failure, id(t), failed)  # (its id may be reused once it is gone)
    return True


def _forget_failure(key: int, failed: _Failed) -> None:
    held = _GUARDS.get(key)
    if held is not None and held[0] is failed:
        del _GUARDS[key]


def _failed_call(func: Any, args: tuple, t: torch.Tensor, failed: _Failed) -> None:
    """A torch call on a tensor a failed flush left undefined: a whole overwrite of it makes it
    plain again; anything else raises."""
    if func not in _OVERWRITES or not args or args[0] is not t:
        raise RtxError(failed.message)
    _forget_failure(id(t), failed)
    with torch._C.DisableTorchFunctionSubclass():
        t.__class__ = t.__class__.__bases__[0]


def _guarded_class(base: type) -> type:
    """A subclass of ``base`` whose torch calls flush the stream that guards the tensor first:
    any call but metadata for a pending write, writes and views for a pending read."""
    cls = _GUARDED.get(base)
    if cls is None:

        def __torch_function__(cls: type, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            found = _tensors_and_lazies((args, kwargs))
            if any(isinstance(t, LazyTensor) for t in found):
                return NotImplemented  # the lazy tensor's handler takes the call
            name = getattr(func, "__name__", "")
            if name == "__get__":  # a property (t.shape): the descriptor's name
                name = getattr(getattr(func, "__self__", None), "__name__", name)
            # a view's guarding streams, taken before a flush below unguards everything
            views = func in torchsem.VIEWS
            streams = {id(g[0]): g[0] for t in found if (g := _GUARDS.get(id(t))) is not None} if views else {}
            if name not in METADATA:
                write = torchsem.writes(func, kwargs)
                level = READ if write or func in torchsem.VIEWS else WRITE
                for t in found:
                    guard = _GUARDS.get(id(t))
                    if guard is not None and guard[1] >= level:
                        if type(guard[0]) is _Failed:
                            _failed_call(func, args, t, guard[0])
                        else:
                            guard[0].flush(f"torch.{name} on a plain tensor the stream reads or writes")
                if write:  # what a flushed kernel saved from its memory is copied first
                    _before_write((args[:1], kwargs.get("out")))
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
                if streams:  # a new alias of a guarded tensor: guarded with it from now on
                    for r in _tensors(out):
                        for stream in streams.values():
                            stream.fusion._remember(r)
                            for t in found:
                                stream.fusion._remember(t)
                if views and _KEEPERS:  # a view of memory a kernel saved from: a write through it copies first
                    _keep_saved(list(_tensors(out)))
            return out

        cls = _GUARDED[base] = type(
            f"Pending{base.__name__}", (base,), {"__torch_function__": classmethod(__torch_function__)}
        )
    return cls


# ---- values saved for backward, copied before the stream writes their memory ----------------------
class _Saved:
    """A tensor that a kernel the stream ran saved for its backward (through ``saved_tensors_hooks``).

    rtxdsl's backward recomputes from a kernel's inputs where eager's ops save their results
    (``sigmoid``, ``exp``, the ``silu`` after an ``o += ...``) or a copy of the original they overwrite
    (``mul_``): a later in-place write to such an input is no error in eager. So before the stream
    writes a saved tensor's memory (an in-place result landing, an eager write) the saved value is
    copied, and the backward reads what the forward read. A plain input that does not require
    grad (a mask, a buffer) stays guarded while a value saved from it lives (``_keep_saved``), so
    an eager write after the flush copies it too. A write the stream never sees (to a value that
    requires grad, written after the flush) still fails at the backward, with autograd's own error."""

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.version = t, _version_of(t)


#: storage -> the values saved from it by the stream's kernels (alive while autograd holds them)
_SAVED: dict[tuple[torch.device, int], list[weakref.ref[_Saved]]] = {}
#: storage -> the plain tensors over it that a kernel read and saved, kept guarded (their class
#: swapped, as a stream's guard does) while a saved value of that storage lives, so that an eager
#: write to one, made after the flush where no stream sees it, copies the saved values first
_KEEPERS: dict[tuple[torch.device, int], list[weakref.ref[torch.Tensor]]] = {}


def _packer(args: list[Any], fusion: Fusion, unsaved: frozenset[int]) -> Callable[[torch.Tensor], _Saved]:
    """The pack hook of a kernel call reading ``args``: it saves each tensor in a ``_Saved``
    cell, and keeps guarded the plain tensors the user holds over a saved argument's memory
    (the argument, the tensor it views, the fusion's other wrappers of it): eager's ``where``,
    ``relu`` or ``sigmoid`` save a mask or their result where rtxdsl's backward recomputes from
    such an input, so a write to it before the backward is no error in eager (a plain ``p.zero_()``
    after ``torch.where(x > p, x, p)`` was flushed raised autograd's version error; lazy fuzzer
    program 2026131100010). Values that require grad are kept where every recorded op that read
    them is one whose eager backward saves none of its values (``unsaved``, the ids of such
    arguments: ``where(p > x, p, x)``, ``p + x``; program 2027700900073); the others, and parameters,
    are not: eager saves those itself, and a weight written between forward and backward fails
    there too."""
    plain = [
        a
        for a in args
        if type(a) in (torch.Tensor, _GUARDED.get(torch.Tensor)) and (not a.requires_grad or id(a) in unsaved)
    ]

    def pack(t: torch.Tensor) -> _Saved:
        with torch._C.DisableTorchFunctionSubclass():
            cell = _Saved(t)
            key = _storage_key(t)
            users = [x for a in plain if _storage_key(a) == key for x in (a, a._base, *fusion._aliases(a))]
        refs = _SAVED.setdefault(key, [])
        refs.append(weakref.ref(cell, lambda _, key=key: _release(key)))
        if len(refs) > 16 or len(_SAVED) > 1024:  # drop what autograd freed
            for k in [k for k, rs in _SAVED.items() if not any(r() is not None for r in rs)]:
                del _SAVED[k]
        _keep_saved([x for x in users if x is not None])
        return cell

    return pack


def _keep_saved(tensors: list[torch.Tensor]) -> None:
    """Guard ``tensors`` (plain ones over memory a live saved value was taken from) until that
    value is freed or copied: their writes run ``_before_write``, their views are kept so too."""
    for x in tensors:
        key = _storage_key(x)
        if key not in _SAVED or type(x) is not torch.Tensor:
            continue
        keepers = _KEEPERS.setdefault(key, [])
        if not any(r() is x for r in keepers):
            keepers.append(weakref.ref(x))
            x.__class__ = _guarded_class(torch.Tensor)


def _release(key: tuple[torch.device, int]) -> None:
    """No live value saved from ``key``'s memory is left uncopied: its kept tensors are plain again
    (those a stream guards now are made plain by the stream's own unguard)."""
    if any((c := r()) is not None and _storage_key(c.tensor) == key for r in _SAVED.get(key, ())):
        return
    for x in (r() for r in _KEEPERS.pop(key, ())):
        if x is not None and id(x) not in _GUARDS and type(x) is _GUARDED.get(torch.Tensor):
            x.__class__ = torch.Tensor


def _unpack(cell: _Saved) -> torch.Tensor:
    t = cell.tensor
    with torch._C.DisableTorchFunctionSubclass():
        if _version_of(t) != cell.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{t.type()} {list(t.shape)}] is at version {_version_of(t)}; expected version "
                f"{cell.version} instead (a write the lazy stream never saw: made after the flush that read it)"
            )
    return t


_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _saved_hooks(tensors: list[Any], fusion: Fusion, unsaved: frozenset[int]) -> Any:
    """The hooks a kernel call of the stream runs under when it records a backward (none under
    a caller's own saved-tensor hooks, which keep theirs)."""
    grads = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
    if not grads or _TOP_HOOKS is None or _TOP_HOOKS(False) is not None:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_packer(tensors, fusion, unsaved), _unpack)


def _call(kernel: Kernel, args: list[Any], grad: bool, fusion: Fusion, unsaved: frozenset[int] = frozenset()) -> Any:
    """A flush's kernel call, with autograd as when its ops were recorded: a graph where a value
    requires grad (whatever the mode at the flush), none where none does. ``unsaved``: the ids
    of the arguments that require grad but that no eager op reading them saves (see ``_packer``)."""
    if grad:
        with torch.enable_grad(), _saved_hooks(args, fusion, unsaved):
            return kernel(*args)
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        with torch.no_grad():
            return kernel(*args)
    return kernel(*args)


def _before_write(tensors: Any) -> None:
    """The stream is about to write these tensors' memory: values saved from it are copied first."""
    if not _SAVED:
        return
    for t in _tensors(tensors):
        key = _storage_key(t)
        refs = _SAVED.pop(key, None)
        for cell in (r() for r in refs or ()):
            if cell is None:
                continue
            with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
                if _version_of(cell.tensor) == cell.version:  # (one already stale stays so: it raises)
                    cell.tensor = cell.tensor.detach().clone()
                    cell.version = _version_of(cell.tensor)
        if refs:
            _release(key)


def _storage_key(t: torch.Tensor) -> tuple[torch.device, int]:
    with torch._C.DisableTorchFunctionSubclass():
        return t.device, t.untyped_storage().data_ptr()


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _holders(t: torch.Tensor) -> tuple[tuple[torch.device, int], int]:
    """``t``'s storage key and how many tensors hold that memory (1: ``t`` alone; torch's count
    includes the probe's own reference; 1 where torch cannot count)."""
    with torch._C.DisableTorchFunctionSubclass():
        storage = t.untyped_storage()
        key = t.device, storage.data_ptr()
    return key, 1 if _USE_COUNT is None else _USE_COUNT(storage._cdata) - 1


def _saved_results(tensors: tuple[torch.Tensor | None, ...], key: tuple[torch.device, int], known: set[int]) -> int:
    """How many holders of memory ``key`` autograd keeps for the backward of the ops that made
    ``tensors`` (an op's saved result, ``sigmoid``'s or attention's: a tensor of autograd's own,
    which no user code writes)."""
    n = 0
    with torch._C.DisableTorchFunctionSubclass():
        nodes = (_grad_fn(x) for x in tensors if x is not None)
        for node in {id(fn): fn for fn in nodes if fn is not None}.values():
            for name in dir(node):
                if not name.startswith("_saved_"):
                    continue
                try:
                    value = getattr(node, name)
                except RuntimeError:  # freed by a backward already
                    continue
                for v in value if isinstance(value, (list, tuple)) else (value,):
                    n += isinstance(v, torch.Tensor) and id(v) not in known and _storage_key(v) == key
    return n


def _contiguous_strides(t: torch.Tensor) -> tuple[int, ...] | None:
    """None for a contiguous tensor, else its strides (the eager layout a lazy value tracks)."""
    with torch._C.DisableTorchFunctionSubclass():
        return None if t.is_contiguous() else tuple(t.stride())


def _memory_order(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...] | None:
    """The dims in memory order (outermost first) when ``strides`` lay ``shape`` out densely
    (a permuted contiguous tensor, as eager's elementwise results of transposed inputs are):
    ``torch.empty(permuted shape).permute(inverse)`` has exactly these strides. None otherwise."""
    perm = tuple(sorted(range(len(shape)), key=lambda d: -strides[d]))
    expect, step = [0] * len(shape), 1
    for d in reversed(perm):
        expect[d], step = step, step * shape[d]
    return perm if tuple(expect) == strides else None


# ---- the stream ---------------------------------------------------------------------------
class OperationStream:
    """Pending expressions of one device, the leaves they read, and the flush that runs them."""

    def __init__(self, fusion: Fusion, device: torch.device) -> None:
        self.fusion = fusion
        self.device = device
        self.on_cpu = device.type == "cpu"  # (numbers meet half tensors as CPU eager's: scalars_as_cpu_eager)
        self.info: dict[Expr, Info] = {}  # types of the nodes recorded since the last flush
        self.leaves: dict[int, tuple[torch.Tensor, Expr]] = {}  # id(tensor) -> (tensor, var)
        # leaves read without gradient (no_grad, detach): id(tensor) -> (its detached alias, var)
        self.detached: dict[int, tuple[torch.Tensor, Expr]] = {}
        self.stops: dict[Expr, Expr] = {}  # expr -> the expression read without gradient
        # plain tensors another tensor the stream never saw aliases, read as a copy:
        # id(tensor) -> (tensor, its version when copied, var, copy)
        self.snapshots: dict[int, tuple[torch.Tensor, int, Expr, torch.Tensor]] = {}
        # ids of the tensors the segment holds (its leaves, their detached aliases), by storage
        self.on_storage: dict[tuple[torch.device, int], set[int]] = {}
        self.grad_vars: set[Expr] = set()  # the leaf variables whose tensor requires grad
        #: grad leaves -> True while every op that read it is one whose eager backward saves none
        #: of its values (``torchsem.saves``): rtxdsl's may save it, so it is copied before a write
        self.unsaved: dict[Expr, bool] = {}
        #: leaf variables whose tensor autograd refuses to differentiate through (a view of a
        #: multi-output op written in place): the error eager raises where a differentiable op reads it
        self.refused: dict[Expr, RuntimeError] = {}
        self.unprobed: set[Expr] = set()  # leaf variables of tensors that require grad, made under no_grad
        self.versions: dict[int, int] = {}  # id(tensor) -> its version counter when first read
        self.read_storages: set[tuple[torch.device, int]] = set()  # storages the leaves live in
        self.holders: list[weakref.ref[LazyTensor]] = []
        # tensors written in place by pending values: id -> (tensor, writers in program order)
        self.homes: dict[int, tuple[torch.Tensor, list[LazyTensor]]] = {}
        self.queued = 0
        self.cap = fusion.config.max_queued_ops  # read again at each flush
        self.epoch = 0  # flushes so far: a conversion that straddles one is redone
        self.guarded: list[tuple[torch.Tensor, type]] = []  # plain tensors guarded until the flush
        self.views: list[weakref.ref[LazyTensor]] = []  # recorded views of pending values

    # leaves and recording
    def leaf(self, t: torch.Tensor, read_by: tuple[Any, tuple, int] | None = None) -> Expr:
        """``t``'s variable in the segment; ``read_by``: the torch call reading it, ``(func, args,
        position)``, asked (for a tensor that requires grad only) whether eager's backward of it
        saves ``t`` (``torchsem.saves``; see ``_packer``); None: taken to save it."""
        v = self.read_leaf(t)
        if v in self.grad_vars:
            saved = read_by is None or torchsem.saves(*read_by)
            self.unsaved[v] = not saved and self.unsaved.get(v, True)
        return v

    def read_leaf(self, t: torch.Tensor) -> Expr:
        home = self.homes.get(id(t))
        if home is not None and home[0] is t:  # t has a pending in-place value: read that
            writer = home[1][-1]
            if writer._grad or not t.requires_grad or not torch.is_grad_enabled():
                return writer._expr  # type: ignore[return-value]
            # written under no_grad, read with gradients: the tensor itself (its history, the new values)
            self.flush("a read with gradients of a tensor written under no_grad")
        with torch._C.DisableTorchFunctionSubclass():
            aliased = self.overlaps_pending_write([t])
        if aliased:
            self.flush("read of a tensor aliased by a pending in-place write")
        hit = self.leaves.get(id(t))
        if hit is not None and hit[0] is t:
            if hit[1] not in self.unprobed or not torch.is_grad_enabled():
                return hit[1]
            return self.probed(t, hit[1])  # first read with gradients of a leaf made under no_grad
        snap = self.snapshots.get(id(t))
        if snap is not None and snap[0] is t and snap[1] == _version_of(t):
            if snap[3].requires_grad or not (t.requires_grad and torch.is_grad_enabled()):
                return snap[2]
        if _GUARDS:
            held = _GUARDS.get(id(t))
            if held is not None and type(held[0]) is _Failed:  # left undefined by a failed flush
                raise RtxError(held[0].message)
        with torch._C.DisableTorchFunctionSubclass():  # (metadata of a guarded tensor, without its dispatch)
            grad = t.requires_grad  # (a guarded tensor's requires_grad_() flushes first: fixed until then)
            refused = _refusal(t) if grad and torch.is_grad_enabled() else None
            key, holders = _holders(t)
            if holders > 1 and self.unseen_alias(t, key, holders):
                return self.snapshot(t, refused)
            if refused is None:
                v = self.new_leaf(t, grad)
                if grad and not torch.is_grad_enabled():
                    self.unprobed.add(v)
            else:  # read detached: no kernel's autograd may reach it (a non-differentiable read is fine)
                v = self.detached_leaf(t)
                self.refused[v] = refused
            self.versions[id(t)] = _version_of(t)  # a write the guards cannot see still bumps it
        self.read_storages.add(key)
        self.on_storage.setdefault(key, set()).add(id(t))
        self.guard(t, READ)
        return v

    def probed(self, t: torch.Tensor, v: Expr) -> Expr:
        """Leaf ``v`` of ``t``, made under ``no_grad``, read with gradients: autograd's checks of ``t``
        now (see ``leaf``); a tensor it refuses is read detached from here on."""
        self.unprobed.discard(v)
        with torch._C.DisableTorchFunctionSubclass():
            refused = _refusal(t)
        if refused is None:
            return v
        del self.leaves[id(t)]  # (read under no_grad, it was read through its detached alias)
        detached = self.detached_leaf(t)
        self.refused[detached] = refused
        return detached

    def new_leaf(self, t: torch.Tensor, grad: bool) -> Expr:
        v = var(f"t{len(self.leaves) + len(self.detached) + 1}")
        self.leaves[id(t)] = (t, v)
        if grad:
            self.grad_vars.add(v)
        self.info[v] = Info.tensor(tuple(t.shape), t.dtype)
        return v

    def unseen_alias(self, t: torch.Tensor, key: tuple[torch.device, int], holders: int) -> bool:
        """Does a tensor the stream never saw hold ``t``'s memory (a plain view made before ``t`` was
        read or wrapped)? The guards cannot see a write through it. Seen: ``t``, the tensor it views,
        the tensors the fusion wrapped or made, and those the segment reads."""
        with torch._C.DisableTorchFunctionSubclass():
            base = t._base
        known = {id(t), *self.on_storage.get(key, ()), *(id(x) for x in self.fusion._aliases(t))}
        if base is not None:
            known.add(id(base))
        return holders > len(known) and holders > len(known) + _saved_results((t, base), key, known)

    def snapshot(self, t: torch.Tensor, refused: RuntimeError | None = None) -> Expr:
        """A copy of ``t`` that the segment reads in its place, as eager reads it now: a write
        through a view the stream never saw (see ``unseen_alias``) cannot change it. Read again
        after such a write (its version moved), ``t`` is copied again. A tensor autograd refuses
        (``refused``, see ``leaf``) is copied detached, and its copy refused likewise."""
        with torch._C.DisableTorchFunctionSubclass():
            copy = t.clone() if refused is None else t.detach().clone()  # (differentiable: a gradient reaches t)
        v = self.new_leaf(copy, copy.requires_grad)
        if refused is not None:
            self.refused[v] = refused
        self.versions[id(copy)] = _version_of(copy)
        self.snapshots[id(t)] = (t, _version_of(t), v, copy)
        self._copy_record(copy, eager=False)
        return v

    def stopped(self, e: Expr) -> Expr:
        """``e`` read without gradient (under ``no_grad``, through ``detach``): each leaf that requires
        grad read as its detached alias (the same memory, no autograd history), as eager reads it."""
        hit = self.stops.get(e)
        if hit is not None:
            return hit
        of = {v: t for t, v in self.leaves.values()}

        def detached(n: Expr) -> Expr | None:
            t = of.get(n) if n.is_var else None
            return self.detached_leaf(t) if t is not None and t.requires_grad else None

        (out,) = substitute([e], detached)
        self.stops[e] = out
        return out

    def detached_leaf(self, t: torch.Tensor) -> Expr:
        hit = self.detached.get(id(t))
        if hit is not None:
            return hit[1]
        with torch._C.DisableTorchFunctionSubclass():
            alias = t.detach()
        self.on_storage.setdefault(_storage_key(alias), set()).add(id(alias))
        v = var(f"t{len(self.leaves) + len(self.detached) + 1}")
        self.detached[id(t)] = (alias, v)
        self.info[v] = Info.tensor(tuple(t.shape), t.dtype)
        return v

    def tensor_of(self) -> dict[Expr, torch.Tensor]:
        """The tensor each leaf variable reads."""
        out = {v: t for t, v in self.leaves.values()}
        out.update((v, t) for t, v in self.detached.values())
        return out

    def record(self, expr: Expr, grad: bool = False) -> LazyTensor:
        """A pending value computing ``expr``; ``grad``: an operand requires grad (the value does as
        in eager: with grad enabled, floating point, and reading an operand's values)."""
        info = self.info
        typed = info.get(expr)
        if typed is None:
            srcs = []
            for s in expr.srcs:  # the common case: one new node over known operands and constants
                i = info.get(s)
                if i is None:
                    if not s.is_const:
                        break
                    i = Info(s.attrs[0][1])
                srcs.append(i)
            else:
                typed = info[expr] = infer(expr, srcs)
            if typed is None:  # operands a builder made itself: type the whole new subtree
                infer_all([expr], info, [])
                typed = info[expr]
        self.queued += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("queued %s (%d pending)", expr, self.queued)
        lt = _new(LazyTensor)
        lt._stream, lt._expr, lt._value, lt._info, lt._home = self, expr, None, typed, None
        lt._base, lt._chain, lt._strides = None, (), None
        if grad:
            grad = typed.dtype in _FLOATS and torch.is_grad_enabled() and (_READS.get(expr.op) or _reads_values(expr))
        if self.refused and torch.is_grad_enabled() and typed.dtype in _FLOATS and _reads_values(expr):
            refused = next((self.refused[n] for n in self.differentiable(expr) if n in self.refused), None)
            if refused is not None:  # eager's differentiable op raises it here
                raise RuntimeError(str(refused))
        lt._grad = grad
        self.holders.append(weakref.ref(lt))
        if self.queued == self.cap:  # flushed once the call recording it is done (see _over_cap)
            _OVER.append(self)
        return lt

    def differentiable(self, expr: Expr) -> list[Expr]:
        """The nodes of ``expr`` a gradient of it reaches: through floating-point values only (a
        compare, an integer cast or an index cuts the path, as eager's autograd records no
        gradient through them: ``where(v > 0, a, b)`` reads ``v`` without differentiating it)."""
        out, seen, stack = [], set(), [expr]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            out.append(n)
            info = self.info.get(n)
            if info is None or info.dtype in _FLOATS:
                stack.extend(n.srcs)
        return out

    def reads(self, t: torch.Tensor) -> bool:
        """Does an op recorded since the last flush read ``t``'s memory (``t`` or an alias of it)?"""
        return bool(self.read_storages) and _storage_key(t) in self.read_storages

    def guard(self, t: torch.Tensor, level: int) -> None:
        """Swap the class of ``t``, of the tensor it views and of every tensor the fusion wrapped
        over the same memory, so plain torch calls on them flush first (see ``_guarded_class``)."""
        with torch._C.DisableTorchFunctionSubclass():
            base = t._base
        for x in (t, base, *self.fusion._aliases(t)):
            if x is None:
                continue
            held = _GUARDS.get(id(x))
            if held is not None:
                if held[0] is self and held[1] < level:
                    _GUARDS[id(x)] = (self, level)
                continue
            if type(x) in (torch.Tensor, torch.nn.Parameter):
                _GUARDS[id(x)] = (self, level)
                self.guarded.append((x, type(x)))
                x.__class__ = _guarded_class(type(x))
            elif type(x) is _GUARDED.get(torch.Tensor):  # kept for a saved value (_keep_saved): its class stays
                _GUARDS[id(x)] = (self, level)
                self.guarded.append((x, None))

    def write_home(self, home: torch.Tensor, writer: LazyTensor) -> None:
        """``writer``'s pending value is ``home``'s new content (an in-place op).

        Until the flush, ``home`` and every tensor known to alias it are guarded: a torch call
        that reads or writes one directly (not through the stream) flushes first.
        """
        entry = self.homes.setdefault(id(home), (home, []))
        if any(w is writer for w in entry[1]):  # keep program order: the latest write last
            entry[1].remove(writer)
        entry[1].append(writer)
        if type(home) not in (torch.Tensor, torch.nn.Parameter, *_GUARDED.values()):
            self.flush(f"in-place write to a {type(home).__name__}")  # a subclass of its own: write now
            return
        self.guard(home, WRITE)

    def _unguard(self) -> None:
        for t, cls in self.guarded:
            _GUARDS.pop(id(t), None)
            if cls is not None:
                t.__class__ = cls
            elif _storage_key(t) not in _KEEPERS:  # (a kept tensor released meanwhile)
                t.__class__ = torch.Tensor
        self.guarded.clear()

    def overlaps_pending_write(self, tensors: list[torch.Tensor]) -> bool:
        return bool(self.homes) and any(_overlaps(t, h) for t in tensors for h, _ in self.homes.values())

    def has_views(self, lt: LazyTensor) -> bool:
        """Is ``lt`` a recorded view, or the root of a live one?"""
        if lt._base is not None:
            return True
        return any((v := r()) is not None and v._expr is not None and v._base is lt for r in self.views)

    # flushing
    def flush(self, reason: str) -> None:
        """Run the segment: every pending value someone holds is computed, in-place results land
        in their tensors, recorded views become real ones. Transactional: where anything raises,
        the error goes to the caller once, and the stream is empty and usable again (``_fail``)."""
        self._unguard()
        writers = [w for _, ws in self.homes.values() for w in ws]
        held = [lt for lt in (r() for r in self.holders) if lt is not None]
        pending = {id(lt): lt for lt in held + writers if lt._expr is not None}
        views = [lt for lt in pending.values() if lt._base is not None]
        for v in views:  # a view keeps its root alive: the root is written, the view is made of it
            pending.setdefault(id(v._base), v._base)
        self.epoch += 1
        written: list[torch.Tensor] = []  # user tensors this flush has begun writing
        try:
            self._check_unchanged()
            computed = [lt for lt in pending.values() if lt._base is None]
            if computed:
                dry = self._compute(reason, computed, written)
                self._land(views, written, dry)
                log.info("flush (%s): %d queued ops, %d output(s)", reason, self.queued, len(pending))
        except BaseException as exc:
            self._fail(exc, reason, pending.values(), written)
            raise
        finally:
            self._reset()

    def _compute(self, reason: str, computed: list[LazyTensor], written: list[torch.Tensor]) -> bool:
        """The segment's kernel, each computed value materialized (True: a dry run, nothing computed)."""
        firsts: dict[Expr, LazyTensor] = {}  # one kernel output per distinct expression
        for lt in computed:
            if not lt._expr.is_var and lt._expr not in firsts:  # type: ignore[union-attr]
                firsts[lt._expr] = lt
        kernel = None
        if firsts:
            # a value eager lays out as a permuted dense tensor is computed in that memory order
            # (its kernel writes permute(value)) and viewed back: eager's strides, no copy
            orders = [_memory_order(lt._info.shape, lt._strides) if lt._strides else None for lt in firsts.values()]
            exprs = [lt._expr if o is None else permute(lt._expr, o) for lt, o in zip(firsts.values(), orders)]
            # an in-place result is written straight into its tensor where the kernel can (it
            # reads the old value only there, element by element): no copy after the kernel
            final = {id(ws[-1]): home for home, ws in self.homes.values() if not home.requires_grad}
            into = {k: final[id(lt)] for k, lt in enumerate(firsts.values()) if id(lt) in final}
            kernel, args, homes = self.fusion._plan(exprs, self, into)
            _before_write(list(into.values()))
            try:
                unsaved = frozenset(id(t) for t, v in self.leaves.values() if self.unsaved.get(v))
                outs = _call(kernel, args, any(lt._grad for lt in firsts.values()), self.fusion, unsaved)
            except BaseException as e:
                # (not launched: a lowering error, or a zero divisor the host found before the launches)
                if homes and not isinstance(e, ZeroDivisorError) and _launched(kernel, args):
                    written.extend(homes)
                raise
            written.extend(homes)
            outs = [outs] if not isinstance(outs, dict) else list(outs.values())
            landed = {id(t) for t in into.values()}
            for k, (lt, out, o) in enumerate(zip(firsts.values(), outs, orders)):
                with torch._C.DisableTorchFunctionSubclass():
                    if id(out) in landed and k not in into:  # another root's tensor (one node): its own copy
                        self._copy_record(out, eager=True)
                        out = out.clone()
                    if out.requires_grad and not lt._grad:  # a kernel's outputs all have its history
                        out = out.detach()
                    if o is not None:  # eager's strides: a view of the memory the kernel wrote, made
                        # with grad on (a view made under no_grad may not be written in place where
                        # grad is on, as eager's result may); a value without history has none
                        with torch.enable_grad():
                            out = out.permute(sorted(range(len(o)), key=o.__getitem__))
                lt._materialize(out)
            self.fusion._last = (reason, kernel, tuple(args))
        tensor_of = self.tensor_of()
        for lt in computed:  # a copy of a leaf, or an expression equal to another: a tensor of its own
            if lt._expr is not None:
                first = firsts.get(lt._expr)
                src = first._value if first is not None else tensor_of[lt._expr]
                self._copy_record(src, eager=True)  # eager computed it twice
                with torch.set_grad_enabled(lt._grad):  # (row-major: the loop below lays out the others)
                    lt._materialize(src.clone(memory_format=torch.contiguous_format))
        for lt in computed:  # eager strides, where eager's value is not contiguous
            if lt._strides is not None and lt._home is None and tuple(lt._value.stride()) != lt._strides:  # type: ignore[union-attr]
                real = torch.empty_strided(lt._info.shape, lt._strides, dtype=lt.dtype, device=self.device)
                self._copy_record(lt._value, eager=False)  # type: ignore[arg-type]
                with torch.set_grad_enabled(lt._grad):
                    lt._value = real.copy_(lt._value)  # type: ignore[arg-type]
        return kernel is not None and kernel.config.dry_run

    def _land(self, views: list[LazyTensor], written: list[torch.Tensor], dry: bool) -> None:
        """In-place results land in their tensors, as in eager; recorded views become real views."""
        for home, ws in self.homes.values():
            if not dry and ws[-1]._value is not home:  # a dry run computed nothing: never write it into a user tensor
                _before_write(home)
                written.append(home)
                with torch.set_grad_enabled(ws[-1]._grad):  # a write under no_grad leaves no history
                    home.copy_(ws[-1]._value)
                self._copy_record(home, eager=False)
            for w in ws:
                w._value, w._home = home, None
        for v in views:  # recorded views become real views of their root's tensor
            value = v._base._value  # type: ignore[union-attr]
            with torch._C.DisableTorchFunctionSubclass():
                for func, rest, kw, grad in v._chain:
                    with torch.set_grad_enabled(grad):
                        value = func(value, *rest, **kw)
            self.fusion._remember(v._base._value)  # type: ignore[union-attr,arg-type]
            self.fusion._remember(value)  # (views the stream made: seen, never a reason to copy a read)
            v._value, v._expr, v._base, v._chain = value, None, None, ()

    def _fail(self, exc: BaseException, reason: str, pending: Any, written: list[torch.Tensor]) -> None:
        """The flush raised ``exc``: nothing it computed is kept. Each value it was to compute reads as
        an ``RtxError`` saying so (its stream is the failure); a user tensor it had begun writing
        raises until it is overwritten whole; every other tensor keeps its old values."""
        what = f"{type(exc).__name__}: {exc}"
        failed = _Failed(
            self.device,
            f"this lazy value was never computed: the flush that was to compute it ({reason}) failed "
            f"with {what}. Compute it again from its inputs",
        )
        for lt in pending:
            lt._stream, lt._expr, lt._value, lt._home = failed, None, None, None  # type: ignore[assignment]
            lt._base, lt._chain = None, ()
        for t in {id(t): t for t in written}.values():
            with torch._C.DisableTorchFunctionSubclass():
                name = f"{SHORT_NAME.get(t.dtype, t.dtype)}{list(t.shape)}"
            guarded = _poison(
                t,
                f"this tensor ({name}) was being written in place by a lazy flush that failed ({reason}: {what}); "
                "its values are undefined. Overwrite it whole (copy_, fill_ or zero_) to use it again",
            )
            if hasattr(exc, "add_note"):
                more = "it raises until it is overwritten whole" if guarded else "its values are undefined"
                exc.add_note(f"rtxdsl: this failed lazy flush had begun writing a tensor ({name}) in place: {more}")

    def _check_unchanged(self) -> None:
        """Every plain tensor the segment reads still holds what it held when it was read. A write
        through an alias the guards never saw (a view made before the tensor was read) changes it
        behind the stream's back: its old values are gone, so the segment cannot run as eager would.
        That is a clear error at the flush, never a silently different result."""
        stale = [t for t, _ in self.leaves.values() if _version_of(t) != self.versions.get(id(t), _version_of(t))]
        if not stale:
            return
        t = stale[0]
        raise RtxError(
            f"a tensor ({SHORT_NAME.get(t.dtype, t.dtype)}{list(t.shape)}) that pending lazy ops read was written "
            "through a view the lazy stream never saw (made before the tensor was read); its old values are "
            "gone. Call rx.sync() (or .torch()) before writing through that view"
        )

    def _copy_record(self, t: torch.Tensor, eager: bool) -> None:
        """A copy the flush launches; ``eager``: eager torch launched its equivalent too."""
        nbytes = 2 * t.numel() * t.element_size()
        self.fusion._stats.record(1, 0, int(eager), nbytes, nbytes if eager else 0)

    def _reset(self) -> None:
        self.info.clear()
        self.leaves.clear()
        self.detached.clear()
        self.stops.clear()
        self.snapshots.clear()
        self.on_storage.clear()
        self.grad_vars.clear()
        self.unsaved.clear()
        self.refused.clear()
        self.unprobed.clear()
        self.versions.clear()
        self.read_storages.clear()
        self.holders.clear()
        self.homes.clear()
        self.views.clear()
        self.queued = 0
        self.cap = self.fusion.config.max_queued_ops


def _launched(kernel: Kernel, args: list[Any]) -> bool:
    """After a call of ``kernel`` raised: did it get as far as its launches (its program lowers)?
    A call whose lowering raised wrote nothing."""
    try:
        kernel.program(*args)
    except Exception:  # noqa: BLE001 - any error in lowering: nothing was launched
        return False
    return True


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _storage_key(a) == _storage_key(b)


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
    memo: dict[Expr, Expr] = {}
    params: list[Expr] = []
    for n in walk(list(roots)):
        value = n.attr("value")
        if n.is_var or n.is_const and (type(value).__name__, repr(value)) not in STRUCTURAL:
            memo[n] = _arg(len(params))
            params.append(n)
        elif n.srcs:
            srcs = tuple(memo[s] for s in n.srcs)
            memo[n] = n if all(a is b for a, b in zip(srcs, n.srcs)) else Expr(n.op, srcs, n.attr_dict)
        else:
            memo[n] = n
    return tuple(memo[r] for r in roots), tuple(params)


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
        if stats is not None and not isinstance(stats, FusionStats):
            raise RtxError(f"Fusion(stats=) needs a FusionStats, got {type(stats).__name__}")
        self._config = config
        self._stats = stats or FusionStats()
        _see_lazy_values_in_autograd_functions()
        self._streams: dict[torch.device, OperationStream] = {}
        # segment structure -> its kernel and the argument positions it writes in place
        self._plans: LRU[tuple, tuple[Kernel, tuple[int, ...]]] = LRU(self.config.cache_size)
        # the last few segments' recorded roots (interned: a steady loop records the same ones) -> their
        # canonical form; a loop whose constants change misses here and pays one walk per flush
        self._canon: LRU[tuple[Expr, ...], tuple[tuple[Expr, ...], tuple[Expr, ...]]] = LRU(16)
        self._last: tuple[str, Kernel, tuple] | None = None
        self.eager_ops = 0  # ops run eagerly at sync points (unsupported calls)
        # the tensors this fusion wrapped, by the memory they live in (a write through one guards all)
        self._known: dict[tuple[torch.device, int], list[weakref.ref[torch.Tensor]]] = {}

    @property
    def config(self) -> FusionConfig:
        return self._config or get_config()

    def lazy(self, t: torch.Tensor) -> LazyTensor:
        """Wrap ``t``; nothing is copied and nothing runs."""
        if isinstance(t, LazyTensor):
            return t
        if not isinstance(t, torch.Tensor):
            raise RtxError(f"lazy() takes a torch.Tensor, got {type(t).__name__}")
        check_dense(t, "lazy()'s tensor")
        self._remember(t)
        return LazyTensor._leaf(self.stream(t.device), t)

    def _remember(self, t: torch.Tensor) -> None:
        refs = self._known.setdefault(_storage_key(t), [])
        if not any(r() is t for r in refs):
            refs.append(weakref.ref(t))
        if len(refs) > 64 or len(self._known) > 4096:  # drop what died
            self._known = {k: live for k, rs in self._known.items() if (live := [r for r in rs if r() is not None])}

    def _aliases(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The live tensors this fusion wrapped that share ``t``'s memory."""
        refs = self._known.get(_storage_key(t), ())
        return [x for r in refs if (x := r()) is not None and x is not t]

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
        """This Fusion's own launches (``rx.fusion_stats()`` counts them too, with every other)."""
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

    def _plan(
        self, roots: list[Expr], stream: OperationStream, into: dict[int, torch.Tensor]
    ) -> tuple[Kernel, list[Any], list[torch.Tensor]]:
        """The kernel for this segment's structure, the tensors and numbers to call it with, and the
        tensors it writes in place.

        Two lookups: the recorded roots themselves (a steady loop records the very same interned
        nodes), then their canonical structure (a loop whose constants change maps to one plan).
        ``into``: root index -> the tensor it may be written into (when the kernel reads it). Not
        where the program checks indices: that check raises after the launch, and a result written
        into its tensor would be lost with the tensor's old values; a buffer landed after it is not.
        """
        key = tuple(roots)
        hit = self._canon.get(key)
        if hit is None:
            hit = canonical(key)
            self._canon.put(key, hit)
        canon, params = hit
        tensor_of = stream.tensor_of()
        args = [tensor_of[p] if p.is_var else p.attr("value") for p in params]
        slot = {id(t): k for k, t in enumerate(args) if isinstance(t, torch.Tensor)}
        targets = tuple((f"o{r}", f"a{slot[id(t)]}") for r, t in into.items() if id(t) in slot)
        entry = self._plans.get((canon, targets))
        if entry is None:
            outputs = {f"o{k}": r for k, r in enumerate(canon)}
            kernel = Kernel(outputs, self._config, stats=self._stats, into=dict(targets))
            written = tuple(int(a[1:]) for _, a in targets)  # the argument positions it writes
            if targets and any(call.checks for call in kernel.prepared(*args).program.launched):
                kernel, written = Kernel(outputs, self._config, stats=self._stats), ()
            entry = kernel, written
            self._plans.put((canon, targets), entry)
        return entry[0], args, [args[k] for k in entry[1]]

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


def _bind(roots: list[Expr], values: dict[str, Expr]) -> list[Expr]:
    """``roots`` with each variable replaced by ``values[name]``."""
    return substitute(roots, lambda n: values[n.attr("name")] if n.is_var else None)


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
    if isinstance(out, tuple) and hasattr(out, "n_fields"):  # torch.return_types keep their names
        return type(out)([_wrap(o, fusion) for o in out])
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

    __slots__ = ("_stream", "_expr", "_value", "_info", "_home", "_base", "_chain", "_strides", "_grad", "__weakref__")

    def __init__(self) -> None:
        raise RtxError("create lazy tensors with rx.lazy(tensor) or Fusion.lazy(tensor)")

    @classmethod
    def _leaf(cls, stream: OperationStream, t: torch.Tensor) -> LazyTensor:
        lt = object.__new__(cls)
        lt._stream, lt._expr, lt._value, lt._home = stream, None, t, None
        lt._base, lt._chain, lt._strides, lt._grad = None, (), _contiguous_strides(t), False
        lt._info = Info.tensor(tuple(t.shape), t.dtype)
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

    def _as_expr(self, read_by: tuple[Any, tuple, int] | None = None) -> Expr:
        if self._expr is None:
            return self._stream.leaf(self._value, read_by)  # type: ignore[arg-type]
        home = self._home
        if home is not None and not self._grad and home.requires_grad and torch.is_grad_enabled():
            # written under no_grad, read with gradients: the tensor itself (its history, the new values)
            self._stream.flush("a read with gradients of a tensor written under no_grad")
            return self._stream.leaf(self._value)  # type: ignore[arg-type]
        return self._expr

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
        """Eager's answer without a flush: a pending value requires grad when it was recorded with
        grad enabled over an operand that does (not under ``no_grad``, not through ``detach``), or
        when it is an in-place write into a tensor that does."""
        if self._value is not None:
            return self._value.requires_grad
        return self._grad or self._home is not None and self._home.requires_grad

    @property
    def is_leaf(self) -> bool:
        if self._value is not None:
            return self._value.is_leaf
        if self._home is not None and not self._grad:
            return self._home.is_leaf
        return not self.requires_grad

    @property
    def grad_fn(self) -> Any:
        """The node that made the value: for a pending value that requires grad, a stand-in (so
        ``x.grad_fn is None`` answers without a flush) that flushes when it is used."""
        if self._value is not None:
            return self._value.grad_fn
        if self._home is not None and not self._grad:
            return self._home.grad_fn
        return PendingNode(self) if self._grad else None

    @property
    def grad(self) -> Any:
        return self._value.grad if self._value is not None else None

    def stride(self, dim: int | None = None) -> Any:
        """Eager's strides, known without running anything (a pending value's are tracked)."""
        strides = self._eager_strides()
        return strides if dim is None else strides[dim]

    def _eager_strides(self) -> tuple[int, ...]:
        """The strides eager's tensor has: the real one's; a pending in-place write's, its home's
        (exactly: size-1 dims keep theirs); else the tracked layout, or contiguous."""
        real = self._value if self._value is not None else self._home
        if real is not None:
            with torch._C.DisableTorchFunctionSubclass():
                return tuple(real.stride())
        if self._strides is not None:
            return self._strides
        return tuple(torch.empty(self._info.shape, device="meta").stride())

    def __rtxdsl_record__(self, kernel: Kernel, values: tuple) -> Any:
        """``kernel(...)`` with lazy operands: its expressions, bound to the operands', are recorded
        in the segment (one kernel with whatever else is pending). A kernel that draws random
        seeds, or operands that need gradients, or a call under saved-tensor hooks, run it on
        materialized operands instead."""
        stream = self._stream
        lazies = [v for v in values if isinstance(v, LazyTensor)]
        grads = torch.is_grad_enabled() and any(
            v.requires_grad for v in values if isinstance(v, (LazyTensor, torch.Tensor))
        )
        hooked = _SAVED_HOOKS(False) is not None  # (a checkpointed region: as ``_hooked``)
        if kernel.draws_seeds or grads or hooked or any(v._stream is not stream for v in lazies):
            if hooked:
                _flush_outside_hooks(stream.fusion)
            real = [v._real("an rtxdsl kernel call") if isinstance(v, LazyTensor) else v for v in values]
            with _saved_hooks(real, stream.fusion, frozenset()):
                return _wrap(kernel(*real), stream.fusion)
        names = [v.attr("name") for v in kernel.variables]
        while True:
            epoch = stream.epoch
            bound = {n: _expr_of(v, stream) for n, v in zip(names, values)}
            if stream.epoch == epoch:
                break
        keys = [k for k, _ in kernel.expressions]
        exprs = _bind([e for _, e in kernel.expressions], {n: as_expr(b) for n, b in bound.items()})
        outs = [stream.record(e) for e in exprs]
        if _OVER:
            _over_cap()
        return outs[0] if kernel.returns_tensor else dict(zip(keys, outs))

    # views that torch spells as properties
    @property
    def T(self) -> Any:  # noqa: N802 (torch's name)
        return self.permute(tuple(reversed(range(self.ndim)))) if self.ndim >= 2 else self._property_view("T")

    @property
    def mT(self) -> Any:  # noqa: N802
        return self.transpose(-2, -1) if self.ndim >= 2 else self._property_view("mT")

    def _property_view(self, name: str) -> Any:
        """A view torch spells as a property, taken of the real value (torch decides, or raises)."""
        real = self._real(f"view .{name}")
        with torch._C.DisableTorchFunctionSubclass():
            out = getattr(real, name)
        return _wrap_view(out, self, self._stream.fusion)

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

    def cpu(self) -> Any:
        out = self._real("data access: .cpu()").cpu()
        return self if out is self._value else out

    def __repr__(self) -> str:
        return f"LazyTensor({self._real('data access: printing')!r})"

    def __bool__(self) -> bool:
        return bool(self._real("data access: bool()"))

    def __float__(self) -> float:
        return float(self._real("data access: float()"))

    def __int__(self) -> int:
        return int(self._real("data access: int()"))

    def __index__(self) -> int:
        return self._real("data access: index").__index__()

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __iter__(self) -> Iterator[Any]:
        if not self.shape:  # (torch's words)
            raise TypeError("iteration over a 0-d tensor")
        return iter([self[i] for i in range(self.shape[0])])

    def __array__(self, dtype: Any = None) -> Any:
        a = self._real("data access: numpy conversion").numpy()
        return a if dtype is None else a.astype(dtype)

    # dispatch
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if _SAVED_HOOKS(False) is not None:
            return _hooked(func, args, kwargs or {})
        if _ANY_AUTOCAST() and not _AUTOCAST_DECIDED[0]:
            return _autocast(func, args, kwargs or {})
        entry = _TORCH.get(func)
        if entry is not None and not kwargs and func not in _SLOW:
            # the hot path: a mapped op over lazy values (one stream, eager layout contiguous) and numbers
            stream = None
            operands = []
            grad = numbers = False
            for k, a in enumerate(args):
                if type(a) is LazyTensor and a._strides is None:
                    if stream is None:
                        stream, epoch = a._stream, a._stream.epoch
                    elif a._stream is not stream:
                        break
                    if a._expr is not None:
                        if a._home is not None and not a._grad and a._home.requires_grad:
                            break  # written under no_grad: read as _as_expr says
                        operands.append(a._expr)
                        grad = grad or a._grad
                    else:
                        v = stream.leaf(a._value, (func, args, k))
                        operands.append(v)
                        grad = grad or v in stream.grad_vars or not v.is_var and a._value.requires_grad
                elif isinstance(a, (bool, int, float)):
                    operands.append(a)
                    numbers = True
                else:
                    break
            else:  # (a conversion that flushed the stream, or no_grad over grads, takes the careful path)
                if stream is not None and stream.epoch == epoch and stream.fusion.config.enabled:
                    if numbers and stream.on_cpu and func in _CPU_ROUNDS and _half(args[0]):
                        operands = scalars_as_cpu_eager(operands, {a.dtype for a in args if type(a) is LazyTensor})
                    if not grad or torch.is_grad_enabled():
                        try:
                            out = stream.record(entry[1](*operands), grad)
                        except (Unsupported, RtxError):
                            pass  # torch decides: the careful path runs it eagerly
                        else:
                            if _OVER:
                                _over_cap()
                            return out
        out = _dispatch(func, args, kwargs or {})
        if _OVER:
            _over_cap()
        return out

    def __getattr__(self, name: str) -> Any:
        fn = getattr(torch.Tensor, name, None)
        if fn is not None and not callable(fn):  # a property of torch's tensors
            if name in _META_PROPERTIES:  # metadata: a stand-in of the same layout answers it
                return getattr(torch.empty(self.shape, dtype=self.dtype, device="meta"), name)
            if name in _DEVICE_PROPERTIES:
                return self.device.type == _DEVICE_PROPERTIES[name]
            return getattr(self._real(f"data access: {name}"), name)  # (``data``, ``real``: the values)
        if fn is None:
            raise AttributeError(f"LazyTensor has no attribute {name!r}")
        return lambda *args, **kwargs: LazyTensor.__torch_function__(fn, (LazyTensor,), (self, *args), kwargs)


#: properties of a dense tensor a meta tensor of its shape and dtype answers as it does (``nn.MultiheadAttention``
#: asks ``is_nested``); and the device ones, by the device's type
_META_PROPERTIES = frozenset(
    {"is_nested", "is_sparse", "is_sparse_csr", "is_quantized", "is_mkldnn", "layout", "itemsize", "nbytes"}
)
_DEVICE_PROPERTIES = {"is_cpu": "cpu", "is_cuda": "cuda", "is_meta": "meta", "is_mps": "mps", "is_xpu": "xpu"}


#: streams whose queue reached its cap during the current call; ``_DEPTH``: calls made while
#: recording another (an in-place op's value), which leave the flush to the outer one
_OVER: list[OperationStream] = []
_DEPTH = [0]


def _over_cap() -> None:
    """The queue cap's flush, once the call that reached it has finished recording: a flush in the
    middle of one (between a view's expression and its root being set, or before an in-place
    op's value lands in its target) would materialize a half-made value."""
    if _DEPTH[0]:
        return
    while _OVER:
        s = _OVER.pop()
        if s.queued >= s.cap:
            s.flush(f"queue cap ({s.cap} ops)")


def _see_lazy_values_in_autograd_functions() -> None:
    """``torch.autograd.Function.apply`` sees no ``__torch_function__``: a lazy value reached a custom
    function (a Liger kernel, a reentrant checkpoint) as an opaque object, so its forward ran under
    no_grad and the gradients upstream were lost without a word. Once a Fusion exists, ``apply``
    materializes lazy arguments first (a sync point) and wraps tensor results, as any op the stream
    cannot fuse; calls without lazy arguments pass straight through."""
    function = torch.autograd.Function
    if getattr(function.apply, "_rtxdsl", False):
        return
    plain = function.apply.__func__

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        lazies = _lazies((args, kwargs))
        if not lazies:
            return plain(cls, *args, **kwargs)
        run = functools.partial(plain, cls)
        return lazies[0]._stream.fusion._eager(run, args, kwargs, f"autograd.Function {cls.__name__}")

    apply._rtxdsl = True  # type: ignore[attr-defined]
    function.apply = classmethod(apply)  # type: ignore[assignment,method-assign]


#: the innermost saved-tensor hooks set (a non-reentrant checkpoint's, ``save_on_cpu``), or None
_SAVED_HOOKS = torch._C._autograd._top_saved_tensors_default_hooks


def _hooked(func: Any, args: tuple, kwargs: dict) -> Any:
    """A call while saved-tensor hooks are set: a non-reentrant checkpoint counts the tensors its
    region saves, and runs the region again in the backward to get them back; a kernel flushed
    later would save them outside it (``CheckpointError``: 8 saved, 6 recomputed). What is pending
    runs first with the hooks set aside (eager computed it before the region), then the call runs
    eagerly under them."""
    fusion = _lazies((args, kwargs))[0]._stream.fusion
    _flush_outside_hooks(fusion)
    return fusion._eager(func, args, kwargs, f"{_name(func)} under saved-tensor hooks")


def _flush_outside_hooks(fusion: Fusion) -> None:
    """Compute what is pending with the innermost saved-tensor hooks set aside (eager computed it
    before their region began), then set them again."""
    hooks = _SAVED_HOOKS(False)
    torch._C._autograd._pop_saved_tensors_default_hooks()
    try:
        for stream in list(fusion._streams.values()):
            stream.flush("saved-tensor hooks (a checkpointed region)")
    finally:
        torch._C._autograd._push_saved_tensors_default_hooks(*hooks)


#: is any autocast region active (cheap: the hot path asks it per call)
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
#: set while a call under autocast runs with its operands cast already: what it records sees no autocast
_AUTOCAST_DECIDED = [0]
#: (func, argument signature, device type, autocast dtype) -> what autocast makes of the call: the
#: dtype it casts the floating operands to, None where it changes nothing, _UNKNOWN where probes fail
_AUTOCAST: LRU[tuple, Any] = LRU(4096)


def _autocast(func: Any, args: tuple, kwargs: dict) -> Any:
    """A call under ``torch.autocast`` for the lazy values' device: eager's casts, then the call as
    it would be recorded. What autocast does to a call is torch's answer on one-element probes of
    the operands' dtypes (on the device's kind), with autocast on and off: a lower-precision op
    (``linear``, ``matmul``, SDPA) gives the autocast dtype, an fp32 op (a loss) float32; the
    floating operands are cast to it (float64 ones stay, as autocast leaves them), then the call is
    recorded with autocast off. A call the probes cannot tell runs eagerly, under autocast."""
    lazies = _lazies((args, kwargs))
    kind = lazies[0].device.type
    if func in _KEEP_DTYPE or not torch.is_autocast_enabled(kind):  # (views and writes keep their dtype)
        cast, target = False, None
    else:
        target = _autocast_target(func, args, kwargs, kind)
        if target is _UNKNOWN:
            return lazies[0]._stream.fusion._eager(func, args, kwargs, f"{_name(func)} under autocast")
        cast = target is not None
    _AUTOCAST_DECIDED[0] += 1
    try:
        if cast:
            args, kwargs = _cast_floating((args, kwargs), target)
        return LazyTensor.__torch_function__(func, _TYPES, args, kwargs)
    finally:
        _AUTOCAST_DECIDED[0] -= 1


def _autocast_target(func: Any, args: tuple, kwargs: dict, kind: str) -> Any:
    key = (func, _sig(args), tuple((k, _sig(v)) for k, v in kwargs.items()), kind, torch.get_autocast_dtype(kind))
    try:
        hit = _AUTOCAST.get(key)
    except TypeError:  # an argument that does not hash
        return _UNKNOWN
    if hit is not None:
        return None if hit is _NONE else hit
    device = torch.device(kind)

    def probe(x: Any) -> Any:
        if isinstance(x, (LazyTensor, torch.Tensor)):
            return torch.zeros((1,) * x.ndim, dtype=x.dtype, device=device)
        if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
            return type(x)(probe(v) for v in x)
        return x

    try:
        with torch._C.DisableTorchFunctionSubclass():
            p_args, p_kwargs = probe(args), {k: probe(v) for k, v in kwargs.items()}
            on = _tensors(func(*p_args, **p_kwargs))
            with torch.autocast(kind, enabled=False):
                off = _tensors(func(*p_args, **p_kwargs))
        answer: Any = _NONE if [t.dtype for t in on] == [t.dtype for t in off] else on[0].dtype
    except Exception:  # noqa: BLE001 - probes of these sizes cannot tell: eager decides
        answer = _UNKNOWN
    if answer is not _UNKNOWN and answer is not _NONE and not answer.is_floating_point:
        answer = _UNKNOWN
    _AUTOCAST.put(key, answer)
    return None if answer is _NONE else answer


def _cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating tensor (lazy or not, float64 aside) cast to ``dtype``."""
    if isinstance(obj, (LazyTensor, torch.Tensor)):
        if obj.dtype.is_floating_point and obj.dtype not in (dtype, torch.float64):
            return obj.to(dtype)
        return obj
    if isinstance(obj, dict):
        return {k: _cast_floating(v, dtype) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return type(obj)(_cast_floating(v, dtype) for v in obj)
    return obj


def _nested(func: Any, args: tuple, kwargs: dict | None = None) -> Any:
    _DEPTH[0] += 1
    try:
        return LazyTensor.__torch_function__(func, _TYPES, args, kwargs)
    finally:
        _DEPTH[0] -= 1


class PendingNode:
    """The ``grad_fn`` of a pending value that requires grad: not None, as eager's; any use of it
    (``name()``, ``next_functions``, ``register_hook``) flushes and is the real node's."""

    __slots__ = ("_of",)

    def __init__(self, of: LazyTensor) -> None:
        self._of = of

    def __getattr__(self, name: str) -> Any:
        return getattr(self._of._real(f"grad_fn.{name}").grad_fn, name)

    def __repr__(self) -> str:
        return repr(self._of._real("printing grad_fn").grad_fn)


#: the dtypes a gradient flows in
_FLOATS = frozenset(d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point)
#: op name -> True where it reads every operand's values (memo of the registry's ``shape_only``)
_READS: dict[str, bool] = {}


def _reads_values(e: Expr) -> bool:
    """Does ``e``'s op read a tensor operand's values (``rand_like`` reads only its shape)?"""
    only = REGISTRY[e.op].shape_only
    if not only:
        _READS[e.op] = True
        return True
    return any(k not in only for k, s in enumerate(e.srcs) if not s.is_const)


def _dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """Every call the hot path does not take: in-place ops, views, mixed operands, sync points."""
    found = _tensors_and_lazies((args, kwargs))
    lazies = [a for a in found if isinstance(a, LazyTensor)]
    fusion = lazies[0]._stream.fusion
    if torchsem.writes(func, kwargs):
        return _inplace(func, args, kwargs, fusion)
    if func is torchsem.CONTIGUOUS:
        return _contiguous(args[0], args[1:], kwargs)
    if func in torchsem.VIEWS and isinstance(args[0], LazyTensor) and _basic_view(func, args):
        return _view(func, args, kwargs, fusion)
    stream = lazies[0]._stream
    entry = REGISTRY.torch.get(func)
    mixed = any(lt._stream is not stream for lt in lazies)
    if entry is None or mixed or not fusion.config.enabled:
        return fusion._eager(func, args, kwargs, f"unsupported {_name(func)}")
    meta = _meta_result(func, args, kwargs)
    if meta is _RAISES:  # torch rejects the call: let it say so, at this statement
        return fusion._eager(func, args, kwargs, f"{_name(func)} raises in torch")
    if meta is _SELF and isinstance(args[0], LazyTensor):
        return args[0]  # eager returns self (x.float() of a float, eval dropout): so do we
    grad = any(a.requires_grad for a in found)
    try:
        expr = _build(func, entry, args, kwargs, stream)
        if isinstance(expr, tuple):
            return _record_many(func, expr, stream, meta, grad)
        out = stream.record(expr, grad)
    except (Unsupported, RtxError):
        return fusion._eager(func, args, kwargs, f"unsupported arguments of {_name(func)}")
    if not _agrees(out, meta):  # our typing differs from torch's: torch's answer, eagerly
        del out  # (recorded, held by no one: a flush the eager call makes must not compute it)
        return fusion._eager(func, args, kwargs, f"{_name(func)}: dtype or shape other than torch's")
    out._strides = _strides_of(meta)
    return out


def _record_many(func: Any, exprs: tuple, stream: OperationStream, meta: Any, grad: bool) -> Any:
    """A recorded op with several results (``max(dim)``): torch's named tuple when torch gives one."""
    outs = [stream.record(e, grad) for e in exprs]
    if isinstance(meta, tuple) and len(meta) == len(outs):
        for o, m in zip(outs, meta):
            if not _agrees(o, m):
                raise Unsupported
        if hasattr(meta, "n_fields"):
            return type(meta)(outs)
    return tuple(outs)


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", getattr(func, "__name__", str(func)))


#: the registry's torch mappings, read once per call on the hot path
_TORCH = REGISTRY.torch
_new = object.__new__
#: the torch functions whose numbers CPU eager rounds to a half operand's dtype (``Front.cpu_rounds_numbers``)
_CPU_ROUNDS = frozenset(f for f, (op, _) in _TORCH.items() if op.front.cpu_rounds_numbers)
#: views, writes and ``contiguous``: their results keep their operand's dtype (autocast too)
_KEEP_DTYPE = frozenset(
    torchsem.VIEWS | torchsem.MAYBE_SELF | {torchsem.CONTIGUOUS} | {f for f in _TORCH if torchsem.writes(f, {})}
)
#: products with a bias whose operands torch requires in one dtype, which its meta kernels do not
#: check of the bias (a half bias beside float32 matrices: eager raises, the stream promoted)
_ONE_DTYPE = frozenset(
    {torch.addmm, torch.Tensor.addmm, torch.baddbmm, torch.Tensor.baddbmm, torch.nn.functional.linear}
)
#: functions the hot path leaves to ``_dispatch``
_SLOW = _KEEP_DTYPE | _ONE_DTYPE


# ---- torch's answer on meta tensors ---------------------------------------------------------------
_RAISES, _SELF = object(), object()  # torch raises / returns its first argument itself
#: (func, argument signature) -> torch's result on meta tensors (or _RAISES): one probe per structure
_META: LRU[tuple, Any] = LRU(4096)


def _meta_of(x: Any) -> Any:
    if isinstance(x, LazyTensor):
        return torch.empty_strided(x._info.shape, x._eager_strides(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.Tensor):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        return type(x)(_meta_of(v) for v in x)
    return x


def _sig(x: Any) -> Any:
    """A call argument as the meta probe sees it (exact strides: size-1 dims keep theirs)."""
    if isinstance(x, LazyTensor):
        return ("L", x.dtype, x._info.shape, x._eager_strides())
    if isinstance(x, torch.Tensor):
        with torch._C.DisableTorchFunctionSubclass():
            return ("T", x.dtype, tuple(x.shape), tuple(x.stride()))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *(_sig(v) for v in x))
    # numbers by value: dims are ints, and a float can decide identity (dropout's p=0 returns self)
    return (type(x).__name__, x) if isinstance(x, (int, float, bool, str, torch.dtype, type(None))) else repr(x)


def _names_device(args: tuple, kwargs: dict) -> bool:
    """Does a call name a device other than its tensor's (``.to("meta")`` of a CPU value)?"""
    here = getattr(args[0], "device", None) if args else None
    for a in (*args[1:], *kwargs.values()):
        if isinstance(a, (str, torch.device)):
            try:
                there = torch.device(a)
            except RuntimeError:  # a string that names no device (a memory format's name): not one
                continue
            if here is None or there.type != here.type or there.index not in (None, here.index):
                return True
    return False


def _meta_result(func: Any, args: tuple, kwargs: dict) -> Any:
    """What torch gives for this call on meta tensors of the same dtypes, shapes and strides:
    a meta tensor, a tuple of them, ``_RAISES``, or None where meta tensors cannot tell."""
    try:
        key = (func, _sig(args), tuple((k, _sig(v)) for k, v in kwargs.items()))
        hash(key)
    except TypeError:
        return None
    hit = _META.get(key)
    if hit is not None:
        return None if hit is _UNKNOWN else hit
    if func in _ONE_DTYPE and len({t.dtype for t in _tensors_and_lazies((args, kwargs))}) > 1:
        return _RAISES
    try:
        metas = _meta_of(args)
        out = func(*metas, **{k: _meta_of(v) for k, v in kwargs.items()})
        if metas and out is metas[0] and not _names_device(args, kwargs):
            out = _SELF  # (a move to a device: to the meta device, meta tensors stay themselves)
        elif not isinstance(out, (torch.Tensor, tuple)):
            out = None
    except (RuntimeError, IndexError, ValueError, TypeError) as exc:
        # data-dependent ops and meta gaps cannot tell; shape and dtype errors are torch's verdict
        text = str(exc)
        out = None if "meta" in text or "data-dependent" in text or "Cannot copy out" in text else _RAISES
    except Exception:  # noqa: BLE001 - anything else: unknown, decide without meta
        out = None
    _META.put(key, _UNKNOWN if out is None else out)
    return out


_UNKNOWN = object()
_NONE = object()  # a cached "nothing" (an LRU answers None for a miss)


def _agrees(out: LazyTensor, meta: Any) -> bool:
    if not isinstance(meta, torch.Tensor):
        return meta is None
    return out.dtype == meta.dtype and out._info.shape == tuple(meta.shape)


def _grad_fn(t: torch.Tensor) -> Any:
    """``t.grad_fn``, None where autograd refuses ``t`` (``_refusal``): the stream's own reads of
    autograd's metadata never raise what eager raises only at a differentiable op."""
    try:
        return t.grad_fn
    except RuntimeError:
        return None


def _refusal(t: torch.Tensor) -> RuntimeError | None:
    """Autograd's error for a tensor it refuses to differentiate through (a view of a multi-output op
    written in place), which eager raises where a differentiable op reads it, not at ``.int()``."""
    try:
        t.grad_fn  # noqa: B018
    except RuntimeError as e:
        return e
    return None


def _strides_of(meta: Any) -> tuple[int, ...] | None:
    """Eager's strides of a result, None where they are a fresh tensor's: exactly, size-1 dims too
    (``2.0 * x`` of a ``[4, 1]`` transposed view keeps its strides ``(1, 4)``; lazy fuzzer seed
    20271023, program 2027102300140 read ``(1, 1)``)."""
    return _view_strides(meta)


def _is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    return torch.empty_strided(shape, strides, device="meta").is_contiguous()


def _view_strides(meta: Any) -> tuple[int, ...] | None:
    """A view's strides exactly (a contiguous one whose size-1 dims keep other strides than a fresh
    tensor's: ``x.T`` of an [n, 1] value), None where they are a fresh tensor's."""
    if not isinstance(meta, torch.Tensor):
        return None
    strides = tuple(meta.stride())
    return None if strides == tuple(torch.empty(meta.shape, device="meta").stride()) else strides


# ---- records, views and writes ------------------------------------------------------------------
def _build(func: Any, entry: tuple[Any, Callable[..., Any]], args: tuple, kwargs: dict, stream: OperationStream) -> Any:
    """Operands as expressions, then the op's builder (``entry``: the registry's op and builder);
    redone if converting an operand flushed the stream (a read of a tensor with a pending in-place
    write): no operand keeps a stale leaf. Numbers as CPU eager rounds them (``scalars_as_cpu_eager``)."""
    builder = entry[1]
    if stream.on_cpu and func in _CPU_ROUNDS:
        dtypes = {t.dtype for t in _tensors_and_lazies((args, kwargs))}
        args = tuple(scalars_as_cpu_eager(list(args), dtypes))
        kwargs = dict(zip(kwargs, scalars_as_cpu_eager(list(kwargs.values()), dtypes)))
    while True:
        epoch = stream.epoch
        exprs = [_expr_of(a, stream, (func, args, k)) for k, a in enumerate(args)]
        kw = {k: _expr_of(v, stream) for k, v in kwargs.items()}
        if stream.epoch == epoch:
            return builder(*exprs, **kw)


#: the dtypes CPU eager casts a Python number operand to (see ``Front.cpu_rounds_numbers``)
_HALVES = frozenset({torch.float16, torch.bfloat16})


def scalars_as_cpu_eager(values: list[Any], dtypes: set[torch.dtype]) -> list[Any]:
    """An op's operands with each Python number as CPU eager computes with it, where the op's
    tensors are all float16 or all bfloat16 and the op is one of those that cast it
    (``Front.cpu_rounds_numbers``): ``x - 0.387`` subtracts ``0.387`` rounded to ``x``'s dtype,
    so it is exactly 0 where ``x`` holds that value, as on CPU (CUDA subtracts the float32 value;
    so does a kernel on a GPU). A number the cast keeps stays as it is (an int stays an int).

    Example:
        >>> import torch
        >>> scalars_as_cpu_eager([0.1, 2], {torch.bfloat16})
        [0.10009765625, 2]
    """
    if len(dtypes) != 1 or (dtype := next(iter(dtypes))) not in _HALVES:
        return values
    return [_rounded(v, dtype) if type(v) in (int, float) else v for v in values]


def _half(a: Any) -> bool:
    return type(a) is LazyTensor and a._info.dtype in _HALVES


@functools.lru_cache(maxsize=4096, typed=True)
def _rounded(v: float, dtype: torch.dtype) -> float:
    r = torch.tensor(v, dtype=torch.float64).to(dtype).item()
    return v if r == v else r


def _tensors_and_lazies(obj: Any) -> list[Any]:
    if isinstance(obj, (LazyTensor, torch.Tensor)):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors_and_lazies(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors_and_lazies(o)]
    return []


def _lazies(obj: Any) -> list[LazyTensor]:
    """The lazy values among a call's arguments (nested lists and dicts included)."""
    return [a for a in _tensors_and_lazies(obj) if isinstance(a, LazyTensor)]


def _expr_of(x: Any, stream: OperationStream, read_by: tuple[Any, tuple, int] | None = None) -> Any:
    """An operand as an expression; under ``no_grad``, one that requires grad is read detached.
    ``read_by``: the call reading it (``OperationStream.leaf``)."""
    if isinstance(x, LazyTensor):
        e = x._as_expr(read_by)
        return e if not x.requires_grad or torch.is_grad_enabled() else stream.stopped(e)
    if isinstance(x, torch.Tensor):
        if x.device != stream.device:
            raise Unsupported
        e = stream.leaf(x, read_by)
        return e if not x.requires_grad or torch.is_grad_enabled() else stream.stopped(e)
    if isinstance(x, (list, tuple)) and any(isinstance(v, (LazyTensor, torch.Tensor)) for v in x):
        return type(x)(_expr_of(v, stream) for v in x)
    return x


def _basic_view(func: Any, args: tuple) -> bool:
    """Is this call a view in torch? Indexing with tensors or lists is a gather (a copy)."""
    if func is not torch.Tensor.__getitem__:
        return not any(isinstance(a, (LazyTensor, torch.Tensor)) for a in args[1:])
    key = args[1] if isinstance(args[1], tuple) else (args[1],)
    return all(k is None or k is Ellipsis or isinstance(k, (int, slice)) and not isinstance(k, bool) for k in key)


def _wrap_view(out: Any, base: LazyTensor, fusion: Fusion) -> Any:
    if isinstance(out, torch.Tensor) and out is base._value:
        return base  # torch gave the tensor itself back (a no-op view)
    return _wrap(out, fusion)


def _view(func: Any, args: tuple, kwargs: dict, fusion: Fusion) -> Any:
    """Views of materialized values are real views (free). Of a pending value, a view the
    registry records is an alias: a lazy value reading the recorded expression, made a real view
    of the root's buffer at the flush; any other view (several results, a layout that is not
    eager's) materializes the value first."""
    base = args[0]
    stream = base._stream
    if base.is_pending:
        meta = _meta_result(func, args, kwargs)
        entry = REGISTRY.torch.get(func)
        alias = func in (torch.Tensor.detach, torch.detach)
        if isinstance(meta, torch.Tensor) and (entry is not None or alias) and fusion.config.enabled:
            try:  # a detached alias reads its root's leaves detached; a view requires grad as its root
                expr = stream.stopped(base._expr) if alias else _build(func, entry, args, kwargs, stream)  # type: ignore[index]
                grad = not alias and base.requires_grad
                view = stream.record(expr, grad) if isinstance(expr, Expr) and base.is_pending else None
            except (Unsupported, RtxError):
                view = None
            if view is not None and _agrees(view, meta) and func in torchsem.LAYOUT_SENSITIVE and not meta._is_view():
                view._strides = _strides_of(meta)  # eager copies (a reshape of another layout): a value of its own
                return view
            if view is not None and _agrees(view, meta):
                view._base = base._base if base._base is not None else base
                # (made as eager made it, with grad on or off: a view made in no_grad mode may not be
                # written in place with grad on)
                view._chain = (*base._chain, (func, args[1:], kwargs, torch.is_grad_enabled()))
                view._strides = _view_strides(meta)
                stream.views.append(weakref.ref(view))
                return view
        base._real(f"view {_name(func)} of a pending value")
    real = base._real(f"view {_name(func)}")
    rest, kw = _materialize_all(args[1:], kwargs, "view")
    with torch._C.DisableTorchFunctionSubclass():
        out = func(real, *rest, **kw)
    return _wrap_view(out, base, fusion)


def _contiguous(base: Any, rest: tuple, kwargs: dict) -> Any:
    """``contiguous()``: the value itself when eager's is contiguous, else a copy."""
    if not isinstance(base, LazyTensor):
        return torch.Tensor.contiguous(base, *rest, **kwargs)
    if base.is_pending:
        if base._home is None and (base._strides is None or _is_contiguous(base._info.shape, base._strides)):
            return base
        if base._home is not None and _contiguous_strides(base._home) is None:
            return base
        # a value of its own: equal expressions get their own buffer at the flush
        return base._stream.record(_expr_of(base, base._stream), base.requires_grad)
    real = base._real("contiguous()")
    with torch._C.DisableTorchFunctionSubclass():
        out = real.contiguous(*rest, **kwargs)
    return _wrap_view(out, base, base._stream.fusion)


def _partly_overlapping(target: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Does an operand share memory with ``target`` without being the same view of it (torch
    refuses some such writes and orders others: eager decides)?"""
    key = _storage_key(target)
    with torch._C.DisableTorchFunctionSubclass():
        here = (target.data_ptr(), tuple(target.shape), tuple(target.stride()))
        for a in _tensors_and_lazies((args[1:], kwargs)):
            t = a._value if isinstance(a, LazyTensor) else a
            if t is None or t is target or _storage_key(t) != key:
                continue
            if (t.data_ptr(), tuple(t.shape), tuple(t.stride())) != here:
                return True
    return False


def _inplace(func: Any, args: tuple, kwargs: dict, fusion: Fusion) -> Any:
    """``a.add_(b)``: ``a + b`` (cast back to a's dtype) becomes a's pending value and, at the
    next flush, its tensor's content. Writes the registry cannot compute, writes to a value with
    views, writes with partly overlapping operands and ``out=`` run eagerly after a flush.

    A write to a tensor that pending ops read is a sync point (they run first, on the old
    content, as in eager); later reads of the tensor see the pending value; a read of
    another view of the same storage flushes first.
    """
    target, plain = args[0], None
    if isinstance(target, torch.Tensor) and not isinstance(target, LazyTensor):
        plain, target = target, fusion.lazy(target)  # a plain tensor written with lazy operands
        args = (target, *args[1:])
    if not isinstance(target, LazyTensor):
        return _eager_write(func, args, kwargs, fusion, plain)
    stream = target._stream
    oop = torchsem.out_of_place(func, kwargs)
    entry = REGISTRY.torch.get(oop[0]) if oop is not None else None
    if entry is None or not fusion.config.enabled or target._stream.fusion is not fusion:
        return _eager_write(func, args, kwargs, fusion, plain)
    if stream.has_views(target):
        stream.flush("in-place write to a value with views")
    lands = target._home if target.is_pending else target._value
    if lands is not None and _shared_storage(lands):  # a view made before the stream saw it reads it
        return _eager_write(func, args, kwargs, fusion, plain)
    if lands is not None and _autograd_checks(lands):  # a leaf or a view that requires grad: torch decides
        return _eager_write(func, args, kwargs, fusion, plain)
    if not target.is_pending:
        # operands partly overlapping the target, or a target whose elements share memory
        # (an expanded view: torch refuses to write it): torch decides, eagerly
        if _partly_overlapping(target._value, args, kwargs) or _internal_overlap(target._value):  # type: ignore[arg-type]
            return _eager_write(func, args, kwargs, fusion, plain)
        if stream.reads(target._value):  # type: ignore[arg-type]
            stream.flush("in-place write to a tensor with pending readers")
    result = _nested(oop[0], args, oop[1])  # type: ignore[index]
    if not isinstance(result, LazyTensor) or not result.is_pending or result.shape != target.shape:
        return _eager_write(func, args, kwargs, fusion, plain)  # eager decides (or raises torch's error)
    if result.dtype != target.dtype:
        if not torch.can_cast(result.dtype, target.dtype):
            return _eager_write(func, args, kwargs, fusion, plain)
        result = _nested(torch.Tensor.to, (result, target.dtype))
    if result is target:  # an identity (eval-mode dropout): nothing to write
        return plain if plain is not None else target
    if plain is not None and torch.is_grad_enabled() and (plain.requires_grad or result._grad):
        # a plain tensor's autograd history is torch's: eager's write gives it the new one (p += x,
        # x requiring grad: p requires grad from here, and a plain op reading p differentiates to x)
        return _eager_write(func, args, kwargs, fusion, plain)
    if target.is_pending and target._grad and not result._grad:
        # under no_grad, or an op with no derivative (logical_not_): eager keeps the value's history
        # (a pending one: what the recorded ops made it) with the new values: the real tensor's
        return _eager_write(func, args, kwargs, fusion, plain)
    home = target._home if target.is_pending else target._value
    target._expr, target._info, target._value, target._grad = result._expr, result._info, None, result._grad
    if home is not None:
        target._home, target._strides = home, _contiguous_strides(home)
        stream.write_home(home, target)
    return plain if plain is not None else target


def _autograd_checks(t: torch.Tensor) -> bool:
    """Does autograd check an in-place write to ``t`` (it refuses one to a leaf that requires grad,
    and rewrites the history of a view's base)? Eager's write then, with eager's answer."""
    return t.requires_grad and torch.is_grad_enabled() and (t.is_leaf or t._base is not None)


def _shared_storage(t: torch.Tensor) -> bool:
    """Does another tensor hold ``t``'s memory (a view made before the stream met ``t``, or after
    ``.torch()`` handed it out)? A pending write into ``t`` would leave reads through it stale,
    and plain reads cannot be intercepted: such a write runs eagerly. (torch counts the holders
    of a storage; the probe's own reference is one of them.)"""
    count = getattr(torch._C, "_storage_Use_Count", None)
    with torch._C.DisableTorchFunctionSubclass():
        storage = t.untyped_storage()
    return count is None or count(storage._cdata) > 2


def _internal_overlap(t: torch.Tensor) -> bool:
    """May two elements of ``t`` share memory (torch's check: 0 no, 1 yes, 2 cannot tell)?"""
    with torch._C.DisableTorchFunctionSubclass():
        return torch._debug_has_internal_overlap(t) != 0


def _eager_write(func: Any, args: tuple, kwargs: dict, fusion: Fusion, plain: torch.Tensor | None) -> Any:
    """A write the stream does not record: everything pending runs first, then torch writes."""
    for s in list(fusion._streams.values()):
        s.flush(f"in-place {_name(func)} (run eagerly)")
    real_args, real_kwargs = _materialize_all(args, kwargs, "in-place write")
    _before_write((real_args[:1], real_kwargs.get("out")))
    out = func(*real_args, **real_kwargs)
    fusion.eager_ops += 1
    nbytes = sum(t.numel() * t.element_size() for t in _tensors((real_args, real_kwargs)))
    fusion._stats.record(1, 0, 1, nbytes, nbytes)
    for lt in _tensors_and_lazies((args, kwargs)):  # set_/resize_ may change what a value is
        if isinstance(lt, LazyTensor) and lt._value is not None:
            lt._info = Info.tensor(tuple(lt._value.shape), lt._value.dtype)
            lt._strides = _contiguous_strides(lt._value)
    target = args[0]
    if out is None or not isinstance(out, torch.Tensor) or out is not real_args[0]:
        return _wrap(out, fusion)
    return plain if plain is not None else target


# operators: dunders are looked up on the class, not through __getattr__
def _dunder(name: str) -> Callable[..., Any]:
    fn = getattr(torch.Tensor, name)
    dispatch = LazyTensor.__torch_function__
    return lambda self, *args: dispatch(fn, _TYPES, (self, *args))


_TYPES = (LazyTensor,)


for _d in (  # the operators an Expr has (one list, in expr.py), and what only a tensor has
    *(f"__{n}__" for n in BINARY_OPERATORS),
    *(f"__r{n}__" for n in BINARY_OPERATORS),
    *torchsem.INPLACE_DUNDERS,
    *(f"__{n}__" for n in (*UNARY_OPERATORS, *COMPARISONS, "getitem", "setitem", "lshift", "rshift", "pos")),
):
    if hasattr(torch.Tensor, _d):
        setattr(LazyTensor, _d, _dunder(_d))
LazyTensor.__hash__ = object.__hash__  # type: ignore[method-assign,assignment]


_default: Fusion | None = None


def default_fusion() -> Fusion:
    """The process-wide Fusion behind rx.lazy / rx.sync (rx.fusion_stats() counts its launches too)."""
    global _default
    if _default is None:
        _default = Fusion()
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
