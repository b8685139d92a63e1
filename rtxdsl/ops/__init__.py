"""The op registry: every op is declared once, in the modules beside this one.

``base`` holds the table's types; ``leaf``, ``elementwise``, ``reduction`` and ``composite``
fill it (``movement`` adds slices, joins, gathers and positions, ``random`` Philox numbers and
dropout, ``llm`` cross-entropy and rotary embeddings, ``attention`` scaled dot-product
attention, ``distill`` a linear head's float32 logits and the distillation losses over two
heads). Importing this package loads every declaration.
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
    AxisRule,
    Coords,
    DtypeRule,
    EmitCtx,
    Front,
    OpDef,
    OpKind,
    Pattern,
    ReduceSpec,
    Registry,
    RemapCtx,
    Unsupported,
    apply_ref,
    as_tensors,
    category,
    register,
)
from . import (  # noqa: F401  (fill the registry)
    attention,
    composite,
    contraction,
    distill,
    divergence,
    elementwise,
    leaf,
    llm,
    movement,
    random,
    reduction,
)

__all__ = [
    "AxisRule",
    "ANY",
    "BOOL",
    "FLOAT",
    "FLOATING",
    "INT",
    "INTEGRAL",
    "NUMERIC",
    "REGISTRY",
    "Coords",
    "DtypeRule",
    "EmitCtx",
    "Front",
    "OpDef",
    "OpKind",
    "Pattern",
    "ReduceSpec",
    "RemapCtx",
    "Registry",
    "Unsupported",
    "apply_ref",
    "as_tensors",
    "category",
    "register",
]
