"""Memory-trace report: GPU-shaped launches of the catalog and of the GPU-shape cases, traced on CPU.

Every kernel is lowered with the sm_90 launch configurations (132 SMs), run under Triton's
interpreter with loads and stores instrumented (``rx.memory_trace``), and reported as: programs
of the widest launch, the most-read input's re-read factor, bytes-weighted 32-byte sector use,
and the traffic model's bytes against the traced bytes.

    python -m benches.trace_report           # the GPU-shape cases at the issue's sizes, workloads 256x4096
    python -m benches.trace_report --quick   # 1/16 of the sizes (CI smoke)

Tracing runs every GPU program in numpy (a few seconds per million elements), hence the
workloads' 256 rows: their kernels are row- or block-local, so more rows add programs, not facts.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

import rtxdsl as rx
from benches.common import markdown, save
from rtxdsl.workloads import WORKLOADS

x, y, w, b = (rx.var(n) for n in ("x", "y", "w", "b"))

#: the GPU-shape cases: (name, expression, inputs at scale s)
CASES: list[tuple[str, Callable[[], Any], Callable[[int], dict[str, torch.Tensor]]]] = [
    ("column sum 4096x1024", lambda: rx.sum(x, axis=0), lambda s: {"x": torch.randn(4096 // s, 1024)}),
    ("full sum 4M", lambda: rx.sum(x), lambda s: {"x": torch.randn((4 << 20) // s)}),
    ("mean 64x65536", lambda: rx.mean(x, axis=1), lambda s: {"x": torch.randn(64, 65536 // s)}),
    ("softmax 8x131072", lambda: rx.softmax(x), lambda s: {"x": torch.randn(8, 131072 // s)}),
    (
        "layer_norm 8x131072",
        lambda: rx.layer_norm(x, w, b),
        lambda s: {"x": torch.randn(8, 131072 // s), "w": torch.randn(131072 // s), "b": torch.randn(131072 // s)},
    ),
    (
        "x.t() + y 4096x1024",
        lambda: x + y,
        lambda s: {"x": torch.randn(1024, 4096 // s).t(), "y": torch.randn(4096 // s, 1024)},
    ),
    ("bias grad (sum over rows) 8192x1024", lambda: rx.sum(x, axis=0), lambda s: {"x": torch.randn(8192 // s, 1024)}),
    (
        "gelu(x + b) backward: dx and db 4096x256",
        lambda: _bias_gelu_backward(),
        lambda s: {"x": torch.randn(4096 // s, 256), "b": torch.randn(256), "y": torch.randn(4096 // s, 256)},
    ),
]


def _bias_gelu_backward() -> dict[str, Any]:
    """What ``rx.compile(rx.gelu(x + b))``'s backward kernel computes (``y`` the cotangent): dx
    beside db, its column sum, in one kernel whose split partial pass stores dx."""
    u = x + b
    dx = y * (0.5 * (1.0 + rx.erf(u * 0.7071067811865476)) + u * 0.3989422804014327 * rx.exp(-0.5 * u * u))
    return {"dx": dx, "db": rx.sum(dx, axis=0)}


#: norm backward kernels (dx with the weight and bias gradients over each program's rows, then the
#: merge of their partials): (name, the norm, rows at scale 1, hidden)
BACKWARDS = [
    ("rms_norm backward: dx and dw", lambda: rx.rms_norm(x, w), 2048, 1024),
    ("layer_norm backward: dx, dw and db", lambda: rx.layer_norm(x, w, b), 2048, 1024),
]


def _backward(norm: Callable[[], Any], rows: int, hidden: int) -> tuple[rx.Kernel, dict[str, torch.Tensor]]:
    """A norm's backward kernel and its inputs (the forward's saved statistics, a cotangent)."""
    k = rx.compile(norm())
    ins = {n: torch.randn((rows, hidden) if n == "x" else (hidden,)).requires_grad_() for n in k.inputs}
    plan = k.grad_plan(**ins)
    feed = {n: t.detach() for n, t in ins.items()} | dict(plan.forward(**ins)) | {"_g0": torch.randn(rows, hidden)}
    return plan.backward, {n: feed[n] for n in plan.backward.inputs}


def row(name: str, kernel: rx.Kernel, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    t0 = time.perf_counter()
    t = rx.memory_trace(kernel, **inputs)
    model, traced = t.model_bytes, t.traced_bytes
    return {
        "case": name,
        "kernels": len(t.launches),
        "split": "+".join(sorted({lt.split for lt in t.launches if lt.split})) or "-",
        "programs": t.programs,
        "re-read": t.re_read,
        "sector use": t.sector_use,
        "model / traced": model / traced if traced else 1.0,
        "trace s": time.perf_counter() - t0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1/16 of the sizes")
    parser.add_argument("--cases", action="store_true", help="the GPU-shape cases only, not the workloads")
    args = parser.parse_args()
    scale = 16 if args.quick else 1
    rows = [row(name, rx.compile(expr()), make(scale)) for name, expr, make in CASES]
    for name, norm, n_rows, hidden in BACKWARDS:
        rows.append(row(f"{name} {n_rows // scale}x{hidden}", *_backward(norm, n_rows // scale, hidden)))
    gen = torch.Generator().manual_seed(0)
    for wl in [] if args.cases else WORKLOADS:
        inputs = wl.inputs(256 // scale, 4096, wl.dtype, torch.device("cpu"), gen)  # the interpreter's speed
        rows.append(row(f"workload {wl.name} {256 // scale}x4096", rx.compile(wl.expr()), inputs))
    columns = ["case", "kernels", "split", "programs", "re-read", "sector use", "model / traced", "trace s"]
    print(markdown(rows, columns))
    save("trace-sm90" + ("-quick" if args.quick else ""), {"scale": scale, "rows": rows})


if __name__ == "__main__":
    main()
