"""Mixtures of experts (issue 36): ``rx.nn.moe_experts``' grouped GEMMs against a float64 loop over
tokens (transformers v5's experts, written out), forward and every gradient; the routing's tiles;
the launches and FLOPs; bad input; Hugging Face MoE families through ``replace_modules`` against
the unmodified model (skipped without ``transformers``). Their sm_90 compile facts (warpgroup MMA,
no spills) are in ``test_compiled_code.py``."""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import commit_seed

import benches.hf_report as hf_report
import rtxdsl as rx
from rtxdsl import liger
from rtxdsl.errors import RtxError
from rtxdsl.nn.moe import route

#: (dtype, atol, rtol) against float64: atol scaled by the largest expected magnitude; half
#: precision rounds the up projection's output (the activation's input) as eager does
TOLERANCES = [(torch.float32, 2e-5, 1e-5), (torch.bfloat16, 3e-2, 2e-2), (torch.float16, 4e-3, 4e-3)]

#: (tokens, hidden, intermediate, experts, top_k), each for a reason
SHAPES = [
    (7, 24, 20, 5, 2),  # odd sizes, the last expert chosen by no token (its gradients are zeros)
    (37, 16, 8, 3, 3),  # an expert with more rows than a tile (the interpreter's BLOCK_M is 32)
    (1, 8, 4, 2, 1),  # one token, top-1 routing
]


def _reference(x, gate_up, down, index, weights, act=F.silu):
    """transformers v5's experts for one token at a time (``gate_up [E, 2I, H]``, ``down [E, H, I]``)."""
    rows = []
    for t in range(x.shape[0]):
        out = x.new_zeros(x.shape[1])
        for j in range(index.shape[1]):
            e = int(index[t, j])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out = out + weights[t, j] * (down[e] @ (act(gate) * up))
        rows.append(out)
    return torch.stack(rows) if rows else x * 0  # (no tokens: still a function of x)


def _draw(gen, tokens, hidden, inter, experts, top_k, dtype, chosen=None):
    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).requires_grad_()

    chosen = chosen or experts - (top_k < experts - 1)  # leave the last expert out where top_k allows
    rows = [torch.randperm(chosen, generator=gen)[:top_k] for _ in range(tokens)]
    index = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)
    weights = torch.rand(tokens, top_k, generator=gen, dtype=torch.float64).float().requires_grad_()
    return (
        rand(tokens, hidden),
        rand(experts, 2 * inter, hidden, scale=0.3),
        rand(experts, hidden, inter, scale=0.3),
        index,
        weights,
    )


#: the activations by name, as torch computes them (the reference's)
ACTS = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu}


def _check_against_float64(x, gate_up, down, index, weights, atol, rtol, **options):
    out = rx.nn.moe_experts(x, gate_up, down, index, weights, **options)
    leaves = [t.detach().double().requires_grad_() for t in (x, gate_up, down, weights)]
    gu64, d64 = leaves[1], leaves[2]
    if options.get("transposed"):
        gu64, d64 = gu64.transpose(1, 2), d64.transpose(1, 2)
    want = _reference(leaves[0], gu64, d64, index, leaves[3], ACTS[options.get("activation", "silu")])
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), want, atol=atol * _scale(want), rtol=rtol)
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * g).sum(), (x, gate_up, down, weights), allow_unused=True)
    want_grads = torch.autograd.grad((want * g).sum(), leaves, allow_unused=True)
    for name, got, expected, leaf in zip(("x", "gate_up_proj", "down_proj", "weights"), grads, want_grads, leaves):
        expected = torch.zeros_like(leaf) if expected is None else expected  # no token: no path to it
        torch.testing.assert_close(got.double(), expected, atol=atol * _scale(expected), rtol=rtol, msg=f"d{name}")


def _scale(t: torch.Tensor) -> float:
    """The largest expected magnitude (at least 1) an absolute tolerance is scaled by."""
    return max(1.0, t.abs().max().item()) if t.numel() else 1.0


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("shape", SHAPES)
def test_moe_experts_match_float64_forward_and_every_gradient(shape, dtype, atol, rtol, gen):
    _check_against_float64(*_draw(gen, *shape, dtype), atol, rtol)


@pytest.mark.parametrize("draw", range(6))
def test_drawn_mixtures_match_float64(draw):
    """Sizes, routing and layouts drawn from the commit's seed (``RTXDSL_MOE_SEED`` reproduces):
    0 to 40 tokens, 1 to 9 experts, top-1 to top-4 (an expert chosen twice by one token, too),
    transposed or strided operands, every dtype."""
    rnd = random.Random(commit_seed("RTXDSL_MOE_SEED") * 100 + draw)
    gen = torch.Generator().manual_seed(rnd.randrange(1 << 30))
    tokens, hidden, inter = rnd.choice([0, 1, 5, 17, 40]), rnd.choice([8, 13, 32]), rnd.choice([4, 9, 16])
    experts = rnd.randint(1, 9)
    top_k = rnd.randint(1, min(experts, 4))
    dtype, atol, rtol = rnd.choice(TOLERANCES)
    x, gate_up, down, index, weights = _draw(gen, tokens, hidden, inter, experts, top_k, dtype, chosen=experts)
    if rnd.random() < 0.2 and top_k > 1:
        index[:, 1] = index[:, 0]  # one expert chosen twice: two rows of the sorted order for one token
    options = {}
    if rnd.random() < 0.3:
        options["transposed"] = True
        gate_up = gate_up.detach().transpose(1, 2).contiguous().requires_grad_()
        down = down.detach().transpose(1, 2).contiguous().requires_grad_()
    if rnd.random() < 0.3:
        x = torch.cat([x.detach(), x.detach()], 1)[:, ::2].requires_grad_()  # a column stride of 2
    _check_against_float64(x, gate_up, down, index, weights, atol, rtol, **options)


def test_transposed_experts_strided_tokens_and_every_activation(gen):
    x, gate_up, down, index, weights = _draw(gen, 9, 16, 12, 4, 2, torch.float32)
    wide = torch.randn(9, 40, generator=gen).requires_grad_()
    strided = wide[:, 3:19]  # hidden states a slice of a wider tensor (row stride 40)
    for activation in ("gelu_tanh", "gelu"):  # the epilogues' activations and their gradients
        _check_against_float64(strided, gate_up, down, index, weights, 2e-5, 1e-5, activation=activation)
        for dtype, atol, rtol in TOLERANCES[1:]:
            half = [t.detach().to(dtype).requires_grad_() for t in (strided, gate_up, down)]
            _check_against_float64(*half, index, weights, atol, rtol, activation=activation)
    # gpt-oss's layout: gate_up_proj [E, H, 2I], down_proj [E, I, H]
    t_gate_up = gate_up.detach().transpose(1, 2).contiguous().requires_grad_()
    t_down = down.detach().transpose(1, 2).contiguous().requires_grad_()
    _check_against_float64(strided, t_gate_up, t_down, index, weights, 2e-5, 1e-5, transposed=True)


def test_an_expert_no_token_chose_gets_zero_gradients_and_no_tokens_give_empty_results(gen):
    x, gate_up, down, index, weights = _draw(gen, 6, 8, 8, 4, 2, torch.float32, chosen=2)
    rx.nn.moe_experts(x, gate_up, down, index, weights).sum().backward()
    assert gate_up.grad[2:].abs().max() == 0 and down.grad[2:].abs().max() == 0
    assert gate_up.grad[:2].abs().min() > 0
    empty = x[:0].detach().requires_grad_()
    out = rx.nn.moe_experts(empty, gate_up, down, index[:0], weights[:0])
    assert out.shape == (0, 8)
    out.sum().backward()
    assert empty.grad.shape == (0, 8)


def test_leading_dims_and_the_torch_backend_agree(gen):
    x, gate_up, down, index, weights = _draw(gen, 12, 8, 6, 3, 2, torch.float32)
    got = rx.nn.moe_experts(x.view(3, 4, 8), gate_up, down, index.view(3, 4, 2), weights.view(3, 4, 2))
    before = rx.get_config()
    rx.set_config(rx.FusionConfig(backend="torch"))
    try:
        eager = rx.nn.moe_experts(x, gate_up, down, index, weights)
    finally:
        rx.set_config(before)
    want = _reference(x.double(), gate_up.double(), down.double(), index, weights.double())
    assert got.shape == (3, 4, 8)
    torch.testing.assert_close(got.reshape(12, 8).double(), want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(eager.double(), want, atol=2e-5, rtol=1e-5)


def test_routing_tiles_cover_every_row_once_and_share_an_expert(gen):
    for tokens, experts, top_k, block in ((50, 7, 2, 8), (3, 16, 1, 4), (64, 2, 2, 32)):
        index = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
        r = route(index, experts, block)
        flat = index.reshape(-1)
        assert torch.equal(flat[r.order], flat[r.order].sort().values)  # sorted by expert
        assert torch.equal(r.tokens.long(), r.order // top_k)
        assert torch.equal(r.positions.reshape(-1)[r.order], torch.arange(tokens * top_k, dtype=torch.int32))
        covered = torch.zeros(tokens * top_k, dtype=torch.int64)
        for e, lo, hi in zip(r.tile_expert.tolist(), r.tile_lo.tolist(), r.tile_hi.tolist()):
            assert 0 <= hi - lo <= block
            if hi > lo:
                assert (flat[r.order[lo:hi]] == e).all()
                covered[lo:hi] += 1
        assert (covered == 1).all()
        assert torch.equal(r.bounds.diff().long(), torch.bincount(flat, minlength=experts))


def test_launches_and_flops(gen):
    """Forward: the up projection with ``act(gate) * up`` in its epilogue, the down projection, the
    combine (routing is torch ops); backward: the down projection's input gradient with the
    activation's and the routing weights' gradients in its epilogue, the up projection's and its
    combine, two segment GEMMs. FLOPs: the GEMMs' and the combines' adds, exactly."""
    tokens, hidden, inter, experts, top_k = 10, 16, 8, 4, 2
    x, gate_up, down, index, weights = _draw(gen, tokens, hidden, inter, experts, top_k, torch.float32)
    rx.reset_fusion_stats()
    out = rx.nn.moe_experts(x, gate_up, down, index, weights)
    fwd = rx.fusion_stats()
    rows = tokens * top_k
    gemms = 2 * rows * hidden * 2 * inter + 2 * rows * inter * hidden
    assert fwd.kernels_launched == 3
    assert fwd.flops == gemms + rows * hidden
    rx.reset_fusion_stats()
    out.sum().backward()
    bwd = rx.fusion_stats()
    assert bwd.kernels_launched == 5
    assert bwd.flops == 2 * gemms + rows * hidden


def test_frozen_experts_run_no_weight_gradient_gemm(gen):
    """Experts frozen (LoRA-style fine-tuning of the rest): the backward runs neither segment GEMM,
    3 launches; tokens frozen too (only the routing weights learn): the up projection's input
    gradient and its combine go as well, 1 launch."""
    x, gate_up, down, index, weights = _draw(gen, 9, 16, 8, 4, 2, torch.float32)
    x, gate_up, down = (t.detach() for t in (x, gate_up, down))
    cot = _reference(x, gate_up, down, index, weights).detach()  # a cotangent of the output's scale
    for learns, launches in (((True, False, False), 3), ((False, False, False), 1)):  # x, gate_up, down
        ins = [t.detach().requires_grad_(g) for t, g in zip((x, gate_up, down), learns)]
        w = weights.detach().requires_grad_()
        out = rx.nn.moe_experts(*ins, index, w)
        rx.reset_fusion_stats()
        (out * cot).sum().backward()
        assert rx.fusion_stats().kernels_launched == launches
        assert [t.grad is not None for t in ins] == list(learns)
        ref_w = weights.detach().double().requires_grad_()
        (_reference(x.double(), gate_up.double(), down.double(), index, ref_w) * cot.double()).sum().backward()
        torch.testing.assert_close(w.grad.double(), ref_w.grad, atol=1e-4, rtol=1e-5)


def test_the_experts_ops_are_opchecked(gen):
    """``rtxdsl::moe_experts`` (what torch.compile sees): schema, fake against real (shapes, strides:
    the outputs are contiguous whatever the inputs' layouts) and autograd registration, on
    transposed expert matrices and strided tokens, with every input's gradient and with frozen ones."""
    from rtxdsl.nn.moe import experts_op

    x, gate_up, down, index, weights = _draw(gen, 7, 16, 8, 3, 2, torch.float32)
    wide = torch.randn(7, 32, generator=gen)[:, ::2]  # strided tokens
    gu, dn = gate_up.transpose(1, 2), down.transpose(1, 2).contiguous()  # [E, K, N]: a view, a copy
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    for grads in ((True, True, True, True), (True, False, False, True)):
        ins = [t.detach().requires_grad_(g) for t, g in zip((wide, gu, dn), grads)]
        args = (*ins, index, weights.detach().requires_grad_(grads[3]), "silu")
        torch.library.opcheck(experts_op, args, test_utils=checks)


@pytest.mark.parametrize(
    "change, fault",
    [
        (lambda a: a.update(index=a["index"] + 4), "top_k_index holds an expert outside"),
        (lambda a: a.update(index=a["index"].float()), "top_k_index must be int32/int64"),
        (lambda a: a.update(weights=a["weights"][:, :1]), "top_k_weights must be floating"),
        (lambda a: a.update(down=a["down"][:, :, :3]), "down_proj"),
        (lambda a: a.update(gate_up=a["gate_up"][:, :, :5]), "gate_up_proj"),
        (lambda a: a.update(x=a["x"].double()), "hidden_states"),
    ],
)
def test_bad_input_names_the_input(change, fault, gen):
    x, gate_up, down, index, weights = _draw(gen, 5, 8, 4, 4, 2, torch.float32)
    args = {"x": x, "gate_up": gate_up, "down": down, "index": index, "weights": weights}
    change(args)
    with pytest.raises(RtxError, match=fault):
        rx.nn.moe_experts(args["x"], args["gate_up"], args["down"], args["index"], args["weights"])
    with pytest.raises(RtxError, match="activation must be one of"):
        rx.nn.moe_experts(x, gate_up, down, index, weights, activation="relu")


def test_liger_experts_reads_liger_s_config_names(gen):
    config = SimpleNamespace(
        num_experts=3, moe_intermediate_size=6, intermediate_size=99, hidden_size=8, hidden_act="silu"
    )
    m = liger.LigerExperts(config)
    assert m.gate_up_proj.shape == (3, 12, 8) and m.down_proj.shape == (3, 8, 6)
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(3, 12, 8, generator=gen) * 0.3)
        m.down_proj.copy_(torch.randn(3, 8, 6, generator=gen) * 0.3)
    x, index, weights = (
        torch.randn(2, 5, 8, generator=gen),
        torch.randint(0, 3, (2, 5, 1), generator=gen),
        torch.rand(2, 5, 1),
    )
    want = _reference(x.reshape(10, 8).double(), m.gate_up_proj.double(), m.down_proj.double(), index.reshape(10, 1),
                      weights.reshape(10, 1).double())  # fmt: skip
    torch.testing.assert_close(m(x, index, weights).reshape(10, 8).double(), want, atol=2e-5, rtol=1e-5)
    with pytest.raises(RtxError, match="hidden_act"):
        liger.LigerExperts(SimpleNamespace(num_local_experts=2, intermediate_size=4, hidden_size=8, hidden_act="relu"))


# ---- Hugging Face mixtures of experts -------------------------------------------------------------
def _tiny(family: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    pytest.importorskip("transformers", reason="transformers not installed (pip install -e '.[hf]')")
    return hf_report.tiny_model(family, dtype)


@pytest.mark.parametrize("family", ["mixtral", *sorted(hf_report.MOE_FAMILIES)])
def test_hugging_face_experts_run_through_grouped_gemms_and_change_nothing(family, monkeypatch):
    model = _tiny(family)
    fused = copy.deepcopy(model)
    n = rx.nn.replace_modules(fused)
    assert n.by_kind["experts"] == 2
    calls = []
    original = rx.nn.moe.moe_experts
    monkeypatch.setattr(rx.nn.moe, "moe_experts", lambda *a, **k: calls.append(1) or original(*a, **k))
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    out0, out1 = model(input_ids=ids, labels=ids), fused(input_ids=ids, labels=ids)
    assert len(calls) == 2  # one grouped call per MoE layer
    out0.loss.backward()
    out1.loss.backward()
    torch.testing.assert_close(out1.logits, out0.logits, atol=2e-6, rtol=2e-6)
    for (name, p0), p1 in zip(model.named_parameters(), fused.parameters()):
        if p0.grad is not None:
            torch.testing.assert_close(p1.grad, p0.grad, atol=2e-6, rtol=2e-5, msg=name)
    if family == "mixtral":  # generate: the experts at one token a step (the routing's smallest grid)
        kw = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
        with torch.no_grad():
            assert torch.equal(fused.generate(ids[:1], **kw), model.generate(ids[:1], **kw))
    again = rx.nn.replace_modules(fused)  # routed twice: still one kernel path, the fallback kept
    assert again.by_kind["experts"] == 2


def test_experts_rtxdsl_does_not_compute_keep_their_implementation():
    """A bias, its own gating or inputs of another dtype: the implementation the model had runs."""
    model = _tiny("mixtral")
    fused = copy.deepcopy(model)
    experts = fused.model.layers[0].mlp.experts
    experts.has_bias = True  # (no bias tensors exist: a module rtxdsl refuses must not run its path)
    n = rx.nn.replace_modules(fused)
    assert n.by_kind["experts"] == 1
    experts.has_bias = False
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, model(input_ids=ids).logits, atol=2e-6, rtol=2e-6)


def test_a_bf16_mixtral_agrees_with_the_unmodified_model():
    model = _tiny("mixtral", torch.bfloat16)
    fused = copy.deepcopy(model)
    rx.nn.replace_modules(fused)
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, fused(input_ids=ids).logits
    assert b.dtype == torch.bfloat16
    torch.testing.assert_close(b.float(), a.float(), atol=3e-2, rtol=3e-2)
