"""The structural signature: constants and sizes are arguments, so they never recompile."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import rtxdsl as rx
from rtxdsl.cache import GLOBAL_CACHE

x, y = rx.var("x"), rx.var("y")


def _compiles() -> int:
    return rx.cache_stats().compiles + rx.cache_stats().disk_hits


def test_other_constants_and_sizes_reuse_the_kernel():
    rx.compile(rx.relu(x * 3.0 + y) * 0.25)(x=torch.randn(5), y=torch.randn(5))
    before = _compiles()
    for scale, n in [(1.5, 7), (-2.0, 1023), (9.0, 20), (0.1, 3001)]:
        k = rx.compile(rx.relu(x * scale + y) * 0.5)
        a, b = torch.randn(n), torch.randn(n)
        assert torch.allclose(k(x=a, y=b), torch.relu(a * scale + b) * 0.5)
    assert _compiles() == before


def test_twenty_sizes_one_compile_per_layout():
    k = rx.compile(rx.softmax(x, axis=-1))
    k(x=torch.randn(3, 100))
    before = _compiles()
    for rows in range(1, 21):  # any row count, and row lengths within one power-of-two bucket
        k(x=torch.randn(rows, 65 + rows))
    assert _compiles() == before


def test_a_size_or_number_equal_to_a_constant_the_expansion_made_compiles_nothing():
    """A mean's count and a norm's eps are kernel arguments of their own: a row of 10 beside
    ``* 10.0``, or eps beside an equal number written after the norm, share no argument with it,
    so the kernel's source is the one every other size (in the bucket) and number gets. (Both
    shared one while constants were interned by value alone: a new kernel at that size.)"""
    w = rx.var("w")
    mean = rx.compile(rx.mean(x, -1) * 10.0)
    sources = {mean.sources(x=torch.randn(3, n))[0] for n in (9, 10, 11)}  # one block bucket, none fills it
    assert len(sources) == 1
    ins = {"x": torch.randn(3, 9), "w": torch.randn(9), "y": torch.randn(9)}
    norms = {rx.compile(rx.layer_norm(x, w, y) + c).sources(**ins)[0] for c in (1e-5, 1e-3)}  # eps=1e-5
    assert len(norms) == 1
    k = rx.compile(rx.mean(x, -1) * 10.0)
    for n in (9, 10, 11):
        t = torch.randn(3, n)
        torch.testing.assert_close(k(x=t), t.mean(-1) * 10.0)


def test_structure_dtype_and_layout_do_recompile():
    k = rx.compile(x * 2.0)
    k(x=torch.randn(8))
    before = rx.cache_stats().misses
    k(x=torch.randn(8).half())  # dtype
    k(x=torch.randn(8, 8).t())  # layout
    rx.compile(x * 2.0 + 1.0)(x=torch.randn(8))  # structure
    assert rx.cache_stats().misses == before + 3


def test_lru_eviction_bounded_by_cache_size():
    cfg = rx.FusionConfig(cache_size=2)
    GLOBAL_CACHE.clear()
    for i in range(4):
        e = x
        for _ in range(i + 1):
            e = rx.exp(e)
        rx.compile(e, config=cfg)(x=torch.randn(4))
    st = rx.cache_stats()
    assert st.entries == 2 and st.evictions == 2


def test_sources_written_to_cache_dir_and_importable(tmp_path):
    cfg = rx.FusionConfig(cache_dir=str(tmp_path))
    k = rx.compile(rx.sigmoid(x) * y, config=cfg)
    k(x=torch.randn(4), y=torch.randn(4))
    (version,) = list(tmp_path.iterdir())  # one format-version directory
    files = sorted(p.name for p in version.iterdir())
    assert len(files) == 2 and files[0].endswith(".json") and files[1].endswith(".py")
    assert not [p for p in tmp_path.rglob("*.tmp")]
    meta = json.loads(next(version.glob("*.json")).read_text())
    src = (version / f"{meta['signature']}.py").read_text()
    assert src == k.sources(x=torch.randn(4), y=torch.randn(4))[0] and "@triton.jit" in src


def test_a_new_process_starts_from_disk(tmp_path):
    script = textwrap.dedent(f"""
        import torch, rtxdsl as rx
        cfg = rx.FusionConfig(cache_dir={str(tmp_path)!r})
        k = rx.compile(rx.gelu(rx.var("x") + rx.var("b")), config=cfg)
        out = k(x=torch.ones(10), b=torch.ones(10))
        s = rx.cache_stats()
        print(s.compiles, s.disk_hits, round(out[0].item(), 4))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    first = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    second = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert first.stdout.split() == ["1", "0", "1.9545"]
    assert second.stdout.split() == ["0", "1", "1.9545"]


PROCESS_SCRIPT = textwrap.dedent("""
    import sys, torch, rtxdsl as rx
    from rtxdsl.workloads import WORKLOADS
    cfg = rx.FusionConfig(cache_dir=sys.argv[1])
    for w in WORKLOADS:
        ins = w.inputs(3, 40, w.dtype, torch.device("cpu"), torch.Generator().manual_seed(0))
        rx.compile(w.expr(), config=cfg)(**ins)
    s = rx.cache_stats()
    print(s.compiles, s.disk_hits, s.healed)
""")


def test_four_processes_share_an_empty_cache_dir_and_a_fifth_starts_from_disk(tmp_path):
    import hashlib

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-c", PROCESS_SCRIPT, str(tmp_path)]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(4)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-2000:]
        assert out.split()[2] == "0"  # nothing had to be healed: no process saw a partial entry
    assert not list(tmp_path.rglob("*.tmp"))
    sources = list(tmp_path.rglob("*.py"))
    assert len(sources) == len(list(tmp_path.rglob("*.json"))) > 0
    for src in sources:  # every entry complete: its record's digest matches its source
        meta = json.loads(src.with_suffix(".json").read_text())
        assert meta["digest"] == hashlib.sha256(src.read_text().encode()).hexdigest()
    fifth = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    compiles, disk_hits, healed = map(int, fifth.stdout.split())
    assert (compiles, healed) == (0, 0) and disk_hits == len(sources)


def test_the_generator_digest_covers_every_module_that_writes_source(tmp_path, monkeypatch):
    """A kernel file on disk is reused only by the code that wrote it: the digest in its name
    changes with codegen/, ops/ and lower/ (block sparsity's tile scan is written by
    ``lower.sparsity``; a change there was served a stale file without it)."""
    import rtxdsl.cache as cache_module

    root = Path(cache_module.__file__).parent
    for sub in ("codegen", "lower", "ops"):
        fake = tmp_path / "rtxdsl"
        if fake.exists():
            shutil.rmtree(fake)
        shutil.copytree(root, fake, ignore=shutil.ignore_patterns("__pycache__"))
        monkeypatch.setattr(cache_module, "__file__", str(fake / "cache.py"))
        before = cache_module.generator_digest()
        target = sorted((fake / sub).glob("*.py"))[-1]
        target.write_text(target.read_text() + "\n# changed\n")
        assert cache_module.generator_digest() != before, sub
