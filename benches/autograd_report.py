"""Autograd report: backward kernel counts and saved-activation memory against eager torch.

python -m benches.autograd_report           # 64x1024 inputs
python -m benches.autograd_report --quick   # CI smoke
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import rtxdsl as rx
from benches.common import machine, markdown, save
from rtxdsl.ops import REGISTRY
from rtxdsl.workloads import rope_eager

x, y, w, b, c, s, t, c3 = (rx.var(n) for n in ("x", "y", "w", "b", "c", "s", "t", "c3"))
CASES = {
    "bias_gelu": (rx.gelu(x + b), lambda x, b: F.gelu(x + b), ("x", "b")),
    "layer_norm": (rx.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b), ("x", "w", "b")),
    "rms_norm": (rx.rms_norm(x, w), lambda x, w: F.rms_norm(x, x.shape[-1:], w, 1e-6), ("x", "w")),
    "softmax": (rx.softmax(x), lambda x: torch.softmax(x, -1), ("x",)),
    "swiglu": (rx.swiglu(x, y), lambda x, y: F.silu(x) * y, ("x", "y")),
    "geglu": (rx.geglu(x, y), lambda x, y: F.gelu(x) * y, ("x", "y")),
    "rope": (rx.rope(x, c, s), lambda x, c, s: rope_eager(x, c, s), ("x", "c", "s")),
    "cross_entropy": (rx.cross_entropy(x, t), lambda x, t: F.cross_entropy(x, t), ("x", "t")),
    # Liger-Kernel's op set (eager: each op's torch reference from the registry)
    "kl_div": (
        rx.kl_div(x, y, "batchmean", True),
        lambda x, y: F.kl_div(x, y, reduction="batchmean", log_target=True),
        ("x", "y"),
    ),
    "jsd": (rx.jsd(x, y, beta=0.3), lambda x, y: REGISTRY["jsd"].ref(x, y, beta=0.3, ignore_index=-100), ("x", "y")),
    "tvd": (rx.tvd(x, y), lambda x, y: (x - y).abs().sum() / 2 / x.shape[0], ("x", "y")),
    "dyt": (rx.dyt(x, 0.5, w, b), lambda x, w, b: w * torch.tanh(0.5 * x) + b, ("x", "w", "b")),
    "relu_squared": (rx.relu_squared(x), lambda x: torch.relu(x) ** 2, ("x",)),
    "poly_norm": (rx.poly_norm(x, c3, 0.1), lambda x, c3: REGISTRY["poly_norm"].ref(x, c3, 0.1, 1e-6), ("x", "c3")),
    "sparsemax": (rx.sparsemax(x), lambda x: REGISTRY["sparsemax"].ref(x, -1), ("x",)),
    "dropout_residual_ln": (
        rx.layer_norm(rx.dropout(x, 0.1, seed=3) + y, w, b),
        None,  # Philox numbers differ from torch's generator: counts and memory only
        ("x", "y", "w", "b"),
    ),
}


def saved_bytes(fn) -> tuple[int, object]:
    """Bytes of tensors autograd saves while ``fn`` runs (the activations kept for backward)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, out


def measure(name: str, rows: int, hidden: int) -> dict:
    expr, eager, names = CASES[name]
    shapes = {"x": (rows, hidden), "y": (rows, hidden), "w": (hidden,), "b": (hidden,)}
    shapes |= {"c": (rows, hidden), "s": (rows, hidden), "c3": (3,)}
    gen = torch.Generator().manual_seed(0)
    base = {
        n: torch.randint(0, hidden, (rows,), generator=gen) if n == "t" else torch.randn(shapes[n], generator=gen)
        for n in names
    }
    k = rx.compile(expr)
    ours = {n: v.clone().requires_grad_(v.is_floating_point()) for n, v in base.items()}
    theirs = {n: v.clone().requires_grad_(v.is_floating_point()) for n, v in base.items()}
    rx.reset_fusion_stats()
    our_saved, out = saved_bytes(lambda: k(**ours))
    fwd = rx.fusion_stats().kernels_launched
    go = torch.randn(out.shape, generator=gen)
    rx.reset_fusion_stats()
    out.backward(go)
    bwd = rx.fusion_stats().kernels_launched
    eager_saved, err = 0, float("nan")
    if eager is not None:
        eager_saved, ref = saved_bytes(lambda: eager(**theirs))
        ref.backward(go)
        err = max((ours[n].grad - theirs[n].grad).abs().max().item() for n in names if ours[n].requires_grad)
    return {
        "op": name,
        "shape": f"{rows}x{hidden}",
        "forward kernels": fwd,
        "backward kernels": bwd,
        "saved MB (rtxdsl)": our_saved / 1e6,
        "saved MB (eager)": eager_saved / 1e6,
        "max grad error vs eager": err,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rows, hidden = (4, 64) if args.quick else (64, 1024)
    table = [measure(n, rows, hidden) for n in CASES]
    print(f"## Forward + backward ({machine()}; python -m benches.autograd_report)\n")
    print(
        markdown(
            table,
            [
                "op",
                "shape",
                "forward kernels",
                "backward kernels",
                "saved MB (rtxdsl)",
                "saved MB (eager)",
                "max grad error vs eager",
            ],
        )
    )
    if not args.quick:
        print(f"\nwrote {save('autograd-cpu', {'autograd': table})}")


if __name__ == "__main__":
    main()
