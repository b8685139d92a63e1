"""Room for recursion over deep expression DAGs.

Code generation and scheduling follow an expression's operands recursively. A long dependent
chain (sparsemax's bisection: ~160 primitives deep, its gradient twice that) is deeper than
Python's default limit of 1000 frames; since Python 3.11 a Python-to-Python call uses no C
stack, so raising the limit around these passes is safe.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

FRAMES = 50_000


def deep(fn: F) -> F:
    """Run ``fn`` with a recursion limit of at least :data:`FRAMES`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before = sys.getrecursionlimit()
        if before >= FRAMES:
            return fn(*args, **kwargs)
        sys.setrecursionlimit(FRAMES)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.setrecursionlimit(before)

    return wrapper  # type: ignore[return-value]
