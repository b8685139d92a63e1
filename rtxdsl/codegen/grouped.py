"""The grouped GEMM family of a mixture of experts: one launch for every expert's rows.

Rows routed to experts are sorted by expert (:func:`rtxdsl.nn.moe.route`); each program of
:func:`grouped_gemm_kernel` takes one tile of rows that share an expert (the routing's tile table:
``tile_expert``, ``tile_lo``, ``tile_hi``; a tile past the last expert has ``lo == hi`` and does
nothing) and one block of columns, reads its rows of A through a gather (``GATHER``: the tokens'
rows, no permuted copy) and multiplies them by its expert's matrix. :func:`segment_gemm_kernel`
is a weight gradient: per expert, a K loop over that expert's rows (a segment of the sorted
order, empty for an expert no token chose: its gradient is zeros). :func:`combine_kernel` sums
each token's ``top_k`` rows back in a fixed order (no atomics: deterministic).

Every kernel multiplies in fp32 accumulators (Triton tutorial 03's K loop); ``PRECISION`` is
``tl.dot``'s ``input_precision`` for fp32 operands (``ieee``, or ``tf32`` where the config allows it;
half-precision operands ignore it).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _activation(g, ACTIVATION: tl.constexpr):
    """``act(g)`` and ``act'(g)`` in fp32: silu (SwiGLU), gelu's tanh form and gelu (GeGLU)."""
    if ACTIVATION == "silu":
        s = tl.sigmoid(g)
        y = g * s
        dy = s * (1.0 + g * (1.0 - s))
    elif ACTIVATION == "gelu_tanh":
        # tanh(u) = 2 * sigmoid(2u) - 1
        t = 2.0 * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g)) - 1.0
        y = 0.5 * g * (1.0 + t)
        dy = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * g * g)
    else:
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        y = g * cdf
        dy = cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
    return y, dy


@triton.jit
def grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, rows_ptr, scale_ptr, tile_expert_ptr, tile_lo_ptr, tile_hi_ptr, h_ptr, act_ptr, part_ptr,
    N, K,
    stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_cm, stride_cn,
    stride_hm, stride_hn, stride_actm, stride_actn, stride_part,
    GATHER: tl.constexpr, SCALE: tl.constexpr, EPILOGUE: tl.constexpr, ACTIVATION: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``c[s, n] = scale[s] * sum_k a[row(s), k] * w[expert(s), k, n]`` over one tile of sorted rows.

    ``EPILOGUE``: ``"none"``; ``"gated"`` (the up projection): ``w`` holds ``[gate | up]`` columns
    (``2N``), ``c`` gets both (the pre-activations the backward reads) and ``act`` gets
    ``act(gate) * up``; ``"dgated"`` (the down projection's input gradient): the product is the
    gradient of ``scale * act(gate) * up`` with ``gate, up`` read from ``h``, ``c`` gets
    ``[dgate | dup]``, ``act`` the recomputed ``act(gate) * up`` (the down weights' gradient reads
    it) and ``part`` each row's sum over this block of columns of the product times it (the routing
    weight's gradient, summed over the column blocks by the caller: no atomics)."""
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    # the tile's expert and its rows of the sorted order
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    lo = tl.load(tile_lo_ptr + tile)
    hi = tl.load(tile_hi_ptr + tile)
    offs_m = lo + tl.arange(0, BLOCK_M)
    row_mask = offs_m < hi
    # A's rows: a token's row through the gather, or the sorted row itself
    if GATHER:
        rows = tl.load(rows_ptr + offs_m, mask=row_mask, other=0).to(tl.int64)
    else:
        rows = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # the K loop (none for an empty tile); the gated epilogue's up columns are N further on
    k_end = tl.where(hi > lo, K, 0)
    for k_start in range(0, k_end, BLOCK_K):
        ks = k_start + offs_k
        a_mask = row_mask[:, None] & (ks[None, :] < K)
        b_mask = (ks[:, None] < K) & (offs_n[None, :] < N)
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak, mask=a_mask, other=0)
        b_ptrs = w_tile + ks[:, None] * stride_wk + offs_n[None, :] * stride_wn
        acc = tl.dot(a, tl.load(b_ptrs, mask=b_mask, other=0), acc, input_precision=PRECISION)
        if EPILOGUE == "gated":
            b_up = tl.load(b_ptrs + N * stride_wn, mask=b_mask, other=0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
    mask = row_mask[:, None] & (offs_n[None, :] < N)
    c_offs = offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    act_offs = offs_m.to(tl.int64)[:, None] * stride_actm + offs_n[None, :] * stride_actn
    if EPILOGUE == "gated":
        # the pre-activations, then act(gate) * up from the fp32 accumulators
        tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=mask)
        tl.store(c_ptr + c_offs + N * stride_cn, acc_up.to(c_ptr.dtype.element_ty), mask=mask)
        y, _ = _activation(acc, ACTIVATION)
        tl.store(act_ptr + act_offs, (y * acc_up).to(act_ptr.dtype.element_ty), mask=mask)
    elif EPILOGUE == "dgated":
        # recompute act(gate) * up from the saved pre-activations
        h_offs = offs_m.to(tl.int64)[:, None] * stride_hm + offs_n[None, :] * stride_hn
        gate = tl.load(h_ptr + h_offs, mask=mask, other=0).to(tl.float32)
        up = tl.load(h_ptr + h_offs + N * stride_hn, mask=mask, other=0).to(tl.float32)
        y, dy = _activation(gate, ACTIVATION)
        tl.store(act_ptr + act_offs, (y * up).to(act_ptr.dtype.element_ty), mask=mask)
        # the routing weight's gradient over this block of columns (masked columns add zeros)
        part = tl.sum(acc * (y * up), axis=1)
        tl.store(part_ptr + pid_n.to(tl.int64) * stride_part + offs_m, part, mask=row_mask)
        # d(act(gate) * up): the cotangent scaled by the routing weight, in fp32
        acc = acc * tl.load(scale_ptr + offs_m, mask=row_mask, other=0).to(tl.float32)[:, None]
        tl.store(c_ptr + c_offs, (acc * up * dy).to(c_ptr.dtype.element_ty), mask=mask)
        tl.store(c_ptr + c_offs + N * stride_cn, (acc * y).to(c_ptr.dtype.element_ty), mask=mask)
    else:
        # the routing weight of each row, in fp32 before the product is rounded
        if SCALE:
            acc = acc * tl.load(scale_ptr + offs_m, mask=row_mask, other=0).to(tl.float32)[:, None]
        tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def segment_gemm_kernel(
    p_ptr, q_ptr, out_ptr, p_rows_ptr, q_rows_ptr, scale_ptr, bounds_ptr,
    N, K,
    stride_pm, stride_pn, stride_qm, stride_qk, stride_oe, stride_on, stride_ok,
    P_GATHER: tl.constexpr, Q_GATHER: tl.constexpr, SCALE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """``out[e, n, k] = sum_{s in e} (scale[s] * p[prow(s), n]) * q[qrow(s), k]``: a weight gradient."""
    pid = tl.program_id(0)
    expert = tl.program_id(1)
    num_pid_k = tl.cdiv(K, BLOCK_K)
    offs_n = (pid // num_pid_k) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = (pid % num_pid_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    # the expert's segment of the sorted rows
    lo = tl.load(bounds_ptr + expert)
    hi = tl.load(bounds_ptr + expert + 1)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for s_start in range(lo, hi, BLOCK_S):
        ss = s_start + tl.arange(0, BLOCK_S)
        s_mask = ss < hi
        if P_GATHER:
            p_rows = tl.load(p_rows_ptr + ss, mask=s_mask, other=0).to(tl.int64)
        else:
            p_rows = ss.to(tl.int64)
        if Q_GATHER:
            q_rows = tl.load(q_rows_ptr + ss, mask=s_mask, other=0).to(tl.int64)
        else:
            q_rows = ss.to(tl.int64)
        p_mask = s_mask[:, None] & (offs_n[None, :] < N)
        p = tl.load(p_ptr + p_rows[:, None] * stride_pm + offs_n[None, :] * stride_pn, mask=p_mask, other=0)
        # the routing weight scales the output gradient, rounded as the product's operand
        if SCALE:
            w = tl.load(scale_ptr + ss, mask=s_mask, other=0).to(tl.float32)
            p = (p.to(tl.float32) * w[:, None]).to(q_ptr.dtype.element_ty)
        q_mask = s_mask[:, None] & (offs_k[None, :] < K)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qm + offs_k[None, :] * stride_qk, mask=q_mask, other=0)
        acc = tl.dot(tl.trans(p), q, acc, input_precision=PRECISION)
    o_offs = expert.to(tl.int64) * stride_oe + offs_n[:, None] * stride_on + offs_k[None, :] * stride_ok
    tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))


@triton.jit
def combine_kernel(
    y_ptr, out_ptr, pos_ptr,
    N,
    stride_ym, stride_yn, stride_om, stride_on,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``out[t, n] = sum_j y[pos[t, j], n]``: a token's rows of the sorted order, in a fixed order."""
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(pos_ptr + token * TOP_K + j).to(tl.int64)
        acc += tl.load(y_ptr + row * stride_ym + offs_n * stride_yn, mask=mask, other=0).to(tl.float32)
    tl.store(out_ptr + token * stride_om + offs_n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask)
