"""Drop-in modules: torch's constructor arguments, parameter names and state_dict keys, with the
memory-bound part of ``forward`` as one fused rtxdsl kernel (fused backward too).

``rx.nn.LayerNorm`` / ``RMSNorm`` / ``CrossEntropyLoss`` subclass torch's, so checkpoints load both
ways and ``isinstance`` checks keep working; ``SwiGLU`` / ``GeGLU`` are Llama- / Gemma-style MLP
blocks (gate, up and down projections run as torch matmuls, the activation product is fused).
``replace_modules(model)`` swaps torch's norms for these in place.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from . import dsl
from .expr import node
from .ops import REGISTRY
from .ops.composite import geglu, layer_norm, rms_norm
from .ops.llm import cross_entropy
from .runtime import Kernel, compile

_x, _w, _b, _t = dsl.var("x"), dsl.var("w"), dsl.var("b"), dsl.var("t")


@functools.lru_cache(maxsize=64)
def _norm_kernel(kind: str, eps: float | None, weight: bool, bias: bool) -> Kernel:
    w = _w if weight else None
    if kind == "layer_norm":
        return compile(layer_norm(_x, w, _b if bias else None, eps))
    if eps is None:  # torch: the machine epsilon of the input's dtype, known at binding
        return compile(node("rms_norm", _x, _w if weight else 1.0, node("eps_of", _x)))
    return compile(rms_norm(_x, w, eps))


class _Fused:
    """Holds the module's kernel, made when the module is (never inside a torch.compile trace)."""

    _kernel: Kernel

    def _make_kernel(self) -> Kernel:
        raise NotImplementedError

    def _attach(self) -> None:
        self._kernel = self._make_kernel()


class LayerNorm(_Fused, torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` over the last axis as one kernel (statistics in one pass).

    Example:
        >>> import torch, rtxdsl as rx
        >>> rx.nn.LayerNorm(8)(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._attach()

    def _make_kernel(self) -> Kernel:
        return _norm_kernel("layer_norm", float(self.eps), self.weight is not None, self.bias is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:  # several normalized dims: torch's own
            return super().forward(x)
        args = [x] + [p for p in (self.weight, self.bias) if p is not None]
        return self._kernel(*args)


class RMSNorm(_Fused, torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` over the last axis as one kernel (``eps=None``: the dtype's epsilon, as torch).

    Example:
        >>> import torch, rtxdsl as rx
        >>> rx.nn.RMSNorm(8)(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._attach()

    def _make_kernel(self) -> Kernel:
        eps = None if self.eps is None else float(self.eps)
        return _norm_kernel("rms_norm", eps, self.weight is not None, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:
            return super().forward(x)
        return self._kernel(x, self.weight) if self.weight is not None else self._kernel(x)


class CrossEntropyLoss(_Fused, torch.nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` as one row kernel (+ the mean), fused backward.

    Example:
        >>> import torch, rtxdsl as rx
        >>> rx.nn.CrossEntropyLoss()(torch.randn(4, 10), torch.tensor([1, 2, 3, 4])).shape
        torch.Size([])
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._attach()

    def _make_kernel(self) -> Kernel:
        return _ce_kernel(self.weight is not None, self.ignore_index, self.reduction, float(self.label_smoothing))

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # noqa: A002
        k = self._kernel
        return k(input, target, self.weight) if self.weight is not None else k(input, target)


@functools.lru_cache(maxsize=64)
def _ce_kernel(weight: bool, ignore_index: int, reduction: str, smoothing: float) -> Kernel:
    return compile(cross_entropy(_x, _t, _w if weight else None, ignore_index, reduction, smoothing))


class _GatedMLP(_Fused, torch.nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False, **factory: Any) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(dim, hidden, bias=bias, **factory)
        self.up_proj = torch.nn.Linear(dim, hidden, bias=bias, **factory)
        self.down_proj = torch.nn.Linear(hidden, dim, bias=bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._kernel(self.gate_proj(x), self.up_proj(x)))


@functools.lru_cache(maxsize=8)
def _gated(kind: str, approximate: str) -> Kernel:
    g, u = dsl.var("g"), dsl.var("u")
    return compile(REGISTRY.functions["swiglu"](g, u) if kind == "swiglu" else geglu(g, u, approximate))


class SwiGLU(_GatedMLP):
    """Llama's MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, the product fused.

    Example:
        >>> import torch, rtxdsl as rx
        >>> rx.nn.SwiGLU(8, 16)(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(self, dim: int, hidden: int, bias: bool = False, **factory: Any) -> None:
        super().__init__(dim, hidden, bias, **factory)
        self._attach()

    def _make_kernel(self) -> Kernel:
        return _gated("swiglu", "none")


class GeGLU(_GatedMLP):
    """Gemma's MLP: ``down_proj(gelu(gate_proj(x)) * up_proj(x))`` (``approximate="tanh"`` as Gemma).

    Example:
        >>> import torch, rtxdsl as rx
        >>> rx.nn.GeGLU(8, 16)(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(self, dim: int, hidden: int, bias: bool = False, approximate: str = "tanh", **factory: Any) -> None:
        super().__init__(dim, hidden, bias, **factory)
        self.approximate = approximate
        self._attach()

    def _make_kernel(self) -> Kernel:
        return _gated("geglu", self.approximate)


def replace_modules(model: torch.nn.Module) -> int:
    """Swap torch's ``LayerNorm`` and ``RMSNorm`` in ``model`` for rtxdsl's, in place (weights kept).

    Returns how many modules were swapped.

    Example:
        >>> import torch, rtxdsl as rx
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> rx.nn.replace_modules(m), type(m[1]).__module__
        (1, 'rtxdsl.nn')
    """
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = _replacement(child)
            if new is not None:
                setattr(parent, name, new)
                swapped += 1
    return swapped


def _replacement(m: torch.nn.Module) -> torch.nn.Module | None:
    """The rtxdsl module equal to ``m`` (same arguments, parameters moved over), or None."""
    if type(m) is torch.nn.LayerNorm:
        new: torch.nn.Module = LayerNorm.__new__(LayerNorm)
    elif type(m) is torch.nn.RMSNorm:
        new = RMSNorm.__new__(RMSNorm)
    else:
        return None
    new.__dict__.update(m.__dict__)  # same parameters, buffers, hooks and training flag: nothing copied
    new._attach()  # type: ignore[attr-defined]
    return new
