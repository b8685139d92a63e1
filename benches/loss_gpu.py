"""The GPU report's post-training section: rtxdsl's losses over a head against Liger's chunked ones.

DPO (sigmoid, with the reference model's head), GRPO (dapo, with the reference's per-token
log-probabilities) and JSD distillation (the teacher's head) as :mod:`rtxdsl.liger`'s modules (one
row kernel per model, the logits never written, the backward derived) and as Liger-Kernel's
``liger_kernel.chunked_loss`` classes (chunks of tokens, logits per chunk, the default
``compiled=True``). Each is first checked against Liger's own class run in float64 (an independent
implementation; on CPU only that, at small sizes, under Triton's interpreter), then timed forward
+ backward in bf16 with the peak memory beyond the inputs, beside one model's logits.

    python -m benches.gpu_report     # runs this section after the contractions
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import rtxdsl as rx
from benches.common import peak_and_ms
from rtxdsl import liger as rx_liger

#: (sequences, tokens, hidden, vocabulary): a Llama-3-8B head, 4 preference pairs of 1K tokens
SIZES = [(8, 1024, 4096, 128256)]


def _inputs(seqs: int, tokens: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device,
            seed: int) -> dict:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)

    target = torch.randint(0, vocab, (seqs, tokens), generator=gen)
    target[:, : tokens // 4] = -100  # the prompt's tokens are not scored
    return {
        "h": t(seqs, tokens, hidden), "w": t(vocab, hidden, scale=hidden**-0.5),
        "ref_h": t(seqs, tokens, hidden), "ref_w": t(vocab, hidden, scale=hidden**-0.5),
        "t": target.to(device), "mask": (target != -100).to(device=device, dtype=dtype),
        "adv": t(seqs), "ref_lp": -t(seqs, tokens).abs(),
    }  # fmt: skip


def _loss(out: Any) -> torch.Tensor:
    """The loss of what a module returns (Liger's preference and policy losses: ``(loss, aux)``)."""
    return out[0] if isinstance(out, tuple) else out


#: each loss: its class name (rtxdsl's and Liger's share names, constructor arguments and forward
#: signatures), the constructor's options, and its call on a module and the inputs
CALLS: dict[str, tuple[str, dict[str, Any], Callable[..., Any]]] = {
    "DPO (sigmoid, reference head)": (
        "LigerFusedLinearDPOLoss", {"use_ref_model": True},
        lambda m, v: _loss(m(v["w"], v["h"], v["t"], None, ref_input=v["ref_h"], ref_weight=v["ref_w"])),
    ),
    "GRPO (dapo, reference log-probs)": (
        "LigerFusedLinearGRPOLoss", {"loss_type": "dapo"},
        lambda m, v: _loss(
            m(v["h"], v["w"], v["t"].clamp(min=0), v["mask"], v["adv"], ref_per_token_logps=v["ref_lp"])
        ),
    ),
    "JSD distillation (teacher head)": (
        "LigerFusedLinearJSDLoss", {},
        lambda m, v: _loss(m(v["h"].flatten(0, 1), v["w"], v["ref_h"].flatten(0, 1), v["ref_w"], v["t"].flatten())),
    ),
}  # fmt: skip


def _peer(cls: str, options: dict[str, Any], compiled: bool) -> Any:
    try:
        import liger_kernel.chunked_loss as chunked
    except ImportError:
        return None
    return getattr(chunked, cls)(**options, compiled=compiled) if hasattr(chunked, cls) else None


def check(device: torch.device, sizes: list[tuple[int, int, int, int]]) -> list[dict]:
    """rtxdsl's losses against Liger's chunked classes in float64, loss and the gradients of the
    hidden states and the head, fp32 and bf16 inputs."""
    rows = []
    for name, (cls, options, call) in CALLS.items():
        peer = _peer(cls, options, compiled=False)
        if peer is None:
            print(f"  {name}: liger_kernel not installed, not checked")
            continue
        for size in sizes:
            for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
                ins = _inputs(*size, dtype, device, 7)
                leaves = {n: ins[n].requires_grad_() for n in ("h", "w")}
                module = getattr(rx_liger, cls)(**options)
                rx.reset_fusion_stats()
                got = call(module, ins)
                grads = torch.autograd.grad(got, list(leaves.values()))
                launches = rx.fusion_stats().kernels_launched
                wide = {n: v.detach().double() if v.is_floating_point() else v for n, v in ins.items()}
                wide_leaves = {n: wide[n].requires_grad_() for n in ("h", "w")}
                want = call(peer, wide)
                want_grads = torch.autograd.grad(want, list(wide_leaves.values()))
                pairs = [(got, want), *zip(grads, want_grads)]
                err = max(((g.double() - e).abs().max() / e.abs().max().clamp_min(1e-30)).item() for g, e in pairs)
                rows.append({"case": name, "shape": "x".join(map(str, size)), "dtype": str(dtype)[6:],
                             "max error": err, "ok": err <= tol, "kernels": launches})  # fmt: skip
    return rows


def time_losses(quick: bool) -> list[dict]:
    """Forward + backward time and peak memory beyond the inputs, bf16, rtxdsl and Liger's chunks."""
    dev = torch.device("cuda")
    rows = []
    for size in SIZES:
        ins = _inputs(*size, torch.bfloat16, dev, 9)
        leaves = [ins[n].requires_grad_() for n in ("h", "w")]
        for name, (cls, options, call) in CALLS.items():
            impls = {"rtxdsl": getattr(rx_liger, cls)(**options), "liger (chunked)": _peer(cls, options, not quick)}
            for impl, module in impls.items():
                if module is None:
                    continue

                def step(module: Any = module, call: Callable[..., Any] = call) -> None:
                    torch.autograd.grad(call(module, ins), leaves)

                try:
                    peak, ms = peak_and_ms(step, 3, 20)
                except Exception as exc:  # noqa: BLE001 (a failing peer is a result to report)
                    print(f"  {name} {size} {impl}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                seqs, tokens, _, vocab = size
                rows.append({"case": name, "shape": "x".join(map(str, size)), "impl": impl,
                             "forward + backward us": ms * 1e3, "peak extra MB": round(peak / 1e6, 1),
                             "logits MB": round(seqs * tokens * vocab * 2 / 1e6, 1)})  # fmt: skip
    return rows
