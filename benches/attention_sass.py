"""Attention's forward compiled for sm_90 without a GPU, beside Triton's fused-attention tutorial.

rtxdsl's kernel is ``rx.attention(q, k, v, causal=True)`` as planned for sm_90 (one kernel: the
``P @ v`` GEMM, its logsumexp merged in its K loop as it runs). The peer is tutorial 06's
FlashAttention-2 loop, written here as the tutorial writes it (``q`` loaded once, ``exp2`` with
the scale folded into ``log2(e)``, the running max and sum, ``acc`` rescaled per key block), with
its H100 choice (128 query rows x 64 keys per block, 3 stages; 4 warps at head dim 64, 8 at
128). The tutorial runs causal attention in two loops, the blocks below the diagonal unmasked
and the diagonal's masked; the peer here is its masked loop (rtxdsl masks every block).

Both are compiled by Triton for ``GPUTarget("cuda", 90, 32)`` and read with the ``ptxas`` /
``cuobjdump`` in Triton's wheel: ``wgmma`` in the PTX, registers, spills, static SASS inside the
loops, and that per score: ``loop instructions * warps / (rows x keys per iteration)``, the warp
instructions one score costs (the static count of the key loop's body; an inner loop over the head
dim, rtxdsl's ``q @ k.mT`` K loop, counts once).

    python -m benches.attention_sass            # head dims 64 and 128
    python -m benches.attention_sass --quick    # CI smoke: head dim 64
"""

from __future__ import annotations

import os

# compiled (not interpreted) Triton: must be decided before triton is imported
os.environ.setdefault("TRITON_INTERPRET", "0")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import argparse  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import rtxdsl as rx  # noqa: E402
from benches.common import markdown, save  # noqa: E402
from rtxdsl.build import compile_kernel, prepare  # noqa: E402
from rtxdsl.codegen.ptx import CompileFacts, compile_call, sass_counts  # noqa: E402


@triton.jit
def tutorial_attention(
    Q, K, V, Out, M, sm_scale, stride_h, stride_m, n_ctx,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Triton tutorial 06 (FlashAttention-2), forward: one program per block of query rows of a head
    start_m = tl.program_id(0)
    off_h = tl.program_id(1)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    base = off_h * stride_h
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.44269504  # exp2 of scores in base 2
    q = tl.load(Q + base + offs_m[:, None] * stride_m + offs_d[None, :])  # once, kept for every block
    hi = (start_m + 1) * BLOCK_M  # causal: the keys up to the block's last row
    for start_n in range(0, hi, BLOCK_N):
        k = tl.load(K + base + (start_n + offs_n)[None, :] * stride_m + offs_d[:, None])
        qk = tl.dot(q, k)
        mask = offs_m[:, None] >= (start_n + offs_n[None, :])
        qk = qk * qk_scale + tl.where(mask, 0, -1.0e6)
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        qk -= m_ij[:, None]
        p = tl.math.exp2(qk)
        l_ij = tl.sum(p, 1)
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + l_ij
        acc = acc * alpha[:, None]
        v = tl.load(V + base + (start_n + offs_n)[:, None] * stride_m + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
    m_i += tl.math.log2(l_i)
    acc = acc / l_i[:, None]
    tl.store(M + off_h * n_ctx + offs_m, m_i)
    tl.store(Out + base + offs_m[:, None] * stride_m + offs_d[None, :], acc.to(Out.type.element_ty))


def _row(kernel: str, facts: CompileFacts, warps: int, rows: int, keys: int) -> dict:
    sass = sass_counts(facts.ptx)
    assert sass is not None, "no ptxas / cuobjdump in this Triton's wheel"
    return {
        "kernel": kernel,
        "tile (rows x keys)": f"{rows} x {keys}",
        "warps": warps,
        "wgmma": facts.ptx.count("wgmma.mma_async"),
        "registers": facts.registers,
        "spills": facts.spill_bytes,
        "SASS": sass.instructions,
        "in the loop": sass.loop,
        "loop per score": round(sass.loop * warps / (rows * keys), 3),
    }


def _tutorial(heads: int, t: int, d: int, dtype: torch.dtype) -> dict:
    block_m, block_n, warps = 128, 64, 4 if d == 64 else 8
    q, k, v, out = (torch.empty(heads, t, d, dtype=dtype) for _ in range(4))
    stat = torch.empty(heads, t)
    meta = {"HEAD_DIM": d, "BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": 3}
    call = SimpleNamespace(meta=meta, args=[d**-0.5, t * d, d, t])  # sm_scale, head and row strides, n_ctx
    facts = compile_call(tutorial_attention, call, [q, k, v, out, stat])
    return _row("Triton tutorial 06 (masked loop)", facts, warps, block_m, block_n)


def _rtxdsl(heads: int, t: int, d: int, dtype: torch.dtype) -> dict:
    kern = rx.compile(rx.attention(rx.var("q"), rx.var("k"), rx.var("v"), causal=True))
    ins = {n: torch.empty(1, heads, t, d, dtype=dtype) for n in "qkv"}
    program, _ = prepare(kern, ins)
    (call,) = program.kernels
    (facts,) = compile_kernel(kern, ins)
    meta = dict(call.meta)
    return _row("rtxdsl rx.attention", facts, meta["num_warps"], meta["BLOCK_M"], meta["BLOCK_K"])


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="head dim 64 only (CI smoke)")
    args = ap.parse_args()
    rows = []
    for d in (64,) if args.quick else (64, 128):
        for make in (_rtxdsl, _tutorial):
            rows.append({"head dim": d} | make(32, 4096, d, torch.bfloat16))
    print("causal attention forward, bf16, 32 heads x 4096 tokens, compiled for sm_90\n")
    print(markdown(rows, list(rows[0])))
    save("attention-sass-quick" if args.quick else "attention-sass", {"rows": rows})


if __name__ == "__main__":
    main()
