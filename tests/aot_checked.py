"""The torch.compile test backend: AOT autograd (Inductor's partitioner) whose graphs run under an
FX interpreter checking each rtxdsl op's real outputs against the fakes it was traced with, without
Inductor's C++ code generation (slow on CPU). Used by test_hf.py and test_torch_compile.py."""

from __future__ import annotations

import torch
from torch._C._dynamo.guards import assert_size_stride


class FakeChecked(torch.fx.Interpreter):
    """Runs an AOT autograd graph checking each rtxdsl op's real outputs against the fakes it was
    traced with (``assert_size_stride``, what Inductor's generated code runs after an opaque op,
    and the dtype); ``checked`` collects the op names."""

    def __init__(self, gm: torch.fx.GraphModule, checked: list[str]) -> None:
        super().__init__(gm)
        self.checked = checked

    def run_node(self, n: torch.fx.Node):
        out = super().run_node(n)
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "rtxdsl":
            fakes = n.meta["val"]
            for got, fake in zip(*((v if isinstance(v, (list, tuple)) else [v]) for v in (out, fakes))):
                assert got.dtype == fake.dtype, f"{n.target}: {got.dtype} != {fake.dtype}"
                assert_size_stride(got, tuple(fake.shape), tuple(fake.stride()), str(n.target))
            self.checked.append(str(n.target))
        return out


def fake_checked(checked: list[str], graphs: list[torch.fx.GraphModule]):
    """A torch.compile backend: AOT autograd with Inductor's partitioner, graphs run by FakeChecked;
    ``graphs`` collects every graph compiled (a forward and a backward per Dynamo compile)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(lambda *args: FakeChecked(gm, checked).run(*args))

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, partition_fn=min_cut_rematerialization_partition)
