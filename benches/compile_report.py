"""Compile report: each workload's kernels compiled for sm_90 (H100/H200) on this machine.

Prints Triton's cold compile time, rtxdsl's own share (bind + analyze + generate + write +
import), facts read from the PTX (128-bit loads/stores, registers, spills) and the warm start
of a known kernel in a fresh process from the disk cache.

    python -m benches.compile_report            # all workloads
    python -m benches.compile_report --quick    # CI smoke: two workloads
"""

from __future__ import annotations

import os

# compiled (not interpreted) Triton: must be decided before triton is imported
os.environ.setdefault("TRITON_INTERPRET", "0")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import argparse  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import rtxdsl as rx  # noqa: E402
from benches.common import machine, markdown, save  # noqa: E402
from rtxdsl.build import compile_kernel, prepare  # noqa: E402
from rtxdsl.cache import GLOBAL_CACHE  # noqa: E402
from rtxdsl.codegen.ptx import compile_call  # noqa: E402
from rtxdsl.workloads import BY_NAME, WORKLOADS  # noqa: E402

ROWS, HIDDEN = 64, 4096


def one(name: str, cache_dir: str) -> list[dict]:
    w = BY_NAME[name]
    cfg = rx.FusionConfig(cache_dir=cache_dir)
    k = rx.compile(w.expr(), config=cfg)
    ins = w.inputs(ROWS, HIDDEN, w.dtype, torch.device("cpu"), torch.Generator().manual_seed(0))
    GLOBAL_CACHE.clear(reset_stats=False)
    start = time.perf_counter()
    program, compiled = prepare(k, ins)  # bind, analyze, generate, write, import
    ours = time.perf_counter() - start
    bufs = [ins[n] for n in k.inputs] + [torch.empty(b.shape, dtype=b.dtype) for b in program.buffers]
    rows = []
    for i, (c, call) in enumerate(zip(compiled, program.kernels)):
        facts = compile_call(c.jit, call, [bufs[j] for j in call.buffers])
        rows.append(
            {
                "workload": name,
                "kernel": facts.name,
                "triton compile ms": facts.seconds * 1e3,
                "rtxdsl ms": ours * 1e3 if i == 0 else 0.0,
                "rtxdsl share %": 100 * ours / facts.seconds if i == 0 else 0.0,
                "128-bit loads": facts.v4_loads,
                "128-bit stores": facts.v4_stores,
                "registers": facts.registers,
                "spill bytes": facts.spill_bytes,
            }
        )
    return rows


def warm_start(cache_dir: str) -> float:
    """ms from compile() to a prepared launch of a known kernel in a new process (disk cache warm)."""
    script = textwrap.dedent(f"""
        import time, torch, rtxdsl as rx
        from rtxdsl.build import prepare
        from rtxdsl.workloads import BY_NAME
        w = BY_NAME["layer_norm"]
        ins = w.inputs(64, 4096, w.dtype, torch.device("cpu"), torch.Generator().manual_seed(0))
        start = time.perf_counter()
        k = rx.compile(w.expr(), config=rx.FusionConfig(cache_dir={cache_dir!r}))
        prepare(k, ins)  # lowered for sm_90, as the parent built it
        took = time.perf_counter() - start
        assert rx.cache_stats().compiles == 0 and rx.cache_stats().disk_hits == 1, rx.cache_stats()
        print(took * 1e3)
    """)
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    return float(out.stdout.split()[-1])


def linear_ce() -> list[dict]:
    """Linear cross-entropy's kernels at 4096 tokens x 32000 vocabulary x 1024 hidden, bf16: the
    forward (the logit tiles in its row loop), the backward's chunk loop (0: a chunk of the logits
    and its dP, 1: dh summing the chunks, 2: the chunk's rows of dw)."""
    bf = {"dtype": torch.bfloat16}
    ins = {"h": torch.empty(4096, 1024, **bf), "w": torch.empty(32000, 1024, **bf),
           "t": torch.zeros(4096, dtype=torch.int64)}  # fmt: skip
    plan = rx.compile(rx.linear_cross_entropy(rx.var("h"), rx.var("w"), rx.var("t"))).grad_plan(**ins)
    rows = []
    for part, kernel, feed in (("forward", plan.forward, ins), ("backward", plan.backward, plan.backward_feed(ins))):
        start = time.perf_counter()
        facts = compile_kernel(kernel, feed)
        seconds = time.perf_counter() - start
        for i, f in enumerate(facts):
            rows.append({"kernel": f"{part} {i}", "compile s (with rtxdsl)": seconds / len(facts),
                         "wgmma": f.ptx.count("wgmma.mma_async"), "registers": f.registers,
                         "spill bytes": f.spill_bytes})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    names = ["mul_add_relu", "layer_norm"] if args.quick else [w.name for w in WORKLOADS]
    with tempfile.TemporaryDirectory() as cache_dir:
        one(names[0], tempfile.mkdtemp())  # load Triton's compiler once, out of the numbers
        table = [r for n in names for r in one(n, cache_dir)]
        warm = warm_start(cache_dir)
    print(f"## Compile for sm_90, {ROWS}x{HIDDEN} inputs ({machine()}; python -m benches.compile_report)\n")
    print(
        markdown(
            table,
            [
                "workload",
                "kernel",
                "triton compile ms",
                "rtxdsl ms",
                "rtxdsl share %",
                "128-bit loads",
                "128-bit stores",
                "registers",
                "spill bytes",
            ],
        )
    )
    total_ours = sum(r["rtxdsl ms"] for r in table)
    total_triton = sum(r["triton compile ms"] for r in table)
    print(
        f"\nrtxdsl's own time over Triton's compile: {100 * total_ours / total_triton:.1f}% "
        f"({total_ours:.0f} ms over {total_triton:.0f} ms)"
    )
    print(f"warm start of a known kernel in a new process (disk cache, host side): {warm:.1f} ms")
    if args.quick:
        return
    lce = linear_ce()
    print("\n## Linear cross-entropy, 4096 tokens x 32000 vocabulary x 1024 hidden, bf16 (sm_90)\n")
    print(markdown(lce, list(lce[0])))
    print(f"wrote {save('compile-sm90', {'kernels': table, 'warm_start_ms': warm, 'linear_cross_entropy': lce})}")


if __name__ == "__main__":
    main()
