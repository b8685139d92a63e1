"""Hugging Face models' attention through :func:`rtxdsl.attention` (transformers' attention interface).

``route_attention(model)`` registers an ``"rtxdsl"`` attention function (and SDPA's mask format
for it) with transformers and points the model's configs at it (those on ``eager`` or ``sdpa``:
a model set to a flash or flex kernel keeps it); each attention call is one
rtxdsl kernel for its options (causal or masked, the mask's kind, Gemma 2's logit softcap, GQA,
dropout while training), made once per option set. GPT-OSS's attention sinks (``s_aux``, a
learned logit per head in the softmax's total only) scale the output by ``sigmoid(lse - sink)``
from the kernel's logsumexp. What it does not cover (attention weights asked for, a position bias,
tensors of another kind) runs the model's own eager attention.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.compiler import is_dynamo_compiling

from .. import dsl
from ..ops import REGISTRY
from ..ops.attention import attention
from ..runtime import Kernel, compile
from .amp import autocast_projection

NAME = "rtxdsl"
#: the implementations routed through rtxdsl's; a chosen flash / flex kernel is the user's to keep
ROUTED = (None, "eager", "sdpa", NAME)

#: option set -> its kernel: made when a model is routed (every set its modules can ask for), found
#: by a plain dict lookup inside torch.compile (``rtxdsl.nn.memo``'s rule; a miss there runs eager)
_MADE: dict[tuple, Kernel] = {}


def _kernel(
    causal: bool, mask: str, softcap: float, scale: float, gqa: bool, dropout: float, lse: bool = False
) -> Kernel | None:
    key = (causal, mask, softcap, scale, gqa, dropout, lse)
    kern = _MADE.get(key)
    if kern is None and not is_dynamo_compiling():
        kern = _MADE[key] = _make(*key)
    return kern


def _make(causal: bool, mask: str, softcap: float, scale: float, gqa: bool, dropout: float, lse: bool) -> Kernel:
    """One attention kernel per option set (``mask``: "", "bool" or "float"; softcap 0: none; ``lse``:
    the logsumexp too, for sinks)."""
    score_mod = None if not softcap else (lambda s, *_: softcap * REGISTRY.functions["tanh"](s / softcap))
    extra = {"attn_mask": dsl.var("m")} if mask else {}
    q, k, v = dsl.var("q"), dsl.var("k"), dsl.var("v")
    return compile(attention(q, k, v, scale, causal, score_mod, None, dropout, gqa, lse, **extra))


def _eager(module: torch.nn.Module) -> Any:
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def rtxdsl_attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    is_causal: bool | None = None, softcap: float | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention signature: ``query [B, Hq, Tq, D]``, ``key / value [B, Hkv, Tk, D]``,
    an additive or bool ``attention_mask`` (or None: causal when the module is); returns the
    output as ``[B, Tq, Hq, D]`` and no weights, as SDPA's integration does."""
    plain = all(type(t) is torch.Tensor for t in (query, key, value)) and query.dim() == 4
    sinks = kwargs.get("s_aux")
    kern = None
    if plain and not _weights_asked(kwargs) and kwargs.get("position_bias") is None:
        kern, ins = _call(module, query, key, value, attention_mask, dropout, scaling, is_causal, softcap, sinks)
    if kern is None:
        eager = _eager(module)
        if eager is None:
            raise NotImplementedError(f"rtxdsl attention: {type(module).__name__} asks for what it cannot give")
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        mask = _additive(attention_mask, query, key, causal)
        return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, softcap=softcap, **kwargs)
    if sinks is None:
        return kern(**ins).transpose(1, 2).contiguous(), None
    out, lse = kern(**ins)  # the sink's exp joins each row's total: exp(lse) / (exp(lse) + exp(sink))
    kept = torch.sigmoid(lse - sinks.float().view(-1, 1)).unsqueeze(-1)
    return (out * kept).to(out.dtype).transpose(1, 2).contiguous(), None


def _weights_asked(kwargs: dict[str, Any]) -> bool:
    """Are the attention weights asked for: ``output_attentions`` passed on, or transformers
    recording them with its output hooks (a model whose forward takes ``output_attentions`` for
    itself, GPT-2's: the hooks read the weights this call returns)?"""
    if kwargs.get("output_attentions"):
        return True
    active = getattr(sys.modules.get("transformers.utils.output_capturing"), "_active_collector", None)
    collected = active.get() if active is not None else None
    return bool(collected) and any(k.endswith("attentions") for k in collected)


def _additive(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, causal: bool) -> torch.Tensor | None:
    """SDPA's mask (the format the ``"rtxdsl"`` attention registers) as the additive one a model's
    eager attention adds to its scores (transformers' ``eager_mask``: 0 or the dtype's minimum):
    passed on as it was, a bool mask's True was added as 1 and no score was masked, and a causal
    call's mask, None where SDPA's ``is_causal`` covers it, masked nothing."""
    dtype = query.dtype
    if mask is None and causal and query.shape[-2] > 1:  # bottom-right, as transformers' (queries last)
        tq, tk = query.shape[-2], key.shape[-2]
        mask = torch.ones(tq, tk, dtype=torch.bool, device=query.device).tril(tk - tq)
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.tensor(0.0, dtype=dtype, device=mask.device), torch.finfo(dtype).min)


def _call(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float, scaling: float | None, is_causal: bool | None,
    softcap: float | None, sinks: torch.Tensor | None = None,
) -> tuple[Kernel | None, dict[str, torch.Tensor]]:  # fmt: skip
    """The kernel for this call's options and its inputs (``sinks``: GPT-OSS's, one logit a head)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    # under autocast, in its dtype as SDPA would run (a rotary embedding's float32 cos may have
    # promoted q and k while v stayed in autocast's dtype)
    ins = autocast_projection({"q": query, "k": key, "v": value}, frozenset("qkv"))
    query = ins["q"]
    kind = ""
    if attention_mask is not None:
        ins["m"] = attention_mask[:, :, :, : key.shape[-2]]
        kind = "bool" if attention_mask.dtype == torch.bool else "float"
        if kind == "float" and attention_mask.dtype != query.dtype:
            ins["m"] = ins["m"].to(query.dtype)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    gqa = query.shape[1] != key.shape[1]
    if sinks is not None and (type(sinks) not in (torch.Tensor, torch.nn.Parameter) or sinks.shape != query.shape[1:2]):
        return None, ins  # (sinks of another shape: the model's own attention)
    return _kernel(causal, kind, float(softcap or 0.0), scale, gqa, float(dropout), sinks is not None), ins


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, rtxdsl_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def route_attention(model: torch.nn.Module) -> int:
    """Point a transformers model's attention at rtxdsl's; the count is its attention modules (0
    for a model that is not a transformers one, or whose transformers lacks the interface)."""
    configs = [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")]
    if not configs or "transformers" not in sys.modules:
        return 0
    if any(_eager(m) is None for m in model.modules() if "Attention" in type(m).__name__):
        # an attention of its own (BLOOM's ALiBi, MPT's): the interface's mask format (SDPA's) would
        # reach it and change what it computes (BLOOM's logits 1.8e-2 off), so nothing is routed
        return 0
    try:
        _register()
    except ImportError:
        return 0
    for c in {id(c): c for c in configs}.values():
        for cfg in (c, *(getattr(c, k, None) for k in getattr(c, "sub_configs", {}) or {})):
            if getattr(cfg, "_attn_implementation", "") in ROUTED:
                cfg._attn_implementation = NAME
    modules = [m for m in model.modules() if "Attention" in type(m).__name__ and getattr(m, "config", None) is not None]
    modules = [m for m in modules if getattr(m.config, "_attn_implementation", None) == NAME]
    for m in modules:  # every kernel a forward can ask for, made now (never inside a trace)
        _premake(m)
    return len(modules)


def _premake(m: torch.nn.Module) -> None:
    c = m.config
    heads, kv = getattr(c, "num_attention_heads", 0), getattr(c, "num_key_value_heads", None) or 0
    scale = getattr(m, "scaling", None)
    if scale is None:
        return
    softcap = float(getattr(c, "attn_logit_softcapping", None) or 0.0)
    dropout = getattr(m, "attention_dropout", 0.0)  # (Persimmon's is a Dropout module)
    drops = {0.0, float(getattr(dropout, "p", dropout) or 0.0)}
    lses = {False, isinstance(getattr(m, "sinks", None), torch.Tensor)}
    for causal, kind in ((True, ""), (False, ""), (False, "bool"), (False, "float")):
        for p in drops:
            for lse in lses:
                _kernel(causal, kind, softcap, float(scale), bool(kv and heads != kv), p, lse)
