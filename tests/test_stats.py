"""FusionStats are exact under the traffic model: inputs read once, outputs written once."""

from __future__ import annotations

import pytest
import torch

import rtxdsl as rx
from rtxdsl.lazy import default_fusion

x, y = rx.var("x"), rx.var("y")


@pytest.mark.parametrize("n", [1, 1023, 4097])
def test_relu_mul_add_counts(n):
    rx.compile(rx.relu(x * y + 1))(x=torch.randn(n), y=torch.randn(n))
    s = rx.fusion_stats()
    assert s.kernels_launched == 1
    assert s.fused_executions == 1
    assert s.kernel_launches_saved == 2
    assert s.bytes_moved == 12 * n  # x, y read, out written
    assert s.bytes_eager == 28 * n  # mul 12n + add 8n + relu 8n


def test_broadcast_operand_counted_at_its_own_size():
    rx.compile(x * y)(x=torch.randn(10, 100), y=torch.randn(100))
    s = rx.fusion_stats()
    assert s.bytes_moved == 4 * (1000 + 100 + 1000)


def test_counts_accumulate_and_reset():
    k = rx.compile(rx.exp(x) + 1)
    for _ in range(3):
        k(x=torch.randn(8))
    s = rx.fusion_stats()
    assert (s.calls, s.kernels_launched, s.kernel_launches_saved) == (3, 3, 3)
    rx.reset_fusion_stats()
    assert rx.fusion_stats().kernels_launched == 0


def test_single_op_is_not_a_fused_execution():
    rx.compile(x + y)(x=torch.randn(8), y=torch.randn(8))
    s = rx.fusion_stats()
    assert (s.kernels_launched, s.fused_executions, s.kernel_launches_saved) == (1, 0, 0)


def test_multi_output_adamw_style_update_is_one_kernel():
    p, g, m = rx.var("p"), rx.var("g"), rx.var("m")
    m2 = 0.9 * m + 0.1 * g
    k = rx.compile({"p": p - 0.01 * m2, "m": m2})
    n = 513
    out = k(p=torch.randn(n), g=torch.randn(n), m=torch.randn(n))
    assert set(out) == {"p", "m"}
    s = rx.fusion_stats()
    assert s.kernels_launched == 1 and s.bytes_moved == 4 * n * 5  # 3 read, 2 written


def test_fusion_stats_count_every_launch_in_the_process_and_a_fusion_its_own():
    """rx.fusion_stats(): compiled kernels, the default stream and every private rx.Fusion;
    f.stats(): that Fusion's launches alone. Each reset touches only its own counters."""
    a = torch.randn(8)
    f, g, default = rx.Fusion(), rx.Fusion(), default_fusion()
    default.reset_stats()  # the process's default stream: other tests ran in it
    (f.lazy(a) * 2 + 1).torch()  # one kernel in f
    (torch.exp(g.lazy(a)) - 1).torch()  # one in g
    (g.lazy(a) * 3).torch()  # another in g
    rx.compile(x + 1)(x=a)  # one outside any Fusion
    (rx.lazy(a) * 4).torch()  # one in the default stream
    assert (f.stats().kernels_launched, g.stats().kernels_launched) == (1, 2)
    assert default.stats().kernels_launched == 1
    s = rx.fusion_stats()
    assert (s.kernels_launched, s.calls, s.bytes_moved) == (5, 5, 5 * 2 * 4 * 8)  # each read 8 floats, wrote 8
    assert (
        s.bytes_moved
        == sum(t.stats().bytes_moved for t in (f, g, default)) + rx.compile(x + 1).program(x=a).bytes_moved
    )
    f.reset_stats()
    assert f.stats().kernels_launched == 0 and rx.fusion_stats().kernels_launched == 5
    rx.reset_fusion_stats()
    assert rx.fusion_stats().kernels_launched == 0 and g.stats().kernels_launched == 2


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_eager_traffic_of_linear_cross_entropy_writes_and_reads_its_logits(bias, softcap):
    """Eager's F.linear writes the [tokens, vocab] logits and F.cross_entropy reads them (each
    softcap op reads and writes them once more): the eager model counts them, as it does for
    rx.cross_entropy(rx.linear(h, w), t); the fused kernel never writes them."""
    n, hidden, vocab, f32, i64 = 37, 33, 31, 4, 8
    h, w, t, b = torch.randn(n, hidden), torch.randn(vocab, hidden), torch.randint(0, vocab, (n,)), torch.randn(vocab)
    logits = n * vocab * f32
    inputs = n * hidden * f32 + vocab * hidden * f32 + (vocab * f32 if bias else 0)
    capped = 0 if softcap is None else 3  # logits / cap, tanh, * cap
    eager = (inputs + logits) + capped * 2 * logits + (logits + n * i64 + f32)  # GEMM, softcap, loss
    H, W, T, B = rx.var("h"), rx.var("w"), rx.var("t"), rx.var("b")
    feed = {"h": h, "w": w, "t": t} | ({"b": b} if bias else {})
    fused = rx.compile(rx.linear_cross_entropy(H, W, T, B if bias else None, softcap=softcap))
    p = fused.program(**feed)
    assert (p.eager_bytes, p.eager_launches) == (eager, 1 + capped + 2)
    assert p.kernels_launched == 1 and p.minimum_bytes == inputs + n * i64 + f32  # no logits
    assert f"(eager: {eager}, minimum: {p.minimum_bytes})" in fused.explain(**feed)
    logits_expr = rx.linear(H, W, B if bias else None)
    if softcap is not None:
        logits_expr = rx.tanh(logits_expr / softcap) * softcap
    spelled_out = rx.compile(rx.cross_entropy(logits_expr, T)).program(**feed)
    assert (spelled_out.eager_bytes, spelled_out.eager_launches) == (eager, 1 + capped + 2)


def test_stats_count_the_tensor_core_flops_of_what_ran(gen):
    """The compute model in the counters: a GEMM's 2 * m * n * k per call, through the lazy stream
    too; elementwise kernels add none."""
    x, w = rx.var("x"), rx.var("w")
    xs, ws = torch.randn(5, 7, generator=gen), torch.randn(3, 7, generator=gen)
    rx.reset_fusion_stats()
    rx.compile(rx.linear(x, w))(x=xs, w=ws)
    rx.compile(rx.relu(x))(x=xs)
    assert rx.fusion_stats().flops == 2 * 5 * 3 * 7
    f = rx.Fusion()
    _ = torch.nn.functional.linear(f.lazy(xs), ws).torch()
    assert f.stats().flops == 2 * 5 * 3 * 7
    assert rx.fusion_stats().flops == 2 * 2 * 5 * 3 * 7
