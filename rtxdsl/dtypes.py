"""Torch dtypes as rtxdsl sees them: which are supported, how a kernel computes in them."""

from __future__ import annotations

import torch

from .errors import RtxError, UnsupportedDtypeError

#: torch dtype -> Triton type name, for every dtype a kernel can load or store.
TRITON_TYPE: dict[torch.dtype, str] = {
    torch.bool: "tl.int1",
    torch.uint8: "tl.uint8",
    torch.int8: "tl.int8",
    torch.int16: "tl.int16",
    torch.int32: "tl.int32",
    torch.int64: "tl.int64",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
}

SHORT_NAME: dict[torch.dtype, str] = {dt: str(dt).removeprefix("torch.") for dt in TRITON_TYPE}

#: torch dtype -> Triton's signature type of a pointer to it (``triton.compile``'s ``*fp32``)
POINTER_TYPE: dict[torch.dtype, str] = {
    torch.bool: "*i1",
    torch.uint8: "*u8",
    torch.int8: "*i8",
    torch.int16: "*i16",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
    torch.float64: "*fp64",
}


def check_supported(dtype: torch.dtype, what: str) -> None:
    """Raise :class:`UnsupportedDtypeError` naming ``what`` unless ``dtype`` is supported."""
    if dtype not in TRITON_TYPE:
        supported = ", ".join(SHORT_NAME.values())
        raise UnsupportedDtypeError(f"{what} has dtype {dtype}, which rtxdsl does not support ({supported})")


def check_dense(t: torch.Tensor, what: str) -> None:
    """Raise :class:`RtxError` naming ``what`` unless ``t`` is a dense (strided) tensor."""
    if t.layout != torch.strided or t.is_nested:
        kind = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        raise RtxError(f"{what} is a {kind} tensor: rtxdsl reads dense (strided) tensors (.to_dense())")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel does its math in: fp32 for half types and fp32, fp64 for fp64."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def accumulator(operand: torch.dtype) -> torch.dtype:
    """A product's accumulator for ``operand`` tiles: fp32, or fp64 for fp64 operands."""
    return torch.float64 if operand == torch.float64 else torch.float32


def is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def is_int(dtype: torch.dtype) -> bool:
    """True for integer dtypes, bool excluded."""
    return not dtype.is_floating_point and dtype is not torch.bool


def lowest(dtype: torch.dtype) -> str:
    """Source text of the smallest value of ``dtype`` (the identity of max)."""
    if dtype.is_floating_point:
        return 'float("-inf")'
    if dtype is torch.bool:
        return "0"
    return str(torch.iinfo(dtype).min)


def highest(dtype: torch.dtype) -> str:
    """Source text of the largest value of ``dtype`` (the identity of min)."""
    if dtype.is_floating_point:
        return 'float("inf")'
    if dtype is torch.bool:
        return "1"
    return str(torch.iinfo(dtype).max)
