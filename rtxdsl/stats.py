"""FusionStats: what ran, what eager torch would have run, the bytes each moved and the FLOPs."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class FusionStatsSnapshot:
    """Counters at one moment; ``bytes_*`` follow the traffic model (every pass over an input, each
    output written once), ``flops`` the compute model (tensor-core FLOPs of the products the
    launched kernels computed, recomputed ones included: ``rtxdsl.lower.flops``)."""

    kernels_launched: int = 0
    fused_executions: int = 0  # launches of kernels that fuse two or more ops
    kernel_launches_saved: int = 0  # eager launches minus launches that ran
    bytes_moved: int = 0
    bytes_eager: int = 0
    calls: int = 0
    flops: int = 0

    @property
    def bytes_saved(self) -> int:
        return self.bytes_eager - self.bytes_moved


class FusionStats:
    """Mutable counters, exact under threads; :meth:`snapshot` freezes them.

    Every launch in the process is counted once in the process-wide counters
    (``rx.fusion_stats()``): counters made with ``FusionStats()`` (a private ``rx.Fusion``'s own,
    ``f.stats()``) also add what they record there.

    Example:
        >>> import torch, rtxdsl as rx
        >>> rx.reset_fusion_stats()
        >>> f = rx.Fusion()
        >>> _ = (f.lazy(torch.ones(3)) * 2 + 1).torch()
        >>> f.stats().kernels_launched, rx.fusion_stats().kernels_launched
        (1, 1)
    """

    __slots__ = (
        "kernels_launched",
        "fused_executions",
        "kernel_launches_saved",
        "bytes_moved",
        "bytes_eager",
        "calls",
        "flops",
        "_lock",
        "_process_wide",
    )

    def __init__(self, *, process_wide: bool = False) -> None:
        self._lock = threading.Lock()
        self._process_wide = process_wide
        self.reset()

    def reset(self) -> None:
        """Zero these counters (the process-wide ones stay as they are)."""
        with self._lock:
            self.kernels_launched = self.fused_executions = self.kernel_launches_saved = 0
            self.bytes_moved = self.bytes_eager = self.calls = self.flops = 0

    def record(
        self, kernels: int, fused: int, eager_launches: int, bytes_moved: int, bytes_eager: int, flops: int = 0
    ) -> None:
        with self._lock:
            self.kernels_launched += kernels
            self.fused_executions += fused
            self.kernel_launches_saved += eager_launches - kernels
            self.bytes_moved += bytes_moved
            self.bytes_eager += bytes_eager
            self.calls += 1
            self.flops += flops
        if not self._process_wide:
            GLOBAL_STATS.record(kernels, fused, eager_launches, bytes_moved, bytes_eager, flops)

    def snapshot(self) -> FusionStatsSnapshot:
        with self._lock:
            return FusionStatsSnapshot(
                self.kernels_launched,
                self.fused_executions,
                self.kernel_launches_saved,
                self.bytes_moved,
                self.bytes_eager,
                self.calls,
                self.flops,
            )


GLOBAL_STATS = FusionStats(process_wide=True)


def fusion_stats() -> FusionStatsSnapshot:
    """Counters of every kernel launch in the process: compiled kernels, the default lazy stream
    and every private ``rx.Fusion`` (whose own launches ``f.stats()`` counts apart).

    Example:
        >>> import rtxdsl as rx
        >>> rx.reset_fusion_stats(); rx.fusion_stats().kernels_launched
        0
    """
    return GLOBAL_STATS.snapshot()


def reset_fusion_stats() -> None:
    """Zero the process-wide counters (a Fusion's own, ``f.stats()``, stay as they are)."""
    GLOBAL_STATS.reset()
