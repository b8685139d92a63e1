"""Structural report: kernels and bytes per workload, and the host overhead of a cached call.

Runs anywhere: counts come from the plan (nothing is launched), host overhead from
``dry_run`` calls (all host work of a call, outputs allocated, no launch) against the
same computation in eager torch on the same tiny CPU tensors.

    python -m benches.report            # full table (about a minute on 2 cores)
    python -m benches.report --quick    # CI smoke
"""

from __future__ import annotations

import argparse

import torch

import rtxdsl as rx
from benches.common import host_compare, machine, markdown, save
from rtxdsl.workloads import WORKLOADS


def structure(rows: int, hidden: int) -> list[dict]:
    out = []
    for w in WORKLOADS:
        k = rx.compile(w.expr())
        ins = {
            n: torch.empty_like(t)
            for n, t in w.inputs(rows, hidden, w.dtype, torch.device("cpu"), torch.Generator().manual_seed(0)).items()
        }
        s = k.summary(**ins)
        out.append(
            {
                "workload": w.name,
                "shape": f"{rows}x{hidden}",
                "rtxdsl kernels": s.kernels,
                "eager kernels": s.eager_launches,
                "rtxdsl MB": s.bytes_moved / 1e6,
                "eager MB": s.bytes_eager / 1e6,
                "bytes / minimum": round(s.bytes_moved / s.bytes_minimum, 3),
                "eager / minimum": round(s.bytes_eager / s.bytes_minimum, 3),
                "pattern": "+".join(s.patterns),
            }
        )
    return out


def overhead(rows: int, hidden: int, calls: int) -> list[dict]:
    """Host work of a cached call (dry_run) next to the eager 3-op chain relu(a * b + 1) on the
    same tensors, timed in interleaved rounds (this machine's speed drifts; ratios do not)."""
    out = []
    gen = torch.Generator().manual_seed(0)
    dry = rx.FusionConfig(dry_run=True)
    for w in WORKLOADS:
        k = rx.compile(w.expr(), config=dry)
        ins = w.inputs(rows, hidden, w.dtype, torch.device("cpu"), gen)
        pos = tuple(ins[n] for n in k.inputs)
        a, b = pos[0], pos[-1] if pos[-1].shape == pos[0].shape else pos[0]
        t = host_compare(
            {
                "ours": lambda: k(*pos),
                "by_name": lambda: k(**ins),
                "chain": lambda: torch.relu(a * b + 1),
                "eager": lambda: w.eager(**ins),
            },
            calls,
        )
        out.append(
            {
                "workload": w.name,
                "shape": f"{rows}x{hidden}",
                "outputs": len(k.outputs),
                "rtxdsl cached call us (positional)": t["ours"],
                "rtxdsl us (by name)": t["by_name"],
                "eager relu(a*b+1) us": t["chain"],
                "rtxdsl / eager chain": round(t["ours"] / t["chain"], 2),
                "eager workload us (computes)": t["eager"],
                "eager kernels": k.summary(**ins).eager_launches,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one size, few calls (CI smoke)")
    args = ap.parse_args()
    sizes = [(1, 4096)] if args.quick else [(1, 4096), (8192, 4096)]
    table = [r for rows, hidden in sizes for r in structure(rows, hidden)]
    print(f"## Kernels and bytes per call ({machine()}; python -m benches.report)\n")
    print(
        markdown(
            table,
            [
                "workload",
                "shape",
                "rtxdsl kernels",
                "eager kernels",
                "rtxdsl MB",
                "eager MB",
                "bytes / minimum",
                "eager / minimum",
                "pattern",
            ],
        )
    )
    host = overhead(1, 1, 100 if args.quick else 1000)
    print(f"\n## Host overhead of a cached call, dry_run, 1-element tensors ({machine()})\n")
    print(
        markdown(
            host,
            [
                "workload",
                "outputs",
                "rtxdsl cached call us (positional)",
                "rtxdsl us (by name)",
                "eager relu(a*b+1) us",
                "rtxdsl / eager chain",
                "eager workload us (computes)",
                "eager kernels",
            ],
        )
    )
    if not args.quick:
        print(f"\nwrote {save('structural-cpu', {'structure': table, 'host_overhead': host})}")


if __name__ == "__main__":
    main()
