"""Lazy stream report: capture cost per recorded op, flush cost, and a transformer block's
launches and bytes against eager torch.

    python -m benches.lazy_report           # full
    python -m benches.lazy_report --quick   # CI smoke
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import rtxdsl as rx
from benches.common import host_compare, machine, markdown, save


class Block(torch.nn.Module):
    """layer_norm -> linear -> gelu -> linear -> residual add -> softmax (the issue's sequence)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d, bias=False)
        self.bias = torch.nn.Parameter(torch.randn(4 * d))
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(self.ln(x)) + self.bias)
        return torch.softmax(self.down(h) + x, dim=-1)


def block_counts(rows: int, d: int) -> dict:
    torch.manual_seed(0)
    block = Block(d)
    x = torch.randn(rows, d)
    f = rx.Fusion()
    with torch.no_grad():
        want = block(x)
        got = block(f.lazy(x)).torch()
    s = f.stats()
    eager_launches = s.kernels_launched + s.kernel_launches_saved
    return {
        "sequence": "ln -> linear -> +bias, gelu -> linear -> +residual, softmax",
        "shape": f"{rows}x{d}",
        "rtxdsl launches": s.kernels_launched,
        "eager launches": eager_launches,
        "fewer launches %": round(100 * (1 - s.kernels_launched / eager_launches), 1),
        "rtxdsl MB": s.bytes_moved / 1e6,
        "eager MB": s.bytes_eager / 1e6,
        "max error": (got - want).abs().max().item(),
    }


class LlamaBlock(torch.nn.Module):
    """A Llama-style block written as plain torch: RMSNorm -> q/k/v -> RoPE (rotate-half, as in
    Hugging Face) -> attention -> residual -> RMSNorm -> SwiGLU MLP -> residual -> logits ->
    cross-entropy. Attention runs eagerly; everything else, the projections too, is recorded."""

    def __init__(self, d: int, heads: int, vocab: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = torch.nn.Linear(d, 2 * d, bias=False), torch.nn.Linear(d, 2 * d, bias=False)
        self.down = torch.nn.Linear(2 * d, d, bias=False)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    @staticmethod
    def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = t.shape[-1] // 2
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))


def llama_counts(batch: int, seq: int, d: int, heads: int, vocab: int) -> dict:
    """Launches and bytes of the whole block (attention eager in both): rtxdsl's against eager torch's."""
    torch.manual_seed(0)
    block = LlamaBlock(d, heads, vocab)
    x = torch.randn(batch, seq, d)
    hd = d // heads
    angle = torch.arange(seq)[:, None] * (10000 ** (-torch.arange(0, hd, 2) / hd))[None]
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    target = torch.randint(0, vocab, (batch, seq))
    f = rx.Fusion()
    with torch.no_grad():
        want = block(x, cos, sin, target)
        got = block(f.lazy(x), cos, sin, target).torch()
    s = f.stats()
    eager_launches = s.kernels_launched + s.kernel_launches_saved
    return {
        "block": "Llama: rms_norm, q/k/v, rope, o + residual, rms_norm, gate/up + swiglu, down + residual, "
        "logits, cross-entropy",
        "shape": f"{batch}x{seq}x{d}, {heads} heads, vocab {vocab}",
        "rtxdsl launches": s.kernels_launched,
        "eager launches": eager_launches,
        "fewer launches %": round(100 * (1 - s.kernels_launched / eager_launches), 1),
        "eager ops (both)": f.eager_ops,
        "MB moved (rtxdsl)": round(s.bytes_moved / 1e6, 3),
        "MB moved (eager)": round(s.bytes_eager / 1e6, 3),
        "max error": (got - want).abs().max().item(),
    }


def overheads(calls: int) -> list[dict]:
    """Capture per recorded op and a cached flush, against one eager op on the same 1-element
    tensor, timed in interleaved rounds (ratios are what this drifting machine can state)."""
    dry = rx.Fusion(rx.FusionConfig(dry_run=True))
    t = torch.randn(1)
    la = dry.lazy(t)
    stream = dry.stream(t.device)

    def capture() -> None:  # 12 recorded ops (4 x mul, add, relu), then dropped unflushed
        y = la
        for _ in range(4):
            y = torch.relu(y * 2.0 + 1.0)
        stream._reset()

    def flush() -> None:  # the same 12 ops, recorded and flushed through a cached plan
        y = la
        for _ in range(4):
            y = torch.relu(y * 2.0 + 1.0)
        y.torch()

    def eager() -> None:
        y = t
        for _ in range(4):
            y = torch.relu(y * 2.0 + 1.0)

    r = host_compare({"capture": capture, "flush": flush, "eager": eager, "op": lambda: t * 2.0}, calls)
    per_op = r["capture"] / 12
    return [
        {"what": "capture, per recorded op", "us": per_op, "x eager op": per_op / r["op"]},
        {"what": "flush of a cached 12-op segment (host work, dry_run)", "us": r["flush"] - r["capture"]},
        {"what": "eager torch, one op (t * 2.0) on a 1-element CPU tensor", "us": r["op"], "x eager op": 1.0},
        {
            "what": "eager torch, the same 12 ops, per op",
            "us": r["eager"] / 12,
            "x eager op": r["eager"] / 12 / r["op"],
        },
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    shapes = [(8, 64)] if args.quick else [(8, 256), (64, 768)]
    blocks = [block_counts(r, d) for r, d in shapes]
    print(f"## Transformer block on lazy tensors ({machine()}; python -m benches.lazy_report)\n")
    print(
        markdown(
            blocks,
            [
                "sequence",
                "shape",
                "rtxdsl launches",
                "eager launches",
                "fewer launches %",
                "rtxdsl MB",
                "eager MB",
                "max error",
            ],
        )
    )
    llama = [
        llama_counts(*c) for c in ([(1, 8, 64, 4, 97)] if args.quick else [(2, 16, 128, 4, 257), (1, 64, 256, 8, 1000)])
    ]
    print("\n## Llama-style block on lazy tensors (matmuls recorded, attention eager)\n")
    cols = ["block", "shape", "rtxdsl launches", "eager launches", "fewer launches %", "eager ops (both)"]
    print(markdown(llama, [*cols, "MB moved (rtxdsl)", "MB moved (eager)", "max error"]))
    over = overheads(100 if args.quick else 1000)
    print("\n## Capture and flush overhead (host)\n")
    print(markdown(over, ["what", "us", "x eager op"]))
    if not args.quick:
        print(f"\nwrote {save('lazy-cpu', {'block': blocks, 'llama': llama, 'overhead': over})}")


if __name__ == "__main__":
    main()
