"""Drop-in modules: torch's constructor arguments, parameter names and state_dict keys, with the
memory-bound part of ``forward`` as one fused rtxdsl kernel (fused backward too).

``rx.nn.LayerNorm`` / ``RMSNorm`` / ``CrossEntropyLoss`` subclass torch's, so checkpoints load both
ways and ``isinstance`` checks keep working; ``SwiGLU`` / ``GeGLU`` are Llama- / Gemma-style MLP
blocks (gate, up and down projections run as torch matmuls, the activation product is fused).
``replace_modules(model)`` (:mod:`rtxdsl.nn.swap`) swaps a model's norms, gated MLPs, rotary
embedding and loss for these, in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .. import dsl
from ..errors import RtxError
from ..expr import node
from ..ops import REGISTRY
from ..ops.composite import geglu, layer_norm, rms_norm
from ..ops.elementwise import cast
from ..ops.helpers import flag_arg, int_arg, scalar_arg
from ..ops.llm import cross_entropy, cross_entropy_outputs, linear_cross_entropy
from ..runtime import Kernel, compile
from ..runtime_grad import land
from .amp import autocast_projection
from .memo import made_once
from .tiled import shard_count, tiled_mlp

_x, _w, _b, _t = dsl.var("x"), dsl.var("w"), dsl.var("b"), dsl.var("t")


@made_once
def _norm_kernel(
    kind: str, eps: float | None, weight: bool, bias: bool, offset: float, out: torch.dtype | None
) -> Kernel:
    """``offset``: the weight enters as ``offset + w`` (Gemma's ``1 + w``); ``out``: the result's dtype
    (None: the input's)."""
    w = (_w + offset if offset else _w) if weight else None
    if kind == "layer_norm":
        e = layer_norm(_x, w, _b if bias else None, eps)
    elif eps is None:  # torch: the epsilon of the dtype it computes in, known at binding
        e = node("rms_norm", _x, 1.0 if w is None else w, node("eps_of", _x))
    else:
        e = rms_norm(_x, w, eps)
    return compile(e if out is None else cast(e, out))


@made_once
def _rms_kernel(eps: float | None, weight: bool, offset: float, residual: bool, in_place: bool) -> Kernel:
    """RMSNorm (``eps=None``: torch's epsilon of the compute dtype), of ``x + r`` with ``residual``
    (then the sum is an output too: ``out`` and ``residual``); ``in_place``: ``out`` written over
    ``x`` and the sum over ``r`` (vLLM's fused add) where that is safe."""
    s = _x + dsl.var("r") if residual else _x
    w = (_w + offset if offset else _w) if weight else 1.0
    outs = {"out": node("rms_norm", s, w, node("eps_of", s) if eps is None else eps)}
    if residual:
        outs["residual"] = s
    into = {"out": "x", "residual": "r"} if in_place else {}
    return Kernel(outs, into={k: v for k, v in into.items() if k in outs})


def _write_over(kernel: Kernel, targets: dict[str, torch.Tensor], **inputs: torch.Tensor) -> None:
    """Run ``kernel`` and leave output ``k`` in ``targets[k]``: written there by the kernel where
    that is safe (a contiguous input, read before it is overwritten), else copied in after it."""
    grads = [n for n, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if torch.is_grad_enabled() and grads:
        raise RtxError(
            f"in-place rms_norm writes over its inputs, and {grads[0]!r} requires grad (autograd would "
            "need the overwritten values): call it under torch.no_grad() / torch.inference_mode(), "
            "or use the out-of-place module"
        )
    for name, t in targets.items():
        if not isinstance(t, torch.Tensor) or t.shape != inputs["x"].shape or t.dtype != inputs["x"].dtype:
            raise RtxError(f"in-place rms_norm: {name!r} must be a tensor of x's shape and dtype")
    mems = [t.untyped_storage().data_ptr() for t in targets.values()]
    if len(set(mems)) != len(mems):
        raise RtxError("in-place add_rms_norm: x and residual share memory; they must be distinct tensors")
    got = kernel(**inputs)
    for key, t in targets.items():
        land(got[key], t)


def rms_norm_(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = None, offset: float = 0.0
) -> torch.Tensor:
    """RMSNorm over the last axis written over ``x`` (one kernel, no new tensor when ``x`` is
    contiguous), for inference: returns ``x``. ``eps=None``: as ``torch.nn.RMSNorm``.

    Example:
        >>> import torch, rtxdsl as rx
        >>> x = torch.full((2, 4), 3.0)
        >>> rx.nn.rms_norm_(x) is x, x[0, 0].item()
        (True, 1.0)
    """
    eps, offset = _eps(eps, "rms_norm_"), scalar_arg(offset, "rms_norm_", "offset")
    kernel = _rms_kernel(eps, weight is not None, offset, False, True)
    extra = {} if weight is None else {"w": weight}
    _write_over(kernel, {"out": x}, x=x, **extra)
    return x


def add_rms_norm_(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's fused add + RMSNorm, in place and in one kernel: ``residual += x``, then ``x =
    rms_norm(residual) * weight``. Returns ``(x, residual)``, the same tensors.

    Example:
        >>> import torch, rtxdsl as rx
        >>> x, r = torch.ones(2, 4), torch.full((2, 4), 2.0)
        >>> out, res = rx.nn.add_rms_norm_(x, r)
        >>> out is x, res[0, 0].item(), x[0, 0].item()
        (True, 3.0, 1.0)
    """
    eps, offset = _eps(eps, "add_rms_norm_"), scalar_arg(offset, "add_rms_norm_", "offset")
    kernel = _rms_kernel(eps, weight is not None, offset, True, True)
    extra = {} if weight is None else {"w": weight}
    _write_over(kernel, {"out": x, "residual": residual}, x=x, r=residual, **extra)
    return x, residual


def _eps(eps: Any, where: str) -> float | None:
    """A norm's ``eps``: a number, or None (torch's: the machine epsilon of the input's dtype)."""
    return None if eps is None else scalar_arg(eps, where, "eps")


def _positive(n: Any, where: str, name: str) -> int:
    if int_arg(n, where, name) < 1:
        raise RtxError(f"{where}: {name} must be >= 1, got {n!r}")
    return n


class _Fused:
    """Holds every kernel the module's forward can call, made when the module is (never inside a
    torch.compile trace, where no kernel can be built: :mod:`rtxdsl.nn.memo`): ``_kernel``, and
    ``_variants`` by what a call can change (an output dtype, an optional input given), so
    ``forward`` only reads attributes and dicts, which Dynamo traces as constants."""

    _kernel: Kernel
    _variants: dict[Any, Kernel]

    def _make_kernel(self) -> Kernel:
        raise NotImplementedError

    def _make_variants(self) -> dict[Any, Kernel]:
        """The kernels besides ``_kernel`` a call may need, by what selects them (none by default)."""
        return {}

    def attach(self) -> None:
        """Make the module's kernels again from its parameters and options (after a copy, a swap or
        a change of options: a forward runs the kernels made here)."""
        self._kernel = self._make_kernel()
        self._variants = self._make_variants()

    # copies and pickles carry the parameters and options; the kernels are made again from them
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_kernel", None)
        state.pop("_variants", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        self.attach()


class LayerNorm(_Fused, torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` over the last axis as one kernel (statistics in one pass).

    Example:
        >>> import torch, rtxdsl as rx
        >>> rx.nn.LayerNorm(8)(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        scalar_arg(self.eps, "LayerNorm", "eps")
        self.attach()

    def _make_kernel(self) -> Kernel:
        return _norm_kernel("layer_norm", float(self.eps), self.weight is not None, self.bias is not None, 0.0, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:  # several normalized dims: torch's own
            return super().forward(x)
        args = [x] + [p for p in (self.weight, self.bias) if p is not None]
        return self._kernel(*args)


#: the dtypes a float input and a float weight promote to: RMSNorm(promote=True)'s results
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class RMSNorm(_Fused, torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` over the last axis as one kernel (``eps=None``: the epsilon of the dtype
    torch computes in, float32's for fp16 / bf16).

    Two options cover Hugging Face's variants: ``offset=1.0`` scales by ``1 + weight`` (Gemma), and
    ``promote=True`` returns the weight's and input's promoted dtype (Llama's ``weight *
    x.to(input_dtype)``); by default the result has the input's dtype, as torch's.

    Example:
        >>> import torch, rtxdsl as rx
        >>> rx.nn.RMSNorm(8)(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(self, *args: Any, offset: float = 0.0, promote: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _eps(self.eps, "RMSNorm")
        self.offset, self.promote = scalar_arg(offset, "RMSNorm", "offset"), flag_arg(promote, "RMSNorm", "promote")
        self.attach()

    def _make_kernel(self) -> Kernel:
        return self._kernel_for(None)

    def _make_variants(self) -> dict[Any, Kernel]:
        """``promote``: one kernel per result dtype a float input and weight can promote to."""
        if not self.promote or self.weight is None:
            return {}
        return {out: self._kernel_for(out) for out in _FLOATS}

    def _kernel_for(self, out: torch.dtype | None) -> Kernel:
        eps = None if self.eps is None else float(self.eps)
        return _norm_kernel("rms_norm", eps, self.weight is not None, False, self.offset, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:
            if self.offset or self.promote:
                raise RtxError("rx.nn.RMSNorm: offset and promote need one normalized dim")
            return super().forward(x)
        if self.weight is None:
            return self._kernel(x)
        out = torch.promote_types(x.dtype, self.weight.dtype) if self.promote else x.dtype
        if out == x.dtype:
            return self._kernel(x, self.weight)
        if out not in self._variants:
            raise RtxError(
                f"rx.nn.RMSNorm(promote=True): no kernel for a {out} result ({x.dtype} x {self.weight.dtype})"
            )
        return self._variants[out](x, self.weight)

    def extra_repr(self) -> str:
        more = (f", offset={self.offset}" if self.offset else "") + (", promote=True" if self.promote else "")
        return super().extra_repr() + more


class AddRMSNorm(_Fused, torch.nn.Module):
    """Liger's / vLLM's fused residual add + RMSNorm: ``forward(hidden_states, residual)`` returns
    ``(rms_norm(hidden_states + residual) * w, hidden_states + residual)`` from one kernel (the
    sum is read once), fused backward. ``offset=1.0``: Gemma's ``1 + w``. ``in_place=True``
    (inference): the results are written over ``hidden_states`` and ``residual``
    (:func:`add_rms_norm_`), no new tensors.

    Example:
        >>> import torch, rtxdsl as rx
        >>> out, res = rx.nn.AddRMSNorm(8)(torch.randn(2, 8), torch.randn(2, 8))
        >>> out.shape, res.shape
        (torch.Size([2, 8]), torch.Size([2, 8]))
    """

    def __init__(
        self, hidden_size: int, eps: float | None = 1e-6, offset: float = 0.0, in_place: bool = False, **factory: Any
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, **factory))
        self.eps = _eps(eps, "AddRMSNorm")
        self.offset = scalar_arg(offset, "AddRMSNorm", "offset")
        self.in_place = flag_arg(in_place, "AddRMSNorm", "in_place")
        self.attach()

    def _make_kernel(self) -> Kernel:
        return _rms_kernel(self.eps, True, self.offset, True, False)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.in_place:
            return add_rms_norm_(hidden_states, residual, self.weight, self.eps, self.offset)
        got = self._kernel(x=hidden_states, r=residual, w=self.weight)
        return got["out"], got["residual"]

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, offset={self.offset}, in_place={self.in_place}"


class ModulatedRMSNorm(_Fused, torch.nn.Module):
    """AdaLN's modulated RMSNorm (diffusion transformers): ``(1 + scale) * rms_norm(x) * (offset +
    weight) + shift`` over the last axis, one kernel; the backward is derived (``x``, ``weight``,
    ``scale``, ``shift``: the modulation's gradients summed over the rows that share it, in the
    kernel). ``forward(x, scale, shift=None)``: ``scale`` (and ``shift``, shaped as ``scale``)
    hold ``R`` rows of ``hidden_size`` where ``R`` divides ``x``'s rows, which take them in
    consecutive runs: ``[H]`` shares one row with every token, ``[B, H]`` one row per sequence of
    ``[B, T, H]``, ``x``'s own shape one per token (Liger's broadcast). The result has the dtype
    torch gives the formula (the normed ``x`` in ``x``'s dtype, promoted with ``scale`` /
    ``shift``); it is computed in float32 and rounded once.

    Example:
        >>> import torch, rtxdsl as rx
        >>> norm = rx.nn.ModulatedRMSNorm(8)
        >>> norm(torch.randn(2, 5, 8), torch.randn(2, 8), torch.randn(2, 8)).shape
        torch.Size([2, 5, 8])
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, elementwise_affine: bool = True,
        **factory: Any,
    ) -> None:  # fmt: skip
        super().__init__()
        weight = torch.nn.Parameter(torch.ones(hidden_size, **factory)) if elementwise_affine else None
        self.register_parameter("weight", weight)
        self.hidden_size = _positive(hidden_size, "ModulatedRMSNorm", "hidden_size")
        self.eps = scalar_arg(eps, "ModulatedRMSNorm", "eps")
        self.offset = scalar_arg(offset, "ModulatedRMSNorm", "offset")
        self.attach()

    def _kernel_for(self, shift: bool) -> Kernel:
        return _modulated_kernel(self.eps, self.weight is not None, self.offset, shift)

    def _make_kernel(self) -> Kernel:
        return self._kernel_for(False)

    def _make_variants(self) -> dict[Any, Kernel]:
        return {"shift": self._kernel_for(True)}

    def forward(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        rows = modulation_rows(x, scale, shift, self.hidden_size)
        ins = {"x": x.reshape(rows, -1, self.hidden_size), "scale": scale.reshape(rows, 1, self.hidden_size)}
        ins |= {} if self.weight is None else {"w": self.weight}
        if shift is None:
            return self._kernel(**ins).reshape(x.shape)
        return self._variants["shift"](**ins, shift=shift.reshape(rows, 1, self.hidden_size)).reshape(x.shape)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, offset={self.offset}, elementwise_affine={self.weight is not None}"


def modulation_rows(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None, hidden_size: int) -> int:
    """How many modulation rows ``scale`` holds (``shift`` the same), checked against ``x``: a
    clear :class:`~rtxdsl.errors.RtxError` naming the tensor whose shape does not fit."""
    for name, t in (("x", x), ("scale", scale), ("shift", shift)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[-1] != hidden_size):
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise RtxError(f"ModulatedRMSNorm: {name} must end in the hidden size {hidden_size}, got {got}")
    rows, tokens = scale.numel() // hidden_size, x.numel() // hidden_size
    if rows == 0 or tokens % rows:
        raise RtxError(
            f"ModulatedRMSNorm: scale holds {rows} rows of {hidden_size}, which must divide x's {tokens} rows "
            f"(x {list(x.shape)}, scale {list(scale.shape)})"
        )
    if shift is not None and shift.numel() != scale.numel():
        raise RtxError(f"ModulatedRMSNorm: shift must hold scale's {rows} rows, got shape {list(shift.shape)}")
    return rows


@made_once
def _modulated_kernel(eps: float, weight: bool, offset: float, shift: bool) -> Kernel:
    """``(1 + scale) * rms_norm(x, offset + w) (+ shift)`` over ``x [R, rows, H]`` and a modulation
    ``[R, 1, H]``: one row kernel, the modulation broadcast along the rows that share it."""
    w = (_w + offset if offset else _w) if weight else None
    e = rms_norm(_x, w, eps) * (1.0 + dsl.var("scale"))
    return compile(e + dsl.var("shift") if shift else e)


class CrossEntropyLoss(_Fused, torch.nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` as one row kernel (+ the mean), fused backward.

    Liger-Kernel's options: ``z_loss`` (PaLM's ``z * lse**2``, added to the loss), and three extra
    outputs, ``return_z_loss``, ``return_token_accuracy`` and ``return_predicted_tokens`` (each
    token's argmax, -1 where ignored): the forward then returns a tuple, the loss first, then the
    extras asked for in that order, all from the same kernel.

    Example:
        >>> import torch, rtxdsl as rx
        >>> rx.nn.CrossEntropyLoss()(torch.randn(4, 10), torch.tensor([1, 2, 3, 4])).shape
        torch.Size([])
        >>> loss, acc = rx.nn.CrossEntropyLoss(return_token_accuracy=True)(torch.eye(3), torch.tensor([0, 1, 0]))
        >>> round(float(acc), 4)
        0.6667
    """

    def __init__(
        self, *args: Any, z_loss: float = 0.0, return_z_loss: bool = False, return_token_accuracy: bool = False,
        return_predicted_tokens: bool = False, **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.z_loss = scalar_arg(z_loss, "CrossEntropyLoss", "z_loss")
        self.return_z_loss = flag_arg(return_z_loss, "CrossEntropyLoss", "return_z_loss")
        self.return_token_accuracy = flag_arg(return_token_accuracy, "CrossEntropyLoss", "return_token_accuracy")
        self.return_predicted_tokens = flag_arg(return_predicted_tokens, "CrossEntropyLoss", "return_predicted_tokens")
        self.attach()

    def _extras(self) -> tuple[bool, ...]:
        return (self.return_z_loss, self.return_token_accuracy, self.return_predicted_tokens)

    def _make_kernel(self) -> Kernel:
        return _ce_kernel(
            self.weight is not None, self.ignore_index, self.reduction, float(self.label_smoothing), self.z_loss,
            self._extras(),
        )  # fmt: skip

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> Any:  # noqa: A002
        k = self._kernel
        out = k(input, target, self.weight) if self.weight is not None else k(input, target)
        if not isinstance(out, dict):
            return out
        return (out["loss"], *(out[key] for key, on in zip(EXTRA_OUTPUTS, self._extras()) if on))


#: cross-entropy's extra outputs in the order a loss module returns them (:func:`rtxdsl.cross_entropy_outputs`)
EXTRA_OUTPUTS = ("z_loss", "accuracy", "predicted_tokens")


@made_once
def _ce_kernel(
    weight: bool, ignore_index: int, reduction: str, smoothing: float, z: float, extra: tuple[bool, ...]
) -> Kernel:
    w = _w if weight else None
    if not any(extra):
        return compile(cross_entropy(_x, _t, w, ignore_index, reduction, smoothing, z))
    outs = cross_entropy_outputs(_x, _t, w, ignore_index, reduction, smoothing, z)
    wanted = {"loss"} | {key for key, on in zip(EXTRA_OUTPUTS, extra) if on}
    return compile({key: e for key, e in outs.items() if key in wanted})


class LinearCrossEntropyLoss(_Fused, torch.nn.Module):
    """``forward(h, w, target, bias=None)``: cross-entropy of the logits ``h @ w.T (+ bias)`` without
    ever writing them (:func:`rtxdsl.linear_cross_entropy`): one forward kernel, two backward
    GEMMs that recompute the logit tiles. Options as :func:`rtxdsl.linear_cross_entropy`'s; the
    class ``weight`` is a constructor argument, as in ``torch.nn.CrossEntropyLoss``. Half inputs give
    a float32 loss (computed in float32 in the kernel either way); under ``torch.autocast`` the
    projection runs in autocast's dtype, as ``F.linear`` would.

    Example:
        >>> import torch, rtxdsl as rx
        >>> loss = rx.nn.LinearCrossEntropyLoss(softcap=30.0)
        >>> h, w = torch.randn(6, 8), torch.randn(11, 8)
        >>> loss(h, w, torch.tensor([1, 2, 3, 4, 5, -100])).shape
        torch.Size([])
    """

    def __init__(
        self, weight: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
        label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
        grad_in_forward: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.register_buffer("weight", weight)
        self.options = {
            "ignore_index": ignore_index, "reduction": reduction, "label_smoothing": float(label_smoothing),
            "z_loss": float(z_loss), "softcap": None if softcap is None else float(softcap),
            "grad_in_forward": grad_in_forward,
        }  # fmt: skip
        self.attach()

    def _make_kernel(self) -> Kernel:
        return self._variants_for()[(False, False)]

    def _make_variants(self) -> dict[Any, Kernel]:
        return self._variants_for()

    def _variants_for(self) -> dict[tuple[bool, bool], Kernel]:
        """By (a bias given, half logits): half logits give a float32 loss, as torch's cross-entropy
        under autocast and Liger's fused loss do (computed in float32 either way, stored so)."""
        options = tuple(sorted(self.options.items()))
        return {
            (b, f): _lce_kernel(b, self.weight is not None, options, f) for b in (False, True) for f in (False, True)
        }

    def forward(
        self, h: torch.Tensor, w: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        ins = {"h": h, "w": w, "t": target} | ({"b": bias} if bias is not None else {})
        ins = autocast_projection(ins) | ({"cw": self.weight} if self.weight is not None else {})
        return self._variants[(bias is not None, ins["h"].dtype in (torch.float16, torch.bfloat16))](**ins)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


@made_once
def _lce_kernel(bias: bool, weight: bool, options: tuple[tuple[str, Any], ...], float32: bool = False) -> Kernel:
    b, cw = (dsl.var("b") if bias else None), (dsl.var("cw") if weight else None)
    loss = linear_cross_entropy(dsl.var("h"), _w, _t, b, cw, **dict(options))
    return compile(cast(loss, torch.float32) if float32 else loss)


class _Tileable(_Fused, torch.nn.Module):
    """An MLP whose ``shards`` option (an int, or ``"auto"``: ``ceil(tokens / hidden)``) computes it
    a slice of tokens at a time (:func:`rtxdsl.nn.tiled_mlp`: the intermediate activations of one
    slice at a time, recomputed in the backward); None (the default) in one pass."""

    shards: int | str | None = None  # a class default: modules built by replace_modules, old pickles

    def _tiling(self, shards: int | str | None) -> None:
        if shards not in (None, "auto"):
            shard_count(torch.empty(1, 1), shards)  # a positive int, or a clear error
        self.shards = shards

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shards is None:
            return self._mlp(x)
        shards = None if self.shards == "auto" else self.shards
        return tiled_mlp(self._mlp, x, shards, [p for p in self.parameters() if p.requires_grad])


class GatedMLP(_Tileable):
    def __init__(
        self, dim: int, hidden: int, bias: bool = False, shards: int | str | None = None, **factory: Any
    ) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(dim, hidden, bias=bias, **factory)
        self.up_proj = torch.nn.Linear(dim, hidden, bias=bias, **factory)
        self.down_proj = torch.nn.Linear(hidden, dim, bias=bias, **factory)
        self._tiling(shards)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._kernel(self.gate_proj(x), self.up_proj(x)))


@made_once
def gated_kernel(kind: str, approximate: str) -> Kernel:
    """``act(g) * u`` as one kernel over ``g`` and ``u``: ``swiglu`` (SiLU) or ``geglu`` (GELU, ``approximate``)."""
    g, u = dsl.var("g"), dsl.var("u")
    return compile(REGISTRY.functions["swiglu"](g, u) if kind == "swiglu" else geglu(g, u, approximate))


class SwiGLU(GatedMLP):
    """Llama's MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, the product fused.

    Example:
        >>> import torch, rtxdsl as rx
        >>> rx.nn.SwiGLU(8, 16)(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(
        self, dim: int, hidden: int, bias: bool = False, shards: int | str | None = None, **factory: Any
    ) -> None:
        super().__init__(dim, hidden, bias, shards, **factory)
        self.attach()

    def _make_kernel(self) -> Kernel:
        return gated_kernel("swiglu", "none")


class GeGLU(GatedMLP):
    """Gemma's MLP: ``down_proj(gelu(gate_proj(x)) * up_proj(x))`` (``approximate="tanh"`` as Gemma).

    Example:
        >>> import torch, rtxdsl as rx
        >>> rx.nn.GeGLU(8, 16)(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(
        self, dim: int, hidden: int, bias: bool = False, approximate: str = "tanh",
        shards: int | str | None = None, **factory: Any,
    ) -> None:  # fmt: skip
        super().__init__(dim, hidden, bias, shards, **factory)
        self.approximate = approximate
        self.attach()

    def _make_kernel(self) -> Kernel:
        return gated_kernel("geglu", self.approximate)


@made_once
def gate_up_kernel(activation: str) -> Kernel:
    """``act(gate) * up`` of ``h = [gate | up]`` (chunked along its last dim), one kernel per activation."""
    h = dsl.var("h")
    gate, up = REGISTRY.functions["chunk"](h, 2, -1)
    return compile(_ACTIVATED[activation](gate, up))


#: activations by name: the torch function each is (``replace_modules`` probes a module's against them)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "gelu": F.gelu,
}

#: the gated products by activation name: silu (SwiGLU), gelu_tanh and gelu (GeGLU)
_ACTIVATED = {
    "silu": lambda g, u: REGISTRY.functions["swiglu"](g, u),
    "gelu_tanh": lambda g, u: geglu(g, u, "tanh"),
    "gelu": lambda g, u: geglu(g, u, "none"),
}


class GateUpMLP(_Tileable):
    """Phi-3's MLP: one ``gate_up_proj`` (gate first, then up), ``down_proj(act(gate) * up)``;
    the chunk and the activation product are one kernel.

    Example:
        >>> import torch, rtxdsl as rx
        >>> rx.nn.GateUpMLP(8, 16)(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(
        self, dim: int, hidden: int, bias: bool = False, activation: str = "silu",
        shards: int | str | None = None, **factory: Any,
    ) -> None:  # fmt: skip
        if activation not in _ACTIVATED:
            raise RtxError(f"GateUpMLP: activation must be one of {sorted(_ACTIVATED)}, got {activation!r}")
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(dim, 2 * hidden, bias=bias, **factory)
        self.down_proj = torch.nn.Linear(hidden, dim, bias=bias, **factory)
        self.activation = activation
        self._tiling(shards)
        self.attach()

    def _make_kernel(self) -> Kernel:
        return gate_up_kernel(self.activation)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._kernel(self.gate_up_proj(x)))


# ---- Liger-Kernel's op set as modules (Liger's parameter names) ------------------------------------
@made_once
def _liger_kernel(kind: str, *options: Any) -> Kernel:
    x, a, g, b, lbl = (dsl.var(n) for n in ("x", "a", "g", "b", "label"))
    f = REGISTRY.functions
    if kind == "dyt":
        return compile(f["dyt"](x, a, g, b if options[0] else None))
    if kind == "poly_norm":
        return compile(f["poly_norm"](x, g, b, options[0]))
    if kind == "sparsemax":
        return compile(f["sparsemax"](x, options[0]))
    if kind == "kl_div":
        return compile(f["kl_div"](x, a, *options))
    label = lbl if options[0] else None
    if kind == "jsd":
        return compile(f["jsd"](x, a, label, *options[1:]))
    return compile(f["tvd"](x, a, label, *options[1:]))


class DyT(_Fused, torch.nn.Module):
    """Dynamic tanh, ``gamma * tanh(alpha * x) + beta``, one kernel forward and backward.

    Example:
        >>> import torch, rtxdsl as rx
        >>> rx.nn.DyT(8)(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(self, hidden_size: int, beta: bool = True, init_alpha: float = 0.5, **factory: Any) -> None:
        super().__init__()
        hidden_size = _positive(hidden_size, "DyT", "hidden_size")
        flag_arg(beta, "DyT", "beta")
        self.alpha = torch.nn.Parameter(torch.full((1,), scalar_arg(init_alpha, "DyT", "init_alpha"), **factory))
        self.gamma = torch.nn.Parameter(torch.ones(hidden_size, **factory))
        self.beta = torch.nn.Parameter(torch.zeros(hidden_size, **factory)) if beta else None
        self.attach()

    def _make_kernel(self) -> Kernel:
        return _liger_kernel("dyt", self.beta is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = {"b": self.beta} if self.beta is not None else {}
        return self._kernel(x=x, a=self.alpha, g=self.gamma, **extra)


class PolyNorm(_Fused, torch.nn.Module):
    """PolyNorm: ``w[0] * norm(x**3) + w[1] * norm(x**2) + w[2] * norm(x) + bias``, one kernel.

    Example:
        >>> import torch, rtxdsl as rx
        >>> rx.nn.PolyNorm()(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(self, eps: float = 1e-6, **factory: Any) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((3,), 1.0 / 3.0, **factory))
        self.bias = torch.nn.Parameter(torch.tensor(1.0, **factory))
        self.eps = scalar_arg(eps, "PolyNorm", "eps")
        self.attach()

    def _make_kernel(self) -> Kernel:
        return _liger_kernel("poly_norm", self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x=x, g=self.weight, b=self.bias)


class Sparsemax(_Fused, torch.nn.Module):
    """Sparsemax over ``dim`` (Liger's ``LigerSparsemax``): one row kernel, fused backward.

    Example:
        >>> import torch, rtxdsl as rx
        >>> rx.nn.Sparsemax()(torch.tensor([[2.0, 1.0, -1.0]]))
        tensor([[1., 0., 0.]])
    """

    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = int_arg(dim, "Sparsemax", "dim")
        self.attach()

    def _make_kernel(self) -> Kernel:
        return _liger_kernel("sparsemax", self.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x=x)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class KLDivLoss(_Fused, torch.nn.KLDivLoss):
    """``torch.nn.KLDivLoss`` as one kernel (the pointwise terms and their reduction), fused backward.

    Example:
        >>> import torch, rtxdsl as rx
        >>> q, p = torch.randn(2, 5).log_softmax(-1), torch.randn(2, 5).softmax(-1)
        >>> rx.nn.KLDivLoss(reduction="batchmean")(q, p).shape
        torch.Size([])
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attach()

    def _make_kernel(self) -> Kernel:
        return _liger_kernel("kl_div", self.reduction, bool(self.log_target))

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # noqa: A002
        return self._kernel(x=input, a=target)


class _LabelledLoss(_Fused, torch.nn.Module):
    """A divergence over rows with an optional label per row (rows labelled ``ignore_index`` count nothing)."""

    _kind = ""

    def _options(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def _make_kernel(self) -> Kernel:
        return _liger_kernel(self._kind, False, *self._options())

    def _make_variants(self) -> dict[Any, Kernel]:
        return {"label": _liger_kernel(self._kind, True, *self._options())}

    def forward(self, a: torch.Tensor, b: torch.Tensor, label: torch.Tensor | None = None) -> torch.Tensor:
        if label is None:
            return self._kernel(x=a, a=b)
        return self._variants["label"](x=a, a=b, label=label)


class JSD(_LabelledLoss):
    """Liger-Kernel's generalized Jensen-Shannon divergence ``forward(log_q, log_p, label=None)``
    (student, teacher log-probabilities): ``beta=0`` forward KL, ``beta=1`` reverse KL.

    Example:
        >>> import torch, rtxdsl as rx
        >>> q, p = torch.randn(2, 5).log_softmax(-1), torch.randn(2, 5).log_softmax(-1)
        >>> rx.nn.JSD(beta=0.5)(q, p).shape
        torch.Size([])
    """

    _kind = "jsd"

    def __init__(self, beta: float = 0.5, ignore_index: int = -100) -> None:
        super().__init__()
        self.beta, self.ignore_index = scalar_arg(beta, "JSD", "beta"), int_arg(ignore_index, "JSD", "ignore_index")
        self.attach()

    def _options(self) -> tuple[Any, ...]:
        return (self.beta, self.ignore_index)


class TVDLoss(_LabelledLoss):
    """Total variation distance ``|p - q| / 2`` (Liger-Kernel's ``forward(p, q, label=None)``).

    Example:
        >>> import torch, rtxdsl as rx
        >>> rx.nn.TVDLoss()(torch.rand(2, 5), torch.rand(2, 5)).shape
        torch.Size([])
    """

    _kind = "tvd"

    def __init__(self, reduction: str = "batchmean", ignore_index: int = -100) -> None:
        super().__init__()
        self.reduction, self.ignore_index = reduction, int_arg(ignore_index, "TVDLoss", "ignore_index")
        self.attach()

    def _options(self) -> tuple[Any, ...]:
        return (self.reduction, self.ignore_index)


class GroupNorm(_Fused, torch.nn.GroupNorm):
    """``torch.nn.GroupNorm``: statistics over each group of channels (a row of a reshape, read in
    place), then the per-channel affine; fused backward.

    Example:
        >>> import torch, rtxdsl as rx
        >>> rx.nn.GroupNorm(2, 4)(torch.randn(3, 4, 5)).shape
        torch.Size([3, 4, 5])
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attach()

    def _make_kernel(self) -> Kernel:
        return _group_norm_kernel(self.num_groups, float(self.eps), self.affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, self.weight, self.bias) if self.affine else self._kernel(x)


@made_once
def _group_norm_kernel(groups: int, eps: float, affine: bool) -> Kernel:
    f = REGISTRY.functions["group_norm"]
    return compile(f(_x, groups, _w, _b, eps) if affine else f(_x, groups, None, None, eps))
