"""Facts about the compiled code for an H100/H200 (sm_90), compiled here without a GPU.

Compiling needs Triton outside interpreter mode, so it runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from filelock import FileLock

SCRIPT = textwrap.dedent("""
    import json, torch, rtxdsl as rx
    from rtxdsl.build import compile_kernel, prepare
    from rtxdsl.codegen.ptx import sass_counts
    x, y, w, b = (rx.var(n) for n in "xywb")
    cases = {
        "flat_fp32": (rx.relu(x * y + 1.0), dict(x=torch.empty(4096), y=torch.empty(4096))),
        "flat_bf16": (rx.gelu(x + y), dict(x=torch.empty(4096, dtype=torch.bfloat16),
                                           y=torch.empty(4096, dtype=torch.bfloat16))),
        "layer_norm": (rx.layer_norm(x, w, b), dict(x=torch.empty(64, 4096), w=torch.empty(4096),
                                                    b=torch.empty(4096))),
        "long_rows": (rx.softmax(x), dict(x=torch.empty(4, 40000))),
        "softmax_bf16": (rx.softmax(x), dict(x=torch.empty(64, 4096, dtype=torch.bfloat16))),
        "rms_norm_bf16": (rx.rms_norm(x, w), dict(x=torch.empty(64, 4096, dtype=torch.bfloat16),
                                                  w=torch.empty(4096, dtype=torch.bfloat16))),
        "rope": (rx.rope(x, y, w), dict(x=torch.empty(8, 16, 128), y=torch.empty(16, 128), w=torch.empty(16, 128))),
        "cross_entropy": (rx.cross_entropy(x, b, reduction="none"),
                          dict(x=torch.empty(64, 32000), b=torch.empty(64, dtype=torch.int64))),
        # rows that fill the waves, kept whole in one 32K block of 32 warps (WIDE_TILES): no spill
        "cross_entropy_wide": (rx.cross_entropy(x, b), dict(x=torch.empty(4096, 32000, dtype=torch.bfloat16),
                                                            b=torch.empty(4096, dtype=torch.int64))),
        "softmax_wide": (rx.softmax(x), dict(x=torch.empty(4096, 32768))),
        # ~27 dependent row reductions (a bisection) in registers: still no spills
        "sparsemax": (rx.sparsemax(x), dict(x=torch.empty(64, 4096))),
        # contractions: 128 x 128 tiles of 16-bit operands (Hopper's warpgroup MMA), a fused epilogue
        "gemm_bf16_gelu": (rx.gelu(rx.linear(x, w, b)), dict(x=torch.empty(4096, 4096, dtype=torch.bfloat16),
                           w=torch.empty(4096, 4096, dtype=torch.bfloat16), b=torch.empty(4096, dtype=torch.bfloat16))),
        "gemm_fp16_mT": (x @ rx.permute(w, (1, 0)), dict(x=torch.empty(512, 1024, dtype=torch.float16),
                         w=torch.empty(768, 1024, dtype=torch.float16))),
        # prologues: an fp32 activation cast to bf16 at load (A), and a scaled weight (B, transposed)
        "gemm_prologue_cast": (rx.linear(rx.cast(x, torch.bfloat16), w), dict(x=torch.empty(4096, 4096),
                               w=torch.empty(4096, 4096, dtype=torch.bfloat16))),
        "gemm_prologue_swiglu": (rx.linear(rx.silu(x) * y, w), dict(x=torch.empty(4096, 1024, dtype=torch.bfloat16),
                                 y=torch.empty(4096, 1024, dtype=torch.bfloat16),
                                 w=torch.empty(128, 1024, dtype=torch.bfloat16))),
        # q, k and v of one hidden state (Llama-2-7B's attention): one K loop, three accumulators
        "gemm_qkv": ({"q": rx.linear(x, w), "k": rx.linear(x, y), "v": rx.linear(x, b)}, dict(
            x=torch.empty(4096, 4096, dtype=torch.bfloat16), w=torch.empty(4096, 4096, dtype=torch.bfloat16),
            y=torch.empty(4096, 4096, dtype=torch.bfloat16), b=torch.empty(4096, 4096, dtype=torch.bfloat16))),
        # a gate and an up projection of one input: one K loop, two accumulators (Llama-8B's MLP)
        "gemm_gate_up": (rx.silu(rx.linear(x, w)) * rx.linear(x, y), dict(
            x=torch.empty(4096, 4096, dtype=torch.bfloat16), w=torch.empty(14336, 4096, dtype=torch.bfloat16),
            y=torch.empty(14336, 4096, dtype=torch.bfloat16))),
    }
    # the backward of linear + bias + gelu from a narrow input (128 features, where the traffic
    # model recomputes gelu'(h) * g at load): two GEMMs, the second with the bias gradient merged
    # in its K loop
    bf = dict(dtype=torch.bfloat16)
    bwd = rx.compile(rx.gelu(rx.linear(x, w, b))).grad_plan(
        x=torch.empty(4096, 128, **bf), w=torch.empty(1024, 128, **bf), b=torch.empty(1024, **bf)).backward
    shapes = dict(_g0=(4096, 1024), _s0=(4096, 1024), x=(4096, 128), w=(1024, 128), b=(1024,))
    feed = {n: torch.empty(shapes[n], **bf) for n in bwd.inputs}
    # (dW's product cast to the weight's dtype, then the bias gradient's sum in its K loop)
    assert [k.summary.endswith("contract, cast, sum") for k in bwd.program(**feed).kernels] == [False, True]
    kernels = {name: (rx.compile(e), ins, 0) for name, (e, ins) in cases.items()}
    kernels["gemm_bwd_bias_sum"] = (bwd, feed, -1)
    # a gated MLP's backward (Llama-2-7B's sizes): dy @ wd whose epilogue reads the gate and up
    # products and writes dg, du and silu(g) * u (rows halved: a wide epilogue), and
    # dx = dg @ wg + du @ wu, the second product in a K loop of its own
    mlp_in = dict(x=torch.empty(4096, 4096, **bf), y=torch.empty(11008, 4096, **bf))
    mlp_in |= dict(w=torch.empty(11008, 4096, **bf), b=torch.empty(4096, 11008, **bf))
    mlp = rx.compile(rx.linear(rx.swiglu(rx.linear(x, w), rx.linear(x, y)), b))
    mlp_plan = mlp.grad_plan(**{n: t.requires_grad_() for n, t in mlp_in.items()})
    mlp_feed = mlp_plan.backward_feed({n: t.detach() for n, t in mlp_in.items()})
    summaries = [k.summary for k in prepare(mlp_plan.backward, mlp_feed)[0].kernels]  # as sm_90 plans it
    kernels["gemm_mlp_dh"] = (mlp_plan.backward, mlp_feed, summaries.index(next(s for s in summaries if "silu" in s)))
    kernels["gemm_mlp_dx"] = (mlp_plan.backward, mlp_feed, summaries.index("Contraction: contract, contract, add"))
    # cross-entropy's loss and gradient in one read of the logits (grad_in_forward): its row kernel
    ce_x = torch.empty(4096, 32000, **bf, requires_grad=True)
    ce_t = torch.zeros(4096, dtype=torch.int64)
    ce = rx.compile(rx.cross_entropy(x, b, grad_in_forward=True)).grad_plan(x=ce_x, b=ce_t).forward.then
    ce_feed = dict(x=ce_x.detach(), b=ce_t, _g0=torch.ones((), **bf), _p0=torch.ones(()))
    kernels["cross_entropy_grad_wide"] = (ce, {n: ce_feed[n] for n in ce.inputs}, 0)
    # linear cross-entropy at 4096 tokens x 32000 vocabulary x 1024 hidden: the forward computes the
    # logit tiles in its row loop; the backward's chunk loop computes them once per chunk of 256
    # classes (dP's fp32 chunk, which the bias gradient sums, within 2% of the bf16 logits; then dh
    # summing the chunks, then dw's rows: 125 chunks); with
    # chunk_budget=0 its two GEMMs recompute them in their K loops instead
    lce_in = dict(x=torch.empty(4096, 1024, **bf), w=torch.empty(32000, 1024, **bf),
                  y=torch.empty(4096, dtype=torch.int64), b=torch.empty(32000, **bf))
    stats = dict(_g0=torch.empty((), **bf), _s0=torch.empty(4096, 1))
    for suffix, budget, launches in (("", 0.02, 3 * 125), ("_recompute", 0.0, 2)):
        config = rx.FusionConfig(chunk_budget=budget)
        lce = rx.compile(rx.linear_cross_entropy(x, w, y, b), config=config).grad_plan(**lce_in)
        lce_feed = {n: lce_in[n] if n in lce_in else stats.get(n, torch.empty(())) for n in lce.backward.inputs}
        assert lce.backward.program(**lce_feed).kernels_launched == launches
        kernels["gemm_lce_forward"] = (lce.forward, lce_in, 0)
        names = ["gemm_lce_chunk", "gemm_lce_dh", "gemm_lce_dw"] if budget else ["gemm_lce_dh", "gemm_lce_dw"]
        for which, name in enumerate(names):
            kernels[name + suffix] = (lce.backward, lce_feed, which)
    # JSD distillation's backward at 4096 tokens x 32000 classes, student hidden 1024, teacher 2048:
    # the chunk loop's first kernel computes both heads' products at its output tile (the
    # teacher's in its epilogue), then dh and dw read the chunk
    hs, ws, ht, wt = (rx.var(n) for n in ("hs", "ws", "ht", "wt"))
    jsd_in = dict(hs=torch.empty(4096, 1024, **bf).requires_grad_(), ws=torch.empty(32000, 1024, **bf).requires_grad_(),
                  ht=torch.empty(4096, 2048, **bf), wt=torch.empty(32000, 2048, **bf),
                  y=torch.zeros(4096, dtype=torch.int64))
    jsd = rx.compile(rx.linear_jsd(hs, ws, ht, wt, y, temperature=2.0)).grad_plan(**jsd_in)
    # each head's saved logsumexp and softmax total, the count of tokens
    saved = dict(_g0=torch.empty(()), _s6=torch.empty(()), **{f"_s{i}": torch.empty(4096, 1) for i in range(4)})
    jsd_feed = {n: jsd_in[n].detach() if n in jsd_in else saved[n] for n in jsd.backward.inputs}
    launched = [k.summary for k in jsd.backward.program(**jsd_feed).kernels]
    chunk = next(i for i, k in enumerate(launched) if k.startswith("Contraction") and k.count("contract") == 2)
    kernels["gemm_distill_chunk"] = (jsd.backward, jsd_feed, chunk)
    # causal attention's forward, bf16, 4096 tokens: one GEMM, the scores' product taken whole over
    # the head dim (q loaded once), 128 rows; grouped-query (8 key/value heads of 32) at 128
    q, k, v = rx.var("q"), rx.var("k"), rx.var("v")
    for d, hkv in ((64, 32), (128, 32), (128, 8)):
        att = rx.compile(rx.attention(q, k, v, causal=True, enable_gqa=hkv != 32))
        att_in = {n: torch.empty(1, 32 if n == "q" else hkv, 4096, d, **bf) for n in "qkv"}
        kernels[f"gemm_attention_d{d}_kv{hkv}"] = (att, att_in, 0)
    # its backward at head dim 128, grouped: dq's GEMM recomputes two products (the scores,
    # dO @ v.T), sliced over the head dim (taken whole, they spilled); dk's and dv's one K loop
    # summing the group recomputes them once for both (no spills)
    plan = att.grad_plan(**{n: t.clone().requires_grad_() for n, t in att_in.items()})
    saved = plan.forward.program(**{n: t.detach() for n, t in att_in.items()})
    bwd_in = {n: t.detach() for n, t in att_in.items()} | {"_g0": torch.empty(1, 32, 4096, 128, **bf)}
    for key, slot in saved.outputs:
        buf = saved.buffers[slot - saved.n_inputs]
        bwd_in[key] = torch.empty(buf.shape, dtype=buf.dtype)
    bwd_in = {n: bwd_in[n] for n in plan.backward.inputs}
    gemms = [i for i, c in enumerate(prepare(plan.backward, bwd_in)[0].kernels) if c.spec.kind == "gemm"]
    for which in gemms:
        kernels[f"gemm_attention_backward_{which}"] = (plan.backward, bwd_in, which)
    out = {}
    SASS = ("softmax_bf16", "rms_norm_bf16")
    def record(name, f, meta):
        out[name] = dict(block=meta.get("BLOCK_SIZE"), warps=meta.get("num_warps"),
                         v4_loads=f.v4_loads, v4_stores=f.v4_stores, regs=f.registers, spills=f.spill_bytes,
                         stores=f.ptx.count("st.global"), wgmma=f.ptx.count("wgmma.mma_async"),
                         bf16_cvt=f.ptx.count("cvt.rn.bf16"), hand_rounded=f.ptx.count("-65536"),
                         ex2_ftz=f.ptx.count("ex2.approx.ftz.f32"), ex2=f.ptx.count("ex2.approx"),
                         compares_s64=f.ptx.count("setp.eq.s64") + f.ptx.count("setp.ne.s64"),
                         # SASS only where a test reads it (assembling every GEMM again costs seconds)
                         barriers=getattr(sass_counts(f.ptx), "barriers", None) if name in SASS else None)
    for name, (kernel, ins, which) in kernels.items():
        meta = dict(prepare(kernel, ins)[0].kernels[which].meta)  # on the GPU target, as compiled
        record(name, compile_kernel(kernel, ins)[which], meta)
    # a mixture of experts' grouped GEMMs (rtxdsl.nn.moe): 256 tokens x top-2 of 8 experts, hidden
    # 1024, intermediate 512, bf16; the up projection gathers token rows and computes SwiGLU in its
    # epilogue, the down projection scales by the routing weights, its input gradient computes
    # SwiGLU's gradient and the routing weights' in its epilogue, the weight gradient loops over
    # each expert's rows
    from types import SimpleNamespace
    from rtxdsl.codegen.ptx import compile_call
    from rtxdsl.nn.moe import Gated, gated_columns, grouped_call, route, segment_call
    r = route(torch.randint(0, 8, (256, 2)), 8, 64)
    xm, hm, am = torch.empty(256, 1024, **bf), torch.empty(512, 1024, **bf), torch.empty(512, 512, **bf)
    gum = torch.empty(8, 1024, 1024, **bf).transpose(1, 2)
    part = torch.empty(gated_columns(512, "gpu"), 512)
    dgated = Gated("dgated", "silu", am, hm, part)
    moe = {"gemm_moe_up": grouped_call(xm, gum, hm, r, True, None, "gpu", Gated("gated", "silu", am)),
           "gemm_moe_down_grad": grouped_call(xm, gum[:, :, :512], hm, r, True, torch.rand(512), "gpu", dgated),
           "gemm_moe_down": grouped_call(hm[:, :512], gum[:, :512], torch.empty(512, 1024), r, False,
                                         torch.rand(512), "gpu"),
           "gemm_moe_weight_grad": segment_call(xm, True, hm, False, None, r, torch.empty_like(gum), "gpu")}
    for name, call in moe.items():
        record(name, compile_call(call.kernel, SimpleNamespace(meta=call.meta, args=call.args), []), call.meta)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    """The compiled facts of every case (compiled once per session: xdist workers share them through
    a locked directory)."""
    base = tmp_path_factory.getbasetemp()  # under xdist, its parent is this session's: shared by the workers
    out = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "sm90-facts"
    out.mkdir(exist_ok=True)
    with FileLock(str(out / "lock")):
        if not (out / "facts.json").exists():
            env = {
                **os.environ,
                "TRITON_INTERPRET": "0",
                "TRITON_DEFAULT_FP_FUSION": "1",
                "RTXDSL_CACHE_DIR": str(out / "cache"),
            }
            res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env)
            if res.returncode != 0 and "GPUTarget" in res.stderr:
                pytest.skip(f"this Triton cannot compile for sm_90 without a GPU: {res.stderr[-300:]}")
            assert res.returncode == 0, res.stderr[-2000:]
            (out / "facts.json").write_text(res.stdout.strip().splitlines()[-1])
    return json.loads((out / "facts.json").read_text())


def test_contiguous_path_uses_128_bit_loads_and_stores(facts):
    for name in ("flat_fp32", "flat_bf16", "layer_norm", "long_rows", "rope", "sparsemax"):
        assert facts[name]["v4_loads"] > 0, name
        assert facts[name]["v4_stores"] > 0, name
    assert facts["cross_entropy"]["v4_loads"] > 0  # the logits row; the loss is one scalar per row


def test_contractions_use_hopper_warpgroup_mma(facts):
    for name in ("gemm_bf16_gelu", "gemm_fp16_mT", "gemm_prologue_cast", "gemm_prologue_swiglu", "gemm_bwd_bias_sum"):
        assert facts[name]["wgmma"] > 0, name
    assert facts["gemm_gate_up"]["wgmma"] == 2 * facts["gemm_bf16_gelu"]["wgmma"]  # both products, one K loop
    assert facts["gemm_mlp_dx"]["wgmma"] == 2 * facts["gemm_bf16_gelu"]["wgmma"]  # two K loops
    assert facts["gemm_qkv"]["wgmma"] == 3 * facts["gemm_bf16_gelu"]["wgmma"]
    assert facts["gemm_mlp_dh"]["wgmma"] > 0
    lce = ("gemm_lce_forward", "gemm_lce_chunk", "gemm_lce_dh", "gemm_lce_dw", "gemm_distill_chunk")
    moe = ("gemm_moe_up", "gemm_moe_down", "gemm_moe_down_grad", "gemm_moe_weight_grad")  # gathered rows too
    attention = ("gemm_attention_d64_kv32", "gemm_attention_d128_kv32", "gemm_attention_d128_kv8")
    attention += tuple(name for name in facts if name.startswith("gemm_attention_backward"))
    assert len(attention) == 5  # dq's GEMM, dk's beside dv's in one K loop
    for name in (*lce, *moe, *attention, "gemm_lce_dh_recompute", "gemm_lce_dw_recompute"):  # recomputed tiles too
        assert facts[name]["wgmma"] > 0, name
    assert facts["layer_norm"]["wgmma"] == 0


def test_bf16_values_round_by_the_gpus_conversion(facts):
    """A bf16 value is rounded to nearest even by ``cvt.rn.bf16(x2).f32``, one instruction for two
    values; until 0.3 it was rounded by integer ops on its bits (the interpreter's truncating cast
    needed it; rtxdsl's interpreter fix rounds now), which the GPU ran too."""
    for name in ("flat_bf16", "gemm_bf16_gelu", "gemm_prologue_swiglu"):
        assert facts[name]["bf16_cvt"] > 0, name
    for name, f in facts.items():  # the hand rounding masked the low 16 bits off: 0xFFFF0000
        assert f["hand_rounded"] == 0, name


def test_row_kernels_synchronize_as_often_as_the_tutorials(facts):
    """Block-wide barriers (SASS ``BAR``) of a row in one block: a softmax's max and sum take three
    (Triton's tutorial 02 takes four), RMSNorm's one sum takes one."""
    if facts["softmax_bf16"]["barriers"] is None:
        pytest.skip("no cuobjdump in this Triton's wheel")
    assert facts["softmax_bf16"]["barriers"] <= 3
    assert facts["rms_norm_bf16"]["barriers"] <= 1


def test_no_register_spills(facts):
    for name, f in facts.items():
        if f["spills"] is None:
            pytest.skip("ptxas not found")
        assert f["spills"] == 0, name
        # a GEMM's 128 x 128 fp32 accumulator alone is 64 registers a thread (8 warps)
        assert f["regs"] <= (255 if name.startswith("gemm") else 128), name


def test_every_generated_kernel_compiles_for_sm90(tmp_path):
    """Forward kernels of every op and dtype, reductions, and every backward kernel of test_autograd."""
    script = Path(__file__).parent / "helpers" / "compile_everything.py"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1", "RTXDSL_CACHE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert not [line for line in lines if line.startswith("FAIL")], "\n".join(lines)
    done, total = lines[-1].split()[0].split("/")
    assert done == total and int(total) > 250


def test_wide_rows_are_one_block_of_32_warps_without_a_spill(facts):
    """A softmax or cross-entropy row up to 32K, in rows that fill the GPU's waves, is one block (as
    Liger-Kernel launches its cross-entropy); fewer rows loop in 4096-wide blocks."""
    for name in ("cross_entropy_wide", "softmax_wide"):
        assert (facts[name]["block"], facts[name]["warps"], facts[name]["spills"]) == (32768, 32, 0), name
    assert facts["cross_entropy"]["block"] == 4096  # 64 rows


def test_cross_entropy_loss_and_gradient_are_one_wide_block(facts):
    """grad_in_forward's one row kernel (loss, gradient, the mean's tail) keeps a 32K row whole in
    32 warps without a spill: its per-row loads (targets, the count, the cotangent) are no tiles."""
    f = facts["cross_entropy_grad_wide"]
    assert (f["block"], f["warps"], f["spills"]) == (32768, 32, 0)


@pytest.mark.parametrize(("name", "per_thread"), [("softmax_bf16", 4096 // 256), ("cross_entropy_grad_wide", 32)])
def test_one_flush_to_zero_exp_per_element(facts, name, per_thread):
    """The logsumexp tile's ``exp2`` (Triton's ``ex2.approx.ftz``, no denormal rescale) is the only
    exp per element: softmax and the cross-entropy gradient reuse it (the shared exp), leaving one
    plain exp per row."""
    f = facts[name]
    assert f["ex2_ftz"] == per_thread
    assert f["ex2"] - f["ex2_ftz"] <= 2  # per row: the rescale exp(shift - lse)


def test_class_positions_compare_in_32_bits(facts):
    """Cross-entropy's ``positions == target`` runs on int32 positions against the target narrowed
    once per row: no 64-bit compare per element (32 per thread at 32K classes in 32 warps)."""
    assert facts["cross_entropy_grad_wide"]["compares_s64"] <= 2


def test_a_row_of_one_column_compiles_where_its_size_is_a_constexpr(tmp_path):
    """Triton's launcher passes an integer argument equal to 1 as a constexpr (a Python int in the
    kernel), as ``compile_call`` does: a one-column row's ``n_cols`` has no ``.to()``."""
    script = textwrap.dedent("""
        import torch, rtxdsl as rx
        from rtxdsl.build import compile_kernel
        x, w, b, t = (rx.var(n) for n in "xwbt")
        for e, ins in [
            (rx.layer_norm(x, w, b), dict(x=torch.empty(64, 1), w=torch.empty(1), b=torch.empty(1))),
            (rx.cross_entropy(x, t), dict(x=torch.empty(64, 1), t=torch.empty(64, dtype=torch.int64))),
        ]:
            compile_kernel(rx.compile(e), ins)
    """)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1", "RTXDSL_CACHE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
