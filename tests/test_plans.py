"""Plans cached by structure (``lower.plans``): a call at a new size of a known layout reuses the
analysis, and the reused plan is the one a fresh analysis makes; programs are plain data."""

from __future__ import annotations

import pickle

import pytest
import torch
from fuzzing import EXAMPLES, programs
from hypothesis import HealthCheck, given, settings

import rtxdsl as rx
from rtxdsl.lower import Layout, Plan, analyze, expand
from rtxdsl.lower import plans as plans_module
from rtxdsl.lower.bind import Info
from rtxdsl.lower.plans import cacheable, plan_of, structure, translated
from rtxdsl.lower.schedule import contiguous_strides

x, y, w, t = rx.var("x"), rx.var("y"), rx.var("w"), rx.var("t")

#: (name, outputs, input shapes at two batch sizes); each a kernel family the plan cache serves
KNOWN = [
    ("softmax", rx.softmax(x) * 2.0, {"x": [(5, 33), (9, 33)]}),
    # a per-row statistic and its broadcast back: the roles KEEP / DROP
    ("layer_norm+gelu", rx.gelu(rx.layer_norm(x, w)), {"x": [(3, 7, 40), (6, 7, 40)], "w": [(40,), (40,)]}),
    # a mean over the row: its element count is a folded constant that the batch leaves alone
    ("mean over a row", (x - x.mean(-1, keepdim=True)) * y, {"x": [(5, 12), (8, 12)], "y": [(12,), (12,)]}),
    # movement ops: a coordinate kernel (slices whose bounds do not depend on the batch)
    ("slices", x[:, 1:5] + x[:, :4], {"x": [(6, 9), (11, 9)]}),
    # several outputs, a broadcast of size-1 dims
    (
        "two outputs",
        {"a": rx.rms_norm(x, w), "b": (x * y).sum(-1)},
        {"x": [(4, 16), (10, 16)], "w": [(16,), (16,)], "y": [(4, 1), (10, 1)]},
    ),
    # cross-entropy's target read by position
    ("cross_entropy", rx.cross_entropy(x, t), {"x": [(6, 30), (13, 30)], "t": [(6,), (13,)]}),
]


def _metas(k: rx.Kernel, shapes: dict[str, tuple[int, ...]]) -> tuple[Layout, ...]:
    dtypes = {"t": torch.int64}
    return tuple(Layout(shapes[n], contiguous_strides(shapes[n]), dtypes.get(n, torch.float32)) for n in k.inputs)


def _graph(k: rx.Kernel, metas: tuple[Layout, ...]):
    return expand(list(k.expressions), k.variables, tuple(Info.tensor(m.shape, m.dtype) for m in metas))


def _described(plan: Plan) -> list[tuple]:
    """A plan as positions in its graph: equal for two plans that group the same nodes alike."""
    at = {n: k for k, n in enumerate(plan.graph.nodes)}

    def pos(nodes):
        return tuple(at[n] for n in nodes)

    return [
        (
            g.shape,
            g.axes,
            g.pattern,
            pos(g.nodes),
            sorted((at[k], r) for k, r in g.roles.items()),
            pos(g.inputs),
            pos(g.outputs),
            pos(g.cone),
            g.notes,
        )
        for g in plan.groups
    ]


@pytest.mark.parametrize("name,outputs,shapes", KNOWN, ids=[k[0] for k in KNOWN])
def test_a_new_batch_size_reuses_the_plan_a_fresh_analysis_makes(name, outputs, shapes):
    k = rx.compile(outputs)
    cfg = rx.get_config()
    small, large = (_metas(k, {n: s[i] for n, s in shapes.items()}) for i in (0, 1))
    first, second = _graph(k, small), _graph(k, large)
    assert structure(first) == structure(second), f"{name}: the batch size changed the structure"
    reused = translated(analyze(first, cfg), second)
    assert _described(reused) == _described(analyze(second, cfg))


def test_a_call_at_a_new_batch_size_skips_the_analysis(monkeypatch):
    k = rx.compile(rx.softmax(x * 3.0) + 1.0)
    k(torch.randn(3, 21))
    calls = []
    real = plans_module.analyze
    monkeypatch.setattr(plans_module, "analyze", lambda g, c: calls.append(g) or real(g, c))
    out = k(xx := torch.randn(8, 21))
    torch.testing.assert_close(out, torch.softmax(xx * 3.0, -1) + 1.0)
    assert calls == []
    k(torch.randn(8, 22))  # a new row width is a new size too: still the same structure
    assert calls == []
    k(torch.randn(8, 1))  # a size-1 row is another structure (the analyzer treats 1 apart)
    assert len(calls) == 1


def test_a_size_equal_to_an_attribute_is_another_structure():
    """``x[:, :4]`` over 4 columns is the whole dim: a size equal to an integer the graph holds keeps
    its value in the key, so the analyzer sees every such relation anew."""
    k = rx.compile(x[:, :4] * 2.0)
    graphs = [_graph(k, _metas(k, {"x": s})) for s in [(3, 4), (3, 9), (3, 11)]]
    keys = [structure(g) for g in graphs]
    assert keys[0] != keys[1] and keys[1] == keys[2]


def test_a_changed_constant_is_another_structure():
    """A mean over the batch axis divides by the batch size, a folded constant the key holds."""
    k = rx.compile(x - x.mean(0))
    keys = [structure(_graph(k, _metas(k, {"x": (m, 6)}))) for m in (4, 7)]
    assert keys[0] != keys[1]


def test_products_are_analyzed_at_every_size(monkeypatch):
    """The GEMM prologue's cost model weighs bytes: a graph with a contraction is not cached."""
    k = rx.compile(rx.gelu(x) @ w)
    calls = []
    real = plans_module.analyze
    monkeypatch.setattr(plans_module, "analyze", lambda g, c: calls.append(g) or real(g, c))
    for m in (4, 6, 4):
        plan_of(_graph(k, _metas(k, {"x": (m, 16), "w": (16, 8)})), rx.get_config())
    assert len(calls) == 3


def test_programs_are_plain_data():
    k = rx.compile({"a": rx.softmax(x), "b": x.sum(-1) * y})
    p = k.program(x=torch.randn(4, 9), y=2.5)
    assert pickle.loads(pickle.dumps(p)) == p


FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
COMPARED: list[str] = []


def _scaled(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Every size but 0 and 1 moved, all of them the same way (no two sizes meet)."""
    return tuple(s if s < 2 else 3 * s + 61 for s in shape)


@FUZZ
@given(p=programs())
def test_random_programs_reuse_plans_a_fresh_analysis_makes(p):
    """Random programs at their sizes and at every size moved: where the structure is the same,
    the translated plan is the fresh analysis's, group for group."""
    k = rx.compile(p.outputs)
    cfg = rx.get_config()
    layouts = {n: t for n, t in p.inputs.items()}
    try:
        graphs = [
            _graph(
                k,
                tuple(
                    Layout(f(tuple(layouts[n].shape)), contiguous_strides(f(tuple(layouts[n].shape))), layouts[n].dtype)
                    for n in k.inputs
                ),
            )
            for f in (tuple, _scaled)
        ]
    except rx.RtxError:
        return
    if not cacheable(graphs[0]) or structure(graphs[0]) != structure(graphs[1]):
        return
    COMPARED.append(repr(p))
    fresh = analyze(graphs[1], cfg)
    assert _described(translated(analyze(graphs[0], cfg), graphs[1])) == _described(fresh), p


def test_random_programs_were_compared():
    """The property above is not vacuous: most random programs keep their structure at new sizes."""
    if not COMPARED:
        test_random_programs_reuse_plans_a_fresh_analysis_makes()
    assert len(COMPARED) >= max(1, EXAMPLES // 4)


def test_plan_of_serves_a_known_structure_from_its_cache():
    plans_module.clear()  # no other test's plan of this structure
    k = rx.compile(rx.silu(x) * y)
    g1, g2 = (_graph(k, _metas(k, {"x": (n, 5), "y": (n, 5)})) for n in (2, 7))
    cfg = rx.get_config()
    first = plan_of(g1, cfg)
    again = plan_of(g2, cfg)
    assert again.graph is g2 and _described(again) == _described(analyze(g2, cfg))
    assert plan_of(g1, cfg) is first
