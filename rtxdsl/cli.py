"""The ``rtxdsl`` command: a demo of real fused workloads, checked against torch.

``python -m rtxdsl`` (or ``rtxdsl demo``) compiles bias+GELU, a residual chain, softmax,
layer norm, RMSNorm+SwiGLU and an AdamW update (three outputs, one kernel), prints the
fusion plan and the generated Triton source of one kernel, runs them (CUDA: compiled;
CPU: the same kernels under Triton's interpreter), checks them against torch and prints
the fusion and cache statistics.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import rtxdsl as rx


def _adamw(lr: float, b1: float, b2: float, eps: float, wd: float, step: int) -> dict[str, rx.Expr]:
    p, g, m, v = rx.var("p"), rx.var("g"), rx.var("m"), rx.var("v")
    m2 = b1 * m + (1 - b1) * g
    v2 = b2 * v + (1 - b2) * g * g
    update = (m2 / (1 - b1**step)) / (rx.sqrt(v2 / (1 - b2**step)) + eps)
    return {"p": p - lr * (update + wd * p), "m": m2, "v": v2}


def _adamw_ref(p, g, m, v, lr, b1, b2, eps, wd, step):
    m2 = b1 * m + (1 - b1) * g
    v2 = b2 * v + (1 - b2) * g * g
    update = (m2 / (1 - b1**step)) / ((v2 / (1 - b2**step)).sqrt() + eps)
    return {"p": p - lr * (update + wd * p), "m": m2, "v": v2}


def workloads(device: torch.device, rows: int = 37, hidden: int = 781) -> list[tuple[str, Any, dict, Callable]]:
    """(name, expression, inputs, torch reference) for the demo and the reports."""
    gen = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    x, b, r, w, g, u = (rx.var(n) for n in ("x", "b", "r", "w", "g", "u"))
    hp = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.01, step=10)
    ins = {n: t(rows, hidden) for n in ("x", "r", "g", "u")}
    ins.update(b=t(hidden), w=t(hidden))
    adam_in = {"p": t(rows, hidden), "g": t(rows, hidden), "m": t(rows, hidden), "v": t(rows, hidden).abs()}
    return [
        ("bias_gelu", rx.gelu(x + b), {"x": ins["x"], "b": ins["b"]}, lambda x, b: F.gelu(x + b)),
        (
            "residual_chain",
            rx.relu(x * w + b) + r,
            {k: ins[k] for k in ("x", "w", "b", "r")},
            lambda x, w, b, r: torch.relu(x * w + b) + r,
        ),
        ("softmax", rx.softmax(x * 0.125), {"x": ins["x"]}, lambda x: torch.softmax(x * 0.125, -1)),
        (
            "layer_norm",
            rx.layer_norm(x, w, b),
            {k: ins[k] for k in ("x", "w", "b")},
            lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b),
        ),
        (
            "rms_norm_swiglu",
            rx.swiglu(rx.rms_norm(g, w), u),
            {k: ins[k] for k in ("g", "w", "u")},
            lambda g, w, u: F.silu(F.rms_norm(g, g.shape[-1:], w, 1e-6)) * u,
        ),
        ("adamw_step", _adamw(**hp), adam_in, lambda p, g, m, v: _adamw_ref(p, g, m, v, **hp)),
    ]


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def demo(show_source: str = "layer_norm") -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mode = "compiled Triton" if device.type == "cuda" else "Triton interpreter (no GPU found)"
    print(f"rtxdsl {rx.__version__}: torch {torch.__version__}, device {device}, running kernels with {mode}\n")
    rx.reset_fusion_stats()
    failures = 0
    for name, expr, inputs, ref in workloads(device):
        kernel = rx.compile(expr)
        start = time.perf_counter()
        out = kernel(**inputs)
        first = time.perf_counter() - start
        want = ref(**inputs)
        outs = out if isinstance(out, dict) else {"out": out}
        wants = want if isinstance(want, dict) else {"out": want}
        err = max(_close(outs[k], wants[k]) for k in outs)
        ok = err <= 1e-4
        failures += not ok
        print(
            f"== {name}: {kernel.launches(**inputs)} kernel(s), max |error| vs torch {err:.2e} "
            f"{'OK' if ok else 'MISMATCH'} (first call {first * 1e3:.0f} ms)"
        )
        print("   " + kernel.explain(**inputs).replace("\n", "\n   "))
        if name == show_source:
            print(f"\n-- generated Triton source for {name} --\n{kernel.sources(**inputs)[0]}")
    s, c = rx.fusion_stats(), rx.cache_stats()
    print(
        f"fusion stats: {s.kernels_launched} kernels launched, {s.fused_executions} fused, "
        f"{s.kernel_launches_saved} launches saved, {s.bytes_moved} bytes moved vs {s.bytes_eager} eager "
        f"({100 * (1 - s.bytes_moved / max(s.bytes_eager, 1)):.0f}% less)"
    )
    print(
        f"kernel cache: {c.entries} entries, {c.compiles} generated, {c.disk_hits} from disk, "
        f"{c.hits} hits, {c.misses} misses; sources in {rx.get_config().resolved_cache_dir}"
    )
    print("all results match torch" if not failures else f"{failures} workload(s) did not match torch")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rtxdsl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd")
    d = sub.add_parser("demo", help="compile, run and check the demo workloads (default)")
    d.add_argument("--source", default="layer_norm", help="workload whose generated source to print")
    args = parser.parse_args(argv)
    return demo(getattr(args, "source", "layer_norm"))


if __name__ == "__main__":
    sys.exit(main())
