"""The user-facing DSL: symbolic inputs, constants, ``compile`` and ``@fuse``.

Every op function (``rx.exp``, ``rx.softmax``, ...) is declared with its op in the registry
(``rtxdsl/ops``) and looked up from there by name, as are ``Expr``'s operators and methods.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch

from .config import FusionConfig
from .dtypes import check_supported
from .errors import RtxError
from .expr import Expr, Scalar, as_expr
from .ops import REGISTRY
from .runtime import Kernel, compile

_RESERVED = re.compile(r"_[gsdjp]\d+|_rng\d+")  # the VJP pass names its extra inputs and outputs so


def var(name: str, dtype: torch.dtype | None = None) -> Expr:
    """A named symbolic input: a tensor (or a python number) given at call time.

    Its dtype and shape come from the tensor given at call time; a declared ``dtype`` is
    checked then. Bound to a python number, it is a scalar argument of the kernel (like a
    constant, but a new value neither re-plans nor recompiles).

    Example:
        >>> import torch, rtxdsl as rx
        >>> x = rx.var("x", dtype=torch.float16)   # checked when the kernel is called
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise RtxError(f"input name must be a python identifier, got {name!r}")
    if _RESERVED.fullmatch(name):
        raise RtxError(
            f"input name {name!r} is reserved: gradients' (_g<k>, _s<k>, _d<k>, _j<k>, _p<k>), random seeds' (_rng<k>)"
        )
    if dtype is not None:
        if not isinstance(dtype, torch.dtype):
            raise RtxError(f"input {name!r}: dtype must be a torch.dtype, got {dtype!r}")
        check_supported(dtype, f"input {name!r}")
    return Expr("var", (), {"name": name, "dtype": dtype})


def const(value: Scalar) -> Expr:
    """A python scalar constant (passed to kernels as an argument, never baked into source).

    Example:
        >>> import rtxdsl as rx
        >>> rx.const(2.0) * rx.var("x")
        2.0 * x
    """
    if not isinstance(value, (bool, int, float)):
        raise RtxError(f"const takes a python bool, int or float, got {type(value).__name__}")
    return as_expr(value)


def function(name: str) -> Callable[..., Any]:
    """The DSL function published under ``name`` (``rx.<name>``), from the op registry."""
    fn = REGISTRY.functions.get(name)
    if fn is None:
        raise AttributeError(f"rtxdsl has no function {name!r}")
    return fn


def fuse(fn: Callable[..., Any] | None = None, *, config: FusionConfig | None = None) -> Any:
    """Decorator: parameters become vars by name; the result is a kernel called with tensors.

    Example:
        >>> import torch, rtxdsl as rx
        >>> @rx.fuse
        ... def bias_gelu(x, b):
        ...     return rx.gelu(x + b)
        >>> bias_gelu(torch.zeros(4), torch.zeros(4)).shape
        torch.Size([4])
    """

    def wrap(f: Callable[..., Any]) -> Kernel:
        if not callable(f):
            raise RtxError(f"@fuse decorates a function, got {f!r}")
        params = inspect.signature(f).parameters
        for p in params.values():
            if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                raise RtxError(f"@fuse {f.__name__}: parameter {p.name!r} must be a plain named parameter")
        out = f(*[var(p) for p in params])
        try:
            kernel = Kernel(out, config, inputs=tuple(params))  # positional order follows the signature
        except RtxError as exc:
            raise RtxError(f"@fuse {f.__name__}: {exc}") from None
        functools.update_wrapper(kernel, f)  # type: ignore[arg-type]
        return kernel

    return wrap(fn) if fn is not None else wrap


__all__ = ["compile", "const", "function", "fuse", "var"]
