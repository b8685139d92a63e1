"""SASS report: rtxdsl's row kernels beside hand-written ones, compiled for sm_90 without a GPU.

Each kernel is compiled by Triton for an H100/H200 (``GPUTarget("cuda", 90, 32)``), assembled by
the ``ptxas`` in Triton's wheel and read back with its ``cuobjdump -sass``: static SASS
instructions (NOPs excluded), barriers, registers and spills. The peers are the kernels of
Triton's tutorials 02 (fused softmax) and 05 (layer norm forward), written here as the
tutorials write them, with tutorial 05's block and warp choice (for bf16 the softmax peer
computes in fp32, as every half-precision softmax does), and Liger-Kernel's RMSNorm forward and
cross-entropy (the loss alone, per row, and with its gradient: ``cross_entropy_grad``, rtxdsl's
``grad_in_forward=True``), imported from ``liger-kernel`` (the ``bench`` extra; its rows are left out where it
is not installed) and launched as Liger launches them.

Static counts compare kernels whose code runs once per block of a row: where a row fits one block,
the count is what each warp issues per row. Instructions per element are warp instructions:
``instructions * num_warps / elements per block``; for a row looped over in blocks (rtxdsl's
cross-entropy at 32K classes, in 4096-wide blocks) that counts each block's pass once, and the
statistics pass and the output pass both. "Loop per element" counts only the instructions inside
the kernel's loops (a looped row's block in each pass, a norm backward's row in its loop over
rows): the code before and after them (a row's target logit, a tail's mean, a program's partials)
runs once per row or program.

    python -m benches.sass_report            # every case
    python -m benches.sass_report --quick    # two cases
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
from rtxdsl.codegen.ptx import compile_call, sass_counts  # noqa: E402


@triton.jit
def tutorial_softmax(
    output_ptr, input_ptr, input_row_stride, output_row_stride, n_rows, n_cols, BLOCK_SIZE: tl.constexpr
):
    # Triton tutorial 02: each program takes rows in a grid-stride loop
    row_start = tl.program_id(0)
    row_step = tl.num_programs(0)
    for row_idx in tl.range(row_start, n_rows, row_step):
        col_offsets = tl.arange(0, BLOCK_SIZE)
        mask = col_offsets < n_cols
        row = tl.load(input_ptr + row_idx * input_row_stride + col_offsets, mask=mask, other=-float("inf"))
        row = row.to(tl.float32)
        row_minus_max = row - tl.max(row, axis=0)
        numerator = tl.exp(row_minus_max)
        denominator = tl.sum(numerator, axis=0)
        out = numerator / denominator
        tl.store(output_ptr + row_idx * output_row_stride + col_offsets, out, mask=mask)


@triton.jit
def tutorial_layer_norm(X, Y, W, B, Mean, Rstd, stride, N, eps, BLOCK_SIZE: tl.constexpr):
    # Triton tutorial 05, forward: the mean, the variance, then the normalized row
    row = tl.program_id(0)
    Y += row * stride
    X += row * stride
    _mean = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    for off in range(0, N, BLOCK_SIZE):
        cols = off + tl.arange(0, BLOCK_SIZE)
        a = tl.load(X + cols, mask=cols < N, other=0.0).to(tl.float32)
        _mean += a
    mean = tl.sum(_mean, axis=0) / N
    _var = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    for off in range(0, N, BLOCK_SIZE):
        cols = off + tl.arange(0, BLOCK_SIZE)
        x = tl.load(X + cols, mask=cols < N, other=0.0).to(tl.float32)
        x = tl.where(cols < N, x - mean, 0.0)
        _var += x * x
    var = tl.sum(_var, axis=0) / N
    rstd = 1 / tl.sqrt(var + eps)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)
    for off in range(0, N, BLOCK_SIZE):
        cols = off + tl.arange(0, BLOCK_SIZE)
        mask = cols < N
        w = tl.load(W + cols, mask=mask)
        b = tl.load(B + cols, mask=mask)
        x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        y = (x - mean) * rstd * w + b
        tl.store(Y + cols, y, mask=mask)


def _peer(name: str, rows: int, cols: int, dtype: torch.dtype) -> dict:
    block = triton.next_power_of_2(cols)
    warps = min(max(block // 256, 1), 8)  # tutorial 05's choice, for both peers
    x, y = torch.empty(rows, cols, dtype=dtype), torch.empty(rows, cols, dtype=dtype)
    if name == "softmax":
        call = SimpleNamespace(meta={"BLOCK_SIZE": block, "num_warps": warps}, args=[cols, cols, rows, cols])
        facts = compile_call(tutorial_softmax, call, [y, x])
    else:
        w, b, stat = torch.empty(cols, dtype=dtype), torch.empty(cols, dtype=dtype), torch.empty(rows)
        call = SimpleNamespace(meta={"BLOCK_SIZE": block, "num_warps": warps}, args=[cols, cols, 1e-5])
        facts = compile_call(tutorial_layer_norm, call, [x, y, w, b, stat, stat])
    return _row(f"Triton tutorial {name}", facts, warps, cols)


def _liger_norm_backward(name: str, rows: int, cols: int, dtype: torch.dtype) -> dict:
    """Liger-Kernel's RMSNorm and LayerNorm backward kernels as Liger launches them: one program per
    SM (132 on sm_90), each looping over its rows, accumulating dW (and dB) per program; the sum over
    the programs' partials is a torch reduction after it (not counted here)."""
    from liger_kernel.ops import layer_norm, rms_norm
    from liger_kernel.ops.utils import calculate_settings

    block, warps = calculate_settings(cols)
    x, w, stat = torch.empty(rows, cols, dtype=dtype), torch.empty(cols, dtype=dtype), torch.empty(rows)
    per_program, partial = -(-rows // 132), torch.empty(132, cols)
    if name == "rms_norm_backward":
        meta = {"X_dtype": tl.bfloat16 if dtype == torch.bfloat16 else tl.float32, "casting_mode": 0}
        meta |= {"elementwise_affine": True, "BLOCK_SIZE": block, "COMPUTE_DW": True, "num_warps": warps}
        # dY, dX, X with their row strides; W, RSTD, dW with theirs; n_rows, n_cols, offset, rows per program
        args = [x, cols, x, cols, x, cols, None, w, 1, stat, 1, partial, cols, rows, cols, 0.0, per_program]
        kernel = rms_norm._rms_norm_backward_kernel
    else:
        meta = {"rows_per_program": per_program, "BLOCK_SIZE": block, "COMPUTE_DW": True, "COMPUTE_DB": True}
        meta["num_warps"] = warps
        # X, W, Mean, RSTD, dX, dW, dB, dY with their row strides; n_rows, n_cols
        args = [x, cols, w, stat, 1, stat, 1, x, cols, partial, cols, partial, cols, x, cols, rows, cols]
        kernel = layer_norm._layer_norm_backward_kernel
    facts = compile_call(kernel, SimpleNamespace(meta=meta, args=args), [])
    return _row(f"Liger-Kernel {name}", facts, warps, block)


def _liger_pointwise(name: str, rows: int, cols: int, dtype: torch.dtype) -> dict:
    """Liger-Kernel's SwiGLU (one row per program, ``calculate_settings``) and RoPE (one token per
    program: all heads of q and k, ``rows`` tokens x ``ROPE_HEADS`` heads x ``cols`` head dim; the
    first half of cos and sin only, as Liger assumes both halves equal), launched as Liger launches them."""
    from liger_kernel.ops import rope, swiglu
    from liger_kernel.ops.utils import calculate_settings

    if name.startswith("rope"):
        q, cos = torch.empty(1, rows, ROPE_HEADS, cols, dtype=dtype), torch.empty(1, rows, cols, dtype=dtype)
        meta = dict.fromkeys(("n_qh", "n_kh", "pad_n_qh", "pad_n_kh", "BLOCK_SIZE"), ROPE_HEADS)
        meta |= dict.fromkeys(("hd", "pad_hd", "pad_rd", "rd"), cols) | {"bs": 1, "cos_bs": 1}
        meta |= {"BACKWARD_PASS": name.endswith("_backward"), "num_warps": 4}
        args = [q, q.stride(1), q, q.stride(1), cos, cos.stride(-2), cos, cos.stride(-2), rows]
        facts = compile_call(rope._triton_rope, SimpleNamespace(meta=meta, args=args), [])
        return _row(f"Liger-Kernel {name}", facts, 4, 2 * ROPE_HEADS * cols)  # q and k of one token
    block, warps = calculate_settings(cols)
    a = torch.empty(rows, cols, dtype=dtype)
    meta = {"n_cols": cols, "BLOCK_SIZE": block, "num_warps": warps}
    kernel = swiglu._swiglu_backward_kernel if name.endswith("_backward") else swiglu._swiglu_forward_kernel
    facts = compile_call(kernel, SimpleNamespace(meta=meta, args=[a, a, a, cols, 1.0]), [])
    return _row(f"Liger-Kernel {name}", facts, warps, cols)


def _liger(name: str, rows: int, cols: int, dtype: torch.dtype) -> dict:
    """Liger-Kernel's RMSNorm forward and cross-entropy (loss only, as rtxdsl's forward), at its own
    launch choices: ``calculate_settings`` for RMSNorm; one block up to 32K and 32 warps on sm_90
    for cross-entropy (looping over longer rows)."""
    from liger_kernel.ops import cross_entropy, rms_norm
    from liger_kernel.ops.utils import calculate_settings

    if name.startswith(("swiglu", "rope")):
        return _liger_pointwise(name, rows, cols, dtype)
    if name.endswith("_backward"):
        return _liger_norm_backward(name, rows, cols, dtype)
    x = torch.empty(rows, cols, dtype=dtype)
    if name == "rms_norm":
        block, warps = calculate_settings(cols)
        w, rstd = torch.empty(cols, dtype=dtype), torch.empty(rows)
        meta = {"casting_mode": 0, "elementwise_affine": True, "BLOCK_SIZE": block, "num_warps": warps}
        args = [x, cols, x, cols, w, 1, rstd, 1, cols, 1e-6, 0.0]
        facts = compile_call(rms_norm._rms_norm_forward_kernel, SimpleNamespace(meta=meta, args=args), [])
        return _row("Liger-Kernel rms_norm", facts, warps, block)
    block, warps = min(1 << 15, triton.next_power_of_2(cols)), 32
    y, loss = torch.zeros(rows, dtype=torch.long), torch.empty(rows, dtype=dtype)
    flags = ("RETURN_Z_LOSS", "RETURN_TOKEN_ACCURACY", "RETURN_PREDICTED_TOKENS", "HAS_WEIGHT", "HAS_SOFTCAPPING")
    reduction = "none" if name.endswith("_none") else "mean"
    meta = {
        "lse_square_scale": 0.0,
        "label_smoothing": 0.0,
        "reduction": reduction,
        "BLOCK_SIZE": block,
        "num_warps": warps,
    }
    meta |= dict.fromkeys(flags, False) | {"HAS_GRADIENTS": name.endswith("_grad")}
    # Liger's arguments in order: X and its stride, Y and its stride, weight, loss, z-loss, the loss
    # stride, token accuracy and predicted tokens with their strides; then n_cols, n_non_ignore,
    # sum_non_ignore_weight, weight_sum, ignore_index, lse_square_scale, label_smoothing, reduction, softcap
    args = [x, cols, y, 1, None, loss, None, 1, None, 0, None, 0]
    args += [cols, rows, rows, 0.0, -100, 0.0, 0.0, reduction, None]
    facts = compile_call(cross_entropy.liger_cross_entropy_kernel, SimpleNamespace(meta=meta, args=args), [])
    return _row(f"Liger-Kernel {name}", facts, warps, min(block, cols))


def _ours(name: str, rows: int, cols: int, dtype: torch.dtype) -> dict:
    x, w, b = rx.var("x"), rx.var("w"), rx.var("b")
    exprs = {
        "softmax": lambda: rx.softmax(x),
        "layer_norm": lambda: rx.layer_norm(x, w, b),
        "rms_norm": lambda: rx.rms_norm(x, w),
        "cross_entropy": lambda: rx.cross_entropy(x, rx.var("t")),
        # per-row losses: no tail taking the mean (its code is in every program, run by the last)
        "cross_entropy_none": lambda: rx.cross_entropy(x, rx.var("t"), reduction="none"),
        "swiglu": lambda: rx.swiglu(x, w),
        "rope": lambda: rx.rope(x, rx.var("c"), rx.var("s")),
    }
    ins = {"x": torch.empty(rows, cols, dtype=dtype), "w": torch.empty(cols, dtype=dtype)}
    ins |= {"b": torch.empty(cols, dtype=dtype), "t": torch.zeros(rows, dtype=torch.long)}
    if name.startswith("swiglu"):  # gate and up: [tokens, intermediate]
        ins["w"] = torch.empty(rows, cols, dtype=dtype)
    if name.startswith("rope"):  # Hugging Face's q: [1, heads, tokens, head dim] over [1, tokens, heads, head dim]
        ins["x"] = torch.empty(1, rows, ROPE_HEADS, cols, dtype=dtype).transpose(1, 2)
        ins |= {k: torch.empty(1, 1, rows, cols, dtype=dtype) for k in "cs"}
    if name == "cross_entropy_grad":  # the loss and its gradient: the forward's one-read program
        ce = rx.compile(rx.cross_entropy(x, rx.var("t"), grad_in_forward=True))
        kernel = ce.grad_plan(x=ins["x"].requires_grad_(), t=ins["t"]).forward.then
        ins |= {"_g0": torch.ones((), dtype=dtype), "_p0": torch.ones(())}
    elif name == "cross_entropy_backward":  # the gradient alone, as autograd's backward runs it later
        plan = rx.compile(rx.cross_entropy(x, rx.var("t"))).grad_plan(x=ins["x"].requires_grad_(), t=ins["t"])
        kernel = plan.backward
        ins |= plan.backward_feed({n: ins[n].detach() for n in plan.forward.inputs})
    elif name.startswith(("swiglu", "rope")) and name.endswith("_backward"):  # pointwise: its backward alone
        fwd = rx.compile(exprs[name.removesuffix("_backward")]())
        plan = fwd.grad_plan(**{n: ins[n].requires_grad_(n in "xw") for n in fwd.inputs})
        kernel = plan.backward
        ins |= plan.backward_feed({n: ins[n].detach() for n in plan.forward.inputs})
    elif name.endswith("_backward"):  # a norm's backward: dx with dW (and dB) over each program's rows
        norm = rx.compile(exprs[name.removesuffix("_backward")]())
        plan = norm.grad_plan(**{n: ins[n].requires_grad_() for n in norm.inputs})
        kernel = plan.backward
        ins |= {"_g0": torch.empty(rows, cols, dtype=dtype)} | {k: torch.empty(rows, 1) for k in plan.grads.saved_keys}
    else:
        kernel = rx.compile(exprs[name]())
    ins = {n: ins[n].detach() for n in kernel.inputs}
    program, _ = prepare(kernel, ins)
    facts, *_ = compile_kernel(kernel, ins)  # a norm's backward: its row kernel (the merge after it is small)
    launch, *_ = program.kernels
    meta = dict(launch.meta)
    per_program = meta.get("ROWS", 1) * min(cols, meta["BLOCK_SIZE"])  # a looped row: per block
    if launch.spec.kind == "pointwise":  # flat blocks over every dim
        per_program = meta["BLOCK_SIZE"]
    return _row(f"rtxdsl {name}", facts, meta.get("num_warps", 4), per_program)


def _row(kernel: str, facts, warps: int, per_program: int) -> dict:
    """``per_program``: the elements one pass of the kernel's code covers (a looped row's block)."""
    sass = sass_counts(facts.ptx)
    assert sass is not None, "no ptxas / cuobjdump in this Triton's wheel"
    return {
        "kernel": kernel,
        "SASS instructions": sass.instructions,
        "per element": round(sass.instructions * warps / per_program, 3),
        # what runs per block of a looped row (per row of a norm backward's loop over rows), without
        # the code before and after the loop
        "loop per element": round(sass.loop * warps / per_program, 3) if sass.loop else None,
        "barriers": sass.barriers,
        "warps": warps,
        "registers": facts.registers,
        "spills": facts.spill_bytes,
    }


CASES = [  # (pattern, rows, cols, dtype, the hand-written peer: Triton's tutorial, Liger-Kernel or none)
    ("softmax", 4096, 4096, torch.float32, _peer),
    ("softmax", 4096, 4096, torch.bfloat16, _peer),
    ("layer_norm", 4096, 4096, torch.float32, _peer),
    ("layer_norm", 4096, 4096, torch.bfloat16, _peer),
    ("rms_norm", 4096, 4096, torch.bfloat16, _liger),
    ("cross_entropy", 4096, 32000, torch.bfloat16, _liger),
    ("cross_entropy_none", 4096, 32000, torch.bfloat16, _liger),
    ("cross_entropy_grad", 4096, 32000, torch.bfloat16, _liger),
    ("cross_entropy_backward", 4096, 32000, torch.bfloat16, None),  # Liger has none: its forward writes it
    # dx with dW (and dB) accumulated per program over its rows (the merge of the partials after it)
    ("rms_norm_backward", 4096, 4096, torch.bfloat16, _liger),
    ("layer_norm_backward", 4096, 4096, torch.bfloat16, _liger),
    # a 128K vocabulary (Llama 3): looped over the row in 32K blocks of 32 warps, as Liger loops
    ("cross_entropy_none", 4096, 128256, torch.bfloat16, _liger),
    ("cross_entropy_grad", 4096, 128256, torch.bfloat16, _liger),
    # Llama-2 7B's intermediate size (no power of two), gate and up as two tensors
    ("swiglu", 4096, 11008, torch.bfloat16, _liger),
    ("swiglu_backward", 4096, 11008, torch.bfloat16, _liger),
    # RoPE on q: 4096 tokens x ROPE_HEADS heads x head dim 128, Hugging Face's layout
    ("rope", 4096, 128, torch.bfloat16, _liger),
    ("rope_backward", 4096, 128, torch.bfloat16, _liger),
]
ROPE_HEADS = 32


def _liger_installed() -> bool:
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two cases (CI smoke)")
    args = parser.parse_args()
    rows = []
    for name, r, c, dt, peer in CASES[:2] if args.quick else CASES:
        size = f"{r} x {c} {str(dt).removeprefix('torch.')}"
        rows.append({"case": size, **_ours(name, r, c, dt)})
        if peer is _peer or peer is _liger and _liger_installed():  # Liger-Kernel: the bench extra
            rows.append({"case": size, **peer(name, r, c, dt)})
    cols = ["case", "kernel", "SASS instructions", "per element", "loop per element", "barriers", "warps"]
    cols += ["registers", "spills"]
    print(markdown(rows, cols))
    save("sass-sm90-quick" if args.quick else "sass-sm90", {"rows": rows})


if __name__ == "__main__":
    main()
