"""FusionConfig: frozen, validated, loadable from files and the environment."""

from __future__ import annotations

import json

import pytest
import torch

import rtxdsl as rx


def test_defaults_and_builders():
    cfg = rx.FusionConfig()
    assert cfg.enabled and cfg.backend == "auto" and not cfg.dry_run
    c2 = cfg.with_enabled(False).with_min_fusion_ops(2).with_max_fusion_ops(8).with_cache_size(16)
    assert (c2.enabled, c2.min_fusion_ops, c2.max_fusion_ops, c2.cache_size) == (False, 2, 8, 16)
    assert cfg.enabled  # builders return copies
    with pytest.raises(ValueError, match="frozen"):
        cfg.enabled = False


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"min_fusion_ops": 5, "max_fusion_ops": 2}, "min_fusion_ops"),
        ({"cache_size": 0}, "cache_size"),
        ({"max_fusion_ops": 0}, "max_fusion_ops"),
        ({"backend": "cuda"}, "backend"),
        ({"enabled": "maybe"}, "enabled"),
        ({"cache_sise": 3}, "cache_sise"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(rx.ConfigError, match=field):
        rx.FusionConfig(**kwargs)


def test_builders_validate():
    with pytest.raises(rx.ConfigError, match="min_fusion_ops"):
        rx.FusionConfig(max_fusion_ops=4).with_min_fusion_ops(9)


@pytest.mark.parametrize(
    "suffix, text",
    [
        (".toml", '[rtxdsl]\nmax_fusion_ops = 12\nbackend = "torch"\n'),
        (".json", json.dumps({"max_fusion_ops": 12, "backend": "torch"})),
        (".yaml", "max_fusion_ops: 12\nbackend: torch\n"),
    ],
)
def test_load_files(tmp_path, suffix, text, monkeypatch):
    monkeypatch.delenv("RTXDSL_MAX_FUSION_OPS", raising=False)
    p = tmp_path / f"cfg{suffix}"
    p.write_text(text)
    cfg = rx.FusionConfig.load(p)
    assert cfg.max_fusion_ops == 12 and cfg.backend == "torch"


def test_load_errors(tmp_path):
    with pytest.raises(rx.ConfigError, match="does not exist"):
        rx.FusionConfig.load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.json"
    bad.write_text('{"cache_size": -1}')
    with pytest.raises(rx.ConfigError, match="bad.json.*cache_size"):
        rx.FusionConfig.load(bad)
    odd = tmp_path / "cfg.ini"
    odd.write_text("x")
    with pytest.raises(rx.ConfigError, match="unknown format"):
        rx.FusionConfig.load(odd)


def test_environment_overrides(tmp_path, monkeypatch):
    p = tmp_path / "cfg.toml"
    p.write_text("max_fusion_ops = 12\n")
    monkeypatch.setenv("RTXDSL_MAX_FUSION_OPS", "7")
    monkeypatch.setenv("RTXDSL_DRY_RUN", "yes")
    cfg = rx.FusionConfig.load(p)
    assert cfg.max_fusion_ops == 7 and cfg.dry_run
    monkeypatch.setenv("RTXDSL_ENABLED", "perhaps")
    with pytest.raises(rx.ConfigError, match="RTXDSL_ENABLED"):
        rx.FusionConfig.from_env()


def test_set_and_get_config():
    old = rx.get_config()
    try:
        rx.set_config(rx.FusionConfig(backend="torch"))
        assert rx.get_config().backend == "torch"
        k = rx.compile(rx.var("x") + 1)
        rx.reset_fusion_stats()
        assert k(x=torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
        assert rx.cache_stats() is not None and rx.fusion_stats().kernels_launched == 1  # eager: one add
    finally:
        rx.set_config(old)
    with pytest.raises(rx.ConfigError):
        rx.set_config({"enabled": True})


def test_dry_run_allocates_but_launches_nothing():
    k = rx.compile(rx.var("x") * 2 + 1, config=rx.FusionConfig(dry_run=True))
    out = k(x=torch.ones(5))
    assert out.shape == (5,) and out.dtype == torch.float32
    assert rx.fusion_stats().kernels_launched == 0


def test_disabled_fusion_runs_op_by_op():
    x = rx.var("x")
    k = rx.compile(rx.relu(x * 2 + 1), config=rx.FusionConfig(enabled=False))
    t = torch.randn(9)
    assert torch.equal(k(x=t), torch.relu(t * 2 + 1))
    s = rx.fusion_stats()
    assert (s.kernels_launched, s.fused_executions, s.kernel_launches_saved) == (3, 0, 0)


def test_min_and_max_fusion_ops_split_groups():
    x = rx.var("x")
    e = rx.relu(x * 2 + 1)  # 3 ops
    t = torch.randn(9)
    assert rx.compile(e, config=rx.FusionConfig(max_fusion_ops=2)).launches(x=t) == 2
    assert rx.compile(e, config=rx.FusionConfig(min_fusion_ops=4, max_fusion_ops=8)).launches(x=t) == 3
    assert rx.compile(e, config=rx.FusionConfig(min_fusion_ops=3)).launches(x=t) == 1
    for cfg in (rx.FusionConfig(max_fusion_ops=2), rx.FusionConfig(min_fusion_ops=4, max_fusion_ops=8)):
        assert torch.allclose(rx.compile(e, config=cfg)(x=t), torch.relu(t * 2 + 1))


@pytest.mark.parametrize(
    "build, limits, kernels",
    [
        # ten pointwise ops under a cap of 4: 4 + 4 + 2
        (lambda x: _chain(x, 10), {"max_fusion_ops": 4}, 3),
        # a composite is one op however many primitives it lowers to (sparsemax: ~160)
        (lambda x: rx.sparsemax(x) * 2.0, {"max_fusion_ops": 2}, 1),
        (lambda x: rx.sparsemax(x) * 2.0 + 1.0, {"max_fusion_ops": 2}, 2),
        # a small group is split one kernel per op written: softmax stays whole
        (lambda x: rx.softmax(x), {"min_fusion_ops": 2}, 1),
        (lambda x: rx.exp(x) + 1.0, {"min_fusion_ops": 3}, 2),
        (lambda x: rx.softmax(x) + 1.0, {"min_fusion_ops": 3}, 2),
        (lambda x: _chain(x, 3), {"min_fusion_ops": 3}, 1),
    ],
)
def test_fusion_op_limits_count_the_ops_written(build, limits, kernels):
    x = torch.randn(3, 9)
    k = rx.compile(build(rx.var("x")), config=rx.FusionConfig(**limits))
    assert k.summary(x=x).kernels == kernels
    torch.testing.assert_close(k(x=x), rx.compile(build(rx.var("x")))(x=x))


def _chain(x, n):
    for i in range(n):
        x = x * 1.5 if i % 2 else x + 0.25
    return x
