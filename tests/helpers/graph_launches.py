"""What torch.compile's graph holds for rtxdsl kernels on CUDA, traced on a machine without one
(run by test_torch_compile.py in a subprocess; prints one JSON line per case).

AOT autograd traces each function on fake CUDA tensors (no device needed) with Triton in compiled
mode (TRITON_INTERPRET=0: ``@triton.jit`` gives a JITFunction, as on a GPU). Two stand-ins for
the absent GPU: Triton's active driver reports sm_90 (torch's analysis of which arguments a user
kernel writes compiles it to TTIR for that target) and the device reports an H200's 132 SMs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
from functorch.compile import aot_function, make_boxed_func  # noqa: E402
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import rtxdsl as rx  # noqa: E402
from rtxdsl.torchop import backward_of, saving_op  # noqa: E402


class _Sm90:
    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


triton.runtime.driver.set_active(_Sm90())
torch.cuda.get_device_properties = lambda device=None: SimpleNamespace(multi_processor_count=132)

x, b, w, t = rx.var("x"), rx.var("b"), rx.var("w"), rx.var("t")
NO_CHECKS = rx.FusionConfig(check_indices=False)
MODE, SYMBOLIC = FakeTensorMode(), FakeTensorMode(shape_env=ShapeEnv())


def fake(*shape: int, dtype: torch.dtype = torch.float32, symbolic: bool = False) -> torch.Tensor:
    with MODE:
        t = torch.empty(shape, dtype=dtype, device="cuda")
    if not symbolic:
        return t
    return SYMBOLIC.from_tensor(t, symbolic_context=StatelessSymbolicContext([DimDynamic.DYNAMIC] * len(shape)))


def traced(kernel, *args, **kwargs):
    """The call as Dynamo records it (``Kernel.__call__`` inside torch.compile): ``rtxdsl::kernel``."""
    return kernel._traced(args, kwargs)


def _report(graph) -> dict:
    """A graph's launches (kernel names), opaque rtxdsl ops, the arguments torch's TTIR analysis
    found written (cloned before a launch) and which of them are the graph's inputs."""
    nodes = list(graph.nodes)
    launches = [n for n in nodes if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
    placeholders = {n.name for n in nodes if n.op == "placeholder"}
    cloned = [(k, n.kwargs["kwargs"][k]) for n in launches for k in n.kwargs["tensors_to_clone"]]
    return {
        "launches": len(launches),
        "kernels": [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__ for n in launches],
        "opaque": [str(n.target) for n in nodes if str(n.target).startswith("rtxdsl.")],
        "written": sorted(k for k, _ in cloned),
        "cloned_inputs": sorted(k for k, v in cloned if getattr(v, "name", "") in placeholders),
    }


def trace(name: str, fn, inputs: tuple, expected: int) -> None:
    """Trace ``fn`` through AOT autograd and print its graph's report."""
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    with inputs[0].fake_mode:
        aot_function(fn, fw_compiler=keep)(*inputs)
    print(json.dumps({"case": name, "expected": expected, **_report(graphs[0].graph)}))


def gradients(kernel, needs: str, *inputs_then_cotangents):
    """What the backward graph of a differentiated call holds (autograd itself cannot run on fake
    CUDA tensors without CUDA): ``rtxdsl::kernel_saving``'s registered backward, on its saved
    statistics (the forward's launch stays only if the statistics are read)."""
    n = len(kernel.inputs)
    inputs, cotangents = list(inputs_then_cotangents[:n]), list(inputs_then_cotangents[n:])
    stats = saving_op(kernel.op_key, needs, inputs)[len(kernel.outputs) :]
    plan = kernel.saving_plan(tuple(inputs), needs)
    return [g for g in backward_of(plan, inputs, stats, cotangents) if g is not None]


def main() -> None:
    bias_gelu = rx.compile(rx.gelu(x + b))
    trace("pointwise", lambda a, c: traced(bias_gelu, a, c) * 2, (fake(33, 70), fake(70)), 1)
    trace("torch_op", lambda a, c: bias_gelu.torch_op(a, c), (fake(33, 70), fake(70)), 1)
    norms = rx.compile({"y": rx.layer_norm(x + b, w, b), "s": rx.softmax(x)})
    program = norms.program(x=fake(8, 4100), w=fake(4100), b=fake(4100))
    trace("two_outputs", lambda a, c, d: traced(norms, x=a, w=c, b=d)["y"], (fake(8, 4100), fake(4100), fake(4100)),
          program.kernels_launched)  # fmt: skip
    loss = rx.compile(rx.cross_entropy(x, t), config=NO_CHECKS)
    logits, targets = fake(64, 1000), fake(64, dtype=torch.int64)
    expected = loss.program(x=logits, t=targets).kernels_launched
    trace("tail", lambda a, c: traced(loss, a, c), (logits, targets), expected)
    checked = rx.compile(rx.cross_entropy(x, t))
    trace("index_checks", lambda a, c: traced(checked, a, c), (logits, targets), 0)
    trace("saving", lambda a, c: saving_op(bias_gelu.op_key, "11", [a, c]), (fake(33, 70), fake(70)), 1)
    trace("saving_tail", lambda a, c: saving_op(loss.op_key, "10", [a, c]), (logits, targets), expected)
    trace("backward", lambda a, c, g: gradients(bias_gelu, "11", a, c, g), (fake(33, 70), fake(70), fake(33, 70)), 1)
    trace("backward_tail", lambda a, c, g: gradients(loss, "10", a, c, g), (logits, targets, fake()), 2)
    symbolic = (fake(33, 70, symbolic=True), fake(70, symbolic=True))
    trace("saving_symbolic", lambda a, c: saving_op(bias_gelu.op_key, "11", [a, c]), symbolic, 0)
    trace("symbolic", lambda a, c: traced(bias_gelu, a, c), symbolic, 0)


if __name__ == "__main__":
    main()
