"""rtxdsl: small tensor expressions in, fused Triton kernels out.

Example:
    >>> import torch, rtxdsl as rx
    >>> x, b = rx.var("x"), rx.var("b")
    >>> k = rx.compile(rx.relu(x * b + 1.0))
    >>> k(x=torch.ones(4), b=torch.ones(4)).tolist()
    [2.0, 2.0, 2.0, 2.0]
"""

from __future__ import annotations

import os as _os

if "TRITON_INTERPRET" not in _os.environ:
    # Triton's interpreter (CPU tensors) needs this before kernels are created; only
    # where no GPU exists, so compiled CUDA kernels stay compiled elsewhere.
    import torch as _torch

    if not _torch.cuda.is_available():
        _os.environ["TRITON_INTERPRET"] = "1"

from .cache import CacheStats, cache_stats  # noqa: E402
from .config import FusionConfig, get_config, set_config  # noqa: E402
from .dsl import (  # noqa: E402
    abs,
    amax,
    amin,
    cast,
    ceil,
    clamp,
    const,
    cos,
    elu,
    erf,
    exp,
    exp2,
    expm1,
    floor,
    fuse,
    gelu,
    layer_norm,
    leaky_relu,
    log,
    log1p,
    log2,
    log_softmax,
    logsumexp,
    max,
    maximum,
    mean,
    min,
    minimum,
    neg,
    pow,
    reciprocal,
    relu,
    rms_norm,
    round,
    rsqrt,
    sigmoid,
    sign,
    silu,
    sin,
    softmax,
    softplus,
    sqrt,
    std,
    sum,
    swiglu,
    tan,
    tanh,
    trunc,
    var,
    variance,
    where,
)
from .errors import (  # noqa: E402
    BackendError,
    ConfigError,
    DeviceMismatchError,
    DtypeMismatchError,
    MissingInputError,
    ParseError,
    RtxError,
    ShapeError,
    UnknownInputError,
    UnsupportedDtypeError,
)
from .expr import Expr  # noqa: E402
from .lazy import Fusion, LazyTensor, OperationStream, lazy, sync  # noqa: E402
from .parse import parse  # noqa: E402
from .runtime import Kernel, compile  # noqa: E402
from .stats import FusionStatsSnapshot, fusion_stats, reset_fusion_stats  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "CacheStats",
    "ConfigError",
    "DeviceMismatchError",
    "DtypeMismatchError",
    "Expr",
    "Fusion",
    "FusionConfig",
    "LazyTensor",
    "OperationStream",
    "lazy",
    "sync",
    "FusionStatsSnapshot",
    "Kernel",
    "MissingInputError",
    "ParseError",
    "RtxError",
    "ShapeError",
    "UnknownInputError",
    "UnsupportedDtypeError",
    "abs",
    "amax",
    "amin",
    "cache_stats",
    "cast",
    "ceil",
    "clamp",
    "compile",
    "const",
    "cos",
    "elu",
    "erf",
    "exp",
    "exp2",
    "expm1",
    "floor",
    "fuse",
    "fusion_stats",
    "gelu",
    "get_config",
    "layer_norm",
    "leaky_relu",
    "log",
    "log1p",
    "log2",
    "log_softmax",
    "logsumexp",
    "max",
    "maximum",
    "mean",
    "min",
    "minimum",
    "neg",
    "parse",
    "pow",
    "reciprocal",
    "relu",
    "reset_fusion_stats",
    "rms_norm",
    "round",
    "rsqrt",
    "set_config",
    "sigmoid",
    "sign",
    "silu",
    "sin",
    "softmax",
    "softplus",
    "sqrt",
    "std",
    "sum",
    "swiglu",
    "tan",
    "tanh",
    "trunc",
    "var",
    "variance",
    "where",
]
