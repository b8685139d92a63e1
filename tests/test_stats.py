"""FusionStats are exact under the traffic model: inputs read once, outputs written once."""

from __future__ import annotations

import pytest
import torch

import rtxdsl as rx

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
