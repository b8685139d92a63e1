"""Column reductions computed by a row kernel (``rtxdsl/lower/columns.py``): a norm's weight and
bias gradients accumulated by its input gradient's programs over their rows, their partial states
merged by a small kernel, as Liger-Kernel's norm backward kernels do; x and dy read once.

GPU-shaped programs run under the interpreter with ``SMALL`` (4 SMs: several programs, each
looping over several blocks of rows); ``GPU`` (sm_90) programs are counted without running.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import FLOAT_TOLERANCES, assert_close
from test_gpu_shapes import AT_SMALL, SMALL

import rtxdsl as rx
from rtxdsl.lower import GPU
from rtxdsl.lower.spec import Split

x, w, b = rx.var("x"), rx.var("w"), rx.var("b")

# name: (expression, its inputs, the torch reference)
NORMS = {
    "rms_norm": (lambda: rx.rms_norm(x, w), "xw", lambda t: F.rms_norm(t["x"], t["x"].shape[-1:], t["w"], 1e-6)),
    "layer_norm": (
        lambda: rx.layer_norm(x, w, b),
        "xwb",
        lambda t: F.layer_norm(t["x"], t["x"].shape[-1:], t["w"], t["b"]),
    ),
    "layer_norm_no_bias": (
        lambda: rx.layer_norm(x, w),
        "xw",
        lambda t: F.layer_norm(t["x"], t["x"].shape[-1:], t["w"]),
    ),
}
# (37, 50): ten row blocks on SMALL's 8 programs, some looping twice, an odd width; (3, 5, 24): rows
# over two dims; (1, 40): one row, one program; (0, 16): no rows (zero weight gradients)
SHAPES = [(37, 50), (3, 5, 24), (1, 40), (0, 16)]


def _merges(program) -> bool:
    """Does a row kernel compute column reductions, a merge (a launch, or its tail) finish them?"""
    calls = list(program.launched)
    merge = [c.tail if c.tail is not None else c for c in calls if c.spec.split is Split.MERGE or c.tail is not None]
    return any(c.spec.columns for c in calls) and [c.spec.split for c in merge] == [Split.MERGE]


def _backward(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator):
    """The norm's backward kernel and its inputs (the forward's statistics), and float64 truth."""
    expr, names, ref = NORMS[name]
    base = {"x": torch.randn(shape, generator=gen, dtype=torch.float64)}
    base |= {n: torch.randn(shape[-1], generator=gen, dtype=torch.float64) for n in names[1:]}
    ins = {n: t.to(dtype).requires_grad_() for n, t in base.items() if n in names}
    plan = rx.compile(expr()).grad_plan(**ins)
    g = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    feed = {n: t.detach() for n, t in ins.items()} | dict(plan.forward(**ins)) | {"_g0": g}
    truth = {n: t.detach().double().requires_grad_() for n, t in ins.items()}
    ref(truth).backward(g.double())
    want = {key: truth[n].grad for n, key in plan.grads.grad_of}
    return plan.backward, {n: feed[n] for n in plan.backward.inputs}, want


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", NORMS)
@pytest.mark.parametrize("dtype,atol,rtol", FLOAT_TOLERANCES, ids=lambda v: str(v).replace("torch.", ""))
def test_norm_gradients_read_x_and_dy_once(name, shape, dtype, atol, rtol, gen):
    kernel, feed, want = _backward(name, shape, dtype, gen)
    trace = rx.memory_trace(kernel, **feed, **AT_SMALL)
    for key, ref in want.items():
        assert_close(trace.result[key], ref, atol, rtol, f"{name} {key}")
    if math.prod(shape):
        # the row kernel (programs looping over their rows) and the merge of its partials (run by
        # its last program where one program merges them all)
        assert _merges(kernel.lower_for(SMALL, **feed)), trace.table()
        assert trace.re_read == 1.0, trace.table()
        assert abs(trace.model_bytes - trace.traced_bytes) <= 0.1 * trace.traced_bytes, trace.table()


def test_column_reductions_of_a_forward_row_kernel(gen):
    """amax / amin / sum over the rows beside a softmax over the columns: one read of x, NaN and
    inf where torch has them (the lanes' NaN wins, as in a row's max)."""
    k = rx.compile({"y": rx.softmax(x), "hi": rx.amax(x, 0), "lo": rx.amin(x, 0), "s": rx.sum(x * 2, 0)})
    t = torch.randn(37, 50, generator=gen, dtype=torch.float64) * 10
    t[3, 4], t[1, 2], t[30, 2] = float("nan"), float("inf"), float("-inf")
    trace = rx.memory_trace(k, x=t, **AT_SMALL)
    want = {"y": torch.softmax(t, -1), "hi": t.amax(0), "lo": t.amin(0), "s": (t * 2).sum(0)}
    for key, ref in want.items():
        assert_close(trace.result[key], ref, 1e-12, 1e-12, key)
    assert _merges(k.lower_for(SMALL, x=t)) and trace.re_read == 1.0, trace.table()


def test_merged_partials_are_bit_stable(gen):
    """Each program's rows in a fixed order, its partials merged in a fixed order: the same bits."""
    kernel, feed, _ = _backward("layer_norm", (37, 50), torch.float32, gen)
    first = rx.memory_trace(kernel, **feed, **AT_SMALL).result
    again = rx.memory_trace(kernel, **feed, **AT_SMALL).result
    assert all(torch.equal(first[k], again[k]) for k in first)


@pytest.mark.parametrize("name", NORMS)
def test_gpu_plan_moves_the_minimum_at_4096_squared(name):
    """sm_90, bf16 4096 x 4096: two launches (it was three: dx, then dW's split column kernels
    reading x and dy again) moving the minimum bytes and the partial states (264 programs x 4096
    floats per reduction, written once and read once: 8.6 MB a reduction, where x and dy again
    were 64 MB), every gradient in its input's dtype."""
    expr, names, _ = NORMS[name]
    big = {n: torch.empty((4096, 4096) if n == "x" else (4096,), dtype=torch.bfloat16) for n in names}
    plan = rx.compile(expr()).grad_plan(**{n: t.requires_grad_() for n, t in big.items()})
    feed = {n: t.detach() for n, t in big.items()} | {"_g0": torch.empty(4096, 4096, dtype=torch.bfloat16)}
    feed |= {k: torch.empty(4096, 1) for k in plan.grads.saved_keys}
    program = plan.backward.lower_for(GPU, **{n: feed[n] for n in plan.backward.inputs})
    rows, merge = program.launched
    assert rows.grid == (GPU.waves,) and rows.spec.columns and merge.spec.split is Split.MERGE
    partials = len(rows.spec.columns) * GPU.waves * 4096 * 4
    assert program.kernels_launched == 2 and program.bytes_moved == program.minimum_bytes + 2 * partials
    assert set(merge.reads) == {0}  # the merge reads the partial states only
    assert all(program.buffers[s - program.n_inputs].dtype == torch.bfloat16 for _, s in program.outputs)


def test_generated_row_kernel_loops_over_rows_with_its_weight_loaded_once(gen):
    """One loop over blocks of rows; the weight (one value per column) loaded before it, x and dy
    inside it; each column reduction's partial stored after it."""
    kernel, feed, _ = _backward("rms_norm", (37, 50), torch.bfloat16, gen)
    source = kernel.sources(**feed)[0]
    head, loop = source.split("for row_block in range(pid, tl.cdiv(n_rows, ROWS), tl.num_programs(0)):")
    body, after = loop.split("n_part = tl.num_programs(0) * n_cols")
    assert "w = tl.load(w_ptr + cols, mask=col_mask" in head
    assert body.count("tl.load(") == 3 and body.count("tl.store(") == 1  # dy, x, the row's rstd; dx
    assert after.count("tl.store(part") == 1 and "tl.load(" not in after


def test_rows_too_long_to_keep_whole_keep_their_column_kernel(gen):
    """A looped row (longer than SMALL's 64-wide block) spans several blocks: its column reductions
    stay a kernel of their own (lanes cannot span the row), and agree all the same."""
    kernel, feed, want = _backward("layer_norm", (3, 301), torch.float32, gen)
    trace = rx.memory_trace(kernel, **feed, **AT_SMALL)
    assert "merge" not in [t.split for t in trace.launches], trace.table()
    for key, ref in want.items():
        assert_close(trace.result[key], ref, 1e-5, 1e-5, key)


@pytest.mark.parametrize("shape", [(4, 6), (37, 9)])  # one block of rows; several
def test_a_column_sum_whose_merge_would_read_every_element_keeps_its_own_kernel(shape, gen):
    """``d/dx0 (sum(x0) + sum(x2 * x0))`` over lazy tensors: the backward's column sum of ``g * x2``
    is followed by ``+ g`` with ``g`` the broadcast scalar cotangent, a value of every element in
    the row kernel, which the merge of partial states has no coordinates for (it crashed in codegen,
    StopIteration in ``CoordWriter._domain``: lazy fuzzer seed 20261311, program 2026131100023).
    That column group keeps its own kernel (``columns._merge_reads_elements``); values and both
    gradients as eager's."""
    rows, cols = shape
    t0 = torch.randn(1, cols, generator=gen).requires_grad_()
    t2 = torch.randn(rows, 1, generator=gen).requires_grad_()
    f = rx.Fusion()
    x0, x2 = f.lazy(t0 * 1), f.lazy(t2 * 1)
    v = x2 * x0  # recorded first: the column group reads the row kernel's product
    got = torch.autograd.grad(x0.sum() + v.sum(), (t0, t2))
    want = torch.autograd.grad(t0.sum() + (t2 * t0).sum(), (t0, t2))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.torch() if isinstance(a, rx.LazyTensor) else a, b, atol=1e-5, rtol=1e-5)
