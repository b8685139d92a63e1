"""The lazy stream: torch code on LazyTensors equals eager torch, with fewer launches."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import rtxdsl as rx


@pytest.fixture
def f():
    return rx.Fusion()


def test_contract_example(f, gen):
    ta, tb = torch.randn(5, 7, generator=gen), torch.randn(5, 7, generator=gen)
    a, b = f.lazy(ta), f.lazy(tb)
    c = torch.relu((a + b) * a)
    assert f.pending == 3
    assert c.shape == (5, 7) and c.dtype == torch.float32 and c.device.type == "cpu" and c.ndim == 2
    assert f.pending == 3  # metadata does not flush
    assert torch.equal(c.torch(), torch.relu((ta + tb) * ta))
    s = f.stats()
    assert (s.kernels_launched, s.fused_executions, s.kernel_launches_saved) == (1, 1, 2)
    assert f.pending == 0


def test_default_stream_and_global_stats(gen):
    rx.sync()
    rx.reset_fusion_stats()
    t = torch.randn(9, generator=gen)
    y = torch.sigmoid(rx.lazy(t) * 2 + 1)
    rx.sync()
    assert torch.allclose(y.torch(), torch.sigmoid(t * 2 + 1))
    assert rx.fusion_stats().kernel_launches_saved == 2


def test_methods_operators_functional_and_reductions(f, gen):
    t = torch.randn(6, 33, generator=gen)
    w, b = torch.randn(33, generator=gen), torch.randn(33, generator=gen)

    def prog(x):
        h = F.layer_norm(x, (33,), w, b)
        h = F.gelu(h, approximate="tanh") * 0.5 - x.abs().sqrt()
        s = torch.softmax(h * 0.125, dim=-1)
        return {
            "s": s,
            "lse": h.logsumexp(-1),
            "v": h.var(-1, keepdim=True),
            "m": h.mean(),
            "c": (h > 0).float(),
            "r": 2.0 - h / 3,
            "mx": torch.maximum(h, x),
            "cl": h.clamp(min=-0.1),
        }

    want = prog(t)
    got = prog(f.lazy(t))
    f.sync()
    for k, v in want.items():
        torch.testing.assert_close(got[k].torch(), v, atol=1e-5, rtol=1e-5, msg=k)


def test_matmul_joins_the_segment_with_its_epilogue(f, gen):
    x, w = torch.randn(4, 8, generator=gen), torch.randn(8, 3, generator=gen)
    a = f.lazy(x)
    y = torch.relu(a * 2) @ w + 1
    assert isinstance(y, rx.LazyTensor) and y.is_pending
    assert torch.allclose(y.torch(), torch.relu(x * 2) @ w + 1)
    assert "segment closed by: data access" in f.explain()
    # one GEMM: relu(a * 2) computed as its A operand loads (a prologue), + 1 in its epilogue
    assert f.stats().kernels_launched == 1
    assert "recomputed at load" in f.explain()


def test_unsupported_and_random_ops_run_eagerly(f, gen):
    x = torch.randn(4, 8, generator=gen)
    a = f.lazy(x)
    cs = torch.cumsum(a + 1, dim=1)  # unsupported: sync point
    assert torch.allclose(cs.torch(), torch.cumsum(x + 1, dim=1))
    r = torch.rand_like(a)  # random: eager
    assert r.shape == (4, 8)
    vals, idx = torch.max(a, dim=1)  # tuple results wrap again
    assert torch.equal(vals.torch(), x.max(1).values) and torch.equal(idx.torch(), x.max(1).indices)


def test_kept_intermediates_are_written_dropped_ones_are_not(f, gen):
    x = torch.randn(1000, generator=gen)
    a = f.lazy(x)
    h = a * 2 + 1  # kept
    y = torch.exp(h) - 1
    f.sync()
    s = f.stats()
    assert s.kernels_launched == 1 and s.bytes_moved == 3 * 4000  # read x, write h and y
    assert torch.allclose(h.torch(), x * 2 + 1) and torch.allclose(y.torch(), torch.exp(x * 2 + 1) - 1, atol=1e-6)
    f.reset_stats()
    z = torch.exp(f.lazy(x) * 2 + 1) - 1  # the intermediate is not held
    f.sync()
    assert f.stats().bytes_moved == 2 * 4000 and torch.allclose(z.torch(), torch.exp(x * 2 + 1) - 1, atol=1e-6)


def test_inplace_ops_and_aliasing_match_eager(f, gen):
    base = torch.randn(6, generator=gen)
    t_eager, t_lazy = base.clone(), base.clone()
    view_eager, view_lazy = t_eager[:3], t_lazy[:3]

    def prog(t, lazy):
        a = f.lazy(t) if lazy else t
        b = a * 2  # a pending reader of t
        a.add_(1)
        a.mul_(3)
        a += b
        c = a.sigmoid()
        return b, c

    b_e, c_e = prog(t_eager, False)
    b_l, c_l = prog(t_lazy, True)
    f.sync()
    assert torch.allclose(b_l.torch(), b_e) and torch.allclose(c_l.torch(), c_e)
    assert torch.allclose(t_lazy, t_eager) and torch.allclose(view_lazy, view_eager)


def test_views_of_materialized_values_are_free(f, gen):
    x = torch.randn(4, 6, generator=gen)
    a = f.lazy(x)
    y = a.view(2, 12).t().unsqueeze(0) * 2
    assert f.pending == 1
    assert torch.equal(y.torch(), x.view(2, 12).t().unsqueeze(0) * 2)
    z = (a + 1).reshape(24)  # a view of a pending value flushes it first
    assert torch.equal(z.torch(), (x + 1).reshape(24))


def test_queue_cap_flushes(gen):
    f = rx.Fusion(rx.FusionConfig(max_queued_ops=4))
    a = f.lazy(torch.ones(3))
    for _ in range(9):
        a = a + 1
        assert f.pending < 4
    assert a.torch().tolist() == [10.0, 10.0, 10.0]


def test_nn_module_on_lazy_inputs_transformer_block(f, gen):
    torch.manual_seed(0)
    ln, l1, l2 = torch.nn.LayerNorm(32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
    x = torch.randn(8, 32, generator=gen)

    def block(x):
        h = l2(F.gelu(l1(ln(x))))
        return torch.softmax(h + x, dim=-1)

    with torch.no_grad():
        want = block(x)
        got = block(f.lazy(x)).torch()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    s = f.stats()
    eager = s.kernels_launched + s.kernel_launches_saved
    assert eager == 6  # layer_norm, linear, gelu, linear, add, softmax
    assert s.kernels_launched == 4  # layer_norm; GEMM + bias + gelu; GEMM + bias + residual; softmax


def test_steady_loop_plans_once_and_stays_bounded(gen):
    f = rx.Fusion()
    p = torch.randn(64, generator=gen)
    m = torch.zeros(64)
    for step in range(100):
        g = torch.randn(64, generator=gen)
        lp, lm = f.lazy(p), f.lazy(m)
        lm.mul_(0.9).add_(f.lazy(g) * 0.1)
        lp.sub_(lm * 0.01)
        f.sync()
        if step == 1:
            plans, entries = f.plans, rx.cache_stats().entries
    assert f.plans == plans and rx.cache_stats().entries == entries
    assert f.pending == 0 and all(not s.leaves and not s.holders for s in f._streams.values())


def test_logging(f, caplog, gen):
    with caplog.at_level(logging.INFO, logger="rtxdsl"):
        (f.lazy(torch.ones(3)) * 2).torch()
    assert any("flush" in r.message for r in caplog.records)


def test_errors_surface_at_record_time(f):
    """torch's own error, at the statement that raises it (the call runs eagerly to say so)."""
    a = f.lazy(torch.ones(3))
    with pytest.raises(RuntimeError, match="must match the size"):
        a + f.lazy(torch.ones(4))
    with pytest.raises(rx.RtxError):
        rx.LazyTensor()


def test_inplace_update_fuses_and_lands_in_the_tensor(f, gen):
    p, m, g = (torch.randn(257, generator=gen) for _ in range(3))
    p0, m0 = p.clone(), m.clone()
    lm = f.lazy(m)
    lm.mul_(0.9).add_(f.lazy(g) * 0.1)
    f.lazy(p).sub_(lm * 0.01)  # nobody holds this lazy tensor: the write still lands
    f.sync()
    want_m = m0 * 0.9 + g * 0.1
    assert torch.allclose(m, want_m) and torch.allclose(p, p0 - want_m * 0.01)
    s = f.stats()
    # one fused update that writes both results into their tensors (no write-back copies)
    assert s.kernels_launched == 1 and s.fused_executions == 1
    assert s.bytes_moved == 5 * 257 * 4  # reads p, m, g; writes p, m


def test_reading_another_view_of_a_pending_write_flushes_first(f):
    t = torch.zeros(4)
    f.lazy(t).add_(1)
    y = f.lazy(t[:2]) * 3  # aliases t: must see the write
    assert y.torch().tolist() == [3.0, 3.0]
    z = f.lazy(t) + 1  # t itself after the write
    assert z.torch().tolist() == [2.0, 2.0, 2.0, 2.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_softmax_with_a_dtype_is_recorded(f, dtype, gen):
    """``F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)``, as Hugging Face's eager attention
    writes it: the input cast first, in the stream (it closed the segment: "unsupported arguments
    of softmax")."""
    t = torch.randn(5, 7, generator=gen).to(dtype)
    w = f.lazy(t) * 0.5
    s = F.softmax(w, dim=-1, dtype=torch.float32).to(dtype)
    ls = w.log_softmax(0, dtype=torch.float32)
    assert f.pending == 4 and s.is_pending  # mul, softmax (its cast inside), the cast back, log_softmax
    torch.testing.assert_close(s.torch(), F.softmax(t * 0.5, dim=-1, dtype=torch.float32).to(dtype))
    torch.testing.assert_close(ls.torch(), (t * 0.5).log_softmax(0, dtype=torch.float32))
    assert f.stats().kernels_launched == 1  # the softmax over rows, the log_softmax over columns: one kernel


def test_eval_dropout_contiguous_and_unsqueeze_of_pending_values_do_not_flush(f, gen):
    t = torch.randn(4, 6, generator=gen)
    a = f.lazy(t)
    s = F.dropout(torch.softmax(a, -1), 0.1, training=False).contiguous().sum(-1).unsqueeze(1) + a
    assert f.pending == 4 and s.shape == (4, 6)  # softmax, sum, unsqueeze, add (the rest are identities)
    torch.testing.assert_close(s.torch(), torch.softmax(t, -1).sum(-1).unsqueeze(1) + t)
    assert f.stats().kernels_launched == 1  # unsqueeze of a per-row value stays in the row kernel
    d = F.dropout(f.lazy(t), 0.5, training=True)  # random: fused, Philox in the kernel
    assert d.shape == (4, 6) and d.is_pending
    kept = d.torch() != 0
    torch.testing.assert_close(d.torch()[kept], t[kept] * 2)


def test_inplace_write_to_a_tensor_with_pending_readers_is_a_sync_point(f):
    t = torch.ones(3)
    a = f.lazy(t)
    b = a * 2  # reads t
    assert f.pending == 1
    a.add_(1)
    assert not b.is_pending and b.torch().tolist() == [2.0, 2.0, 2.0]
    assert "in-place write to a tensor with pending readers" in f.explain()
    f.sync()
    assert t.tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("shape", [(), (1,)])  # 0-dim: amax over dim -1 is the value itself (one node)
def test_a_value_equal_to_an_in_place_result_is_a_tensor_of_its_own(f, shape):
    """``m = x.amax(-1)`` after ``x.mul_(...)`` is the same node as x's pending value: the flush
    writes x's tensor, and m must not be that tensor (x's next in-place write would change it).
    Found by the lazy fuzzer (seed 25386736000047)."""
    t = torch.full(shape, -0.8)
    x = f.lazy(t)
    x.mul_(0.25)
    m = x.amax(-1, keepdim=True)
    x.torch()  # the flush: both land
    x.sub_(x * x, alpha=2)
    torch.testing.assert_close(m.torch(), torch.full(shape, -0.2))
    torch.testing.assert_close(x.torch(), torch.full(shape, -0.28))


def test_outputs_that_are_one_node_are_two_tensors():
    """Two keys whose expressions simplify to one node get a tensor each (eager's two results are
    two), the copy counted as a launch."""
    x = rx.var("x")
    k = rx.compile({"a": x * 2, "b": rx.amax(x * 2, -1, keepdim=True), "c": x * 2})
    rx.reset_fusion_stats()
    out = k(x=torch.tensor(1.5))
    assert len({id(v) for v in out.values()}) == 3
    assert rx.fusion_stats().kernels_launched == k.launches(x=torch.tensor(1.5)) + 2
    out["a"].add_(1)
    assert out["b"].item() == out["c"].item() == 3.0


def test_slices_joins_gathers_and_cross_entropy_are_recorded(f, gen):
    t = torch.randn(6, 10, generator=gen)
    target = torch.randint(0, 5, (6,), generator=gen)
    a = f.lazy(t)  # materialized: its slices are free views, the ops over them are recorded
    half = torch.cat((-a[:, 5:], a[:, :5]), dim=-1) + torch.flip(a, (-1,))
    picked = torch.gather(half, 1, target[:, None]) + torch.narrow(a, 1, 2, 1)
    loss = F.cross_entropy(torch.narrow(a, 1, 0, 5) * 2, target)
    assert half.is_pending and picked.is_pending and loss.is_pending
    want_half = torch.cat((-t[:, 5:], t[:, :5]), -1) + t.flip(-1)
    torch.testing.assert_close(half.torch(), want_half)
    torch.testing.assert_close(picked.torch(), want_half.gather(1, target[:, None]) + t[:, 2:3])
    torch.testing.assert_close(loss.torch(), F.cross_entropy(t[:, :5] * 2, target))


@pytest.mark.parametrize("write", ["base", "view", "chunks"])
def test_views_see_inplace_writes_as_in_eager(f, gen, write):
    """A recorded unsqueeze of a pending value, and views of a flushed one, read stale values after
    a deferred in-place write to their base (lazy fuzzer, seed 31); they alias it as in eager now."""
    t = torch.randn(3, 5, generator=gen)
    v, w = f.lazy(t).abs(), t.abs()
    if write == "chunks":
        got, want = v.chunk(2, -1), w.chunk(2, -1)
        v.add_(1)
        w.add_(1)
    else:
        got, want = (v.unsqueeze(0),), (w.unsqueeze(0),)
        (v if write == "base" else got[0]).add_(1.5)
        (w if write == "base" else want[0]).add_(1.5)
    for g, e in zip(got, want):
        torch.testing.assert_close(g.torch(), e)
    torch.testing.assert_close(v.torch(), w)


@pytest.mark.parametrize(
    "make",
    [
        lambda g: torch.randn(3, 5, 7, generator=g).transpose(0, 2),  # a permuted dense layout
        lambda g: torch.randn(2, 4, 3, 6, generator=g).transpose(1, 2),  # heads moved, as q/k in attention
        lambda g: torch.randn(6, 5, generator=g).t()[:, :1],  # a size-1 dim: strides still eager's
    ],
)
def test_values_eager_lays_out_permuted_are_computed_in_that_order_not_copied(f, gen, make):
    t = make(gen)
    want = t * 2 + torch.sin(t)
    got = (f.lazy(t) * 2 + torch.sin(f.lazy(t))).torch()

    def layout(x):  # strides of size-1 dims mean nothing (torch itself treats them as free)
        return [s for s, n in zip(x.stride(), x.shape) if n > 1]

    assert layout(got) == layout(want)
    assert got.is_contiguous() == want.is_contiguous()
    torch.testing.assert_close(got, want)
    assert f.stats().kernels_launched == 1  # the kernel writes eager's memory order: no restriding copy


def test_a_permuted_result_made_without_grad_can_be_written_with_grad(f, gen):
    """A value eager lays out permuted is a view of the kernel's memory: made under no_grad, it may
    still be written in place where grad is on, as eager's (no view at all) may (lazy fuzzer, seed
    2026161600169: 'a view was created in no_grad mode and is being modified inplace')."""
    t = torch.randn(2, 3, generator=gen).t().contiguous().t().requires_grad_()  # column-major
    with torch.no_grad():
        got, want = f.lazy(t) * 0.5, t * 0.5
    got.copy_(f.lazy(t))
    want.copy_(t)
    assert got.torch().requires_grad and want.requires_grad
    torch.testing.assert_close(got.torch(), want)
    plain = torch.randn(2, 3, generator=gen).t().contiguous().t()
    out = (f.lazy(plain) * 0.5).torch()
    out.add_(t)  # a result without history, written with one
    torch.testing.assert_close(out, plain * 0.5 + t)


def test_a_flushed_result_has_contiguous_strides_along_its_size_one_dims(f):
    """Outputs are allocated contiguous, not with an input's own strides along its size-1 dims
    (``torch.zeros(6, 1).t()`` has strides (1, 1); eager's sigmoid of it (6, 1)), so stride() is
    the same before and after the flush (lazy fuzzer, seeds 2026163000097, 2026163300039)."""
    t = torch.zeros(6, 1).t()
    y = torch.sigmoid(f.lazy(t))
    pending = y.stride()
    assert y.torch().stride() == pending == torch.sigmoid(t).stride()


def test_rtxdsl_kernels_join_the_lazy_segment(f, gen):
    """An rtxdsl kernel (here an rx.nn module) called on lazy tensors records its expression: one
    kernel with what is pending, no sync; with gradients on, it runs on materialized operands."""
    t = torch.randn(3, 8, generator=gen)
    norm = rx.nn.RMSNorm(8)
    with torch.no_grad():
        y = norm(f.lazy(t) * 2) + 1
        assert y.is_pending and f.stats().kernels_launched == 0
        torch.testing.assert_close(y.torch(), torch.nn.functional.rms_norm(t * 2, (8,), norm.weight) + 1)
    assert f.stats().kernels_launched == 1
    k = rx.compile({"a": rx.var("x") + 1, "b": rx.var("x") * rx.var("s")})
    out = k(x=f.lazy(t), s=2.0)
    assert out["a"].is_pending and out["b"].is_pending
    torch.testing.assert_close(out["b"].torch(), t * 2)
    y = norm(f.lazy(t))  # the weight requires grad: the kernel runs eagerly, autograd intact
    assert not y.is_pending and y.torch().requires_grad


def test_views_of_pending_values_stay_in_the_segment(f, gen):
    """``view`` / ``reshape`` / ``transpose`` / ``permute`` / ``t`` / ``.mT`` of a pending value are
    recorded (a causal LM's ``logits.view(-1, V)`` before its loss, attention's ``view(...)
    .transpose(1, 2)``): one segment, values as eager's."""
    x, w = torch.randn(2, 5, 8, generator=gen), torch.randn(11, 8, generator=gen)
    t = torch.randint(0, 11, (10,), generator=gen)
    h = f.lazy(x)
    logits = F.linear(h, w)
    loss = F.cross_entropy(logits.view(-1, 11), t)
    heads = (h * 2).view(2, 5, 2, 4).transpose(1, 2).permute(0, 1, 3, 2).reshape(2, 2, 20)
    flat = (h + 1).reshape(10, 8).t() @ torch.ones(10, 3)
    mt = (h - 1).mT.sum(-1)
    want = {
        "loss": F.cross_entropy(F.linear(x, w).view(-1, 11), t),
        "heads": (x * 2).view(2, 5, 2, 4).transpose(1, 2).permute(0, 1, 3, 2).reshape(2, 2, 20),
        "flat": (x + 1).reshape(10, 8).t() @ torch.ones(10, 3),
        "mt": (x - 1).mT.sum(-1),
    }
    got = {"loss": loss, "heads": heads, "flat": flat, "mt": mt}
    assert all(v.is_pending for v in got.values())
    f.sync()
    assert f.stats().calls == 1  # one segment: no view closed it
    for k, v in want.items():
        torch.testing.assert_close(got[k].torch(), v, atol=1e-5, rtol=1e-5, msg=k)


def test_a_reshape_eager_copies_is_a_value_of_its_own(f, gen):
    """``reshape`` of a value whose eager layout is not contiguous copies in eager: writing into
    the copy leaves the value alone (a view of the same layout would write through); ``view``
    of it raises in torch, and so it does here."""
    x = torch.randn(4, 6, generator=gen)
    a = f.lazy(x)
    y = a.mT * 2  # eager keeps the transposed layout
    r = y.reshape(-1)
    y.add_(1.0)  # no view of y exists (r is a copy): the write is recorded, nothing flushes
    r.add_(100.0)
    assert y.is_pending and r.is_pending and f.stats().calls == 0
    torch.testing.assert_close(y.torch(), x.mT * 2 + 1.0)
    torch.testing.assert_close(r.torch(), (x.mT * 2).reshape(-1) + 100.0)
    z = f.lazy(x) * 3  # contiguous: the reshape is a view, a write goes through
    v = z.view(-1)
    v.add_(1.0)
    torch.testing.assert_close(z.torch(), x * 3 + 1.0)
    with pytest.raises(RuntimeError):
        (f.lazy(x).mT * 2).view(-1)


def test_writes_through_detached_and_reshaped_aliases_reach_the_value(f, gen):
    """``v.detach()`` and ``v.detach().reshape(-1)`` of a pending value share its memory, as in
    eager: writes through them change ``v`` (a detach is not a copy although torch does not call
    it a view). From the commit-seeded lazy fuzzer."""
    x = torch.randn(2, 7, generator=gen)

    def prog(t):
        v = t.sign()
        d = v.detach()
        r = d.reshape(-1)
        r.neg_()
        d -= 0.5
        return v

    torch.testing.assert_close(prog(f.lazy(x.clone())).torch(), prog(x.clone()))


def test_an_in_place_result_reports_its_tensors_strides(f):
    """A pending in-place write lands in its tensor: ``stride()`` is that tensor's exactly (a
    size-1 dim keeps its stride), before and after the flush. From the lazy fuzzer, seed 13."""
    t = torch.zeros(1, 4).t()  # [4, 1] with strides (1, 4)
    a = f.lazy(t)
    a.abs_()
    assert a.stride() == (1, 4)
    a.abs_()
    f.sync()
    assert a.stride() == (1, 4)


def test_a_write_into_a_tensor_with_views_the_stream_never_saw_runs_eagerly(f, gen):
    """A plain view made before the stream met its tensor cannot be intercepted when read: a
    write landing in that memory runs eagerly, so the view reads the new values (it read the old
    ones, silently: lazy fuzzer seed 13). A tensor nothing else holds still takes recorded writes."""
    p = torch.full((2, 7), 1.5)
    before = torch.flatten(p)  # a plain view, made before any lazy op touched p
    x = f.lazy(torch.randn(2, 7, generator=gen))
    p.add_(x.sign())
    torch.testing.assert_close(before + before, (p + p).flatten())
    lone = torch.zeros(3)
    a = f.lazy(lone)
    a.add_(f.lazy(torch.ones(3)) * 2)
    assert a.is_pending  # recorded: nothing else shares its memory
    torch.testing.assert_close(lone, torch.full((3,), 2.0))


@pytest.mark.parametrize("view", ["T", "mT", "H", "mH"])
def test_a_write_through_a_property_view_made_after_the_read_flushes_first(f, view):
    """``t.T`` (a property: a torch function sees its getter) of a plain tensor pending ops read is
    a view of it like ``t.t()``: the guard flushes before the view is made, so a write through it
    lands after the read, as in eager (it raised 'a view the lazy stream never saw (made before the
    tensor was read)', the view having been made after: lazy fuzzer seed 20261317, program
    2026131700090)."""
    p = torch.full((4, 1), 1.5)
    v = f.lazy(torch.ones(4, 1)) * p
    w = getattr(p, view)
    w += w
    torch.testing.assert_close(v.torch(), torch.full((4, 1), 1.5))
    torch.testing.assert_close(p, torch.full((4, 1), 3.0))


# ---- autograd through the stream: what a backward saves, requires_grad (issue 33, items 7 and 8) ----
def _grads_both(f, prog, *shapes, frozen=()):
    """``prog`` run eagerly and on lazy inputs, then backward of the sum of its result: the
    input gradients of both runs (each on its own leaves)."""
    torch.manual_seed(0)
    leaves = [torch.randn(*s, requires_grad=True) for s in shapes]
    got = []
    for lazy in (False, True):
        xs = [t.detach().clone().requires_grad_() for t in leaves]
        out = prog(*[f.lazy(x) if lazy else x for x in xs], *frozen)
        loss = out.sum()
        (loss.torch() if isinstance(loss, rx.LazyTensor) else loss).backward()
        got.append([x.grad for x in xs])
    return got


def test_a_write_to_a_kernel_input_its_backward_does_not_read_is_no_error(f):
    """A kernel's autograd function saves only the inputs its backward reads (a product with a
    frozen weight keeps the weight, not its input), as eager saves per op: an in-place write to
    the others after the kernel ran is no error (it was one: the input was saved and then written)."""
    w = torch.randn(6, 4)

    def linear_then_write(x, w):
        o = x * 1.0
        o = o.torch() if isinstance(o, rx.LazyTensor) else o  # materialized: the product reads it
        h = F.linear(o, w) + o.sum(-1, keepdim=True) * 0
        h = h.torch() if isinstance(h, rx.LazyTensor) else h
        o.add_(1)  # eager: mm saved w alone, sum saved nothing
        return h

    def scaled_then_zeroed(x, w):
        o = x * 1.0
        o = o.torch() if isinstance(o, rx.LazyTensor) else o
        h = o * 3.0
        h = h.torch() if isinstance(h, rx.LazyTensor) else h
        o.zero_()
        return h

    for prog in (linear_then_write, scaled_then_zeroed):
        want, got = _grads_both(f, prog, (3, 4), frozen=(w,))
        torch.testing.assert_close(got, want)
    k = rx.compile(rx.var("x") * rx.var("w"))  # a kernel called directly: the same rule
    x = torch.randn(5, requires_grad=True)
    h = x * 1.0
    y = k(x=h, w=torch.full((5,), 2.0))
    h.add_(1)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((5,), 2.0))


def test_a_backward_reads_what_its_forward_read_when_the_stream_writes_it_later(f):
    """rtxdsl's backward recomputes from a kernel's inputs where eager's ops save their results or
    a copy of what they overwrite: the stream copies a saved input before it writes its memory
    (the issue's program: ``o += g * u`` lands in ``o``, which the kernel computing ``silu(o)``
    read and saved)."""
    w = torch.randn(16, 8)

    def issue(x, w):
        o = x * 1.5
        g, u = F.linear(o, w).chunk(2, -1)
        o += g * u
        return F.silu(o)

    def sigmoid_then_write(x, w):
        o = x * 1.0
        o = o.torch() if isinstance(o, rx.LazyTensor) else o
        y = torch.sigmoid(o)
        y = y.torch() if isinstance(y, rx.LazyTensor) else y
        o += 1  # eager: sigmoid saved its result
        return y

    def mul_by_a_tensor_that_needs_grad(x, w):
        m = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
        m = f.lazy(m) if isinstance(x, rx.LazyTensor) else m
        m.mul_(x)  # eager keeps the original m for x's gradient
        return m * 2.0

    for prog in (issue, sigmoid_then_write, mul_by_a_tensor_that_needs_grad):
        want, got = _grads_both(f, prog, (4, 8), frozen=(w,))
        torch.testing.assert_close(got, want)


def test_a_write_the_stream_never_sees_still_fails_at_the_backward(f):
    """After the flush the tensor is plain: a plain write to it is autograd's business, and the
    backward raises autograd's error, as eager's does for ``sin`` (it saves its input)."""
    x = torch.randn(5, requires_grad=True)
    o = x * 1.0
    y = f.lazy(o).sin().torch()
    o.add_(1)  # plain torch on a plain tensor: not through the stream
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize(
    "prog, write",
    [
        (lambda x, p: torch.where(x > p, x, p), lambda p: p.zero_()),  # eager saves the mask
        (lambda x, p: torch.relu(x - p), lambda p: p.zero_()),  # eager saves relu's result
        (lambda x, p: torch.sigmoid(x + p), lambda p: p.mul_(3)),  # and sigmoid's
        (lambda x, p: torch.sigmoid(x + p), lambda p: p[1:].mul_(3)),  # a view made after the flush
        (lambda x, p: torch.sigmoid(x[1:] + p[1:]), lambda p: p.zero_()),  # the tensor a read view views
    ],
    ids=["where", "relu", "sigmoid", "later-view", "base"],
)
def test_a_plain_tensor_a_kernel_saved_is_copied_before_an_eager_write_after_the_flush(f, prog, write):
    """rtxdsl's backward recomputes from a plain input (a mask, a buffer) that eager's op does not
    save: the tensor stays guarded while the saved value lives, so an eager write made after the
    flush, where no stream sees it, copies the saved value first. It raised autograd's version
    error (lazy fuzzer program 2026131100010); the class is plain again once the backward ran."""
    grads = []
    for lazy in (False, True):
        x = torch.linspace(-2.0, 3.0, 6).requires_grad_()
        p = torch.full((6,), 0.5)
        p[0] = -3.0
        y = prog(f.lazy(x) if lazy else x, p)
        f.sync()
        write(p)
        (y.float().sum() if lazy else y.sum()).backward()
        grads.append(x.grad)
        del y
        assert type(p) is torch.Tensor
    torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize(
    "prog",
    [
        lambda x, p: torch.where(p > x, p, x),  # where saves its mask, a comparison nothing
        lambda x, p: torch.sigmoid(x + p) * 2.0,  # add saves nothing, sigmoid its result
        lambda x, p: torch.tanh(p * 3.0 - x),  # a product with a number saves nothing, tanh its result
    ],
    ids=["where", "add-sigmoid", "scaled-tanh"],
)
def test_a_plain_tensor_that_requires_grad_read_by_ops_eager_saves_nothing_of_may_be_written(f, prog):
    """Eager's backward of these ops keeps none of ``p``'s values, so writing ``p`` in place after
    the flush is no error there; rtxdsl's recomputes from ``p``, so ``p`` (a plain tensor that
    requires grad, never wrapped) is copied before the write as a buffer is (``torchsem.saves``).
    It raised autograd's version error (lazy fuzzer program 2027700900073)."""
    grads = []
    for lazy in (False, True):
        t = torch.linspace(-2.0, 3.0, 6).requires_grad_()
        x = f.lazy(t * 1) if lazy else t * 1
        p = t * 0.5 - 0.25  # a plain tensor with a history
        y = prog(x, p)
        f.sync()
        p.relu_()
        grads.append(torch.autograd.grad(y.float().sum(), t)[0])
        del y
    torch.testing.assert_close(torch.as_tensor(grads[1]), grads[0])


def test_a_plain_tensor_that_requires_grad_read_by_an_op_eager_saves_still_fails_at_the_backward(f):
    """``p * x`` saves ``p`` for ``x``'s gradient: a write to ``p`` after the flush fails, as in eager."""
    for lazy in (False, True):
        t = torch.linspace(-2.0, 3.0, 6).requires_grad_()
        x = f.lazy(t * 1) if lazy else t * 1
        p = t * 0.5
        y = p * x
        f.sync()
        p.relu_()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(y.float().sum(), t)


@pytest.mark.parametrize(
    "shape",
    [
        (4, 1),  # an inner dim of one: both of the operand's strides are 1
        (1, 1),  # one element
        (5, 3),  # an ordinary matrix
    ],
)
def test_an_operand_of_a_recomputed_product_read_at_the_tile_too_gets_one_set_of_strides(f, shape):
    """The backward of ``linear(v, v)`` beside a write to ``v``'s source reads ``v`` as a recomputed
    product's operand and elementwise at the tile: one load, whose stride classes the launch
    took from the product's rule (a ``[4, 1]`` tensor's strides 1 and 1: both strided) and the
    parameters from the tile's (both unit): 'launch values do not match the parameters' (lazy
    fuzzer program 2026151400164). Both now follow the load's own classes."""
    grads = []
    for lazy in (True, False):
        t = torch.randn(shape, generator=torch.Generator().manual_seed(1)).requires_grad_()
        x = f.lazy(t * 1) if lazy else t * 1
        v = x.clone()
        x.div_(v.abs() + 1)
        out = F.linear(v, v) * x.sum()
        grads.append(torch.autograd.grad(out.sum(), (t,))[0])
    torch.testing.assert_close(torch.as_tensor(grads[0]), grads[1])


def test_requires_grad_grad_fn_and_is_leaf_of_pending_values_are_eagers(f):
    """Answered without a flush, and the flushed values agree (no gradient through ``no_grad`` or
    ``detach``: it leaked, the kernel differentiated the whole expression)."""
    w = torch.randn(6, 4, requires_grad=True)

    def param():
        p = torch.ones(4, requires_grad=True)
        p.grad = torch.ones(4)
        return p

    def prog(x, w, p):
        h = F.linear(x, w)
        out = {"h": h, "cmp": h > 0, "sign": h.sign(), "rand": torch.rand_like(h), "max": h.max(-1)}
        out["det"] = h.detach() * 2
        with torch.no_grad():
            out["ng"] = h * 2
            out["ngw"] = F.linear(x, w)
        out["after"] = out["ng"] + 1
        out["branch"] = h * 2 if h.requires_grad else h - 1
        with torch.no_grad():
            p.sub_(0.1 * p.grad)  # an optimizer step: p stays a leaf that requires grad
        out["p"] = p * 1
        return out

    def answers(out):
        vals = [v for o in out.values() for v in (o if isinstance(o, tuple) else (o,))]
        return [(v.requires_grad, v.grad_fn is None, v.is_leaf) for v in vals]

    x = torch.randn(3, 4)
    want = answers(prog(x, w, param()))
    q = param()
    out = prog(f.lazy(x), w, f.lazy(q))
    assert f.pending > 0
    assert answers(out) == want  # pending: no flush
    assert f.pending > 0
    f.sync()
    assert answers(out) == want
    assert q.is_leaf and q.requires_grad and q.grad_fn is None
    node = F.linear(f.lazy(x), w).grad_fn
    assert node is not None and "Backward" in node.name()  # a stand-in until it is used


def test_an_in_place_write_to_a_leaf_that_requires_grad_raises_at_its_statement(f):
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        f.lazy(x).add_(1)
    with torch.no_grad():  # allowed there, as in eager
        f.lazy(x).mul_(2)
    f.sync()
    assert x.requires_grad and x.is_leaf


# ---- the queue cap and plain aliases (issue 33, items 12 and 13) -----------------------------------
def _issue_cap_program(x0):
    v1 = F.layer_norm(x0, (1,), eps=1e-3)
    v3 = v1.unsqueeze(0)
    v3.clamp_(max=0)
    return [v1, v3, v1.clone()]


def _cap_program(x0):
    v1 = F.layer_norm(x0, (1,), eps=1e-3)
    v2 = x0 * 2 + 1
    v3 = v1.unsqueeze(0)
    v3.clamp_(max=0)
    v5 = v2.t()
    v5.mul_(3)
    return [v1, v3, v1.clone(), v2, v5]


@pytest.mark.parametrize("prog", [_issue_cap_program, _cap_program])
@pytest.mark.parametrize("cap", range(1, 7))
def test_the_queue_cap_flushes_between_calls_never_inside_one(prog, cap, gen):
    """The cap's flush waits until the call that reached it is recorded: it came between a view's
    expression and its root being set (the view became a copy, and the next flush crashed on it:
    ``'NoneType' object has no attribute 'is_var'``), or between an in-place op's value and its
    target."""
    x = torch.randn(8, 1, generator=gen)
    f = rx.Fusion(rx.FusionConfig(max_queued_ops=cap))
    want = prog(x.clone())
    got = [v.torch() for v in prog(f.lazy(x.clone()))]
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)
        assert g.stride() == w.stride()


def test_a_plain_tensor_read_then_written_through_a_view_made_before_reads_as_in_eager(f, gen):
    """A read of a plain tensor that a tensor the stream never saw also holds (a view made
    before) is a copy of it: a write through that view cannot change what pending ops read (it
    raised at the flush, 'its old values are gone'); a read after the write sees the new values.
    A tensor nothing else holds is read in place, no copy."""

    def prog(L, p0, x):
        lx = L(x)
        v0 = p0.contiguous().div_(2.0)  # p0 itself
        v2 = v0.select(0, 1)
        c = torch.cat([v0, lx])
        v2.clamp_(-3, 3)
        return c, v0 * 2 + lx, p0

    p0, x = torch.randn(3, 4, generator=gen) * 10, torch.randn(3, 4, generator=gen)
    want = prog(lambda t: t, p0.clone(), x.clone())
    got = prog(f.lazy, p0.clone(), x.clone())
    for w, g in zip(want, got):
        torch.testing.assert_close(g.torch() if isinstance(g, rx.LazyTensor) else g, w)
    f.reset_stats()
    lone = torch.randn(3, 4, generator=gen)
    y = (f.lazy(x) + lone).torch()
    torch.testing.assert_close(y, x + lone)
    assert f.stats().kernels_launched == 1  # no copy


def test_a_failed_flush_raises_once_and_leaves_the_stream_usable(f, gen):
    """A flush is a transaction: an error raised at it (here a gather index out of range, found by
    the kernel's check after its launch) reaches the caller once; every value that flush was to
    compute raises an RtxError naming the failure; the stream runs the next segment as if nothing
    happened; and a tensor the failed segment was to update in place keeps its old values (a
    kernel whose program checks indices never writes into a user tensor)."""
    t, y = torch.randn(3, 5, generator=gen), torch.randn(3, 2, generator=gen)
    y0 = y.clone()
    bad = torch.tensor([[0, 9], [1, 2], [3, 4]])
    a = f.lazy(t)
    f.lazy(y).add_(torch.gather(a * 2, 1, bad))
    beside = a + 1
    with pytest.raises(rx.RtxError, match="index 9 is out of bounds"):
        f.sync()
    assert f.pending == 0
    with pytest.raises(rx.RtxError, match=r"never computed: the flush that was to compute it \(.*\) failed"):
        beside.torch()
    assert torch.equal(y, y0)  # untouched: readable, its old values
    good = torch.tensor([[0, 4], [1, 2], [3, 4]])
    z = torch.gather(f.lazy(t) * 2, 1, good) + f.lazy(y)
    torch.testing.assert_close(z.torch(), torch.gather(t * 2, 1, good) + y0)


def test_a_tensor_a_failed_flush_began_writing_raises_until_overwritten(f, gen, monkeypatch):
    """Where a launch fails after it may have written a user tensor in place, the tensor's values are
    undefined: every torch call on it raises an RtxError that says so (and the error that failed the
    flush carries a note), metadata still answers, and a whole overwrite makes it plain again."""
    import importlib

    lazy = importlib.import_module("rtxdsl.lazy")  # (rx.lazy is the function)
    m = torch.randn(7, generator=gen)
    f.lazy(m).mul_(0.5)

    def launch_fails(kernel, args, grad, fusion, unsaved):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(lazy, "_call", launch_fails)
    with pytest.raises(RuntimeError, match="launch failed") as err:
        f.sync()
    assert any("had begun writing a tensor (float32[7])" in n for n in getattr(err.value, "__notes__", []))
    monkeypatch.undo()
    assert m.shape == (7,) and m.dtype == torch.float32
    with pytest.raises(rx.RtxError, match=r"float32\[7\].*undefined. Overwrite it whole"):
        m + 1
    with pytest.raises(rx.RtxError, match="undefined"):
        f.lazy(m) * 2
    m.fill_(2.0)
    assert type(m) is torch.Tensor and (m + 1).tolist() == [3.0] * 7
    torch.testing.assert_close((f.lazy(m) * 2).torch(), torch.full((7,), 4.0))


@pytest.mark.parametrize("grad_first", [False, True])  # a plain tensor without history; one with history
def test_a_plain_tensor_written_with_operands_that_require_grad_gets_eager_s_history(f, gen, grad_first):
    """``p += x`` (``p`` plain, ``x`` lazy requiring grad) made ``p``'s new values pending and left its
    autograd history as it was: ``p.requires_grad`` stayed False (eager: True) and a plain op reading
    ``p`` after the flush differentiated to nothing (found by the lazy fuzzer, seed 2026150200032).
    Torch writes it now, with the history eager gives it."""
    t = torch.randn(5, generator=gen, requires_grad=True)
    w = torch.randn(5, generator=gen, requires_grad=True)
    results = []
    for lazy in (False, True):
        p = torch.full((5,), 1.5)
        if grad_first:
            p = p * w  # history already: p's grad_fn is a MulBackward
        x = f.lazy(t * 1) if lazy else t * 1
        p += x.exp()
        assert p.requires_grad and p.grad_fn is not None
        y = torch.sin(p).sum()  # a plain op: flushes first, then differentiates through p
        results.append([y.detach(), *torch.autograd.grad(y, (t, w) if grad_first else (t,))])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want)


def test_autocast_casts_as_eager_does(f, gen):
    """Under ``torch.autocast`` a lazy ``linear`` / ``@`` computes in the autocast dtype and a loss in
    float32, as eager's (they were recorded at the operands' float32: every dtype after them
    differed); forward and every gradient against eager autocast."""
    x = torch.randn(6, 8, generator=gen)
    w1, b1 = torch.randn(16, 8, generator=gen).requires_grad_(), torch.randn(16, generator=gen).requires_grad_()
    w2 = torch.randn(5, 16, generator=gen).requires_grad_()
    t = torch.tensor([0, 1, 2, 3, 4, 0])

    def program(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = F.gelu(F.linear(x, w1, b1))
            logits = h @ w2.T
            return h, logits, F.cross_entropy(logits, t)

    want, got = program(x), [o.torch() for o in program(f.lazy(x))]
    assert [o.dtype for o in got] == [o.dtype for o in want] == [torch.bfloat16, torch.bfloat16, torch.float32]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    for a, b in zip(torch.autograd.grad(got[2], [w1, b1, w2]), torch.autograd.grad(want[2], [w1, b1, w2])):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the product itself: bit for bit
        assert torch.equal((f.lazy(x) @ w1.T).torch(), x @ w1.T)


def test_a_custom_autograd_function_and_a_reentrant_checkpoint_keep_the_gradients(f, gen):
    """``autograd.Function.apply`` sees no ``__torch_function__``: a lazy value reached it as an opaque
    object, its forward ran without grad and every gradient upstream was None (a reentrant
    checkpoint raised 'does not require grad'). It is a sync point now, as any op not fused."""

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    w = torch.randn(5, generator=gen, requires_grad=True)
    x = torch.randn(3, 5, generator=gen)
    (want,) = torch.autograd.grad(Square.apply(x * w).sum(), w)
    (got,) = torch.autograd.grad(Square.apply(f.lazy(x) * w).torch().sum(), w)
    torch.testing.assert_close(got, want)
    block = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5))
    grads = []
    for inp in (x, f.lazy(x)):  # (a reentrant checkpoint takes .backward(), not autograd.grad)
        params = [w, *block.parameters()]
        for p in params:
            p.grad = None
        out = torch.utils.checkpoint.checkpoint(block, inp * w, use_reentrant=True)
        (out.torch() if inp is not x else out).sum().backward()
        grads.append([p.grad for p in params])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a)


def test_nn_multihead_attention_reads_a_lazy_values_metadata(f, gen):
    """``nn.MultiheadAttention`` asks ``query.is_nested`` (a property, not a method: it raised
    AttributeError); metadata properties answer without a flush, ``data`` flushes."""
    att = torch.nn.MultiheadAttention(6, 2, batch_first=True)
    x = torch.randn(2, 5, 6, generator=gen)
    want, _ = att(x, x, x, need_weights=False)
    lx = f.lazy(x)
    got, _ = att(lx, lx, lx, need_weights=False)
    torch.testing.assert_close(got.torch() if hasattr(got, "torch") else got, want)
    y = f.lazy(x) * 2
    assert (y.is_nested, y.is_cpu, y.is_cuda, y.layout, y.nbytes, f.pending) == (
        False,
        True,
        False,
        torch.strided,
        240,
        1,
    )
    assert torch.equal(y.data, x * 2)


def test_inference_mode_flushes_as_no_grad_does(f, gen):
    """Inference tensors keep no version counter: the flush read ``_version`` and raised."""
    x, w = torch.randn(3, 4, generator=gen), torch.randn(4, 4, generator=gen)
    with torch.inference_mode():
        want = F.layer_norm(x @ w.T + 1.0, (4,))
        got = F.layer_norm(f.lazy(x) @ w.T + 1.0, (4,)).torch()
    torch.testing.assert_close(got, want)


def test_a_non_reentrant_checkpoint_over_lazy_values_recomputes_what_it_saved(f, gen):
    """Under saved-tensor hooks (a non-reentrant checkpoint) the region runs eagerly, what was pending
    before it first with the hooks set aside: a fused kernel flushed later saved its tensors outside
    the region (CheckpointError: 8 tensors saved, 6 recomputed)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Linear(5, 5), torch.nn.LayerNorm(5))
    rx.nn.replace_modules(model)
    x = torch.randn(3, 5, generator=gen)
    post_norm, pre_norm = (lambda t: model[2](t + model[1](t))), (lambda t: t + model[1](model[2](t)))
    for region in (post_norm, pre_norm):  # (pre-norm: the fused module reads the pending value first)
        grads = []
        for inp in (x, f.lazy(x)):
            model.zero_grad()
            h = model[0](inp)
            y = torch.utils.checkpoint.checkpoint(region, h, use_reentrant=False)
            (y.torch() if inp is not x else y).pow(2).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for a, b in zip(*grads):
            torch.testing.assert_close(b, a)


def test_a_product_with_a_bias_of_another_dtype_raises_at_the_statement(f, gen):
    """torch's meta kernels do not check a bias's dtype: a half bias beside float32 matrices was
    promoted (addmm) or raised only at the flush (linear); eager raises at the call."""
    a, w, half = torch.randn(3, 4, generator=gen), torch.randn(2, 4, generator=gen), torch.randn(2).half()
    for call in (lambda x: torch.addmm(half, x, w.T), lambda x: F.linear(x, w, half)):
        with pytest.raises(RuntimeError, match="same dtype"):
            call(a)
        with pytest.raises(RuntimeError, match="same dtype"):
            call(f.lazy(a) + 1)
