"""GPU report: correctness first, then speed against eager torch, torch.compile and Liger-Kernel.

One command for a CUDA machine (see ../shared/gpu/README.md for the wheels to bring):

    python -m benches.gpu_report            # < 8 minutes on an H200; writes benches/results/gpu-*.json
    python -m benches.gpu_report --quick    # two sizes, no torch.compile

Method: every workload is first checked against eager torch; then each implementation is
timed with ``triton.testing.do_bench`` (CUDA events, medians) over input sets rotated so
they do not sit in L2, never on zeros. Achieved GB/s counts the minimum bytes (inputs read
once, outputs written once) and is shown as a fraction of a measured device-to-device copy.
The whole-call overhead of a cached call is timed on a tiny tensor with the host clock.
Without CUDA only the correctness checks run (kernels under Triton's interpreter).
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from typing import Any

import torch

import rtxdsl as rx
from benches import attention_gpu, gemm_gpu, loss_gpu, moe_gpu, norm_gpu
from benches.common import GPU_SIZES, host_us, machine, markdown, save
from rtxdsl.workloads import WORKLOADS, Workload, max_error, tolerance

L2_BYTES = 50 * 2**20
BUDGET_S = 330  # leave room under the 6-minute target
GEMM_BUDGET_S = 90  # the contraction section, after the memory-bound workloads


def check(dev: torch.device, sizes: list[tuple[int, int]]) -> list[dict]:
    rows = []
    for w in WORKLOADS:
        for r, h in sizes:
            ins = w.inputs(r, h, w.dtype, dev, torch.Generator().manual_seed(1))
            k = rx.compile(w.expr())
            try:
                err = max_error(k(**ins), w.eager(**ins))
                ok = err <= tolerance(w.dtype)
            except Exception as exc:  # a failure is a result to report, not a crash
                err, ok = float("nan"), False
                print(f"  {w.name} {r}x{h}: {type(exc).__name__}: {exc}")
            rows.append(
                {
                    "workload": w.name,
                    "shape": f"{r}x{h}",
                    "max error": err,
                    "ok": ok,
                    "kernels": k.launches(**ins),
                    "eager kernels": k.summary(**ins).eager_launches,
                }
            )
    return rows


def copy_bandwidth() -> float:
    from triton.testing import do_bench

    n = 2**28  # 1 GiB of fp32
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def _liger(name: str) -> Any:
    """Liger-Kernel's function for a workload, where importable."""
    try:
        if name == "layer_norm":
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction

            return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5)
        if name == "rms_norm_swiglu":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return lambda g, w, u: LigerSiLUMulFunction.apply(LigerRMSNormFunction.apply(g, w, 1e-6), u)
        if name == "softmax":
            from liger_kernel.ops.softmax import LigerSoftmaxFunction

            return lambda x: LigerSoftmaxFunction.apply(x)
        if name in ("geglu", "cross_entropy", "rope_qk"):
            from liger_kernel.transformers import functional as lf

            if name == "geglu":  # tanh GELU, as the workload
                return lambda g, u: lf.liger_geglu(g, u)
            if name == "cross_entropy":
                return lambda x, t: lf.liger_cross_entropy(x, t, label_smoothing=0.1)

            def rope(q: Any, k: Any, c: Any, s: Any) -> dict:  # Liger wants [batch, heads, seq, dim]
                rq, rk = lf.liger_rope(q[None, None], k[None, None], c[None], s[None])
                return {"q": rq[0, 0], "k": rk[0, 0]}

            return rope
    except ImportError:
        return None
    return None


def _fixed(**shapes: tuple[int, ...]) -> Any:
    """Inputs of fixed shapes (the GPU-shape cases ignore rows and hidden)."""

    def make(rows: int, hidden: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
        return {n: torch.randn(s, generator=gen).to(device=device, dtype=dtype) for n, s in shapes.items()}

    return make


def _transposed(rows: int, hidden: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    return {
        "x": torch.randn(1024, 4096, generator=gen).to(device=device, dtype=dtype).t(),
        "y": torch.randn(4096, 1024, generator=gen).to(device=device, dtype=dtype),
    }


_x, _y, _w, _b = (rx.var(n) for n in ("x", "y", "w", "b"))
#: the shapes a GPU punishes (split rows, column and 2-D tiles): timed once each, at these sizes
GPU_SHAPES = [
    Workload("column_sum 4096x1024", lambda: rx.sum(_x, 0), _fixed(x=(4096, 1024)), lambda x: x.sum(0)),
    Workload("full_sum 4M", lambda: rx.sum(_x), _fixed(x=(4 << 20,)), lambda x: x.sum()),
    Workload("mean 64x65536", lambda: rx.mean(_x, 1), _fixed(x=(64, 65536)), lambda x: x.mean(1)),
    Workload("softmax 8x131072", lambda: rx.softmax(_x), _fixed(x=(8, 131072)), lambda x: x.softmax(-1)),
    Workload(
        "layer_norm 8x131072",
        lambda: rx.layer_norm(_x, _w, _b),
        _fixed(x=(8, 131072), w=(131072,), b=(131072,)),
        lambda x, w, b: torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b),
    ),
    Workload("transposed_add 4096x1024", lambda: _x + _y, _transposed, lambda x, y: x + y),
]


def time_workload(w: Workload, rows: int, hidden: int, impls: dict[str, Any], copy_gbs: float) -> list[dict]:
    from triton.testing import do_bench

    gen = torch.Generator().manual_seed(2)
    first = w.inputs(rows, hidden, w.dtype, torch.device("cuda"), gen)
    k = rx.compile(w.expr())
    s = k.summary(**first)
    sets = [first] + [
        w.inputs(rows, hidden, w.dtype, torch.device("cuda"), gen)
        for _ in range(min(15, max(0, math.ceil(2 * L2_BYTES / s.bytes_minimum) - 1)))
    ]
    out = []
    for impl, fn in impls.items():
        if fn is None:
            continue
        cycle = itertools.cycle(sets)
        try:
            fn(**first)
            ms = do_bench(lambda: fn(**next(cycle)), warmup=25, rep=100, return_mode="median")
        except Exception as exc:
            print(f"  {w.name} {rows}x{hidden} {impl}: {type(exc).__name__}: {exc}")
            continue
        gbs = s.bytes_minimum / (ms * 1e-3) / 1e9
        out.append(
            {
                "workload": w.name,
                "shape": f"{rows}x{hidden}" if rows else "-",
                "dtype": str(w.dtype).removeprefix("torch."),
                "impl": impl,
                "us": ms * 1e3,
                "GB/s": gbs,
                "of copy": round(gbs / copy_gbs, 3),
                "kernels": s.kernels if impl == "rtxdsl" else None,
            }
        )
    return out


def overhead(w: Workload, impls: dict[str, Any]) -> list[dict]:
    ins = w.inputs(1, 64, w.dtype, torch.device("cuda"), torch.Generator().manual_seed(3))
    rows = []
    for impl, fn in impls.items():
        if fn is None:
            continue
        try:
            rows.append(
                {
                    "workload": w.name,
                    "impl": impl,
                    "whole call us": host_us(lambda: fn(**ins), calls=2000, repeats=5, sync=True),
                }
            )
        except Exception as exc:
            print(f"  overhead {w.name} {impl}: {type(exc).__name__}: {exc}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two sizes, no torch.compile")
    ap.add_argument("--out", default=None, help="also write the JSON into this folder (e.g. $OUT)")
    args = ap.parse_args()
    start = time.perf_counter()
    if not torch.cuda.is_available():
        print("no CUDA device: running the correctness checks only (Triton interpreter, small sizes)")
        rows = check(torch.device("cpu"), [(3, 100), (1, 257)])
        print(markdown(rows, ["workload", "shape", "max error", "ok", "kernels", "eager kernels"]))
        gemms = gemm_gpu.check(torch.device("cpu"), [(33, 20, 17), (1, 7, 129)])
        gemms += gemm_gpu.check_linear_ce(torch.device("cpu"), [(37, 33, 31), (1, 8, 1000)])
        gemms += moe_gpu.check(torch.device("cpu"), [(9, 16, 12, 4, 2)])
        gemms += norm_gpu.check(torch.device("cpu"), [(37, 50)])
        gemms += loss_gpu.check(torch.device("cpu"), [(4, 9, 16, 37)])
        gemms += attention_gpu.check(torch.device("cpu"), [(1, 4, 2, 37, 29, 16), (1, 4, 2, 1, 1100, 8)])
        print(markdown(gemms, ["case", "shape", "dtype", "max error", "ok", "kernels"]))
        bad = [r for r in rows + gemms if not r["ok"]]
        raise SystemExit(1 if bad else 0)

    print(f"GPU report on {machine()}, torch {torch.__version__}")
    checks = check(torch.device("cuda"), [(37, 781), (64, 4096)])
    failed = {r["workload"] for r in checks if not r["ok"]}
    print(markdown(checks, ["workload", "shape", "max error", "ok", "kernels", "eager kernels"]))
    copy_gbs = copy_bandwidth()
    print(f"\ndevice-to-device copy: {copy_gbs:.0f} GB/s")
    sizes = [GPU_SIZES[0], GPU_SIZES[-1]] if args.quick else GPU_SIZES
    timings: list[dict] = []
    overheads: list[dict] = []
    name = f"gpu-{torch.cuda.get_device_name().replace(' ', '_')}"

    def payload() -> dict:
        return {
            "copy_GBps": copy_gbs,
            "checks": checks,
            "timings": timings,
            "overhead": overheads,
            "seconds": time.perf_counter() - start,
        }

    for w in WORKLOADS:
        if w.name in failed:
            print(f"  {w.name}: skipped (failed its correctness check)")
            continue
        k = rx.compile(w.expr())
        impls: dict[str, Any] = {"rtxdsl": lambda kk=k, **ins: kk(**ins), "eager": w.eager}
        if not args.quick and time.perf_counter() - start < BUDGET_S / 2:  # its compiles take time too
            impls["torch.compile"] = torch.compile(w.eager, dynamic=True)
        impls["liger"] = _liger(w.name)
        for rows, hidden in sizes:
            if time.perf_counter() - start > BUDGET_S:
                print(f"  {w.name} {rows}x{hidden}: skipped, over the time budget")
                continue
            timings += time_workload(w, rows, hidden, impls, copy_gbs)
        overheads += overhead(w, impls)
        save(name, payload(), args.out)  # partial results survive a timeout
        print(f"  {w.name}: done at {time.perf_counter() - start:.0f} s")
    for w in GPU_SHAPES:  # one size each: the shape is the point
        if time.perf_counter() - start > BUDGET_S:
            print(f"  {w.name}: skipped, over the time budget")
            continue
        k = rx.compile(w.expr())
        impls = {"rtxdsl": lambda kk=k, **ins: kk(**ins), "eager": w.eager}
        if not args.quick:
            impls["torch.compile"] = torch.compile(w.eager, dynamic=False)
        timings += time_workload(w, 0, 0, impls, copy_gbs)
    gemm_checks = gemm_gpu.check(torch.device("cuda"), [(37, 781, 129), (512, 1024, 768)])
    gemm_checks += gemm_gpu.check_linear_ce(torch.device("cuda"), [(257, 1024, 32000)])
    gemm_checks += moe_gpu.check(torch.device("cuda"), [(37, 64, 48, 5, 2), (512, 1024, 768, 16, 4)])
    gemm_checks += norm_gpu.check(torch.device("cuda"), [(37, 781), (4096, 4096)])
    gemm_checks += loss_gpu.check(torch.device("cuda"), [(4, 37, 64, 1000), (8, 512, 1024, 32000)])
    gemm_checks += attention_gpu.check(torch.device("cuda"), [(1, 8, 2, 300, 300, 64), (1, 32, 8, 1, 5000, 128)])
    print(markdown(gemm_checks, ["case", "shape", "dtype", "max error", "ok", "kernels"]))
    if all(r["ok"] for r in gemm_checks):
        gemms = gemm_gpu.time_gemms(time.perf_counter() + GEMM_BUDGET_S, args.quick)
        mlp = gemm_gpu.time_mlp(args.quick)
        lce = gemm_gpu.time_linear_ce(args.quick)
        moe = moe_gpu.time_moe(args.quick)
        norms = norm_gpu.time_norms(args.quick, copy_gbs)
        losses = loss_gpu.time_losses(args.quick)
        attention = attention_gpu.time_prefill(args.quick) + attention_gpu.time_decode(args.quick)
    else:
        gemms, mlp, lce, moe, norms, losses, attention = [], [], [], [], [], [], []
        print("  contractions: not timed (a correctness check failed)")
    print("\n## Kernel time (do_bench median), achieved GB/s and fraction of copy bandwidth\n")
    print(markdown(timings, ["workload", "shape", "dtype", "impl", "us", "GB/s", "of copy", "kernels"]))
    print("\n## Whole-call time of a cached call on a 1x64 tensor (host clock, synchronized)\n")
    print(markdown(overheads, ["workload", "impl", "whole call us"]))
    print(f"\n## Contractions: TFLOP/s and fraction of the {gemm_gpu.PEAK_TFLOPS:.0f} TFLOP/s 16-bit peak\n")
    print(markdown(gemms, ["case", "shape", "dtype", "impl", "us", "TFLOP/s", "of peak"]))
    print("\n## The Llama MLP block, bf16, forward and forward + backward\n")
    print(markdown(mlp, ["block", "shape", "impl", "forward us", "forward + backward us"]))
    print("\n## Linear cross-entropy, bf16, forward + backward: time and peak memory beyond the inputs\n")
    print(markdown(lce, ["case", "shape", "impl", "forward + backward us", "peak extra MB", "logits MB"]))
    print("\n## Mixture-of-experts experts, bf16, forward and forward + backward\n")
    print(markdown(moe, ["case", "shape", "impl", "forward us", "forward + backward us"]))
    print("\n## Norm backward (dx, dW, dB), bf16: kernel time and achieved GB/s (x and dy read, dx written)\n")
    print(markdown(norms, ["case", "shape", "impl", "us", "GB/s", "of copy"]))
    print("\n## Post-training losses over a head, bf16, forward + backward: rtxdsl vs Liger's chunks\n")
    print(markdown(losses, ["case", "shape", "impl", "forward + backward us", "peak extra MB", "logits MB"]))
    print("\n## Attention, bf16: prefill TFLOP/s (FlashAttention-2's count) and a decoding step's time\n")
    print(markdown(attention, ["case", "shape", "impl", "pass", "us", "TFLOP/s"]))
    results = {"gemm_checks": gemm_checks, "gemms": gemms, "mlp": mlp, "lce": lce, "moe": moe, "norms": norms}
    results["losses"], results["attention"] = losses, attention
    path = save(name, {**payload(), **results}, args.out)
    print(f"\nwrote {path} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
