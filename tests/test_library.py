"""Kernel files: rx.load_library and the check / explain / build / bench commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import rtxdsl as rx

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "llm_kernels.toml"

GOOD = """
[config]
max_fusion_ops = 32

[kernels.bias_gelu]
expr = "gelu(x + b, approximate='tanh')"
inputs = { x = "float32[B, 16]", b = "float32[16]" }
sizes = { B = [1, 3] }

[kernels.residual_norm]
outputs = { h = "x + r", y = "layer_norm(x + r, w, c)" }
inputs = { x = "float32[B, H]", r = "float32[B, H]", w = "float32[H]", c = "float32[H]" }
sizes = { B = [2], H = [8, 13] }
tolerance = { atol = 1e-5, rtol = 1e-5 }
"""


def _write(tmp_path: Path, text: str, name: str = "k.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "rtxdsl", *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT
    )


def test_load_library_gives_ordinary_kernels(tmp_path):
    lib = rx.load_library(_write(tmp_path, GOOD))
    assert lib.names == ("bias_gelu", "residual_norm")
    assert isinstance(lib.bias_gelu, rx.Kernel) and lib["residual_norm"] is lib.residual_norm
    assert lib.config.max_fusion_ops == 32 and lib.bias_gelu.config.max_fusion_ops == 32
    assert rx.get_config().max_fusion_ops != 32  # the file's config applies to its kernels only
    x, b = torch.randn(3, 16), torch.randn(16)
    torch.testing.assert_close(lib.bias_gelu(x=x, b=b), F.gelu(x + b, approximate="tanh"))
    assert lib.bias_gelu.inputs == ("x", "b")  # the file's input order
    out = lib.residual_norm(x=x, r=x, w=b, c=b)
    assert set(out) == {"h", "y"} and lib.residual_norm.launches(x=x, r=x, w=b, c=b) == 1
    xg = x.clone().requires_grad_()
    lib.bias_gelu(x=xg, b=b).sum().backward()  # autograd works as for any kernel
    assert xg.grad is not None
    with pytest.raises(rx.RtxError, match="no kernel named 'nope'"):
        lib["nope"]


def test_yaml_and_json_files(tmp_path):
    y = "kernels:\n  act:\n    expr: relu(x) * 2\n    inputs: {x: 'float16[N]'}\n    sizes: {N: [5]}\n"
    lib = rx.load_library(_write(tmp_path, y, "k.yaml"))
    assert lib.act(x=torch.ones(5, dtype=torch.float16)).tolist() == [2.0] * 5
    j = {"kernels": {"act": {"expr": "x + 1", "inputs": {"x": "int32[3]"}}}}
    lib = rx.load_library(_write(tmp_path, json.dumps(j), "k.json"))
    assert lib.act(x=torch.zeros(3, dtype=torch.int32)).tolist() == [1, 1, 1]


BAD = """[config]
max_fusion_ops = 0

[kernels.a]
expr = "gelu(x + b"
inputs = { x = "float32[B, 4]", b = "float32[4]" }
sizes = { B = [1, 2] }

[kernels.b]
expr = "relu(x) + y"
inputs = { x = "floot32[N]", z = "float32[M]" }
sizes = { N = [3] }

[kernels.c]
outputs = { h = "x + 1" }
inputs = { x = "float32[K]" }
sizes = { K = [0] }
unknown_key = 3
"""


def test_every_problem_is_reported_with_its_position(tmp_path):
    path = _write(tmp_path, BAD)
    with pytest.raises(rx.LibraryError) as info:
        rx.load_library(path)
    problems = info.value.problems
    text = "\n".join(problems)
    assert f"{path}:1:1: config: " in text and "max_fusion_ops" in text
    assert f"{path}:5:13: kernels.a.expr: invalid expression" in text  # column 5 of the expression text
    assert f"{path}:11:12: kernels.b.inputs.x: unknown dtype 'floot32'" in text
    assert "kernels.b.inputs.z: dim 'M' has no entry in 'sizes'" in text
    assert "the expression reads 'y', which is not declared" in text
    assert "kernels.b.inputs.z: input 'z' is not used by the expression" in text
    assert f"{path}:17:1: kernels.c.sizes: " in text and "positive ints" in text
    assert f"{path}:18:1: kernels.c.unknown_key: Extra inputs are not permitted" in text


def test_syntax_errors_have_positions(tmp_path):
    with pytest.raises(rx.LibraryError, match=r"k.toml:2:10: invalid TOML"):
        rx.load_library(_write(tmp_path, '[kernels.a]\nexpr = "x\n'))
    with pytest.raises(rx.LibraryError, match=r"k.yaml:2:\d+: invalid YAML"):
        rx.load_library(_write(tmp_path, "kernels:\n  a: b: c\n", "k.yaml"))


def test_check_command_exit_codes(tmp_path):
    ok = _cli("check", str(_write(tmp_path, GOOD)))
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    assert sum("OK" in line for line in lines) == 4  # 2 sizes + 2 sizes
    assert "bias_gelu [B=3]: 1 kernel(s) (eager 2)" in ok.stdout
    bad = _cli("check", str(_write(tmp_path, BAD, "bad.toml")))
    assert bad.returncode == 2 and "nothing was run" in bad.stderr and "kernels.a.expr" in bad.stderr


def test_disagreement_exits_1_and_tolerances_are_applied(tmp_path, monkeypatch, capsys):
    from rtxdsl import commands

    path = _write(tmp_path, GOOD)
    assert commands.check(str(path), "bias_gelu") == 0
    monkeypatch.setattr(commands, "_agree", lambda out, ref, tol: (False, 1.0))
    assert commands.check(str(path), "bias_gelu") == 1
    assert "MISMATCH" in capsys.readouterr().out
    monkeypatch.undo()
    ref = torch.tensor([1.0, float("nan"), 2.0], dtype=torch.float64)
    assert commands._agree(torch.tensor([1.0, float("nan"), 2.0]), ref, None)[0]
    assert not commands._agree(torch.tensor([1.0, 0.0, 2.0]), ref, None)[0]  # NaN must stay NaN
    assert not commands._agree(torch.tensor([1.0, float("nan"), 2.001]), ref, (0.0, 1e-4))[0]
    assert commands._agree(torch.tensor([1.0, float("nan"), 2.001]), ref, (0.0, 1e-3))[0]
    assert not commands._agree(torch.tensor([1, 2]), torch.tensor([1, 3]), None)[0]  # integers exact


def test_explain_command_takes_files_and_text(tmp_path):
    res = _cli("explain", str(_write(tmp_path, GOOD)), "--kernel", "residual_norm", "--source")
    assert res.returncode == 0, res.stderr
    assert "== residual_norm [B=2, H=8]" in res.stdout and "@triton.jit" in res.stdout
    text = _cli("explain", "relu(x) * 2", "--input", "x=float32:3x5")
    assert text.returncode == 0 and "max |error| against torch" in text.stdout


def test_build_command_compiles_for_sm90_without_a_gpu(tmp_path):
    manifest = tmp_path / "manifest.json"
    res = _cli("build", str(_write(tmp_path, GOOD)), "--target", "sm_90", "--kernel", "bias_gelu",
               "--manifest", str(manifest), "--jobs", "2")  # fmt: skip
    if res.returncode != 0 and "GPUTarget" in res.stderr:
        pytest.skip(f"this Triton cannot compile for sm_90 without a GPU: {res.stderr[-300:]}")
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(manifest.read_text())["kernels"]
    assert len(rows) == 2 and {r["target"] for r in rows} == {"sm_90"}
    assert all(r["spill_bytes"] == 0 and r["v4_loads"] > 0 and len(r["signature"]) >= 20 for r in rows)
    assert _cli("build", str(tmp_path / "k.toml"), "--target", "gpu90").returncode == 2


def test_bench_command_writes_pytest_benchmark_json(tmp_path):
    one = 'kernels.act.expr = "relu(x)"\nkernels.act.inputs = { x = "float32[64]" }\n'
    out = tmp_path / "bench.json"
    res = _cli("bench", str(_write(tmp_path, one)), "--json", str(out))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [b["name"] for b in data["benchmarks"]] == ["test_kernel[act[fixed]-rtxdsl]"]
    if not torch.cuda.is_available():
        assert "host overhead per call only" in res.stdout


def test_example_library_checks_clean():
    lib = rx.load_library(EXAMPLE)
    assert {"cross_entropy", "rope_qk", "geglu", "add_rms_norm"} <= set(lib.names)
