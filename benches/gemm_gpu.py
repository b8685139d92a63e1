"""The GPU report's contraction section: a GEMM with its epilogue fused against cuBLAS.

At Llama-7B / Llama-3-8B projection sizes, fp16 and bf16, each case is timed as rtxdsl's one
kernel, cuBLAS's GEMM alone (``F.linear``: the floor a fused epilogue should stay near), cuBLAS
plus the eager epilogue (what the fusion replaces) and ``torch.compile`` of the same; TFLOP/s
counts ``2 M N K`` and is shown as a fraction of the device's dense 16-bit tensor-core peak. The
Llama MLP block is timed forward and backward. Every case is first checked against eager torch
(on CPU: only that, at small sizes, under Triton's interpreter).

    python -m benches.gpu_report     # runs this section after the memory-bound workloads
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import rtxdsl as rx
from benches.common import gpu_ms, peak_and_ms

_x, _w, _b, _r, _wg, _wu, _wd = (rx.var(n) for n in ("x", "w", "b", "r", "wg", "wu", "wd"))

#: dense fp16 / bf16 tensor-core peak of an H100 / H200 SXM (TFLOP/s, no sparsity)
PEAK_TFLOPS = 989.0

#: (tokens, out features, in features): Llama-7B q/k/v/o, up/gate, down; Llama-3-8B up/gate
SIZES = [(4096, 4096, 4096), (4096, 11008, 4096), (4096, 4096, 11008), (8192, 14336, 4096)]


def _cases() -> dict[str, tuple[rx.Expr, Callable[..., Any], Callable[..., Any]]]:
    """name -> (rtxdsl expression, eager with its epilogue, cuBLAS's GEMM alone)."""
    alone = lambda x, w, **_: F.linear(x, w)  # noqa: E731
    return {
        "linear": (rx.linear(_x, _w), lambda x, w: F.linear(x, w), alone),
        "linear + bias + gelu": (
            rx.gelu(rx.linear(_x, _w, _b)),
            lambda x, w, b: F.gelu(F.linear(x, w, b)),
            alone,
        ),
        "linear + bias + residual": (
            rx.linear(_x, _w, _b) + _r,
            lambda x, w, b, r: F.linear(x, w, b) + r,
            alone,
        ),
    }


def _inputs(name: str, m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)

    ins = {"x": t(m, k), "w": t(n, k, scale=k**-0.5)}
    if "bias" in name:
        ins["b"] = t(n)
    if "residual" in name:
        ins["r"] = t(m, n)
    return ins


def check(device: torch.device, sizes: list[tuple[int, int, int]]) -> list[dict]:
    """Every case against eager torch in float64 (fp32 accumulation: a per-sqrt(K) tolerance)."""
    rows = []
    for name, (expr, eager, _) in _cases().items():
        kernel = rx.compile(expr)
        for m, n, k in sizes:
            for dtype in (torch.float16, torch.bfloat16):
                ins = _inputs(name, m, n, k, dtype, device, 1)
                got = kernel(**ins).double()
                want = eager(**{v: t.double() for v, t in ins.items()})
                err = (got - want).abs().max().item() if got.numel() else 0.0
                tol = (1e-2 if dtype == torch.float16 else 6e-2) * max(1.0, want.abs().max().item())
                rows.append({"case": name, "shape": f"{m}x{n}x{k}", "dtype": str(dtype)[6:], "max error": err,
                             "ok": err <= tol, "kernels": kernel.launches(**ins)})  # fmt: skip
    return rows


def time_gemms(deadline: float, quick: bool) -> list[dict]:
    """TFLOP/s of each case and implementation (stops at ``deadline``, a perf_counter time)."""
    rows = []
    dev = torch.device("cuda")
    for name, (expr, eager, alone) in _cases().items():
        kernel = rx.compile(expr)
        impls: dict[str, Callable[..., Any]] = {"rtxdsl": lambda kk=kernel, **ins: kk(**ins)}
        impls["cuBLAS GEMM alone"] = alone
        if name != "linear":
            impls["cuBLAS + eager epilogue"] = eager
        if not quick:
            impls["torch.compile"] = torch.compile(eager, dynamic=False)
        for m, n, k in SIZES[:2] if quick else SIZES:
            for dtype in (torch.float16, torch.bfloat16):
                if time.perf_counter() > deadline:
                    print(f"  {name} {m}x{n}x{k}: skipped, over the time budget")
                    return rows
                ins = _inputs(name, m, n, k, dtype, dev, 2)
                for impl, fn in impls.items():
                    try:
                        ms = gpu_ms(lambda fn=fn: fn(**ins))
                    except Exception as exc:  # noqa: BLE001
                        print(f"  {name} {m}x{n}x{k} {impl}: {type(exc).__name__}: {exc}")
                        continue
                    tflops = 2 * m * n * k / (ms * 1e-3) / 1e12
                    shape, dt = f"{m}x{n}x{k}", str(dtype)[6:]
                    rows.append({"case": name, "shape": shape, "dtype": dt, "impl": impl, "us": ms * 1e3,
                                 "TFLOP/s": tflops, "of peak": round(tflops / PEAK_TFLOPS, 3)})  # fmt: skip
    return rows


def time_mlp(quick: bool) -> list[dict]:
    """The Llama MLP block ``down(silu(gate(x)) * up(x))``, forward and backward, bf16."""
    tokens, hidden, inter = (2048 if quick else 4096), 4096, 11008
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(3)

    def t(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * shape[-1] ** -0.5).to(device=dev, dtype=dtype).requires_grad_()

    ins = {"x": t(tokens, hidden), "wg": t(inter, hidden), "wu": t(inter, hidden), "wd": t(hidden, inter)}
    kernel = rx.compile(rx.linear(rx.swiglu(rx.linear(_x, _wg), rx.linear(_x, _wu)), _wd))

    def eager(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)

    impls = {"rtxdsl": lambda **v: kernel(**v), "eager": eager}
    if not quick:
        impls["torch.compile"] = torch.compile(eager, dynamic=False)
    cot = torch.randn(tokens, hidden, generator=gen).to(device=dev, dtype=dtype)
    rows = []
    for impl, fn in impls.items():
        fwd = gpu_ms(lambda fn=fn: fn(**ins))
        both = gpu_ms(lambda fn=fn: torch.autograd.grad(fn(**ins), list(ins.values()), cot))
        rows.append({"block": "Llama MLP", "shape": f"{tokens}x{hidden}x{inter}", "impl": impl,
                     "forward us": fwd * 1e3, "forward + backward us": both * 1e3})  # fmt: skip
    return rows


# ---- linear cross-entropy: the logits never written ------------------------------------------------
#: (tokens, hidden, vocabulary): the issue's sizes (Llama-2's and Llama-3's vocabularies)
LCE_SIZES = [(8192, 4096, 32000), (8192, 4096, 128256)]


def _lce_inputs(tokens: int, hidden: int, vocab: int, device: torch.device, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(vocab, hidden, generator=gen) * hidden**-0.5).to(device=device, dtype=torch.bfloat16)
    t = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    t[1::7] = -100  # some ignored tokens
    return {"h": h, "w": w, "t": t}


def _lce_impls(quick: bool) -> dict[str, Callable[..., Any]]:
    """rtxdsl, eager (``F.linear`` + ``F.cross_entropy``), torch.compile of it, and Liger-Kernel's and
    Apple's Cut Cross-Entropy kernels where they are installed."""
    kernel = rx.compile(rx.linear_cross_entropy(rx.var("h"), rx.var("w"), rx.var("t")))

    def eager(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(h, w).float(), t)

    impls: dict[str, Callable[..., Any]] = {"rtxdsl": lambda **v: kernel(**v), "eager": eager}
    if not quick:
        impls["torch.compile"] = torch.compile(eager, dynamic=False)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        impls["liger (chunked)"] = lambda h, w, t: liger(w, h, t)
    except ImportError:
        print("  linear cross-entropy: liger_kernel not installed, not compared")
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        impls["cut cross-entropy"] = lambda h, w, t: cce(h, w, t)
    except ImportError:
        print("  linear cross-entropy: cut_cross_entropy not installed, not compared")
    return impls


def check_linear_ce(device: torch.device, sizes: list[tuple[int, int, int]]) -> list[dict]:
    """rtxdsl's loss and gradients against float64 torch (bf16 inputs)."""
    kernel = rx.compile(rx.linear_cross_entropy(rx.var("h"), rx.var("w"), rx.var("t")))
    rows = []
    for tokens, hidden, vocab in sizes:
        ins = _lce_inputs(tokens, hidden, vocab, device, 4)
        leaves = {n: ins[n].clone().requires_grad_() for n in ("h", "w")}
        loss = kernel(**ins | leaves)
        grads = torch.autograd.grad(loss, list(leaves.values()))
        wide = {n: ins[n].double().requires_grad_() for n in ("h", "w")}
        want = F.cross_entropy(F.linear(wide["h"], wide["w"]), ins["t"])
        want_grads = torch.autograd.grad(want, list(wide.values()))
        relative = [((g.double() - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()
                    for g, e in zip(grads, want_grads)]  # fmt: skip
        err = max([(loss.double() - want).abs().item(), *relative])
        rows.append({"case": "linear cross-entropy", "shape": f"{tokens}x{hidden}x{vocab}", "dtype": "bfloat16",
                     "max error": err, "ok": err <= 3e-2, "kernels": kernel.launches(**ins)})  # fmt: skip
    return rows


def time_linear_ce(quick: bool) -> list[dict]:
    """Forward + backward time and peak memory beyond the inputs, bf16, each implementation."""
    dev = torch.device("cuda")
    rows = []
    for tokens, hidden, vocab in LCE_SIZES[:1] if quick else LCE_SIZES:
        ins = _lce_inputs(tokens, hidden, vocab, dev, 5)
        leaves = {n: ins[n].requires_grad_() for n in ("h", "w")}
        for impl, fn in _lce_impls(quick).items():

            def step(fn: Callable[..., Any] = fn) -> None:
                torch.autograd.grad(fn(**ins), list(leaves.values()))

            try:
                peak, ms = peak_and_ms(step)
            except Exception as exc:  # noqa: BLE001
                print(f"  linear cross-entropy {tokens}x{hidden}x{vocab} {impl}: {type(exc).__name__}: {exc}")
                continue
            rows.append({"case": "linear cross-entropy", "shape": f"{tokens}x{hidden}x{vocab}", "impl": impl,
                         "forward + backward us": ms * 1e3, "peak extra MB": round(peak / 1e6, 1),
                         "logits MB": round(tokens * vocab * 2 / 1e6, 1)})  # fmt: skip
    return rows
