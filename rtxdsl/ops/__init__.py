"""The op registry: every op is declared once, in the modules beside this one.

``base`` holds the table's types; ``leaf``, ``elementwise``, ``reduction`` and ``composite``
fill it (``movement`` and ``random`` add indexing and random numbers). Importing this package
loads every declaration.
"""

from __future__ import annotations

from ..registry import (
    ANY,
    BOOL,
    FLOAT,
    FLOATING,
    INT,
    INTEGRAL,
    NUMERIC,
    REGISTRY,
    DtypeRule,
    EmitCtx,
    Front,
    OpDef,
    OpKind,
    ReduceSpec,
    Registry,
    Unsupported,
    apply_ref,
    as_tensors,
    category,
    register,
)
from . import composite, elementwise, leaf, movement, reduction  # noqa: F401  (fill the registry)

__all__ = [
    "ANY",
    "BOOL",
    "FLOAT",
    "FLOATING",
    "INT",
    "INTEGRAL",
    "NUMERIC",
    "REGISTRY",
    "DtypeRule",
    "EmitCtx",
    "Front",
    "OpDef",
    "OpKind",
    "ReduceSpec",
    "Registry",
    "Unsupported",
    "apply_ref",
    "as_tensors",
    "category",
    "register",
]
