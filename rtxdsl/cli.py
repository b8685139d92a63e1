"""The ``rtxdsl`` command: a demo of real fused workloads, and the kernel-file commands.

``python -m rtxdsl`` (or ``rtxdsl demo``) compiles the workloads of ``rtxdsl.workloads``,
prints the fusion plan and the generated Triton source of one kernel, runs them (CUDA:
compiled; CPU: the same kernels under Triton's interpreter), checks them against torch and
prints the fusion and cache statistics. ``rtxdsl check | explain | build | bench FILE`` work
on kernel files (``rtxdsl.commands``); ``rtxdsl explain "text" --input x=float32:4x8`` on one
expression.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import rtxdsl as rx
from rtxdsl import commands
from rtxdsl.workloads import WORKLOADS, max_error, tolerance


def demo(show_source: str = "layer_norm") -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mode = "compiled Triton" if device.type == "cuda" else "Triton interpreter (no GPU found)"
    print(f"rtxdsl {rx.__version__}: torch {torch.__version__}, device {device}, running kernels with {mode}\n")
    rx.reset_fusion_stats()
    failures = 0
    gen = torch.Generator().manual_seed(0)
    for w in WORKLOADS:
        kernel = rx.compile(w.expr())
        inputs = w.inputs(37, 781, w.dtype, device, gen)
        start = time.perf_counter()
        out = kernel(**inputs)
        first = time.perf_counter() - start
        err = max_error(out, w.eager(**inputs))
        ok = err <= tolerance(w.dtype)
        failures += not ok
        print(
            f"== {w.name} ({str(w.dtype).removeprefix('torch.')}): {kernel.launches(**inputs)} kernel(s), "
            f"max |error| vs torch {err:.2e} {'OK' if ok else 'MISMATCH'} (first call {first * 1e3:.0f} ms)"
        )
        print("   " + kernel.explain(**inputs).replace("\n", "\n   "))
        if w.name == show_source:
            print(f"\n-- generated Triton source for {w.name} --\n{kernel.sources(**inputs)[0]}")
    s, c = rx.fusion_stats(), rx.cache_stats()
    print(
        f"fusion stats: {s.kernels_launched} kernels launched, {s.fused_executions} fused, "
        f"{s.kernel_launches_saved} launches saved, {s.bytes_moved} bytes moved vs {s.bytes_eager} eager "
        f"({100 * (1 - s.bytes_moved / max(s.bytes_eager, 1)):.0f}% less)"
    )
    print(
        f"kernel cache: {c.entries} entries, {c.compiles} generated, {c.disk_hits} from disk, "
        f"{c.hits} hits, {c.misses} misses; sources in {rx.get_config().resolved_cache_dir}"
    )
    print("all results match torch" if not failures else f"{failures} workload(s) did not match torch")
    return 1 if failures else 0


def _input(spec: str) -> tuple[str, torch.Tensor]:
    """``name=dtype:4x8`` (dtype optional, float32 by default) -> a random tensor."""
    name, _, rest = spec.partition("=")
    dtype_name, _, dims = rest.rpartition(":")
    dtype = getattr(torch, dtype_name or "float32", None)
    if not name or not isinstance(dtype, torch.dtype) or not dims:
        raise rx.RtxError(f"--input {spec!r}: expected name=dtype:4x8, e.g. x=float16:32x1024")
    shape = tuple(int(d) for d in dims.split("x")) if dims != "scalar" else ()
    return name, torch.randn(shape).to(dtype)


def explain(text: str, inputs: list[str]) -> int:
    """Parse ``text``, print its plan and generated source for ``inputs``, check it against torch."""
    expr = rx.parse(text)
    tensors = dict(_input(i) for i in inputs)
    kernel = rx.compile(expr)
    print(kernel.explain(**tensors))
    for src in kernel.sources(**tensors):
        print(f"\n{src}")
    out = kernel(**tensors)
    want = rx.compile(expr, config=rx.FusionConfig(backend="torch"))(**tensors)
    err = max_error(out, want)
    print(f"max |error| against torch: {err:.3g}")
    return 0 if err <= tolerance(out.dtype) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rtxdsl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd")
    d = sub.add_parser("demo", help="compile, run and check the demo workloads (default)")
    d.add_argument("--source", default="layer_norm", help="workload whose generated source to print")
    e = sub.add_parser("explain", help="plans of a kernel file, or plan, source and check of expression text")
    e.add_argument("expr", help='a kernel file (.toml/.yaml/.yml/.json), or text: "softmax(x * 0.125, axis=-1)"')
    e.add_argument("--input", action="append", default=[], help="name=dtype:4x8 (repeat per input)")
    e.add_argument("--kernel", help="only this kernel of the file")
    e.add_argument("--source", action="store_true", help="also print the generated sources")
    c = sub.add_parser("check", help="every kernel of a file at every size against torch (float64)")
    c.add_argument("file")
    c.add_argument("--kernel", help="only this kernel")
    b = sub.add_parser("build", help="generate and compile every kernel of a file for GPU targets, no GPU needed")
    b.add_argument("file")
    b.add_argument("--target", action="append", default=[], help="sm_XX (repeat; default sm_90)")
    b.add_argument("--kernel", help="only this kernel")
    b.add_argument("--manifest", help="where to write build-manifest.json (default: the cache directory)")
    b.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    m = sub.add_parser("bench", help="pytest-benchmark of every kernel of a file against eager torch")
    m.add_argument("file")
    m.add_argument("--kernel", help="only this kernel")
    m.add_argument("--json", dest="json_out", help="write pytest-benchmark's JSON here")
    m.add_argument("--compare", default="eager", help="comma-separated: eager (compile runs on a GPU only)")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "explain":
            if commands.is_kernel_file(args.expr):
                return commands.explain(args.expr, args.kernel, args.source)
            return explain(args.expr, args.input)
        if args.cmd == "check":
            return commands.check(args.file, args.kernel)
        if args.cmd == "build":
            return commands.build(args.file, args.target or ["sm_90"], args.kernel, args.manifest, args.jobs)
        if args.cmd == "bench":
            return commands.bench(args.file, args.kernel, args.json_out, args.compare.split(","))
        return demo(getattr(args, "source", "layer_norm"))
    except rx.RtxError as exc:
        print(f"rtxdsl: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
