"""One training step of a small model after ``rx.nn.replace_modules``, compiled by Inductor, in a
process of its own: test_torch_compile.py runs it twice with one ``TORCHINDUCTOR_CACHE_DIR``, so
the second process loads the compiled graphs from torch's disk caches (FX graph and AOT autograd)
with none of the first one's kernels built. Saves the loss, every gradient and every updated
parameter (of the compiled replaced model and of the unmodified one run eagerly) and the caches'
counters to the file named by ``argv[1]``.

    python tests/helpers/compiled_step.py OUT.pt
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import rtxdsl as rx  # noqa: E402


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
):
    """Hugging Face's (replace_modules patches it here, in the module defining the attention class)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class TinyAttention(torch.nn.Module):
    """Llama's q and k, transposed views of their projections, rotated; their product stands in for
    the attention (RoPE's kernel returns contiguous q and k where torch keeps the transposed order)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.q_proj, self.k_proj = heads, torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim // heads, 2) / (dim // heads)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        freqs = torch.arange(s, dtype=torch.float32)[:, None] * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), -1)[None]
        q = self.q_proj(x).view(b, s, self.heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.heads, -1).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
        return (q * k).transpose(1, 2).reshape(b, s, dim)


class MLP(torch.nn.Module):
    """Llama's gated MLP (replaced by rx.nn.SwiGLU)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(dim, hidden), torch.nn.Linear(dim, hidden)
        self.down_proj = torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Small(torch.nn.Module):
    """A decoder layer's kernels at their layouts: an RMSNorm, RoPE on transposed q and k, a gated
    MLP, and a cross-entropy loss saving each row's logsumexp."""

    def __init__(self, dim: int = 8, vocab: int = 11) -> None:
        super().__init__()
        self.norm, self.attn, self.mlp = torch.nn.RMSNorm(dim), TinyAttention(dim, 2), MLP(dim, 2 * dim)
        self.head, self.loss = torch.nn.Linear(dim, vocab), torch.nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm(x))
        return self.loss(self.head(self.mlp(h)).flatten(0, 1), target.flatten())


def step(model: torch.nn.Module, run: Any, x: torch.Tensor, target: torch.Tensor) -> dict:
    """Forward, backward and an SGD step of ``model``, called through ``run``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = run(x, target)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return {
        "loss": loss.detach(),
        "grads": grads,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def main(out: str) -> None:
    torch.manual_seed(0)
    model = Small()
    fused = copy.deepcopy(model)
    fused.loss = rx.nn.CrossEntropyLoss()
    assert rx.nn.replace_modules(fused).by_kind == {"rms_norm": 1, "mlp": 1, "rope": 1}
    gen = torch.Generator().manual_seed(1)
    x, target = torch.randn(2, 3, 8, generator=gen), torch.randint(0, 11, (2, 3), generator=gen)
    compiled = step(fused, torch.compile(fused, fullgraph=True), x, target)
    eager = step(model, model, x, target)
    seen = {k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd")}
    torch.save({"compiled": compiled, "eager": eager, "counters": seen}, out)


if __name__ == "__main__":
    main(sys.argv[1])
