"""Triton's interpreter as rtxdsl uses it: two fixes the generated kernels need on CPU tensors, and
bounds checks of every access they make (``RTXDSL_CHECK_BOUNDS=1``, on in the test suite).

The interpreter holds bf16 values as their raw 16 bits (numpy has no bfloat16), and
:func:`install` makes it compute with them as a GPU does. Compiled kernels are unaffected.

* Its ``tl.dot`` multiplies those integers, so a bf16 GEMM computes garbage there (fp8 is
  converted first, bf16 is not): bf16 dot operands are converted to float32 first (exact, since
  a bf16 value is a float32 with a shorter mantissa).
* Its ``tl.reduce`` with a combine function of its own (rtxdsl's layer norm sums the deviations
  and their squares in one tree) calls the function once per element, from Python: about 3 s per
  launch at any size. It combines halves now, as a GPU's reduction tree does: log2(n) calls.
* Its float32 -> bf16 cast truncates, where a GPU's ``cvt.rn.bf16.f32`` (and torch) rounds to
  nearest even, and its bf16 -> float32 cast flushes subnormals to 0: both are exact now.
  Generated kernels cast with a plain ``.to(tl.bfloat16)`` (until 0.3 they rounded by hand with
  integer ops, which the GPU ran too: 80 of RMSNorm's 275 SASS instructions in bf16).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np


def _bf16_bits_to_float32(data: np.ndarray) -> np.ndarray:
    return (data.astype(np.uint32) << 16).view(np.float32)


def _float32_to_bf16_bits(data: np.ndarray) -> np.ndarray:
    """float32 values as bf16 bits, rounded to nearest even (NaN stays a quiet NaN)."""
    f = np.asarray(data, dtype=np.float32)
    bits = f.view(np.uint32)
    rne = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(f), ((bits >> 16) | np.uint32(0x40)).astype(np.uint16), rne)


def install() -> None:
    """Patch the interpreter's ``create_dot`` and ``cast_impl`` once per process (idempotent)."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None or not hasattr(interpreter, "TensorHandle") or getattr(original, "__rtxdsl__", False):
        return  # another Triton's interpreter (or patched already): left as it is
    _install_rounding(builder, interpreter)
    _install_tree_reduce(interpreter)

    @functools.wraps(original)
    def create_dot(self: Any, a: Any, b: Any, d: Any, *args: Any, **kwargs: Any) -> Any:
        if a.dtype.is_bf16() or b.dtype.is_bf16():
            a = interpreter.TensorHandle(_bf16_bits_to_float32(a.data), interpreter.tl.float32)
            b = interpreter.TensorHandle(_bf16_bits_to_float32(b.data), interpreter.tl.float32)
        return original(self, a, b, d, *args, **kwargs)

    create_dot.__rtxdsl__ = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot  # type: ignore[union-attr]


def _install_tree_reduce(interpreter: Any) -> None:
    """``tl.reduce`` with a combine function of the kernel's own reduces along an axis by combining
    its lower half with its upper half until one remains: the lower half is always the combine's
    left operand, so a combine that breaks ties to the left still does. Reductions over every axis,
    or along a length not a power of two, take the interpreter's own way."""
    ops = getattr(interpreter, "ReduceOps", None)
    original = getattr(ops, "generic_reduce", None)
    if original is None or getattr(original, "__rtxdsl__", False):
        return
    tl = interpreter.tl

    @functools.wraps(original)
    def generic_reduce(self: Any, inputs: Any) -> Any:
        shape = inputs[0].handle.data.shape
        if self.axis is None or not shape:
            return original(self, inputs)
        axis = self.axis % len(shape)
        if shape[axis] & (shape[axis] - 1):
            return original(self, inputs)
        datas = [t.handle.data for t in inputs]
        while datas[0].shape[axis] > 1:
            half = datas[0].shape[axis] // 2
            lower = [self.to_tensor(np.take(d, np.arange(half), axis), t.dtype) for d, t in zip(datas, inputs)]
            upper = [
                self.to_tensor(np.take(d, np.arange(half, 2 * half), axis), t.dtype) for d, t in zip(datas, inputs)
            ]
            ret = self.combine_fn.fn(*lower, *upper)
            ret = ret if isinstance(ret, tuple) else (ret,)
            datas = [
                np.broadcast_to(r.handle.data if isinstance(r, tl.core.tensor) else r, lower[0].handle.data.shape)
                for r in ret
            ]
        return [self.to_tensor(d if self.keep_dims else np.squeeze(d, axis), t.dtype) for d, t in zip(datas, inputs)]

    generic_reduce.__rtxdsl__ = True  # type: ignore[attr-defined]
    ops.generic_reduce = generic_reduce


def _install_rounding(builder: Any, interpreter: Any) -> None:
    """float32 -> bf16 casts (``create_fp_trunc`` and ``to(tl.bfloat16)`` go through ``cast_impl``)
    round to nearest even, and bf16 -> float32 keeps subnormals (the interpreter flushed them to
    0), as compiled kernels do."""
    original = getattr(builder, "cast_impl", None)
    if original is None:  # compiled kernels are right; say so once for interpreted ones
        logging.getLogger("rtxdsl").warning("this Triton's interpreter has no cast_impl: bf16 casts truncate there")
        return
    tl = interpreter.tl

    @functools.wraps(original)
    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_float32_to_bf16_bits(src.data), dst_type.scalar)
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:  # exact (subnormals too)
            return interpreter.TensorHandle(_bf16_bits_to_float32(np.asarray(src.data)), dst_type.scalar)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl


# ---- bounds checks: every address a kernel touches lies inside a tensor it was given ----------
#: ``RTXDSL_CHECK_BOUNDS=1``: every interpreted launch checks its loads, stores and atomics (the test
#: suite sets it). A generated kernel must compute every index in bounds or mask it; one that does
#: not reads garbage or segfaults on CPU and corrupts memory or faults on a GPU. The check names the
#: kernel, the access and the first address outside.
CHECK_BOUNDS = os.environ.get("RTXDSL_CHECK_BOUNDS", "") not in ("", "0")


class OutOfBounds(AssertionError):
    """A generated kernel touched memory outside every tensor it was given (a bug in rtxdsl)."""


#: the launch being checked: its kernel's name and each pointer argument's (name, first, end) bytes
_LAUNCH: list[tuple[str, list[tuple[str, int, int]]]] = []


def extent(t: Any) -> tuple[int, int]:
    """The bytes a tensor's elements span: ``[first, end)`` (strides may be 0 or negative)."""
    lo = hi = 0
    for size, stride in zip(t.shape, t.stride()):
        if size == 0:
            return t.data_ptr(), t.data_ptr()
        step = (size - 1) * stride * t.element_size()
        lo, hi = (lo + step, hi) if step < 0 else (lo, hi + step)
    return t.data_ptr() + lo, t.data_ptr() + hi + t.element_size()


@contextlib.contextmanager
def bounds_checked(kernel: str, names: list[str], tensors: list[Any]) -> Iterator[None]:
    """Check every access of the launch inside (``names[i]``: the pointer parameter of ``tensors[i]``)."""
    _install_bounds()
    _LAUNCH.append((kernel, [(n, *extent(t)) for n, t in zip(names, tensors)]))
    try:
        yield
    finally:
        _LAUNCH.pop()


def _check(what: str, ptrs: Any, mask: Any) -> None:
    if not _LAUNCH:
        return
    from triton.runtime import interpreter

    addresses = ptrs.data if mask is None else ptrs.data[np.asarray(mask.data).astype(bool)]
    if not addresses.size:
        return
    item = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
    flat = addresses.ravel().astype(np.int64)
    kernel, ranges = _LAUNCH[-1]
    inside = np.zeros(flat.size, dtype=bool)
    for _, lo, hi in ranges:
        inside |= (flat >= lo) & (flat + item <= hi)
    if inside.all():
        return
    bad = int(flat[~inside][0])
    near = min(ranges, key=lambda r: min(abs(bad - r[1]), abs(bad - r[2])), default=("?", 0, 0))
    raise OutOfBounds(
        f"kernel {kernel}: a {what} of {int((~inside).sum())} element(s) outside every tensor it was given "
        f"(first at byte {bad - near[1]:+d} from {near[0]}, whose {near[2] - near[1]} bytes start at 0)"
    )


def _install_bounds() -> None:
    """Wrap the interpreter's masked loads and stores and its atomics once per process."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_masked_load, "__rtxdsl__", False):
        return
    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def checked_load(self: Any, ptrs: Any, mask: Any, *args: Any) -> Any:
        _check("load", ptrs, mask)
        return load(self, ptrs, mask, *args)

    def checked_store(self: Any, ptrs: Any, value: Any, mask: Any, *args: Any) -> Any:
        _check("store", ptrs, mask)
        return store(self, ptrs, value, mask, *args)

    def checked_rmw(self: Any, op: Any, ptr: Any, val: Any, mask: Any, *args: Any) -> Any:
        _check("atomic", ptr, mask)
        return rmw(self, op, ptr, val, mask, *args)

    def checked_cas(self: Any, ptr: Any, *args: Any) -> Any:
        _check("atomic", ptr, None)
        return cas(self, ptr, *args)

    for wrapper in (checked_load, checked_store, checked_rmw, checked_cas):
        wrapper.__rtxdsl__ = True  # type: ignore[attr-defined]
    builder.create_masked_load, builder.create_masked_store = checked_load, checked_store  # type: ignore[method-assign]
    builder.create_atomic_rmw, builder.create_atomic_cas = checked_rmw, checked_cas  # type: ignore[method-assign]
