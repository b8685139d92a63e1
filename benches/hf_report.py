"""Hugging Face models fused by ``rx.nn.replace_modules``: what it replaced per family, the max
logit / loss / gradient error against the unmodified model, and the rtxdsl launches of one
forward + backward (tiny configs: 2 layers, hidden 32, vocab 97; needs ``pip install -e ".[hf]"``).

    python -m benches.hf_report
    python -m benches.hf_report --bf16   # bf16 training against float64, beside eager bf16's
    python -m benches.hf_report --more   # 20 more families (GPT-2, OLMo 2, GPT-OSS, T5, BERT, ...)
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch

import rtxdsl as rx
from benches.common import markdown

#: family: (config class, model class, config overrides); tests/test_hf.py runs the same models
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),  # q_norm / k_norm over heads
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),  # 1 + w norms, tanh GeGLU
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8}),  # + post norms, softcapping
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
#: mixture-of-experts families beside Mixtral (tests/test_moe.py): their experts run rx.nn.moe_experts
MOE_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                   "norm_topk_prob": True}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              {"num_experts": 4, "num_experts_per_tok": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",  # a shared expert (a gated MLP) too
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                   "shared_expert_intermediate_size": 40}),
}  # fmt: skip
LAYERS = 2
#: families beyond tests/test_hf.py's (``--more``), as a user's model would come: config overrides
#: on ``sizes()`` (the arguments their configs take where those names differ)
MORE_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.5}),
    "phi": ("PhiConfig", "PhiForCausalLM", {"partial_rotary_factor": 0.5}),
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 64, "word_embed_proj_dim": 32}),
    "falcon": ("FalconConfig", "FalconForCausalLM", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),  # q / k norms over the projections; rotary cast back
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),  # interleaved rotary; a layer norm without bias
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"embedding_multiplier": 2.0, "residual_multiplier": 0.5}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "glm": ("GlmConfig", "GlmForCausalLM", {"head_dim": 8, "pad_token_id": 0}),  # a rotary of its own
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                "head_dim": 8, "pad_token_id": 0, "sliding_window": 4,
                "layer_types": ["sliding_attention", "full_attention"]}),  # attention sinks
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {"moe_intermediate_size": 16, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8, "first_k_dense_replace": 1,
                    "num_key_value_heads": 4}),
    "bloom": ("BloomConfig", "BloomForCausalLM", {"n_layer": 2, "n_head": 4}),  # ALiBi: not routed
    "mpt": ("MptConfig", "MptForCausalLM", {"d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 64}),
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", {"num_key_value_heads": 4}),
    "t5": ("T5Config", "T5ForConditionalGeneration", {"d_model": 32, "d_ff": 64, "d_kv": 8, "num_layers": 2,
           "num_heads": 4, "decoder_start_token_id": 0, "pad_token_id": 0}),
    "bart": ("BartConfig", "BartForConditionalGeneration", {"d_model": 32, "encoder_ffn_dim": 64,
             "decoder_ffn_dim": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
             "decoder_attention_heads": 4, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
             "decoder_start_token_id": 2}),
    "bert": ("BertConfig", "BertForMaskedLM", {}),
    "modernbert": ("ModernBertConfig", "ModernBertForMaskedLM", {"pad_token_id": 0, "global_attn_every_n_layers": 2,
                   "local_attention": 4}),
}  # fmt: skip


def tiny(config_cls: str, model_cls: str, moved: float = 0.02, **config: Any) -> torch.nn.Module:
    """transformers' ``model_cls`` of ``config_cls(**config)`` on eager attention, every weight moved
    off its initial value by ``moved`` standard normals (Gemma's norms start at zero, where ``w``
    and ``1 + w`` would not be told apart by a test)."""
    import transformers

    cfg = getattr(transformers, config_cls)(**config)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * moved)
    return model


def sizes() -> dict[str, int]:
    """The sizes of every tiny model (``LAYERS`` layers, read when called)."""
    return {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 64,
    }  # fmt: skip


def tiny_model(family: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A 2-layer model of ``family`` (``tiny``)."""
    config_cls, model_cls, extra = {**FAMILIES, **MOE_FAMILIES, **MORE_FAMILIES}[family]
    return tiny(config_cls, model_cls, **(sizes() | extra)).to(dtype)


def compare(family: str) -> dict[str, Any]:
    """Replace, then run both models forward + backward on the same tokens."""
    model = tiny_model(family)
    fused = copy.deepcopy(model)
    n = rx.nn.replace_modules(fused)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    want = model(input_ids=ids, labels=ids)
    want.loss.backward()
    rx.reset_fusion_stats()
    got = fused(input_ids=ids, labels=ids)
    got.loss.backward()
    grad = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), fused.parameters()))
    generates = "n/a"
    if model.can_generate():
        with torch.no_grad():
            greedy = [m.generate(ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0) for m in (model, fused)]
        generates = "same" if torch.equal(*greedy) else "DIFFERENT"
    return {
        "family": family,
        "replaced": ", ".join(f"{k} {v}" for k, v in n.by_kind.items()),
        "max logit error": f"{(got.logits - want.logits).abs().max().item():.1e}",
        "loss error": f"{(got.loss - want.loss).abs().item():.1e}",
        "max grad error": f"{grad:.1e}",
        "rtxdsl launches (fwd + bwd)": rx.fusion_stats().kernels_launched,
        "greedy generate": generates,
    }


def bf16_against_float64(family: str) -> dict[str, Any]:
    """One bf16 training step's loss and gradients, eager and replaced, against the float64 model
    (the same weights): each parameter's max gradient error over its float64 gradient's max, and
    the largest ratio of rtxdsl's to eager's among the parameters."""
    base = tiny_model(family)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    runs = {}
    for tag, dtype, fuse in (
        ("f64", torch.float64, False),
        ("eager", torch.bfloat16, False),
        ("rx", torch.bfloat16, True),
    ):
        model = copy.deepcopy(base).to(dtype)
        if fuse:
            rx.nn.replace_modules(model)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        runs[tag] = (
            out.loss.double().item(),
            {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None},
        )
    (loss, exact), (eager_loss, eager), (rx_loss, got) = runs["f64"], runs["eager"], runs["rx"]

    def error(grads: dict[str, torch.Tensor], name: str) -> float:
        return (grads[name] - exact[name]).abs().max().item() / max(exact[name].abs().max().item(), 1e-30)

    ratio, worst = max((error(got, n) / max(error(eager, n), 1e-12), n) for n in exact)
    return {
        "family": family,
        "loss error: rtxdsl / eager bf16": f"{abs(rx_loss - loss):.1e} / {abs(eager_loss - loss):.1e}",
        "largest gradient error over eager's": f"{ratio:.2f}x ({worst})",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--bf16", action="store_true", help="bf16 training against float64, beside eager bf16")
    ap.add_argument("--more", action="store_true", help="the families beyond tests/test_hf.py's (MORE_FAMILIES)")
    args = ap.parse_args()
    if args.more:
        rows = [compare(f) for f in MORE_FAMILIES]
        print(markdown(rows, list(rows[0])))
        return
    if args.bf16:  # (Mixtral's eager experts run torch's grouped_mm: no float64)
        rows = [bf16_against_float64(f) for f in FAMILIES if f != "mixtral"]
    else:
        rows = [compare(f) for f in FAMILIES]
    print(markdown(rows, list(rows[0])))


if __name__ == "__main__":
    main()
