"""Leaves: named inputs and python-scalar constants (no computation; rx.var / rx.const build them)."""

from __future__ import annotations

from typing import Any

from ..registry import OpDef, OpKind, register


def _leaf_ref(*_: Any, **__: Any) -> Any:
    raise AssertionError("leaves are bound, not evaluated")


# a named input tensor
register(OpDef(name="var", kind=OpKind.LEAF, arity=0, ref=_leaf_ref, eager_launches=0))
# a python scalar, passed as a kernel argument
register(OpDef(name="const", kind=OpKind.LEAF, arity=0, ref=_leaf_ref, eager_launches=0))
