"""Drop-in fused modules (:mod:`rtxdsl.nn.modules`) and ``replace_modules`` (:mod:`rtxdsl.nn.swap`),
which fuses a torch or Hugging Face model's norms, gated MLPs, rotary embedding and loss in place.

Example:
    >>> import torch, rtxdsl as rx
    >>> rx.nn.RMSNorm(8)(torch.randn(2, 8)).shape
    torch.Size([2, 8])
"""

from __future__ import annotations

from .modules import (
    JSD,
    AddRMSNorm,
    CrossEntropyLoss,
    DyT,
    GateUpMLP,
    GeGLU,
    GroupNorm,
    KLDivLoss,
    LayerNorm,
    LinearCrossEntropyLoss,
    ModulatedRMSNorm,
    PolyNorm,
    RMSNorm,
    Sparsemax,
    SwiGLU,
    TVDLoss,
    add_rms_norm_,
    rms_norm_,
)
from .moe import moe_experts
from .swap import Replaced, causal_lm_loss, replace_modules
from .tiled import tiled_mlp

__all__ = [
    "JSD",
    "AddRMSNorm",
    "CrossEntropyLoss",
    "DyT",
    "GateUpMLP",
    "GeGLU",
    "GroupNorm",
    "KLDivLoss",
    "LayerNorm",
    "LinearCrossEntropyLoss",
    "ModulatedRMSNorm",
    "PolyNorm",
    "RMSNorm",
    "Replaced",
    "Sparsemax",
    "SwiGLU",
    "TVDLoss",
    "add_rms_norm_",
    "causal_lm_loss",
    "moe_experts",
    "replace_modules",
    "rms_norm_",
    "tiled_mlp",
]
