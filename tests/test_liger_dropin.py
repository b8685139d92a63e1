"""rtxdsl.liger: Liger-Kernel's names, argument orders, flags and outputs, each module against a
float64 torch reference written from Liger's definition (values and gradients), and its
unsupported flags raising an error that names them."""

from __future__ import annotations

import inspect
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import FLOAT_TOLERANCES, assert_close

from rtxdsl import liger
from rtxdsl.errors import RtxError

ROWS, HIDDEN, VOCAB = 7, 24, 13  # odd rows, a hidden size of no power of two, odd classes


@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOAT_TOLERANCES)
@pytest.mark.parametrize("offset, init_fn", [(0.0, "ones"), (1.0, "zeros")], ids=["llama", "gemma"])
def test_rms_norm(dtype, atol, rtol, offset, init_fn, gen):
    m = liger.LigerRMSNorm(
        HIDDEN, eps=1e-6, offset=offset, init_fn=init_fn, casting_mode="gemma" if offset else "llama"
    )
    assert torch.equal(m.weight, torch.ones(HIDDEN) if init_fn == "ones" else torch.zeros(HIDDEN))
    m.weight.data.normal_(generator=gen)
    x = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + m.weight.double())
    assert_close(m.to(dtype)(x.to(dtype)), want, atol, rtol, "rms_norm")


def test_fused_add_rms_norm_returns_the_sum(gen):
    m = liger.LigerFusedAddRMSNorm(HIDDEN)
    h, r = torch.randn(ROWS, HIDDEN, generator=gen), torch.randn(ROWS, HIDDEN, generator=gen)
    out, total = m(h, r)
    assert_close(total, (h + r).double(), 1e-6, 1e-6, "sum")
    assert_close(out, F.rms_norm((h + r).double(), (HIDDEN,), eps=1e-6), 1e-5, 1e-5, "normed")


def test_layer_norm_has_liger_s_parameters(gen):
    m = liger.LigerLayerNorm(HIDDEN, bias=False)
    assert torch.equal(m.bias, torch.zeros(HIDDEN)) and torch.equal(m.weight, torch.ones(HIDDEN))
    x = torch.randn(ROWS, HIDDEN, generator=gen)
    assert_close(m(x), F.layer_norm(x.double(), (HIDDEN,), eps=1e-6), 1e-5, 1e-5, "layer_norm")


def test_group_norm_takes_channels_first(gen):
    m = liger.LigerGroupNorm(6, 3)  # Liger's order: (num_channels, num_groups)
    assert (m.num_channels, m.num_groups) == (6, 3)
    x = torch.randn(2, 6, 5, generator=gen)
    assert_close(m(x), F.group_norm(x.double(), 3, eps=1e-6), 1e-5, 1e-5, "group_norm")


def _ce_reference(logits, target, z, softcap=None, weight=None):
    x = logits.double() if softcap is None else softcap * torch.tanh(logits.double() / softcap)
    kept = target != -100
    lse = torch.logsumexp(x, -1)
    loss = F.cross_entropy(x, target, weight=weight)
    z_term = z * (lse[kept] ** 2).mean()
    acc = (x.argmax(-1)[kept] == target[kept]).double().mean()
    return loss + z_term, z_term, acc


def test_cross_entropy_output_object(gen):
    logits = torch.randn(ROWS, VOCAB, generator=gen)
    target = torch.tensor([1, -100, 3, 4, 12, 0, 2])
    fn = liger.LigerCrossEntropyLoss(lse_square_scale=1e-2, softcap=5.0, return_z_loss=True, return_token_accuracy=True)
    out = fn(logits, target)
    assert isinstance(out, liger.CrossEntropyOutput)
    loss, z_term, acc = _ce_reference(logits, target, 1e-2, softcap=5.0)
    assert_close(out.loss, loss, 1e-5, 1e-5, "loss")
    assert_close(out.z_loss, z_term, 1e-5, 1e-5, "z_loss")
    assert_close(out.token_accuracy, acc, 1e-6, 1e-6, "accuracy")
    assert liger.LigerCrossEntropyLoss()(logits, target).shape == ()  # no flag: a tensor, as Liger's


@pytest.mark.parametrize(("dtype", "atol", "rtol"), [(torch.float32, 2e-5, 2e-5), (torch.bfloat16, 2e-2, 2e-2)])
def test_fused_linear_cross_entropy_weight_first(dtype, atol, rtol, gen):
    h = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64)
    w = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) / HIDDEN**0.5
    b = torch.randn(VOCAB, generator=gen, dtype=torch.float64)
    target = torch.tensor([1, -100, 3, 4, 12, 0, 2])
    fn = liger.LigerFusedLinearCrossEntropyLoss(lse_square_scale=1e-3, return_z_loss=True)
    leaves = [t.to(dtype).requires_grad_() for t in (w, h, b)]
    out = fn(*leaves[:2], target, leaves[2])  # Liger's order: (lin_weight, _input, target, bias)
    assert out.loss.dtype == torch.float32  # as Liger's, for half inputs too
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    loss, z_term, _ = _ce_reference(ref_leaves[1] @ ref_leaves[0].T + ref_leaves[2], target, 1e-3)
    assert_close(out.loss, loss, atol, rtol, "loss")
    assert_close(out.z_loss, z_term, atol, rtol, "z_loss")
    got = torch.autograd.grad(out.loss, leaves)
    want = torch.autograd.grad(loss, ref_leaves)
    for name, a, e in zip(("lin_weight", "_input", "bias"), got, want):
        assert_close(a, e, atol, rtol, f"d/d{name}")


def _scaled_reference(x, target, weight, reduction, smoothing, z):
    """Liger's token scaling, from its definition: each token's loss (cross-entropy with the class
    weight and smoothing, plus the z-loss term) times its target's probability, detached (0 where
    ignored); the mean divides the cross-entropy term by the counted tokens' class weights and the
    z-loss term by their number."""
    kept = target != -100
    ce = F.cross_entropy(x, target, weight=weight, reduction="none", label_smoothing=smoothing)
    z_term = torch.where(kept, z * torch.logsumexp(x, -1) ** 2, 0)
    p = torch.where(kept, torch.softmax(x, -1).gather(1, target.clamp(min=0)[:, None])[:, 0], 0).detach()
    if reduction == "none":
        return (ce + z_term) * p, z_term * p
    ce, z_term = (ce * p).sum(), (z_term * p).sum()
    if reduction == "mean":
        mass = kept.sum() if weight is None else weight[target[kept]].sum()
        ce, z_term = ce / mass, z_term / kept.sum()
    return ce + z_term, z_term


@pytest.mark.parametrize(("dtype", "atol", "rtol"), [(torch.float32, 2e-5, 2e-5), (torch.bfloat16, 2e-2, 2e-2)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "float32-ce_weight"])
def test_fused_linear_cross_entropy_token_scaling(dtype, atol, rtol, reduction, weighted, gen):
    """use_token_scaling in the same row kernel as the loss, every term scaled; a float32
    ce_weight beside bfloat16 inputs is taken as given (Liger's test_correctness passes one)."""
    h = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64)
    w = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) / HIDDEN**0.5
    target = torch.tensor([1, -100, 3, 4, 12, 0, 2])
    cw = torch.rand(VOCAB, generator=gen) if weighted else None
    fn = liger.LigerFusedLinearCrossEntropyLoss(
        ce_weight=cw, lse_square_scale=1e-2, label_smoothing=0.1, reduction=reduction, return_z_loss=True,
        use_token_scaling=True,
    )  # fmt: skip
    leaves = [t.to(dtype).requires_grad_() for t in (w, h)]
    out = fn(*leaves, target)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    loss, z_term = _scaled_reference(
        ref_leaves[1] @ ref_leaves[0].T, target, None if cw is None else cw.double(), reduction, 0.1, 1e-2
    )
    assert out.loss.dtype == torch.float32
    assert_close(out.loss, loss, atol, rtol, "loss")
    assert_close(out.z_loss, z_term, atol, rtol, "z_loss")
    cot = torch.randn(loss.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out.loss, leaves, cot.float())
    want = torch.autograd.grad(loss, ref_leaves, cot)
    for name, a, e in zip(("lin_weight", "_input"), got, want):
        assert_close(a, e, atol, rtol, f"d/d{name}")


def test_cross_entropy_takes_a_float32_weight_beside_half_logits(gen):
    logits = torch.randn(ROWS, VOCAB, generator=gen, dtype=torch.float64)
    target = torch.tensor([1, -100, 3, 4, 12, 0, 2])
    cw = torch.rand(VOCAB, generator=gen)
    x = logits.to(torch.bfloat16).requires_grad_()
    loss = liger.LigerCrossEntropyLoss(weight=cw)(x, target)
    assert loss.dtype == torch.bfloat16  # Liger's cross-entropy keeps the logits' dtype
    ref = x.detach().double().requires_grad_()
    want = F.cross_entropy(ref, target, weight=cw.double())
    assert_close(loss, want, 8e-3, 1.6e-2, "loss")
    (g,) = torch.autograd.grad(loss, x)
    assert g.dtype == torch.bfloat16
    assert_close(g, torch.autograd.grad(want, ref)[0], 8e-3, 1.6e-2, "d/dlogits")


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_projection_losses_follow_autocast(autocast_dtype, gen):
    """Under torch.autocast the projections run in autocast's dtype, as F.linear would (a float32
    head beside half hidden states is no dtype error), and the float32 weights get float32
    gradients."""
    hs = torch.randn(ROWS, HIDDEN, generator=gen).to(autocast_dtype).requires_grad_()
    ht = torch.randn(ROWS, 2 * HIDDEN, generator=gen).to(autocast_dtype)
    ws = (torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5).requires_grad_()
    wt = torch.randn(VOCAB, 2 * HIDDEN, generator=gen) / HIDDEN**0.5
    target = torch.tensor([1, -100, 3, 4, 12, 0, 2])
    with torch.autocast("cpu", dtype=autocast_dtype):
        jsd = liger.LigerFusedLinearJSD()(hs, ws, ht, wt, target)
        ce = liger.LigerFusedLinearCrossEntropyLoss()(ws, hs, target)
    gh, gw = torch.autograd.grad(jsd + ce, (hs, ws))
    assert gh.dtype == autocast_dtype and gw.dtype == torch.float32
    with torch.autocast("cpu", dtype=autocast_dtype):
        logits_s, logits_t = hs @ ws.T, ht @ wt.T  # autocast's own casts, then the math in float64
    ref_s = logits_s.detach().double()
    kept = target != -100
    p, q = torch.softmax(ref_s, -1), torch.softmax(logits_t.double(), -1)
    m = (p + q) / 2
    want_jsd = ((0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1))[kept]).mean()
    assert_close(jsd, want_jsd, 1e-2, 2e-2, "jsd")
    assert_close(ce, F.cross_entropy(ref_s, target), 1e-2, 2e-2, "cross_entropy")


def test_fused_add_rms_norm_in_place_is_liger_s_backward_buffer(gen):
    """Liger's in_place lets its backward write dX over dY; the forward's results are new tensors
    and autograd works (rtxdsl's own in_place=True module overwrites its inputs instead)."""
    m = liger.LigerFusedAddRMSNorm(HIDDEN, in_place=True)
    h = torch.randn(ROWS, HIDDEN, generator=gen, requires_grad=True)
    r = torch.randn(ROWS, HIDDEN, generator=gen, requires_grad=True)
    out, total = m(h, r)
    (out.sum() + total.sum()).backward()
    assert h.grad is not None and r.grad is not None and m.weight.grad is not None
    assert_close(total, (h + r).double(), 1e-6, 1e-6, "sum")


def test_mlps_from_a_config(gen):
    config = types.SimpleNamespace(hidden_size=8, intermediate_size=12, hidden_act="silu")
    m = liger.LigerSwiGLUMLP(config)
    x = torch.randn(3, 8, generator=gen)
    want = m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))
    torch.testing.assert_close(m(x), want, atol=1e-5, rtol=1e-5)
    g = liger.LigerGEGLUMLP(config)
    want = g.down_proj(F.gelu(g.gate_proj(x), approximate="tanh") * g.up_proj(x))
    torch.testing.assert_close(g(x), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(RtxError, match="hidden_act"):
        liger.LigerSwiGLUMLP(types.SimpleNamespace(hidden_size=8, intermediate_size=12, hidden_act="relu"))


def test_softmax_and_relu_squared(gen):
    x = torch.randn(ROWS, VOCAB, generator=gen)
    assert_close(liger.LigerSoftmax()(x), torch.softmax(x.double(), -1), 1e-6, 1e-6, "softmax")
    assert_close(liger.LigerReLUSquared()(x), torch.relu(x.double()) ** 2, 1e-6, 1e-6, "relu_squared")


def test_apply_liger_kernel_swaps_an_instance():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    liger.apply_liger_kernel_to_llama(model=m)
    assert type(m[1]).__module__ == "rtxdsl.nn.modules"
    kept = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.RMSNorm(4, eps=1e-6))
    liger.apply_liger_kernel_to_llama(model=kept, rms_norm=False)  # Liger's flags choose what is swapped
    assert type(kept[1]) is torch.nn.RMSNorm
    with pytest.raises(RtxError, match="swigl"):
        liger.apply_liger_kernel_to_llama(model=kept, swigl=False)
    with pytest.raises(RtxError, match="cannot both be True"):
        liger.apply_liger_kernel_to_llama(model=kept, cross_entropy=True)


def test_every_liger_family_has_its_apply_function():
    """Liger-Kernel 0.8.5's 45 ``apply_liger_kernel_to_*`` names (its monkey_patch module lists them)."""
    monkey_patch = pytest.importorskip("liger_kernel.transformers.monkey_patch")
    theirs = {n for n in vars(monkey_patch) if n.startswith("apply_liger_kernel_to_")}
    assert theirs <= set(liger.__all__) and all(callable(getattr(liger, n)) for n in theirs)
    # each with Liger's parameters, order and defaults: Trainer and AutoLigerKernelForCausalLM pass only
    # the keywords a signature names (rms_norm and swiglu were **flags: dropped; outside Liger test run)
    for n in theirs:
        mine, want = inspect.signature(getattr(liger, n)), inspect.signature(getattr(monkey_patch, n))
        assert [(p.name, p.kind, p.default) for p in mine.parameters.values()] == [
            (p.name, p.kind, p.default) for p in want.parameters.values()
        ], n


def test_liger_s_defaults_and_positions_choose_what_is_swapped():
    """A flag left out is Liger's default for the family (Gemma 4's layer_norm=False keeps its layer
    norms, its RMSNorms swap); ``model`` binds where Liger's signature has it (last)."""
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.RMSNorm(4, eps=1e-6))
    liger.apply_liger_kernel_to_gemma4(model=m)
    assert type(m[1]) is torch.nn.LayerNorm and type(m[2]).__module__ == "rtxdsl.nn.modules"
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.RMSNorm(4, eps=1e-6))
    liger.apply_liger_kernel_to_llama(True, False, True, False, True, m)  # rms_norm=False, positionally
    assert type(m[1]) is torch.nn.RMSNorm
    with pytest.raises(RtxError, match="multiple values|too many"):
        liger.apply_liger_kernel_to_llama(True, False, True, True, True, m, m)


@pytest.fixture
def patched_family():
    """apply_liger_kernel_to_<family>() without a model patches transformers' classes: undone after."""
    patched: list[type] = []
    yield patched.extend
    for cls in patched:
        for attr in ("forward", "post_init", "from_pretrained"):
            f = vars(cls).get(attr)
            original = getattr(getattr(f, "__func__", f), "rtxdsl_original", None)
            if original is not None:
                setattr(cls, attr, classmethod(original) if attr == "from_pretrained" else original)


def test_a_mixture_of_experts_family_patched_by_class_runs_its_experts_through_rtxdsl(patched_family):
    """Qwen3-MoE's norms and experts swapped at construction; its loss equals the unmodified model's."""
    modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    from benches.hf_report import tiny_model

    patched_family([c for c in vars(modeling).values() if isinstance(c, type)])
    ref = tiny_model("qwen3_moe")
    liger.apply_liger_kernel_to_qwen3_moe(fused_linear_cross_entropy=False, cross_entropy=True)
    m = tiny_model("qwen3_moe")
    m.load_state_dict(ref.state_dict())
    from rtxdsl.nn.moe import NAME

    assert type(m.model.norm).__module__ == "rtxdsl.nn.modules" and m.config._experts_implementation == NAME
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    got, want = m(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got.loss, want.loss, atol=2e-6, rtol=2e-6)


@pytest.fixture
def patched_llama():
    """apply_liger_kernel_to_llama() without a model patches transformers' classes: undone after."""
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    yield
    for cls in [c for c in vars(modeling).values() if isinstance(c, type)]:
        for attr in ("forward", "post_init", "from_pretrained"):
            patched = vars(cls).get(attr)
            original = getattr(getattr(patched, "__func__", patched), "rtxdsl_original", None)
            if original is not None:
                setattr(cls, attr, classmethod(original) if attr == "from_pretrained" else original)


def test_apply_liger_kernel_without_a_model_patches_the_family(patched_llama, tmp_path):
    """Liger's class-level form: a model built after the call is swapped when constructed, one
    loaded by ``from_pretrained`` (built on the meta device) once loaded, one built before at its
    first forward; the loss is taken from the hidden states (logits None), equal to the unmodified
    model's, every gradient too."""
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    from benches.hf_report import tiny_model

    ref = tiny_model("llama")
    ref.save_pretrained(tmp_path)
    before = tiny_model("llama")
    liger.apply_liger_kernel_to_llama(swiglu=False)
    built = tiny_model("llama")
    assert type(built.model.norm).__module__ == "rtxdsl.nn.modules"  # at construction
    assert type(before.model.norm).__module__ != "rtxdsl.nn.modules"  # not yet: at its first forward
    m = LlamaForCausalLM.from_pretrained(tmp_path)
    assert type(m.model.norm).__module__ == "rtxdsl.nn.modules" and torch.equal(m.lm_head.weight, ref.lm_head.weight)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    m.train(), before.train()  # Liger skips the logits in training only (from_pretrained: eval)
    got, want = m(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    assert got.logits is None and type(m.model.norm).__module__ == "rtxdsl.nn.modules"
    assert type(m.model.layers[0].mlp).__module__ != "rtxdsl.nn.modules"  # swiglu=False
    torch.testing.assert_close(got.loss, want.loss, atol=2e-6, rtol=2e-6)
    before.load_state_dict(ref.state_dict())
    first = before(input_ids=ids, labels=ids)
    assert first.logits is None and type(before.model.norm).__module__ == "rtxdsl.nn.modules"
    torch.testing.assert_close(first.loss, want.loss, atol=2e-6, rtol=2e-6)
    got.loss.backward()
    want.loss.backward()
    for (name, p0), p1 in zip(ref.named_parameters(), m.parameters()):
        torch.testing.assert_close(p1.grad, p0.grad, atol=2e-6, rtol=2e-5, msg=name)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: liger.LigerFusedLinearCrossEntropyLoss(use_token_scaling=1), "use_token_scaling"),
        (lambda: liger.LigerFusedLinearCrossEntropyLoss(accum_dtype=torch.float16), "accum_dtype"),
        (lambda: liger.LigerRMSNorm(8, casting_mode="fp8"), "casting_mode"),
        (lambda: liger.LigerRMSNorm(8, init_fn="randn"), "init_fn"),
    ],
    ids=["use_token_scaling", "accum_dtype", "casting_mode", "init_fn"],
)
def test_unsupported_flags_name_themselves(make, words):
    with pytest.raises(RtxError, match=words):
        make()


def test_modules_run_inside_torch_compile(gen):
    """Their kernels are made when the module is (rtxdsl.nn.memo): the forward only finds them, so a
    whole-graph trace holds one custom op per kernel."""
    h, w = torch.randn(ROWS, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen)
    target = torch.tensor([1, -100, 3, 4, 12, 0, 2])
    for fn, args in (
        (liger.LigerFusedLinearCrossEntropyLoss(), (w, h, target)),
        (liger.LigerCrossEntropyLoss(), (h @ w.T, target)),
        (liger.LigerSoftmax(), (h,)),
    ):
        torch.testing.assert_close(torch.compile(fn, fullgraph=True)(*args), fn(*args))


def _functional_cases(gen):
    """(function, args, float64 reference of the same args): Liger's functional forms."""
    x = torch.randn(ROWS, HIDDEN, generator=gen)
    r, w, b = torch.randn(ROWS, HIDDEN, generator=gen), torch.randn(HIDDEN, generator=gen), torch.randn(HIDDEN)
    logits, target = torch.randn(ROWS, VOCAB, generator=gen), torch.tensor([1, -100, 3, 4, 12, 0, 2])
    scale = torch.randn(ROWS, HIDDEN, generator=gen)
    lq, lp = torch.log_softmax(logits, -1), torch.log_softmax(torch.randn(ROWS, VOCAB, generator=gen), -1)
    rms = lambda v, eps=1e-6: v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)  # noqa: E731
    kept = target != -100
    return {
        "rms_norm": (liger.liger_rms_norm, (x, w, 1e-6), lambda x, w, e: rms(x) * w),
        "rms_norm_no_weight": (lambda x, e: liger.liger_rms_norm(x, None, e), (x, 1e-6), lambda x, e: rms(x)),
        "rms_norm_gemma": (lambda x, w, e: liger.liger_rms_norm(x, w, e, offset=1.0, casting_mode="gemma"),
                           (x, w, 1e-6), lambda x, w, e: rms(x) * (1 + w)),
        "fused_add_rms_norm": (lambda *a: liger.liger_fused_add_rms_norm(*a)[0], (x, r, w, 1e-6),
                               lambda x, r, w, e: rms(x + r) * w),
        "modulated_rms_norm": (liger.liger_modulated_rms_norm, (x, w, scale), lambda x, w, s: rms(x) * w * (1 + s)),
        "layer_norm": (liger.liger_layer_norm, (x, w, b, 1e-6), lambda x, w, b, e: F.layer_norm(x, (HIDDEN,), w, b, e)),
        "group_norm": (liger.liger_group_norm, (x.reshape(ROWS, 6, 4), w[:6], b[:6], 6, 3, 1e-6),
                       lambda x, w, b, c, g, e: F.group_norm(x, g, w, b, e)),
        "poly_norm": (liger.liger_poly_norm, (x, w[:3], b[0], 1e-6),
                      lambda x, w, b, e: w[0] * rms(x**3) + w[1] * rms(x**2) + w[2] * rms(x) + b),
        "dyt": (liger.liger_dyt, (x, w[:1], w, b), lambda x, a, g, b: g * torch.tanh(a * x) + b),
        "swiglu": (liger.liger_swiglu, (x, r), lambda a, b: F.silu(a) * b),
        "geglu": (liger.liger_geglu, (x, r), lambda a, b: F.gelu(a, approximate="tanh") * b),
        "softmax": (liger.liger_softmax, (x,), lambda v: torch.softmax(v, -1)),
        "relu_squared": (liger.liger_relu_squared, (x,), lambda v: torch.relu(v) ** 2),
        "cross_entropy": (liger.liger_cross_entropy, (logits, target), lambda v, t: F.cross_entropy(v, t)),
        "kl_div": (lambda q, p: liger.liger_kl_div(q, p, reduction="batchmean"), (lq, lp),
                   lambda q, p: F.kl_div(q, p, reduction="batchmean")),
        "jsd": (lambda q, p: liger.liger_jsd(q, p, target), (lq, lp),
                lambda q, p: (0.5 * (torch.exp(q) * (q - torch.log((q.exp() + p.exp()) / 2))).sum(-1)
                              + 0.5 * (torch.exp(p) * (p - torch.log((q.exp() + p.exp()) / 2))).sum(-1))[kept].mean()),
        "fused_linear_cross_entropy": (liger.liger_fused_linear_cross_entropy, (x, torch.randn(VOCAB, HIDDEN), target),
                                       lambda h, w, t: F.cross_entropy(h @ w.T, t)),
    }  # fmt: skip


FUNCTIONAL = sorted(_functional_cases(torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("name", FUNCTIONAL)
def test_functional_forms(name, gen):
    """Liger's ``liger_*`` functions: values and every floating argument's gradient against a
    float64 torch reference of the same arguments."""
    fn, args, ref = _functional_cases(gen)[name]
    leaves = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    got = fn(*leaves)
    ref_leaves = [a.detach().double().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                  for a in leaves]  # fmt: skip
    want = ref(*ref_leaves)
    assert_close(got, want, 2e-5, 2e-5, name)
    cot = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    floats = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    grads = torch.autograd.grad(got, [leaves[i] for i in floats], cot.float())
    wants = torch.autograd.grad(want, [ref_leaves[i] for i in floats], cot)
    for i, g, e in zip(floats, grads, wants):
        assert_close(g, e, 2e-5, 2e-5, f"{name}: d/darg{i}")


@pytest.mark.parametrize("fused", [False, True], ids=["cross_entropy", "fused_linear"])
def test_an_out_of_range_target_raises_as_liger_asserts(fused, gen):
    """Liger's own test_correctness_with_out_of_bounds_target_once catches an AssertionError naming
    the target "out of bounds"; rtxdsl raised its RtxError alone (run of Liger's tests against
    rtxdsl.liger). Now one error that is an AssertionError, an IndexError (torch's) and an RtxError."""
    t = torch.tensor([0, 1, 20, 3])
    with pytest.raises(AssertionError, match="out of bounds") as e:
        if fused:
            liger.LigerFusedLinearCrossEntropyLoss()(torch.randn(16, 8), torch.randn(4, 8), t)
        else:
            liger.LigerCrossEntropyLoss()(torch.randn(4, 16, generator=gen), t)
    assert isinstance(e.value, IndexError) and isinstance(e.value, RtxError)


def _rotate_half_reference(q, k, cos, sin):
    """Hugging Face's apply_rotary_pos_emb in float64 (cos and sin unsqueezed at the heads)."""

    def rot(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), -1)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rot(q) * s, k * c + rot(k) * s


# (q heads, k heads, head dim, cos rows): k with fewer heads (GQA), an odd head dim (the middle element
# in the second half, as Hugging Face splits it), a table per batch row, a vision model's 2-D table
ROPE_CASES = [(3, 1, 8, "one"), (2, 2, 7, "one"), (3, 1, 8, "batch"), (4, 4, 6, "2d")]


@pytest.mark.parametrize(
    ("hq", "hk", "dim", "table"), ROPE_CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in ROPE_CASES]
)
@pytest.mark.parametrize("entry", ["liger_rope", "liger_rotary_pos_emb", "LigerRopeFunction"])
def test_rope_functions(hq, hk, dim, table, entry, gen):
    """Liger's rope entry points (Liger's own test_rope imports all three): q and k in one kernel,
    values and gradients against Hugging Face's formula in float64; Liger reads a 2-D table as every
    batch row's."""
    b, t = 2, 5
    q, k = (torch.randn(b, h, t, dim, generator=gen, dtype=torch.float64) for h in (hq, hk))
    rows = {"one": (1, t, dim), "batch": (b, t, dim), "2d": (t, dim)}[table]
    cos, sin = (
        torch.randn(rows, generator=gen, dtype=torch.float64),
        torch.randn(rows, generator=gen, dtype=torch.float64),
    )
    fn = liger.LigerRopeFunction.apply if entry == "LigerRopeFunction" else getattr(liger, entry)
    q1, k1 = (v.float().requires_grad_() for v in (q, k))
    got = fn(q1, k1, cos.float(), sin.float())
    q2, k2 = (v.clone().requires_grad_() for v in (q, k))
    full = (lambda v: v.expand(1, t, dim)) if table == "2d" else (lambda v: v)
    want = _rotate_half_reference(q2, k2, full(cos), full(sin))
    for g, w, name in zip(got, want, "qk"):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert_close(g, w, 1e-5, 1e-5, name)
    cots = [torch.randn(w.shape, generator=gen, dtype=torch.float64) for w in want]
    grads = torch.autograd.grad(got, (q1, k1), [c.float() for c in cots])
    for g, w, name in zip(grads, torch.autograd.grad(want, (q2, k2), cots), "qk"):
        assert_close(g, w, 1e-5, 1e-5, f"d{name}")


@pytest.mark.parametrize(
    "entry", ["liger_qwen2vl_mrope", "liger_multimodal_rotary_pos_emb", "LigerQwen2VLMRopeFunction"]
)
def test_multimodal_rope_functions(entry, gen):
    """Qwen2-VL's multimodal RoPE: channel block i of ``sections * 2`` takes table ``i % 3``."""
    sections, b, t, dim = (1, 1, 2), 2, 5, 8
    q, k = (torch.randn(b, h, t, dim, generator=gen, dtype=torch.float64) for h in (3, 1))
    cos, sin = (torch.randn(3, b, t, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    fn = liger.LigerQwen2VLMRopeFunction.apply if entry == "LigerQwen2VLMRopeFunction" else getattr(liger, entry)
    got = fn(q.float(), k.float(), cos.float(), sin.float(), list(sections))

    def tables(v):
        return torch.cat([m[i % 3] for i, m in enumerate(v.split(list(sections) * 2, dim=-1))], dim=-1)

    for g, w in zip(got, _rotate_half_reference(q, k, tables(cos), tables(sin))):
        assert_close(g, w, 1e-5, 1e-5, entry)
    with pytest.raises(RtxError, match="mrope_section"):
        fn(q, k, cos, sin, 4)


def test_function_classes_take_liger_s_argument_order(gen):
    """Liger's ``Liger*Function.apply`` (its tests call them beside the functional forms): each
    Function's positional order, which for the losses differs from the functional's; the
    cross-entropy Functions return Liger's four outputs, None where not asked."""
    x, w = torch.randn(ROWS, HIDDEN, generator=gen), torch.randn(HIDDEN, generator=gen)
    logits, target = torch.randn(ROWS, VOCAB, generator=gen), torch.randint(0, VOCAB, (ROWS,), generator=gen)
    lq, lp = (torch.log_softmax(torch.randn(ROWS, VOCAB, generator=gen), -1) for _ in range(2))
    assert_close(liger.LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", True, None),
                 liger.liger_rms_norm(x, w, 1e-6).double(), 0, 0, "rms_norm with row_mode")  # fmt: skip
    loss, z, acc, tokens = liger.LigerCrossEntropyFunction.apply(logits, target, None, 0, 1e-4, 0.1, "mean", 30.0, True)
    want = liger.liger_cross_entropy(logits, target, None, None, 0, None, "mean", 0.1, 1e-4, 30.0, True)
    assert (acc, tokens) == (None, None)
    assert_close(loss, want.loss.double(), 0, 0, "loss")
    assert_close(z, want.z_loss.double(), 0, 0, "z_loss")
    head = torch.randn(VOCAB, HIDDEN, generator=gen)
    out = liger.LigerFusedLinearCrossEntropyFunction.apply(x, head, target)
    assert out[1:] == (None, None, None)
    assert_close(out[0], F.cross_entropy(x.double() @ head.double().T, target), 1e-5, 1e-5, "fused linear")
    assert_close(liger.LigerKLDivLossFunction.apply(lq, lp), F.kl_div(lq.double(), lp.double(), reduction="batchmean"),
                 1e-6, 1e-6, "kl_div batchmean by default")  # fmt: skip
    p, q = lq.exp(), lp.exp()
    assert_close(liger.LigerTVDLossFunction.apply(p, q), 0.5 * (p - q).abs().sum() / ROWS, 1e-6, 1e-6, "tvd batchmean")
    a, b = (torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    a1, b1 = (v.detach().float().requires_grad_() for v in (a, b))
    got = liger.LigerSiLUMulFunction.apply(a1, b1, 0.7, 1.3)
    want = F.silu(a * 0.7) * b * 1.3
    assert_close(got, want, 1e-6, 1e-6, "silu mul with multipliers")
    for g, e in zip(torch.autograd.grad(got.sum(), (a1, b1)), torch.autograd.grad(want.sum(), (a, b))):
        assert_close(g, e, 1e-6, 1e-6, "silu mul gradients")
    assert_close(liger.LigerSiLUMulFunction.apply(a1, b1), F.silu(a) * b, 1e-6, 1e-6, "silu mul")
    assert_close(liger.LigerGELUMulFunction.apply(a1, b1), F.gelu(a, approximate="tanh") * b, 1e-6, 1e-6, "gelu mul")
    for name in liger.FUNCTION_CLASSES:  # every one is Liger's: a Function with apply, exported
        assert callable(getattr(liger, name).apply) and name in liger.__all__


def test_liger_mlps_and_their_function(gen):
    """Liger's LigerMLP (Llama's MLP; a hidden_act other than silu raises ValueError, as Liger's),
    LigerFalconH1MLP (gate and down multipliers from the config) and LigerMLPFunction.apply, each
    against a float64 reference of Liger's formula, gradients too."""
    from transformers import FalconH1Config, LlamaConfig

    heads = {"num_attention_heads": 4, "num_key_value_heads": 2}
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=40, **heads)
    with pytest.raises(ValueError, match="hidden_act"):
        liger.LigerMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=40, hidden_act="gelu", **heads))
    falcon = FalconH1Config(hidden_size=HIDDEN, intermediate_size=40, mlp_multipliers=[0.7, 1.3], **heads)
    x = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64)
    for m, (g, d) in ((liger.LigerMLP(cfg), (1.0, 1.0)), (liger.LigerFalconH1MLP(falcon), (0.7, 1.3))):
        for p in m.parameters():
            p.data.normal_(generator=gen)
        w = {n: p.detach().double().requires_grad_() for n, p in m.named_parameters()}
        gated = F.silu(F.linear(x, w["gate_proj.weight"]) * g) * F.linear(x, w["up_proj.weight"])
        want = F.linear(gated, w["down_proj.weight"]) * d
        got = m(x.float())
        assert_close(got, want, 1e-4, 1e-4, type(m).__name__)
        got.sum().backward()
        want.sum().backward()
        for n, p in m.named_parameters():
            assert_close(p.grad, w[n].grad, 1e-4, 1e-4, f"{type(m).__name__}: d{n}")
        weights = [m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
        assert_close(liger.LigerMLPFunction.apply(x.float(), *weights, g, d), want, 1e-4, 1e-4, "LigerMLPFunction")


def test_auto_liger_kernel_for_causal_lm_applies_the_family_s_function(patched_llama):
    """Liger's AutoLigerKernelForCausalLM: the model type's apply function (MODEL_TYPE_TO_APPLY_LIGER_FN)
    with the keywords its signature names, the rest to transformers."""
    from transformers import LlamaConfig

    from benches.hf_report import sizes

    assert liger.MODEL_TYPE_TO_APPLY_LIGER_FN["llama4_text"] is liger.apply_liger_kernel_to_llama4
    model = liger.AutoLigerKernelForCausalLM.from_config(LlamaConfig(**sizes()), swiglu=False)
    assert type(model.model.norm).__module__ == "rtxdsl.nn.modules"  # patched at construction
    assert type(model.model.layers[0].mlp).__module__ != "rtxdsl.nn.modules"  # swiglu=False reached it


def _chunked_args(name, gen):
    """Keyword arguments for Liger's chunked loss Function ``name`` (small, odd), as its tests build them."""
    b, t, h, v = 2, 3, HIDDEN, VOCAB
    x, w = torch.randn(2 * b, t, h, generator=gen), torch.randn(v, h, generator=gen)
    y = torch.randint(0, v, (2 * b, t), generator=gen)
    common = {"_input": x, "weight": w, "target": y, "compiled": False}
    if name == "DPO":
        return common | {"ref_input": x * 0.5, "ref_weight": w * 0.5}
    if name == "KTO":
        return common | {"preference_labels": torch.tensor([True, False, True, False]), "ref_input": x * 0.5,
                         "ref_weight": w * 0.5}  # fmt: skip
    if name == "GRPO":
        return {"_input": x, "weight": w, "selected_token_ids": y, "attention_mask": torch.ones(2 * b, t),
                "advantages": torch.randn(2 * b, generator=gen), "use_ref_model": False, "compiled": False}  # fmt: skip
    if name in ("CosineSimilarity", "JSD"):
        teacher = torch.randn(2 * b * t, h, generator=gen)
        return {"student_input": x.view(-1, h), "student_weight": w, "teacher_input": teacher,
                "teacher_weight": w * 0.5, "true_labels": y.view(-1), "student_bias": None, "teacher_bias": None,
                "compiled": False}  # fmt: skip
    return common


@pytest.mark.parametrize("name", ["DPO", "ORPO", "CPO", "SimPO", "KTO", "CosineSimilarity", "JSD", "GRPO"])
def test_chunked_loss_functions_take_liger_s_order(name, gen):
    """Liger's chunked losses' ``LigerFusedLinear*Function.apply`` (the input first, where the modules take
    the weight first) and their ``liger_fused_linear_*`` aliases, against Liger-Kernel's own Functions on the
    same positional arguments; the two ``liger_fused_linear_jsd`` are told apart by their arguments."""
    stem = {"CosineSimilarity": "cosine_similarity"}.get(name, name.lower())
    theirs = getattr(pytest.importorskip(f"liger_kernel.chunked_loss.{stem}_loss"), f"LigerFusedLinear{name}Function")
    fn = getattr(liger, f"LigerFusedLinear{name}Function").apply
    order = getattr(liger, f"LigerFusedLinear{'CosineSimilarity' if name == 'JSD' else name}Function").apply
    bound = inspect.signature(order).bind(**_chunked_args(name, gen))  # the JSD's order is the cosine loss's
    bound.apply_defaults()
    args = bound.args  # positional, in Liger's order
    want = theirs.apply(*args)
    first = lambda o: o[0] if isinstance(o, tuple) else o  # noqa: E731
    assert_close(first(fn(*args)), first(want).double(), 1e-5, 1e-5, name)
    if name == "JSD":  # the chunked call with its biases None, positionally (the sixth: None, not a jsd_beta)
        seven = args[:7]
        assert_close(first(liger.liger_fused_linear_jsd(*seven)), first(theirs.apply(*seven)).double(), 1e-5, 1e-5, "7")
    alias = {"JSD": "liger_fused_linear_jsd"} | {n[len("LigerFusedLinear") : -len("Function")]: f
                                                  for f, n in liger.CHUNKED_FUNCTIONS.items()}  # fmt: skip
    assert_close(first(getattr(liger, alias[name])(*args)), first(want).double(), 1e-5, 1e-5, alias[name])


def test_apply_liger_kernel_to_an_instance_by_its_model_type():
    """Liger's ``_apply_liger_kernel_to_instance`` (transformers' Trainer calls it for ``use_liger_kernel``):
    the model type's function on the model, with the keywords its signature names."""
    from benches.hf_report import tiny_model

    model = tiny_model("llama")
    liger._apply_liger_kernel_to_instance(model, rms_norm=False, unrelated=1)
    assert type(model.model.norm).__module__ != "rtxdsl.nn.modules"
    assert type(model.model.layers[0].mlp).__module__ == "rtxdsl.nn.modules"
    with pytest.raises(RtxError, match="model_type"):
        liger._apply_liger_kernel_to_instance(torch.nn.Linear(2, 2))


def test_liger_expert_mlps_glm4_norm_and_vision_rope(gen):
    """Liger's LigerBlockSparseTop2MLP (Mixtral's expert: w2(silu(w1 x) * w3 x)), LigerQwen3MoeSwiGLUMLP,
    LigerRMSNormForGlm4 (in_place False by default) and liger_rotary_pos_emb_vision ([T, H, D] in its own
    dtype), each against a float64 reference of Liger's formula."""
    from transformers import MixtralConfig

    cfg = MixtralConfig(hidden_size=HIDDEN, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2)
    x = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64)
    expert = liger.LigerBlockSparseTop2MLP(cfg)
    w = {n: p.detach().double() for n, p in expert.named_parameters()}
    want = F.linear(F.silu(F.linear(x, w["w1.weight"])) * F.linear(x, w["w3.weight"]), w["w2.weight"])
    assert_close(expert(x.float()), want, 1e-5, 1e-5, "block sparse top-2 expert")
    assert liger.LigerQwen3MoeSwiGLUMLP(cfg, intermediate_size=12).gate_proj.weight.shape == (12, HIDDEN)
    assert liger.LigerRMSNormForGlm4(HIDDEN).in_place is False
    q, k = (torch.randn(5, h, 8, generator=gen, dtype=torch.float64) for h in (3, 1))
    cos, sin = (torch.randn(5, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    got = liger.liger_rotary_pos_emb_vision(q.to(torch.bfloat16), k.to(torch.bfloat16), cos, sin)
    four = lambda t: t.unsqueeze(0).transpose(1, 2)  # noqa: E731
    for g, w_ in zip(got, _rotate_half_reference(four(q), four(k), cos[None], sin[None])):
        assert g.dtype == torch.bfloat16 and g.shape == w_.transpose(1, 2).squeeze(0).shape
        assert_close(g, w_.transpose(1, 2).squeeze(0), 3e-2, 3e-2, "vision rope")
