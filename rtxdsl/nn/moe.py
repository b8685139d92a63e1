"""A mixture of experts' routed MLPs in grouped GEMMs (:mod:`rtxdsl.codegen.grouped`), and
Hugging Face models' experts through them (transformers' experts interface).

For tokens ``x [T, H]`` routed to ``top_k`` experts each (``top_k_index``, ``top_k_weights``:
``[T, top_k]``), :func:`moe_experts` computes transformers v5's experts::

    out[t] = sum_j top_k_weights[t, j] * down_proj[e] @ (act(gate) * up),
    gate, up = (gate_up_proj[e] @ x[t]).chunk(2),  e = top_k_index[t, j]

with ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (``transposed``: ``[E, H, 2I]`` and
``[E, I, H]``). Forward, on a GPU or the interpreter:

1. routing (:func:`route`): the ``T * top_k`` (token, expert) rows sorted by expert, each expert's
   segment and a table of row tiles that share an expert; torch ops on the device, no host sync;
2. the up projection: one grouped GEMM whose prologue gathers each row's token (no permuted copy)
   and whose epilogue computes ``act(gate) * up`` from its two fp32 accumulators (it writes the
   pre-activations too: the backward reads them);
3. the down projection: one grouped GEMM, each row scaled by its routing weight in fp32;
4. the combine: each token's ``top_k`` rows summed in a fixed order (deterministic, no atomics).

Backward: the output gradient is read through the tokens' gather (never copied per row); one
grouped GEMM computes the down projection's input gradient and, in its epilogue, the activation's
gradient (``[dgate | dup]``), the activation recomputed (the down weights' gradient reads it) and
the routing weights' gradient (``dw[s] = a[s] . (dout[t] @ down[e])``, as Liger-Kernel's MoE, per
block of columns, summed after: no atomics); weight gradients are segment GEMMs (a K loop over each
expert's rows; an expert no token chose gets zeros); the input gradient is a grouped GEMM and the
combine. 3 launches forward, 5 backward (fewer where a gradient is not wanted). The forward and
backward are ``torch.library`` ops (``rtxdsl::moe_experts``, ``rtxdsl::moe_experts_backward``),
so ``torch.compile`` traces a model through them. Without Triton (CPU tensors, TRITON_INTERPRET unset) the
same math runs in torch ops, one expert at a time.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction

from ..codegen.grouped import combine_kernel, grouped_gemm_kernel, segment_gemm_kernel
from ..config import get_config
from ..errors import RtxError
from ..lower import tf32_of
from ..runtime_launch import backend_for
from ..stats import GLOBAL_STATS
from .modules import ACTIVATIONS

#: launch tables by target: the grouped GEMM's (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages),
#: BLOCK_M being the routing's row tile; 4-byte operands halve BLOCK_K and double the warps
GROUPED = {"gpu": (64, 128, 64, 4, 3), "interpreter": (32, 64, 64, 1, 1)}
#: the segment GEMM's (BLOCK_N, BLOCK_K, BLOCK_S: rows per step of its K loop, num_warps, num_stages)
SEGMENT = {"gpu": (128, 128, 32, 8, 3), "interpreter": (64, 64, 32, 1, 1)}
#: the combine's columns per program
COMBINE = {"gpu": 1024, "interpreter": 1 << 14}

_INTERPRETED: dict[Any, Any] = {}


def _launcher(kernel: Any, device: torch.device) -> Any:
    """The compiled kernel for CUDA tensors, the same kernel under Triton's interpreter otherwise."""
    if device.type == "cuda" or isinstance(kernel, InterpretedFunction):
        return kernel
    if kernel not in _INTERPRETED:
        _INTERPRETED[kernel] = InterpretedFunction(kernel.fn)
    return _INTERPRETED[kernel]


@dataclass(frozen=True)
class Routing:
    """Rows ``s`` of the sorted order: ``(token, j)`` pairs grouped by expert."""

    tokens: torch.Tensor  # [S] int32: each sorted row's token
    order: torch.Tensor  # [S] int64: each sorted row's flat (token, j) index
    positions: torch.Tensor  # [T, top_k] int32: each (token, j)'s sorted row
    bounds: torch.Tensor  # [E + 1] int32: expert e's rows are bounds[e]:bounds[e + 1]
    tile_expert: torch.Tensor  # [tiles] int32: a tile's expert (E past the last expert's tiles)
    tile_lo: torch.Tensor  # [tiles] int32: its first row
    tile_hi: torch.Tensor  # [tiles] int32: one past its last row (lo == hi: an empty tile)
    block_m: int

    @property
    def experts(self) -> int:
        return self.bounds.numel() - 1


def route(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """Sort the ``[T, top_k]`` routed rows by expert, and tile each expert's rows by ``block_m``.

    Example:
        >>> import torch
        >>> from rtxdsl.nn.moe import route
        >>> r = route(torch.tensor([[1, 0], [1, 2]]), 4, 2)
        >>> r.tokens.tolist(), r.bounds.tolist(), r.tile_expert.tolist()
        ([0, 0, 1, 1], [0, 1, 3, 4, 4], [0, 1, 2, 4, 4, 4])
    """
    dev = top_k_index.device
    flat = top_k_index.reshape(-1).long()
    rows = flat.numel()
    order = torch.argsort(flat, stable=True)
    positions = torch.empty_like(order)
    positions[order] = torch.arange(rows, device=dev)
    counts = torch.bincount(flat, minlength=num_experts)
    ends = counts.cumsum(0)
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    # at most one partial tile per expert: a static bound, so no host sync for the grid
    ids = torch.arange(-(-rows // block_m) + min(num_experts, rows), device=dev)
    expert = torch.searchsorted(tile_end, ids, right=True)
    e = expert.clamp(max=num_experts - 1)
    lo = ends[e] - counts[e] + (ids - tile_end[e] + tiles[e]) * block_m
    valid = expert < num_experts
    hi = torch.where(valid, torch.minimum(lo + block_m, ends[e]), 0)
    i32 = torch.int32
    return Routing(
        tokens=(order // top_k_index.shape[-1]).to(i32),
        order=order,
        positions=positions.view(top_k_index.shape).to(i32),
        bounds=torch.cat([ends.new_zeros(1), ends]).to(i32),
        tile_expert=expert.to(i32),
        tile_lo=torch.where(valid, lo, 0).to(i32),
        tile_hi=hi.to(i32),
        block_m=block_m,
    )


def _family(device: torch.device) -> str:
    return "gpu" if device.type == "cuda" else "interpreter"


def _precision() -> str:
    """fp32 operands multiply exactly unless the config (or torch's setting) allows TF32."""
    return "tf32" if tf32_of(get_config()) else "ieee"


@dataclass(frozen=True)
class Call:
    """One launch of a grouped-family kernel: its grid, arguments and constexprs (``launch`` runs
    it; ``rtxdsl.codegen.ptx.compile_call`` compiles it for sm_90), and what it computes."""

    kernel: Any
    grid: tuple[int, int]
    args: tuple[Any, ...]
    meta: dict[str, Any]
    flops: int
    nbytes: int

    def launch(self, device: torch.device) -> None:
        _launcher(self.kernel, device)[self.grid](*self.args, **self.meta)
        GLOBAL_STATS.record(1, 1, 1, self.nbytes, self.nbytes, self.flops)


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Gated:
    """A grouped GEMM's gated epilogue (:func:`rtxdsl.codegen.grouped.grouped_gemm_kernel`):
    ``kind`` ``"gated"`` writes ``act`` (``act(gate) * up``) beside the pre-activations; ``"dgated"``
    reads them from ``h`` and writes their gradient, ``act`` recomputed and the routing weight's
    gradient per block of columns into ``part``."""

    kind: str
    activation: str
    act: torch.Tensor
    h: torch.Tensor | None = None
    part: torch.Tensor | None = None


def gated_columns(n: int, family: str) -> int:
    """The column blocks of a gated epilogue over ``n`` columns: ``part``'s leading dimension."""
    return -(-n // (GROUPED[family][1] // 2))


def grouped_call(
    a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, r: Routing, gather: bool, scale: torch.Tensor | None,
    family: str, gated: Gated | None = None,
) -> Call:  # fmt: skip
    """``c[s] = scale[s] * a[row(s)] @ w[expert(s)]``, ``w`` read as ``[E, K, N]`` through its strides;
    ``gated``: the epilogue of the up projection (``w``'s ``N`` columns are ``[gate | up]``) or of the
    down projection's input gradient."""
    rows, (k, n) = r.tokens.numel(), w.shape[1:]
    _, bn, bk, warps, stages = GROUPED[family]
    kind = "none" if gated is None else gated.kind
    if kind == "gated":
        n //= 2
    if kind != "none":
        bn //= 2  # two accumulators (or the pre-activations' loads): half the columns, no spills on sm_90
    meta = {
        "GATHER": gather,
        "SCALE": scale is not None,
        "EPILOGUE": kind,
        "ACTIVATION": "silu" if gated is None else gated.activation,
        "PRECISION": _precision(),
        "BLOCK_M": r.block_m,
        "BLOCK_N": bn,
    }
    wide = a.element_size() == 4  # fp32 operands: half the K slice, twice the warps (no spills on sm_90)
    meta |= {"BLOCK_K": bk // 2 if wide else bk, "num_warps": 2 * warps if wide else warps, "num_stages": stages}
    act = c if gated is None else gated.act
    h = c if gated is None or gated.h is None else gated.h
    part = r.tokens if gated is None or gated.part is None else gated.part
    args = (
        a, w, c, r.tokens, r.tokens if scale is None else scale, r.tile_expert, r.tile_lo, r.tile_hi, h, act, part,
        n, k, a.stride(0), a.stride(1), *w.stride(), *c.stride(), *h.stride(), *act.stride(), part.stride(0),
    )  # fmt: skip
    nbytes = rows * k * a.element_size() + _bytes(w, c) + (0 if gated is None else _bytes(gated.act))
    if kind == "dgated":
        nbytes += _bytes(h, part)
    flops = 2 * rows * w.shape[2] * k
    return Call(grouped_gemm_kernel, (r.tile_expert.numel(), -(-n // bn)), args, meta, flops, nbytes)


def segment_call(
    p: torch.Tensor, p_gather: bool, q: torch.Tensor, q_gather: bool, scale: torch.Tensor | None,
    r: Routing, out: torch.Tensor, family: str,
) -> Call:  # fmt: skip
    """``out[e] = (scale * p[prow])[rows of e].T @ q[qrow][rows of e]`` into ``out`` read as ``[E, N, K]``."""
    rows, (n, k) = r.tokens.numel(), out.shape[1:]
    bn, bk, bs, warps, stages = SEGMENT[family]
    meta = {"P_GATHER": p_gather, "Q_GATHER": q_gather, "SCALE": scale is not None, "PRECISION": _precision()}
    meta |= {"BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_S": bs, "num_warps": warps, "num_stages": stages}
    args = (
        p, q, out, r.tokens, r.tokens, r.tokens if scale is None else scale, r.bounds,
        n, k, p.stride(0), p.stride(1), q.stride(0), q.stride(1), *out.stride(),
    )  # fmt: skip
    nbytes = rows * (n * p.element_size() + k * q.element_size()) + _bytes(out)
    return Call(segment_gemm_kernel, (-(-n // bn) * -(-k // bk), r.experts), args, meta, 2 * rows * n * k, nbytes)


def _grouped(
    a: torch.Tensor, w: torch.Tensor, r: Routing, gather: bool, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    c = torch.empty(r.tokens.numel(), w.shape[2], device=a.device, dtype=dtype)
    if c.numel():
        grouped_call(a, w, c, r, gather, scale, _family(a.device)).launch(a.device)
    return c


def _segment(
    p: torch.Tensor, p_gather: bool, q: torch.Tensor, q_gather: bool, scale: torch.Tensor | None,
    r: Routing, out: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    if r.tokens.numel() == 0:
        return out.zero_()
    if out.numel():
        segment_call(p, p_gather, q, q_gather, scale, r, out, _family(p.device)).launch(p.device)
    return out


def _combine(y: torch.Tensor, r: Routing, dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = sum_j y[positions[t, j]]``, summed in fp32 (a token routed nowhere: zeros)."""
    (tokens, top_k), n = r.positions.shape, y.shape[1]
    out = torch.empty(tokens, n, device=y.device, dtype=dtype)
    if out.numel() == 0 or top_k == 0:
        return out.zero_()
    block = min(COMBINE[_family(y.device)], max(16, 1 << (n - 1).bit_length()))
    args = (y, out, r.positions, n, *y.stride(), *out.stride())
    meta = {"TOP_K": top_k, "BLOCK_N": block}
    nbytes = _bytes(out) + tokens * top_k * n * y.element_size()
    Call(combine_kernel, (tokens, -(-n // block)), args, meta, tokens * top_k * n, nbytes).launch(y.device)
    return out


def _kn(w: torch.Tensor, transposed: bool) -> torch.Tensor:
    """An expert matrix as the product's ``[E, K, N]`` (a view: transformers keeps ``[E, N, K]``)."""
    return w if transposed else w.transpose(1, 2)


def _experts_forward(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, r: Routing, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed experts, ``gate_up`` ``[E, H, 2I]`` and ``down`` ``[E, I, H]`` read as ``[E, K, N]``
    and ``weights`` in sorted order, in 3 launches (the up projection with ``act(gate) * up`` in its
    epilogue, the down projection scaled by the routing weights, the combine): the output, and
    the pre-activations the backward reads."""
    rows, inter = r.tokens.numel(), down.shape[1]
    h = x.new_empty(rows, 2 * inter)
    a = x.new_empty(rows, inter)
    if a.numel():
        gated = Gated("gated", activation, a)
        grouped_call(x, gate_up, h, r, True, None, _family(x.device), gated).launch(x.device)
    return _combine(_grouped(a, down, r, False, weights, torch.float32), r, x.dtype), h


def _experts_backward(
    dout: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
    h: torch.Tensor, r: Routing, activation: str, needs: list[bool],
) -> list[torch.Tensor | None]:  # fmt: skip
    """Gradients of ``x``, ``gate_up``, ``down`` and the sorted ``weights`` (None where ``needs`` says
    none is wanted) in 5 launches: the down projection's input gradient with the activation's
    gradient and the routing weights' in its epilogue, two segment GEMMs, the up projection's
    input gradient and its combine."""
    family, inter = _family(x.device), down.shape[1]
    dh, a = torch.empty_like(h), x.new_empty(h.shape[0], inter)
    part = torch.zeros(gated_columns(inter, family), h.shape[0], device=x.device, dtype=torch.float32)
    if a.numel():
        gated = Gated("dgated", activation, a, h, part)
        grouped_call(dout, down.transpose(1, 2), dh, r, True, weights, family, gated).launch(x.device)
    else:
        dh.zero_()
    dx = (
        _combine(_grouped(dh, gate_up.transpose(1, 2), r, False, None, torch.float32), r, x.dtype) if needs[0] else None
    )
    dgate_up = _segment(x, True, dh, False, None, r, gate_up.new_empty(gate_up.shape)) if needs[1] else None
    ddown = _segment(a, False, dout, True, weights, r, down.new_empty(down.shape)) if needs[2] else None
    return [dx, dgate_up, ddown, part.sum(0).to(weights.dtype) if needs[3] else None]


# ---- the experts as torch.library ops: what torch.compile sees ----------------------------------------
# Routing is recomputed in the backward (sort and count of T * top_k indices on the device: small
# beside the GEMMs), so the forward op returns two tensors, not the routing's seven.
def _routing(index: torch.Tensor, experts: int) -> Routing:
    _check_range(index, experts)
    return route(index, experts, GROUPED[_family(index.device)][0])


@torch.library.custom_op("rtxdsl::moe_experts", mutates_args=())
def experts_op(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Tokens ``x [T, H]`` through experts ``gate_up [E, H, 2I]`` and ``down [E, I, H]`` (any
    strides), routed by ``index`` / ``weights [T, top_k]``: the output ``[T, H]`` and the
    pre-activations ``[T * top_k, 2I]`` in routed order (saved for the backward)."""
    r = _routing(index, gate_up.shape[0])
    return _experts_forward(x, gate_up, down, weights.reshape(-1)[r.order], r, activation)


@experts_op.register_fake
def _experts_fake(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return x.new_empty(x.shape), x.new_empty(index.numel(), gate_up.shape[2])


@torch.library.custom_op("rtxdsl::moe_experts_backward", mutates_args=())
def experts_backward_op(
    dout: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, index: torch.Tensor,
    weights: torch.Tensor, h: torch.Tensor, activation: str, needs: list[bool],
) -> list[torch.Tensor]:  # fmt: skip
    """Gradients of ``x``, ``gate_up``, ``down`` and ``weights`` (``[T, top_k]``); an empty tensor
    where ``needs`` (those four flags) says none is wanted."""
    r = route(index, gate_up.shape[0], GROUPED[_family(index.device)][0])  # checked by the forward
    grads = _experts_backward(dout, x, gate_up, down, weights.reshape(-1)[r.order], h, r, activation, needs)
    if grads[3] is not None:  # the weights' gradient back in (token, j) order
        grads[3] = grads[3].new_empty(r.order.shape).index_copy_(0, r.order, grads[3]).view(weights.shape)
    return [g if g is not None else x.new_empty(0) for g in grads]


@experts_backward_op.register_fake
def _experts_backward_fake(
    dout: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, index: torch.Tensor,
    weights: torch.Tensor, h: torch.Tensor, activation: str, needs: list[bool],
) -> list[torch.Tensor]:  # fmt: skip
    return [t.new_empty(t.shape) if need else x.new_empty(0) for t, need in zip((x, gate_up, down, weights), needs)]


def _experts_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, gate_up, down, index, weights, ctx.activation = inputs
    ctx.save_for_backward(x, gate_up, down, index, weights, output[1])
    ctx.mark_non_differentiable(output[1])


def _experts_grad(ctx: Any, dout: torch.Tensor, _dh: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    x, gate_up, down, index, weights, h = ctx.saved_tensors
    dx, dgu, dd, dw = ctx.needs_input_grad[:3] + ctx.needs_input_grad[4:5]
    needs = [bool(dx), bool(dgu), bool(dd), bool(dw)]
    grads = experts_backward_op(dout, x, gate_up, down, index, weights, h, ctx.activation, needs)
    g = [t if need else None for t, need in zip(grads, needs)]
    return g[0], g[1], g[2], None, g[3], None


experts_op.register_autograd(_experts_grad, setup_context=_experts_setup)


def _torch_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, r: Routing, weights: torch.Tensor, activation: str
) -> torch.Tensor:
    """The same math in torch ops, one expert at a time (CPU tensors without Triton's interpreter)."""
    act = ACTIVATIONS[activation]
    bounds = r.bounds.tolist()
    rows = []
    for e in range(r.experts):
        seg = slice(bounds[e], bounds[e + 1])
        h = x[r.tokens[seg].long()] @ gate_up[e]
        gate, up = h.chunk(2, -1)
        rows.append((act(gate) * up) @ down[e])
    y = torch.cat(rows) * weights[:, None] if rows else x.new_zeros(0, x.shape[1])
    return y.float()[r.positions.long()].sum(1).to(x.dtype)


def _check(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, index: torch.Tensor, w: torch.Tensor) -> None:
    def fail(name: str, why: str) -> None:
        raise RtxError(f"moe_experts: {name} {why}")

    if gate_up.dim() != 3 or down.dim() != 3:
        fail("gate_up_proj" if gate_up.dim() != 3 else "down_proj", "must be [experts, rows, cols]")
    e, two_i, h = gate_up.shape
    if x.shape[-1] != h or two_i % 2:
        fail("gate_up_proj", f"{tuple(gate_up.shape)} does not fit hidden {x.shape[-1]} (want [E, 2I, H])")
    if down.shape != (e, h, two_i // 2):
        fail("down_proj", f"{tuple(down.shape)} does not fit gate_up_proj (want [E, H, I])")
    if index.dtype not in (torch.int32, torch.int64) or index.shape[:-1] != x.shape[:-1]:
        fail(
            "top_k_index",
            f"must be int32/int64 of shape {(*x.shape[:-1], 'top_k')}, got {index.dtype} {tuple(index.shape)}",
        )
    if w.shape != index.shape or not w.is_floating_point():
        fail(
            "top_k_weights",
            f"must be floating with top_k_index's shape {tuple(index.shape)}, got {w.dtype} {tuple(w.shape)}",
        )
    if not (x.dtype == gate_up.dtype == down.dtype) or not x.is_floating_point():
        fail("hidden_states", f"{x.dtype} and the experts' {gate_up.dtype} / {down.dtype} must be one floating dtype")
    if len({t.device for t in (x, gate_up, down, index, w)}) != 1:
        fail("hidden_states", "and every other input must be on one device")


def _check_range(index: torch.Tensor, experts: int) -> None:
    """Every routed expert in ``[0, experts)``: raised on the host for CPU tensors, asserted on the
    device for CUDA ones (no sync). Run where the experts are computed (inside the op: a traced call
    checks its values when it runs)."""
    if index.numel() and index.device.type != "cuda" and not (0 <= int(index.min()) and int(index.max()) < experts):
        raise RtxError(f"moe_experts: top_k_index holds an expert outside [0, {experts})")
    if index.numel() and index.device.type == "cuda":
        torch._assert_async(((index >= 0) & (index < experts)).all(), "moe_experts: top_k_index outside [0, experts)")


def moe_experts(
    hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor, *, activation: str = "silu", transposed: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Routed tokens through their experts' gated MLPs, weighted and summed: transformers v5's
    experts (Mixtral, Qwen2/3-MoE, OLMoE), with gradients to the tokens, both expert matrices and
    the routing weights. ``activation``: ``silu`` (SwiGLU), ``gelu_tanh`` or ``gelu``.

    Example:
        >>> import torch, rtxdsl as rx
        >>> x, gate_up, down = torch.randn(5, 8), torch.randn(3, 12, 8), torch.randn(3, 8, 6)
        >>> idx, w = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]]), torch.rand(5, 2)
        >>> rx.nn.moe_experts(x, gate_up, down, idx, w).shape
        torch.Size([5, 8])
    """
    if activation not in ACTIVATIONS:
        raise RtxError(f"moe_experts: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    gate_up = gate_up_proj.transpose(1, 2) if transposed else gate_up_proj
    down = down_proj.transpose(1, 2) if transposed else down_proj
    _check(hidden_states, gate_up, down, top_k_index, top_k_weights)
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    index = top_k_index.reshape(x.shape[0], top_k_index.shape[-1])
    weights = top_k_weights.reshape(index.shape)
    backend, _ = backend_for(get_config(), x.device)
    if backend == "torch":
        r = _routing(index, gate_up.shape[0])
        out = _torch_experts(x, _kn(gate_up, False), _kn(down, False), r, weights.reshape(-1)[r.order], activation)
        return out.view(shape)
    return experts_op(x, _kn(gate_up, False), _kn(down, False), index, weights, activation)[0].view(shape)


# ---- transformers' experts interface ------------------------------------------------------------
NAME = "rtxdsl"
#: the implementations routed through rtxdsl's (a model set to another keeps it)
ROUTED = (None, "eager", "grouped_mm", "batched_mm", NAME)


def _activation_of(m: torch.nn.Module) -> str | None:
    """The name of the experts' activation, by probing ``act_fn`` (None: not one rtxdsl has)."""
    act = getattr(m, "act_fn", None)
    if act is None:
        return None
    x = torch.linspace(-6, 6, 97, dtype=torch.float64)
    with torch.no_grad():
        try:
            got = act(x)
        except Exception:  # noqa: BLE001 - an activation that takes no float64 tensor is not ours
            return None
    return next((n for n, f in ACTIVATIONS.items() if torch.allclose(got, f(x), atol=1e-12, rtol=0)), None)


def _routable(m: torch.nn.Module) -> str | None:
    """The activation of a transformers experts module rtxdsl computes (None: it keeps its own)."""
    plain = getattr(m, "has_gate", False) and getattr(m, "is_concatenated", False)
    plain = plain and not getattr(m, "has_bias", True) and not getattr(m, "has_post_expert_norm", True)
    if not plain or getattr(type(m), "_apply_gate", None) is not _default_gate():
        return None
    if not isinstance(getattr(m, "gate_up_proj", None), torch.Tensor):
        return None
    return _activation_of(m)


def _default_gate() -> Any:
    return getattr(sys.modules.get("transformers.integrations.moe"), "_default_apply_gate", None)


def rtxdsl_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts signature: ``hidden_states [T, H]``, ``top_k_index / top_k_weights
    [T, top_k]``; a module rtxdsl does not compute (a bias, interleaved gates, its own gating, a
    sharded expert set) or inputs of another dtype run the implementation it had. Inside
    ``torch.compile`` the experts are the ops ``rtxdsl::moe_experts`` and ``rtxdsl::moe_experts_backward``."""
    activation, previous = self.__dict__.get("_rtxdsl_experts", (None, None))
    x, gate_up, down = hidden_states, self.gate_up_proj, self.down_proj
    plain = all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in (x, gate_up, down))
    plain = plain and not getattr(self, "_is_expert_parallel", True)
    plain = plain and x.dtype == gate_up.dtype == down.dtype
    if activation is None or not plain:
        interface = sys.modules["transformers.integrations.moe"].ALL_EXPERTS_FUNCTIONS
        original = type(self).forward.__wrapped__
        return interface.get_interface(previous, original)(self, hidden_states, top_k_index, top_k_weights)
    transposed = bool(getattr(self, "is_transposed", False))
    out = moe_experts(x, gate_up, down, top_k_index, top_k_weights, activation=activation, transposed=transposed)
    return out.to(hidden_states.dtype)


def route_experts(model: torch.nn.Module) -> int:
    """Point a transformers model's mixture-of-experts layers at rtxdsl's grouped GEMMs; the count
    is the experts modules it computes (0 for a model without them, or a transformers without the
    experts interface)."""
    if "transformers" not in sys.modules:
        return 0
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return 0
    ALL_EXPERTS_FUNCTIONS.register(NAME, rtxdsl_experts_forward)
    found = [m for m in model.modules() if hasattr(type(m), "_apply_gate") and hasattr(m, "config")]
    found = [m for m in found if getattr(m.config, "_experts_implementation", "") in ROUTED]
    previous = {id(m.config): m.config._experts_implementation for m in found}  # before any is set
    for m in found:
        if previous[id(m.config)] != NAME:
            m.__dict__["_rtxdsl_experts"] = (_routable(m), previous[id(m.config)])
    for m in found:
        m.config._experts_implementation = NAME
    return sum(m.__dict__.get("_rtxdsl_experts", (None,))[0] is not None for m in found)
