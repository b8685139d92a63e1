"""The kernel-file commands: ``rtxdsl check | explain | build | bench FILE``.

Each returns an exit code: 0 all good, 1 a kernel disagrees with torch / spills / fails to
compile, 2 an invalid file (every problem printed with its file:line:col, nothing run).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .build import compile_kernel
from .library import Entry, Library, LibraryError, load_library, size_label
from .runtime_launch import interpreter_active

#: (atol, rtol) against a float64 reference, by output dtype (kernels compute half types in fp32)
TOLERANCE = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (4e-2, 4e-2),
}


def _open(path: str) -> Library | None:
    try:
        return load_library(path)
    except LibraryError as exc:
        for p in exc.problems:
            print(p, file=sys.stderr)
        print(f"rtxdsl: {path}: {len(exc.problems)} problem(s); nothing was run", file=sys.stderr)
        return None


def _pick(lib: Library, only: str | None) -> list[Entry] | None:
    if only is None:
        return list(lib.entries.values())
    if only not in lib.entries:
        print(f"rtxdsl: {lib.path}: no kernel named {only!r}; it has {', '.join(lib.names)}", file=sys.stderr)
        return None
    return [lib.entries[only]]


def _selected(path: str, only: str | None) -> tuple[Library, list[Entry]] | None:
    """The library at ``path`` and its kernels (``only`` one of them); None after reporting why not."""
    lib = _open(path)
    if lib is None:
        return None
    entries = _pick(lib, only)
    return None if entries is None else (lib, entries)


def _outputs(out: Any) -> dict[str, torch.Tensor]:
    return out if isinstance(out, dict) else {"out": out}


def _agree(out: torch.Tensor, ref: torch.Tensor, tol: tuple[float, float] | None) -> tuple[bool, float]:
    """Within tolerance of the float64 reference (NaN where it has NaN; integers exact)."""
    if out.shape != ref.shape:
        return False, float("inf")
    if not out.dtype.is_floating_point:
        return bool(torch.equal(out, ref.to(out.dtype))), 0.0
    atol, rtol = tol or TOLERANCE.get(out.dtype, (1e-4, 1e-4))
    a, b = out.double(), ref.to(out.dtype).double()
    same = (a == b) | (a.isnan() & b.isnan())
    diff = torch.where(same, 0.0, (a - b).abs())
    err = float(diff.max()) if diff.numel() else 0.0
    ok = bool((same | (diff <= atol + rtol * b.abs())).all())
    return ok, err


def check(path: str, only: str | None = None) -> int:
    """Every kernel at every size combination against the torch backend in float64."""
    picked = _selected(path, only)
    if picked is None:
        return 2
    lib, entries = picked
    reference = lib.config.model_copy(update={"backend": "torch"})
    bad = 0
    for e in entries:
        ref_kernel = type(e.kernel)(dict(e.kernel.expressions), reference, inputs=e.kernel.inputs)
        for sizes in e.size_grid():
            ins = e.random_inputs(sizes)
            out = _outputs(e.kernel(**ins))
            ref = _outputs(ref_kernel(**{n: t.double() if t.is_floating_point() else t for n, t in ins.items()}))
            if e.kernel.outputs == ("out",) and "out" not in ref:
                ref = {"out": next(iter(ref.values()))}
            results = [_agree(out[k], ref[k], e.tolerance) for k in out]
            ok = all(r[0] for r in results)
            err = max(r[1] for r in results)
            s = e.kernel.summary(**ins)
            bad += not ok
            print(
                f"{e.name} [{size_label(sizes)}]: {s.kernels} kernel(s) (eager {s.eager_launches}), "
                f"{s.bytes_moved / 1e6:.3g} MB vs {s.bytes_eager / 1e6:.3g} MB eager, "
                f"max |error| {err:.2e} {'OK' if ok else 'MISMATCH'}"
            )
    print(f"{len(entries)} kernel(s) checked: {'all agree with torch' if not bad else f'{bad} disagreement(s)'}")
    return 1 if bad else 0


def explain(path: str, only: str | None = None, source: bool = False) -> int:
    """Plans (and generated sources) for each kernel's first size combination."""
    picked = _selected(path, only)
    if picked is None:
        return 2
    lib, entries = picked
    for e in entries:
        sizes = next(e.size_grid())
        ins = e.random_inputs(sizes)
        print(f"== {e.name} [{size_label(sizes)}]")
        print(e.kernel.explain(**ins))
        if source:
            for src in e.kernel.sources(**ins):
                print(f"\n{src}")
    return 0


def build(path: str, targets: list[str], only: str | None = None, manifest: str | None = None, jobs: int = 1) -> int:
    """Generate and compile every kernel and size for each ``sm_XX`` target, without that GPU."""
    if interpreter_active():  # compiling needs Triton's compiled mode: run in a fresh process
        argv = ["build", path, *[a for t in targets for a in ("--target", t)], "--jobs", str(jobs)]
        argv += ["--kernel", only] if only else []
        argv += ["--manifest", manifest] if manifest else []
        env = {"TRITON_DEFAULT_FP_FUSION": "1", **os.environ, "TRITON_INTERPRET": "0"}
        return subprocess.run([sys.executable, "-m", "rtxdsl", *argv], env=env, check=False).returncode

    archs = []
    for t in targets:
        if not (t.startswith("sm_") and t[3:].isdigit()):
            print(f"rtxdsl: --target {t!r}: expected sm_XX, e.g. sm_90", file=sys.stderr)
            return 2
        archs.append(int(t[3:]))
    if jobs < 1:
        print(f"rtxdsl: --jobs {jobs}: expected a positive count", file=sys.stderr)
        return 2
    picked = _selected(path, only)
    if picked is None:
        return 2
    lib, entries = picked
    work = [(str(lib.path), e.name, sizes, arch) for e in entries for sizes in e.size_grid() for arch in archs]
    if jobs == 1:
        results = map(_build_one, work)
    else:  # each worker loads the file once and compiles its share
        pool = concurrent.futures.ProcessPoolExecutor(max_workers=jobs)
        results = pool.map(_build_one, work)
    rows, bad = [], 0
    for (_, name, sizes, arch), (facts, error) in zip(work, _progress(results, len(work))):
        if error is not None:  # a compile failure of one kernel is reported, the rest still build
            bad += 1
            print(f"{name} [{size_label(sizes)}] sm_{arch}: FAILED {error}")
            continue
        for f in facts:
            spilled = bool(f["spill_bytes"])
            bad += spilled
            rows.append({"kernel": name, "sizes": sizes, "target": f"sm_{arch}", **f})
            print(
                f"{name} [{size_label(sizes)}] sm_{arch}: {f['generated']}: {f['compile_ms']:.0f} ms, "
                f"{f['registers']} registers, {f['spill_bytes']} spill bytes, "
                f"{f['v4_loads']}/{f['v4_stores']} 128-bit loads/stores{' SPILLS' if spilled else ''}"
            )
    if jobs > 1:
        pool.shutdown()
    out = Path(manifest) if manifest else lib.config.resolved_cache_dir / "build-manifest.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"file": str(lib.path), "kernels": rows}, indent=1))
    print(f"{len(rows)} kernel(s) compiled, {bad} problem(s); manifest {out}")
    return 1 if bad else 0


@functools.lru_cache(maxsize=4)
def _library(path: str) -> Library:
    return load_library(path)


def _build_one(job: tuple[str, str, dict[str, int], int]) -> tuple[list[dict[str, Any]], str | None]:
    """Compile one kernel at one size for one target: its facts, or the error (picklable either way)."""
    path, name, sizes, arch = job
    e = _library(path).entries[name]
    try:
        facts = compile_kernel(e.kernel, e.random_inputs(sizes), arch)
    except Exception as exc:  # reported per kernel by the caller
        return [], f"{type(exc).__name__}: {str(exc)[:200]}"
    return [
        {
            "generated": f.name,
            "signature": f.signature,
            "compile_ms": round(f.seconds * 1e3, 1),
            "registers": f.registers,
            "spill_bytes": f.spill_bytes,
            "v4_loads": f.v4_loads,
            "v4_stores": f.v4_stores,
        }
        for f in facts
    ], None


def _progress(results: Any, total: int) -> Any:
    """A progress bar on a terminal (tqdm), the plain results otherwise."""
    return tqdm(results, total=total, file=sys.stderr, unit="kernel") if sys.stderr.isatty() else results


BENCH_MODULE = textwrap.dedent('''
    """Generated by rtxdsl bench: every kernel and size of {path} against eager torch."""
    import pytest, torch
    from rtxdsl.commands import bench_cases
    CASES = bench_cases({path!r}, {only!r}, {compare!r})

    @pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
    def test_kernel(benchmark, case):
        benchmark.group = case.group
        benchmark.extra_info.update(case.info)
        benchmark(case.fn)
''')


class BenchCase:
    def __init__(self, id: str, group: str, fn: Any, info: dict[str, Any]) -> None:  # noqa: A002
        self.id, self.group, self.fn, self.info = id, group, fn, info


def bench_cases(path: str, only: str | None, compare: list[str]) -> list[BenchCase]:
    """rtxdsl (dry_run host work on a machine without a GPU) and each comparison, per kernel and size."""
    lib = load_library(path)
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    mode = "gpu" if gpu else "host overhead only (dry_run; no GPU)"
    cfg = lib.config if gpu else lib.config.model_copy(update={"dry_run": True})
    cases = []
    for e in lib.entries.values() if only is None else [lib.entries[only]]:
        kernel = type(e.kernel)(dict(e.kernel.expressions), cfg, inputs=e.kernel.inputs)
        eager = type(e.kernel)(
            dict(e.kernel.expressions), cfg.model_copy(update={"backend": "torch"}), inputs=e.kernel.inputs
        )
        for sizes in e.size_grid():
            ins = e.random_inputs(sizes, device=device)
            group = f"{e.name}[{size_label(sizes)}]"
            info = {"mode": mode, "sizes": sizes}
            kernel(**ins)
            cases.append(BenchCase(f"{group}-rtxdsl", group, lambda k=kernel, i=ins: k(**i), info))
            if gpu and "eager" in compare:  # on a CPU a ratio to eager compute would mislead
                cases.append(BenchCase(f"{group}-eager", group, lambda k=eager, i=ins: k(**i), info))
    return cases


def bench(path: str, only: str | None, json_out: str | None, compare: list[str]) -> int:
    """pytest-benchmark over the file's kernels; its own JSON format (``pytest-benchmark compare`` reads it)."""
    if _selected(path, only) is None:  # the file loads and names the kernel: reported here, not in pytest
        return 2
    unknown = [c for c in compare if c not in ("eager", "compile")]
    if unknown:
        print(f"rtxdsl: --compare {unknown[0]!r}: expected eager and/or compile", file=sys.stderr)
        return 2
    if "compile" in compare:
        print("rtxdsl bench: torch.compile comparisons are not implemented yet: skipped")
    if not torch.cuda.is_available():
        print("rtxdsl bench: no GPU here: rtxdsl's host overhead per call only (dry_run), no comparison")
    with tempfile.TemporaryDirectory() as tmp:
        mod = Path(tmp) / "test_rtxdsl_bench.py"
        mod.write_text(BENCH_MODULE.format(path=str(Path(path).resolve()), only=only, compare=compare))
        argv = [sys.executable, "-m", "pytest", str(mod), "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
        argv += ["--benchmark-only", "--benchmark-group-by=group", "--benchmark-columns=min,median,mean,rounds"]
        if json_out:
            argv.append(f"--benchmark-json={Path(json_out).resolve()}")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTEST_XDIST"))}  # a nested run
        res = subprocess.run(argv, cwd=tmp, env=env, check=False)
    return 0 if res.returncode == 0 else 1


def is_kernel_file(arg: str) -> bool:
    """An argument naming an existing .toml / .yaml / .yml / .json file is a kernel file."""
    p = Path(arg)
    return p.suffix.lower() in (".toml", ".yaml", ".yml", ".json") and p.is_file()
