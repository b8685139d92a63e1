"""Contractions with their epilogues fused: kernels and bytes against eager torch, forward and backward.

Plans only (``Kernel.summary``: nothing runs), so Llama-7B projection sizes cost nothing here:
4096 tokens, hidden 4096, intermediate 11008, bf16. Bytes are the traffic model's (each operand
of a GEMM charged once, as eager's; the memory trace counts real loads). The backward is the
fused gradient plan's kernel, fed the forward's saved products. Eager launches are counted, not
modelled: the aten ops eager torch runs forward and in autograd's backward (views excluded), on
small tensors of the same ranks; eager bytes charge each op of the gradient expression once.

The second table is linear cross-entropy's memory: the buffers rtxdsl's forward and backward
allocate beyond their inputs and results, every tokens x vocabulary tensor eager torch makes
(``F.linear`` + ``F.cross_entropy``, forward and backward), and Liger-Kernel's logits chunk.
The third is the post-training losses with a second model's head (DPO, KTO, GRPO with a
reference model's; JSD and cosine distillation, and fused linear JSD, with a teacher's): kernels,
bytes, FLOPs and the backward's buffers, beside the logits neither model writes.

    python -m benches.contraction_report [--quick]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import rtxdsl as rx
from benches.common import machine, markdown, save
from rtxdsl.lower.target import GPU

x, w, b, r, wg, wu, wd = (rx.var(n) for n in ("x", "w", "b", "r", "wg", "wu", "wd"))


def cases(tokens: int, hidden: int, inter: int, dtype: torch.dtype) -> dict:
    def t(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype)

    return {
        "linear + bias + GELU": (
            rx.gelu(rx.linear(x, w, b)),
            lambda x, w, b: F.gelu(F.linear(x, w, b)),
            {"x": t(tokens, hidden), "w": t(inter, hidden), "b": t(inter)},
        ),
        "linear + bias + residual": (
            rx.linear(x, w, b) + r,
            lambda x, w, b, r: F.linear(x, w, b) + r,
            {"x": t(tokens, inter), "w": t(hidden, inter), "b": t(hidden), "r": t(tokens, hidden)},
        ),
        # prologues: the traffic model recomputes a cast at load at any size; gelu'(h) * g in both
        # gradient GEMMs (and the bias gradient in dW's K loop) only where few tiles reload it
        "fp32 activations cast at load -> linear": (
            rx.linear(rx.cast(x, dtype), w),
            lambda x, w: F.linear(x.to(dtype), w),
            {"x": torch.empty(tokens, hidden), "w": t(hidden, hidden)},
        ),
        "narrow input (128): linear + bias + GELU": (
            rx.gelu(rx.linear(x, w, b)),
            lambda x, w, b: F.gelu(F.linear(x, w, b)),
            {"x": t(tokens, 128), "w": t(inter, 128), "b": t(inter)},
        ),
        "Llama MLP: down(silu(gate(x)) * up(x))": (
            rx.linear(rx.swiglu(rx.linear(x, wg), rx.linear(x, wu)), wd),
            lambda x, wg, wu, wd: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd),
            {"x": t(tokens, hidden), "wg": t(inter, hidden), "wu": t(inter, hidden), "wd": t(hidden, inter)},
        ),
    }


#: aten ops that launch nothing (views and metadata)
_FREE = {"view", "t", "transpose", "expand", "_unsafe_view", "reshape", "detach", "alias", "as_strided",
         "permute", "unsqueeze", "squeeze", "select", "slice", "empty_like"}  # fmt: skip


class _Launches(TorchDispatchMode):
    """Counts the aten ops eager torch runs (each one kernel launch on a GPU), views excluded."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func.overloadpacket.__name__ not in _FREE:
            self.count += 1
        return func(*args, **(kwargs or {}))


def eager_launches(fn: Callable[..., torch.Tensor], ins: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Eager torch's launches, forward and backward (autograd), on small tensors of the same ranks."""
    small = {n: torch.randn([min(s, 8) for s in v.shape], dtype=v.dtype, requires_grad=True) for n, v in ins.items()}
    with _Launches() as fwd:
        out = fn(**small)
    cotangent = torch.ones_like(out)  # made before counting: not part of autograd's backward
    with _Launches() as bwd:
        out.backward(cotangent)
    return fwd.count, bwd.count


def measure(name: str, expr: rx.Expr, eager: Callable[..., torch.Tensor], ins: dict[str, torch.Tensor]) -> dict:
    k = rx.compile(expr)
    eager_fwd, eager_bwd = eager_launches(eager, ins)
    fwd = k.summary(**ins)
    needs = {n: v.requires_grad_() for n, v in ins.items()}
    plan = k.grad_plan(**needs)
    saving = plan.forward.summary(**ins)
    bwd = plan.backward.summary(**plan.backward_feed(ins))
    return {
        "case": name,
        "forward kernels": fwd.kernels,
        "eager forward": eager_fwd,
        "forward MB": round(fwd.bytes_moved / 1e6, 1),
        "eager forward MB": round(fwd.bytes_eager / 1e6, 1),
        "saving forward MB": round(saving.bytes_moved / 1e6, 1),
        "backward kernels": bwd.kernels,
        "eager backward (autograd)": eager_bwd,
        "backward MB": round(bwd.bytes_moved / 1e6, 1),
        "eager backward MB (per op)": round(bwd.bytes_eager / 1e6, 1),
    }


# ---- linear cross-entropy: memory beside the logits ---------------------------------------------------
class _Sized(TorchDispatchMode):
    """Bytes of every tensor of at least ``numel`` elements eager torch makes (on meta tensors)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.bytes = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel and func.overloadpacket.__name__ not in _FREE:
                self.bytes += t.numel() * t.element_size()
        return out


def liger_chunk(tokens: int, vocab: int, hidden: int) -> int:
    """Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` token chunk: the logits of ``chunk`` tokens
    exist at a time (``next_power_of_2(cdiv(BT, cdiv(V, H)))``, its fused_linear_cross_entropy.py)."""
    inc = -(-vocab // hidden)
    return 1 << max(0, (-(-tokens // inc) - 1).bit_length())


def linear_ce(tokens: int, vocab: int, hidden: int, dtype: torch.dtype) -> dict:
    """Kernels and memory of ``rx.linear_cross_entropy`` (planned), eager's logits (counted on meta
    tensors: every tokens x vocabulary tensor forward and backward makes) and Liger's chunk."""
    h, wv, t = rx.var("h"), rx.var("w"), rx.var("t")
    ins = {"h": torch.empty(tokens, hidden, dtype=dtype), "w": torch.empty(vocab, hidden, dtype=dtype),
           "t": torch.zeros(tokens, dtype=torch.int64)}  # fmt: skip
    k = rx.compile(rx.linear_cross_entropy(h, wv, t))
    plan = k.grad_plan(h=ins["h"].requires_grad_(), w=ins["w"].requires_grad_(), t=ins["t"])
    fwd = plan.forward.program(**ins)
    bwd = plan.backward.program(**plan.backward_feed(ins))
    meta = {n: torch.empty(v.shape, dtype=v.dtype, device="meta", requires_grad=v.dtype.is_floating_point)
            for n, v in ins.items()}  # fmt: skip
    with _Sized(tokens * vocab) as eager:
        F.cross_entropy(F.linear(meta["h"], meta["w"]), meta["t"]).backward()
    logits = tokens * vocab * dtype.itemsize
    chunk = liger_chunk(tokens, vocab, hidden)
    return {
        "tokens x vocab x hidden": f"{tokens} x {vocab} x {hidden}",
        "logits MB": round(logits / 1e6, 1),
        "rtxdsl kernels fwd / bwd": f"{fwd.kernels_launched} / {bwd.kernels_launched}",
        "rtxdsl extra MB fwd / bwd": f"{fwd.scratch_bytes / 1e6:.3f} / {bwd.scratch_bytes / 1e6:.3f}",
        "rtxdsl extra / logits": f"{max(fwd.scratch_bytes, bwd.scratch_bytes) / logits:.2%}",
        "eager tokens x vocab MB (fwd + bwd)": round(eager.bytes / 1e6, 1),
        "Liger chunk (tokens) / its logits MB": f"{chunk} / {chunk * vocab * dtype.itemsize / 1e6:.1f}",
        # the compute model (lower.flops): tensor-core FLOPs against the logits' GEMM and the minimum
        "rtxdsl TFLOP fwd / bwd (minimum bwd)": f"{fwd.flops / 1e12:.2f} / {bwd.flops / 1e12:.1f} "
        f"({bwd.minimum_flops / 1e12:.1f})",
        "bwd / logits GEMM": f"{bwd.flops / (2 * tokens * vocab * hidden):.0f}x",
    }


# ---- post-training losses over the head: no logits for either model ------------------------------------
def head_losses(seqs: int, tokens: int, vocab: int, hidden: int, dtype: torch.dtype) -> list[dict]:
    """DPO (with its reference model's head), KTO and GRPO (a reference head, the sampling policy's
    log-probabilities) over ``seqs`` sequences of ``tokens``: kernels and bytes forward (planned,
    against eager's per-op bytes), the backward's launches and the buffers it allocates beyond its
    inputs and results, beside one model's logits."""
    v = rx.var
    head = dict(h=torch.empty(seqs, tokens, hidden, dtype=dtype), w=torch.empty(vocab, hidden, dtype=dtype),
                t=torch.zeros(seqs, tokens, dtype=torch.int64))  # fmt: skip
    ref = dict(rh=torch.empty(seqs, tokens, hidden, dtype=dtype), rw=torch.empty(vocab, hidden, dtype=dtype))
    models = (v("rh"), v("rw"), None)
    losses = {
        "DPO (sigmoid, reference head)": (
            rx.preference_outputs("dpo", v("h"), v("w"), v("t"), ref=models, compute_nll_loss=False)["loss"],
            head | ref,
        ),
        "KTO (reference head)": (
            rx.kto_outputs(v("h"), v("w"), v("t"), v("y"), ref=models)["loss"],
            head | ref | {"y": torch.zeros(seqs, dtype=torch.bool)},
        ),  # fmt: skip
        "GRPO (dapo, reference head)": (
            rx.grpo_outputs(v("h"), v("w"), v("t"), v("m"), v("a"), ref=models, old_logps=v("old"))["loss"],
            head | ref | {"m": torch.ones(seqs, tokens), "a": torch.zeros(seqs), "old": torch.zeros(seqs, tokens)},
        ),
        # distillation: the teacher's head (here as wide as the student's) in the student's row kernel
        "JSD distillation (teacher head)": (
            rx.distillation_outputs("jsd", v("h"), v("w"), v("rh"), v("rw"), v("t"), temperature=2.0)["loss"],
            head | ref,
        ),
        "cosine distillation (teacher head)": (
            rx.distillation_outputs("cosine", v("h"), v("w"), v("rh"), v("rw"), v("t"))["loss"],
            head | ref,
        ),
        "fused linear JSD (teacher head)": (rx.linear_jsd(v("h"), v("w"), v("rh"), v("rw"), v("t")), head | ref),
    }
    rows = []
    for name, (expr, ins) in losses.items():
        k = rx.compile(expr)
        fwd = k.summary(**ins)
        plan = k.grad_plan(**{n: t.requires_grad_() if n in ("h", "w") else t for n, t in ins.items()})
        feed = plan.backward_feed(ins)
        bwd = plan.backward.program(**feed)
        # the compute model on sm_90's tiles (how often a GEMM recomputes a product depends on them)
        flops = (k.lower_for(GPU, **ins).flops, *((p := plan.backward.lower_for(GPU, **feed)).flops, p.minimum_flops))
        rows.append({
            "loss": name,
            "kernels fwd / bwd": f"{fwd.kernels} / {bwd.kernels_launched}",
            "forward GB (eager)": f"{fwd.bytes_moved / 1e9:.2f} ({fwd.bytes_eager / 1e9:.1f})",
            "backward extra MB": round(bwd.scratch_bytes / 1e6, 1),
            "sm_90 TFLOP fwd / bwd (min bwd)": f"{flops[0] / 1e12:.1f} / {flops[1] / 1e12:.1f} ({flops[2] / 1e12:.1f})",
            "one model's logits MB": round(seqs * tokens * vocab * dtype.itemsize / 1e6, 1),
        })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    sizes = (64, 32, 48, torch.float32) if args.quick else (4096, 4096, 11008, torch.bfloat16)
    table = [measure(name, e, eager, ins) for name, (e, eager, ins) in cases(*sizes).items()]
    print(f"## Contractions with fused epilogues ({machine()}; python -m benches.contraction_report)\n")
    print(f"tokens {sizes[0]}, hidden {sizes[1]}, intermediate {sizes[2]}, {str(sizes[3]).removeprefix('torch.')}\n")
    print(markdown(table, list(table[0])))
    lce_sizes = [(128, 4099, 32, torch.float32)] if args.quick else [
        (4096, 32000, 1024, torch.bfloat16), (8192, 128256, 4096, torch.bfloat16)]  # fmt: skip
    lce = [linear_ce(*size) for size in lce_sizes]
    print("\n## Linear cross-entropy: memory and FLOPs beside the logits (planned; eager counted on meta tensors)\n")
    print(markdown(lce, list(lce[0])))
    heads = head_losses(*((4, 6, 37, 16, torch.float32) if args.quick else (8, 4096, 128256, 4096, torch.bfloat16)))
    print("\n## Post-training losses over the head: no logits for either model (planned)\n")
    print(markdown(heads, list(heads[0])))
    if not args.quick:
        saved = {"contraction": table, "linear_cross_entropy": lce, "head_losses": heads}
        print(f"\nwrote {save('contraction-cpu', saved)}")


if __name__ == "__main__":
    main()
