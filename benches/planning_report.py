"""Planning report: how long lowering takes (bind, expand, analyze, schedule) as expressions grow.

An expression of N nodes mixes elementwise chains, broadcasts, shared subexpressions and row
reductions; a lazy segment of N recorded ops is flushed for the first time (its plan is new).
Near-linear planning means the per-node time stays flat as N grows.

    python -m benches.planning_report            # 125 .. 1000 nodes
    python -m benches.planning_report --quick    # CI smoke
"""

from __future__ import annotations

import argparse
import time

import torch

import rtxdsl as rx
from benches.common import machine, markdown, save
from benches.new_size import KERNELS, first_call_ms
from rtxdsl.expr import walk
from rtxdsl.lower import GPU, Layout, lower, plans


def expression(n: int) -> tuple[rx.Expr, dict[str, torch.Tensor]]:
    """About ``n`` primitive nodes: chains over two inputs, a row reduction every 40 ops."""
    x, b = rx.var("x"), rx.var("b")
    e, shared = x, x * b
    ops = 0
    while ops < n:
        k = ops % 40
        if k == 39:
            e = e - rx.mean(e, -1, keepdim=True)  # sum, rcount, div, sub
            ops += 3
        elif k % 7 == 0:
            e = rx.tanh(e + shared) * 0.5
            ops += 3
        else:
            e = rx.where(e > b, e * 1.01, e - b)
            ops += 4
    return e, {"x": torch.empty(64, 512), "b": torch.empty(512)}


def plan_ms(e: rx.Expr, ins: dict[str, torch.Tensor], repeats: int = 3) -> float:
    """Lowering from scratch: no plan of this structure cached."""
    k = rx.compile(e)
    metas = tuple(Layout(tuple(t.shape), tuple(t.stride()), t.dtype) for t in (ins[n] for n in k.inputs))
    best = float("inf")
    for _ in range(repeats):
        plans.clear()
        start = time.perf_counter()
        lower(k.expressions, k.variables, metas, k.config, GPU)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def lazy_ms(n: int, repeats: int = 3) -> float:
    """First flush of an ``n``-op segment: canonical form, plan, program (dry_run: nothing runs)."""
    best = float("inf")
    t, w = torch.randn(64, 512), torch.randn(512)
    for r in range(repeats):
        f = rx.Fusion(rx.FusionConfig(dry_run=True, max_queued_ops=n + 1))
        y = f.lazy(t)
        i = 0
        while f.pending < n:  # n recorded ops; new constants each repeat: a structure never planned
            y = torch.relu(y * (1.5 + i + r * n)) if i % 3 else y + w
            i += 1
        start = time.perf_counter()
        y.torch()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    sizes = [125, 250] if args.quick else [125, 250, 500, 1000]
    rows = []
    for n in sizes:
        e, ins = expression(n)
        nodes = len(walk([e]))
        ms = plan_ms(e, ins)
        rows.append({"what": "expression", "nodes": nodes, "plan ms": ms, "us per node": 1e3 * ms / nodes})
    for n in [25, 50] if args.quick else [25, 50, 100, 200]:
        ms = lazy_ms(n)
        rows.append({"what": "lazy segment (first flush)", "nodes": n, "plan ms": ms, "us per node": 1e3 * ms / n})
    print(f"## Planning time ({machine()}; python -m benches.planning_report)\n")
    print(markdown(rows, ["what", "nodes", "plan ms", "us per node"]))
    cols = ["kernel", "analysis run, host ms", "plan reused, host ms"]
    again = [dict(zip(cols, (n, first_call_ms(n, before=plans.clear), first_call_ms(n)))) for n in KERNELS]
    print("\n## A known kernel's first call at a new batch size (dry run)\n")
    print(markdown(again, cols))
    if not args.quick:
        print(f"\nwrote {save('planning-cpu', {'planning': rows, 'new_size': again})}")


if __name__ == "__main__":
    main()
