"""Every user mistake is an RtxError (a ValueError) naming the input, op or field at fault."""

from __future__ import annotations

import pytest
import torch

import rtxdsl as rx

x, b = rx.var("x"), rx.var("b")


def _raises(cls, match, fn, *args, **kwargs):
    with pytest.raises(cls, match=match) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, rx.RtxError) and isinstance(info.value, ValueError)


def test_unknown_input():
    _raises(
        rx.UnknownInputError, "unknown input 'c'", rx.compile(x + b), x=torch.ones(2), b=torch.ones(2), c=torch.ones(2)
    )


def test_missing_input():
    _raises(rx.MissingInputError, "missing input 'b'", rx.compile(x + b), x=torch.ones(2))


def test_input_given_twice_and_too_many_positional():
    k = rx.compile(x + b)
    _raises(rx.RtxError, "'x' given twice", k, torch.ones(2), x=torch.ones(2))
    _raises(rx.RtxError, "takes 2 inputs", k, torch.ones(2), torch.ones(2), torch.ones(2))


def test_non_tensor_input():
    _raises(rx.RtxError, "input 'b' must be a torch.Tensor", rx.compile(x + b), x=torch.ones(2), b=[1.0, 2.0])


def test_declared_dtype_mismatch():
    h = rx.var("h", dtype=torch.float16)
    _raises(
        rx.DtypeMismatchError, "input 'h' was declared float16 but got a float32", rx.compile(h * 2), h=torch.ones(3)
    )


def test_shapes_that_do_not_broadcast():
    _raises(rx.ShapeError, "op 'add'", rx.compile(x + b), x=torch.ones(3), b=torch.ones(4))


def test_inputs_on_different_devices():
    meta = torch.ones(3, device="meta")
    _raises(rx.DeviceMismatchError, "'x' \\(cpu\\) and 'b' \\(meta\\)", rx.compile(x + b), x=torch.ones(3), b=meta)


def test_unsupported_dtype():
    _raises(
        rx.UnsupportedDtypeError,
        "input 'x' has dtype torch.complex64",
        rx.compile(x + 1),
        x=torch.ones(3, dtype=torch.complex64),
    )
    _raises(
        rx.UnsupportedDtypeError,
        "op 'and' does not accept float32",
        rx.compile(x & b),
        x=torch.ones(3),
        b=torch.ones(3),
    )
    _raises(
        rx.UnsupportedDtypeError,
        "op 'softmax' does not accept int64",
        rx.compile(rx.softmax(x)),
        x=torch.ones(3, dtype=torch.int64),
    )
    _raises(
        rx.UnsupportedDtypeError,
        "op 'gelu' does not accept int32",
        rx.compile(rx.gelu(x) + b),
        x=torch.ones(3, dtype=torch.int32),
        b=torch.ones(3, dtype=torch.int32),
    )


def test_axis_out_of_range():
    _raises(rx.ShapeError, "op 'sum'", rx.compile(rx.sum(x, axis=3)), x=torch.ones(2, 3))


def test_expression_misuse():
    _raises(rx.RtxError, "no truth value", bool, x > 1)
    _raises(rx.RtxError, "cannot be embedded", lambda: x + torch.ones(2))
    _raises(rx.RtxError, "python identifier", rx.var, "not a name")
    _raises(rx.RtxError, "approximate", rx.gelu, x, approximate="fast")
    _raises(rx.RtxError, "axis must be", rx.sum, x, axis="last")
    _raises(rx.UnsupportedDtypeError, "cast target", rx.cast, x, torch.complex64)
    _raises(rx.RtxError, "declared twice", rx.compile, rx.var("x", dtype=torch.float16) + x)


def test_backend_triton_needs_cuda():
    k = rx.compile(x + 1, config=rx.FusionConfig(backend="triton"))
    _raises(rx.BackendError, "backend 'triton'", k, x=torch.ones(2))
