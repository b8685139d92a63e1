"""Lazy stream report: capture cost per recorded op, flush cost, and a transformer block's
launches and bytes against eager torch.

    python -m benches.lazy_report           # full
    python -m benches.lazy_report --quick   # CI smoke
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import rtxdsl as rx
from benches.common import host_compare, machine, markdown, save


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
    """Capture per recorded op and a cached flush, against one eager op on the same 1-element
    tensor, timed in interleaved rounds (ratios are what this drifting machine can state)."""
    dry = rx.Fusion(rx.FusionConfig(dry_run=True))
    t = torch.randn(1)
    la = dry.lazy(t)
    stream = dry.stream(t.device)

    def capture() -> None:  # 12 recorded ops (4 x mul, add, relu), then dropped unflushed
        y = la
        for _ in range(4):
            y = torch.relu(y * 2.0 + 1.0)
        stream._reset()

    def flush() -> None:  # the same 12 ops, recorded and flushed through a cached plan
        y = la
        for _ in range(4):
            y = torch.relu(y * 2.0 + 1.0)
        y.torch()

    def eager() -> None:
        y = t
        for _ in range(4):
            y = torch.relu(y * 2.0 + 1.0)

    r = host_compare({"capture": capture, "flush": flush, "eager": eager, "op": lambda: t * 2.0}, calls)
    per_op = r["capture"] / 12
    return [
        {"what": "capture, per recorded op", "us": per_op, "x eager op": per_op / r["op"]},
        {"what": "flush of a cached 12-op segment (host work, dry_run)", "us": r["flush"] - r["capture"]},
        {"what": "eager torch, one op (t * 2.0) on a 1-element CPU tensor", "us": r["op"], "x eager op": 1.0},
        {
            "what": "eager torch, the same 12 ops, per op",
            "us": r["eager"] / 12,
            "x eager op": r["eager"] / 12 / r["op"],
        },
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
    over = overheads(100 if args.quick else 1000)
    print("\n## Capture and flush overhead (host)\n")
    print(markdown(over, ["what", "us", "x eager op"]))
    if not args.quick:
        print(f"\nwrote {save('lazy-cpu', {'block': blocks, 'overhead': over})}")


if __name__ == "__main__":
    main()
