"""Attention compiled for sm_90 without a GPU, beside Triton's fused-attention tutorial.

rtxdsl's kernel is ``rx.attention(q, k, v, causal=True)`` as planned for sm_90 (one kernel: the
``P @ v`` GEMM, its logsumexp merged in its K loop as it runs). The peer is tutorial 06's
FlashAttention-2 loop, written here as the tutorial writes it (``q`` loaded once, ``exp2`` with
the scale folded into ``log2(e)``, the running max and sum, ``acc`` rescaled per key block), with
its H100 choice (128 query rows x 64 keys per block, 3 stages; 4 warps at head dim 64, 8 at
128). The tutorial runs causal attention in two loops, the blocks below the diagonal unmasked
and the diagonal's masked: both are compiled (its ``MASKED`` constexpr), as rtxdsl splits its K
loop where registers allow (``GemmWriter._split_loop``: 8 warps, or dQ's one accumulator).

Both are compiled by Triton for ``GPUTarget("cuda", 90, 32)`` and read with the ``ptxas`` /
``cuobjdump`` in Triton's wheel: ``wgmma`` in the PTX, registers, spills, static SASS inside the
loops, and that per score: ``loop instructions * warps / (rows x keys per iteration)``, the warp
instructions one score costs (the static count of the key loop's body; an inner loop over the head
dim, rtxdsl's ``q @ k.mT`` K loop, counts once).

The backward's GEMM kernels (dQ's; dK and dV's, one K loop over the queries) beside tutorial 06's
dK/dV kernel as it writes it (128 keys x 32 queries per iteration, 4 warps, 5 stages, K and V
loaded once; masked and unmasked), per score likewise; "per score, each loop" lists each loop's
(rtxdsl's tile scan first, then its K loop or its split K loop's two: the diagonal's slices, then
those below it).

    python -m benches.attention_sass            # head dims 64 and 128, forward and backward
    python -m benches.attention_sass --quick    # CI smoke: head dim 64, the forward
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
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
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
        if MASKED:  # the diagonal's blocks (stage 2); those below it run the same loop unmasked (stage 1)
            mask = offs_m[:, None] >= (start_n + offs_n[None, :])
            qk = qk * qk_scale + tl.where(mask, 0, -1.0e6)
        else:
            qk = qk * qk_scale
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


@triton.jit
def tutorial_attention_dkdv(
    Q, K, V, DO, DK, DV, M, D, stride_h, stride_m, n_ctx,
    HEAD_DIM: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    # Triton tutorial 06, backward: dK and dV of a block of keys in one loop over blocks of queries
    # (from the diagonal on: its masked loop), K scaled by sm_scale * log2(e) by the host as the
    # tutorial's is, the row statistic M in base 2, D = rowsum(dO * O) from its preprocessing kernel
    start_n = tl.program_id(0) * BLOCK_N1
    base = tl.program_id(1) * stride_h
    row = tl.program_id(1) * n_ctx
    offs_n = start_n + tl.arange(0, BLOCK_N1)
    offs_k = tl.arange(0, HEAD_DIM)
    k = tl.load(K + base + offs_n[:, None] * stride_m + offs_k[None, :])  # once, kept for every block
    v = tl.load(V + base + offs_n[:, None] * stride_m + offs_k[None, :])
    dk = tl.zeros([BLOCK_N1, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N1, HEAD_DIM], dtype=tl.float32)
    for start_m in range(start_n, n_ctx, BLOCK_M1):
        offs_m = start_m + tl.arange(0, BLOCK_M1)
        qT = tl.load(Q + base + offs_m[None, :] * stride_m + offs_k[:, None])
        m = tl.load(M + row + offs_m)
        pT = tl.math.exp2(tl.dot(k, qT) - m[None, :])
        if MASKED:  # the diagonal's blocks; the tutorial runs those past them unmasked
            pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        do = tl.load(DO + base + offs_m[:, None] * stride_m + offs_k[None, :])
        dv += tl.dot(pT.to(do.dtype), do)
        dpT = tl.dot(v, tl.trans(do)).to(tl.float32)
        dsT = pT * (dpT - tl.load(D + row + offs_m)[None, :])
        dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT))
    tl.store(DK + base + offs_n[:, None] * stride_m + offs_k[None, :], dk.to(DK.type.element_ty))
    tl.store(DV + base + offs_n[:, None] * stride_m + offs_k[None, :], dv.to(DV.type.element_ty))


def _row(kernel: str, facts: CompileFacts, warps: int, rows: int, keys: int) -> dict:
    """A kernel's facts; per score: each loop's (rtxdsl's: the tile scan, then the K loop, or a
    split K loop's two, the diagonal's slices and those below it, ``GemmWriter._split_loop``)."""
    sass = sass_counts(facts.ptx)
    assert sass is not None, "no ptxas / cuobjdump in this Triton's wheel"
    per_loop = [round(n * warps / (rows * keys), 3) for n in sass.loops]
    return {
        "kernel": kernel,
        "tile (rows x keys)": f"{rows} x {keys}",
        "warps": warps,
        "wgmma": facts.ptx.count("wgmma.mma_async"),
        "registers": facts.registers,
        "spills": facts.spill_bytes,
        "SASS": sass.instructions,
        "in the loops": sass.loop,
        "per score, each loop": " / ".join(map(str, per_loop)),
    }


def _tutorial(heads: int, t: int, d: int, dtype: torch.dtype, masked: bool) -> dict:
    block_m, block_n, warps = 128, 64, 4 if d == 64 else 8
    q, k, v, out = (torch.empty(heads, t, d, dtype=dtype) for _ in range(4))
    stat = torch.empty(heads, t)
    meta = {
        "HEAD_DIM": d,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "MASKED": masked,
        "num_warps": warps,
        "num_stages": 3,
    }
    call = SimpleNamespace(meta=meta, args=[d**-0.5, t * d, d, t])  # sm_scale, head and row strides, n_ctx
    facts = compile_call(tutorial_attention, call, [q, k, v, out, stat])
    which = "masked loop" if masked else "unmasked loop"
    return _row(f"Triton tutorial 06 ({which})", facts, warps, block_m, block_n)


def _rtxdsl(heads: int, t: int, d: int, dtype: torch.dtype) -> dict:
    kern = rx.compile(rx.attention(rx.var("q"), rx.var("k"), rx.var("v"), causal=True))
    ins = {n: torch.empty(1, heads, t, d, dtype=dtype) for n in "qkv"}
    program, _ = prepare(kern, ins)
    (call,) = program.kernels
    (facts,) = compile_kernel(kern, ins)
    meta = dict(call.meta)
    return _row("rtxdsl rx.attention", facts, meta["num_warps"], meta["BLOCK_M"], meta["BLOCK_K"])


def _tutorial_dkdv(heads: int, t: int, d: int, dtype: torch.dtype, masked: bool) -> dict:
    block_m1, block_n1, warps = 32, 128, 4  # the tutorial's backward choice (5 stages), at every head dim
    tensors = [torch.empty(heads, t, d, dtype=dtype) for _ in range(6)] + [torch.empty(heads, t) for _ in range(2)]
    meta = {"HEAD_DIM": d, "BLOCK_M1": block_m1, "BLOCK_N1": block_n1, "MASKED": masked}
    meta |= {"num_warps": warps, "num_stages": 5}
    facts = compile_call(tutorial_attention_dkdv, SimpleNamespace(meta=meta, args=[t * d, d, t]), tensors)
    which = "masked loop" if masked else "unmasked loop"
    return _row(f"Triton tutorial 06 dK + dV ({which})", facts, warps, block_n1, block_m1)


def _rtxdsl_backward(heads: int, t: int, d: int, dtype: torch.dtype) -> list[dict]:
    """The backward's GEMM kernels: dQ's (rows: queries; its loop over keys), dK and dV's (rows:
    keys; one loop over queries)."""
    kern = rx.compile(rx.attention(rx.var("q"), rx.var("k"), rx.var("v"), causal=True))
    ins = {n: torch.empty(1, heads, t, d, dtype=dtype) for n in "qkv"}
    plan = kern.grad_plan(**{n: x.clone().requires_grad_() for n, x in ins.items()})
    feed = plan.backward_feed(ins)
    program, _ = prepare(plan.backward, feed)
    facts = compile_kernel(plan.backward, feed)
    rows = []
    for call, f in zip(program.kernels, facts):
        if call.spec.kind == "gemm":
            meta = dict(call.meta)
            name = "rtxdsl dK + dV" if len(call.spec.outputs) == 2 else "rtxdsl dQ"
            rows.append(_row(name, f, meta["num_warps"], meta["BLOCK_M"], meta["BLOCK_K"]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="head dim 64 only (CI smoke)")
    args = ap.parse_args()
    rows = []
    for d in (64,) if args.quick else (64, 128):
        rows.append({"head dim": d} | _rtxdsl(32, 4096, d, torch.bfloat16))
        for masked in (True, False):
            rows.append({"head dim": d} | _tutorial(32, 4096, d, torch.bfloat16, masked))
    print("causal attention forward, bf16, 32 heads x 4096 tokens, compiled for sm_90\n")
    print(markdown(rows, list(rows[0])))
    backward = []
    for d in () if args.quick else (64, 128):
        tutorial = [_tutorial_dkdv(32, 4096, d, torch.bfloat16, masked) for masked in (True, False)]
        for row in (*_rtxdsl_backward(32, 4096, d, torch.bfloat16), *tutorial):
            backward.append({"head dim": d} | row)
    if backward:  # per score: loop instructions * warps / (rows x the K slice one iteration covers)
        print("\ncausal attention backward, bf16, 32 heads x 4096 tokens, compiled for sm_90\n")
        print(markdown(backward, list(backward[0])))
    save("attention-sass-quick" if args.quick else "attention-sass", {"rows": rows, "backward": backward})


if __name__ == "__main__":
    main()
