"""The GPU report's attention section: ``rx.attention`` forward and backward against SDPA, and a
decoding step over a long cache split into chunks (``SPLIT_KV``) against the same step whole.

Prefill: causal and not, head dims 64 and 128, bf16, 1 x 32 heads x T; TFLOP/s count
FlashAttention-2's FLOPs (``4 * B * H * T * T * D`` forward, 2.5 times that backward, halved
when causal). Decoding: 1 x 32 query heads (8 key/value heads) x 1 query over Tk keys x 128,
microseconds per step: rtxdsl split (the default past ``SPLIT_KV["min_keys"]``), rtxdsl whole
(the threshold raised), SDPA. Each is first checked against float64 (on CPU: only that, small,
under Triton's interpreter, the split step with its threshold lowered).

    python -m benches.gpu_report     # runs this section after the contractions
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

import rtxdsl as rx

OPS = importlib.import_module("rtxdsl.ops.attention")  # (rx.attention is the function)
_q, _k, _v = rx.var("q"), rx.var("k"), rx.var("v")


@contextlib.contextmanager
def _split_from(keys: int) -> Iterator[None]:
    """``SPLIT_KV``'s threshold set to ``keys`` (a kernel plans at its first call: a call made
    inside keeps that plan)."""
    kept = OPS.SPLIT_KV["min_keys"]
    OPS.SPLIT_KV["min_keys"] = keys
    try:
        yield
    finally:
        OPS.SPLIT_KV["min_keys"] = kept


def _inputs(b: int, hq: int, hkv: int, tq: int, tk: int, d: int, dtype: torch.dtype, device: Any) -> dict:
    gen = torch.Generator().manual_seed(7)
    shapes = {"q": (b, hq, tq, d), "k": (b, hkv, tk, d), "v": (b, hkv, tk, d)}
    return {n: torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_() for n, s in shapes.items()}


def _eager(causal: bool, gqa: bool) -> Any:
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def check(device: torch.device, sizes: list[tuple[int, int, int, int, int, int]]) -> list[dict]:
    """Output and every gradient against float64, fp32 and bf16, causal and not, at each
    ``(b, hq, hkv, tq, tk, d)``; a decoding step (``tq == 1``) split into chunks from 1,024 keys."""
    rows = []
    for b, hq, hkv, tq, tk, d in sizes:
        for causal in (False, True) if tq > 1 else (False,):
            kern = rx.compile(rx.attention(_q, _k, _v, causal=causal, enable_gqa=hq != hkv))
            for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
                ins = _inputs(b, hq, hkv, tq, tk, d, dtype, device)
                wide = {n: t.detach().double().requires_grad_() for n, t in ins.items()}
                rx.reset_fusion_stats()
                with _split_from(1024):
                    out = kern(**ins)
                dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(device)
                got = [out, *torch.autograd.grad(out, list(ins.values()), dout.to(dtype))]
                launches = rx.fusion_stats().kernels_launched
                want_out = _eager(causal, hq != hkv)(**wide)
                want = [want_out, *torch.autograd.grad(want_out, list(wide.values()), dout.double())]
                err = max(((g.double() - e).abs().max() / e.abs().max()).item() for g, e in zip(got, want))
                case, shape = f"attention{' causal' if causal else ''}", f"{b}x{hq}/{hkv}x{tq}x{tk}x{d}"
                rows.append({"case": case, "shape": shape, "dtype": str(dtype)[6:], "max error": err,
                             "ok": err <= tol, "kernels": launches})  # fmt: skip
    return rows


def _flops(t: int, d: int, causal: bool, heads: int = 32) -> float:
    """FlashAttention-2's forward count at 1 x ``heads`` x ``t`` x ``d`` (halved when causal)."""
    return 4 * heads * t * t * d / (2 if causal else 1)


def _timed(fn: Any, backward: bool, ins: dict) -> float:
    """Median milliseconds of the forward, or of forward + backward."""
    from triton.testing import do_bench

    if not backward:
        return do_bench(lambda: fn(**ins), warmup=10, rep=50, return_mode="median")
    dout = torch.randn_like(fn(**ins))
    return do_bench(lambda: torch.autograd.grad(fn(**ins), list(ins.values()), dout), warmup=10, rep=50,
                    return_mode="median")  # fmt: skip


def time_prefill(quick: bool) -> list[dict]:
    """Forward and forward + backward TFLOP/s, rtxdsl against SDPA, bf16."""
    out = []
    for t in (4096,) if quick else (1024, 4096, 16384):
        for d in (128,) if quick else (64, 128):
            for causal in (True,) if quick else (False, True):
                ins = _inputs(1, 32, 32, t, t, d, torch.bfloat16, "cuda")
                impls = {"rtxdsl": rx.compile(rx.attention(_q, _k, _v, causal=causal)), "sdpa": _eager(causal, False)}
                for impl, fn in impls.items():
                    for backward in (False, True):
                        try:
                            ms = _timed(fn, backward, ins)
                        except Exception as exc:  # noqa: BLE001 (a failing peer is a result to report)
                            print(f"  attention {t}x{d} {impl}: {type(exc).__name__}: {str(exc)[:200]}")
                            continue
                        flops = _flops(t, d, causal) * (3.5 if backward else 1.0)
                        out.append({"case": f"attention{' causal' if causal else ''}", "shape": f"1x32x{t}x{d}",
                                    "impl": impl, "pass": "fwd + bwd" if backward else "fwd", "us": ms * 1e3,
                                    "TFLOP/s": flops / (ms * 1e-3) / 1e12})  # fmt: skip
    return out


def time_decode(quick: bool) -> list[dict]:
    """A decoding step's microseconds: rtxdsl split and whole, SDPA (bf16, 32 / 8 heads, d 128)."""
    out = []
    for tk in (32768,) if quick else (4096, 16384, 32768, 131072):
        ins = {n: t.detach() for n, t in _inputs(1, 32, 8, 1, tk, 128, torch.bfloat16, "cuda").items()}
        split = rx.compile(rx.attention(_q, _k, _v, enable_gqa=True))
        with _split_from(tk + 1):
            whole = rx.compile(rx.attention(_q, _k, _v, enable_gqa=True))
            whole(**ins)  # planned (and compiled) whole, under the raised threshold
        impls = {"rtxdsl split": split, "rtxdsl whole": whole, "sdpa": _eager(False, True)}
        for impl, fn in impls.items():
            try:
                ms = _timed(fn, False, ins)
            except Exception as exc:  # noqa: BLE001
                print(f"  decode {tk} {impl}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            out.append({"case": "decoding step", "shape": f"1x32/8x1x{tk}x128", "impl": impl, "us": ms * 1e3})
    return out
