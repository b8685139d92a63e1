"""Attention as planned for sm_90: launches, buffers, bytes moved and tensor-core FLOPs of the
forward and the backward, multi-head and grouped-query (nothing runs: ``lower_for`` plans).

Each row is ``rx.attention(q, k, v, causal=True, enable_gqa=...)`` at ``B x Hq heads x T x D`` in
bf16, with ``Hkv`` key/value heads; "largest buffer" is the largest tensor a plan allocates
(the scores would be ``B * Hq * T * T`` elements; K repeated per query head ``B * Hq * T * D``).

    python -m benches.attention_report            # 1 x 32 heads x 4096 x 128
    python -m benches.attention_report --quick    # CI smoke: 1 x 8 heads x 256 x 64

A decoding step (one query per head over a cache of ``Tk`` keys, 32 query and 8 key/value heads,
head dim 128) follows, as planned with its keys split into chunks (``SPLIT_KV``) and whole.
"""

from __future__ import annotations

import argparse
import importlib
import math

import torch

import rtxdsl as rx
from benches.common import machine, markdown, save
from rtxdsl.lower.spec import Program
from rtxdsl.lower.target import GPU

MB = 1e6


def _plans(hq: int, hkv: int, t: int, d: int) -> tuple[Program, Program]:
    """The forward and backward programs on sm_90 for causal attention with ``hkv`` key heads."""
    bf = {"dtype": torch.bfloat16, "requires_grad": True}
    ins = {n: torch.empty(1, h, t, d, **bf) for n, h in (("q", hq), ("k", hkv), ("v", hkv))}
    q, k, v = rx.var("q"), rx.var("k"), rx.var("v")
    kern = rx.compile(rx.attention(q, k, v, causal=True, enable_gqa=hq != hkv))
    forward = kern.lower_for(GPU, **ins)
    plan = kern.grad_plan(**ins)
    saved = plan.forward.program(**ins)
    feed = {n: x.detach() for n, x in ins.items()} | {"_g0": torch.empty(1, hq, t, d, dtype=torch.bfloat16)}
    for key, slot in saved.outputs:
        buf = saved.buffers[slot - saved.n_inputs]
        feed[key] = torch.empty(buf.shape, dtype=buf.dtype)
    backward = plan.backward.lower_for(GPU, **{n: feed[n] for n in plan.backward.inputs})
    return forward, backward


def _row(case: str, pass_: str, program: Program) -> dict:
    sizes = [math.prod(b.shape) * b.dtype.itemsize for b in program.buffers]
    return {
        "case": case,
        "pass": pass_,
        "launches": len(program.launched),
        "buffers MB": round(sum(sizes) / MB, 1),
        "largest buffer MB": round(max(sizes, default=0) / MB, 1),
        "moved MB": round(program.bytes_moved / MB, 1),
        "GFLOP": round(program.flops / 1e9, 1),
    }


def _decode_rows(tk: int) -> list[dict]:
    """A decoding step at ``tk`` keys, split into chunks and whole (``SPLIT_KV``'s threshold raised)."""
    ops = importlib.import_module("rtxdsl.ops.attention")
    ins = {n: torch.empty(1, h, t, 128, dtype=torch.bfloat16) for n, h, t in (("q", 32, 1), ("k", 8, tk), ("v", 8, tk))}
    rows = []
    for how, least in (("split", ops.SPLIT_KV["min_keys"]), ("whole", tk + 1)):
        kept, ops.SPLIT_KV["min_keys"] = ops.SPLIT_KV["min_keys"], least
        try:
            # (a kernel of its own each time: plans are cached per kernel)
            program = rx.compile(rx.attention(rx.var("q"), rx.var("k"), rx.var("v"), enable_gqa=True)).lower_for(
                GPU, **ins
            )
        finally:
            ops.SPLIT_KV["min_keys"] = kept
        rows.append(
            {
                "Tk": tk,
                "keys": how,
                "launches": len(program.launched),
                "programs of the largest launch": max(math.prod(c.grid) for c in program.kernels),
                "moved MB": round(program.bytes_moved / MB, 2),
                "GFLOP": round(program.flops / 1e9, 3),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    hq, t, d = (8, 256, 64) if args.quick else (32, 4096, 128)
    rows = []
    for case, hkv in ((f"MHA ({hq} heads)", hq), (f"GQA ({hq // 4} key/value heads)", hq // 4)):
        forward, backward = _plans(hq, hkv, t, d)
        rows += [_row(case, "forward", forward), _row(case, "backward", backward)]
    print(f"causal attention, 1 x {hq} heads x {t} x {d}, bf16, planned for sm_90 ({machine()})\n")
    print(markdown(rows, list(rows[0])))
    decode = [r for tk in ((8192,) if args.quick else (4096, 32768)) for r in _decode_rows(tk)]
    print("\ndecoding step, 1 x 32 query heads (8 key/value heads) x 1 query x Tk keys x 128, bf16\n")
    print(markdown(decode, list(decode[0])))
    save("attention-quick" if args.quick else "attention", {"rows": rows, "decode": decode})


if __name__ == "__main__":
    main()
