"""Hugging Face models fused by one call: ``rx.nn.replace_modules`` on tiny configs of each family,
logits, loss and every gradient against the unmodified model (skipped without ``transformers``:
``pip install -e ".[hf]"``; CI installs it)."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch._C._dynamo.guards import assert_size_stride

import rtxdsl as rx

pytest.importorskip("transformers", reason="transformers not installed (pip install -e '.[hf]')")

import benches.hf_report as hf_report  # noqa: E402 (after the skip)
from benches.hf_report import FAMILIES, LAYERS, tiny_model  # noqa: E402

#: what replace_modules must find per layer besides the final norm and the loss
NORMS_PER_LAYER = {"qwen3": 4, "gemma2": 4, "gemma3": 6}
NO_MLP = {"mixtral"}  # experts are a sparse mixture: only its norms, rotary and loss are fused


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replace_modules_fuses_a_hugging_face_model_and_changes_nothing_it_computes(family):
    model = tiny_model(family)
    fused = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing norm- or MLP-like left unrecognised
        n = rx.nn.replace_modules(fused)
    want = {"rms_norm": NORMS_PER_LAYER.get(family, 2) * LAYERS + 1, "rope": LAYERS, "loss": 1}
    if family not in NO_MLP:
        want["mlp"] = LAYERS
    assert n.by_kind == want and n == sum(want.values())
    assert fused.state_dict().keys() == model.state_dict().keys()  # checkpoints load both ways
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    out0, out1 = model(input_ids=ids, labels=ids), fused(input_ids=ids, labels=ids)
    out0.loss.backward()
    out1.loss.backward()
    torch.testing.assert_close(out1.logits, out0.logits, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(out1.loss, out0.loss, atol=2e-6, rtol=2e-6)
    for (name, p0), p1 in zip(model.named_parameters(), fused.parameters()):
        torch.testing.assert_close(p1.grad, p0.grad, atol=2e-6, rtol=2e-5, msg=name)
    again = rx.nn.replace_modules(fused)  # idempotent: its own modules are left as they are
    assert again.by_kind.keys() <= {"rope", "loss"}


def test_replaced_llama_in_bf16_and_generate_agree():
    model = tiny_model("llama", torch.bfloat16)
    fused = copy.deepcopy(model)
    rx.nn.replace_modules(fused)
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, fused(input_ids=ids).logits
        assert b.dtype == a.dtype == torch.bfloat16
        torch.testing.assert_close(b.float(), a.float(), atol=3e-2, rtol=3e-2)
        kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
        fused_tokens = fused.generate(ids, **kw)
    assert fused_tokens.shape == (1, 9)


def test_replaced_models_copy_and_pickle():
    fused = tiny_model("gemma")
    rx.nn.replace_modules(fused)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        want = fused(input_ids=ids).logits
        for clone in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
            torch.testing.assert_close(clone(input_ids=ids).logits, want)


class _ShapesSeen(torch.utils._python_dispatch.TorchDispatchMode):
    """Every tensor shape an aten op returns while the mode is on (our kernels' buffers included)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen2"])
def test_training_without_logits_never_makes_a_tokens_by_vocabulary_tensor(family):
    """``replace_modules(model, logits=False)``: the loss from the hidden states (Gemma 2's logit
    softcap included), the same loss and gradients as the unmodified model, and no tensor of
    tokens x vocabulary anywhere in the forward and backward."""
    model = tiny_model(family)
    fused = copy.deepcopy(model)
    assert rx.nn.replace_modules(fused, logits=False).by_kind["loss"] == 1
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    out0 = model(input_ids=ids, labels=ids)
    out0.loss.backward()
    vocab, tokens = out0.logits.shape[-1], ids.numel()
    with _ShapesSeen() as seen:
        out1 = fused(input_ids=ids, labels=ids)
        out1.loss.backward()
    assert out1.logits is None
    big = [s for s in seen.shapes if s and s[-1] == vocab and torch.Size(s).numel() >= tokens * vocab // 2]
    assert not big, f"tensors of the logits' size were made: {big[:3]}"
    torch.testing.assert_close(out1.loss, out0.loss, atol=2e-6, rtol=2e-6)
    for (name, p0), p1 in zip(model.named_parameters(), fused.parameters()):
        torch.testing.assert_close(p1.grad, p0.grad, atol=2e-6, rtol=2e-5, msg=name)
    with torch.no_grad():  # without labels: the logits, as before
        torch.testing.assert_close(fused(input_ids=ids).logits, model(input_ids=ids).logits, atol=2e-6, rtol=2e-6)
    clone = pickle.loads(pickle.dumps(fused))
    assert clone(input_ids=ids, labels=ids).logits is None


# ---- torch.compile training of a replaced model (issue 33, item 9) ----------------------------------
class _FakeChecked(torch.fx.Interpreter):
    """Runs an AOT autograd graph checking each rtxdsl op's real outputs against the fakes it was
    traced with (``assert_size_stride``, what Inductor's generated code runs after an opaque op,
    and the dtype), without Inductor's C++ code generation; ``checked`` collects the op names."""

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


def _fake_checked(checked: list[str], graphs: list[torch.fx.GraphModule]):
    """A torch.compile backend: AOT autograd with Inductor's partitioner, graphs run by _FakeChecked."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(lambda *args: _FakeChecked(gm, checked).run(*args))

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, partition_fn=min_cut_rematerialization_partition)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_torch_compile_trains_a_replaced_model(family, monkeypatch):
    """``torch.compile(model, fullgraph=True)`` of a replaced model (every family compiles whole):
    two SGD steps of forward with labels, backward and update against the unmodified model run
    eagerly, through one forward and one backward graph (no recompile), every rtxdsl op's real
    outputs laid out as its fake said (Inductor asserted otherwise: RoPE's q and k, transposed
    views, came back contiguous where the fake said transposed)."""
    monkeypatch.setattr(hf_report, "LAYERS", 1)  # one decoder layer holds every kernel there is
    model = tiny_model(family).train()
    fused = copy.deepcopy(model)
    rx.nn.replace_modules(fused)
    checked, graphs = [], []
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, backend=_fake_checked(checked, graphs))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, fused)]
    for seed in (5, 6):
        ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(seed))
        want, got = model(input_ids=ids, labels=ids), compiled(input_ids=ids, labels=ids)
        want.loss.backward()
        got.loss.backward()
        torch.testing.assert_close(got.logits, want.logits, atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(got.loss, want.loss, atol=2e-6, rtol=2e-6)
        for (name, p0), p1 in zip(model.named_parameters(), fused.parameters()):
            torch.testing.assert_close(p1.grad, p0.grad, atol=2e-6, rtol=2e-5, msg=name)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for (name, p0), p1 in zip(model.named_parameters(), fused.parameters()):
            torch.testing.assert_close(p1, p0, atol=2e-6, rtol=2e-6, msg=name)
    assert len(graphs) == 2  # one forward, one backward: fullgraph, and the second step reuses them
    # the forward saved its row statistics and the backward ran the fused backward kernels
    assert {"rtxdsl.kernel_saving.default", "rtxdsl.kernel.default"} <= set(checked)


def _ops_called(model: torch.nn.Module, ids: torch.Tensor, monkeypatch) -> list[tuple]:
    """The rtxdsl op each kernel call of a training step of ``model`` becomes inside torch.compile
    (``rtxdsl::kernel_saving`` where grad is on and an input requires it, else ``rtxdsl::kernel``)
    with its inputs as the call got them (their layouts and requires_grad), one per distinct call."""
    from rtxdsl.torchop import kernel_op, saving_op

    calls, call = {}, rx.Kernel.__call__

    def recording(kernel, *args, **kwargs):
        values = kernel.collect(args, kwargs)
        grad = torch.is_grad_enabled()
        ins = [v.detach().requires_grad_(grad and v.requires_grad) for v in values]
        needs = "".join("01"[t.requires_grad] for t in ins)
        layouts = tuple((t.shape, t.stride(), t.dtype) for t in ins)
        op = (saving_op, (kernel.op_key, needs, ins)) if "1" in needs else (kernel_op, (kernel.op_key, ins))
        calls.setdefault((kernel.op_key, needs, layouts), op)
        return call(kernel, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(rx.Kernel, "__call__", recording)
        model(input_ids=ids, labels=ids).loss.backward()
    return list(calls.values())


@pytest.mark.parametrize("family", ["llama", "gemma", "phi3", "qwen3"])  # every kind of module it replaces
def test_the_ops_a_replaced_model_calls_are_opchecked(family, monkeypatch):
    """``torch.library.opcheck`` of each op a replaced model's training step calls inside torch.compile,
    on the inputs it calls it with (RoPE's q and k are transposed views): schema, autograd
    registration, fake against real (shapes, strides, dtypes) and AOT tracing. Not the dynamic AOT
    check: kernel_saving becomes rtxdsl::kernel at symbolic sizes (test_torch_compile.py)."""
    monkeypatch.setattr(hf_report, "LAYERS", 1)
    model = tiny_model(family).train()
    rx.nn.replace_modules(model)
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(7))
    ops = _ops_called(model, ids, monkeypatch)
    assert any(len(args[-1][0].shape) == 4 and not args[-1][0].is_contiguous() for _, args in ops)  # q, k
    for op, args in ops:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
