"""What torch functions do to memory: which return views, which may return ``self``, which write.

The lazy stream reproduces eager aliasing from these tables (see ``lazy.py``): a view shares its
base's storage, an op that may return ``self`` returns the same object when it changes nothing,
and a write is either recorded exactly or is a sync point. Knowledge of torch only, no rtxdsl.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

#: functions whose result is a view of their first argument (torch's "view ops" list)
_VIEW_NAMES = (
    "view", "view_as", "reshape", "reshape_as", "unsqueeze", "squeeze", "expand", "expand_as", "transpose",
    "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "t", "flatten", "unflatten", "narrow", "select",
    "unbind", "split", "split_with_sizes", "tensor_split", "hsplit", "vsplit", "chunk", "diagonal", "detach",
    "alias", "as_strided", "__getitem__", "unfold", "adjoint", "view_as_real", "real",
)  # fmt: skip
#: properties whose value is a view (``t.T``, ``t.mT``): a torch function sees their getter
_VIEW_PROPERTIES = ("T", "mT", "H", "mH", "real", "imag")
VIEWS: frozenset[Any] = frozenset(
    [
        *(f for owner in (torch.Tensor, torch) for n in _VIEW_NAMES if callable(f := getattr(owner, n, None))),
        *(getattr(torch.Tensor, n).__get__ for n in _VIEW_PROPERTIES),
    ]
)
#: functions that may return their first argument itself (eager: ``x.float() is x`` for fp32 x)
MAYBE_SELF: frozenset[Any] = frozenset(
    {
        *(getattr(torch.Tensor, n) for n in ("to", "type", "type_as", "contiguous", "float", "half", "double")),
        *(getattr(torch.Tensor, n) for n in ("bfloat16", "int", "long", "short", "bool", "char", "byte")),
        F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, torch.dropout,
    }
)  # fmt: skip
#: the views whose strides depend on the base's (a copy when they cannot be a view)
LAYOUT_SENSITIVE: frozenset[Any] = frozenset(
    f for owner in (torch.Tensor, torch) for n in ("view", "view_as", "reshape", "reshape_as", "flatten", "unflatten")
    if (f := getattr(owner, n, None)) is not None
)  # fmt: skip
CONTIGUOUS = torch.Tensor.contiguous

_DUNDER_NAMES = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift")
#: in-place dunder -> its out-of-place dunder (``__iadd__`` -> ``__add__``), by function object
_IDUNDERS: dict[Any, Any] = {
    getattr(torch.Tensor, f"__i{n}__"): getattr(torch.Tensor, f"__{n}__")
    for n in _DUNDER_NAMES
    if hasattr(torch.Tensor, f"__i{n}__") and hasattr(torch.Tensor, f"__{n}__")
}
#: the in-place dunders a LazyTensor defines (python rebinds the name for missing ones)
INPLACE_DUNDERS = tuple(f"__i{n}__" for n in _DUNDER_NAMES if hasattr(torch.Tensor, f"__i{n}__"))
_OWNERS = (torch.Tensor, torch, F, torch._C._nn)


def _name(func: Any) -> str:
    return getattr(func, "__name__", "")


def writes(func: Any, kwargs: dict) -> bool:
    """Does this call write into a tensor argument (the first, or ``out=``)?"""
    name = _name(func)
    if func in _IDUNDERS or name == "__setitem__" or kwargs.get("inplace") is True:
        return True
    if kwargs.get("out") is not None:
        return True
    return name.endswith("_") and not name.startswith("_")


def out_of_place(func: Any, kwargs: dict) -> tuple[Callable[..., Any], dict] | None:
    """The function computing the value an in-place call writes, and its keyword arguments:
    ``Tensor.add_`` -> ``Tensor.add``, ``__itruediv__`` -> ``__truediv__``, ``F.elu(inplace=True)``
    -> ``F.elu(inplace=False)``; None when there is none (``zero_``, ``__setitem__``, ``out=``)."""
    name = _name(func)
    if kwargs.get("out") is not None:
        return None
    if kwargs.get("inplace") is True:
        return func, {**kwargs, "inplace": False}
    if func in _IDUNDERS:
        return _IDUNDERS[func], kwargs
    if not name.endswith("_") or name.startswith("_"):
        return None
    plain = name[:-1]
    for owner in _OWNERS:
        if getattr(owner, name, None) is func:
            found = getattr(owner, plain, None)
            return (found, kwargs) if callable(found) else None
    return None


# ---- what eager's backward saves -------------------------------------------------------------------
#: functions whose backward saves none of their tensor operands' values (a sum's gradient is the
#: cotangent broadcast, ``where`` saves its mask, ``relu`` / ``sigmoid`` / ``softmax`` their results,
#: dropout its mask; a comparison has no backward): eager lets a write to such an operand between
#: forward and backward go
_UNSAVED_NAMES = (
    "add", "sub", "subtract", "rsub", "neg", "negative", "where", "masked_fill", "clone", "sum", "mean", "relu",
    "sigmoid", "tanh", "exp", "exp2", "expm1", "sqrt", "rsqrt", "reciprocal", "softmax", "log_softmax", "dropout",
    "to", "float", "half", "bfloat16", "double", "type_as", "__add__", "__radd__", "__sub__", "__rsub__", "__neg__",
    "__rtruediv__", "gt", "lt", "ge", "le", "eq", "ne", "greater", "less", "greater_equal", "less_equal",
    "not_equal", "__gt__", "__lt__", "__ge__", "__le__", "__eq__", "__ne__", "isnan", "isinf", "isfinite", "sign",
)  # fmt: skip
_UNSAVED: frozenset[Any] = frozenset(
    f for owner in _OWNERS for n in _UNSAVED_NAMES if callable(f := getattr(owner, n, None))
)
#: products: an operand is saved for the other's gradient only (``x * 2`` saves nothing)
_PRODUCTS: frozenset[Any] = frozenset(
    f for owner in _OWNERS for n in ("mul", "multiply", "__mul__", "__rmul__") if callable(f := getattr(owner, n, None))
)
#: quotients: the numerator is saved for the denominator's gradient only, the denominator always
_QUOTIENTS: frozenset[Any] = frozenset(
    f
    for owner in _OWNERS
    for n in ("div", "divide", "true_divide", "__truediv__")
    if callable(f := getattr(owner, n, None))
)


def saves(func: Any, args: tuple, k: int) -> bool:
    """Does eager's ``func(*args)`` save positional operand ``k``'s values for its backward? A
    function outside these tables is taken to save every operand.

    Example:
        >>> import torch
        >>> x = torch.ones(2, requires_grad=True)
        >>> saves(torch.where, (x > 0, x, x), 1), saves(torch.sin, (x,), 0), saves(torch.mul, (x, 2.0), 0)
        (False, True, False)
    """
    if func in _UNSAVED:
        return False
    if func in _PRODUCTS or func in _QUOTIENTS and k == 0:
        other = args[1 - k] if len(args) == 2 else None
        return getattr(other, "requires_grad", False) is True  # (a tensor, lazy or not, not a number)
    return True
