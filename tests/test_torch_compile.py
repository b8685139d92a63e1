"""Kernels inside PyTorch: torch.library ops (opcheck), torch.compile without graph breaks, and
on CUDA the generated kernels themselves in the compiled graph (traced here on fake CUDA tensors)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import rtxdsl as rx
from rtxdsl.workloads import WORKLOADS

x, b = rx.var("x"), rx.var("b")


@pytest.mark.parametrize("w", WORKLOADS, ids=[w.name for w in WORKLOADS])
def test_every_catalog_kernel_is_an_opchecked_torch_op(w):
    k = rx.compile(w.expr())
    ins = w.inputs(3, 16, w.dtype, torch.device("cpu"), torch.Generator().manual_seed(0))
    args = tuple(ins[n] for n in k.inputs)
    want = k(*args)
    got = k.torch_op(*args)
    if isinstance(want, dict):
        assert isinstance(got, tuple) and len(got) == len(k.outputs)
        for key, g in zip(k.outputs, got):
            torch.testing.assert_close(g, want[key])
    else:
        torch.testing.assert_close(got, want)
    assert k.torch_op._qualname.startswith("rtxdsl::k_")
    torch.library.opcheck(k.torch_op, args)
    # and differentiated: AOT autograd traces the backward at symbolic sizes too (issue 22 item 3)
    grad_args = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in args)
    torch.library.opcheck(k.torch_op, grad_args)


def test_torch_op_is_the_same_op_for_the_same_structure():
    one, two = rx.compile(rx.gelu(x + b)), rx.compile(rx.gelu(x + b))
    assert one.torch_op is two.torch_op
    assert rx.compile(rx.relu(x + b)).torch_op is not one.torch_op


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_kernels_inside_torch_compile_fullgraph(backend):
    k = rx.compile(rx.gelu(x + b))
    ln = rx.nn.LayerNorm(8)

    @rx.fuse
    def scaled(a, c):
        return rx.softmax(a * c)

    def fn(a, c):
        h = k(x=a, b=c) + k(a, c)  # by name and positionally
        return ln(scaled(h, 0.5 + c.abs()))

    compiled = torch.compile(fn, fullgraph=True, backend=backend, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    t, c = torch.randn(5, 8, generator=gen), torch.randn(8, generator=gen)
    ta, tr = t.clone().requires_grad_(), t.double().requires_grad_()
    out = compiled(ta, c)
    c64, (w64, b64) = c.double(), (p.detach().double() for p in (ln.weight, ln.bias))
    ref = F.layer_norm(torch.softmax(2 * F.gelu(tr + c64) * (0.5 + c64.abs()), -1), (8,), w64, b64)
    # against float64, fp32's tolerance (the gradient chain's fp32 rounding alone reaches ~1e-5)
    torch.testing.assert_close(out.double(), ref.detach(), atol=3e-5, rtol=3e-5)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(ta.grad.double(), tr.grad, atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(compiled(torch.randn(9, 8), c).shape, torch.Size([9, 8]))


def test_no_graph_breaks_and_no_recompiles_across_batch_sizes():
    k = rx.compile({"h": x + b, "y": rx.layer_norm(x + b)})
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fn(a, c):
        out = k(x=a, b=c)
        return out["y"] * 2 + out["h"]

    explained = torch._dynamo.explain(fn)(torch.randn(4, 8), torch.randn(8))
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=counting, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    for rows in (2, 5, 17, 64):
        t, c = torch.randn(rows, 8, generator=gen), torch.randn(8, generator=gen)
        torch.testing.assert_close(compiled(t, c), F.layer_norm(t + c, (8,)) * 2 + t + c)
    assert len(graphs) == 1


def test_random_kernels_under_compile_refuse_a_backward_they_cannot_replay():
    k = rx.compile(rx.dropout(x, 0.5))
    compiled = torch.compile(lambda a: k(a), fullgraph=True, backend="eager")
    out = compiled(torch.ones(64))
    assert set(out.unique().tolist()) <= {0.0, 2.0}
    with pytest.raises(Exception, match="draws random seeds per call"):
        compiled(torch.ones(64, requires_grad=True)).sum().backward()


def test_a_mapping_with_the_single_key_out_stays_a_mapping_through_the_torch_ops():
    """``compile({"out": e})`` returns a dict, ``compile(e)`` a tensor: the ops must not confuse them."""
    as_dict, as_tensor = rx.compile({"out": rx.relu(x)}), rx.compile(rx.relu(x))
    t = torch.tensor([-1.0, 2.0])
    assert as_dict.torch_op is not as_tensor.torch_op
    assert isinstance(as_dict.torch_op(t), tuple) and isinstance(as_tensor.torch_op(t), torch.Tensor)
    compiled = torch.compile(lambda a: as_dict(a)["out"] + as_tensor(a), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(t), 2 * t.relu())


# ---- on CUDA, the compiled graph holds the generated kernels (wrap_triton) ------------------------
@pytest.fixture(scope="module")
def graph_reports(tmp_path_factory) -> dict[str, dict]:
    """``helpers/graph_launches.py``: AOT autograd's graphs of rtxdsl calls on fake CUDA tensors."""
    script = Path(__file__).parent / "helpers" / "graph_launches.py"
    cache = tmp_path_factory.mktemp("graph_launches")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1", "RTXDSL_CACHE_DIR": str(cache)}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return {r["case"]: r for r in map(json.loads, res.stdout.splitlines())}


# fixed shapes on CUDA: each launch a node of the graph (Inductor schedules it), nothing opaque
LAUNCHED = [
    "pointwise",  # bias + GELU: one pointwise kernel
    "torch_op",  # the same through k.torch_op (the kernel's own op)
    "two_outputs",  # layer_norm and softmax of a 4100-wide row: one row kernel, two outputs
    "tail",  # cross-entropy with its mean as the row kernel's tail (counter zeroed in the graph)
    "saving",  # a differentiated call: the forward of its gradient plan (bias + GELU saves nothing)
    "saving_tail",  # ... cross-entropy's, also writing each row's logsumexp for the backward
]


@pytest.mark.parametrize("case", LAUNCHED)
def test_on_cuda_the_compiled_graph_holds_each_generated_kernel(graph_reports, case):
    r = graph_reports[case]
    assert r["launches"] == r["expected"] >= 1 and not r["opaque"], r
    # rtxdsl's kernels: [pattern_]family_..., ``softmax_row_<signature>``, ``pointwise_add_gelu_<signature>``
    assert all(re.match(r"(?:[a-z_]+_)?(?:pointwise|row)_", name) for name in r["kernels"]), r
    # torch's TTIR analysis found what each kernel writes, and no input among it (none is cloned)
    assert set(r["written"]) - {"count_ptr"} and not r["cloned_inputs"], r
    assert ("count_ptr" in r["written"]) == case.endswith("tail")


@pytest.mark.parametrize(
    "case",
    [
        "index_checks",  # gathers whose flags are read on the host after the launch
        "symbolic",  # dynamic sizes: one opaque op serves every size (no recompile per size)
        "saving_symbolic",  # a differentiated call at dynamic sizes: the same op, no statistics saved
    ],
)
def test_calls_that_are_not_a_fixed_list_of_launches_stay_one_opaque_op(graph_reports, case):
    r = graph_reports[case]
    assert r["launches"] == 0 and r["opaque"] == ["rtxdsl.kernel.default"], r


@pytest.mark.parametrize(
    "case",
    [
        "backward",  # bias + GELU: nothing saved (the forward's launch is dropped), one kernel for dx and db
        "backward_tail",  # cross-entropy: the forward saving each row's logsumexp, then the gradient kernel
    ],
)
def test_gradients_in_the_compiled_graph_are_the_fused_backward_kernels(graph_reports, case):
    r = graph_reports[case]
    assert r["launches"] == r["expected"] and not r["opaque"] and not r["cloned_inputs"], r


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_a_differentiated_call_saves_its_statistics_for_the_backward(backend, dynamic):
    """``rtxdsl::kernel_saving`` at fixed sizes: one row kernel forward (the outputs and each
    row's mean and rstd), one backward kernel reading them, as eager autograd runs. At symbolic
    sizes (a second size through the same graph) AOT autograd's graph holds ``rtxdsl::kernel``
    and the backward runs the forward again (2); the ``eager`` backend runs the op itself, at
    real sizes, and saves."""
    k = rx.compile({"y": rx.layer_norm(x + b), "s": rx.softmax(x)})
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(
        lambda p, q: k(p, q)["y"].square().sum(), fullgraph=True, backend=counting, dynamic=dynamic
    )
    gen = torch.Generator().manual_seed(0)
    for rows, cols in ((6, 9), (11, 13)) if dynamic else ((6, 9),):
        a = torch.randn(rows, cols, generator=gen, dtype=torch.float64, requires_grad=True)
        c = torch.randn(cols, generator=gen, dtype=torch.float64, requires_grad=True)
        rx.reset_fusion_stats()
        out = compiled(a, c)
        forward = rx.fusion_stats().kernels_launched
        out.backward()
        assert (forward, rx.fusion_stats().kernels_launched - forward) == (
            1,
            2 if dynamic and backend != "eager" else 1,
        )
        want = F.layer_norm(a + c, (cols,)).square().sum()
        torch.testing.assert_close(out, want)
        for got, expected in zip((a.grad, c.grad), torch.autograd.grad(want, (a, c))):
            torch.testing.assert_close(got, expected)
    assert len(graphs) == 1


def test_a_compiled_backward_outlives_the_kernels_plan_cache():
    """The compiled backward names the gradient plan's kernels by key: other layouts evicting
    plans from the kernel's cache (one entry here) must not free them."""
    import gc

    k = rx.compile(rx.layer_norm(x + b), config=rx.FusionConfig(launch_cache_size=1))
    compiled = torch.compile(lambda p, q: k(p, q).square().sum(), fullgraph=True, backend="aot_eager", dynamic=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        a = torch.randn(6, 9, generator=gen, dtype=torch.float64, requires_grad=True)
        c = torch.randn(9, generator=gen, dtype=torch.float64, requires_grad=True)
        compiled(a, c).backward()
        want = torch.autograd.grad(F.layer_norm(a + c, (9,)).square().sum(), (a, c))
        torch.testing.assert_close((a.grad, c.grad), want)
        for rows in (3, 4, 5):  # eager calls at other sizes churn the plan cache
            k(torch.randn(rows, 9, requires_grad=True), torch.randn(9)).sum().backward()
        gc.collect()


@pytest.mark.parametrize(
    ("outputs", "needs", "shapes"),
    [
        # layer_norm and softmax of one input: mean and rstd saved per row
        ({"y": rx.layer_norm(x + b), "s": rx.softmax(x)}, "11", ((6, 9), (9,))),
        # cross-entropy: integer targets need no gradient; each row's logsumexp saved
        (rx.cross_entropy(x, b), "10", ((7, 11), (7,))),
    ],
)
def test_the_saving_op_is_opchecked(outputs, needs, shapes):
    """Schema, fake, autograd registration and AOT tracing at fixed sizes. Not
    ``test_aot_dispatch_dynamic``: at symbolic sizes AOT autograd replaces the op by
    ``rtxdsl::kernel`` (no statistics), which that check sees as different outputs; the
    symbolic path is tested end to end above."""
    from rtxdsl.torchop import saving_op

    k = rx.compile(outputs)
    gen = torch.Generator().manual_seed(0)
    ins = [torch.randn(*shapes[0], generator=gen, requires_grad=True)]
    ins.append(torch.randn(*shapes[1], generator=gen, requires_grad=True) if needs == "11" else
               torch.randint(0, shapes[0][1], shapes[1], generator=gen))  # fmt: skip
    checks = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static")
    torch.library.opcheck(saving_op, (k.op_key, needs, ins), test_utils=checks)


#: kernels whose results torch's reference lays out otherwise than the kernel does, by input:
#: (expression, inputs from a (9, 6) transposed ``t``, a contiguous ``c`` and a bias ``v``)
LAYOUTS = {
    "pointwise_of_a_transposed_input": (rx.gelu(x + b), "tv"),  # torch keeps the input's order
    "an_input_as_an_output": ({"y": x, "z": x * 2.0}, "t"),  # the kernel hands the input itself back
    "a_view_of_an_input": (rx.reshape(x, (54,)), "c"),  # no kernel: the input's memory
    "a_transpose": (rx.transpose(x, 0, 1) * 2.0, "c"),  # torch: a transposed result
    "row_statistics_of_a_transposed_input": ({"y": rx.layer_norm(x + b), "s": rx.softmax(x)}, "tv"),
    "a_residual_and_its_norm": ({"h": x + b, "y": rx.rms_norm(x + b, None, 1e-6)}, "tc"),
}


@pytest.mark.parametrize("case", LAYOUTS)
def test_every_op_returns_the_layout_its_fake_states(case):
    """One rule lays out every output of every rtxdsl op, real and fake (``torchop.op_outputs``: a
    contiguous tensor of its own), so Inductor's stride assertions after an opaque op hold: the
    fakes ran the torch reference, whose layout follows the inputs' (a transposed input gave a
    transposed fake, the kernel a contiguous result), and a real call could return an input or a
    view of one (which a custom op may not)."""
    from rtxdsl.torchop import kernel_grad_op, kernel_op, saving_op

    expr, kinds = LAYOUTS[case]
    gen = torch.Generator().manual_seed(0)
    made = {"t": torch.randn(6, 9, generator=gen).t(), "c": torch.randn(9, 6, generator=gen)}
    made["v"] = torch.randn(6, generator=gen)
    k = rx.compile(expr)
    ins = [made[c] for c in kinds]
    result = k(*ins)
    cotangents = [torch.ones_like(r) for r in ([result] if k.returns_tensor else result.values())]
    ops = [
        (kernel_op, (k.op_key, ins)),
        (k.torch_op, tuple(ins)),
        (saving_op, (k.op_key, "1" * len(ins), [t.detach().requires_grad_() for t in ins])),
        (kernel_grad_op, (k.op_key, ins, cotangents)),
    ]
    for op, args in ops:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_the_graph_run_computes_what_the_call_does():
    """The launches a CUDA graph holds, run here eagerly under the interpreter: allocation, the
    tail's per-call counter and argument order are the call's own."""
    z_loss = rx.compile(rx.sum(rx.logsumexp(x, -1) ** 2))  # rows, then the sum as their tail
    norms = rx.compile({"y": rx.layer_norm(x + b), "s": rx.softmax(x)})
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 11, generator=gen)
    rows, bias = torch.randn(5, 13, generator=gen).t(), torch.randn(5, generator=gen)  # transposed
    assert any(buf.persistent for buf in z_loss.program(logits).buffers)  # a tail's counter
    for kernel, ins in ((z_loss, (logits,)), (norms, (rows, bias))):
        run = kernel._graph_run(ins, kernel.config, interpret=True)
        for _ in range(2):  # twice: the tail's counter starts at zero on every call
            got, want = run(ins), kernel(*ins)
            if isinstance(want, dict):
                for key in want:
                    torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-6)
            else:
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert z_loss.graph_run((logits,)) is None  # CPU tensors: the opaque op


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor runs user Triton kernels on CUDA only")
def test_inductor_on_cuda_runs_the_generated_kernels_with_their_gradients():
    from torch._inductor.utils import run_and_get_code

    k = rx.compile({"y": rx.layer_norm(x + b), "s": rx.softmax(x)})
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(64, 1000, device="cuda", generator=gen, requires_grad=True)
    c = torch.randn(1000, device="cuda", generator=gen, requires_grad=True)
    compiled = torch.compile(lambda p, q: k(p, q)["y"].square().sum() + k(p, q)["s"][:, 0].sum(), fullgraph=True)
    loss, (code, *_) = run_and_get_code(compiled, a, c)
    assert "row_add_" in code  # the generated kernel, in Inductor's output module
    want = F.layer_norm(a + c, (1000,)).square().sum() + a.softmax(-1)[:, 0].sum()
    torch.testing.assert_close(loss, want, atol=1e-3, rtol=1e-4)
    got = torch.autograd.grad(loss, (a, c))
    for g, w in zip(got, torch.autograd.grad(want, (a, c))):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


# ---- CUDA graphs: the cached call neither synchronizes nor allocates beyond its outputs -------------
def test_the_cached_call_path_allocates_outputs_only_and_never_synchronizes():
    """What CUDA-graph capture needs, read off the generated per-layout ``run`` (CPU): one
    allocation per buffer the program declares, launches, a counter update; no host reads."""
    for w in WORKLOADS:
        k = rx.compile(w.expr())
        ins = w.inputs(3, 64, w.dtype, torch.device("cpu"), torch.Generator().manual_seed(0))
        launch = k._launch_for((), ins)
        body = launch.source.splitlines()[1:]
        allocations = [ln for ln in body if " = empty" in ln or " = zeros" in ln]
        kept = [ln for ln in body if " = KEPT" in ln]  # a tail's counter: allocated once (per stream)
        assert len(kept) == sum(1 for b in launch.program.buffers if b.persistent)
        assert len(allocations) + len(kept) == len(launch.program.buffers), launch.source
        flags = sum(1 for b in launch.program.buffers if b.zero)
        host_reads = [ln for ln in body if "CHECK" in ln]  # a flag read: only for gathers' index checks
        assert len(host_reads) == sum(1 for c in launch.program.launched if c.checks), launch.source
        assert flags == len(host_reads) or not flags
        assert not any(s in launch.source for s in (".item(", ".cpu(", ".tolist(", "synchronize")), launch.source


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_a_workload_is_captured_in_a_cuda_graph_and_replayed():
    x, w, b = rx.var("x"), rx.var("w"), rx.var("b")
    k = rx.compile({"y": rx.layer_norm(x + b, w, b), "s": rx.softmax(x)})
    static = {n: torch.randn(s, device="cuda") for n, s in (("x", (64, 1000)), ("w", (1000,)), ("b", (1000,)))}
    k(**static)  # compiles and prepares the launch outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = k(**static)
    for _ in range(3):
        static["x"].copy_(torch.randn(64, 1000, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        want = F.layer_norm(static["x"] + static["b"], (1000,), static["w"], static["b"])
        torch.testing.assert_close(out["y"], want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out["s"], static["x"].softmax(-1), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_a_tail_kernel_replays_in_a_cuda_graph():
    """Cross-entropy's mean runs in the row kernel's last program; its counter must be back at
    zero after every replay (no index-flag read: check_indices=False, as capture requires)."""
    k = rx.compile(rx.cross_entropy(rx.var("x"), rx.var("t")), config=rx.FusionConfig(check_indices=False))
    static = {"x": torch.randn(4096, 1000, device="cuda"), "t": torch.randint(0, 1000, (4096,), device="cuda")}
    k(**static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = k(**static)
    for _ in range(3):
        static["x"].copy_(torch.randn(4096, 1000, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, F.cross_entropy(static["x"], static["t"]), atol=1e-5, rtol=1e-5)


def test_compiled_graphs_name_kernels_by_structure_the_same_in_every_process():
    """torch's on-disk compile caches replay graphs in later processes: the kernel a graph names
    must be the same structure there, and an unknown name fails loudly (never another kernel)."""
    import subprocess
    import sys

    from rtxdsl.torchop import kernel_op

    k = rx.compile(rx.gelu(x + b))
    assert rx.compile(rx.gelu(x + b)).op_key == k.op_key != rx.compile(rx.gelu(x - b)).op_key
    code = "import rtxdsl as rx; x, b = rx.var('x'), rx.var('b'); print(rx.compile(rx.gelu(x + b)).op_key)"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == k.op_key
    with pytest.raises(rx.RtxError, match="which this process has not built"):
        kernel_op("k_0000000000000000", [torch.ones(2)])


def test_a_kernel_stays_callable_when_another_of_its_structure_dies():
    """Two kernels of one structure share a key: the second one dying (garbage collected while the
    first is still in use) must leave the key reachable. It was forgotten, and the first kernel's
    calls inside torch.compile failed with "not built" (order-dependent: it hit CI once)."""
    import gc

    first = rx.compile(rx.softmax(x * 3.0))
    second = rx.compile(rx.softmax(x * 3.0))
    assert first is not second and first.op_key == second.op_key
    del second
    gc.collect()
    t = torch.randn(5, 8, requires_grad=True)
    compiled = torch.compile(lambda a: first(x=a), fullgraph=True, backend="eager", dynamic=True)
    out = compiled(t)
    out.sum().backward()
    torch.testing.assert_close(out, torch.softmax(t.detach() * 3.0, -1))


@pytest.mark.slow  # two fresh processes compiling with Inductor: ~40 s on 2 cores
def test_a_compiled_training_step_reloaded_from_torchs_disk_cache_in_another_process(tmp_path):
    """A replaced model compiled by Inductor (forward, backward, SGD step) in a fresh process, then
    again in a second one sharing its ``TORCHINDUCTOR_CACHE_DIR``: the second loads both graphs from
    the FX graph cache, their stride assertions included, and must compute exactly what the first
    did (both as the unmodified model does eagerly). The fakes stated other strides than the
    kernels return, so the first process failed Inductor's assertion and the cache kept the
    wrong ones."""
    script = Path(__file__).parent / "helpers" / "compiled_step.py"
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",  # no pool of compile workers to start (each imports torch)
    }
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}.pt"
        res = subprocess.run(
            [sys.executable, str(script), str(out)], capture_output=True, text=True, env=env, timeout=400
        )
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(torch.load(out))
    first, second = runs
    assert first["counters"]["inductor"].get("fxgraph_cache_miss") == 2, first["counters"]  # forward, backward
    assert second["counters"]["inductor"].get("fxgraph_cache_hit") == 2, second["counters"]
    assert not second["counters"]["inductor"].get("fxgraph_cache_miss"), second["counters"]
    torch.testing.assert_close(second["compiled"], first["compiled"], atol=0, rtol=0)
    torch.testing.assert_close(first["compiled"], first["eager"], atol=2e-6, rtol=2e-5)


# ---- every rx.nn module compiled whole, in training ------------------------------------------------
class _EveryModule(torch.nn.Module):
    """One call of every rx.nn module, and of every option that makes its forward pick another kernel
    at call time (RMSNorm's promoted result dtype, LinearCrossEntropyLoss's bias, JSD's labels)."""

    def __init__(self, dim: int = 8, vocab: int = 11) -> None:
        super().__init__()
        self.ln, self.rms = rx.nn.LayerNorm(dim), rx.nn.RMSNorm(dim, eps=1e-6)
        self.rms_promote = rx.nn.RMSNorm(dim, eps=1e-6, promote=True)  # Llama's: weight * x.to(input dtype)
        self.rms_gemma = rx.nn.RMSNorm(dim, offset=1.0, promote=True)  # Gemma's 1 + w, torch's eps
        self.add_rms = rx.nn.AddRMSNorm(dim)
        self.swiglu, self.geglu = rx.nn.SwiGLU(dim, 2 * dim), rx.nn.GeGLU(dim, 2 * dim)
        self.gate_up, self.head = rx.nn.GateUpMLP(dim, 2 * dim), torch.nn.Linear(dim, vocab)
        self.ce = rx.nn.CrossEntropyLoss(ignore_index=3, label_smoothing=0.1, reduction="sum")
        self.ce_z = rx.nn.CrossEntropyLoss(z_loss=1e-2, return_z_loss=True, return_token_accuracy=True)
        self.lce = rx.nn.LinearCrossEntropyLoss(label_smoothing=0.1, softcap=30.0, ignore_index=2)
        self.dyt, self.poly, self.sparsemax = rx.nn.DyT(dim), rx.nn.PolyNorm(), rx.nn.Sparsemax()
        self.group, self.kl = rx.nn.GroupNorm(2, dim), rx.nn.KLDivLoss(reduction="batchmean", log_target=True)
        self.jsd, self.tvd = rx.nn.JSD(beta=0.3), rx.nn.TVDLoss()

    def forward(self, x: torch.Tensor, r: torch.Tensor, t: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {"ln": self.ln(x), "rms": self.rms(x), "promote": self.rms_promote(x), "gemma": self.rms_gemma(x)}
        out["add_rms"], out["residual"] = self.add_rms(x, r)
        out.update(swiglu=self.swiglu(x), geglu=self.geglu(x), gate_up=self.gate_up(x))
        logits = self.head(x)
        w, b = self.head.weight.to(logits.dtype), self.head.bias.to(logits.dtype)  # autocast's, for a linear
        out["ce"] = self.ce(logits, t)
        out["ce_z"], out["z"], out["accuracy"] = self.ce_z(logits, t)
        out.update(lce=self.lce(x.to(w.dtype), w, t), lce_bias=self.lce(x.to(w.dtype), w, t, b))
        p, q = logits.float().log_softmax(-1), r.float().repeat(1, 2)[:, :11].log_softmax(-1)
        out["jsd"] = self.jsd(p, q, t)
        if x.dtype != torch.float32:  # the rest once (their kernels pick nothing by dtype: time)
            return out
        out.update(dyt=self.dyt(x), poly=self.poly(x), sparsemax=self.sparsemax(x), group=self.group(x.view(2, 8, -1)))
        out.update(kl=self.kl(p, q), tvd=self.tvd(p.exp(), q.exp()))
        return out


def _every_module_step(module: torch.nn.Module, dtype: torch.dtype, seed: int) -> tuple[dict, dict]:
    """Forward and backward of every output, under bf16 autocast for bf16 (fp32 weights, bf16
    activations); the outputs and the input and parameter gradients."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 8, generator=gen).to(dtype).requires_grad_()
    r, t = torch.randn(6, 8, generator=gen).to(dtype), torch.tensor([1, 3, 2, 0, 10, 3])
    with torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = module(x, r, t)
    sum(v.float().sum() for v in out.values() if v.requires_grad).backward()
    params = module._orig_mod if hasattr(module, "_orig_mod") else module
    grads = {"x": x.grad} | {n: p.grad for n, p in params.named_parameters()}
    params.zero_grad(set_to_none=True)
    return out, grads


def test_every_rx_nn_module_compiles_whole_in_training():
    """``torch.compile(fullgraph=True)`` of every rx.nn module in training, forward and backward, in
    fp32 and in bf16 activations with fp32 weights (autocast), against the uncompiled modules: one
    Dynamo compile (one forward and one backward graph) per dtype, none again for new values. A
    forward that asked an ``lru_cache``'d factory for a kernel (RMSNorm(promote=True) when the
    result's dtype is not the input's, LinearCrossEntropyLoss with a bias, JSD with labels) broke
    the trace: Dynamo traces into the cache and cannot build a kernel. Every kernel a forward can
    pick is now made with the module (rtxdsl.nn.memo). ~25 s on 2 cores, most of it Dynamo and AOT
    tracing."""
    from aot_checked import fake_checked

    torch.manual_seed(0)
    module = _EveryModule().train()
    checked, graphs = [], []
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend=fake_checked(checked, graphs))
    for n, dtype in enumerate((torch.float32, torch.bfloat16), start=1):
        want, want_grads = _every_module_step(module, dtype, 1)
        got, got_grads = _every_module_step(compiled, dtype, 1)
        assert len(graphs) == 2 * n  # this dtype's forward and backward
        for key, value in want.items():
            assert got[key].dtype == value.dtype, key
            torch.testing.assert_close(got[key], value, msg=key)
        torch.testing.assert_close(got_grads, want_grads)
    assert want["promote"].dtype == torch.float32 and want["swiglu"].dtype == torch.bfloat16
    _every_module_step(compiled, torch.float32, 2)  # new values of a dtype compiled for: no compile
    assert len(graphs) == 4
    assert {"rtxdsl.kernel_saving.default", "rtxdsl.kernel.default"} <= set(checked)


# which inputs visibly require grad when Dynamo traces the call: one (the other filled in place), none
@pytest.mark.parametrize("a_grad", [True, False], ids=["one-visible", "none-visible"])
def test_a_kernel_input_filled_in_place_gets_its_gradient_under_compile(a_grad):
    """Dynamo's fake tensors report ``requires_grad=False`` for a tensor made by ``new_empty`` and
    filled by ``copy_`` into slices (DeepSeek-V3's attention key): its gradient was lost under
    torch.compile (kv_a_proj_with_mqa's gradient 2e-3 off; outside HF probe). Every floating input
    of a differentiated call now gets one; autograd keeps those it needs."""
    k = rx.compile(rx.var("a") * rx.var("b"))

    def f(a, b0):
        b = a.new_empty(b0.shape)
        b[..., :2].copy_(b0[..., :2] * 2)
        b[..., 2:].copy_(b0[..., 2:] * 3)
        return k(a=a, b=b)

    gen = torch.Generator().manual_seed(0)
    a, b0 = torch.randn(3, 5, generator=gen, requires_grad=a_grad), torch.randn(3, 5, generator=gen, requires_grad=True)
    want = torch.autograd.grad(f(a, b0).sum(), b0)
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(a, b0).sum(), b0)
    torch.testing.assert_close(got, want)
