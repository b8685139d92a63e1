"""GPU-shaped kernels, proven on CPU: split reductions, column tiles, 2-D pointwise tiles, and
the memory-access trace that holds every family to coalesced, parallel, few-pass access.

Launch configurations come from a target. ``GPU`` (sm_90) shapes are counted without running
(program counts at the issue's sizes); the generated code runs under the interpreter with
``SMALL``, a target with 4 SMs and tiny tiles, so small odd-sized tensors take the same code
paths (split rows, looped column tiles, 2-D tiles) a GPU takes on big ones.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import FLOAT_TOLERANCES, assert_close

import rtxdsl as rx
from rtxdsl.lower import GPU, Target

SMALL = Target(
    "small", sm_count=4, pointwise_block=64, row_tile=256, max_row_block=64, loop_block=32, col_rows=8,
    split_min=64, tile=(8, 16),
)  # fmt: skip

#: run at SMALL; a program's last 512 bytes of loads stay on chip (four loop blocks), as 32 KB do on sm_90
AT_SMALL = {"target": SMALL, "reuse_bytes": 512}

x, w, b, y = (rx.var(n) for n in ("x", "w", "b", "y"))

# (name, expression, torch reference, extra inputs by shape of x's last dim)
ROW_CASES = [
    ("sum", lambda: rx.sum(x, axis=-1), lambda t: t.sum(-1)),
    ("mean", lambda: rx.mean(x, axis=-1), lambda t: t.mean(-1)),
    ("amax", lambda: rx.amax(x, axis=-1), lambda t: t.amax(-1)),
    ("amin", lambda: rx.amin(x, axis=-1), lambda t: t.amin(-1)),
    ("logsumexp", lambda: rx.logsumexp(x, -1), lambda t: t.logsumexp(-1)),
    ("variance", lambda: rx.variance(x, -1), lambda t: t.var(-1)),
    ("std", lambda: rx.std(x, -1), lambda t: t.std(-1)),
    ("softmax", lambda: rx.softmax(x), lambda t: t.softmax(-1)),
    ("log_softmax", lambda: rx.log_softmax(x), lambda t: t.log_softmax(-1)),
]

# shapes: (3, 301): few long rows -> split; (1, 999): a whole-tensor reduction -> split;
# (40, 70): enough rows to fill SMALL's 8-program waves -> one program per row block, no split
SHAPES = [(3, 301), (1, 999), (40, 70)]


def _split(trace: rx.Trace) -> list[str]:
    return [t.split for t in trace.launches]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name,expr,ref", ROW_CASES, ids=[c[0] for c in ROW_CASES])
@pytest.mark.parametrize("dtype,atol,rtol", FLOAT_TOLERANCES, ids=lambda v: str(v).replace("torch.", ""))
def test_split_rows_match_torch(name, expr, ref, shape, dtype, atol, rtol, gen):
    t = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    k = rx.compile(expr())
    trace = rx.memory_trace(k, x=t, **AT_SMALL)
    assert_close(trace.result, ref(t.double()), atol, rtol, f"{name} {shape}")
    assert _split(trace) == (["partial", "finish"] if shape[0] < 8 else [""]), trace.table()
    # looped statistics + output pass: at most two reads; a reduction alone reads once
    assert trace.re_read <= (2.0 if name in ("softmax", "log_softmax") else 1.0) + 1e-9, trace.table()


def test_split_norms_match_torch(gen):
    t = torch.randn(3, 301, generator=gen, dtype=torch.float64)
    wt, bt = torch.randn(301, generator=gen, dtype=torch.float64), torch.randn(301, generator=gen, dtype=torch.float64)
    ln = rx.memory_trace(rx.compile(rx.layer_norm(x, w, b)), x=t, w=wt, b=bt, **AT_SMALL)
    assert_close(ln.result, F.layer_norm(t, (301,), wt, bt), 1e-10, 1e-10, "layer_norm")
    rms = rx.memory_trace(rx.compile(rx.rms_norm(x, w, eps=1e-6)), x=t, w=wt, **AT_SMALL)
    assert_close(rms.result, F.rms_norm(t, (301,), wt, eps=1e-6), 1e-10, 1e-10, "rms_norm")
    for trace in (ln, rms):
        assert _split(trace) == ["partial", "finish"] and trace.re_read == 2.0, trace.table()


@pytest.mark.parametrize(
    "make",
    [
        lambda g: torch.randint(-9, 9, (2, 333), generator=g),  # ints: exact
        lambda g: torch.randn(333, 2, generator=g).t(),  # transposed: the reduced axis strided
        lambda g: torch.randn(2, 700, generator=g)[:, 1::2],  # a sliced view
        lambda g: torch.randn(1, 1, generator=g).expand(2, 301),  # expanded: stride 0 everywhere
    ],
    ids=["int64", "transposed", "sliced", "expanded"],
)
def test_split_rows_of_any_layout(make, gen):
    t = make(gen)
    trace = rx.memory_trace(rx.compile(rx.sum(x, axis=-1)), x=t, **AT_SMALL)
    assert _split(trace) == ["partial", "finish"]
    ref = t.sum(-1) if not t.dtype.is_floating_point else t.double().sum(-1)
    assert_close(trace.result, ref, 1e-5, 1e-5, "sum")


def test_split_rows_propagate_nan_and_inf():
    t = torch.zeros(2, 301)
    t[0, 250], t[1, 17] = float("nan"), float("inf")
    for expr, ref in [(rx.sum(x, axis=-1), t.sum(-1)), (rx.amax(x, axis=-1), t.amax(-1)),
                      (rx.logsumexp(x, -1), t.logsumexp(-1)), (rx.softmax(x), t.softmax(-1))]:  # fmt: skip
        out = rx.memory_trace(rx.compile(expr), x=t, **AT_SMALL).result
        assert_close(out, ref, 1e-6, 1e-6, repr(expr))


def test_split_results_are_deterministic(gen):
    t = torch.randn(2, 4001, generator=gen)
    k = rx.compile({"s": rx.sum(x, axis=-1), "p": rx.softmax(x)})
    first = rx.memory_trace(k, x=t, **AT_SMALL).result
    again = rx.memory_trace(k, x=t, **AT_SMALL).result
    assert all(torch.equal(first[n], again[n]) for n in first)  # bit for bit: a fixed merge order


def test_split_is_structural_not_per_size(gen):
    """Other sizes reuse the split kernels: the split count and chunk are arguments."""
    k = rx.compile(rx.softmax(x))
    rx.memory_trace(k, x=torch.randn(3, 301, generator=gen), **AT_SMALL)
    before = rx.cache_stats().compiles
    rx.memory_trace(k, x=torch.randn(2, 517, generator=gen), **AT_SMALL)
    assert rx.cache_stats().compiles == before


def test_column_reduction_tiles_the_contiguous_axis(gen):
    """A column sum (a bias gradient): kept columns side by side in each load, reduced rows looped."""
    t = torch.randn(301, 24, generator=gen)
    trace = rx.memory_trace(rx.compile(rx.sum(x, axis=0)), x=t, **AT_SMALL)
    assert_close(trace.result, t.double().sum(0), 1e-5, 1e-5, "column sum")
    assert trace.sector_use == 1.0 and trace.re_read == 1.0, trace.table()
    cs = rx.memory_trace(rx.compile(rx.log_softmax(x, axis=0)), x=t, **AT_SMALL)
    assert_close(cs.result, t.double().log_softmax(0), 1e-5, 1e-5, "column log_softmax")
    assert cs.sector_use == 1.0 and cs.re_read <= 2.0, cs.table()


@pytest.mark.parametrize(
    "make,aligned",
    [
        (lambda g: (torch.randn(40, 24, generator=g).t(), torch.randn(24, 40, generator=g)), True),  # x.t() + y
        (lambda g: (torch.randn(5, 16, 3, generator=g).permute(1, 2, 0), torch.randn(16, 3, 5, generator=g)), False),
        (lambda g: (torch.randn(37, 29, generator=g).t(), torch.randn(29, 1, generator=g)), False),  # odd + broadcast
    ],
    ids=["transposed", "permuted", "odd-broadcast"],
)
def test_pointwise_with_transposed_operands_uses_2d_tiles(make, aligned, gen):
    a, c = make(gen)
    trace = rx.memory_trace(rx.compile(rx.relu(x) * y + 1.0), x=a, y=c, **AT_SMALL)
    assert_close(trace.result, torch.relu(a.double()) * c.double() + 1.0, 1e-6, 1e-6, "tile")
    assert _split(trace) == ["tile"], trace.table()
    if aligned:  # whole 32-byte sectors along both fastest axes: every sector fully used by both operands
        assert trace.sector_use == 1.0, trace.table()


# pointwise kernels with re-indexed values (positions, views of per-row values): 2-D tiles
# along the last axis at SMALL's 8 x 16 (odd sizes: partial tiles both ways)
COORDINATE_TILES = [
    # cross-entropy's gradient: per-row logsumexp, target and cotangent against class positions
    ("ce_backward", (37, 53)),
    # positions against a per-row value beyond int32 (narrowed once per row, -1 outside)
    ("positions", (37, 53)),
    ("positions", (3, 5, 40)),  # rows over two dims: decomposed once per row
]


@pytest.mark.parametrize("case,shape", COORDINATE_TILES, ids=[f"{c}-{s}" for c, s in COORDINATE_TILES])
@pytest.mark.parametrize("dtype,atol,rtol", FLOAT_TOLERANCES, ids=lambda v: str(v).replace("torch.", ""))
def test_pointwise_coordinate_kernels_use_2d_tiles(case, shape, dtype, atol, rtol, gen):
    """No ``offs // size`` per element: the last axis is the tile's columns, per-row values are
    computed once per tile row; values against float64 torch."""
    xs = torch.randn(shape, generator=gen, dtype=torch.float64)
    if case == "ce_backward":
        ts = torch.randint(0, shape[-1], shape[:-1], generator=gen)
        ts[1] = -100
        plan = rx.compile(rx.cross_entropy(x, y)).grad_plan(x=xs.to(dtype).requires_grad_(), y=ts)
        feed = {"x": xs.to(dtype), "y": ts, "_g0": torch.tensor(1.5, dtype=dtype)}
        feed |= {key: v for key, v in plan.forward(x=xs.to(dtype), y=ts).items() if key in plan.grads.saved_keys}
        trace = rx.memory_trace(plan.backward, **{n: feed[n] for n in plan.backward.inputs}, **AT_SMALL)
        ref = xs.to(dtype).double().requires_grad_()
        (F.cross_entropy(ref, ts) * 1.5).backward()
        (got,) = trace.result.values()
        assert_close(got, ref.grad, atol * 10, rtol * 10, "cross-entropy gradient")
    else:
        ks = torch.tensor([3, 2**31 + 5, 2**31 + 1, -1, 18, 7, -(2**31)] * 6, dtype=torch.int64)
        ks = ks[: math.prod(shape[:-1])].reshape(*shape[:-1], 1)
        hit = rx.arange_like(x, -1) == y * 2
        trace = rx.memory_trace(rx.compile(rx.where(hit, x * 2.0, x)), x=xs.to(dtype), y=ks, **AT_SMALL)
        xd = xs.to(dtype).double()
        want = torch.where(torch.arange(shape[-1]) == ks * 2, xd * 2.0, xd)
        assert_close(trace.result, want, atol, rtol, "positions")
    assert _split(trace) == ["tile"], trace.table()
    assert all(launch.re_read <= 1.0 + 1e-9 for launch in trace.launches), trace.table()


def test_empty_and_single_element_reductions_keep_torch_values():
    k = rx.compile({"s": rx.sum(x, axis=-1), "m": rx.mean(x, axis=-1)})
    out = rx.memory_trace(k, x=torch.empty(3, 0), **AT_SMALL).result
    assert torch.equal(out["s"], torch.zeros(3)) and out["m"].isnan().all()
    one = rx.memory_trace(k, x=torch.full((1, 1), 2.5), **AT_SMALL).result
    assert one["s"].item() == 2.5 and one["m"].item() == 2.5


# ---- GPU launch shapes at the sizes (counted, not run) ----------------------------------
def _programs(expr, **inputs) -> list[int]:
    program = rx.compile(expr).lower_for(GPU, **inputs)
    return [c.grid[0] for c in program.launched]


@pytest.mark.parametrize(
    "name,expr,inputs,least",
    [
        ("column sum 4096x1024", lambda: rx.sum(x, axis=0), {"x": (4096, 1024)}, 132),
        ("full sum 4M", lambda: rx.sum(x), {"x": (4 << 20,)}, 132),
        ("mean 64x65536", lambda: rx.mean(x, axis=1), {"x": (64, 65536)}, 132),
        ("softmax 8x131072", lambda: rx.softmax(x), {"x": (8, 131072)}, 132),
        (
            "layer_norm 8x131072",
            lambda: rx.layer_norm(x, w, b),
            {"x": (8, 131072), "w": (131072,), "b": (131072,)},
            132,
        ),
        ("transposed add 4096x1024", lambda: x + y, {"x": (1024, 4096), "y": (4096, 1024)}, 264),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_gpu_programs_fill_the_device(name, expr, inputs, least):
    ts = {k: torch.empty(s) for k, s in inputs.items()}
    if name.startswith("transposed"):
        ts["x"] = ts["x"].t()
    assert min(_programs(expr(), **ts)) >= least


def test_traffic_model_counts_every_pass_and_partial_buffer():
    t = torch.empty(8, 131072)
    p = rx.compile(rx.softmax(x)).lower_for(GPU, x=t)
    nbytes = t.numel() * 4
    partial, finish = p.launched
    assert partial.reads == (1,) and finish.reads == (1,)
    states = partial.bytes - nbytes  # (max, sum of exp) per program
    assert states == 2 * 4 * partial.grid[0]
    assert finish.bytes == nbytes + states + nbytes  # reads x again and the states, writes the output


def test_trace_agrees_with_the_traffic_model(gen):
    """Within 10%, for every family: rows in registers, looped, split, column, 2-D tile, flat."""
    cases = [
        (rx.softmax(x), {"x": torch.randn(40, 50, generator=gen)}),
        (rx.softmax(x), {"x": torch.randn(8, 200, generator=gen)}),
        (rx.softmax(x), {"x": torch.randn(2, 301, generator=gen)}),
        (rx.sum(x, axis=0), {"x": torch.randn(301, 24, generator=gen)}),
        (x + y, {"x": torch.randn(40, 24, generator=gen).t(), "y": torch.randn(24, 40, generator=gen)}),
        (rx.gelu(x + b), {"x": torch.randn(9, 77, generator=gen), "b": torch.randn(77, generator=gen)}),
    ]
    for expr, inputs in cases:
        trace = rx.memory_trace(rx.compile(expr), **AT_SMALL, **inputs)
        assert abs(trace.model_bytes - trace.traced_bytes) <= 0.1 * trace.traced_bytes, trace.table()


# ---- launch options: one table per family, autotune with a stored winner ---------------------------
def test_every_family_has_tunable_launch_options():
    from rtxdsl.lower.schedule import TUNABLE, candidates, family

    bf16 = torch.bfloat16
    kernels = {
        "pointwise": (rx.relu(x) + 1.0, {"x": torch.empty(5000)}),
        "row": (rx.softmax(x), {"x": torch.empty(64, 1000)}),
        "looped": (rx.softmax(x), {"x": torch.empty(512, 70001)}),  # enough rows: no split
        "split": (rx.sum(x), {"x": torch.empty(1 << 20)}),
        "tile": (x + y, {"x": torch.empty(64, 64).t(), "y": torch.empty(64, 64)}),
        "gemm": (rx.linear(x, y), {"x": torch.empty(300, 64, dtype=bf16), "y": torch.empty(40, 64, dtype=bf16)}),
    }
    for name, (expr, inputs) in kernels.items():
        call = rx.compile(expr).lower_for(GPU, **inputs).launched[0]
        assert family(call.spec) == name
        options = candidates(call.spec, call.meta, call.grid, call.args)
        assert options[0] == (dict(call.meta), call.grid) and len(options) > len(TUNABLE[name]) // 2, name
        if name == "pointwise":  # a new block resizes the grid
            assert all(g == (-(-5000 // m["BLOCK_SIZE"]),) for m, g in options)
        if name == "gemm":  # a tile narrowed to the 40 columns (64 wide at most), the grid follows it
            for m, g in options:
                assert m["BLOCK_N"] <= 64 and g == (-(-300 // m["BLOCK_M"]) * -(-40 // m["BLOCK_N"]), 1)


@pytest.mark.parametrize("hidden", [256, 64], ids=["looped over the hidden dim", "the hidden dim one slice"])
def test_tuned_tiles_of_a_gemm_recomputing_a_product_keep_their_rows_halved(hidden):
    """Linear cross-entropy's gradient GEMMs recompute the logits' tiles in their prologue (a second
    accumulator): the heuristic halves their rows so both fit in registers, and so must every tile
    autotune tries (a 256-row tile there would spill). Where the hidden dim is one slice of the
    product (``Target.whole_k``: attention's head dim) the heuristic keeps 128 rows and autotune tries no
    more (``schedule.WHOLE_ROWS``)."""
    from rtxdsl.lower.schedule import TUNABLE, WHOLE_ROWS, candidates

    bf16 = torch.bfloat16
    ins = {"h": torch.randn(512, hidden, dtype=bf16), "w": torch.randn(1000, hidden, dtype=bf16)}
    ins["t"] = torch.randint(0, 1000, (512,))
    config = rx.FusionConfig(chunk_budget=0.0)  # the logits recomputed in both GEMMs, not chunked
    k = rx.compile(rx.linear_cross_entropy(rx.var("h"), rx.var("w"), rx.var("t")), config=config)
    plan = k.grad_plan(**ins)
    saved = plan.forward(**ins)
    feed = ins | saved | {"_g0": torch.ones((), dtype=bf16)}
    backward = plan.backward.lower_for(GPU, **{n: feed[n] for n in plan.backward.inputs})
    gemms = [c for c in backward.launched if c.spec.kind == "gemm"]
    assert len(gemms) == 2
    for call in gemms:
        options = candidates(call.spec, call.meta, call.grid, call.args)
        widest = max(t["BLOCK_M"] for t in TUNABLE["gemm"])
        if hidden > 128:
            assert dict(call.meta)["BLOCK_M"] <= GPU.gemm[0] // 2
            assert all(m["BLOCK_M"] <= widest // 2 for m, _ in options) and len(options) > 1
        else:
            assert dict(call.meta)["BLOCK_M"] == WHOLE_ROWS == GPU.gemm[0]
            assert all(m["BLOCK_M"] <= WHOLE_ROWS for m, _ in options) and len(options) > 1


def test_autotune_times_once_stores_the_winner_and_the_next_process_reads_it(tmp_path, gen):
    from rtxdsl import tune

    timed: list[dict] = []

    def timer(launch) -> float:  # an injected clock: 8 warps wins
        launch()
        timed.append({})
        return 1.0 if len(timed) == 3 else 5.0

    cfg = rx.FusionConfig(autotune=True, cache_dir=str(tmp_path))
    t = torch.randn(7, 301, generator=gen)
    tune.set_timer(timer)
    try:
        out = rx.compile(rx.softmax(x), config=cfg)(x=t)
        n_timed = len(timed)
        assert n_timed >= 3
        stored = list((tmp_path / "tuned").glob("*.json"))
        assert len(stored) == 1 and not list((tmp_path / "tuned").glob(".tune-*"))  # no temporary left
        record = json.loads(stored[0].read_text())
        assert len(record["ms"]) == n_timed and record["ms"].index(min(record["ms"])) == 2  # the fastest kept
        # a new kernel object (as in a new process): reads the winner, times nothing
        again = rx.compile(rx.softmax(x), config=cfg)(x=t)
        assert len(timed) == n_timed
    finally:
        tune.set_timer(None)
    assert_close(out, t.double().softmax(-1), 1e-5, 1e-5, "tuned softmax")
    assert torch.equal(out, again)


# ---- every composite, forward and backward: GPU-shaped under the trace ---------------------------
c, s, tgt = rx.var("c"), rx.var("s"), rx.var("t")
COMPOSITES = {
    "softmax": (lambda: rx.softmax(x), "x"),
    "log_softmax": (lambda: rx.log_softmax(x), "x"),
    "logsumexp": (lambda: rx.logsumexp(x, -1), "x"),
    "variance": (lambda: rx.variance(x, -1), "x"),
    "layer_norm": (lambda: rx.layer_norm(x, w, b), "xwb"),
    "rms_norm": (lambda: rx.rms_norm(x, w), "xw"),
    "bias_gelu": (lambda: rx.gelu(x + b), "xb"),
    "swiglu": (lambda: rx.swiglu(x, y), "xy"),
    "geglu": (lambda: rx.geglu(x, y), "xy"),
    "rope": (lambda: rx.rope(x, c, s), "xcs"),
    "cross_entropy": (lambda: rx.cross_entropy(x, tgt), "xt"),
}


def _inputs(names: str, rows: int, hidden: int, gen: torch.Generator, make=torch.randn) -> dict:
    shapes = {"x": (rows, hidden), "y": (rows, hidden), "c": (rows, hidden), "s": (rows, hidden)}
    shapes |= {"w": (hidden,), "b": (hidden,)}
    out = {n: make(shapes[n], generator=gen) if make is torch.randn else make(shapes[n]) for n in names if n != "t"}
    if "t" in names:
        out["t"] = torch.randint(0, hidden, (rows,), generator=gen) if make is torch.randn else torch.empty(rows).long()
    return out


def _fwd_bwd(expr, inputs: dict, run: bool = True) -> list[tuple[str, rx.Kernel, dict]]:
    """The forward and backward kernels autograd runs, each with inputs it would get (``run``:
    computed by the forward; otherwise empty tensors of the forward's output shapes)."""
    k = rx.compile(expr)
    plan = k.grad_plan(**inputs)
    feed = dict(inputs)
    fwd_in = {n: feed[n] for n in plan.forward.inputs}
    if run:
        fo = plan.forward(**fwd_in)
        fo = fo if isinstance(fo, dict) else {"out": fo}
    else:
        program = plan.forward.program(**fwd_in)
        bufs = {program.n_inputs + i: b for i, b in enumerate(program.buffers)}
        fo = {
            key: torch.empty(bufs[slot].shape, dtype=bufs[slot].dtype)
            for key, slot in program.outputs
            if slot is not None
        }
    for key in plan.grads.saved_keys:
        feed[key] = fo[key]
    for i, key in enumerate(plan.grads.user_keys):
        feed[f"_g{i}"] = torch.randn_like(fo[key])
    pick = lambda kk: {n: feed[n] for n in kk.inputs}  # noqa: E731
    return [("forward", plan.forward, pick(plan.forward)), ("backward", plan.backward, pick(plan.backward))]


@pytest.mark.parametrize("rows,hidden", [(24, 64), (24, 200), (2, 512)], ids=["in-registers", "looped", "split"])
@pytest.mark.parametrize("name", list(COMPOSITES))
def test_composite_kernels_are_gpu_shaped(name, rows, hidden, gen):
    """Re-read <= 1 on chip (<= 2 looped or split), sector use >= 0.9, model within 10% of the trace."""
    expr, names = COMPOSITES[name]
    for phase, kernel, inputs in _fwd_bwd(expr(), _inputs(names, rows, hidden, gen)):
        trace = rx.memory_trace(kernel, **inputs, **AT_SMALL)
        many_passes = any(lt.split in ("partial", "finish") for lt in trace.launches) or any(
            c.spec.looped and c.spec.split != "tile" for c in kernel.lower_for(SMALL, **inputs).launched
        )
        what = f"{name} {phase} {rows}x{hidden}\n{trace.table()}"
        for launch in trace.launches:  # per kernel: one pass on chip, two for statistics + output
            assert launch.re_read <= (2.0 if many_passes else 1.0) + 1e-9, what
            if sum(t.unique for t in launch.big) >= 1024:  # a few bytes (2 rows' losses) cannot fill sectors
                assert launch.sector_use >= 0.9, what
        for first, second in zip(trace.launches, trace.launches[1:]):  # a split row: two reads in all
            if (first.split, second.split) == ("partial", "finish"):
                assert first.re_read + second.re_read <= 2.0 + 1e-9, what
        assert abs(trace.model_bytes - trace.traced_bytes) <= 0.1 * trace.traced_bytes, what


@pytest.mark.parametrize("name", list(COMPOSITES))
def test_composite_kernels_fill_the_gpu_at_a_million_elements(name):
    """>= 264 programs for pointwise work, >= 132 for reductions, forward and backward (counted)."""
    expr, names = COMPOSITES[name]
    for phase, kernel, inputs in _fwd_bwd(expr(), _inputs(names, 1024, 1024, None, make=torch.empty), run=False):
        program = kernel.lower_for(GPU, **inputs)
        shapes = [tuple(inputs[n].shape) for n in kernel.inputs] + [b.shape for b in program.buffers]
        for call in program.launched:
            # the kernel's biggest operand: of the inputs, those it reads (a merge of partial states none)
            unread = {i for i, r in zip(call.buffers, call.reads) if r == 0}
            work = max(math.prod(shapes[i]) for i in call.buffers if i not in unread)
            if work >= 1 << 20:
                least = 264 if call.spec.kind == "pointwise" else 132
                assert call.grid[0] >= least, f"{name} {phase}: {call.summary} has {call.grid[0]} programs"


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"label_smoothing": 0.1}, {"reduction": "none"}, {"reduction": "sum", "weight": True}],
    ids=["mean", "smoothing", "none", "sum-weighted"],
)
def test_cross_entropy_over_a_long_vocabulary_splits_its_rows(kwargs, gen):
    """LLM decode: a few rows over a long vocabulary (a coordinate kernel: the target is gathered)."""
    logits = torch.randn(3, 301, generator=gen, dtype=torch.float64)
    target = torch.tensor([5, -100, 300])
    ins, ref_kw = {"x": logits, "t": target}, dict(kwargs)
    if kwargs.get("weight"):
        ins["w"] = ref_kw["weight"] = torch.rand(301, generator=gen, dtype=torch.float64)
        kwargs = {**kwargs, "weight": w}
    trace = rx.memory_trace(rx.compile(rx.cross_entropy(x, tgt, **kwargs)), **ins, **AT_SMALL)
    assert trace.launches[0].split == "partial" and trace.launches[1].split == "finish", trace.table()
    assert_close(trace.result, F.cross_entropy(logits, target, **ref_kw), 1e-10, 1e-10, str(kwargs))
    with pytest.raises(rx.RtxError, match="out of range"):
        rx.memory_trace(rx.compile(rx.cross_entropy(x, tgt)), x=logits, t=torch.tensor([5, 301, 0]), **AT_SMALL)


#: tiny tiles and blocks: the rows of small random tensors split, loop and tile
TINY = Target(
    "tiny", sm_count=4, pointwise_block=16, row_tile=32, max_row_block=8, loop_block=4, col_rows=4,
    split_min=8, tile=(4, 4),
)  # fmt: skip
RANDOM_REDUCTIONS = [
    (lambda: rx.sum(x, axis=-1), lambda t: t.sum(-1)),
    (lambda: rx.sum(x, axis=0), lambda t: t.sum(0)),
    (lambda: rx.mean(x, axis=(0, 1)), lambda t: t.mean((0, 1))),
    (lambda: rx.amax(x, axis=-1, keepdim=True) * 2.0, lambda t: t.amax(-1, keepdim=True) * 2),
    (lambda: rx.softmax(x, axis=0), lambda t: t.softmax(0)),
    (lambda: rx.log_softmax(x) + 1.5, lambda t: t.log_softmax(-1) + 1.5),
    (lambda: rx.variance(x, 0), lambda t: t.var(0)),
    (lambda: rx.std(x, -1) - rx.mean(x, -1), lambda t: t.std(-1) - t.mean(-1)),
    (lambda: x - rx.logsumexp(x, -1, keepdim=True), lambda t: t - t.logsumexp(-1, keepdim=True)),
    (lambda: rx.sum(rx.exp(x) * 0.5, axis=0) + rx.amin(x, 0), lambda t: (t.exp() * 0.5).sum(0) + t.amin(0)),
]


def test_random_split_and_looped_reductions_match_torch():
    """Random reductions, shapes, layouts, dtypes and non-finite values on TINY (a differential
    fuzz of the split, looped and column families; 300 such cases ran clean while building it)."""
    import random

    rng = random.Random(0)
    phases: set[str] = set()
    for _ in range(40):
        make, ref = rng.choice(RANDOM_REDUCTIONS)
        rows, cols = rng.randint(1, 6), rng.randint(1, 70)
        layout = rng.choice(["contiguous", "transposed", "sliced"])
        t = {
            "contiguous": lambda: torch.randn(rows, cols, dtype=torch.float64),
            "transposed": lambda: torch.randn(cols, rows, dtype=torch.float64).t(),
            "sliced": lambda: torch.randn(rows, 2 * cols, dtype=torch.float64)[:, ::2],
        }[layout]()
        if rng.random() < 0.15:
            t[rng.randrange(rows), rng.randrange(cols)] = rng.choice([float("nan"), float("inf"), -float("inf")])
        dtype, atol, rtol = rng.choice(FLOAT_TOLERANCES)
        trace = rx.memory_trace(rx.compile(make()), x=t.to(dtype), target=TINY, reuse_bytes=64)
        phases |= {lt.split for lt in trace.launches}
        what = f"{make()!r} on {layout} {dtype} [{rows}, {cols}]"
        assert_close(trace.result, ref(t.to(dtype).double()), atol * 10, rtol * 10, what)
    assert {"partial", "finish", ""} <= phases  # the families this is meant to exercise ran


# ---- tails: a one-program reduction over what a launch wrote, run by that launch's last program -----
t_ = rx.var("t")
TAIL_CASES = [
    # cross-entropy's mean over its rows (the lazy Llama block's loss): rows, then the mean
    ("ce_mean", lambda: rx.cross_entropy(x, t_), lambda a, tg: F.cross_entropy(a, tg)),
    # a scalar over a row statistic: logsumexp rows, then a sum of squares (a z-loss)
    ("sum_lse_sq", lambda: rx.sum(rx.logsumexp(x, -1) ** 2), lambda a, tg: (a.logsumexp(-1) ** 2).sum()),
    # a mean of row maxima
    ("mean_row_max", lambda: rx.mean(rx.amax(x, -1)), lambda a, tg: a.amax(-1).mean()),
]


@pytest.mark.parametrize("name,expr,ref", TAIL_CASES, ids=[c[0] for c in TAIL_CASES])
@pytest.mark.parametrize("dtype,atol,rtol", FLOAT_TOLERANCES, ids=lambda v: str(v).replace("torch.", ""))
def test_tail_runs_in_the_last_program_of_one_launch(name, expr, ref, dtype, atol, rtol, gen):
    k = rx.compile(expr())
    for rows in (37, 5):  # several programs, then other data and sizes: the counter was left at zero
        a = torch.randn(rows, 50, generator=gen, dtype=torch.float64)
        tg = torch.randint(0, 50, (rows,), generator=gen)
        ins = {"x": a.to(dtype), "t": tg} if "t" in k.inputs else {"x": a.to(dtype)}
        trace = rx.memory_trace(k, **ins, **AT_SMALL)
        assert len(trace.launches) == 1 and (rows < 8 or trace.launches[0].programs > 1)
        assert_close(trace.result, ref(a.to(dtype).double(), tg), atol, rtol, f"{name} {rows} rows")
        again = rx.memory_trace(k, **ins, **AT_SMALL).result
        assert torch.equal(again, trace.result)  # bit for bit: the tail reads in a fixed order
        assert_close(k(**ins), ref(a.to(dtype).double(), tg), atol, rtol, f"{name} {rows} rows, interpreter target")


def test_tail_code_takes_one_ticket_and_resets_the_counter(gen):
    k = rx.compile(rx.cross_entropy(x, t_))
    a, tg = torch.randn(9, 30, generator=gen), torch.randint(0, 30, (9,), generator=gen)
    (src,) = k.sources(x=a, t=tg)
    assert src.count("tl.atomic_add(count_ptr, 1") == 1 and src.count("tl.store(count_ptr, 0)") == 1
    assert "atomic_xchg" not in src  # (its unused result would pass through shared memory: two barriers)
    # the head kernel, the function its last program calls, and the tail's two sums' combine
    assert src.count("def ") == 3 and "_tail(" in src and "tl.reduce(" in src
    assert src.index("tl.debug_barrier()") < src.index("tl.atomic_add(count_ptr")  # every store before the ticket
    assert src.index("_tail(t_") < src.index("tl.store(count_ptr, 0)")  # the reset after the tail's reads
    big = k.lower_for(GPU, x=torch.empty(8192, 32000), t=torch.zeros(8192, dtype=torch.long))
    assert big.kernels_launched == 1 and big.kernels[0].grid == (8192,) and big.kernels[0].tail.grid == (1,)


@pytest.mark.parametrize(
    ("shape", "split"),
    [((4096, 256), True), ((600, 70), False)],  # a split column reduction; a looped one on the interpreter
)
def test_bias_gradient_reads_each_input_once(shape, split, gen):
    """The backward of ``gelu(x + b)``: dx (full, needs no reduction) and db (its column sum) in one
    kernel. dx is stored in the first pass (a split row's partial kernel), so no later pass reads
    x or the cotangent again: the sm_90 trace sees each input read once, as the model counts."""
    xs, bs = torch.randn(shape, generator=gen), torch.randn(shape[1], generator=gen)
    cot = torch.randn(shape, generator=gen)
    plan = rx.compile(rx.gelu(rx.var("x") + rx.var("b"))).grad_plan(x=xs, b=bs)
    feed = {"x": xs, "b": bs} | {n: cot for n in plan.backward.inputs if n.startswith("_g")}
    t = rx.memory_trace(plan.backward, **{n: feed[n] for n in plan.backward.inputs})
    assert len(t.launches) == (2 if split else 1)
    assert t.re_read == 1.0 and t.model_bytes == t.traced_bytes
    for launch in t.launches:  # the finish kernel of a split row reads only the partial sums
        loads = {tt.name: tt.loaded for tt in launch.tensors}
        if launch.split == "finish":
            assert loads["in0"] == loads["in2"] == 0, loads
    x64 = xs.double().requires_grad_()
    b64 = bs.double().requires_grad_()
    torch.autograd.backward(torch.nn.functional.gelu(x64 + b64), cot.double())
    grads = t.result if isinstance(t.result, dict) else {}
    grad_of = dict(plan.grads.grad_of)
    torch.testing.assert_close(grads[grad_of["x"]].double(), x64.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grads[grad_of["b"]].double(), b64.grad, atol=1e-3, rtol=1e-4)
