"""rtxdsl: small tensor expressions in, fused Triton kernels out.

Example:
    >>> import torch, rtxdsl as rx
    >>> x, b = rx.var("x"), rx.var("b")
    >>> k = rx.compile(rx.relu(x * b + 1.0))
    >>> k(x=torch.ones(4), b=torch.ones(4)).tolist()
    [2.0, 2.0, 2.0, 2.0]

Op functions (``rx.exp``, ``rx.softmax``, ``rx.layer_norm``, ...) come from the op registry
(``rtxdsl/ops``), where each op is declared once.
"""

from __future__ import annotations

import os as _os

if "TRITON_INTERPRET" not in _os.environ:
    # Triton's interpreter (CPU tensors) needs this before kernels are created; only
    # where no GPU exists, so compiled CUDA kernels stay compiled elsewhere.
    import torch as _torch

    if not _torch.cuda.is_available():
        _os.environ["TRITON_INTERPRET"] = "1"

from . import nn, optim  # noqa: E402
from .cache import CacheStats, cache_stats  # noqa: E402
from .config import FusionConfig, get_config, set_config  # noqa: E402
from .dsl import const, fuse, var  # noqa: E402
from .errors import (  # noqa: E402
    BackendError,
    ConfigError,
    DeviceMismatchError,
    DtypeMismatchError,
    IndexOutOfRangeError,
    MissingInputError,
    ParseError,
    RtxError,
    ShapeError,
    UnknownInputError,
    UnsupportedDtypeError,
    ZeroDivisorError,
)
from .expr import Expr  # noqa: E402
from .lazy import Fusion, LazyTensor, OperationStream, lazy, sync  # noqa: E402
from .library import Library, LibraryError, load_library  # noqa: E402
from .ops import REGISTRY as _REGISTRY  # noqa: E402
from .ops.distill import distillation_outputs, linear_jsd  # noqa: E402
from .ops.llm import cross_entropy_outputs  # noqa: E402
from .ops.policy import grpo_outputs  # noqa: E402
from .ops.preference import kto_outputs, preference_outputs, sequence_logps  # noqa: E402
from .parse import parse  # noqa: E402
from .runtime import Kernel, compile  # noqa: E402
from .stats import FusionStatsSnapshot, fusion_stats, reset_fusion_stats  # noqa: E402
from .trace import Trace, memory_trace  # noqa: E402

__version__ = "0.2.0"

# every op function declared in the registry, under each of its public names
globals().update(_REGISTRY.functions)


def __getattr__(name: str):  # ops declared after import (a plugin module, a test)
    fn = _REGISTRY.functions.get(name)
    if fn is None:
        raise AttributeError(f"module 'rtxdsl' has no attribute {name!r}")
    return fn


def __dir__() -> list[str]:
    return sorted({*globals(), *_REGISTRY.functions})


__all__ = [
    "BackendError",
    "CacheStats",
    "ConfigError",
    "DeviceMismatchError",
    "DtypeMismatchError",
    "Expr",
    "Fusion",
    "FusionConfig",
    "FusionStatsSnapshot",
    "IndexOutOfRangeError",
    "Kernel",
    "LazyTensor",
    "Library",
    "cross_entropy_outputs",
    "distillation_outputs",
    "grpo_outputs",
    "kto_outputs",
    "linear_jsd",
    "preference_outputs",
    "sequence_logps",
    "LibraryError",
    "MissingInputError",
    "OperationStream",
    "ParseError",
    "RtxError",
    "ShapeError",
    "Trace",
    "UnknownInputError",
    "UnsupportedDtypeError",
    "ZeroDivisorError",
    "cache_stats",
    "compile",
    "const",
    "fuse",
    "fusion_stats",
    "get_config",
    "lazy",
    "memory_trace",
    "nn",
    "optim",
    "load_library",
    "parse",
    "reset_fusion_stats",
    "set_config",
    "sync",
    "var",
]
__all__ += sorted(set(_REGISTRY.functions) - set(__all__))
