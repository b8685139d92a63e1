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


_X, _T, _QKV = torch.randn(3, 5), torch.tensor([0, 2, 4]), torch.randn(1, 1, 3, 4)
_q = rx.var("q")
# (what the user wrote, the error class, words of its message): each fell through to a Python
# error from inside rtxdsl, or was silently coerced or accepted, until an outside probe of the API
MISTAKES = {
    # switches take bools: 'no' is truthy, and a string or a number was read as its truth value
    "keepdim as a string": (lambda: rx.sum(x, -1, keepdim="no"), rx.RtxError, "sum: keepdim must be True or False"),
    "a flag of contract": (lambda: rx.contract(x, b, ta=1), rx.RtxError, "contract: ta must be True or False"),
    "rope's interleaved": (lambda: rx.rope(x, b, b, interleaved="yes"), rx.RtxError, "rope: interleaved must be"),
    # sizes and axes take ints: a float was truncated, a string raised ValueError inside
    "a float in a shape": (lambda: rx.reshape(x, (2.0, 6)), rx.RtxError, "reshape: shape must be an int, got 2.0"),
    "mrope's sections": (lambda: rx.mrope(x, b, b, (1.5, 2.5)), rx.RtxError, "mrope: sections must be an int"),
    "a flip's axis None": (lambda: rx.flip(x, None), rx.RtxError, "flip: axis"),
    "a flip of one axis twice": (lambda: rx.flip(x, (0, 0)), rx.ShapeError, "names a dim more than once"),
    # axis and dim: one of them (dim was taken silently)
    "softmax's axis and dim": (lambda: rx.softmax(x, axis=0, dim=1), rx.RtxError, "give axis or dim, not both"),
    "cat's axis and dim": (lambda: rx.cat([x, b], axis=0, dim=1), rx.RtxError, "give axis or dim, not both"),
    # a number where a tensor is read (ValueError: not enough values to unpack)
    "a number as a matrix": (lambda: x @ 1.0, rx.RtxError, "matmul: b must be a tensor expression, got 1.0"),
    "a number as an index": (lambda: rx.gather(x, 0), rx.RtxError, "gather: index must be a tensor expression"),
    "a number as a weight": (lambda: rx.linear(x, 2.0), rx.RtxError, "linear: weight must be a tensor expression"),
    # score and mask functions of the wrong arity (TypeError from inside)
    "a score_mod of one argument": (
        lambda: rx.attention(_q, x, b, score_mod=lambda s: s),
        rx.RtxError,
        r"score_mod must take \(s, b, h",
    ),
    "a mask_mod of two arguments": (
        lambda: rx.attention(_q, x, b, mask_mod=lambda i, j: i),
        rx.RtxError,
        r"mask_mod must take \(b, h, q_idx",
    ),
    # a reference model's head is (h, w, bias)
    "a ref of one tensor": (
        lambda: rx.preference_outputs("dpo", x, b, _q, ref=(x,)),
        rx.RtxError,
        r"ref must be the reference model's",
    ),
    # an expression is not iterable (list() never ended)
    "list of an expression": (lambda: list(x), TypeError, "not iterable"),
    "a reserved input name": (lambda: rx.var("_rng0"), rx.RtxError, "reserved: .* random seeds"),
    # a string is no operand: the op's own check names the argument ("eq: cannot use str")
    "a bare word for a choice": (lambda: rx.parse("gelu(x, approximate=tanh)"), rx.ParseError, "gelu: approximate"),
    "a bare word for a switch": (lambda: rx.parse("rope(x, c, s, interleaved=yes)"), rx.ParseError, "interleaved"),
    # at the call
    "integer logits": (
        lambda: rx.compile(rx.cross_entropy(x, b))(x=_X.long(), b=_T),
        rx.UnsupportedDtypeError,
        "cross_entropy: logits must be floating point",
    ),  # (torch: not implemented for 'Long')
    "ignore_index with probabilities": (
        lambda: rx.compile(rx.cross_entropy(x, b, ignore_index=1))(x=_X, b=_X.softmax(-1)),
        rx.RtxError,
        r"ignore_index \(1\) is not supported for class-probability targets",
    ),
    "a half mask for float scores": (
        lambda: rx.compile(rx.attention(_q, x, b, attn_mask=rx.var("m")))(
            q=_QKV, x=_QKV, b=_QKV, m=torch.zeros(3, 3).half()
        ),
        rx.DtypeMismatchError,
        "attn_mask is torch.float16; as SDPA's, it must be bool or q's dtype",
    ),
    "an unsqueeze past the rank": (
        lambda: rx.compile(rx.mrope(x, b, b, (1, 1, 1), unsqueeze_dim=9))(
            x=torch.randn(1, 2, 3, 6), b=torch.randn(3, 1, 3, 6)
        ),
        rx.ShapeError,
        "axis 9 is out of range",
    ),
    "a sparse input": (lambda: rx.compile(x * 2)(x=_X.to_sparse()), rx.RtxError, "input 'x' is a sparse_coo tensor"),
    "a sparse lazy tensor": (lambda: rx.Fusion().lazy(_X.to_sparse()), rx.RtxError, "dense"),
    "a duplicate reduction axis": (
        lambda: rx.compile(rx.sum(x, axis=(0, 0)))(x=_X),
        rx.ShapeError,
        r"\(operands \[3, 5\]\): torch refuses it: dim 0 appears multiple times",
    ),
    # modules and their options
    "a norm's eps as a string": (lambda: rx.nn.RMSNorm(4, eps="a"), rx.RtxError, "RMSNorm: eps must be a python"),
    "a loss's switch as a string": (
        lambda: rx.nn.CrossEntropyLoss(return_z_loss="yes"),
        rx.RtxError,
        "return_z_loss must be True or False",
    ),
    "a negative hidden size": (lambda: rx.nn.DyT(-1), rx.RtxError, "DyT: hidden_size must be >= 1"),
    "replace_modules of a string": (lambda: rx.nn.replace_modules("model"), rx.RtxError, "must be a torch.nn.Module"),
    "Fusion's stats": (lambda: rx.Fusion(stats=1), rx.RtxError, "needs a FusionStats"),
    "memory_trace of a string": (lambda: rx.memory_trace("k", x=_X), rx.RtxError, "kernel must be an rx.Kernel"),
    # config fields take their own type (pydantic coerced "8", 8.0, True; "off" was truthy)
    "a size as a string": (lambda: rx.FusionConfig(cache_size="8"), rx.ConfigError, "cache_size"),
    "a switch as a string": (lambda: rx.FusionConfig(enabled="off"), rx.ConfigError, "enabled"),
    "a copy skipping validation": (
        lambda: rx.FusionConfig().model_copy(update={"cache_size": -1}),
        rx.ConfigError,
        "cache_size must be >= 1",
    ),
    "a field set on a frozen config": (
        lambda: setattr(rx.FusionConfig(), "cache_size", 5),
        rx.ConfigError,
        "frozen: cache_size cannot be set",
    ),
    "pydantic's own validation": (
        lambda: rx.FusionConfig.model_validate({"cache_size": -1}),
        rx.ConfigError,
        "cache_size must be >= 1",
    ),
    "an empty cache_dir": (lambda: rx.FusionConfig(cache_dir=""), rx.ConfigError, "cache_dir must name a directory"),
    "a config file of None": (lambda: rx.FusionConfig.load(None), rx.ConfigError, "path must be a str or a path"),
    # a python number where an op reads a tensor (expression fuzzer seeds 20307115, 20307348, 20308402:
    # a bare IndexError, ValueError or AttributeError from the op's shape rule or reference)
    **{
        f"a number read as a tensor by {name}": (
            lambda e=e, kw=kw: rx.compile(e)(**kw),
            rx.ShapeError,
            r"reads d = 1\.5 as a tensor: pass a tensor",
        )
        for name, e, kw in [
            ("cat", rx.cat([rx.var("d"), rx.var("d")], -1), {"d": 1.5}),
            ("matmul", rx.matmul(rx.var("d"), rx.var("c")), {"d": 1.5, "c": torch.randn(3, 2)}),
            ("rms_norm", rx.rms_norm(rx.var("d"), rx.var("c")), {"d": 1.5, "c": torch.randn(3)}),
            ("flip", rx.flip(rx.var("d"), 0), {"d": 1.5}),
            ("an index", rx.var("d")[0], {"d": 1.5}),
        ]
    },
    # an index no expression takes: the key named (x["a"] returned NotImplemented, named at compile as such)
    "a string index": (lambda: x["a"], rx.RtxError, "indexing: only slices, integers, None and .* got 'a'"),
}


@pytest.mark.parametrize("mistake", MISTAKES, ids=list(MISTAKES))
def test_a_mistake_is_named_where_it_was_made(mistake):
    call, cls, words = MISTAKES[mistake]
    with pytest.raises(cls, match=words):
        call()


def test_a_lazy_iteration_and_a_move_to_another_device_are_eagers():
    """``list()`` of a 0-d value raises as torch's (it gave []); ``.to("meta")`` moves the value
    (it was dropped: a meta tensor's ``.to("meta")`` is itself, so it read as "returns self")."""
    f = rx.Fusion()
    with pytest.raises(TypeError, match="iteration over a 0-d tensor"):
        list(f.lazy(_X).sum())
    assert [tuple(r.shape) for r in f.lazy(_X) * 2] == [(5,)] * 3
    assert (f.lazy(_X) + 1).to("meta").device.type == "meta"
    y = (f.lazy(_X) + 1).to("cpu") * 2
    torch.testing.assert_close(y.torch(), (_X + 1) * 2)
