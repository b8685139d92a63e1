"""The workloads rtxdsl is measured on: the demo, the benchmarks and the reports share them.

Each is an expression (or dict of them), a maker of inputs for ``rows x hidden`` and the
eager torch code a user would otherwise write.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import rtxdsl as rx

from .expr import Expr

ADAMW = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.01, step=10)


@dataclass(frozen=True)
class Workload:
    name: str
    expr: Callable[[], Expr | dict[str, Expr]]
    inputs: Callable[[int, int, torch.dtype, torch.device, torch.Generator], dict[str, torch.Tensor]]
    eager: Callable[..., Any]
    dtype: torch.dtype = torch.float32


def _rand(gen: torch.Generator, device: torch.device, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def _named(*spec: tuple[str, str]) -> Callable[..., dict[str, torch.Tensor]]:
    """Inputs by name: "rh" is rows x hidden, "h" is hidden."""

    def make(rows: int, hidden: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
        shape = {"rh": (rows, hidden), "h": (hidden,)}
        return {name: _rand(gen, device, dtype, *shape[kind]) for name, kind in spec}

    return make


def _masked(rows: int, hidden: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    mask = torch.zeros(rows, hidden)
    mask[:, 1::4] = float("-inf")  # additive attention mask; column 0 always kept
    return {"x": _rand(gen, device, dtype, rows, hidden), "m": mask.to(device=device, dtype=dtype)}


def _adam_inputs(rows: int, hidden: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    ins = _named(("p", "rh"), ("g", "rh"), ("m", "rh"), ("v", "rh"))(rows, hidden, dtype, device, gen)
    ins["v"] = ins["v"].abs()
    return ins


def _ce_inputs(rows: int, hidden: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    target = torch.randint(0, hidden, (rows,), generator=gen)
    target[::7] = -100  # padding tokens: ignored
    return {"x": _rand(gen, device, dtype, rows, hidden), "t": target.to(device)}


def _rope_inputs(rows: int, hidden: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    """q and k as [rows, hidden] (tokens x one head's dim, made even); cos / sin of the positions."""
    half = hidden // 2
    hidden = 2 * half
    angle = torch.arange(rows)[:, None] * (10000 ** (-torch.arange(half) / half))[None]
    angle = torch.cat((angle, angle), -1)
    ins = _named(("q", "rh"), ("k", "rh"))(rows, hidden, dtype, device, gen)
    return {**ins, "c": angle.cos().to(device=device, dtype=dtype), "s": angle.sin().to(device=device, dtype=dtype)}


def rope_eager(t: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Hugging Face Llama's apply_rotary_pos_emb for one tensor."""
    half = t.shape[-1] // 2
    return t * c + torch.cat((-t[..., half:], t[..., :half]), -1) * s


def adamw(lr: float, b1: float, b2: float, eps: float, wd: float, step: int) -> dict[str, Expr]:
    """One AdamW step: new parameter, first and second moments, as one three-output kernel."""
    p, g, m, v = rx.var("p"), rx.var("g"), rx.var("m"), rx.var("v")
    m2 = b1 * m + (1 - b1) * g
    v2 = b2 * v + (1 - b2) * g * g
    update = (m2 / (1 - b1**step)) / (rx.sqrt(v2 / (1 - b2**step)) + eps)
    return {"p": p - lr * (update + wd * p), "m": m2, "v": v2}


def adamw_eager(p, g, m, v, lr, b1, b2, eps, wd, step):
    m2 = b1 * m + (1 - b1) * g
    v2 = b2 * v + (1 - b2) * g * g
    update = (m2 / (1 - b1**step)) / ((v2 / (1 - b2**step)).sqrt() + eps)
    return {"p": p - lr * (update + wd * p), "m": m2, "v": v2}


def _v(*names: str) -> tuple[Expr, ...]:
    return tuple(rx.var(n) for n in names)


WORKLOADS: list[Workload] = [
    Workload(
        "mul_add_relu",
        lambda: rx.relu(rx.var("x") * rx.var("y") + 1.0),
        _named(("x", "rh"), ("y", "rh")),
        lambda x, y: torch.relu(x * y + 1.0),
    ),
    Workload(
        "bias_gelu",
        lambda: rx.gelu(rx.var("x") + rx.var("b")),
        _named(("x", "rh"), ("b", "h")),
        lambda x, b: F.gelu(x + b),
    ),
    Workload(
        "bias_gelu_tanh_bf16",
        lambda: rx.gelu(rx.var("x") + rx.var("b"), approximate="tanh"),
        _named(("x", "rh"), ("b", "h")),
        lambda x, b: F.gelu(x + b, approximate="tanh"),
        torch.bfloat16,
    ),
    Workload("softmax", lambda: rx.softmax(rx.var("x")), _named(("x", "rh")), lambda x: torch.softmax(x, -1)),
    Workload(
        "scaled_masked_softmax",
        lambda: rx.softmax(rx.var("x") * 0.125 + rx.var("m")),
        _masked,
        lambda x, m: torch.softmax(x * 0.125 + m, -1),
    ),
    Workload(
        "layer_norm",
        lambda: rx.layer_norm(*_v("x", "w", "b")),
        _named(("x", "rh"), ("w", "h"), ("b", "h")),
        lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b),
    ),
    Workload(
        "residual_layer_norm",
        lambda: {
            "h": rx.var("x") + rx.var("r"),
            "y": rx.layer_norm(rx.var("x") + rx.var("r"), rx.var("w"), rx.var("b")),
        },
        _named(("x", "rh"), ("r", "rh"), ("w", "h"), ("b", "h")),
        lambda x, r, w, b: {"h": x + r, "y": F.layer_norm(x + r, x.shape[-1:], w, b)},
    ),
    Workload(
        "rms_norm_swiglu",
        lambda: rx.swiglu(rx.rms_norm(rx.var("g"), rx.var("w")), rx.var("u")),
        _named(("g", "rh"), ("w", "h"), ("u", "rh")),
        lambda g, w, u: F.silu(F.rms_norm(g, g.shape[-1:], w, 1e-6)) * u,
    ),
    Workload("adamw_step", lambda: adamw(**ADAMW), _adam_inputs, lambda p, g, m, v: adamw_eager(p, g, m, v, **ADAMW)),
    Workload(
        "add_rms_norm",
        lambda: {"h": rx.var("x") + rx.var("r"), "y": rx.rms_norm(rx.var("x") + rx.var("r"), rx.var("w"))},
        _named(("x", "rh"), ("r", "rh"), ("w", "h")),
        lambda x, r, w: {"h": x + r, "y": F.rms_norm(x + r, x.shape[-1:], w, 1e-6)},
    ),
    Workload(
        "geglu",
        lambda: rx.geglu(rx.var("g"), rx.var("u"), approximate="tanh"),
        _named(("g", "rh"), ("u", "rh")),
        lambda g, u: F.gelu(g, approximate="tanh") * u,
    ),
    Workload(
        "rope_qk",
        lambda: {"q": rx.rope(*_v("q", "c", "s")), "k": rx.rope(*_v("k", "c", "s"))},
        _rope_inputs,
        lambda q, k, c, s: {"q": rope_eager(q, c, s), "k": rope_eager(k, c, s)},
    ),
    Workload(
        "cross_entropy",
        lambda: rx.cross_entropy(rx.var("x"), rx.var("t"), label_smoothing=0.1),
        _ce_inputs,
        lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1),
    ),
]

BY_NAME = {w.name: w for w in WORKLOADS}


def max_error(out: Any, want: Any) -> float:
    """Largest absolute difference over one output or a dict of them, in float64.

    NaN where only one side has NaN (in any output) makes the result NaN; equal values (inf
    included) and NaN on both sides count as agreement; a shape mismatch is infinite.
    """
    outs = out if isinstance(out, dict) else {"out": out}
    wants = want if isinstance(want, dict) else {"out": want}
    worst = 0.0
    for k in outs:
        a, b = outs[k].double(), wants[k].double()
        if a.shape != b.shape:
            return math.inf
        if not a.numel():
            continue
        d = torch.where((a == b) | (a.isnan() & b.isnan()), 0.0, (a - b).abs())
        m = d.max().item()
        if math.isnan(m):
            return math.nan
        worst = max(worst, m)
    return worst


def tolerance(dtype: torch.dtype) -> float:
    """Absolute error allowed against eager torch at the workloads' magnitudes."""
    return {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}.get(dtype, 1e-4)
