"""FusionStats: what ran, what eager torch would have run, and the bytes each moved."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class FusionStatsSnapshot:
    """Counters at one moment; ``bytes_*`` follow the traffic model (every pass over an input, each
    output written once)."""

    kernels_launched: int = 0
    fused_executions: int = 0  # launches of kernels that fuse two or more ops
    kernel_launches_saved: int = 0  # eager launches minus launches that ran
    bytes_moved: int = 0
    bytes_eager: int = 0
    calls: int = 0

    @property
    def bytes_saved(self) -> int:
        return self.bytes_eager - self.bytes_moved


class FusionStats:
    """Mutable counters, exact under threads; :meth:`snapshot` freezes them."""

    __slots__ = (
        "kernels_launched",
        "fused_executions",
        "kernel_launches_saved",
        "bytes_moved",
        "bytes_eager",
        "calls",
        "_lock",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.kernels_launched = self.fused_executions = self.kernel_launches_saved = 0
            self.bytes_moved = self.bytes_eager = self.calls = 0

    def record(self, kernels: int, fused: int, eager_launches: int, bytes_moved: int, bytes_eager: int) -> None:
        with self._lock:
            self.kernels_launched += kernels
            self.fused_executions += fused
            self.kernel_launches_saved += eager_launches - kernels
            self.bytes_moved += bytes_moved
            self.bytes_eager += bytes_eager
            self.calls += 1

    def snapshot(self) -> FusionStatsSnapshot:
        with self._lock:
            return FusionStatsSnapshot(
                self.kernels_launched,
                self.fused_executions,
                self.kernel_launches_saved,
                self.bytes_moved,
                self.bytes_eager,
                self.calls,
            )


GLOBAL_STATS = FusionStats()


def fusion_stats() -> FusionStatsSnapshot:
    """Counters of the process-wide default stream and of every compiled kernel call.

    Example:
        >>> import rtxdsl as rx
        >>> rx.reset_fusion_stats(); rx.fusion_stats().kernels_launched
        0
    """
    return GLOBAL_STATS.snapshot()


def reset_fusion_stats() -> None:
    GLOBAL_STATS.reset()
