"""pytest-benchmark: each workload, rtxdsl against what a user would run instead.

    pytest benches/ --benchmark-only --benchmark-group-by=group

On a GPU: rtxdsl's fused kernels against eager torch and torch.compile (each call followed
by a synchronize, so the times are whole calls). On a CPU the generated kernels would run
under Triton's interpreter, whose speed means nothing, so only **host work** is compared:
rtxdsl with ``dry_run`` (every host step of a call, outputs allocated, no launch) against eager
torch's dispatch of the same ops on 1-element tensors (its compute made negligible). Groups say
which comparison they hold ("host work" on a CPU, "whole call" on a GPU).
"""

from __future__ import annotations

import pytest
import torch

import rtxdsl as rx
from benches.common import CPU_SIZES, GPU_SIZES, device
from rtxdsl.workloads import WORKLOADS

DEV = device()
CUDA = DEV.type == "cuda"
SIZES = GPU_SIZES if CUDA else CPU_SIZES
IMPLS = ["rtxdsl", "eager", "torch.compile"] if CUDA else ["rtxdsl-host(dry_run)", "eager-host(1-element)"]
MEASURES = "whole call" if CUDA else "host work"


def _tiny(ins: dict) -> dict:
    """The same inputs with every dimension cut to 1 (eager's host work without its compute)."""
    return {n: t[(slice(0, 1),) * t.dim()].clone() if isinstance(t, torch.Tensor) else t for n, t in ins.items()}


def _runner(impl: str, w, ins: dict):
    if impl.startswith("eager"):
        small = ins if CUDA else _tiny(ins)
        return lambda: w.eager(**small)
    if impl == "torch.compile":
        fn = torch.compile(w.eager)
        return lambda: fn(**ins)
    cfg = None if CUDA else rx.FusionConfig(dry_run=True)
    k = rx.compile(w.expr(), config=cfg)
    args = tuple(ins[n] for n in k.inputs)
    return lambda: k(*args)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rows, hidden", SIZES, ids=lambda v: str(v))
@pytest.mark.parametrize("w", WORKLOADS, ids=lambda w: w.name)
def test_workload(benchmark, w, rows, hidden, impl):
    ins = w.inputs(rows, hidden, w.dtype, DEV, torch.Generator().manual_seed(0))
    fn = _runner(impl, w, ins)
    fn()  # compile and cache out of the numbers
    benchmark.group = f"{MEASURES}: {w.name} {rows}x{hidden} {str(w.dtype).removeprefix('torch.')}"
    if CUDA:
        benchmark(lambda: (fn(), torch.cuda.synchronize()))
    else:
        benchmark(fn)


@pytest.mark.parametrize("impl", ["rtxdsl-lazy", "eager"])
@pytest.mark.parametrize("rows, d", [(1, 256), (64, 768)], ids=str)
def test_lazy_transformer_block(benchmark, rows, d, impl):
    """The transformer-block epilogue sequence (issue 5) as ordinary torch code on lazy tensors."""
    from benches.lazy_report import Block

    torch.manual_seed(0)
    block = Block(d).to(DEV)
    x = torch.randn(rows, d, device=DEV)
    benchmark.group = f"{MEASURES}: lazy transformer block {rows}x{d}"
    if impl == "eager":
        xe = x if CUDA else x[:1]  # 1 row on a CPU: mostly host work (the block's matmuls stay)
        fn = lambda: block(xe)  # noqa: E731
    else:
        f = rx.Fusion(None if CUDA else rx.FusionConfig(dry_run=True))
        fn = lambda: block(f.lazy(x)).torch()  # noqa: E731
    with torch.no_grad():
        fn()
        if CUDA:
            benchmark(lambda: (fn(), torch.cuda.synchronize()))
        else:
            benchmark(fn)


@pytest.mark.parametrize("impl", ["rtxdsl", "eager"] + (["torch.compile"] if CUDA else []))
@pytest.mark.parametrize("op", ["bias_gelu", "layer_norm", "rms_norm", "softmax", "swiglu"])
def test_forward_backward(benchmark, op, impl):
    """Forward + backward (issue 6); on a CPU rtxdsl runs dry (host work of both passes only)."""
    from benches.autograd_report import CASES

    expr, eager, names = CASES[op]
    rows, hidden = (4096, 4096) if CUDA else (16, 768)
    shapes = {"x": (rows, hidden), "y": (rows, hidden), "w": (hidden,), "b": (hidden,)}
    ins = {n: torch.randn(shapes[n], device=DEV, requires_grad=True) for n in names}
    go = torch.randn(rows, hidden, device=DEV)
    if impl == "rtxdsl":
        k = rx.compile(expr, config=None if CUDA else rx.FusionConfig(dry_run=True))
        fn = lambda: k(**ins).backward(go)  # noqa: E731
    else:
        f = torch.compile(eager) if impl == "torch.compile" else eager
        if not CUDA:  # host work against host work: eager on 1-element tensors
            ins = {n: t.requires_grad_() for n, t in _tiny({n: t.detach() for n, t in ins.items()}).items()}
            go = _tiny({"go": go})["go"]
        fn = lambda: f(**ins).backward(go)  # noqa: E731
    fn()
    benchmark.group = f"{MEASURES}: fwd+bwd {op} {rows}x{hidden}"
    benchmark(lambda: (fn(), torch.cuda.synchronize()) if CUDA else fn())
