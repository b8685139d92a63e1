"""``replace_modules(model)``: a model's norms, gated MLPs, rotary embedding and loss, fused.

Modules are recognised by structure and behaviour, not by class: a candidate (a module with a
1-d ``weight`` and an epsilon attribute; one with ``gate_proj`` / ``up_proj`` / ``down_proj`` or
``gate_up_proj`` / ``down_proj`` linears and an activation) is *probed*: it runs once on a small
random input and its output is compared with each formula rtxdsl can fuse (RMSNorm scaled by ``w``
or by ``1 + w``; the output dtype rule; SiLU, tanh-GELU or GELU gating). Only a module that matches
one is replaced, by an rtxdsl module holding the *same* parameter objects under the same names
(``state_dict`` keys, checkpoints and optimizers are unaffected). So Llama, Mistral, Qwen2/3,
Gemma 1/2/3, Phi-3 and Mixtral norms are found without a table of their classes, and a model
whose norm differs in a way the probe sees keeps its own module (and a warning says so).

Hugging Face's rotary embedding is a free function (``apply_rotary_pos_emb``) in each model's
module; the replaced model's attention modules run it as one kernel for q and k (the original
still runs for inputs it does not cover, e.g. partial rotary), and only they: another model of
the family, or this one replaced with ``rope=False``, keeps the original. The function is probed
too (``rotary_pairs``): Cohere's rotates GPT-J's interleaved pairs and gets that kernel, GLM's
(pairs of a half-size cos) keeps its own, and OLMo 2's returns q's dtype from float32 ``cos`` /
``sin``, as the fused kernel then does.
The causal-LM loss (``model.loss_function``) becomes ``rx.cross_entropy`` over the logits as
they are (no float32 copy of them); with ``logits=False`` it is taken from the hidden states
without ever making the logits.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .. import dsl
from ..errors import RtxError
from ..ops.elementwise import cast
from ..ops.helpers import flag_arg
from ..ops.llm import capped_logits, cross_entropy, rope
from ..runtime import Kernel, compile
from .attention import route_attention
from .memo import made_once
from .modules import ACTIVATIONS, GatedMLP, GateUpMLP, GeGLU, LayerNorm, RMSNorm, SwiGLU
from .moe import route_experts

#: attributes Hugging Face norms keep their epsilon in
_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")
_PROBE_ROWS = 3
_TOL = 1e-4
#: a gated MLP's error relative to its output, by whether its weights are half (False, True)
_MLP_TOL = (1e-4, 2e-2)


class Replaced(int):
    """How many modules ``replace_modules`` swapped (an int), with ``by_kind``: kind -> count.

    Kinds: ``layer_norm``, ``rms_norm``, ``mlp``, ``rope`` (attention modules whose rotary
    embedding is fused), ``loss``, ``attention`` (attention modules routed through rtxdsl's),
    ``experts`` (mixture-of-experts layers computed by :func:`rtxdsl.nn.moe_experts`).
    """

    by_kind: dict[str, int]

    def __new__(cls, by_kind: dict[str, int]) -> Replaced:
        obj = super().__new__(cls, sum(by_kind.values()))
        obj.by_kind = {k: v for k, v in by_kind.items() if v}
        return obj

    def __repr__(self) -> str:
        return f"Replaced({int(self)}, by_kind={self.by_kind})"


def replace_modules(
    model: torch.nn.Module,
    *,
    rope: bool = True,
    loss: bool = True,
    logits: bool = True,
    attention: bool = True,
    experts: bool = True,
    norms: bool = True,
    mlps: bool = True,
    rms_norms: bool = True,
    layer_norms: bool = True,
) -> Replaced:
    """Swap ``model``'s norms, gated MLPs, rotary embedding and causal-LM loss for fused ones, in place;
    with ``attention`` a transformers model's attention runs :func:`rtxdsl.attention`'s kernels
    (transformers' attention interface, :mod:`rtxdsl.nn.attention`); with ``experts`` its
    mixture-of-experts layers run :func:`rtxdsl.nn.moe_experts`' grouped GEMMs (transformers' experts
    interface, :mod:`rtxdsl.nn.moe`). ``norms=False`` / ``mlps=False`` keep the model's own norms /
    gated MLPs (Liger's ``swiglu=False``); ``rms_norms=False`` / ``layer_norms=False`` keep one kind of
    norm only (Liger's ``rms_norm=False`` / ``layer_norm=False``).

    Parameters stay the same objects under the same names. Returns the number swapped, an int
    with ``.by_kind``; warns about norm- or MLP-like modules it left alone.

    ``logits=False`` (training a Hugging Face causal LM): called with ``labels`` in training mode
    (Liger's rule; ``skip_logits=`` in the call says otherwise), the model computes its loss from
    the last hidden states and the output embedding's weight in :func:`rtxdsl.linear_cross_entropy`'s
    kernels and returns ``logits=None``: no tokens x vocabulary tensor is made, forward or backward.
    Otherwise it returns its logits as before.
    Its ``lm_head`` becomes the same Linear (same parameters) with a flag the forward sets, so the
    model still compiles whole (``torch.compile(model, fullgraph=True)``).

    Example:
        >>> import torch, rtxdsl as rx
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> n = rx.nn.replace_modules(m)
        >>> int(n), n.by_kind, type(m[1]).__module__
        (1, {'layer_norm': 1}, 'rtxdsl.nn.modules')
    """
    if not isinstance(model, torch.nn.Module):
        raise RtxError(f"replace_modules: model must be a torch.nn.Module, got {type(model).__name__}")
    switches = dict(
        rope=rope, loss=loss, logits=logits, attention=attention, experts=experts, norms=norms, mlps=mlps,
        rms_norms=rms_norms, layer_norms=layer_norms,
    )  # fmt: skip
    for name, on in switches.items():
        flag_arg(on, "replace_modules", name)
    counts = {"layer_norm": 0, "rms_norm": 0, "mlp": 0, "rope": 0, "loss": 0, "attention": 0, "experts": 0}
    left: set[str] = set()
    kept = {"layer_norm": norms and layer_norms, "rms_norm": norms and rms_norms, "mlp": mlps}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            found = _replacement(child)
            if found is not None and not kept[found[0]]:
                continue  # a kind left alone on request
            if found is not None:
                kind, new = found
                setattr(parent, name, new)
                counts[kind] += 1
            elif _looks_fusable(child):
                left.add(type(child).__qualname__)
    if rope:
        counts["rope"] = _fuse_rotary(model, left)
    if loss and _fuse_loss(model, logits):
        counts["loss"] = 1
    if attention:
        counts["attention"] = route_attention(model)
    if experts:
        counts["experts"] = route_experts(model)
    if left:
        warnings.warn(
            f"rx.nn.replace_modules left {sorted(left)} alone: their output matched no formula rtxdsl fuses",
            stacklevel=2,
        )
    return Replaced(counts)


# ---- recognising modules --------------------------------------------------------------------------
def _replacement(m: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    if isinstance(m, (LayerNorm, RMSNorm, GatedMLP, GateUpMLP)):
        return None  # already ours
    if type(m) is torch.nn.LayerNorm:
        return "layer_norm", _same_state(LayerNorm.__new__(LayerNorm), m)
    if type(m) is torch.nn.RMSNorm:
        new = _same_state(RMSNorm.__new__(RMSNorm), m, offset=0.0, promote=False)
        return "rms_norm", new
    for recognise in (_rms_norm_like, _gated_mlp_like):
        found = recognise(m)
        if found is not None:
            return found
    return None


def _same_state(new: Any, m: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """``new`` with ``m``'s parameters, buffers, hooks and training flag (nothing copied)."""
    new.__dict__.update(m.__dict__)
    new.__dict__.update(options)
    new.attach()
    return new


def _looks_fusable(m: torch.nn.Module) -> bool:
    """Named like a norm or an MLP, and not ours or a torch norm we deliberately keep (several dims)."""
    if isinstance(m, (LayerNorm, RMSNorm, GatedMLP, GateUpMLP, torch.nn.LayerNorm, torch.nn.RMSNorm)):
        return False
    return type(m).__name__.lower().endswith(("rmsnorm", "layernorm", "mlp"))


def _probe_input(p: torch.Tensor, *shape: int) -> torch.Tensor | None:
    if p.device.type == "meta":
        return None
    gen = torch.Generator(device=p.device).manual_seed(0)
    return torch.randn(*shape, generator=gen, device=p.device, dtype=torch.float32)


def _rms_norm_like(m: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """A module whose only parameter is a 1-d ``weight``, with an epsilon, computing RMSNorm, or a
    layer norm without a bias (Cohere's) returning its input's dtype."""
    params = dict(m.named_parameters(recurse=False))
    w = params.get("weight")
    eps = next((getattr(m, a) for a in _EPS_NAMES if isinstance(getattr(m, a, None), float)), None)
    if set(params) != {"weight"} or w is None or w.dim() != 1 or eps is None or list(m.children()):
        return None
    x = _probe_input(w, _PROBE_ROWS, w.shape[0])
    if x is None or not w.is_floating_point():
        return None
    with torch.no_grad():
        try:
            got = m(x)  # float32: close to the float64 formula whatever the weight's dtype
            # an input narrower than the weight tells the dtype rule (Llama: weight * x.to(input dtype))
            other = torch.float16 if w.dtype == torch.bfloat16 else torch.bfloat16
            promoted = m(x.to(other)).dtype != other
        except Exception:  # noqa: BLE001 - a module that is not a norm may reject the probe
            return None
        rstd = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
        for offset in (0.0, 1.0):  # Gemma scales by 1 + w
            want = x.double() * rstd * (w.double() + offset)
            if got.shape == want.shape and torch.allclose(got.double(), want, atol=_TOL * 10, rtol=_TOL * 10):
                new = RMSNorm(w.shape[0], eps=eps, device="meta", offset=offset, promote=promoted)
                new.weight = w  # the same parameter
                new.train(m.training)
                return "rms_norm", new
        centred = x.double() - x.double().mean(-1, keepdim=True)
        want = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * w.double()
        if (
            not promoted
            and got.shape == want.shape
            and torch.allclose(got.double(), want, atol=_TOL * 10, rtol=_TOL * 10)
        ):
            norm = LayerNorm(w.shape[0], eps=eps, bias=False, device="meta")
            norm.weight = w
            norm.train(m.training)
            return "layer_norm", norm
    return None


def _activation_of(m: torch.nn.Module) -> str | None:
    """The activation of an MLP that holds it as a module or function (transformers' ``act_fn``),
    read off it over [-6, 6] in float32: its name in ``ACTIVATIONS``, "" where it is none of them
    (quick-GELU, ReLU), None where the MLP holds none."""
    act = getattr(m, "act_fn", None)
    if not callable(act):
        return None
    x = torch.linspace(-6.0, 6.0, 97)
    try:
        y = act(x)
    except Exception:  # noqa: BLE001 - not an elementwise activation after all
        return None
    for name, ref in ACTIVATIONS.items():
        if isinstance(y, torch.Tensor) and y.shape == x.shape and torch.allclose(y, ref(x), rtol=1e-5, atol=1e-6):
            return name
    return ""


def _gated_mlp_like(m: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """``down(act(gate(x)) * up(x))`` with linears named as Llama's, or Phi-3's fused ``gate_up_proj``.
    The activation is read off the module's ``act_fn`` where it has one; the formula is checked on a
    probe whose gate values are spread over the activation's curve (a freshly initialised model's
    are ~0.1, where the GELUs and quick-GELU agree to 1%), by the error relative to the output."""
    lin = {n: c for n, c in m.named_children() if type(c) is torch.nn.Linear}
    fused = "gate_up_proj" in lin
    wanted = {"gate_up_proj", "down_proj"} if fused else {"gate_proj", "up_proj", "down_proj"}
    if not wanted <= set(lin) or (set(dict(m.named_parameters(recurse=False)))):
        return None
    held = _activation_of(m)
    first = lin["gate_up_proj" if fused else "gate_proj"]
    x = _probe_input(first.weight, _PROBE_ROWS, first.in_features)
    if x is None or held == "":
        return None

    def gate_up(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if fused:
            return lin["gate_up_proj"](x).chunk(2, -1)  # type: ignore[return-value]
        return lin["gate_proj"](x), lin["up_proj"](x)

    with torch.no_grad():
        try:
            x = x.to(first.weight.dtype)
            spread = gate_up(x)[0].float().std().item()
            x = x * (2.0 / spread) if spread > 0 else x  # gate values ~N(0, 2)
            got = m(x)
            gate, up = gate_up(x)
        except Exception:  # noqa: BLE001 - the probe's input may not fit this module
            return None
        errors = {}
        for name, act in ACTIVATIONS.items():  # the closest formula
            want = lin["down_proj"](act(gate) * up)
            if got.shape == want.shape and held in (name, None):
                errors[name] = (got.double() - want.double()).abs().max().item() / max(want.abs().max().item(), 1e-30)
    best = min(errors, key=errors.__getitem__, default=None)
    if best is None or not errors[best] <= _MLP_TOL[first.weight.dtype in (torch.float16, torch.bfloat16)]:
        return None
    return "mlp", _gated_module(m, best, lin, fused)


def _gated_module(m: torch.nn.Module, act: str, lin: dict[str, torch.nn.Linear], fused: bool) -> torch.nn.Module:
    if fused:
        new: torch.nn.Module = GateUpMLP.__new__(GateUpMLP)
        torch.nn.Module.__init__(new)
        new.gate_up_proj, new.down_proj, new.activation = lin["gate_up_proj"], lin["down_proj"], act
    else:
        cls = SwiGLU if act == "silu" else GeGLU
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.gate_proj, new.up_proj, new.down_proj = lin["gate_proj"], lin["up_proj"], lin["down_proj"]
        if cls is GeGLU:
            new.approximate = "tanh" if act == "gelu_tanh" else "none"
    new.train(m.training)
    new.attach()  # type: ignore[attr-defined]
    return new


# ---- rotary embedding: the model module's free function ------------------------------------------
@made_once
def _rope_kernel(pairs: bool) -> Kernel:
    q, k, cos, sin = (dsl.var(n) for n in ("q", "k", "cos", "sin"))
    return compile({"q": rope(q, cos, sin, interleaved=pairs), "k": rope(k, cos, sin, interleaved=pairs)})


def _rope_fused(
    original: Callable[..., Any], form: tuple[bool, bool], q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any
) -> Any:
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` as one kernel for q and k; ``original``
    for what it does not cover (more arguments, partial rotary, an odd head dim, tensor subclasses).
    ``form``: whether ``original`` rotates pairs (``rotary_pairs``) and returns q's and k's dtypes
    whatever cos's (``rotary_keeps_dtype``)."""
    pairs, keep = form
    unsqueeze_dim = kwargs.get("unsqueeze_dim", 1)
    whole = all(type(t) is torch.Tensor for t in (q, k, cos, sin)) and cos.shape[-1] == q.shape[-1]
    if args or kwargs.keys() - {"unsqueeze_dim"} or not whole or q.shape[-1] % 2:
        return original(q, k, cos, sin, *args, **kwargs)
    out = _rope_kernel(pairs)(q=q, k=k, cos=cos.unsqueeze(unsqueeze_dim), sin=sin.unsqueeze(unsqueeze_dim))
    return (out["q"].to(q.dtype), out["k"].to(k.dtype)) if keep else (out["q"], out["k"])


def _hub_original(func_class: type) -> Callable[..., Any]:
    """The torch function a ``kernels`` hub function class wraps (its forward closes over it), kept
    on the class once found (Dynamo reads a class attribute; it cannot trace ``inspect``)."""
    original = getattr(func_class, "rtxdsl_original", None)  # read on the class: the function itself
    if original is None:
        original = inspect.getclosurevars(func_class.forward).nonlocals["func"]
        func_class.rtxdsl_original = original  # type: ignore[attr-defined]
    return original


def _rotary_forward(self: torch.nn.Module, q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> Any:
    """The forward of one attention module's own ``kernels`` hub function (transformers >= 5 with the
    ``kernels`` package): set on that instance only, so other models keep theirs. A module-level
    function: a pickled instance names it (``kernels`` pickles an instance's forward by reference)."""
    return _rope_fused(_hub_original(type(self)), type(self).rtxdsl_rotary_form, q, k, cos, sin, *args, **kwargs)


class _RopeGate:
    """How many attention modules ``replace_modules`` hooked are running now: the patched module
    function fuses only inside them. A plain attribute, not a ``ContextVar`` (Dynamo traces
    neither ``ContextVar.get`` nor ``set``; it replays an attribute's writes): another thread
    running another model of the family meanwhile runs the fused kernel too (the same values)."""

    open = 0


def _rope_enter(module: torch.nn.Module, args: Any) -> None:
    _RopeGate.open += 1


def _rope_leave(module: torch.nn.Module, args: Any, out: Any) -> None:
    _RopeGate.open -= 1


def _gated_rotary(original: Callable[..., Any]) -> Callable[..., Any]:
    """A model module's plain ``apply_rotary_pos_emb`` (transformers without per-instance hub
    functions), fused only while an attention module ``replace_modules`` hooked is running."""

    form = (bool(rotary_pairs(original)), rotary_keeps_dtype(original))

    @functools.wraps(original)
    def apply_rotary_pos_emb(*args: Any, **kwargs: Any) -> Any:
        return _rope_fused(original, form, *args, **kwargs) if _RopeGate.open else original(*args, **kwargs)

    apply_rotary_pos_emb.__rtxdsl_original__ = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _gate_rotary(attention: torch.nn.Module, home: types.ModuleType, fn: Callable[..., Any]) -> None:
    """Gate the rotary function ``attention`` calls (``home``'s, or a hub function's forward shared by
    every model), and hook ``attention`` to open the gate while it runs."""
    if isinstance(fn, torch.nn.Module):
        if not hasattr(fn.forward, "__rtxdsl_original__"):
            fn.forward = _gated_rotary(fn.forward)
    elif not hasattr(fn, "__rtxdsl_original__"):
        home.apply_rotary_pos_emb = _gated_rotary(fn)  # type: ignore[attr-defined]
    if _rope_enter not in attention._forward_pre_hooks.values():
        attention.register_forward_pre_hook(_rope_enter)
        attention.register_forward_hook(_rope_leave, always_call=True)


def _rotary_probe(fn: Callable[..., Any], dtype: torch.dtype) -> tuple[list[torch.Tensor], Any]:
    """Small random ``q`` and ``k`` of ``dtype`` with float32 ``cos`` and ``sin``, and ``fn`` of them
    (None where it raises: a function taking other arguments)."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 3, 8, generator=gen).to(dtype) for _ in range(2))
    cos, sin = (torch.randn(1, 3, 8, generator=gen) for _ in range(2))
    try:
        with torch.no_grad():
            return [q, k, cos, sin], fn(q, k, cos, sin)
    except Exception:  # noqa: BLE001 - not a rotary function of these arguments
        return [q, k, cos, sin], None


@functools.lru_cache(maxsize=64)
def rotary_keeps_dtype(fn: Callable[..., Any]) -> bool:
    """Does the rotary function ``fn`` return bfloat16 ``q`` and ``k`` from float32 ``cos`` and
    ``sin`` (OLMo 2's casts back; Llama's promotes, its ``cos`` being made in q's dtype already)?"""
    _, got = _rotary_probe(fn, torch.bfloat16)
    return isinstance(got, tuple) and all(getattr(g, "dtype", None) == torch.bfloat16 for g in got)


@functools.lru_cache(maxsize=64)
def rotary_pairs(fn: Callable[..., Any]) -> bool | None:
    """Which rotary embedding ``fn(q, k, cos, sin)`` computes, ``x * cos + rotate(x) * sin`` with
    ``cos`` and ``sin`` unsqueezed at dim 1: False for Llama's ``rotate_half``, True for GPT-J's
    pairs (Cohere's, ``x[..., ::2]`` and ``x[..., 1::2]``), None for neither (GLM's rotates pairs
    of a cos made of half the dims: it keeps its own). Probed once per function on small random
    inputs, as the norms are.

    Example:
        >>> import torch
        >>> rotary_pairs(lambda q, k, cos, sin: (q, k)) is None
        True
    """
    (q, k, cos, sin), got = _rotary_probe(fn, torch.float32)
    if not isinstance(got, tuple) or len(got) != 2:
        return None
    halves = lambda x: torch.cat((-x[..., 4:], x[..., :4]), -1)  # noqa: E731
    pairs = lambda x: torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)  # noqa: E731
    for interleaved, rotate in ((False, halves), (True, pairs)):
        want = [x * cos[:, None] + rotate(x) * sin[:, None] for x in (q, k)]
        if all(isinstance(g, torch.Tensor) and g.shape == w.shape and torch.allclose(g, w, atol=1e-5)
               for g, w in zip(got, want)):  # fmt: skip
            return interleaved
    return None


def _fuse_rotary(model: torch.nn.Module, left: set[str]) -> int:
    """Fuse ``apply_rotary_pos_emb`` for the model's attention modules, and for no other model: the
    count is the attention modules that call it. Each one's own hub function gets the fused forward
    where transformers gives each its own (``_kernel_funcs``); otherwise the function in the module
    defining the attention class (or a shared hub function's forward) is gated, and the attention
    modules here are hooked to open the gate while they run. A function computing another rotary
    embedding (``rotary_pairs``) is left alone, its name added to ``left``."""
    _rope_kernel(False), _rope_kernel(True)  # made here: never inside a torch.compile trace (rtxdsl.nn.memo)
    users = 0
    for m in model.modules():
        home = sys.modules.get(type(m).__module__)
        fn = getattr(home, "apply_rotary_pos_emb", None) if isinstance(home, types.ModuleType) else None
        if fn is None or not callable(fn) or "Attention" not in type(m).__name__:
            continue
        if rotary_pairs(getattr(fn, "__rtxdsl_original__", fn)) is None:
            left.add(f"{home.__name__}.apply_rotary_pos_emb")
            continue
        own = next((f for f in m.__dict__.get("_kernel_funcs", {}).values() if type(f) is type(fn)), None)
        if own is not None:  # a hub function module of this instance's own (fn's class)
            if getattr(own.__dict__.get("forward"), "__func__", None) is not _rotary_forward:
                # found now (a torch.compile trace only reads them)
                original = _hub_original(type(own))
                form = (bool(rotary_pairs(original)), rotary_keeps_dtype(original))
                type(own).rtxdsl_rotary_form = form  # type: ignore[attr-defined]
                own.forward = types.MethodType(_rotary_forward, own)
        else:
            _gate_rotary(m, home, fn)
        users += 1
    return users


# ---- the causal-LM loss ------------------------------------------------------------------------------
#: the ignore_index the loss kernels here are made for; another is mapped onto it (_ignored_as_default)
_IGNORED = -100


@made_once
def _loss_kernel(reduction: str) -> Kernel:
    logits, target = dsl.var("logits"), dsl.var("target")
    # float32 logits, as ForCausalLMLoss makes them: cast as loaded (no float32 copy), and every
    # per-row value float32 (a half loss cast after would round each row's loss first)
    return compile(cross_entropy(cast(logits, torch.float32), target, ignore_index=_IGNORED, reduction=reduction))


def _ignored_as_default(target: torch.Tensor, ignore_index: int, classes: int) -> torch.Tensor:
    """``target`` for a kernel that ignores -100, whatever ``ignore_index`` the caller passed (so one
    kernel per reduction, made before any trace, serves them all): its rows become -100, and a -100
    that torch would reject (it is not the ignore_index) becomes ``classes``, out of range as it was
    (the error then names that class)."""
    if ignore_index == _IGNORED:
        return target
    return torch.where(target == ignore_index, _IGNORED, torch.where(target == _IGNORED, classes, target))


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss`` (labels shifted left, mean over non-ignored tokens, or a
    sum divided by ``num_items_in_batch``) as one cross-entropy kernel over the logits in their own
    dtype (no float32 copy); the loss is float32, as theirs. Compiles whole (``fullgraph=True``)
    with every option: its two kernels are made when rtxdsl is imported.

    Example:
        >>> import torch, rtxdsl as rx
        >>> float(rx.nn.causal_lm_loss(torch.zeros(1, 3, 5), torch.tensor([[1, 2, 3]]), 5))  # log(5)
        1.6094379425048828
    """

    def run(reduction: str, target: torch.Tensor) -> torch.Tensor:
        target = _ignored_as_default(target, ignore_index, vocab_size)
        return _loss_kernel(reduction)(logits=logits.reshape(-1, vocab_size), target=target)

    return _shifted_loss(run, labels, logits.device, num_items_in_batch, ignore_index, shift_labels)


for _reduction in ("mean", "sum"):  # made here: causal_lm_loss may first run inside a torch.compile trace
    _loss_kernel(_reduction)


def _shifted_loss(
    run: Callable[[str, torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    device: torch.device,
    num_items_in_batch: torch.Tensor | int | None,
    ignore_index: int,
    shift_labels: torch.Tensor | None,
) -> torch.Tensor:
    """``ForCausalLMLoss``'s frame around a cross-entropy ``run(reduction, flat target)``: labels
    shifted left (unless given shifted), the mean over non-ignored tokens, or a sum divided by
    ``num_items_in_batch``."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = run("mean" if num_items_in_batch is None else "sum", shift_labels.reshape(-1).to(device))
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _fuse_loss(model: torch.nn.Module, logits: bool = True) -> bool:
    """A Hugging Face causal LM (``...ForCausalLM`` with a ``loss_function``) gets ``causal_lm_loss``;
    with ``logits=False`` and an output embedding, a forward that never makes the logits for a loss
    (its kernels made here, outside any trace)."""
    if not type(model).__name__.endswith("ForCausalLM") or not hasattr(type(model), "loss_function"):
        return False
    head = getattr(model, "lm_head", None)
    if logits or not isinstance(head, torch.nn.Linear):
        model.loss_function = causal_lm_loss
        if isinstance(model.__dict__.get("forward"), _LossFromHidden):
            del model.forward  # replaced before with logits=False: the class's forward again
        return True
    _keeping_head(model, head)
    model.loss_function = _LossOnKept(model)
    model.forward = _LossFromHidden(model)
    return True


def _keeping_head(model: torch.nn.Module, head: torch.nn.Linear) -> _OutputHead:
    """``model``'s output embedding as an :class:`_OutputHead` (the same Linear), its loss kernels made."""
    if not isinstance(head, _OutputHead):
        head = model.lm_head = _OutputHead.wrapping(head)
    for reduction in ("mean", "sum"):
        _hidden_loss_kernel(reduction, head.bias is not None, _softcap(model))
    return head


def _softcap(model: torch.nn.Module) -> float | None:
    """The final logit softcap of a model's config (Gemma 2), or None."""
    return getattr(getattr(model, "config", None), "final_logit_softcapping", None)


@made_once
def _hidden_loss_kernel(reduction: str, bias: bool, softcap: float | None) -> Kernel:
    """Hugging Face's causal-LM cross-entropy from hidden states: the logits (soft-capped where the
    model caps them, then float32 as ``ForCausalLMLoss`` makes them) only ever exist as tiles."""
    logits = capped_logits(dsl.var("h"), dsl.var("w"), dsl.var("b") if bias else None, softcap)
    return compile(cross_entropy(cast(logits, torch.float32), dsl.var("target"), None, _IGNORED, reduction))


class _OutputHead(torch.nn.Linear):
    """The output embedding of a model replaced with ``logits=False``: the model's own Linear (its
    parameters, hooks and state, nothing copied), except while :class:`_LossFromHidden` runs a
    forward given labels (``keep``): it then keeps the hidden states it is given for the loss and
    hands them on in place of logits (what the model does to its "logits" after it, a softcap, is
    done to them and discarded). A flag the forward reads, not a module swapped during it, so
    Dynamo traces the whole forward (``torch.compile(model, fullgraph=True)``)."""

    keep: bool = False
    kept: torch.Tensor | None = None

    @classmethod
    def wrapping(cls, head: torch.nn.Linear) -> _OutputHead:
        new = cls.__new__(cls)
        new.__dict__.update(head.__dict__)
        return new

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.keep:
            self.kept = hidden
            return hidden
        return super().forward(hidden)


class _LossFromHidden:
    """A causal LM's forward (``replace_modules(model, logits=False)``): given ``labels``, the model's
    own forward with its output embedding keeping the hidden states (:class:`_OutputHead`), whose
    loss (:class:`_LossOnKept`, the model's ``loss_function``) comes from them and the embedding's
    weight; ``logits`` is None. Whatever else the forward does with its loss stays (Mixtral adds its
    router's auxiliary loss). Without labels, the model's own forward. Picklable: it holds the
    model, whose class holds the forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @property
    def __signature__(self) -> inspect.Signature:
        """The model's own forward's, with ``skip_logits``: transformers' Trainer keeps the dataset
        columns it names (``(*args, labels, **kwargs)`` made it drop ``input_ids``)."""
        sig = inspect.signature(functools.partial(type(self.model).forward, self.model))
        params = list(sig.parameters.values())
        if "skip_logits" not in sig.parameters:
            at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
            params.insert(at, inspect.Parameter("skip_logits", inspect.Parameter.KEYWORD_ONLY, default=None))
        return sig.replace(parameters=params)

    def __call__(
        self, *args: Any, labels: torch.Tensor | None = None, skip_logits: bool | None = None, **kwargs: Any
    ) -> Any:
        model = self.model
        forward = type(model).forward
        if skip_logits is None:  # Liger's rule: in training, where the logits are only the loss's
            skip_logits = model.training and labels is not None
        if skip_logits and labels is None:
            raise RtxError("skip_logits=True needs labels: the loss is what the logits are skipped for")
        head = model.lm_head
        if skip_logits and type(head) is torch.nn.Linear:  # set since (resize_token_embeddings): kept alike
            head = _keeping_head(model, head)
        if not skip_logits or not isinstance(head, _OutputHead):  # (another kind of head: its logits)
            return forward(model, *args, labels=labels, **kwargs)
        head.keep = True
        try:
            out = forward(model, *args, labels=labels, **kwargs)
        finally:
            head.keep, head.kept = False, None
        if isinstance(out, tuple):  # return_dict=False: (loss, logits, ...), the logits' place kept
            return (out[0], None, *out[2:])
        out.logits = None
        return out


class _LossOnKept:
    """The ``loss_function`` of a model replaced with ``logits=False``: :func:`causal_lm_loss` from
    the hidden states its output embedding kept (the ``logits`` it is given are those hidden states,
    perhaps soft-capped: unused), or over the logits where none were kept."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        head = self.model.lm_head
        hidden = getattr(head, "kept", None)
        if hidden is None:
            return causal_lm_loss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)
        head.kept = None
        softcap = _softcap(self.model)
        if softcap is None and logits.shape == hidden.shape:
            # what the model did to its "logits" after the head, a scale (Granite's / logits_scaling,
            # Cohere's * logit_scale), is linear: done to the hidden states, it scales the logits alike
            hidden = logits.to(hidden.dtype)
        return _loss_from_hidden(hidden, head, labels, softcap, num_items_in_batch, ignore_index, shift_labels)


def _loss_from_hidden(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    labels: torch.Tensor,
    softcap: float | None,
    num_items_in_batch: torch.Tensor | int | None,
    ignore_index: int,
    shift_labels: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`causal_lm_loss` from the hidden states and the output embedding."""
    bias = {"b": head.bias} if head.bias is not None else {}

    def run(reduction: str, target: torch.Tensor) -> torch.Tensor:
        target = _ignored_as_default(target, ignore_index, head.weight.shape[0])
        kernel = _hidden_loss_kernel(reduction, bool(bias), softcap)
        return kernel(h=hidden.reshape(-1, hidden.shape[-1]), w=head.weight, target=target, **bias)

    return _shifted_loss(run, labels, hidden.device, num_items_in_batch, ignore_index, shift_labels)
