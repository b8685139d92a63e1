"""DTensor and FSDP2: which axes a kernel may shard (proved piecewise, no processes), and real
DTensor calls and FSDP2 training on two gloo ranks (one subprocess pair for the whole module)."""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from filelock import FileLock
from fuzzing import EXAMPLES, programs
from hypothesis import HealthCheck, given, settings

import rtxdsl as rx
from rtxdsl.expr import walk
from rtxdsl.lower.pieces import pieces
from rtxdsl.lower.shard import PARTIAL, sharding

x, w, b, t = rx.var("x"), rx.var("w"), rx.var("b"), rx.var("t")
F64 = torch.float64


def _ways(outputs: dict, **inputs: torch.Tensor):
    k = rx.compile(outputs)
    return sharding(k.analysis(**inputs).graph), k.inputs


# (outputs, inputs, ways as {input: dim} per way with the outputs' entries, why: per input the reasons)
SHARDINGS = [
    # pointwise with a broadcast bias: rows (bias replicated) or columns (bias sharded alike)
    ({"o": rx.gelu(x + b)}, {"x": (5, 6), "b": (6,)}, [((0,), (0, None)), ((1,), (1, 0))]),
    # a row reduction: rows shard, the reduced axis stays whole
    ({"o": rx.softmax(x)}, {"x": (5, 6)}, [((0,), (0,))]),
    # a column sum that is an output: a partial sum per piece of the rows
    ({"o": rx.sum(x, 0)}, {"x": (5, 6)}, [((PARTIAL,), (0,)), ((0,), (1,))]),
    # ... but a mean divides by a count of the rows: no partial way over them
    ({"o": rx.mean(x, 0)}, {"x": (5, 6)}, [((0,), (1,))]),
    # layer_norm's weight is read along the normalized (whole) axis: replicated with the rows sharded
    ({"o": rx.layer_norm(x, w)}, {"x": (3, 5, 6), "w": (6,)}, [((0,), (0, None)), ((1,), (1, None))]),
    # RoPE re-indexes the last axis (halves swapped): batch and positions shard, cos / sin with positions
    ({"o": rx.rope(x, w, b)}, {"x": (2, 3, 8), "w": (3, 8), "b": (3, 8)}, [((0,), (0, None, None)), ((1,), (1, 0, 0))]),
    # random numbers depend on positions: nothing shards
    ({"o": rx.dropout(x, 0.5, seed=3)}, {"x": (4, 9)}, []),
    # a size-1 axis broadcasts, never shards
    ({"o": x * b}, {"x": (1, 6), "b": (6,)}, [((1,), (1, 0))]),
    # a product: A's rows, B's columns, or the contracted axis as partial sums of the output
    ({"o": x @ w}, {"x": (4, 6), "w": (6, 5)}, [((0,), (0, None)), ((1,), (None, 1)), ((PARTIAL,), (1, 0))]),
    # ... whose epilogue reads the sum (gelu): the contracted axis stays whole
    (
        {"o": rx.gelu(rx.linear(x, w, b))},
        {"x": (4, 6), "w": (5, 6), "b": (5,)},
        [((0,), (0, None, None)), ((1,), (None, 0, 0))],
    ),
    # batch dims shard alike (a size-1 one broadcasts); a weight gradient's batch is summed too
    (
        {"o": x @ w},
        {"x": (3, 4, 6), "w": (1, 6, 5)},
        [((0,), (0, None)), ((1,), (1, None)), ((PARTIAL,), (2, 1)), ((2,), (None, 2))],
    ),
    (
        {"o": rx.contract(x, w, ta=True, sum_batch=True)},
        {"x": (3, 4, 6), "w": (3, 4, 5)},
        [((PARTIAL,), (0, 0)), ((PARTIAL,), (1, 1)), ((0,), (2, None)), ((1,), (None, 2))],
    ),
]


@pytest.mark.parametrize(
    "outputs, shapes, want", SHARDINGS, ids=[repr(next(iter(o.values())))[:40] for o, _, _ in SHARDINGS]
)
def test_sharding_ways_of_named_kernels(outputs, shapes, want):
    found, names = _ways(outputs, **{n: torch.empty(s, dtype=F64) for n, s in shapes.items()})
    assert names == tuple(shapes)
    assert sorted(found.ways, key=repr) == sorted(want, key=repr)
    _assemble(outputs, {n: torch.randn(s, dtype=F64) for n, s in shapes.items()})


def test_cross_entropy_mean_keeps_everything_whole_and_says_why():
    found, _ = _ways({"o": rx.cross_entropy(x, t)}, x=torch.empty(4, 9, dtype=F64), t=torch.zeros(4, dtype=torch.long))
    assert found.ways == ()
    assert found.whole == (("reduced by sum", "reduced by sum"), ("reduced by sum",))
    per_row, _ = _ways(
        {"o": rx.cross_entropy(x, t, reduction="none")},
        x=torch.empty(4, 9, dtype=F64),
        t=torch.zeros(4, dtype=torch.long),
    )
    assert per_row.ways == (((0,), (0, 0)),)


def _pieces(v: torch.Tensor, dim: int | None) -> list[torch.Tensor]:
    return [v, v] if dim is None else list(torch.tensor_split(v, 2, dim))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(p=programs())
def test_every_claimed_sharding_gives_the_pieces_of_the_full_result(p):
    """A differential check of the analysis: cut each input as a way says, run each piece alone
    (torch, op by op, in float64), and the pieces must be the full result's pieces (exactly for
    integers; float64 within 1e-12: torch's CPU exp2 rounds by an ulp differently at other sizes;
    a narrower float a program casts to within its rounding, the pieces summed in another order)."""
    _assemble(p.outputs, {n: v.double() if v.is_floating_point() else v for n, v in p.inputs.items()})


#: per narrowest float a program computes in: pieces computed apart, then concatenated or
#: summed, against the whole
PIECE_TOLERANCE = {
    torch.float64: {"atol": 1e-12, "rtol": 1e-12},
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-2, "rtol": 1e-2},
    torch.bfloat16: {"atol": 6e-2, "rtol": 6e-2},
}


REFERENCE = rx.FusionConfig(backend="torch")


def _whole(outputs: dict, inputs: dict):
    """The kernel (torch, op by op), its full results, its sharding analysis and the tolerance its
    pieces are held to; None for a program torch itself rejects."""
    k = rx.compile(outputs, config=REFERENCE)
    try:
        full = k(**inputs)
        graph = k.analysis(**inputs).graph
    except (RuntimeError, rx.RtxError):
        return None
    # a program may cast to a narrower float (a GEMM's operands): pieces summed or cut round in
    # that dtype, in another order than the whole; the narrowest float it computes in sets the bar
    floats = [i.dtype for n in graph.nodes if not (i := graph.of(n)).is_scalar and i.dtype.is_floating_point]
    tol = PIECE_TOLERANCE[max(floats, key=lambda dt: torch.finfo(dt).eps)] if floats else PIECE_TOLERANCE[F64]
    return k, (full if isinstance(full, dict) else {"out": full}), sharding(graph), tol


def decided_by_floats(outputs: dict, inputs: dict) -> set[str]:
    """The outputs that are bool or integer values computed from float ones (a comparison, a float
    floored to an int): pieces summed in another order can put such a value on the other side of
    its threshold (``lse < gather(lse, i)`` of two roundings of one number), so they are held to
    nothing; every other output is."""
    graph = rx.compile(outputs, config=REFERENCE).analysis(**inputs).graph

    def is_float(n):
        return not graph.of(n).is_scalar and graph.of(n).dtype.is_floating_point

    return {
        key
        for key, root in graph.outputs
        if any(not is_float(n) and any(is_float(s) for s in n.srcs) for n in walk([root]))
    }


def _assemble(outputs: dict, inputs: dict) -> None:
    """Every way the analysis claims, checked: cut, run each piece alone, put the pieces together."""
    whole = _whole(outputs, inputs)
    if whole is None:
        return
    k, full, found, tol = whole
    for outs, ins in found.ways:
        cut = [_pieces(inputs[n], d) for n, d in zip(k.inputs, ins)]
        parts = [k(*[c[i] for c in cut]) for i in range(2)]
        parts = [r if isinstance(r, dict) else {"out": r} for r in parts]
        for key, d in zip(k.outputs, outs):
            got = [r[key] for r in parts]
            want = full[key]
            exact = {"atol": 0, "rtol": 0}
            if d == PARTIAL:
                assembled = [got[0] + got[1]]
            else:
                assembled = got if d is None else [torch.cat(got, d)]  # replicated: each piece is all of it
            for g in assembled:
                torch.testing.assert_close(g, want, equal_nan=True, **(tol if want.is_floating_point() else exact))


# ---- in pieces: reductions over a sharded axis merged after (no processes) -------------------------
def _in_pieces(outputs: dict, inputs: dict, name: str, dim: int, n: int, config: rx.FusionConfig | None = None):
    """Run ``outputs`` in ``n`` pieces along ``dim`` of input ``name`` as the ranks would (each piece's
    kernel on its part, with its offset; the reductions' values stacked; the merge kernel), or the
    reason it cannot be."""
    k = rx.compile(outputs, config=config)
    graph = k.analysis(**inputs).graph
    found = pieces(graph, k.inputs.index(name), dim)
    if isinstance(found, str):
        return found
    axis = next(d for d in found.dims if d is not None)
    size = inputs[name].shape[dim]
    cut = {v: list(torch.tensor_split(inputs[v], n, d)) for v, d in zip(k.inputs, found.dims) if d is not None}
    stacks: dict[str, list] = {s.name: [] for s in found.stacks}
    local: dict[str, list] = {o: [] for o, _ in found.local}
    start = 0
    for i in range(n):
        part = {v: cut[v][i] if v in cut else inputs[v] for v in k.inputs}
        length = next(iter(cut.values()))[i].shape[axis] if cut else size
        piece = k.derived(found.piece(length))
        out = piece(**{v: ({found.offset: start} | part)[v] for v in piece.inputs})
        for key, vals in (*stacks.items(), *local.items()):
            vals.append(out[key])
        start += length
    merged = {s.name: torch.stack(stacks[s.name]) for s in found.stacks}
    merged |= {s.name: torch.empty((), dtype=s.dtype).expand(s.shape) for s in found.stand_ins}
    result = {o: torch.cat(vals, d) for (o, d), vals in zip(found.local, local.values())}
    if found.merged:
        merge = k.derived(found.merge())
        result |= merge(**{v: (merged | inputs)[v] for v in merge.inputs})
    return result


#: (outputs, inputs, the input and dim split, None: runs in pieces, else why it cannot)
IN_PIECES = [
    # Megatron's vocabulary-parallel cross-entropy, every option: the vocabulary (w, bias, class weights) split
    (
        {"o": rx.linear_cross_entropy(x, w, t, b, rx.var("cw"), label_smoothing=0.1, z_loss=1e-3, softcap=3.0)},
        {"x": (7, 5), "w": (11, 5), "t": (7,), "b": (11,), "cw": (11,)},
        ("w", 0),
        None,
    ),
    # per-token losses (an output without the axis) from a split vocabulary; tokens split too
    ({"o": rx.linear_cross_entropy(x, w, t, reduction="none")}, {"x": (7, 5), "w": (11, 5), "t": (7,)}, ("w", 0), None),
    # cross-entropy's mean over split tokens: partial sums of losses and of counted tokens
    ({"o": rx.cross_entropy(x, t)}, {"x": (7, 11), "t": (7,)}, ("x", 0), None),
    # class-split logits, and a split-row output beside a merged one
    ({"o": rx.cross_entropy(x, t), "m": rx.amax(x, 0)}, {"x": (7, 11), "t": (7,)}, ("x", 1), None),
    # softmax over the split axis needs the merged logsumexp back in each piece: three passes, not two
    ({"o": rx.softmax(x)}, {"x": (5, 6)}, ("x", 1), "a value of the whole axis"),
    # Welford's sum of squared deviations does not merge from the pieces' values alone
    ({"o": rx.std(x, -1)}, {"x": (5, 6)}, ("x", 1), "does not merge"),
    # a reversal along the split axis re-indexes it
    ({"o": rx.sum(rx.flip(x, -1) * b, -1)}, {"x": (5, 6), "b": (6,)}, ("x", 1), "re-indexes the axis"),
]


@pytest.mark.parametrize("outputs, shapes, split, why", IN_PIECES, ids=[w or repr(o)[:40] for o, _, _, w in IN_PIECES])
def test_a_graph_runs_in_pieces_along_a_reduced_axis_or_says_why(outputs, shapes, split, why, gen):
    inputs = {n: torch.randn(s, dtype=F64, generator=gen) for n, s in shapes.items() if n != "t"}
    if "t" in shapes:
        inputs["t"] = torch.randint(0, 11, shapes["t"], generator=gen)
        inputs["t"][1] = -100  # an ignored token
    if "cw" in inputs:
        inputs["cw"] = inputs["cw"].abs() + 0.5
    got = _in_pieces(outputs, inputs, *split, n=3)
    if why is not None:
        assert isinstance(got, str) and why in got
        return
    want = rx.compile(outputs)(**inputs)
    want = want if isinstance(want, dict) else {"o": want}
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-12, rtol=1e-12)


def test_cross_entropy_in_pieces_is_exact_where_a_piece_holds_no_mass_or_rows_are_far_from_zero(gen):
    """A vocabulary split: each piece's softmax total is taken at its own logsumexp and rescaled to
    the whole's (``ops/reduction.py: _softmax_sum_of_pieces``). A piece whose part of a row is all
    -inf (masked classes) adds nothing; a row of one value far from zero keeps its ``log n``."""
    logits = torch.randn(4, 12, generator=gen, dtype=F64)
    logits[0, :4] = -math.inf  # the first piece of row 0 masked whole
    logits[1] = -1e18  # a row of one value: loss log 12 (lse - x would round it to 0)
    logits[2, 4:] = 1e17 + torch.arange(8, dtype=F64)  # far from zero, spread
    target = torch.tensor([7, 3, 9, -100])
    outputs = {"o": rx.cross_entropy(x, t, reduction="none")}
    got = _in_pieces(outputs, {"x": logits, "t": target}, "x", 1, n=3)
    torch.testing.assert_close(got["o"], F.cross_entropy(logits, target, reduction="none"), atol=1e-12, rtol=1e-12)


def test_a_split_gather_index_does_not_run_in_pieces_over_a_whole_input(gen):
    """gather's output is its index's shape: splitting the index's rows splits the output's, but
    the input is read at the rows' own positions (here it has more rows), so a piece would read
    the input's first rows. Found by the property below at a commit seed."""
    i = rx.var("i")
    outputs = {"o": rx.cross_entropy(rx.gather(x, i, 1), t, reduction="none")}
    inputs = {
        "x": torch.randn(5, 4, 1, generator=gen),
        "i": torch.randint(0, 4, (3, 2, 1), generator=gen),
        "t": torch.randint(0, 2, (3, 1), generator=gen),
    }
    k = rx.compile(outputs)
    graph = k.analysis(**inputs).graph
    for name in ("i", "t"):  # the target's rows are the same axis, through the loss
        assert "reads its input at the positions of the axis" in pieces(graph, k.inputs.index(name), 0)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(p=programs())
def test_every_graph_that_runs_in_pieces_gives_the_full_result(p):
    """A differential check: every input axis the sharding keeps whole, run in two pieces where
    ``lower.pieces`` says it can (torch, op by op, float64), equals the whole."""
    inputs = {n: v.double() if v.is_floating_point() else v for n, v in p.inputs.items()}
    whole = _whole(p.outputs, inputs)
    if whole is None:
        return
    k, full, found, tol = whole
    exact = {"atol": 0, "rtol": 0}
    loose = decided_by_floats(p.outputs, inputs)
    for name, kept in zip(k.inputs, found.whole):
        for dim, why in enumerate(kept):
            if not why or inputs[name].shape[dim] < 2:
                continue
            got = _in_pieces(p.outputs, inputs, name, dim, 2, REFERENCE)
            if isinstance(got, str):
                continue
            for key, want in full.items():
                if key in loose:
                    continue
                torch.testing.assert_close(
                    got[key], want, equal_nan=True, **(tol if want.is_floating_point() else exact)
                )


# ---- two ranks -----------------------------------------------------------------------------------
HELPER = Path(__file__).parent / "helpers" / "dtensor_ranks.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Rank 0's and rank 1's results of every scenario in ``helpers/dtensor_ranks.py`` (run once per
    session: xdist workers share the results through a locked directory)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no torch.distributed with the gloo backend")
    base = tmp_path_factory.getbasetemp()  # under xdist, its parent is this session's: shared by the workers
    out = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "dtensor-ranks"
    out.mkdir(exist_ok=True)
    with FileLock(str(out / "lock")):
        if not (out / "rank1.pkl").exists():
            root = str(Path(__file__).resolve().parents[1])  # this checkout's rtxdsl, whatever is installed
            paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
            cmd = [sys.executable, str(HELPER), str(out)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
            assert done.returncode == 0, done.stderr[-4000:]
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(2)]


def _ran(ranks: list[dict], name: str) -> dict:
    """A scenario's results on rank 0, after checking it ran without error on both ranks."""
    for r in ranks:
        assert "error" not in r[name], r[name].get("error")
    return ranks[0][name]


def test_pointwise_keeps_the_inputs_sharding(ranks):
    result = _ran(ranks, "pointwise")
    assert result["rows"][:3] == ("Shard(dim=0)", (3, 7), 0.0)  # 5 rows over 2 ranks: 3 + 2
    assert result["cols"][:3] == ("Shard(dim=1)", (5, 4), 0.0)  # the bias sharded along with the columns
    assert result["rep"][:3] == ("Replicate()", (5, 7), 0.0)
    assert all(v[3] == [] for v in result.values())  # no communication needed: no warning


def test_rows_shard_and_a_sharded_reduced_axis_is_gathered_once_with_one_warning(ranks):
    result = _ran(ranks, "rows")
    assert result["row"] == ("Shard(dim=0)", pytest.approx(0, abs=1e-15), [])
    placed, err, warned = result["col"]
    assert placed == "Replicate()" and err < 1e-15
    assert len(warned) == 1 and "'x'" in warned[0] and "Shard(1)" in warned[0] and "logsumexp" in warned[0]
    assert result["col_again"] == (pytest.approx(0, abs=1e-15), [])  # one warning per kernel


def test_partial_sums_over_sharded_rows(ranks):
    result = _ran(ranks, "partial_sums")
    assert result["col"] == ("Partial(sum)", pytest.approx(0, abs=1e-13))
    assert result["row"] == ("Shard(dim=0)", 0.0)
    assert result["warned"] == []


def test_grads_stay_sharded_through_the_fused_backward(ranks):
    result = _ran(ranks, "grads")
    assert result["out"] == ("Shard(dim=0)", pytest.approx(0, abs=1e-14))
    assert result["dx"] == ("Shard(dim=0)", pytest.approx(0, abs=1e-14))
    assert result["dw"] < 1e-13 and result["db"] < 1e-13
    assert result["warned"] == []


def test_llm_kernels_rope_sharded_cross_entropy_in_pieces_dropout_replicated(ranks):
    result = _ran(ranks, "llm")
    assert result["rope"] == ("Shard(dim=0)", 0.0, [])
    # a mean over row-sharded tokens: each rank's partial sums, all-gathered and merged (no gather)
    assert result["ce"][0] == "Replicate()" and result["ce"][1] < 1e-14 and result["ce"][2] == 0
    assert result["dropout"] == ("Replicate()", 0.0)  # the same mask as one process with the same seed


def test_linear_cross_entropy_shards_tokens_and_runs_a_sharded_vocabulary_in_parallel(ranks):
    result = _ran(ranks, "linear_ce")
    assert result["rows"][0] == "Shard(dim=0)" and result["rows"][1] < 1e-12 and result["rows"][2] == []
    for name in ("mean", "none", "all", "sum"):  # every option; nothing gathered (no warning)
        placement, err, warned = result[name]["loss"]
        assert placement == "Replicate()" and err < 1e-12 and warned == [], name
        (dh, dh_err), *rest = result[name]["grads"]
        assert dh_err < 1e-12, name  # each rank's part of dh, summed across ranks
        assert all(p == "Shard(dim=0)" and e < 1e-12 for p, e in rest), name  # dw, db, dcw stay sharded
    assert ranks[1]["linear_ce"]["all"] == result["all"]


def test_bad_input_mixed_and_mismatched_meshes_raise_naming_inputs_and_placements(ranks):
    result = _ran(ranks, "bad_input")
    assert "input 'y' is a plain torch.Tensor" in result["mixed"] and "Shard(dim=0)" in result["mixed"]
    assert "'x'" in result["meshes"] and "'y'" in result["meshes"] and "different meshes" in result["meshes"]
    assert "ranks [0, 1]" in result["meshes"] and "ranks [1, 0]" in result["meshes"]


def test_fsdp2_trains_rx_modules_with_rx_adamw_like_one_process(ranks):
    result = _ran(ranks, "fsdp2")
    assert result["param"] == ("DTensor", "Shard(dim=0)")
    assert result["exp_avg"] == "DTensor" and result["step_launches"] == ["DistributedCall", "PreparedCall"]
    assert result["losses"] == pytest.approx(result["single_process"], rel=1e-5, abs=1e-6)
    assert ranks[1]["fsdp2"]["losses"] == result["losses"]
    assert result["losses"][-1] < result["losses"][0] / 2  # it trains
