"""Fused optimizers: ``rx.optim.AdamW`` is ``torch.optim.AdamW`` (same arguments, param groups, state
and state_dict, so either loads the other's checkpoint and LR schedulers work) whose step runs one
fused multi-output kernel per parameter, which writes the parameter and its state in place (no
per-step copies). Learning rate, betas, bias corrections and weight decay are scalar kernel
arguments: a schedule compiles nothing.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import dsl
from .dtensor import is_dtensor
from .nn.memo import made_once
from .ops import REGISTRY
from .runtime import Kernel
from .runtime_grad import land

_maximum, _sqrt, _where = (REGISTRY.functions[n] for n in ("maximum", "sqrt", "where"))


@made_once
def _adamw_kernel(amsgrad: bool, in_place: bool) -> Kernel:
    """p, m, v (and the running max of v) after one AdamW step, torch's formula step for step;
    ``in_place``: each written over its own tensor where that is safe (not for DTensors, whose
    kernels run as functional torch ops). The step's scalars come computed as torch computes them,
    in double on the host: ``1 - lr * wd``, ``1 - beta1``, ``1 - beta2`` (formed from a float32
    ``beta2`` in the kernel it was 1.3e-5 off at 0.999, a bias every step shared), ``lr / (1 -
    beta1**t)`` and ``sqrt(1 - beta2**t)``."""
    p, g, m, v, vmax = (dsl.var(n) for n in ("p", "g", "m", "v", "vmax"))
    decay, w1, b2, w2, c2, eps, step = (dsl.var(n) for n in ("decay", "w1", "b2", "w2", "c2", "eps", "step"))
    decayed = p * decay  # torch: param.mul_(1 - lr * weight_decay)
    # torch: exp_avg.lerp_(grad, 1 - beta1), whose kernel takes the nearer end by the weight
    m2 = _where(w1 < 0.5, m + w1 * (g - m), g - (g - m) * (1 - w1))
    v2 = v * b2 + w2 * g * g  # torch: exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    outs = {"m": m2, "v": v2}
    second = v2
    if amsgrad:
        second = _maximum(vmax, v2)
        outs["vmax"] = second
    denom = _sqrt(second) / c2 + eps
    outs["p"] = decayed - step * (m2 / denom)  # torch: param.addcdiv_(exp_avg, denom, value=-step_size)
    names = ("p", "g", "m", "v", *(("vmax",) if amsgrad else ()), "decay", "w1", "b2", "w2", "c2", "eps", "step")
    return Kernel(outs, inputs=names, into={k: k for k in outs} if in_place else None)


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with a fused step (one kernel per parameter; fp32 math for half params).

    Example:
        >>> import torch, rtxdsl as rx
        >>> w = torch.nn.Parameter(torch.ones(3))
        >>> opt = rx.optim.AdamW([w], lr=0.1)
        >>> w.grad = torch.ones(3); opt.step(); round(w[0].item(), 4)
        0.899
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False) -> None:  # fmt: skip
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize
        )
        for group in self.param_groups:  # the step's kernels, made outside any torch.compile trace
            for in_place in (False, True):
                _adamw_kernel(bool(group["amsgrad"]), in_place)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            amsgrad = group["amsgrad"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:  # torch's own state layout, so state_dicts move both ways
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if amsgrad:
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = float(state["step"])
                g = -p.grad if group["maximize"] else p.grad
                args = [p.detach(), g, state["exp_avg"], state["exp_avg_sq"]]
                args += [state["max_exp_avg_sq"]] if amsgrad else []
                lr, beta1, beta2 = float(group["lr"]), float(b1), float(b2)
                scalars = [1 - lr * float(group["weight_decay"]), 1 - beta1, beta2, 1 - beta2]
                scalars += [math.sqrt(1 - beta2**step), float(group["eps"]), lr / (1 - beta1**step)]
                out = _adamw_kernel(amsgrad, not is_dtensor(p))(*args, *scalars)
                targets = {"p": p, "m": state["exp_avg"], "v": state["exp_avg_sq"]}
                if amsgrad:
                    targets["vmax"] = state["max_exp_avg_sq"]
                for key, target in targets.items():
                    land(out[key], target)
        return loss
