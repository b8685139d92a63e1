"""Helpers shared by the benchmarks and reports: devices, sizes, host timing, tables."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"

# (rows, hidden): decode-time rows first, then a prefill-sized batch
CPU_SIZES = [(1, 768), (16, 768), (64, 4096)]
GPU_SIZES = [(1, 4096), (64, 4096), (4096, 4096), (32768, 4096)]


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def host_us(fn: Callable[[], Any], calls: int = 2000, repeats: int = 7, sync: bool = False) -> float:
    """Best of ``repeats`` of the mean host time per call, in microseconds.

    The minimum, not the median: on a shared 2-core machine other work only ever adds time,
    and the question is what the call itself costs.
    """
    for _ in range(min(calls, 500)):  # warm caches and the allocator out of the numbers
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if sync:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return min(samples)


def host_compare(fns: dict[str, Callable[[], Any]], calls: int = 2000, rounds: int = 15) -> dict[str, float]:
    """Best-round mean microseconds per call of each function, timed in interleaved rounds.

    This machine's speed drifts by up to 2x within a run; timing every contender in every round
    (the minimum over rounds for each) gives each the same phases, so their ratio is stable.
    """
    for fn in fns.values():  # warm caches and the allocator out of the numbers
        for _ in range(min(calls, 300)):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / calls * 1e6)
    return best


def markdown(rows: list[dict[str, Any]], columns: list[str]) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(out)


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def save(name: str, payload: dict[str, Any], also: str | None = None) -> Path:
    """Write ``payload`` as JSON under benches/results (and into ``also`` when given)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{date.today().isoformat()}.json"
    text = json.dumps(
        {"date": date.today().isoformat(), "machine": machine(), "torch": torch.__version__, **payload},
        indent=1,
        default=str,
    )
    path.write_text(text)
    if also:
        Path(also).mkdir(parents=True, exist_ok=True)
        (Path(also) / path.name).write_text(text)
    return path


def gpu_ms(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` on the GPU (Triton's ``do_bench``)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def peak_and_ms(step: Callable[[], Any], warmup: int = 25, rep: int = 100) -> tuple[int, float]:
    """The peak bytes ``step`` allocates beyond what is allocated before it (its second run, after
    one to warm caches and compiles), and its median milliseconds."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, gpu_ms(step, warmup, rep)
