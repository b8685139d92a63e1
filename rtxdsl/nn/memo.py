"""Kernels by configuration: the one memo every ``rx.nn`` module, ``replace_modules`` and
``rx.optim`` look their kernels up in, compile-safe.

Inside ``torch.compile`` a lookup is traced, not run: Dynamo traces into a
``functools.lru_cache``'d factory even on a hit, and cannot build a ``Kernel`` (its caches and
locks are not traceable), so a factory called on the forward path broke every trace that reached
it. A hit in a plain dict is a lookup Dynamo reads as a constant (it guards on that one entry:
the dict growing later recompiles nothing). So every kernel a forward can ask for is made
*before* any trace, where the configuration is known (a module's ``attach()``, ``replace_modules``),
and the forward only ever finds it; a miss while Dynamo traces raises an ``RtxError`` naming the
configuration instead of building there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch.compiler import is_dynamo_compiling

from ..errors import RtxError
from ..runtime import Kernel


def made_once(factory: Callable[..., Kernel]) -> Callable[..., Kernel]:
    """``factory(*key)`` memoized in a plain dict by its positional arguments (a configuration of
    constants: strings, numbers, bools, dtypes, tuples of them). Call it with every argument, in
    one form, so one configuration is one key.

    Example:
        >>> import rtxdsl as rx
        >>> from rtxdsl.nn.memo import made_once
        >>> scaled = made_once(lambda s: rx.compile(rx.var("x") * s))
        >>> scaled(2.0) is scaled(2.0)
        True
    """
    made: dict[tuple[Any, ...], Kernel] = {}

    @functools.wraps(factory)
    def get(*key: Any) -> Kernel:
        kernel = made.get(key)
        if kernel is None:
            if is_dynamo_compiling():
                raise RtxError(
                    f"rtxdsl kernel {getattr(factory, '__qualname__', factory)}{key} is first asked for inside a "
                    "torch.compile trace, where no kernel can be built: make it before compiling (construct the "
                    "module, or call attach() after changing its options; replace_modules makes the loss kernels)"
                )
            kernel = made[key] = factory(*key)
        return kernel

    return get
