"""A fix to Triton's interpreter that the generated kernels need on CPU tensors.

The interpreter holds bf16 values as their raw 16 bits (numpy has no bfloat16) and its
``tl.dot`` multiplies those integers, so a bf16 GEMM computes garbage there (fp8 is converted
first, bf16 is not). :func:`install` converts bf16 dot operands to float32 — exact, since a bf16
value is a float32 with a shorter mantissa — before the interpreter's product. Compiled kernels
are unaffected.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np


def _bf16_bits_to_float32(data: np.ndarray) -> np.ndarray:
    return (data.astype(np.uint32) << 16).view(np.float32)


def install() -> None:
    """Patch the interpreter's ``create_dot`` once per process (idempotent)."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None or not hasattr(interpreter, "TensorHandle") or getattr(original, "__rtxdsl__", False):
        return  # another Triton's interpreter (or patched already): left as it is

    @functools.wraps(original)
    def create_dot(self: Any, a: Any, b: Any, d: Any, *args: Any, **kwargs: Any) -> Any:
        if a.dtype.is_bf16() or b.dtype.is_bf16():
            a = interpreter.TensorHandle(_bf16_bits_to_float32(a.data), interpreter.tl.float32)
            b = interpreter.TensorHandle(_bf16_bits_to_float32(b.data), interpreter.tl.float32)
        return original(self, a, b, d, *args, **kwargs)

    create_dot.__rtxdsl__ = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot  # type: ignore[union-attr]
