"""Hugging Face models fused by one call: ``rx.nn.replace_modules`` on tiny configs of each family,
logits, loss and every gradient against the unmodified model (skipped without ``transformers``:
``pip install -e ".[hf]"``; CI installs it)."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

import rtxdsl as rx

pytest.importorskip("transformers", reason="transformers not installed (pip install -e '.[hf]')")

from benches.hf_report import FAMILIES, LAYERS, tiny_model  # noqa: E402 (after the skip)

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
