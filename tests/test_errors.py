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


# ---- cross-entropy's target: what the user passed, as torch words it ---------------------------------
def test_cross_entropy_target_of_the_wrong_kind_names_the_target_and_its_dtype():
    k = rx.compile(rx.cross_entropy(x, b))
    logits = torch.randn(4, 6)
    # torch: "expected target dtype to be Long or Byte, but got Float" (not an internal broadcasting error)
    _raises(rx.RtxError, r"cross_entropy: target is torch.float32 of shape \[4\]: class indices must be int64",
            k, x=logits, b=torch.zeros(4))  # fmt: skip
    # torch: "Expected floating point type for target with class probabilities, got Long"
    _raises(rx.RtxError, r"target is torch.int64 of shape \[4, 6\], the logits' shape: class probabilities must be "
            r"floating point", k, x=logits, b=torch.zeros(4, 6, dtype=torch.int64))  # fmt: skip
    _raises(rx.RtxError, "class-index target must be int64, got torch.int32", k, x=logits, b=torch.zeros(4).int())
    probabilities = torch.softmax(torch.randn(4, 6), -1)  # a float target shaped like the logits: supported
    torch.testing.assert_close(k(x=logits, b=probabilities), torch.nn.functional.cross_entropy(logits, probabilities))


@pytest.mark.parametrize(
    ("expr", "logits", "target", "bad"),
    [
        (rx.cross_entropy(x, b), torch.randn(4, 6), torch.tensor([0, 6, -100, 2]), 6),  # "Target 6 is out of bounds."
        (rx.cross_entropy(x, b), torch.randn(4, 6), torch.tensor([0, -3, 1, 2]), -3),  # negative, not ignore_index
        (rx.cross_entropy(x, b, reduction="none"), torch.randn(2, 6, 3), torch.tensor([[0, 9, 1], [0, 0, 0]]), 9),
        (rx.cross_entropy(x, b, reduction="none"), torch.randn(6), torch.tensor(7), 7),  # unbatched
        (rx.cross_entropy(x, b, ignore_index=2), torch.randn(4, 6), torch.tensor([2, 6, 1, 2]), 6),
    ],
)
def test_cross_entropy_target_out_of_bounds_names_the_target_the_valid_range_and_the_first_bad_class(
    expr, logits, target, bad
):
    """torch: "Target 6 is out of bounds."; the value is found on the host once the kernel's flag
    says one is out of range. With several, ours is the first in the target's order (torch's
    threads report any one of them), see the linear cross-entropy test below."""
    with pytest.raises(IndexError, match=f"^Target {bad} is out of bounds.$"):  # torch's words, the same class
        torch.nn.functional.cross_entropy(logits, target, ignore_index=expr.attr("ignore_index"), reduction="none")
    _raises(rx.RtxError, r"cross_entropy: target 'b' holds a class index out of range: each must be in \[0, 6\) or "
            rf"be ignore_index \(torch: 'Target {bad} is out of bounds.'\)$",
            rx.compile(expr), x=logits, b=target)  # fmt: skip


def test_linear_cross_entropy_and_the_lazy_stream_name_the_target_too():
    k = rx.compile(rx.linear_cross_entropy(x, rx.var("w"), b))
    _raises(rx.RtxError, r"linear_cross_entropy: target 'b' holds a class index out of range: each must be in "
            r"\[0, 6\).*'Target 6 is out of bounds.'", k, x=torch.randn(4, 5), w=torch.randn(6, 5),
            b=torch.tensor([0, 6, 1, 9]))  # fmt: skip
    f = rx.Fusion()
    loss = torch.nn.functional.cross_entropy(f.lazy(torch.randn(4, 6)), f.lazy(torch.tensor([0, 7, 1, 2])))
    _raises(rx.RtxError, r"cross_entropy: target '\w+' holds a class index out of range.*'Target 7 is out", loss.torch)


def test_a_gather_index_out_of_range_names_the_first_bad_index_as_torch_does():
    """torch.gather: "index 9 is out of bounds for dimension 1 with size 7"."""
    k = rx.compile(rx.gather(x, b, -1))
    data, index = torch.randn(3, 7), torch.tensor([[0], [9], [-1]])
    with pytest.raises(RuntimeError, match="index 9 is out of bounds for dimension 1 with size 7"):
        torch.gather(data, 1, index)
    _raises(rx.RtxError, r"gather: an index in b is out of range for axis 1 of x \(size 7\): the first is 9 "
            r"\(torch: 'index 9 is out of bounds for dimension 1 with size 7'\)", k, x=data, b=index)  # fmt: skip
    # an index computed in the kernel: the host computes it the same way
    _raises(rx.RtxError, r"the first is -2 ", rx.compile(rx.gather(x, b - 3, -1)), x=data, b=torch.tensor([[1], [5]]))
