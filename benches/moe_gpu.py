"""The GPU report's mixture-of-experts section: ``rx.nn.moe_experts`` against torch's grouped GEMM.

transformers v5's experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, SwiGLU, top-k
routing weights) are timed forward and forward + backward in bf16 as rtxdsl's grouped GEMMs (3
launches forward, 5 backward), ``torch._grouped_mm`` over tokens sorted by expert (what
transformers' ``grouped_mm`` implementation runs), a loop over experts (transformers' ``eager``)
and Liger-Kernel's ``LigerFusedMoEFunction`` where importable; each is first checked against
float64 (on CPU: only that, at small sizes, under Triton's interpreter).

    python -m benches.gpu_report     # runs this section after the contractions
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import rtxdsl as rx
from benches.common import gpu_ms

#: (tokens, hidden, intermediate, experts, top_k): Qwen3-30B-A3B's and Mixtral-8x7B's experts
SIZES = [(4096, 2048, 768, 128, 8), (4096, 4096, 14336, 8, 2)]


def _inputs(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype,
            device: torch.device, seed: int) -> dict:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)

    def t(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * shape[-1] ** -0.5).to(device=device, dtype=dtype)

    logits = torch.randn(tokens, experts, generator=gen)
    weights, index = logits.softmax(-1).topk(top_k, -1)  # Mixtral's router: top-k of a softmax
    return {
        "x": t(tokens, hidden),
        "gate_up": t(experts, 2 * inter, hidden),
        "down": t(experts, hidden, inter),
        "index": index.to(device),
        "weights": (weights / weights.sum(-1, keepdim=True)).to(device=device, dtype=dtype),
    }


def _loop(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, index: torch.Tensor,
          weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """transformers' ``eager`` experts: each expert's tokens in turn."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(index == e)
        gate, up = F.linear(x[token], gate_up[e]).chunk(2, -1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[token, slot, None]
        out = out.index_add(0, token, y.to(out.dtype))
    return out


def _grouped_mm(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, index: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Tokens sorted by expert through ``torch._grouped_mm`` (offsets: each expert's last row)."""
    flat = index.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // index.shape[-1]
    offs = torch.bincount(flat, minlength=gate_up.shape[0]).cumsum(0).to(torch.int32)
    gate, up = torch._grouped_mm(x[token], gate_up.transpose(1, 2), offs=offs).chunk(2, -1)
    y = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs)
    y = y * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add(0, token, y)


def _impls() -> dict[str, Callable[..., Any]]:
    impls: dict[str, Callable[..., Any]] = {
        "rtxdsl": lambda x, gate_up, down, index, weights: rx.nn.moe_experts(x, gate_up, down, index, weights),
        "torch._grouped_mm": _grouped_mm,
        "eager loop": _loop,
    }
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

        impls["liger"] = lambda x, gate_up, down, index, weights: LigerFusedMoEFunction.apply(
            x, gate_up, down, index.to(torch.int32), weights
        )
    except ImportError:
        pass
    return impls


def _errors(got: torch.Tensor, grads: tuple, ins: dict) -> float:
    """The largest error relative to each result's magnitude, forward and every gradient, vs float64."""
    wide = {n: (v.double().requires_grad_() if v.is_floating_point() else v) for n, v in ins.items()}
    want = _loop(**wide)
    leaves = [wide[n] for n in ("x", "gate_up", "down", "weights")]
    want_grads = torch.autograd.grad(want.sum(), leaves)
    pairs = [(got, want), *zip(grads, want_grads)]
    return max(((g.double() - e).abs().max() / e.abs().max().clamp_min(1e-30)).item() for g, e in pairs)


def check(device: torch.device, sizes: list[tuple[int, int, int, int, int]]) -> list[dict]:
    """rtxdsl's experts against float64, forward and every gradient, fp32 and bf16."""
    rows = []
    for size in sizes:
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
            ins = _inputs(*size, dtype, device, 7)
            leaves = [ins[n].requires_grad_() for n in ("x", "gate_up", "down", "weights")]
            rx.reset_fusion_stats()
            out = rx.nn.moe_experts(ins["x"], ins["gate_up"], ins["down"], ins["index"], ins["weights"])
            grads = torch.autograd.grad(out.sum(), leaves)
            err = _errors(out, grads, {n: v.detach() for n, v in ins.items()})
            launches = rx.fusion_stats().kernels_launched
            rows.append({"case": "moe experts", "shape": "x".join(map(str, size)), "dtype": str(dtype)[6:],
                         "max error": err, "ok": err <= tol, "kernels": launches})  # fmt: skip
    return rows


def time_moe(quick: bool) -> list[dict]:
    """Forward and forward + backward time of each implementation, bf16, each size."""
    dev = torch.device("cuda")
    rows = []
    for size in SIZES[:1] if quick else SIZES:
        ins = _inputs(*size, torch.bfloat16, dev, 9)
        leaves = [ins[n].requires_grad_() for n in ("x", "gate_up", "down", "weights")]
        cot = torch.randn_like(ins["x"])
        for impl, fn in _impls().items():
            if impl == "eager loop" and size[3] > 32:
                continue  # a launch per expert and op: minutes of timing, nothing to learn
            try:
                fwd = gpu_ms(lambda fn=fn: fn(**ins), 10, 50)
                both = gpu_ms(lambda fn=fn: torch.autograd.grad(fn(**ins), leaves, cot), 10, 50)
            except Exception as exc:  # noqa: BLE001 (a failing peer is a result to report)
                print(f"  moe experts {size} {impl}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            rows.append({"case": "moe experts", "shape": "x".join(map(str, size)), "impl": impl,
                         "forward us": fwd * 1e3, "forward + backward us": both * 1e3})  # fmt: skip
    return rows
