"""GPU-shaped kernels, proven on CPU: split reductions, column tiles, 2-D pointwise tiles, and
the memory-access trace that holds every family to coalesced, parallel, few-pass access.

Launch configurations come from a target. ``GPU`` (sm_90) shapes are counted without running
(program counts at the issue's sizes); the generated code runs under the interpreter with
``SMALL``, a target with 4 SMs and tiny tiles, so small odd-sized tensors take the same code
paths (split rows, looped column tiles, 2-D tiles) a GPU takes on big ones.
"""

from __future__ import annotations

import json

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

#: run at SMALL; a program's own loads stay on chip for one loop block (128 bytes), as 32 KB do on sm_90
AT_SMALL = {"target": SMALL, "reuse_bytes": 128}

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

    kernels = {
        "pointwise": (rx.relu(x) + 1.0, {"x": torch.empty(5000)}),
        "row": (rx.softmax(x), {"x": torch.empty(64, 1000)}),
        "looped": (rx.softmax(x), {"x": torch.empty(512, 70001)}),  # enough rows: no split
        "split": (rx.sum(x), {"x": torch.empty(1 << 20)}),
        "tile": (x + y, {"x": torch.empty(64, 64).t(), "y": torch.empty(64, 64)}),
    }
    for name, (expr, inputs) in kernels.items():
        call = rx.compile(expr).lower_for(GPU, **inputs).launched[0]
        assert family(call.spec) == name
        options = candidates(call.spec, call.meta, call.grid, call.args[0])
        assert options[0] == (dict(call.meta), call.grid) and len(options) > len(TUNABLE[name]) // 2
        if name == "pointwise":  # a new block resizes the grid
            assert all(g == (-(-5000 // m["BLOCK_SIZE"]),) for m, g in options)


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
