"""Lazy stream report: capture cost per recorded op, flush cost, and a transformer block's
launches and bytes against eager torch.

    python -m benches.lazy_report           # full
    python -m benches.lazy_report --quick   # CI smoke
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import rtxdsl as rx
from benches.common import host_us, machine, markdown, save


class Block(torch.nn.Module):
    """layer_norm -> linear -> gelu -> linear -> residual add -> softmax (the issue's sequence)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d, bias=False)
        self.bias = torch.nn.Parameter(torch.randn(4 * d))
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(self.ln(x)) + self.bias)
        return torch.softmax(self.down(h) + x, dim=-1)


def block_counts(rows: int, d: int) -> dict:
    torch.manual_seed(0)
    block = Block(d)
    x = torch.randn(rows, d)
    f = rx.Fusion()
    with torch.no_grad():
        want = block(x)
        got = block(f.lazy(x)).torch()
    s = f.stats()
    eager_launches = s.kernels_launched + s.kernel_launches_saved
    return {
        "sequence": "ln -> linear -> +bias, gelu -> linear -> +residual, softmax",
        "shape": f"{rows}x{d}",
        "rtxdsl launches": s.kernels_launched,
        "eager launches": eager_launches,
        "fewer launches %": round(100 * (1 - s.kernels_launched / eager_launches), 1),
        "rtxdsl MB": s.bytes_moved / 1e6,
        "eager MB": s.bytes_eager / 1e6,
        "max error": (got - want).abs().max().item(),
    }


def overheads(calls: int) -> list[dict]:
    dry = rx.Fusion(rx.FusionConfig(dry_run=True))
    t = torch.randn(1, 768)
    la = dry.lazy(t)

    def capture() -> None:  # 8 recorded ops, then drop them unflushed
        y = la
        for _ in range(4):
            y = torch.relu(y * 2.0 + 1.0)
        dry.stream(t.device)._reset()

    def flush_us(calls: int) -> float:  # the flush alone, of the same 12 ops through a cached plan
        best = float("inf")
        for _ in range(5):
            total = 0.0
            for _ in range(calls):
                y = la
                for _ in range(4):
                    y = torch.relu(y * 2.0 + 1.0)
                start = time.perf_counter()
                y.torch()
                total += time.perf_counter() - start
            best = min(best, total / calls * 1e6)
        return best

    def eager() -> None:
        y = t
        for _ in range(4):
            y = torch.relu(y * 2.0 + 1.0)

    cap, eag = host_us(capture, calls), host_us(eager, calls)
    flush = flush_us(max(50, calls // 10))
    # relu(x * 2 + 1) is 3 recorded ops (mul, add, relu): 12 per call
    return [
        {"what": "capture, per recorded op", "us": cap / 12},
        {"what": "flush of a cached 12-op segment (host work, dry_run)", "us": flush},
        {"what": "eager torch, same 12 ops on a 1x768 CPU tensor, per op", "us": eag / 12},
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    shapes = [(8, 64)] if args.quick else [(8, 256), (64, 768)]
    blocks = [block_counts(r, d) for r, d in shapes]
    print(f"## Transformer block on lazy tensors ({machine()}; python -m benches.lazy_report)\n")
    print(
        markdown(
            blocks,
            [
                "sequence",
                "shape",
                "rtxdsl launches",
                "eager launches",
                "fewer launches %",
                "rtxdsl MB",
                "eager MB",
                "max error",
            ],
        )
    )
    over = overheads(200 if args.quick else 3000)
    print("\n## Capture and flush overhead (host)\n")
    print(markdown(over, ["what", "us"]))
    if not args.quick:
        print(f"\nwrote {save('lazy-cpu', {'block': blocks, 'overhead': over})}")


if __name__ == "__main__":
    main()
