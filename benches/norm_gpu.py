"""The GPU report's norm-backward section: RMSNorm and LayerNorm gradients, bf16.

The backward alone is timed (the forward's statistics saved once, outside the timing): rtxdsl's
row kernel accumulating the weight (and bias) gradients over each program's rows with the merge
of its partials (2 launches), eager autograd, torch.compile and Liger-Kernel's functions where
importable. Achieved GB/s counts the minimum bytes: x and dy read once, dx written once. Each is
first checked against float64 (on CPU: only that, small, under Triton's interpreter).

    python -m benches.gpu_report     # runs this section after the contractions
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import rtxdsl as rx

#: (rows, hidden): a Llama-8B layer's tokens x hidden at two batch sizes
SIZES = [(4096, 4096), (16384, 4096)]
_x, _w, _b = rx.var("x"), rx.var("w"), rx.var("b")
#: name -> (rtxdsl expression, eager function, its parameter names)
NORMS: dict[str, tuple[Callable[[], Any], Callable[..., torch.Tensor], str]] = {
    "rms_norm": (lambda: rx.rms_norm(_x, _w), lambda x, w: F.rms_norm(x, x.shape[-1:], w, 1e-6), "w"),
    "layer_norm": (lambda: rx.layer_norm(_x, _w, _b), lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b), "wb"),
}


def _inputs(rows: int, hidden: int, params: str, dtype: torch.dtype, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(5)
    ins = {"x": torch.randn(rows, hidden, generator=gen)}
    ins |= {n: 1 + 0.1 * torch.randn(hidden, generator=gen) for n in params}
    return {n: t.to(device=device, dtype=dtype).requires_grad_() for n, t in ins.items()}


def _liger(name: str) -> Callable[..., torch.Tensor] | None:
    try:
        if name == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            return lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6)
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5)
    except ImportError:
        return None


def check(device: torch.device, sizes: list[tuple[int, int]]) -> list[dict]:
    """rtxdsl's gradients against float64, every input, fp32 and bf16."""
    rows = []
    for name, (expr, eager, params) in NORMS.items():
        k = rx.compile(expr())
        for size in sizes:
            for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
                ins = _inputs(*size, params, dtype, device)
                wide = {n: t.detach().double().requires_grad_() for n, t in ins.items()}
                dy = torch.randn(size, generator=torch.Generator().manual_seed(6)).to(device)
                rx.reset_fusion_stats()
                got = torch.autograd.grad(k(**ins), list(ins.values()), dy.to(dtype))
                launches = rx.fusion_stats().kernels_launched
                want = torch.autograd.grad(eager(**wide), list(wide.values()), dy.double())
                err = max(((g.double() - e).abs().max() / e.abs().max()).item() for g, e in zip(got, want))
                rows.append({"case": f"{name} backward", "shape": f"{size[0]}x{size[1]}", "dtype": str(dtype)[6:],
                             "max error": err, "ok": err <= tol, "kernels": launches})  # fmt: skip
    return rows


def time_norms(quick: bool, copy_gbs: float) -> list[dict]:
    """The backward's time per implementation, bf16, each size (the forward run once, outside)."""
    from triton.testing import do_bench

    out = []
    for name, (expr, eager, params) in NORMS.items():
        impls: dict[str, Callable[..., torch.Tensor] | None] = {"rtxdsl": rx.compile(expr()), "eager": eager}
        if not quick:
            impls["torch.compile"] = torch.compile(eager, dynamic=False)
        impls["liger"] = _liger(name)
        for rows, hidden in SIZES[:1] if quick else SIZES:
            ins = _inputs(rows, hidden, params, torch.bfloat16, torch.device("cuda"))
            dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
            minimum = 3 * rows * hidden * 2  # x and dy read, dx written
            for impl, fn in impls.items():
                if fn is None:
                    continue
                try:
                    y = fn(**ins)
                    ms = do_bench(lambda y=y: torch.autograd.grad(y, list(ins.values()), dy, retain_graph=True),
                                  warmup=10, rep=50, return_mode="median")  # fmt: skip
                except Exception as exc:  # noqa: BLE001 (a failing peer is a result to report)
                    print(f"  {name} backward {rows}x{hidden} {impl}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                gbs = minimum / (ms * 1e-3) / 1e9
                out.append({"case": f"{name} backward", "shape": f"{rows}x{hidden}", "impl": impl,
                            "us": ms * 1e3, "GB/s": gbs, "of copy": round(gbs / copy_gbs, 3)})  # fmt: skip
    return out
