"""Liger-Kernel's public names on rtxdsl kernels: a Liger user switches by changing an import.

``from rtxdsl.liger import LigerRMSNorm, LigerFusedLinearCrossEntropyLoss, ...`` gives modules
with Liger-Kernel's (0.8) constructor arguments, argument orders, flags and outputs
(``CrossEntropyOutput`` with ``.loss``, ``.z_loss``, ``.token_accuracy``, ``.predicted_tokens``), each a thin layer over
an ``rx.nn`` module or an rtxdsl expression, so kernels, derived backwards and caches are
rtxdsl's. Where Liger's and torch's orders differ, these follow Liger's (``lin_weight`` first in
the fused linear loss, ``num_channels`` first in group norm); ``rx.nn`` keeps DESIGN's.

A flag rtxdsl does not implement raises an :class:`~rtxdsl.errors.RtxError` naming it (nothing
is silently ignored): an ``accum_dtype`` other than float32 (rtxdsl accumulates in float32
always). ``use_token_scaling`` (each token's loss times its target's probability, detached) is
part of the same row kernel; a float32 ``ce_weight`` beside half logits computes the loss in
float32, as Liger's.
The chunked preference losses (``LigerFusedLinearDPOLoss``, ``...ORPOLoss``, ``...CPOLoss``,
``...SimPOLoss``, ``...KTOLoss``) are :func:`rtxdsl.ops.preference.preference_outputs` kernels,
``LigerFusedLinearGRPOLoss`` a :func:`rtxdsl.ops.policy.grpo_outputs` one, the distillation losses
(``LigerFusedLinearJSDLoss``, ``...CosineSimilarityLoss``, and ``LigerFusedLinearJSD``)
:func:`rtxdsl.ops.distill.distillation_outputs` and :func:`rtxdsl.linear_jsd` ones: no chunks, the
logits never written (a policy's and a reference model's, a student's and a teacher's, computed
tile by tile in one row kernel). ``LigerExperts`` (a mixture of experts' routed MLPs) is
:func:`rtxdsl.nn.moe_experts`' grouped GEMMs.
Liger's functional forms (``liger_rms_norm``, ``liger_cross_entropy``, ... :data:`FUNCTIONS`) are
those modules' forwards with the weights passed in.
``apply_liger_kernel_to_<model>(..., model=m)`` calls :func:`rtxdsl.nn.replace_modules` on the
instance ``m``; without ``model`` (Liger's class-level patching) every model of the family's
transformers classes is swapped once its weights are real (constructed, loaded by
``from_pretrained``, or at its first forward).

Example:
    >>> import torch
    >>> from rtxdsl.liger import LigerFusedLinearCrossEntropyLoss
    >>> loss_fn = LigerFusedLinearCrossEntropyLoss(return_z_loss=True, lse_square_scale=1e-4)
    >>> out = loss_fn(torch.randn(11, 8), torch.randn(6, 8), torch.tensor([1, 2, 3, 4, 5, -100]))
    >>> out.loss.shape, out.z_loss.shape
    (torch.Size([]), torch.Size([]))
"""

from __future__ import annotations

import ast
import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import dsl
from .errors import IndexOutOfRangeError, RtxError
from .expr import Expr
from .nn import modules as _m
from .nn.amp import autocast_projection
from .nn.memo import made_once
from .nn.moe import moe_experts as rx_moe_experts
from .nn.swap import replace_modules
from .ops import REGISTRY
from .ops.distill import distillation_outputs, hard_loss, linear_jsd
from .ops.llm import capped_logits, cross_entropy, cross_entropy_outputs, mrope, rope, z_loss_term
from .ops.policy import TOKEN_LEVEL_ONLY, grpo_outputs
from .ops.preference import kto_outputs, preference_outputs
from .runtime import Kernel, compile


@dataclass
class CrossEntropyOutput:
    """What Liger's cross-entropy losses return when an extra output is asked for."""

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None


def _init(weight: torch.Tensor | None, init_fn: str) -> None:
    """Liger's ``init_fn`` of a norm's weight (none without an affine weight: still checked)."""
    if init_fn not in ("ones", "zeros"):
        raise RtxError(f"init_fn must be 'ones' or 'zeros', got {init_fn!r}")
    if weight is not None:
        weight.data.fill_(1.0 if init_fn == "ones" else 0.0)


def _casting(casting_mode: str) -> None:
    # every mode computes in fp32 and rounds once: "llama" and "none" differ from it by roundings only
    if casting_mode not in ("llama", "gemma", "none"):
        raise RtxError(f"casting_mode must be 'llama', 'gemma' or 'none', got {casting_mode!r}")


# ---- norms ----------------------------------------------------------------------------------------------
class LigerRMSNorm(_m.RMSNorm):
    """Liger's ``LigerRMSNorm(hidden_size, eps, offset, casting_mode, init_fn, in_place, row_mode)``."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, casting_mode: str = "llama",
        init_fn: str = "ones", in_place: bool = True, row_mode: Any = None, elementwise_affine: bool = True,
    ) -> None:  # fmt: skip
        _casting(casting_mode)
        super().__init__(hidden_size, eps=eps, elementwise_affine=elementwise_affine, offset=offset)
        _init(self.weight, init_fn)
        self.casting_mode, self.in_place, self.row_mode = casting_mode, in_place, row_mode
        self.variance_epsilon = eps


class LigerRMSNormForGlm4(LigerRMSNorm):
    """Liger's ``LigerRMSNormForGlm4``: :class:`LigerRMSNorm` with ``in_place=False`` unless given."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, casting_mode: str = "llama",
        init_fn: str = "ones", in_place: bool = False, row_mode: Any = None,
    ) -> None:  # fmt: skip
        super().__init__(hidden_size, eps, offset, casting_mode, init_fn, in_place, row_mode)


class LigerFusedAddRMSNorm(_m.AddRMSNorm):
    """Liger's ``LigerFusedAddRMSNorm``: ``forward(hidden_states, residual)`` -> ``(normed, sum)``."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, casting_mode: str = "llama",
        init_fn: str = "ones", in_place: bool = False,
    ) -> None:  # fmt: skip
        _casting(casting_mode)
        super().__init__(hidden_size, eps=eps, offset=offset)
        _init(self.weight, init_fn)
        # Liger's in_place reuses dY's buffer for dX in its backward (a memory saving, the results
        # are new tensors): rtxdsl's derived backward writes dX once, so the flag changes nothing
        self.casting_mode, self.variance_epsilon, self.liger_in_place = casting_mode, eps, in_place


class LigerModulatedRMSNorm(_m.ModulatedRMSNorm):
    """Liger's ``LigerModulatedRMSNorm(hidden_size, eps, offset, casting_mode, init_fn, in_place,
    elementwise_affine)``: ``forward(hidden_states, scale, shift=None)`` is ``(1 + scale) *
    RMSNorm(x) + shift``, with Liger's broadcast of the modulation; the result has ``x``'s dtype, as
    Liger's."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, casting_mode: str = "llama",
        init_fn: str = "ones", in_place: bool = True, elementwise_affine: bool = True,
    ) -> None:  # fmt: skip
        _casting(casting_mode)
        super().__init__(hidden_size, eps=eps, offset=offset, elementwise_affine=elementwise_affine)
        _init(self.weight, init_fn)
        self.casting_mode, self.in_place, self.variance_epsilon = casting_mode, in_place, eps

    def forward(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x, scale, shift).to(x.dtype)


class LigerLayerNorm(_m.LayerNorm):
    """Liger's ``LigerLayerNorm(hidden_size, eps=1e-6, bias=False, init_fn="ones")``: a weight and a
    bias always (the bias random when ``bias=True``, zeros otherwise, as Liger's)."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, bias: bool = False, init_fn: str = "ones", **_: Any
    ) -> None:
        super().__init__(hidden_size, eps=eps)
        _init(self.weight, init_fn)
        self.bias.data.copy_(torch.randn(hidden_size) if bias else torch.zeros(hidden_size))
        self.variance_epsilon = eps


class LigerGroupNorm(_m.GroupNorm):
    """Liger's ``LigerGroupNorm(num_channels, num_groups, eps=1e-6, bias=False, init_fn="ones")``
    (channels first, where torch's ``GroupNorm`` takes the groups first)."""

    def __init__(
        self, num_channels: int, num_groups: int, eps: float = 1e-6, bias: bool = False, init_fn: str = "ones"
    ):
        super().__init__(num_groups, num_channels, eps=eps)
        _init(self.weight, init_fn)
        self.bias.data.copy_(torch.randn(num_channels) if bias else torch.zeros(num_channels))


LigerDyT = _m.DyT  # (hidden_size, beta=True, init_alpha=0.5): Liger's arguments already
LigerSparsemax = _m.Sparsemax  # (dim=-1)
LigerJSD = _m.JSD  # (beta=0.5, ignore_index=-100); forward(log_q, log_p, shift_labels=None)
LigerTVDLoss = _m.TVDLoss  # (reduction="batchmean", ignore_index=-100); forward(p, q, shift_labels=None)


class LigerPolyNorm(_m.PolyNorm):
    """Liger's ``LigerPolyNorm(eps=1e-6, in_place=True)`` (``in_place`` is a memory choice of
    Liger's backward; rtxdsl's backward is derived)."""

    def __init__(self, eps: float = 1e-6, in_place: bool = True) -> None:
        super().__init__(eps=eps)
        self.in_place = in_place


class LigerKLDIVLoss(_m.KLDivLoss):
    """Liger's ``LigerKLDIVLoss(eps=1e-10, *args, **kwargs)``: torch's KLDivLoss arguments after eps."""

    def __init__(self, eps: float = 1e-10, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.eps = eps


class LigerSoftmax(torch.nn.Module):
    """Liger's ``LigerSoftmax()``: softmax over the last axis, one kernel."""

    def __init__(self) -> None:
        super().__init__()
        _softmax()  # made now, found by the forward (rtxdsl.nn.memo: never built inside a trace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _softmax()(x)


class LigerReLUSquared(torch.nn.Module):
    """Liger's ``LigerReLUSquared()``: ``relu(x) ** 2``, one kernel."""

    def __init__(self) -> None:
        super().__init__()
        _relu_squared()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _relu_squared()(x)


@made_once
def _softmax() -> Kernel:
    return compile(REGISTRY.functions["softmax"](dsl.var("x"), -1))


@made_once
def _relu_squared() -> Kernel:
    return compile(REGISTRY.functions["relu_squared"](dsl.var("x")))


# ---- MLPs: built from a Hugging Face config, as Liger's -----------------------------------------------
def _mlp_sizes(config: Any, intermediate_size: int | None = None) -> tuple[int, int]:
    return config.hidden_size, intermediate_size if intermediate_size is not None else config.intermediate_size


class LigerSwiGLUMLP(_m.SwiGLU):
    """Liger's ``LigerSwiGLUMLP(config, intermediate_size=None)``: Llama's MLP, ``hidden_act`` silu."""

    def __init__(self, config: Any, intermediate_size: int | None = None) -> None:
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
            raise RtxError(f"LigerSwiGLUMLP: hidden_act must be silu or swish, got {config.hidden_act!r}")
        super().__init__(*_mlp_sizes(config, intermediate_size))
        self.config = config
        self.hidden_size, self.intermediate_size = _mlp_sizes(config, intermediate_size)


class LigerMLP(LigerSwiGLUMLP):
    """Liger's ``LigerMLP(config)`` (``liger_kernel.transformers.mlp``): Llama's MLP, no biases,
    ``hidden_act`` silu or swish."""


class LigerQwen3MoeSwiGLUMLP(LigerSwiGLUMLP):
    """Liger's ``LigerQwen3MoeSwiGLUMLP(config, intermediate_size=None)``: a Qwen3-MoE expert's MLP."""


class LigerBlockSparseTop2MLP(torch.nn.Module):
    """Liger's ``LigerBlockSparseTop2MLP(config)``: Mixtral's expert, ``w2(silu(w1(x)) * w3(x))``, the
    gated product one kernel."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
            raise RtxError(f"LigerBlockSparseTop2MLP: hidden_act must be silu or swish, got {config.hidden_act!r}")
        self.hidden_dim, self.ffn_dim = config.hidden_size, config.intermediate_size
        self.w1 = torch.nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.w2 = torch.nn.Linear(self.ffn_dim, self.hidden_dim, bias=False)
        self.w3 = torch.nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(liger_swiglu(self.w1(x), self.w3(x)))


class LigerFalconH1MLP(torch.nn.Module):
    """Liger's ``LigerFalconH1MLP(config)``: Falcon-H1's MLP, ``down(silu(gate(x) * g) * up(x)) * d`` with
    ``(g, d) = config.mlp_multipliers``; the gated product one kernel (:data:`LigerMLPFunction`'s)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
            raise RtxError(f"LigerFalconH1MLP: hidden_act must be silu or swish, got {config.hidden_act!r}")
        if getattr(config, "mlp_bias", False):
            raise RtxError("LigerFalconH1MLP: mlp_bias is not supported (as Liger's)")
        hidden, inner = _mlp_sizes(config)
        self.config, self.hidden_size, self.intermediate_size = config, hidden, inner
        self.gate_proj = torch.nn.Linear(hidden, inner, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inner, bias=False)
        self.down_proj = torch.nn.Linear(inner, hidden, bias=False)
        self.gate_multiplier, self.down_multiplier = (float(m) for m in config.mlp_multipliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _mlp_function(
            x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
            self.gate_multiplier, self.down_multiplier,
        )  # fmt: skip


class LigerGEGLUMLP(_m.GeGLU):
    """Liger's ``LigerGEGLUMLP(config)``: Gemma's MLP with tanh-approximated GELU (as Liger's)."""

    def __init__(self, config: Any) -> None:
        super().__init__(*_mlp_sizes(config), approximate="tanh")
        self.config = config
        self.hidden_size, self.intermediate_size = _mlp_sizes(config)


class LigerTiledSwiGLUMLP(LigerSwiGLUMLP):
    """Liger's ``LigerTiledSwiGLUMLP(config, num_shards=None)``: Llama's MLP computed a slice of the
    sequence at a time, recomputed in the backward (:func:`rtxdsl.nn.tiled_mlp`; ``num_shards=None``:
    ``ceil(tokens / hidden_size)``)."""

    def __init__(self, config: Any, num_shards: int | None = None) -> None:
        super().__init__(config)
        self._tiling("auto" if num_shards is None else num_shards)
        self.num_shards = num_shards


class LigerTiledGEGLUMLP(LigerGEGLUMLP):
    """Liger's ``LigerTiledGEGLUMLP(config, num_shards=None)``: Gemma's MLP (tanh-approximated GELU,
    ``hidden_act`` a GELU), a slice of the sequence at a time as :class:`LigerTiledSwiGLUMLP`."""

    def __init__(self, config: Any, num_shards: int | None = None) -> None:
        if getattr(config, "hidden_act", "gelu") not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise RtxError(f"LigerTiledGEGLUMLP: hidden_act must be a GELU, got {config.hidden_act!r}")
        super().__init__(config)
        self._tiling("auto" if num_shards is None else num_shards)
        self.num_shards = num_shards


class LigerPhi3SwiGLUMLP(_m.GateUpMLP):
    """Liger's ``LigerPhi3SwiGLUMLP(config)``: Phi-3's MLP (one ``gate_up_proj``)."""

    def __init__(self, config: Any) -> None:
        super().__init__(*_mlp_sizes(config), activation="silu")
        self.config = config


class LigerExperts(torch.nn.Module):
    """Liger's ``LigerExperts(config)``: transformers v5's experts (``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``, SwiGLU) as :func:`rtxdsl.nn.moe_experts`' grouped GEMMs; the expert
    count from ``num_experts``, ``num_local_experts`` or ``n_routed_experts``, the intermediate size
    from ``moe_intermediate_size`` or ``intermediate_size``, as Liger reads them."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
            raise RtxError(f"LigerExperts: hidden_act must be silu or swish, got {config.hidden_act!r}")
        names = ("num_experts", "num_local_experts", "n_routed_experts")
        self.num_experts = next(getattr(config, n) for n in names if getattr(config, n, None) is not None)
        self.intermediate_dim = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        self.hidden_dim = config.hidden_size
        e, i, h = self.num_experts, self.intermediate_dim, self.hidden_dim
        self.gate_up_proj = torch.nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = torch.nn.Parameter(torch.empty(e, h, i))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        out = rx_moe_experts(hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights)
        return out.to(hidden_states.dtype)


# ---- losses ---------------------------------------------------------------------------------------------
#: Liger's extra outputs: its flag, rtxdsl's output name (:func:`rtxdsl.cross_entropy_outputs`), its field
_EXTRAS = (
    ("return_z_loss", "z_loss", "z_loss"),
    ("return_token_accuracy", "accuracy", "token_accuracy"),
    ("return_predicted_tokens", "predicted_tokens", "predicted_tokens"),
)


def _extras(*flags: bool) -> tuple[bool, ...]:
    for (name, _, _), flag in zip(_EXTRAS, flags):
        if not isinstance(flag, bool):
            raise RtxError(f"{name} must be a bool, got {flag!r}")
    return flags


@made_once
def _loss_kernel(
    linear: bool, bias: bool, weight: bool, options: tuple, extras: tuple[bool, ...], scaled: bool = False,
    promote: bool = False,
) -> Kernel:  # fmt: skip
    """The loss (and the z-loss term, the token accuracy, the predicted tokens) of logits given, or
    of ``h @ w.T (+ b)``, soft-capped: one dict of outputs the analyzer fuses as one row kernel (no logits written when
    the logits are a product). ``scaled``: each token's loss and z-loss times its target's
    probability, detached (Liger's ``use_token_scaling``); ``promote``: the logits and the class
    weights taken in float32 (Liger's fused linear loss; its cross-entropy with a float32
    ``ce_weight`` beside half logits)."""
    opts = dict(options)
    cap = opts.pop("softcap")
    x = dsl.var("x")
    if linear:
        x = capped_logits(dsl.var("h"), dsl.var("w"), dsl.var("b") if bias else None, cap)
    elif cap is not None:
        x = cap * REGISTRY.functions["tanh"](x / cap)
    cw = dsl.var("cw") if weight else None
    if promote:
        x = REGISTRY.functions["cast"](x, torch.float32)
        cw = REGISTRY.functions["cast"](cw, torch.float32) if cw is not None else None
    t = dsl.var("t")
    outs = cross_entropy_outputs(x, t, cw, **opts)
    if scaled:
        outs |= _token_scaled(x, t, cw, **opts)
    keys = ["loss"] + [key for (_, key, _), on in zip(_EXTRAS, extras) if on]
    return compile({k: outs[k] for k in keys})


def _token_scaled(
    x: Expr, t: Expr, cw: Expr | None, *, ignore_index: int, reduction: str, label_smoothing: float, z_loss: float
) -> dict[str, Expr]:
    """Liger's token scaling: each token's loss (and z-loss term) times its target's probability
    ``exp(-nll)``, detached, 0 where ignored; the mean divides by what the unscaled mean does (the
    class weights of the counted tokens for the cross-entropy term, their number for the z-loss)."""
    fn = REGISTRY.functions
    valid = t != ignore_index
    p = fn["detach"](fn["where"](valid, fn["exp"](-cross_entropy(x, t, None, ignore_index, "none")), 0.0))
    ce = cross_entropy(x, t, cw, ignore_index, "none", label_smoothing) * p
    zl = z_loss_term(x, t, z_loss, ignore_index, "none") * p
    if reduction == "none":
        return {"loss": ce + zl if z_loss else ce, "z_loss": zl}
    ce, zl = fn["sum"](ce), fn["sum"](zl)
    if reduction == "mean":
        tokens = fn["sum"](fn["where"](valid, 1.0, 0.0))
        picked = fn["gather"](cw, fn["where"](valid, t, 0), 0) if cw is not None else None
        mass = tokens if picked is None else fn["sum"](fn["where"](valid, picked, 0.0))
        # Liger's z-loss mean over no counted token is 0 (z_loss_term's); the loss's is torch's 0 / 0
        ce, zl = ce / mass, fn["where"](tokens == 0.0, 0.0, zl / fn["where"](tokens == 0.0, 1.0, tokens))
    return {"loss": ce + zl if z_loss else ce, "z_loss": zl}


def _options(ignore_index: int, lse_square_scale: float, label_smoothing: float, reduction: str, softcap: Any) -> tuple:
    cap = None if softcap is None else float(softcap)
    return tuple(
        sorted(
            {
                "ignore_index": ignore_index,
                "z_loss": float(lse_square_scale),
                "label_smoothing": float(label_smoothing),
                "reduction": reduction,
                "softcap": cap,
            }.items()  # fmt: skip
        )
    )


def _promotes(weight: torch.Tensor | None, x: torch.Tensor, half: bool = False) -> bool:
    """Whether the logits (and class weights) are taken in float32: class weights of another
    floating dtype than the logits' (Liger takes a float32 ``ce_weight`` beside bfloat16 logits),
    or, with ``half``, half logits (Liger's fused linear loss is float32)."""
    if half and x.dtype in (torch.float16, torch.bfloat16):
        return True
    return weight is not None and weight.dtype != x.dtype and weight.is_floating_point() and x.is_floating_point()


def _output(out: dict[str, torch.Tensor], extras: tuple[bool, ...]) -> Any:
    if not any(extras):
        return out["loss"]
    return CrossEntropyOutput(loss=out["loss"], **{field: out.get(key) for _, key, field in _EXTRAS})


class TargetOutOfBoundsError(IndexOutOfRangeError, AssertionError):
    """A target outside ``[0, classes)``: Liger's kernels assert it, so its tests (and users)
    catch an AssertionError; an RtxError and an IndexError too."""


def _asserting(kern: Any, ins: dict[str, Any]) -> Any:
    """``kern(**ins)``, an out-of-range target raised as Liger raises it."""
    try:
        return kern(**ins)
    except IndexOutOfRangeError as e:
        raise TargetOutOfBoundsError(str(e)) from None


class LigerCrossEntropyLoss(torch.nn.Module):
    """Liger's ``LigerCrossEntropyLoss``: ``forward(_input, target)`` over ``[tokens, classes]``
    logits; ``lse_square_scale`` is the z-loss, ``softcap`` caps the logits first; with
    ``return_z_loss`` / ``return_token_accuracy`` / ``return_predicted_tokens`` a
    :class:`CrossEntropyOutput`."""

    def __init__(
        self, weight: torch.Tensor | None = None, ignore_index: int = -100, lse_square_scale: float = 0.0,
        label_smoothing: float = 0.0, reduction: str = "mean", softcap: float | None = None,
        return_z_loss: bool = False, return_token_accuracy: bool = False, return_predicted_tokens: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.weight, self.ignore_index, self.reduction = weight, ignore_index, reduction
        self.lse_square_scale, self.label_smoothing, self.softcap = lse_square_scale, label_smoothing, softcap
        self.extras = _extras(return_z_loss, return_token_accuracy, return_predicted_tokens)
        self.return_z_loss, self.return_token_accuracy, self.return_predicted_tokens = self.extras
        self._options = _options(ignore_index, lse_square_scale, label_smoothing, reduction, softcap)
        for promote in (False, True) if weight is not None else (False,):  # made now, found by forward
            _loss_kernel(False, False, weight is not None, self._options, self.extras, False, promote)

    def forward(self, _input: torch.Tensor, target: torch.Tensor) -> Any:
        promote = _promotes(self.weight, _input)
        kern = _loss_kernel(False, False, self.weight is not None, self._options, self.extras, False, promote)
        ins = {"x": _input, "t": target} | ({"cw": self.weight} if self.weight is not None else {})
        out = _asserting(kern, ins)
        if promote:  # Liger's loss has the logits' dtype
            out = {k: v.to(_input.dtype) if v.is_floating_point() else v for k, v in out.items()}
        return _output(out, self.extras)


class LigerFusedLinearCrossEntropyLoss(torch.nn.Module):
    """Liger's ``LigerFusedLinearCrossEntropyLoss``: ``forward(lin_weight, _input, target,
    bias=None)``, the weight first; the logits ``_input @ lin_weight.T (+ bias)`` are never
    written (:func:`rtxdsl.linear_cross_entropy`'s kernels). The logits are taken in float32 where the
    GEMM accumulates them, so the loss is float32 for half inputs, as Liger's, and a float32
    ``ce_weight`` is used as given."""

    def __init__(
        self, ce_weight: torch.Tensor | None = None, ignore_index: int = -100, lse_square_scale: float = 0.0,
        label_smoothing: float = 0.0, reduction: str = "mean", softcap: float | None = None,
        return_z_loss: bool = False, accum_dtype: torch.dtype | None = None, use_token_scaling: bool = False,
        return_token_accuracy: bool = False, return_predicted_tokens: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        if accum_dtype not in (None, torch.float32):
            raise RtxError(f"accum_dtype: rtxdsl accumulates in float32; got {accum_dtype}")
        if not isinstance(use_token_scaling, bool):
            raise RtxError(f"use_token_scaling must be a bool, got {use_token_scaling!r}")
        self.use_token_scaling = use_token_scaling
        self.ce_weight, self.ignore_index, self.reduction = ce_weight, ignore_index, reduction
        self.lse_square_scale, self.label_smoothing, self.softcap = lse_square_scale, label_smoothing, softcap
        self.extras = _extras(return_z_loss, return_token_accuracy, return_predicted_tokens)
        self.return_z_loss, self.return_token_accuracy, self.return_predicted_tokens = self.extras
        self._options = _options(ignore_index, lse_square_scale, label_smoothing, reduction, softcap)
        for bias in (False, True):  # made now, found by the forward (never built inside a trace)
            for promote in (False, True):
                _loss_kernel(True, bias, ce_weight is not None, self._options, self.extras, use_token_scaling, promote)

    def forward(
        self, lin_weight: torch.Tensor, _input: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None
    ) -> Any:
        ins = {"h": _input, "w": lin_weight, "t": target} | ({"b": bias} if bias is not None else {})
        ins = autocast_projection(ins) | ({"cw": self.ce_weight} if self.ce_weight is not None else {})
        kern = _loss_kernel(
            True, bias is not None, self.ce_weight is not None, self._options, self.extras, self.use_token_scaling,
            _promotes(self.ce_weight, ins["h"], half=True),
        )  # fmt: skip
        return _output(_asserting(kern, ins), self.extras)


# ---- chunked preference losses: one row kernel per model, no chunks ------------------------------------
#: Liger's auxiliary outputs after the loss, in its order (``nll_loss`` is 0 where it is not computed)
_AUX = ("chosen_logps", "rejected_logps", "chosen_logits_mean", "rejected_logits_mean", "nll_loss",
        "chosen_rewards", "rejected_rewards", "log_odds_ratio", "log_odds_chosen")  # fmt: skip


@made_once
def _preference_kernel(
    loss: str, bias: bool, ref: tuple[bool, bool] | None, given: tuple[str, ...], options: tuple
) -> Kernel:
    """The loss and its outputs (:func:`rtxdsl.ops.preference.preference_outputs`, or
    :func:`~rtxdsl.ops.preference.kto_outputs`) for one configuration: which operands are given
    (``given``: the optional ones, by input name), and the loss's options."""
    var = dsl.var
    refs = (var("ref_h"), var("ref_w"), var("ref_b") if ref[1] else None) if ref is not None and ref[0] else None
    head = (var("h"), var("w"), var("t"))
    b = var("b") if bias else None
    kl, nll = (var(n) if n in given else None for n in ("kl", "nll_t"))
    if loss == "kto":  # unpaired: each sequence labelled desirable or not
        outs = kto_outputs(*head, var("labels"), b, ref=refs, kl=kl, **dict(options))
    else:
        outs = preference_outputs(loss, *head, b, ref=refs, nll_target=nll, **dict(options))
    return compile(outs)


class _FusedLinearPreference(torch.nn.Module):
    """What Liger's chunked preference losses share: ``forward(lin_weight, _input, target,
    bias=None, ...)`` (DPO adds the reference model's inputs, ORPO ``nll_target``) returning
    ``(loss, (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss,
    *extras))``, over a batch that stacks the chosen sequences, then their rejected ones
    (``paired``). ``compiled`` and ``chunk_size`` are accepted and change nothing: rtxdsl's kernels
    are compiled per structure and take every token at once, with no logits buffer to chunk."""

    loss = ""
    paired = True
    optional: tuple[str, ...] = ()  # inputs a forward may leave out: a kernel for each choice
    aux = _AUX

    def __init__(self, options: dict[str, Any], use_ref_model: bool = False, chunk_size: int = 1) -> None:
        super().__init__()
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise RtxError(f"chunk_size must be a positive int, got {chunk_size!r}")
        for name, value in options.items():
            setattr(self, name, value)
        self.use_ref_model, self.chunk_size = use_ref_model, chunk_size
        self._options = tuple(sorted(options.items()))
        refs = (None,) if not use_ref_model else ((True, False), (True, True))
        choices = [(), *((n,) for n in self.optional)]
        for bias in (False, True):  # every configuration made now: a forward only finds its kernel
            for ref in refs:
                for given in choices:
                    _preference_kernel(self.loss, bias, ref, given, self._options)

    def forward(
        self, lin_weight: torch.Tensor, _input: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return self._run(lin_weight, _input, target, bias)

    def _run(
        self, lin_weight: torch.Tensor, _input: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
        ref: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None = None,
        **extra: torch.Tensor | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:  # fmt: skip
        if self.paired and (target.dim() < 1 or target.shape[0] % 2):
            raise RtxError(
                f"target: a preference batch stacks chosen then rejected sequences, so its first dim must be "
                f"even; got shape {list(target.shape)}"
            )
        ins = {"h": _input, "w": lin_weight, "t": target} | ({"b": bias} if bias is not None else {})
        key = None
        if self.use_ref_model:
            assert ref is not None
            for name, given in zip(("ref_input", "ref_weight"), ref[:2]):
                if given is None:
                    raise RtxError(f"{name}: use_ref_model=True needs the reference model's {name}")
            ins |= {"ref_h": ref[0], "ref_w": ref[1]} | ({"ref_b": ref[2]} if ref[2] is not None else {})
            key = (True, ref[2] is not None)
        ins |= {n: v for n, v in extra.items() if v is not None}
        given = tuple(n for n in self.optional if extra.get(n) is not None)
        out = _preference_kernel(self.loss, bias is not None, key, given, self._options)(**autocast_projection(ins))
        out.setdefault("nll_loss", torch.zeros((), device=out["loss"].device))
        return out["loss"], tuple(out[k] for k in self.aux if k in out)


class LigerFusedLinearDPOLoss(_FusedLinearPreference):
    """Liger's ``LigerFusedLinearDPOLoss``: ``forward(lin_weight, _input, target, bias=None,
    ref_input=None, ref_weight=None, ref_bias=None)``; every ``loss_type`` Liger ships
    (:data:`rtxdsl.ops.preference.DPO_LOSSES`). The reference model's log-probabilities come from its
    own row kernel, logits unwritten, without a gradient."""

    loss = "dpo"

    def __init__(
        self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, compute_nll_loss: bool = False,
        compiled: bool = True, use_ref_model: bool = True, average_log_prob: bool = False, chunk_size: int = 1,
        loss_type: str = "sigmoid", label_smoothing: float = 0.0, discopop_tau: float = 0.05,
    ) -> None:  # fmt: skip
        options = {
            "ignore_index": ignore_index, "beta": beta, "alpha": alpha, "compute_nll_loss": compute_nll_loss,
            "average_log_prob": average_log_prob, "loss_type": loss_type, "label_smoothing": label_smoothing,
            "discopop_tau": discopop_tau,
        }  # fmt: skip
        super().__init__(options, use_ref_model, chunk_size)
        self.compiled = compiled

    def forward(
        self, lin_weight: torch.Tensor, _input: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None,
        ref_input: torch.Tensor | None = None, ref_weight: torch.Tensor | None = None,
        ref_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:  # fmt: skip
        return self._run(lin_weight, _input, target, bias, (ref_input, ref_weight, ref_bias))


class LigerFusedLinearORPOLoss(_FusedLinearPreference):
    """Liger's ``LigerFusedLinearORPOLoss``: ``forward(lin_weight, _input, target, bias=None,
    nll_target=None)``; the log-probabilities are averaged over each sequence's tokens, and the
    extras are ``chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen``."""

    loss = "orpo"
    optional = ("nll_t",)

    def __init__(
        self, ignore_index: int = -100, beta: float = 0.1, compute_nll_loss: bool = True, compiled: bool = True,
        chunk_size: int = 1,
    ) -> None:  # fmt: skip
        options = {"ignore_index": ignore_index, "beta": beta, "compute_nll_loss": compute_nll_loss,
                   "average_log_prob": True}  # fmt: skip
        super().__init__(options, chunk_size=chunk_size)
        self.compiled = compiled

    def forward(
        self, lin_weight: torch.Tensor, _input: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None,
        nll_target: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:  # fmt: skip
        return self._run(lin_weight, _input, target, bias, nll_t=nll_target)


class LigerFusedLinearCPOLoss(_FusedLinearPreference):
    """Liger's ``LigerFusedLinearCPOLoss``: ``forward(lin_weight, _input, target, bias=None)``."""

    loss = "cpo"

    def __init__(
        self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
        compute_nll_loss: bool = True, compiled: bool = True, average_log_prob: bool = False, chunk_size: int = 1,
    ) -> None:  # fmt: skip
        options = {
            "ignore_index": ignore_index, "beta": beta, "alpha": alpha, "label_smoothing": label_smoothing,
            "compute_nll_loss": compute_nll_loss, "average_log_prob": average_log_prob,
        }  # fmt: skip
        super().__init__(options, chunk_size=chunk_size)
        self.compiled = compiled


class LigerFusedLinearSimPOLoss(_FusedLinearPreference):
    """Liger's ``LigerFusedLinearSimPOLoss``: ``forward(lin_weight, _input, target, bias=None)``;
    the log-probabilities are averaged over each sequence's tokens, ``gamma`` the reward margin."""

    loss = "simpo"

    def __init__(
        self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
        compute_nll_loss: bool = True, compiled: bool = True, gamma: float = 0.5, chunk_size: int = 1,
    ) -> None:  # fmt: skip
        options = {
            "ignore_index": ignore_index, "beta": beta, "alpha": alpha, "label_smoothing": label_smoothing,
            "compute_nll_loss": compute_nll_loss, "average_log_prob": True, "gamma": gamma,
        }  # fmt: skip
        super().__init__(options, chunk_size=chunk_size)
        self.compiled = compiled


class LigerFusedLinearKTOLoss(_FusedLinearPreference):
    """Liger's ``LigerFusedLinearKTOLoss``: ``forward(_input, lin_weight, target, bias=None,
    preference_labels=None, ref_input=None, ref_weight=None, ref_bias=None, kl=None)`` (the input
    first, as Liger's KTO takes it), over unpaired sequences labelled desirable or not; returns
    ``(loss, (chosen_logps_sum, rejected_logps_sum, chosen_logits_sum, rejected_logits_sum,
    chosen_rewards_sum, rejected_rewards_sum))`` (:func:`rtxdsl.ops.preference.kto_outputs`)."""

    loss = "kto"
    paired = False
    optional = ("kl",)
    aux = ("chosen_logps_sum", "rejected_logps_sum", "chosen_logits_sum", "rejected_logits_sum",
           "chosen_rewards_sum", "rejected_rewards_sum")  # fmt: skip

    def __init__(
        self, ignore_index: int = -100, beta: float = 0.1, compiled: bool = True, use_ref_model: bool = False,
        average_log_prob: bool = False, chunk_size: int = 1,
    ) -> None:  # fmt: skip
        options = {"ignore_index": ignore_index, "beta": beta, "average_log_prob": average_log_prob}
        super().__init__(options, use_ref_model, chunk_size)
        self.compiled = compiled

    def forward(  # type: ignore[override]  (Liger's own order: the input first)
        self, _input: torch.Tensor, lin_weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None,
        preference_labels: torch.Tensor | None = None, ref_input: torch.Tensor | None = None,
        ref_weight: torch.Tensor | None = None, ref_bias: torch.Tensor | None = None, kl: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:  # fmt: skip
        if preference_labels is None or preference_labels.dtype != torch.bool:
            raise RtxError("preference_labels: KTO needs a bool tensor saying which sequences are desirable")
        ref = (ref_input, ref_weight, ref_bias)
        return self._run(lin_weight, _input, target, bias, ref, labels=preference_labels, kl=kl)


_DAPO_LIKE = ("dapo", "cispo", "vespo")  # the losses that divide by the batch's token count


@made_once
def _grpo_kernel(bias: bool, ref: str, given: tuple[str, ...], options: tuple) -> Kernel:
    """:func:`rtxdsl.ops.policy.grpo_outputs` for one configuration: the reference (``""`` none,
    ``"logps"`` given, ``"model"`` / ``"model+bias"`` its head), which optional inputs are given
    (``old``, ``ratio``, ``norm``), and the loss's options."""
    var = dsl.var
    head = (var("h"), var("w"), var("t"), var("mask"), var("adv"), var("b") if bias else None)
    model = (
        (var("ref_h"), var("ref_w"), var("ref_b") if ref == "model+bias" else None) if ref.startswith("model") else None
    )
    optional = {n: var(n) if n in given else None for n in ("old", "ratio", "norm")}
    return compile(
        grpo_outputs(
            *head, ref=model, ref_logps=var("ref_lp") if ref == "logps" else None, old_logps=optional["old"],
            is_ratio=optional["ratio"], normalizer=optional["norm"], **dict(options),
        )
    )  # fmt: skip


class LigerFusedLinearGRPOLoss(torch.nn.Module):
    """Liger's ``LigerFusedLinearGRPOLoss``: ``forward(_input, lin_weight, selected_token_ids,
    attention_mask, advantages, bias=None, ref_per_token_logps=None, old_per_token_logps=None,
    ref_input=None, ref_weight=None, ref_bias=None, vllm_is_ratio=None, num_items_in_batch=None)``
    returning ``(loss, (kl, clip_ratio))`` (``kl`` only when ``beta`` is not 0), every ``loss_type``
    Liger ships (:data:`rtxdsl.ops.policy.TOKEN_LOSSES`): one row kernel per model, the logits
    never written. ``compiled`` and ``chunk_size`` are accepted and change nothing."""

    def __init__(
        self, beta: float = 0.04, compiled: bool = True, use_ref_model: bool = True, chunk_size: int = 1,
        epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "dapo",
        max_completion_length: int | None = None, importance_sampling_level: str = "token",
        sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05, temperature: float = 1.0,
        delta: float | None = None, use_bias_correction_kl: bool = False, vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
    ) -> None:  # fmt: skip
        super().__init__()
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise RtxError(f"chunk_size must be a positive int, got {chunk_size!r}")
        options = {
            "beta": beta, "epsilon_low": epsilon_low, "epsilon_high": epsilon_high, "loss_type": loss_type,
            "max_completion_length": max_completion_length, "importance_sampling_level": importance_sampling_level,
            "sapo_temperature_pos": sapo_temperature_pos, "sapo_temperature_neg": sapo_temperature_neg,
            "temperature": temperature, "delta": delta, "use_bias_correction_kl": use_bias_correction_kl,
            "vespo_k_pos": vespo_k_pos, "vespo_lambda_pos": vespo_lambda_pos, "vespo_k_neg": vespo_k_neg,
            "vespo_lambda_neg": vespo_lambda_neg,
        }  # fmt: skip
        for name, value in options.items():
            setattr(self, name, value)
        self.compiled, self.use_ref_model, self.chunk_size = compiled, use_ref_model, chunk_size
        self._options = tuple(sorted(options.items()))
        refs = ("logps", "model", "model+bias") if use_ref_model and beta != 0.0 else ("",)
        optional = ("old", "ratio", "norm") if loss_type in _DAPO_LIKE else ("old", "ratio")
        choices = [tuple(n for i, n in enumerate(optional) if bits >> i & 1) for bits in range(1 << len(optional))]
        # Liger refuses sequence-level weights for these losses when called, so this does too
        self._refused = importance_sampling_level == "sequence" and loss_type in TOKEN_LEVEL_ONLY
        for bias in (False, True) if not self._refused else ():  # every configuration made now: a forward finds it
            for ref in refs:
                for given in choices:
                    _grpo_kernel(bias, ref, given, self._options)

    def forward(
        self, _input: torch.Tensor, lin_weight: torch.Tensor, selected_token_ids: torch.Tensor,
        attention_mask: torch.Tensor, advantages: torch.Tensor, bias: torch.Tensor | None = None,
        ref_per_token_logps: torch.Tensor | None = None, old_per_token_logps: torch.Tensor | None = None,
        ref_input: torch.Tensor | None = None, ref_weight: torch.Tensor | None = None,
        ref_bias: torch.Tensor | None = None, vllm_is_ratio: torch.Tensor | None = None,
        num_items_in_batch: int | float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:  # fmt: skip
        if self._refused:
            grpo_outputs(*(dsl.var(n) for n in "hwtma"), **dict(self._options))  # raises, naming the options
        ins: dict[str, Any] = {"h": _input, "w": lin_weight, "t": selected_token_ids, "mask": attention_mask,
                               "adv": advantages, "b": bias, "old": old_per_token_logps}  # fmt: skip
        ref = ""
        if self.use_ref_model and self.beta != 0.0:  # Liger's KL term: the reference given, or its model's head
            if ref_per_token_logps is not None:
                ref, ins["ref_lp"] = "logps", ref_per_token_logps
            elif ref_input is None:
                raise RtxError("ref_input: use_ref_model=True needs ref_per_token_logps or ref_input (and ref_weight)")
            elif ref_weight is None:
                raise RtxError("ref_weight: use_ref_model=True with ref_input needs the reference model's ref_weight")
            else:
                ref = "model+bias" if ref_bias is not None else "model"
                ins |= {"ref_h": ref_input, "ref_w": ref_weight, "ref_b": ref_bias}
        ins["ratio"] = _is_ratio(vllm_is_ratio, attention_mask)
        if self.loss_type in _DAPO_LIKE:
            ins["norm"] = _token_count(attention_mask, num_items_in_batch)
        given = tuple(n for n in ("old", "ratio", "norm") if ins.get(n) is not None)
        kernel = _grpo_kernel(bias is not None, ref, given, self._options)
        out = kernel(**autocast_projection({n: ins[n] for n in kernel.inputs}))
        return out["loss"], tuple(out[k] for k in ("kl", "clip_ratio") if k in out)


def _is_ratio(ratio: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    """vLLM's importance-sampling ratio as Liger takes it: ``[B]`` (a column), ``[B, 1]`` or ``[B, T]``."""
    if ratio is None:
        return None
    b, t = mask.shape
    if ratio.dim() == 1 and ratio.shape[0] == b:
        return ratio.unsqueeze(-1)
    if ratio.dim() == 2 and ratio.shape[0] == b and ratio.shape[1] in (1, t):
        return ratio
    raise RtxError(f"vllm_is_ratio: shape must be ({b},), ({b}, 1) or ({b}, {t}); got {tuple(ratio.shape)}")


def _token_count(mask: torch.Tensor, num_items: int | float | torch.Tensor | None) -> torch.Tensor | None:
    """DAPO's normalizer per process, as Liger's: ``num_items_in_batch`` over the processes, or the
    mask's token count summed across them (None on one process without it: the kernel sums the mask)."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if num_items is not None:
        return torch.as_tensor(num_items, dtype=torch.float32, device=mask.device) / world
    if world == 1:
        return None
    count = mask.to(torch.float32).sum()
    torch.distributed.all_reduce(count)
    return count / world


# ---- distillation over a student's and a teacher's heads: one row kernel, no chunks ---------------------
@made_once
def _distill_kernel(loss: str, biases: tuple[bool, bool], options: tuple) -> Kernel:
    """:func:`rtxdsl.ops.distill.distillation_outputs` for one loss, the biases given, its options."""
    var = dsl.var
    bs, bt = (var(n) if on else None for n, on in zip(("bs", "bt"), biases))
    return compile(distillation_outputs(loss, var("hs"), var("ws"), var("ht"), var("wt"), var("t"), bs, bt,
                                        **dict(options)))  # fmt: skip


@made_once
def _hard_kernel(biased: bool, ignore_index: int) -> Kernel:
    var = dsl.var
    return compile(hard_loss(var("h"), var("w"), var("t"), var("b") if biased else None, ignore_index=ignore_index))


class _FusedLinearDistillation(torch.nn.Module):
    """What Liger's chunked distillation losses share (its ``LigerFusedLinearDistillationBase``):
    ``forward(student_input, student_weight, teacher_input, teacher_weight, true_labels,
    student_bias=None, teacher_bias=None)`` returns the loss, or ``(loss, soft_loss, hard_loss)``
    with ``return_soft_hard_loss``; the student's head gets gradients, the teacher's none.
    ``compiled`` and ``chunk_size`` are accepted and change nothing: both heads' logits are computed
    tile by tile in one row kernel, never written."""

    loss = ""

    def __init__(
        self, weight_hard_loss: float = 0.5, weight_soft_loss: float = 0.5, beta: float = 0.5,
        ignore_index: int = -100, temperature: float = 1.0, compiled: bool = True, chunk_size: int = 1024,
        return_soft_hard_loss: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise RtxError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if not isinstance(return_soft_hard_loss, bool):
            raise RtxError(f"return_soft_hard_loss must be a bool, got {return_soft_hard_loss!r}")
        self.weight_hard_loss, self.weight_soft_loss, self.beta = weight_hard_loss, weight_soft_loss, beta
        self.ignore_index, self.temperature, self.compiled = ignore_index, temperature, compiled
        self.chunk_size, self.return_soft_hard_loss = chunk_size, return_soft_hard_loss
        self._options = tuple(
            sorted(
                {
                    "weight_hard_loss": weight_hard_loss,
                    "weight_soft_loss": weight_soft_loss,
                    "beta": beta,
                    "ignore_index": ignore_index,
                    "temperature": temperature,
                }.items()  # fmt: skip
            )
        )
        for biases in ((False, False), (True, False), (False, True), (True, True)):  # made now, found by forward
            _distill_kernel(self.loss, biases, self._options)
            _hard_kernel(biases[0], ignore_index)

    def forward(
        self, student_input: torch.Tensor, student_weight: torch.Tensor, teacher_input: torch.Tensor,
        teacher_weight: torch.Tensor, true_labels: torch.Tensor, student_bias: torch.Tensor | None = None,
        teacher_bias: torch.Tensor | None = None,
    ) -> Any:  # fmt: skip
        ins = {"hs": student_input, "ws": student_weight, "ht": teacher_input, "wt": teacher_weight, "t": true_labels}
        biases = (student_bias, teacher_bias)
        pad = teacher_weight.shape[0] - student_weight.shape[0]
        if pad > 0:  # a teacher's padded vocabulary: Liger pads the student's logits with zeros (zero rows)
            ins["ws"] = F.pad(student_weight, (0, 0, 0, pad))
            biases = (None if student_bias is None else F.pad(student_bias, (0, pad)), teacher_bias)
        ins |= {n: b for n, b in zip(("bs", "bt"), biases) if b is not None}
        kern = _distill_kernel(self.loss, (biases[0] is not None, biases[1] is not None), self._options)
        out = kern(**autocast_projection(ins))
        if pad > 0:
            out = self._own_classes_hard(out, student_input, student_weight, true_labels, student_bias)
        return (out["loss"], out["soft_loss"], out["hard_loss"]) if self.return_soft_hard_loss else out["loss"]

    def _own_classes_hard(
        self, out: dict[str, torch.Tensor], h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, b: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """The outputs with the hard term over the student's own classes (as Liger's: the padded
        head's zero logits would join its logsumexp)."""
        hard = _hard_kernel(b is not None, self.ignore_index)(h=h, w=w, t=t, **({"b": b} if b is not None else {}))
        soft = out["soft_loss"]
        return {
            "loss": self.weight_hard_loss * hard + self.weight_soft_loss * soft,
            "soft_loss": soft,
            "hard_loss": hard,
        }


class LigerFusedLinearJSDLoss(_FusedLinearDistillation):
    """Liger's ``LigerFusedLinearJSDLoss`` (chunked): ``weight_hard_loss`` x the student's
    cross-entropy plus ``weight_soft_loss`` x the generalized JSD of the two softmaxes at
    ``temperature`` (``beta`` 0: KL(teacher || student); 1: KL(student || teacher)), each summed
    over the tokens whose label counts and divided by their number."""

    loss = "jsd"


class LigerFusedLinearCosineSimilarityLoss(_FusedLinearDistillation):
    """Liger's ``LigerFusedLinearCosineSimilarityLoss`` (chunked): the soft term is ``beta * (1 -
    cos)`` of each token's two logit vectors at ``temperature``, summed over the tokens whose
    label counts and divided by their number."""

    loss = "cosine"


@made_once
def _linear_jsd_kernel(labelled: bool, beta: float, ignore_index: int, temperature: float) -> Kernel:
    var = dsl.var
    label = var("t") if labelled else None
    return compile(linear_jsd(var("hs"), var("ws"), var("ht"), var("wt"), label, beta, ignore_index, temperature))


class LigerFusedLinearJSD(torch.nn.Module):
    """Liger's ``LigerFusedLinearJSD``: ``forward(student_input, student_weight, teacher_input,
    teacher_weight, shift_labels=None)``, the generalized JSD of the two heads' softmaxes at
    ``temperature`` averaged over the tokens whose label is not ``ignore_index`` (every token
    without labels): :func:`rtxdsl.linear_jsd`, one row kernel, no logits written."""

    def __init__(
        self, jsd_beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
        accum_dtype: torch.dtype | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        if accum_dtype not in (None, torch.float32):
            raise RtxError(f"accum_dtype: rtxdsl accumulates in float32; got {accum_dtype}")
        self.jsd_beta, self.ignore_index, self.temperature = jsd_beta, ignore_index, temperature
        for labelled in (False, True):  # made now, found by forward
            _linear_jsd_kernel(labelled, jsd_beta, ignore_index, temperature)

    def forward(
        self, student_input: torch.Tensor, student_weight: torch.Tensor, teacher_input: torch.Tensor,
        teacher_weight: torch.Tensor, shift_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        ins = {"hs": student_input, "ws": student_weight, "ht": teacher_input, "wt": teacher_weight}
        ins |= {"t": shift_labels} if shift_labels is not None else {}
        kern = _linear_jsd_kernel(shift_labels is not None, self.jsd_beta, self.ignore_index, self.temperature)
        return kern(**autocast_projection(ins))


# ---- Liger's functional forms: its modules' forwards with the weights passed in --------------------------
_MODULES: dict[tuple[Any, ...], torch.nn.Module] = {}


def _module(cls: type, *config: Any, **options: Any) -> torch.nn.Module:
    """``cls(*config, **options)``, one module per configuration, made once (its kernels are made
    with it: a functional call only finds them)."""
    key = (cls, config, tuple(sorted(options.items())))
    module = _MODULES.get(key)
    if module is None:
        module = _MODULES[key] = cls(*config, **options)
    return module


def _call(cls: type, params: dict[str, torch.Tensor | None], args: tuple, *config: Any, **options: Any) -> Any:
    """``cls(*config, **options)``'s forward on ``args`` with ``params`` as its parameters, as
    Liger's functions are its modules' ``Function.apply``."""
    given = {n: p for n, p in params.items() if p is not None}
    missing = sorted(set(params) - set(given))
    if missing:
        raise RtxError(f"{cls.__name__}: the functional form needs {missing} (got None)")
    return torch.func.functional_call(_module(cls, *config, **options), given, args)


def _not_given(op: str, **legacy: Any) -> None:
    for name, value in legacy.items():
        if value is not None:
            raise RtxError(f"{op}: {name} is torch's deprecated form; pass reduction= instead (got {value!r})")


def liger_cross_entropy(
    input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None, size_average: Any = None,  # noqa: A002
    ignore_index: int = -100, reduce: Any = None, reduction: str = "mean", label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0, softcap: float | None = None, return_z_loss: bool = False,
    return_token_accuracy: bool = False, return_predicted_tokens: bool = False,
) -> Any:  # fmt: skip
    """Liger's ``liger_cross_entropy``: :class:`LigerCrossEntropyLoss`'s forward."""
    _not_given("liger_cross_entropy", size_average=size_average, reduce=reduce)
    return LigerCrossEntropyLoss(
        weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap, return_z_loss,
        return_token_accuracy, return_predicted_tokens,
    )(input, target)  # fmt: skip


def liger_fused_linear_cross_entropy(
    input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None,  # noqa: A002
    ce_weight: torch.Tensor | None = None, ignore_index: int = -100, lse_square_scale: float = 0.0,
    label_smoothing: float = 0.0, reduction: str = "mean", softcap: float | None = None, return_z_loss: bool = False,
    accum_dtype: torch.dtype | None = None, use_token_scaling: bool = False, return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False, chunk_mem_const: int = 1,
) -> Any:  # fmt: skip
    """Liger's ``liger_fused_linear_cross_entropy`` (the input first, unlike its module):
    :class:`LigerFusedLinearCrossEntropyLoss`'s forward. ``chunk_mem_const`` sizes Liger's chunks;
    rtxdsl has none (the logits are never written), so it changes nothing."""
    if isinstance(chunk_mem_const, bool) or not isinstance(chunk_mem_const, int) or chunk_mem_const < 1:
        raise RtxError(f"chunk_mem_const must be a positive int, got {chunk_mem_const!r}")
    return LigerFusedLinearCrossEntropyLoss(
        ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap, return_z_loss, accum_dtype,
        use_token_scaling, return_token_accuracy, return_predicted_tokens,
    )(weight, input, target, bias)  # fmt: skip


def _ops_fused_linear_jsd(
    student_input: torch.Tensor, student_weight: torch.Tensor, teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor, shift_labels: torch.Tensor | None = None, jsd_beta: float = 0.5,
    ignore_index: int = -100, temperature: float = 1.0, accum_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    """Liger's ``liger_fused_linear_jsd``: :class:`LigerFusedLinearJSD`'s forward."""
    fn = _module(LigerFusedLinearJSD, jsd_beta, ignore_index, temperature, accum_dtype)
    return fn(student_input, student_weight, teacher_input, teacher_weight, shift_labels)


def liger_fused_linear_jsd(*args: Any, **kwargs: Any) -> Any:
    """Liger's ``liger_fused_linear_jsd``, both of them: the ops form ``(student_input, student_weight,
    teacher_input, teacher_weight, shift_labels=None, jsd_beta=0.5, ignore_index=-100, temperature=1.0,
    accum_dtype=None)`` (:class:`LigerFusedLinearJSD`'s forward), or the chunked loss's ``(student_input,
    student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias,
    weight_hard_loss, ...)`` (:class:`LigerFusedLinearJSDLoss`'s), told apart by the arguments."""
    if _is_chunked_jsd(args, kwargs):
        return _CHUNKED_JSD(*args, **kwargs)
    return _ops_fused_linear_jsd(*args, **kwargs)


def liger_swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Liger's ``liger_swiglu``: ``silu(a) * b``, one kernel."""
    return _m.gated_kernel("swiglu", "none")(g=a, u=b)


def liger_geglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Liger's ``liger_geglu``: ``gelu(a, approximate="tanh") * b``, one kernel."""
    return _m.gated_kernel("geglu", "tanh")(g=a, u=b)


def liger_softmax(x: torch.Tensor) -> torch.Tensor:
    """Liger's ``liger_softmax``: over the last axis."""
    return _softmax()(x)


def liger_relu_squared(x: torch.Tensor) -> torch.Tensor:
    """Liger's ``liger_relu_squared``: ``relu(x) ** 2``."""
    return _relu_squared()(x)


def liger_sparsemax(input: torch.Tensor, dim: int = -1) -> torch.Tensor:  # noqa: A002
    """Liger's ``liger_sparsemax``."""
    return _module(LigerSparsemax, dim)(input)


def liger_jsd(
    input: torch.Tensor, target: torch.Tensor, shift_labels: torch.Tensor | None = None, beta: float = 0.5,  # noqa: A002
    ignore_index: int = -100,
) -> torch.Tensor:  # fmt: skip
    """Liger's ``liger_jsd``: :class:`LigerJSD`'s forward (log-probabilities of the student, then the teacher)."""
    return _module(LigerJSD, beta, ignore_index)(input, target, shift_labels)


def liger_tvd(
    input: torch.Tensor, target: torch.Tensor, shift_labels: torch.Tensor | None = None, reduction: str = "mean",  # noqa: A002
    ignore_index: int = -100,
) -> torch.Tensor:  # fmt: skip
    """Liger's ``liger_tvd``: :class:`LigerTVDLoss`'s forward."""
    return _module(LigerTVDLoss, reduction, ignore_index)(input, target, shift_labels)


def liger_kl_div(
    input: torch.Tensor, target: torch.Tensor, size_average: bool = True, reduce: bool = True,  # noqa: A002
    reduction: str = "mean", log_target: bool = False, eps: float = 1e-10,
) -> torch.Tensor:  # fmt: skip
    """Liger's ``liger_kl_div`` (``size_average`` and ``reduce`` are placeholders there too: Liger
    ignores them, its reduction is ``reduction``)."""
    return _module(LigerKLDIVLoss, eps, reduction=reduction, log_target=log_target)(input, target)


def liger_rms_norm(
    X: torch.Tensor, W: torch.Tensor, eps: float, offset: float = 0.0, casting_mode: str = "llama",  # noqa: N803
    in_place: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Liger's ``liger_rms_norm``: :class:`LigerRMSNorm`'s forward with the weight ``W`` (None: no weight)."""
    params, affine = ({"weight": W}, True) if W is not None else ({}, False)
    config = (X.shape[-1], eps, offset, casting_mode)
    return _call(LigerRMSNorm, params, (X,), *config, in_place=in_place, elementwise_affine=affine)


def liger_fused_add_rms_norm(
    X: torch.Tensor, R: torch.Tensor, W: torch.Tensor, eps: float, offset: float = 0.0,  # noqa: N803
    casting_mode: str = "llama", in_place: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Liger's ``liger_fused_add_rms_norm``: ``(rms_norm(X + R) * W, X + R)``."""
    return _call(LigerFusedAddRMSNorm, {"weight": W}, (X, R), X.shape[-1], eps, offset, casting_mode, in_place=in_place)


def liger_modulated_rms_norm(
    X: torch.Tensor, W: torch.Tensor | None, scale: torch.Tensor, shift: torch.Tensor | None = None,  # noqa: N803
    eps: float = 1e-6, offset: float = 0.0, casting_mode: str = "llama", in_place: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Liger's ``liger_modulated_rms_norm`` (``W=None``: no affine weight)."""
    affine = W is not None
    params = {"weight": W} if affine else {}
    config = (X.shape[-1], eps, offset, casting_mode)
    return _call(
        LigerModulatedRMSNorm, params, (X, scale, shift), *config, in_place=in_place, elementwise_affine=affine
    )


def liger_layer_norm(X: torch.Tensor, W: torch.Tensor, B: torch.Tensor, eps: float) -> torch.Tensor:  # noqa: N803
    """Liger's ``liger_layer_norm``."""
    return _call(LigerLayerNorm, {"weight": W, "bias": B}, (X,), X.shape[-1], eps)


def liger_group_norm(
    X: torch.Tensor, affine_scaling_weight: torch.Tensor, affine_shifting_bias: torch.Tensor,  # noqa: N803
    num_channels: int, num_groups: int, eps: float,
) -> torch.Tensor:  # fmt: skip
    """Liger's ``liger_group_norm`` (channels first, as its module)."""
    params = {"weight": affine_scaling_weight, "bias": affine_shifting_bias}
    return _call(LigerGroupNorm, params, (X,), num_channels, num_groups, eps)


def liger_poly_norm(X: torch.Tensor, W: torch.Tensor, B: torch.Tensor, eps: float = 1e-6, in_place: bool = True) -> Any:  # noqa: N803
    """Liger's ``liger_poly_norm``: ``W`` its three weights, ``B`` its bias."""
    return _call(LigerPolyNorm, {"weight": W, "bias": B}, (X,), eps, in_place)


def liger_dyt(x: torch.Tensor, alpha: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor | None) -> torch.Tensor:
    """Liger's ``liger_dyt``: ``gamma * tanh(alpha * x) + beta``."""
    params = {"alpha": alpha, "gamma": gamma} | ({"beta": beta} if beta is not None else {})
    return _call(LigerDyT, params, (x,), x.shape[-1], beta is not None)


# ---- rotary embeddings: q and k in one kernel --------------------------------------------------------------
@made_once
def _rope_qk(sections: tuple[int, ...], unsqueeze_dim: int) -> Kernel:
    """q's and k's rotations in one kernel: rotate-half RoPE over cos and sin already unsqueezed, or,
    with ``sections``, Qwen2-VL's multimodal tables ``[3, B, T, D]``."""
    q, k, cos, sin = (dsl.var(n) for n in ("q", "k", "cos", "sin"))
    if sections:
        return compile({n: mrope(x, cos, sin, sections, unsqueeze_dim) for n, x in (("q", q), ("k", k))})
    return compile({n: rope(x, cos, sin) for n, x in (("q", q), ("k", k))})


def _rotated(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sections: tuple[int, ...],
             unsqueeze_dim: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    if not sections:
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    out = _rope_qk(sections, unsqueeze_dim)(q=q, k=k, cos=cos, sin=sin)
    return out["q"], out["k"]


def liger_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: Any = None,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Liger's ``liger_rope`` / ``liger_rotary_pos_emb``: Hugging Face's ``apply_rotary_pos_emb`` on
    ``q`` ``[B, Hq, T, D]`` and ``k`` ``[B, Hk, T, D]`` with ``cos`` and ``sin`` ``[1 or B, T, D]``, one
    kernel. ``position_ids`` is accepted and unused, as in Liger (cos and sin are per position already);
    a table without a batch dim, ``[T, D]`` (a vision model's), is every batch's, as Liger reads it.

    Example:
        >>> import torch
        >>> from rtxdsl.liger import liger_rope
        >>> q, k = liger_rope(torch.ones(1, 2, 3, 4), torch.ones(1, 1, 3, 4), torch.ones(1, 3, 4), torch.zeros(1, 3, 4))
        >>> q.shape, k.shape, bool(q.eq(1).all())
        (torch.Size([1, 2, 3, 4]), torch.Size([1, 1, 3, 4]), True)
    """
    if cos.dim() == 2 and sin.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    return _rotated(q, k, cos, sin, (), unsqueeze_dim)


liger_rotary_pos_emb = liger_rope


def liger_rotary_pos_emb_vision(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Liger's ``liger_rotary_pos_emb_vision`` (Qwen3-VL's vision tower): ``q`` and ``k`` ``[T, H, D]``,
    ``cos`` and ``sin`` ``[T, D]``; rotated in float32, returned in their own dtypes and layout."""
    q32, k32 = (t.to(torch.float32).unsqueeze(0).transpose(1, 2) for t in (q, k))
    q_out, k_out = liger_rope(q32, k32, cos.to(torch.float32), sin.to(torch.float32))
    return q_out.transpose(1, 2).squeeze(0).to(q.dtype), k_out.transpose(1, 2).squeeze(0).to(k.dtype)


def liger_qwen2vl_mrope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mrope_section: Any, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Liger's ``liger_qwen2vl_mrope`` / ``liger_multimodal_rotary_pos_emb``: Qwen2-VL's multimodal
    RoPE (:func:`rtxdsl.mrope`) on ``q`` and ``k``, ``cos`` and ``sin`` ``[3, B, T, D]``, one kernel."""
    if isinstance(mrope_section, (str, bytes)) or not hasattr(mrope_section, "__iter__"):
        raise RtxError(f"liger_qwen2vl_mrope: mrope_section must be a sequence of ints, got {mrope_section!r}")
    return _rotated(q, k, cos, sin, tuple(mrope_section), unsqueeze_dim)


liger_multimodal_rotary_pos_emb = liger_qwen2vl_mrope


FUNCTIONS = (
    "liger_cross_entropy", "liger_dyt", "liger_fused_add_rms_norm", "liger_fused_linear_cross_entropy",
    "liger_fused_linear_jsd", "liger_geglu", "liger_group_norm", "liger_jsd", "liger_kl_div", "liger_layer_norm",
    "liger_modulated_rms_norm", "liger_poly_norm", "liger_relu_squared", "liger_rms_norm", "liger_softmax",
    "liger_sparsemax", "liger_swiglu", "liger_tvd", "liger_rope", "liger_rotary_pos_emb", "liger_qwen2vl_mrope",
    "liger_multimodal_rotary_pos_emb", "liger_rotary_pos_emb_vision",
)  # fmt: skip


# ---- Liger's autograd Function classes: ``apply`` in each Function's own argument order --------------------
def _signature(spec: str) -> inspect.Signature:
    """A row of :data:`SIGNATURES` (``"rope=True, ..., model=None, **kwargs"``) as a Signature."""
    params = []
    for item in spec.split(", "):
        if item.startswith("**"):
            params.append(inspect.Parameter(item[2:], inspect.Parameter.VAR_KEYWORD))
            continue
        if "=" not in item:  # required
            params.append(inspect.Parameter(item, inspect.Parameter.POSITIONAL_OR_KEYWORD))
            continue
        name, default = item.split("=")
        params.append(
            inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=ast.literal_eval(default))
        )
    return inspect.Signature(params)


def _function(name: str, apply: Any, doc: str = "") -> type:
    """Liger's ``name`` (a ``torch.autograd.Function``): ``apply`` runs the rtxdsl kernels of the
    functional form, with Liger's positional order for that Function (the losses' differ from their
    functionals'); the gradients are the kernels' derived backwards."""
    what = doc or f"the same as :func:`{apply.__name__}`"
    return type(
        name,
        (),
        {"apply": staticmethod(apply), "__doc__": f"Liger's ``{name}.apply``: {what}.", "__module__": __name__},
    )


def _four(out: Any) -> tuple[Any, Any, Any, Any]:
    """A cross-entropy Function's outputs: ``(loss, z_loss, token_accuracy, predicted_tokens)``."""
    if isinstance(out, CrossEntropyOutput):
        return out.loss, out.z_loss, out.token_accuracy, out.predicted_tokens
    return out, None, None, None


@made_once
def _scaled_swiglu() -> Kernel:
    g, u = dsl.var("g"), dsl.var("u")
    return compile(REGISTRY.functions["swiglu"](g * dsl.var("gate_multiplier"), u) * dsl.var("down_multiplier"))


def _silu_mul(a: torch.Tensor, b: torch.Tensor, gate_multiplier: float = 1.0, down_multiplier: float = 1.0) -> Any:
    if gate_multiplier == 1.0 and down_multiplier == 1.0:
        return liger_swiglu(a, b)
    return _scaled_swiglu()(g=a, u=b, gate_multiplier=float(gate_multiplier), down_multiplier=float(down_multiplier))


def _rms_norm_function(X: torch.Tensor, W: torch.Tensor, eps: float, offset: float = 0.0, casting_mode: str = "llama",  # noqa: N803
                       in_place: bool = True, row_mode: Any = None) -> torch.Tensor:  # fmt: skip
    return liger_rms_norm(X, W, eps, offset, casting_mode, in_place)


def _fused_add_rms_norm_function(X: torch.Tensor, R: torch.Tensor, W: torch.Tensor, eps: float, offset: float = 0.0,  # noqa: N803
                                 casting_mode: str = "llama", in_place: bool = False) -> Any:  # fmt: skip
    return liger_fused_add_rms_norm(X, R, W, eps, offset, casting_mode, in_place)


def _cross_entropy_function(
    _input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int = -100,
    lse_square_scale: float = 0.0, label_smoothing: float = 0.0, reduction: str = "mean", softcap: float | None = None,
    return_z_loss: bool = False, return_token_accuracy: bool = False, return_predicted_tokens: bool = False,
) -> tuple[Any, Any, Any, Any]:  # fmt: skip
    return _four(
        liger_cross_entropy(
            _input,
            target,
            weight,
            None,
            ignore_index,
            None,
            reduction,
            label_smoothing,
            lse_square_scale,
            softcap,
            return_z_loss,
            return_token_accuracy,
            return_predicted_tokens,
        )
    )


def _kl_div_function(y_pred: torch.Tensor, y_true: torch.Tensor, reduction: str = "batchmean", log_target: bool = False,
                     eps: float = 1e-10) -> torch.Tensor:  # fmt: skip
    return liger_kl_div(y_pred, y_true, reduction=reduction, log_target=log_target, eps=eps)


def _tvd_function(p: torch.Tensor, q: torch.Tensor, shift_labels: torch.Tensor | None = None,
                  reduction: str = "batchmean", ignore_index: int = -100) -> torch.Tensor:  # fmt: skip
    return liger_tvd(p, q, shift_labels, reduction, ignore_index)


def _mlp_function(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor,
                  gate_multiplier: float = 1.0, down_multiplier: float = 1.0) -> torch.Tensor:  # fmt: skip
    gated = _silu_mul(F.linear(x, gate_weight), F.linear(x, up_weight), gate_multiplier, down_multiplier)
    return F.linear(gated, down_weight)


LigerRMSNormFunction = _function(
    "LigerRMSNormFunction",
    _rms_norm_function,
    ":func:`liger_rms_norm` (``row_mode``, a launch choice of Liger's, changes nothing here)",
)
LigerFusedAddRMSNormFunction = _function(
    "LigerFusedAddRMSNormFunction",
    _fused_add_rms_norm_function,
    ":func:`liger_fused_add_rms_norm`, ``in_place`` False unless given",
)
LigerModulatedRMSNormFunction = _function("LigerModulatedRMSNormFunction", liger_modulated_rms_norm)
LigerLayerNormFunction = _function("LigerLayerNormFunction", liger_layer_norm)
LigerGroupNormFunction = _function("LigerGroupNormFunction", liger_group_norm)
LigerPolyNormFunction = _function("LigerPolyNormFunction", liger_poly_norm)
LigerDyTFunction = _function("LigerDyTFunction", liger_dyt)
LigerSiLUMulFunction = _function(
    "LigerSiLUMulFunction", _silu_mul, "``silu(a * gate_multiplier) * b * down_multiplier``, one kernel"
)
LigerMLPFunction = _function(
    "LigerMLPFunction", _mlp_function, "``down(silu(x @ gate.T * g) * (x @ up.T)) * d``, the gated product one kernel"
)
LigerGELUMulFunction = _function("LigerGELUMulFunction", liger_geglu)
LigerReLUSquaredFunction = _function("LigerReLUSquaredFunction", liger_relu_squared)
LigerSoftmaxFunction = _function("LigerSoftmaxFunction", liger_softmax)
LigerSparsemaxFunction = _function("LigerSparsemaxFunction", liger_sparsemax)
LigerCrossEntropyFunction = _function(
    "LigerCrossEntropyFunction",
    _cross_entropy_function,
    ":func:`liger_cross_entropy` in the Function's order, returning "
    "``(loss, z_loss, token_accuracy, predicted_tokens)`` (None where not asked)",
)
LigerFusedLinearCrossEntropyFunction = _function(
    "LigerFusedLinearCrossEntropyFunction",
    lambda *args, **kwargs: _four(liger_fused_linear_cross_entropy(*args, **kwargs)),
    ":func:`liger_fused_linear_cross_entropy`, returning ``(loss, z_loss, token_accuracy, predicted_tokens)``",
)
LigerFusedLinearJSDFunction = _function("LigerFusedLinearJSDFunction", liger_fused_linear_jsd)
LigerJSDFunction = _function("LigerJSDFunction", liger_jsd)
LigerKLDivLossFunction = _function(
    "LigerKLDivLossFunction", _kl_div_function, ":func:`liger_kl_div` (``reduction`` batchmean unless given)"
)
LigerTVDLossFunction = _function("LigerTVDLossFunction", _tvd_function, ":func:`liger_tvd` (batchmean unless given)")
LigerRopeFunction = _function("LigerRopeFunction", liger_rope)
LigerQwen2VLMRopeFunction = _function("LigerQwen2VLMRopeFunction", liger_qwen2vl_mrope)
#: the distillation losses' Function parameters (cosine similarity, the chunked JSD)
_DISTILL = (
    "student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias, "
    "weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, ignore_index=-100, temperature=1.0, compiled=True, "
    "chunk_size=1024, return_soft_hard_loss=False"
)
#: Liger's chunked losses' Function classes (``liger_kernel.chunked_loss``): each ``apply``'s parameters, in
#: its order (the input first, where the module takes the weight first), and the module it runs
_CHUNKED = {
    "LigerFusedLinearDPOFunction": ("LigerFusedLinearDPOLoss",
        "_input, weight, target, bias=None, ref_input=None, ref_weight=None, ref_bias=None, ignore_index=-100, "
        "beta=0.1, compute_nll_loss=False, compiled=True, use_ref_model=True, average_log_prob=False, chunk_size=1, "
        "loss_type='sigmoid', label_smoothing=0.0, discopop_tau=0.05, alpha=1.0"),
    "LigerFusedLinearORPOFunction": ("LigerFusedLinearORPOLoss",
        "_input, weight, target, bias=None, ignore_index=-100, beta=0.1, compute_nll_loss=True, nll_target=None, "
        "compiled=True, chunk_size=1"),
    "LigerFusedLinearCPOFunction": ("LigerFusedLinearCPOLoss",
        "_input, weight, target, bias=None, ignore_index=-100, beta=0.1, alpha=1.0, label_smoothing=0.0, "
        "compute_nll_loss=True, compiled=True, average_log_prob=False, chunk_size=1"),
    "LigerFusedLinearSimPOFunction": ("LigerFusedLinearSimPOLoss",
        "_input, weight, target, bias=None, ignore_index=-100, beta=0.1, alpha=1.0, label_smoothing=0.0, "
        "compute_nll_loss=False, compiled=True, gamma=0.5, chunk_size=1"),
    "LigerFusedLinearKTOFunction": ("LigerFusedLinearKTOLoss",
        "_input, weight, target, preference_labels, bias=None, ref_input=None, ref_weight=None, ref_bias=None, "
        "kl=None, ignore_index=-100, beta=0.1, compiled=True, use_ref_model=True, average_log_prob=False, "
        "chunk_size=1"),
    "LigerFusedLinearCosineSimilarityFunction": ("LigerFusedLinearCosineSimilarityLoss", _DISTILL),
    "LigerFusedLinearGRPOFunction": ("LigerFusedLinearGRPOLoss",
        "_input, weight, selected_token_ids, attention_mask, advantages, bias=None, ref_per_token_logps=None, "
        "old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None, beta=0.04, epsilon_low=0.2, "
        "epsilon_high=0.2, loss_type='dapo', max_completion_length=None, importance_sampling_level='token', "
        "sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, temperature=1.0, compiled=True, use_ref_model=True, "
        "chunk_size=1, vllm_is_ratio=None, delta=None, use_bias_correction_kl=False, vespo_k_pos=2.0, "
        "vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, num_items_in_batch=None"),
}  # fmt: skip


def _chunked_apply(module: str, spec: str) -> Any:
    """A chunked loss Function's ``apply``: its arguments bound in Liger's order, the module's
    configuration built from those its constructor takes, the rest its forward's (``weight`` is the
    module's ``lin_weight``)."""
    sig, cls = _signature(spec), globals()[module]
    init = inspect.signature(cls.__init__).parameters

    def apply(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        config, inputs = {}, {}
        for key, value in bound.arguments.items():
            key = "lin_weight" if key == "weight" else key
            (config if key in init else inputs)[key] = value
        return cls(**config)(**inputs)

    apply.__signature__ = sig  # type: ignore[attr-defined]
    return apply


globals().update({n: _function(n, _chunked_apply(*row), f":class:`{row[0]}` in the Function's order")
                  for n, row in _CHUNKED.items()})  # fmt: skip
_CHUNKED_JSD = _chunked_apply("LigerFusedLinearJSDLoss", _DISTILL)
#: Liger's chunked functional forms (``liger_kernel.chunked_loss.functional``): each a Function's apply
CHUNKED_FUNCTIONS = {
    "liger_fused_linear_dpo": "LigerFusedLinearDPOFunction",
    "liger_fused_linear_orpo": "LigerFusedLinearORPOFunction",
    "liger_fused_linear_cpo": "LigerFusedLinearCPOFunction",
    "liger_fused_linear_simpo": "LigerFusedLinearSimPOFunction",
    "liger_fused_linear_kto": "LigerFusedLinearKTOFunction",
    "liger_fused_linear_cosine": "LigerFusedLinearCosineSimilarityFunction",
    "liger_fused_linear_grpo": "LigerFusedLinearGRPOFunction",
}
globals().update({f: globals()[n].apply for f, n in CHUNKED_FUNCTIONS.items()})


def _is_chunked_jsd(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Liger has two ``LigerFusedLinearJSDFunction`` / ``liger_fused_linear_jsd``: the chunked loss's
    (true labels and biases fifth to seventh, loss weights after) and the ops' (``shift_labels``,
    ``jsd_beta``, ...). A call is the chunked one's by its arguments."""
    chunked_words = {"true_labels", "student_bias", "teacher_bias", "weight_hard_loss", "weight_soft_loss", "beta"}
    # the sixth is the ops' jsd_beta (a number), the chunked loss's student_bias (a tensor or None)
    sixth_not_a_number = len(args) > 5 and (isinstance(args[5], bool) or not isinstance(args[5], (int, float)))
    return len(args) > 9 or bool(chunked_words & set(kwargs)) or sixth_not_a_number


#: Liger's Function classes this module has
FUNCTION_CLASSES = tuple(n for n in dict(globals()) if n.startswith("Liger") and n.endswith("Function"))

# ---- Liger's model patches: replace_modules on an instance, or on each model a family's classes run ------
#: Liger's flags beside ``model``: which replace_modules option each sets (``geglu``: Gemma's MLP)
_FLAGS = {
    "rms_norm": "rms_norms", "layer_norm": "layer_norms", "rope": "rope",
    "swiglu": "mlps", "geglu": "mlps", "relu_squared": "mlps",  # Nemotron's MLP: not gated, kept as it is
}  # fmt: skip
#: a family whose transformers module is named otherwise
_MODULE = {"gemma3_text": "gemma3", "gemma4_text": "gemma4"}


def _apply(family: str) -> Any:
    name = f"apply_liger_kernel_to_{family}"
    sig = _signature(SIGNATURES[family])

    def apply(*args: Any, **kwargs: Any) -> None:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise RtxError(f"{name}: {e}; Liger's parameters are {sig}") from None
        bound.apply_defaults()
        flags = dict(bound.arguments)
        flags |= flags.pop("kwargs", {})  # a vision model's: its language model's flags
        model = flags.pop("model")
        cross_entropy = bool(flags.pop("cross_entropy", False))
        fused = bool(flags.pop("fused_linear_cross_entropy", False))
        unknown = sorted(set(flags) - set(_FLAGS))
        if unknown:
            raise RtxError(f"{name}: unknown flag(s) {unknown}; Liger's are {sig}")
        if cross_entropy and fused:
            raise RtxError(f"{name}: cross_entropy and fused_linear_cross_entropy cannot both be True")
        options = {"rope": True, "rms_norms": True, "layer_norms": True, "mlps": True}
        for flag, on in flags.items():
            options[_FLAGS[flag]] = options[_FLAGS[flag]] and bool(on)
        options |= {"loss": cross_entropy or fused, "logits": not fused}
        if model is not None:
            replace_modules(model, **options)
        else:
            _patch_classes(name, _MODULE.get(family, family), options)

    apply.__name__ = apply.__qualname__ = name
    apply.__signature__ = sig  # type: ignore[attr-defined]
    apply.__doc__ = (
        f"Liger's ``{name}{sig}``: :func:`rtxdsl.nn.replace_modules` on ``model``; without one, on every "
        "model of the family's transformers classes once its weights are real (constructed, loaded, or "
        "first called). Liger's defaults: the flags a call leaves out are Liger's for this family."
    )
    return apply


def _patch_classes(name: str, family: str, options: dict[str, bool]) -> None:
    """Liger's class-level patching, rtxdsl's way: each model class of ``transformers.models.<family>``
    runs :func:`rtxdsl.nn.replace_modules` on its instance once its weights are real: at the end of
    its construction (``post_init``; ``from_config``, a direct call), after ``from_pretrained`` has
    loaded them (it builds the model on the meta device), or at its first forward otherwise. The
    swap keeps every parameter object and name; a model built before this call swaps at its first
    forward."""
    import importlib

    from transformers import PreTrainedModel

    try:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError as e:
        raise RtxError(f"{name}: transformers has no models.{family} here ({e})") from None
    for cls in vars(module).values():
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel) and "forward" in vars(cls):
            cls.forward = _swapping_forward(_original(cls, "forward"), options)
            cls.post_init = _swapping_post_init(_original(cls, "post_init"), options)
            cls.from_pretrained = classmethod(_swapping_from_pretrained(_original(cls, "from_pretrained"), options))


def _original(cls: type, attr: str) -> Any:
    """``cls.attr`` as transformers defines it (under an earlier patch of this module's)."""
    found = vars(cls).get(attr)
    found = getattr(found, "__func__", found)  # a classmethod's function
    if found is not None and hasattr(found, "rtxdsl_original"):
        return found.rtxdsl_original
    got = getattr(cls, attr)
    return getattr(got, "__func__", got)


def _swap_once(model: torch.nn.Module, options: dict[str, bool]) -> None:
    if getattr(model, "rtxdsl_swapped", False):
        return
    kind = next(model.parameters()).device.type
    with torch.autocast(kind, enabled=False):  # the probes compare formulas at the weights' dtype
        replace_modules(model, **options)
    for m in model.modules():
        m.rtxdsl_swapped = True


def _swapping_forward(original: Any, options: dict[str, bool]) -> Any:
    @functools.wraps(original)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "rtxdsl_swapped", False):
            _swap_once(self, options)
            own = self.__dict__.get("forward")  # the loss without logits is an instance's forward
            if own is not None:
                return own(*args, **kwargs)
        return original(self, *args, **kwargs)

    forward.rtxdsl_original = original  # type: ignore[attr-defined]
    return forward


def _swapping_post_init(original: Any, options: dict[str, bool]) -> Any:
    @functools.wraps(original)
    def post_init(self: torch.nn.Module) -> None:
        original(self)
        # a base model built inside a causal LM swaps first; the outer model's swap then finds its
        # modules done and adds the loss
        if not any(p.is_meta for p in self.parameters()):
            _swap_once(self, options)

    post_init.rtxdsl_original = original  # type: ignore[attr-defined]
    return post_init


def _swapping_from_pretrained(original: Any, options: dict[str, bool]) -> Any:
    @functools.wraps(original)
    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        model = original(cls, *args, **kwargs)
        _swap_once(model, options)
        return model

    from_pretrained.rtxdsl_original = original  # type: ignore[attr-defined]
    return from_pretrained


#: Liger-Kernel 0.8.5's model families and each ``apply_liger_kernel_to_<family>``'s parameters, in
#: its order with its defaults (transformers' Trainer and Liger's ``AutoLigerKernelForCausalLM`` pass
#: only the keywords a signature names). ``replace_modules`` recognises modules by what they compute,
#: so one function serves every family.
SIGNATURES = {  # fmt: skip
    "granite": "rope=True, cross_entropy=True, fused_linear_cross_entropy=False, rms_norm=True, swiglu=True, "
               "model=None",
    "llama": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
             "model=None",
    "smollm3": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
               "model=None",
    "llava": "cross_entropy=False, fused_linear_cross_entropy=True, model=None, **kwargs",
    "llama4": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
              "model=None, layer_norm=True",
    "mllama": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, layer_norm=True, rms_norm=True, "
              "swiglu=True, model=None",
    "ministral": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
                 "model=None",
    "mistral": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
               "model=None",
    "nemotron": "relu_squared=True, cross_entropy=False, fused_linear_cross_entropy=True, model=None, **kwargs",
    "mixtral": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
               "model=None",
    "muse_glimmer": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, layer_norm=True, "
                    "rms_norm=True, swiglu=True, model=None",
    "pixtral": "rope=True, rms_norm=True, swiglu=True, model=None",
    "gemma": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, geglu=True, model=None",
    "gemma2": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, geglu=True, "
              "model=None",
    "gemma3_text": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, geglu=True, "
                   "model=None",
    "gemma3": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, layer_norm=True, rms_norm=True, "
              "geglu=True, model=None",
    "gemma4_text": "rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, geglu=True, "
                   "model=None",
    "gemma4": "rope=False, cross_entropy=False, fused_linear_cross_entropy=True, layer_norm=False, rms_norm=True, "
              "geglu=True, model=None",
    "paligemma": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, layer_norm=True, "
                 "rms_norm=True, geglu=True, model=None",
    "qwen2": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
             "model=None",
    "qwen3": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
             "model=None",
    "qwen3_moe": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
                 "model=None",
    "gpt_oss": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=False, "
               "model=None",
    "qwen2_vl": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, layer_norm=True, "
                "swiglu=True, model=None",
    "qwen2_5_vl": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
                  "model=None",
    "qwen3_vl": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=False, "
                "model=None",
    "qwen3_vl_moe": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
                    "model=None",
    "phi3": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, model=None",
    "olmo2": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
             "model=None",
    "olmo3": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
             "model=None",
    "glm4": "rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
            "model=None",
    "glm4v": "rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
             "model=None",
    "glm4v_moe": "rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
                 "model=None",
    "internvl": "cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, layer_norm=True, "
                "model=None, **kwargs",
    "smolvlm": "cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, layer_norm=True, model=None, "
               "**kwargs",
    "falcon_h1": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
                 "model=None",
    "qwen3_next": "rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
                  "model=None",
    "qwen3_5": "rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
               "model=None",
    "qwen3_5_moe": "rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
                   "model=None",
    "hunyuan_v1_dense": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, "
                        "swiglu=True, model=None",
    "hunyuan_v1_moe": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, "
                      "swiglu=True, model=None",
    "deepseek_v2": "rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
                   "model=None",
    "deepseek_v3": "rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
                   "model=None",
    "deepseek_v4": "rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, "
                   "swiglu=False, model=None",
    "exaone4": "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
               "model=None",
}  # fmt: skip
FAMILIES = tuple(SIGNATURES)
globals().update({f"apply_liger_kernel_to_{f}": _apply(f) for f in FAMILIES})
#: a text model's type and the family whose function patches it (Liger's table's other rows)
_TEXT_MODELS = {
    "llama4_text": "llama4", "mllama_text_model": "mllama", "qwen2_vl_text": "qwen2_vl",
    "qwen2_5_vl_text": "qwen2_5_vl", "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_vl_text": "qwen3_vl", "qwen3_vl_moe_text": "qwen3_vl_moe",
}  # fmt: skip
#: Liger's ``MODEL_TYPE_TO_APPLY_LIGER_FN``: transformers' ``model_type`` -> its ``apply_liger_kernel_to_*``
MODEL_TYPE_TO_APPLY_LIGER_FN = {t: globals()[f"apply_liger_kernel_to_{f}"] for t, f in {
    **{f: f for f in FAMILIES}, **_TEXT_MODELS}.items()}  # fmt: skip


def _split_for(model_type: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The model type's ``apply_liger_kernel_to_*`` (None if it has none), the keywords its signature
    names, and the rest."""
    fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    names = inspect.signature(fn).parameters if fn is not None else {}
    return fn, {k: v for k, v in kwargs.items() if k in names}, {k: v for k, v in kwargs.items() if k not in names}


def _apply_liger_kernel(model_type: str, **kwargs: Any) -> None:
    """Liger's: the model type's ``apply_liger_kernel_to_*`` with the keywords its signature names
    (nothing for a type without one)."""
    fn, taken, _ = _split_for(model_type, kwargs)
    if fn is not None:
        fn(**taken)


def _apply_liger_kernel_to_instance(model: torch.nn.Module, **kwargs: Any) -> None:
    """Liger's ``_apply_liger_kernel_to_instance`` (transformers' Trainer calls it for ``use_liger_kernel``):
    the model's ``config.model_type``'s function on ``model``, given the keywords its signature names."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    fn, taken, _ = _split_for(model_type, kwargs)
    if fn is None:
        raise RtxError(f"_apply_liger_kernel_to_instance: no Liger function for model_type {model_type!r}")
    fn(**(taken | {"model": model}))


def _auto_model_class() -> type:
    from transformers import AutoConfig, AutoModelForCausalLM

    class AutoLigerKernelForCausalLM(AutoModelForCausalLM):  # type: ignore[misc, valid-type]
        """Liger's ``AutoLigerKernelForCausalLM``: ``AutoModelForCausalLM`` with the model type's
        ``apply_liger_kernel_to_*`` applied first, given the call's keywords its signature names (the
        rest go to transformers)."""

        @classmethod
        def from_pretrained(cls, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any) -> Any:
            model_type = AutoConfig.from_pretrained(pretrained_model_name_or_path, **kwargs).model_type
            _apply_liger_kernel(model_type, **kwargs)
            rest = _split_for(model_type, kwargs)[2]
            return super().from_pretrained(pretrained_model_name_or_path, *model_args, **rest)

        @classmethod
        def from_config(cls, config: Any, **kwargs: Any) -> Any:
            model_type = getattr(config, "model_type", None)
            if model_type:
                _apply_liger_kernel(model_type, **kwargs)
                kwargs = _split_for(model_type, kwargs)[2]
            return super().from_config(config, **kwargs)

    AutoLigerKernelForCausalLM.__module__ = __name__
    AutoLigerKernelForCausalLM.__qualname__ = "AutoLigerKernelForCausalLM"
    return AutoLigerKernelForCausalLM


def __getattr__(name: str) -> Any:
    """``AutoLigerKernelForCausalLM``, made on first use (it subclasses transformers' class: an optional
    dependency)."""
    if name == "AutoLigerKernelForCausalLM":
        cls = globals()[name] = _auto_model_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "AutoLigerKernelForCausalLM"})


__all__ = [
    "CrossEntropyOutput",
    "LigerCrossEntropyLoss",
    "LigerDyT",
    "LigerExperts",
    "LigerFusedAddRMSNorm",
    "LigerFusedLinearCPOLoss",
    "LigerFusedLinearCosineSimilarityLoss",
    "LigerFusedLinearCrossEntropyLoss",
    "LigerFusedLinearDPOLoss",
    "LigerFusedLinearGRPOLoss",
    "LigerFusedLinearJSD",
    "LigerFusedLinearJSDLoss",
    "LigerFusedLinearKTOLoss",
    "LigerFusedLinearORPOLoss",
    "LigerFusedLinearSimPOLoss",
    "LigerGEGLUMLP",
    "LigerGroupNorm",
    "LigerJSD",
    "LigerKLDIVLoss",
    "LigerLayerNorm",
    "LigerPhi3SwiGLUMLP",
    "LigerPolyNorm",
    "LigerRMSNorm",
    "LigerReLUSquared",
    "LigerSoftmax",
    "LigerSparsemax",
    "LigerSwiGLUMLP",
    "LigerTVDLoss",
    "TargetOutOfBoundsError",
    *(f"apply_liger_kernel_to_{f}" for f in FAMILIES),
    *FUNCTIONS,
    *FUNCTION_CLASSES,
    *CHUNKED_FUNCTIONS,
    "LigerMLP",
    "LigerFalconH1MLP",
    "LigerQwen3MoeSwiGLUMLP",
    "LigerBlockSparseTop2MLP",
    "LigerRMSNormForGlm4",
    "MODEL_TYPE_TO_APPLY_LIGER_FN",
    "SIGNATURES",
]
