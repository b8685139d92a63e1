"""A known kernel's first call at a new batch size: host time (dry run, nothing launches).

It uses the public API only, so the same file measures any commit (copy it into an older
checkout to compare): ``python -m benches.new_size [--repeats N]``. The planning report
(``python -m benches.planning_report``) prints the same calls with the plan cache forgotten
before the timed call and not.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import rtxdsl as rx

KERNELS = ("softmax", "layer_norm + gelu", "linear cross-entropy")


def _kernel(name: str) -> tuple[rx.Expr, Callable[[int], dict[str, torch.Tensor]]]:
    """The expression and its inputs at ``rows`` rows (512 columns; 1000 classes of 64)."""
    x, w, t = rx.var("x"), rx.var("w"), rx.var("t")
    if name == "softmax":
        return rx.softmax(x), lambda r: {"x": torch.empty(r, 512)}
    if name == "layer_norm + gelu":
        return rx.gelu(rx.layer_norm(x, w)), lambda r: {"x": torch.empty(r, 512), "w": torch.empty(512)}
    return rx.linear_cross_entropy(x, w, t), lambda r: {
        "x": torch.empty(r, 64),
        "w": torch.empty(1000, 64),
        "t": torch.zeros(r, dtype=torch.long),
    }


def first_call_ms(name: str, repeats: int = 5, before: Callable[[], None] = lambda: None) -> float:
    """Best of ``repeats``: a fresh kernel called at 64 rows, then (after ``before()``) timed at a
    batch size it has not seen."""
    e, make = _kernel(name)
    best = float("inf")
    for r in range(repeats):
        k = rx.compile(e, rx.FusionConfig(dry_run=True))
        k(**make(64))
        before()
        start = time.perf_counter()
        k(**make(96 + r))
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    for name in KERNELS:
        print(f"{name}: {first_call_ms(name, args.repeats):.2f} ms")


if __name__ == "__main__":
    main()
