"""Process replay: the generated source of every catalog kernel, to see what a change alters.

Writes one file per kernel — every workload, every composite and the backward kernels of
both — for a fixed set of shapes and dtypes, lowered for the GPU target (sm_90 launch
configurations), with signatures normalized (they hash the generator's own code, so they
change with any edit of it). ``tests/test_replay.py`` compares a fresh replay with the
snapshot committed under ``tests/replay/`` and prints a unified diff of what changed.

    python -m benches.replay --out tests/replay      # accept the current kernels as the snapshot
"""

from __future__ import annotations

import argparse
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import rtxdsl as rx
from rtxdsl.build import prepare
from rtxdsl.lower import GPU
from rtxdsl.workloads import WORKLOADS

x, y, w, b = (rx.var(n) for n in "xywb")
#: (rows, hidden): on chip, and a row long enough to loop
SHAPES = [(5, 33), (2, 40000)]
#: composites by name: expression and the inputs' kinds ("rh": rows x hidden, "h": hidden)
COMPOSITES: dict[str, tuple[Callable[[], Any], tuple[str, ...]]] = {
    "softmax": (lambda: rx.softmax(x), ("rh",)),
    "log_softmax": (lambda: rx.log_softmax(x, axis=0), ("rh",)),
    "logsumexp": (lambda: rx.logsumexp(x, -1), ("rh",)),
    "layer_norm": (lambda: rx.layer_norm(x, w, b), ("rh", "h", "h")),
    "rms_norm": (lambda: rx.rms_norm(x, w), ("rh", "h")),
    "swiglu": (lambda: rx.swiglu(x, y), ("rh", "rh")),
    "mean_variance_std": (lambda: {"m": rx.mean(x, 0), "v": rx.variance(x, -1), "s": rx.std(x)}, ("rh",)),
    "amax_amin": (lambda: {"hi": rx.amax(x, -1, keepdim=True), "lo": rx.amin(x, 0)}, ("rh",)),
    "clamp_where": (lambda: rx.where(x > 0, rx.clamp(x, -1.0, 1.0), y), ("rh", "rh")),
}
SIGNATURE = re.compile(r"[0-9a-f]{24}")
NAME_HASH = re.compile(r"_[0-9a-f]{8}(_tail)?\(")  # a kernel's name, and its tail's (``<name>_tail``)


def normalize(source: str) -> str:
    return NAME_HASH.sub(r"_SIG\1(", SIGNATURE.sub("SIGNATURE", source))


def _inputs(kinds: tuple[str, ...], names: tuple[str, ...], rows: int, hidden: int, dtype: torch.dtype) -> dict:
    shape = {"rh": (rows, hidden), "h": (hidden,)}
    return {n: torch.empty(shape[k], dtype=dtype) for n, k in zip(names, kinds)}


def _sources(kernel: rx.Kernel, ins: dict[str, Any]) -> list[str]:
    _, compiled = prepare(kernel, ins, GPU)
    return [normalize(c.source) for c in compiled]


def cases() -> dict[str, tuple[rx.Kernel, dict[str, Any]]]:
    """Every kernel call to replay, by a stable name."""
    out: dict[str, tuple[rx.Kernel, dict[str, Any]]] = {}
    for wl in WORKLOADS:
        k = rx.compile(wl.expr())
        ins = wl.inputs(7, 33, wl.dtype, torch.device("cpu"), torch.Generator().manual_seed(0))
        out[f"workload.{wl.name}"] = (k, ins)
    for name, (expr, kinds) in COMPOSITES.items():
        k = rx.compile(expr())
        for rows, hidden in SHAPES:
            for dtype in (torch.float32, torch.bfloat16):
                out[f"composite.{name}.{rows}x{hidden}.{str(dtype).removeprefix('torch.')}"] = (
                    k,
                    _inputs(kinds, k.inputs, rows, hidden, dtype),
                )
    # a contraction with its epilogue: the GEMM family's forward and backward (dx, and dW summed over batches)
    x, w, b = rx.var("x"), rx.var("w"), rx.var("b")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        ins = {"x": torch.randn(2, 7, 33, generator=gen), "w": torch.randn(17, 33, generator=gen)}
        ins = {**{n: t.to(dtype) for n, t in ins.items()}, "b": torch.randn(17, generator=gen).to(dtype)}
        out[f"contraction.linear_bias_gelu.2x7x33.{str(dtype).removeprefix('torch.')}"] = (
            rx.compile(rx.gelu(rx.linear(x, w, b))),
            ins,
        )
    # linear cross-entropy with a bias: the forward's product rows, the backward's chunk loop (hidden
    # above 128: dP's fp32 chunk, dh summing the chunks, dw's rows with db)
    t = rx.var("t")
    ins = {
        "x": torch.randn(37, 257, generator=gen).to(torch.bfloat16),
        "w": torch.randn(300, 257, generator=gen).to(torch.bfloat16),
        "t": torch.randint(0, 300, (37,), generator=gen),
        "b": torch.randn(300, generator=gen).to(torch.bfloat16),
    }
    out["contraction.linear_cross_entropy.37x300x257.bfloat16"] = (rx.compile(rx.linear_cross_entropy(x, w, t, b)), ins)
    return out


def replay() -> dict[str, str]:
    """File name -> normalized source, forward and backward, for every case."""
    files: dict[str, str] = {}
    for name, (k, ins) in cases().items():
        for i, src in enumerate(_sources(k, ins)):
            files[f"{name}.fwd{i}.py"] = src
        if any(t.dtype.is_floating_point for t in ins.values()):
            plan = k.grad_plan(**ins)
            for i, src in enumerate(_sources(plan.backward, plan.backward_feed(ins))):
                files[f"{name}.bwd{i}.py"] = src
    return files


def write(out: Path) -> int:
    files = replay()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name, src in files.items():
        (out / name).write_text(src)
    return len(files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory to (re)write, e.g. tests/replay")
    args = ap.parse_args()
    print(f"wrote {write(Path(args.out))} kernel sources to {args.out}")


if __name__ == "__main__":
    main()
