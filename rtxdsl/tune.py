"""Autotuning (``FusionConfig(autotune=True)``): time a kernel's launch options once, keep the fastest.

On its first launch a kernel is launched with each candidate of its family's table
(:data:`rtxdsl.lower.schedule.TUNABLE`: warps, pipeline stages, a pointwise block — never
anything that changes the generated source) and timed; the winner is written under
``<cache_dir>/tuned/`` keyed by the kernel's signature, the device's name and Triton's version
(atomically: a temporary file renamed into place), so the next process starts tuned and never
times again. Timing uses CUDA events on a GPU and the host clock otherwise; tests inject a
timer with :func:`set_timer`.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton

from .fileio import atomic_write
from .log import log

#: ``timer(launch) -> milliseconds`` for one candidate
Timer = Callable[[Callable[[], None]], float]


def _host_timer(launch: Callable[[], None]) -> float:
    launch()  # warm-up: compiles this variant
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        launch()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _cuda_timer(launch: Callable[[], None]) -> float:
    launch()  # warm-up: compiles this variant
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


_timer: list[Timer | None] = [None]
_lock = threading.Lock()


def set_timer(timer: Timer | None) -> None:
    """Time candidates with ``timer`` (None: CUDA events on a GPU, the host clock otherwise)."""
    _timer[0] = timer


def tuned_path(cache_dir: Path, signature: str, device: str) -> Path:
    key = f"{signature}|{device}|triton-{triton.__version__}"
    return cache_dir / "tuned" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("meta"), dict) else None


def _write(path: Path, payload: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(payload))
    except OSError as exc:
        log.warning("could not store the tuned launch options at %s: %s", path, exc)


class Tuned:
    """One kernel's launcher that tunes on its first call, then launches with the winner.

    ``candidates`` are (meta, grid) pairs, the heuristic's first; ``launch_for(grid)`` launches.
    """

    __slots__ = ("launch_for", "candidates", "path", "device", "launcher", "meta")

    def __init__(
        self,
        launch_for: Callable[[tuple[int, ...]], Any],
        candidates: list[tuple[dict[str, int], tuple[int, ...]]],
        path: Path,
        device: str,
    ) -> None:
        self.launch_for = launch_for
        self.candidates = candidates
        self.path = path
        self.device = device
        self.launcher: Any = None
        self.meta: dict[str, int] = {}
        stored = _read(path)
        if stored is not None:
            pick = next((c for c in candidates if c[0] == stored["meta"]), None)
            if pick is not None:
                self._use(*pick)

    def _use(self, meta: dict[str, int], grid: tuple[int, ...]) -> None:
        self.meta, self.launcher = meta, self.launch_for(grid)

    def __call__(self, *args: Any, **_heuristic: Any) -> Any:
        if self.launcher is None:
            with _lock:
                if self.launcher is None:
                    self._tune(args)
        return self.launcher(*args, **self.meta)

    def _tune(self, args: tuple[Any, ...]) -> None:
        timer = _timer[0] or (_cuda_timer if self.device.startswith("cuda") else _host_timer)
        timings = []
        for meta, grid in self.candidates:
            launcher = self.launch_for(grid)
            timings.append((timer(lambda m=meta, lz=launcher: lz(*args, **m)), len(timings)))
        best = min(timings)[1]  # ties: the earlier candidate (the heuristic's is first)
        meta, grid = self.candidates[best]
        self._use(meta, grid)
        _write(self.path, {"meta": meta, "ms": [t for t, _ in timings], "device": self.device})
