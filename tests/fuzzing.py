"""Random programs for the differential fuzzers (hypothesis draws, so failures shrink).

A program is a few inputs (odd, broadcast-compatible shapes, 0-dim and empty ones, mixed
dtypes, contiguous / transposed / sliced / expanded layouts, NaN and inf sprinkled in) and a
DAG of ops over them (every elementwise op, reduction and composite, slices, flips, integer
indexing, joins and positions, shared subexpressions, several outputs). Ops whose domain is
restricted get "safe" operands (log of |x| + 1/4, exp of a clamp) so a float64 reference and
a float32 kernel stay comparable.

``RTXDSL_FUZZ_EXAMPLES`` sets how many programs each fuzz test runs (CI-sized by default).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st

import rtxdsl as rx
from rtxdsl.expr import walk

EXAMPLES = int(os.environ.get("RTXDSL_FUZZ_EXAMPLES", "40"))
DIMS = (1, 2, 3, 5, 7, 8, 13)  # 8: a power of two fills its blocks (even kernels: no column mask)
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

#: (atol relative to the output's magnitude, rtol) per output dtype, against a float64 reference
TOLERANCE = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (3e-5, 3e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


@dataclass
class Value:
    """A pool entry: an expression with its shape and category (float, int or bool)."""

    expr: Any
    shape: tuple[int, ...]
    kind: str


@dataclass
class Program:
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, Any]
    steps: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        ins = ", ".join(
            f"{n}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)} stride={t.stride()}"
            for n, t in self.inputs.items()
        )
        outs = "\n  ".join(f"{k} = {e!r}" for k, e in self.outputs.items())
        return f"Program(inputs: {ins}\n  {outs})"


def broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            return None
        out.append(y if x == 1 else x)
    return tuple(out)


def reduced(shape: tuple[int, ...], axis: Any, keepdim: bool) -> tuple[int, ...]:
    if axis is None:
        axes = set(range(len(shape)))
    else:
        axes = {a % len(shape) for a in (axis if isinstance(axis, tuple) else (axis,))}
    if keepdim:
        return tuple(1 if d in axes else s for d, s in enumerate(shape))
    return tuple(s for d, s in enumerate(shape) if d not in axes)


# ---- inputs ----------------------------------------------------------------------------------
def _tensor(draw: Any, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    layouts = ["contiguous"]
    if len(shape) >= 2 and shape[-1] > 1 and shape[-2] > 1:
        layouts.append("transposed")
    if shape and shape[-1] > 0:
        layouts.append("sliced")
    if any(s > 1 for s in shape):
        layouts.append("expanded")
    layout = draw(st.sampled_from(layouts))

    def values(sh: tuple[int, ...]) -> torch.Tensor:
        if dtype is torch.bool:
            return torch.rand(sh, generator=gen) < 0.5
        if not dtype.is_floating_point:
            return torch.randint(-6, 7, sh, generator=gen).to(dtype)
        t = torch.randn(sh, generator=gen) * draw(st.sampled_from([1.0, 1.0, 3.0]))
        if draw(st.integers(0, 4)) == 0 and t.numel():  # NaN and inf at a few positions
            flat = t.view(-1)
            for special in (math.nan, math.inf, -math.inf):
                flat[int(torch.randint(0, flat.numel(), (1,), generator=gen))] = special
        return t.to(dtype)

    if layout == "transposed":
        return values((*shape[:-2], shape[-1], shape[-2])).transpose(-1, -2)
    if layout == "sliced":
        return values((*shape[:-1], 2 * shape[-1]))[..., ::2]
    if layout == "expanded":
        d = draw(st.sampled_from([i for i, s in enumerate(shape) if s > 1]))
        small = tuple(1 if i == d else s for i, s in enumerate(shape))
        return values(small).expand(shape)
    return values(shape)


def _input_shape(draw: Any, base: tuple[int, ...]) -> tuple[int, ...]:
    shape = tuple(1 if draw(st.integers(0, 3)) == 0 else s for s in base)
    # fewer leading dims (0-dim included) half the time: biases, per-row and scalar operands, whose
    # gradients sum what broadcast them
    drop = draw(st.integers(0, len(shape))) if draw(st.booleans()) else 0
    return shape[drop:]


# ---- ops ------------------------------------------------------------------------------------------
def _safe_pos(e: Any) -> Any:
    return rx.abs(e) + 0.25


UNARY_FLOAT: list[tuple[str, Callable[[Any], Any]]] = [
    ("exp", lambda e: rx.exp(rx.clamp(e, -6.0, 6.0))),
    ("exp2", lambda e: rx.exp2(rx.clamp(e, -6.0, 6.0))),
    ("expm1", lambda e: rx.expm1(rx.clamp(e, -4.0, 4.0))),
    ("log", lambda e: rx.log(_safe_pos(e))),
    ("log2", lambda e: rx.log2(_safe_pos(e))),
    ("log1p", lambda e: rx.log1p(rx.abs(e))),
    ("sqrt", lambda e: rx.sqrt(rx.abs(e))),
    ("rsqrt", lambda e: rx.rsqrt(_safe_pos(e))),
    ("reciprocal", lambda e: rx.reciprocal(_safe_pos(e))),
    ("sin", rx.sin),
    ("cos", rx.cos),
    ("tan", lambda e: rx.tan(rx.tanh(e))),
    ("tanh", rx.tanh),
    ("sigmoid", rx.sigmoid),
    ("relu", rx.relu),
    ("gelu", rx.gelu),
    ("gelu_tanh", lambda e: rx.gelu(e, approximate="tanh")),
    ("silu", rx.silu),
    ("erf", rx.erf),
    ("abs", rx.abs),
    ("neg", lambda e: -e),
    ("floor", rx.floor),
    ("ceil", rx.ceil),
    ("round", rx.round),
    ("trunc", rx.trunc),
    ("sign", rx.sign),
    ("softplus", lambda e: rx.softplus(e, 2.0, 3.0)),
    ("leaky_relu", lambda e: rx.leaky_relu(e, 0.1)),
    ("elu", lambda e: rx.elu(e, 0.7)),
    ("clamp", lambda e: rx.clamp(e, -0.5, 0.75)),
    ("half_cast", lambda e: rx.cast(e, torch.float16)),
    ("bf16_cast", lambda e: rx.cast(e, torch.bfloat16)),
]
BINARY_FLOAT: list[tuple[str, Callable[[Any, Any], Any]]] = [
    ("add", lambda a, b: a + b),
    ("sub", lambda a, b: a - b),
    ("mul", lambda a, b: a * b),
    ("div", lambda a, b: a / _safe_pos(b)),
    ("maximum", rx.maximum),
    ("minimum", rx.minimum),
    ("pow", lambda a, b: rx.pow(_safe_pos(a), rx.clamp(b, -2.0, 2.0))),
    ("where", lambda a, b: rx.where(a > b, a, b * 0.5)),
    ("swiglu", rx.swiglu),
]
BINARY_INT: list[tuple[str, Callable[[Any, Any], Any]]] = [
    ("add", lambda a, b: a + b),
    ("sub", lambda a, b: a - b),
    ("mul", lambda a, b: a * b),
    ("floordiv", lambda a, b: a // (rx.abs(b) + 1)),
    ("remainder", lambda a, b: a % (rx.abs(b) + 1)),
    # divisors that may hold a zero: torch raises ZeroDivisionError on CPU, so must rtxdsl
    ("floordiv_any", lambda a, b: a // b),
    ("remainder_any", lambda a, b: a % b),
    ("maximum", rx.maximum),
    ("minimum", rx.minimum),
    ("and", lambda a, b: a & b),
    ("xor", lambda a, b: a ^ b),
    ("pow", lambda a, b: a ** rx.clamp(b, 0, 3)),
]
COMPARE = [
    ("lt", lambda a, b: a < b),
    ("ge", lambda a, b: a >= b),
    ("eq", lambda a, b: a == b),
    ("ne", lambda a, b: a != b),
]
REDUCE_FLOAT = ["sum", "mean", "amax", "amin", "logsumexp", "variance", "std"]
REDUCE_INT = ["sum", "amax", "amin"]


def _axis(draw: Any, shape: tuple[int, ...]) -> Any:
    if not shape or draw(st.integers(0, 4)) == 0:
        return None
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    if len(shape) >= 2 and draw(st.integers(0, 3)) == 0:
        other = draw(st.integers(0, len(shape) - 1))
        if other % len(shape) != axis % len(shape):
            return (axis, other)
    return axis


def _move(draw: Any, pool: list[Value], a: Value) -> tuple[str, Value] | None:
    """A movement op over ``a``: a slice, flip, integer index, join or positions along one axis."""
    r = len(a.shape)
    ax = draw(st.integers(-r, r - 1))
    n = a.shape[ax]
    lead = (slice(None),) * (ax % r)
    name = draw(st.sampled_from(["slice", "flip", "select", "cat", "arange", "unsqueeze"]))
    if name == "slice":
        start, stop = draw(st.integers(-n - 1, n + 1)), draw(st.sampled_from([None, *range(-n - 1, n + 2)]))
        step = draw(st.integers(1, 3))
        length = len(range(*slice(start, stop, step).indices(n)))
        shape = a.shape[: ax % r] + (length,) + a.shape[ax % r + 1 :]
        return name, Value(a.expr[(*lead, slice(start, stop, step))], shape, a.kind)
    if name == "flip":
        return name, Value(rx.flip(a.expr, ax), a.shape, a.kind)
    if name == "select" and n:
        i = draw(st.integers(-n, n - 1))
        return name, Value(a.expr[(*lead, i)], a.shape[: ax % r] + a.shape[ax % r + 1 :], a.kind)
    if name == "cat":
        fits = [
            v for v in pool
            if v.kind == a.kind and len(v.shape) == r
            and all(x == y for d, (x, y) in enumerate(zip(v.shape, a.shape)) if d != ax % r)
        ]  # fmt: skip
        b = draw(st.sampled_from(fits))
        shape = a.shape[: ax % r] + (n + b.shape[ax % r],) + a.shape[ax % r + 1 :]
        return name, Value(rx.cat([a.expr, b.expr], ax), shape, a.kind)
    if name == "unsqueeze":  # a size-1 dim inserted: read by broadcasting through a view
        return name, Value(a.expr[(*lead, None)], a.shape[: ax % r] + (1,) + a.shape[ax % r :], a.kind)
    if name == "arange" and a.kind != "bool":
        return name, Value(a.expr + rx.arange_like(a.expr, ax), a.shape, a.kind)
    return None


def _indexed(draw: Any, a: Value, new_input: Callable[[torch.Tensor], Any]) -> tuple[str, Value] | None:
    """Ops that read ``a`` at positions from an index input: cross-entropy with class indices
    (its target logit is a gather) and ``gather``; the index input is drawn here."""
    r = len(a.shape)
    if draw(st.booleans()):
        cls = 1 if r > 1 else 0
        classes = a.shape[cls]
        rows = a.shape[:cls] + a.shape[cls + 1 :]
        if classes == 0:
            return None
        target = torch.randint(0, classes, rows, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
        if target.numel() and draw(st.booleans()):
            target.view(-1)[0] = -100  # ignored
        reduction = draw(st.sampled_from(["none", "mean", "sum"]))
        smoothing = draw(st.sampled_from([0.0, 0.0, 0.1]))
        e = rx.cross_entropy(a.expr, new_input(target), reduction=reduction, label_smoothing=smoothing)
        return "cross_entropy", Value(e, rows if reduction == "none" else (), "float")
    ax = draw(st.integers(-r, r - 1))
    if a.shape[ax] == 0:
        return None
    shape = tuple(draw(st.integers(1, s)) if s else 0 for s in a.shape)
    seed = draw(st.integers(0, 99))
    index = torch.randint(0, a.shape[ax], shape, generator=torch.Generator().manual_seed(seed))
    return "gather", Value(rx.gather(a.expr, new_input(index), ax), shape, a.kind)


def _step(draw: Any, pool: list[Value], steps: list[str], new_input: Callable[[torch.Tensor], Any]) -> None:
    """Add one op to ``pool`` (over earlier entries, shared freely)."""
    a = draw(st.sampled_from(pool))
    if a.shape and a.kind == "float" and draw(st.integers(0, 3)) == 0:
        made = _indexed(draw, a, new_input)
        if made is not None:
            pool.append(made[1])
            steps.append(made[0])
            return
    if a.shape and draw(st.integers(0, 4)) == 0:
        moved = _move(draw, pool, a)
        if moved is not None:
            pool.append(moved[1])
            steps.append(moved[0])
            return
    choice = draw(st.integers(0, 11))
    floats = [v for v in pool if v.kind == "float"]
    if a.kind == "bool" and choice < 7:
        other = draw(st.sampled_from(pool))
        shape = broadcast(a.shape, other.shape)
        if shape is not None and other.kind == "bool":
            name, fn = draw(st.sampled_from([("and", lambda x, y: x & y), ("or", lambda x, y: x | y)]))
            pool.append(Value(fn(a.expr, other.expr), shape, "bool"))
        elif floats:
            f = draw(st.sampled_from(floats))
            shape = broadcast(a.shape, f.shape)
            if shape is not None:
                pool.append(Value(rx.where(a.expr, f.expr, -f.expr), shape, "float"))
                name = "where"
            else:
                name = "skip"
        else:
            pool.append(Value(rx.cast(a.expr, torch.float32) * 1.5, a.shape, "float"))
            name = "cast"
        steps.append(name)
        return
    if a.kind == "int":
        if choice < 5:
            b = draw(st.sampled_from([v for v in pool if v.kind == "int"]))
            shape = broadcast(a.shape, b.shape)
            if shape is not None:
                name, fn = draw(st.sampled_from(BINARY_INT))
                pool.append(Value(fn(a.expr, b.expr), shape, "int"))
                steps.append(name)
                return
        if choice < 7 and a.shape:
            op = draw(st.sampled_from(REDUCE_INT))
            axis, keep = _axis(draw, a.shape), draw(st.booleans())
            pool.append(Value(getattr(rx, op)(a.expr, axis, keep), reduced(a.shape, axis, keep), "int"))
            steps.append(op)
            return
        pool.append(Value(rx.cast(a.expr, draw(st.sampled_from(FLOATS))), a.shape, "float"))
        steps.append("cast_int_float")
        return
    # float operand
    if choice < 3:
        name, fn = draw(st.sampled_from(UNARY_FLOAT))
        pool.append(Value(fn(a.expr), a.shape, "float"))
    elif choice < 6:
        b = draw(st.sampled_from(pool))
        if b.kind == "bool":
            b = Value(rx.cast(b.expr, torch.float32), b.shape, "float")
        const = draw(st.sampled_from([None, None, 0.5, -2.0, 3, 1e-3]))
        shape = broadcast(a.shape, b.shape) if const is None else a.shape
        if shape is None:
            return
        name, fn = draw(st.sampled_from(BINARY_FLOAT))
        if name == "swiglu" and (b.kind != "float" or const is not None):
            name, fn = BINARY_FLOAT[0]
        operand = b.expr if const is None else const
        if draw(st.booleans()) and const is None:
            pool.append(Value(fn(operand, a.expr), shape, "float"))
        else:
            pool.append(Value(fn(a.expr, operand), shape, "float"))
    elif choice == 6:
        b = draw(st.sampled_from(pool))
        shape = broadcast(a.shape, b.shape)
        if shape is None or b.kind == "bool":
            return
        name, fn = draw(st.sampled_from(COMPARE))
        pool.append(Value(fn(a.expr, b.expr), shape, "bool"))
    elif choice == 7:
        name = draw(st.sampled_from(REDUCE_FLOAT))
        axis, keep = _axis(draw, a.shape), draw(st.booleans())
        if name in ("amax", "amin") and 0 in a.shape:
            return  # torch has no identity for these
        pool.append(Value(getattr(rx, name)(a.expr, axis, keep), reduced(a.shape, axis, keep), "float"))
    elif choice == 8 and a.shape:
        name = draw(st.sampled_from(["softmax", "log_softmax"]))
        axis = draw(st.integers(-len(a.shape), len(a.shape) - 1))
        pool.append(Value(getattr(rx, name)(a.expr, axis), a.shape, "float"))
        _across_rows(draw, pool, pool[-1])
    elif choice == 9 and a.shape:
        name = draw(st.sampled_from(["layer_norm", "rms_norm"]))
        d = a.shape[-1]
        weights = [v for v in pool if v.kind == "float" and v.shape == (d,)]
        w = draw(st.sampled_from(weights)).expr if weights and draw(st.booleans()) else None
        e = rx.layer_norm(a.expr, w, None) if name == "layer_norm" else rx.rms_norm(a.expr, w)
        pool.append(Value(e, a.shape, "float"))
        _across_rows(draw, pool, pool[-1])
    elif choice >= 10 and a.shape and a.kind == "float":
        name = _contraction(draw, pool, a, new_input)
    else:
        return
    steps.append(name)


def _across_rows(draw: Any, pool: list[Value], a: Value) -> None:
    """Now and then a reduction of a row op's result over its leading axes (``amin(softmax(x) * x,
    0)``, a norm's column sum): a row kernel computes it over its programs' rows, and an extreme's
    gradient compares its recomputed operand with it (a softmax's exp computed in two forms once
    made no element equal)."""
    if len(a.shape) < 2 or 0 in a.shape or draw(st.integers(0, 2)):
        return
    name = draw(st.sampled_from(["amax", "amin", "sum"]))
    operand = (
        a.expr * pool[0].expr if pool[0].kind == "float" and broadcast(a.shape, pool[0].shape) == a.shape else a.expr
    )
    axis = tuple(range(len(a.shape) - 1))
    pool.append(Value(getattr(rx, name)(operand, axis, False), a.shape[-1:], "float"))


def _contraction(draw: Any, pool: list[Value], a: Value, new_input: Callable[[torch.Tensor], Any]) -> str:
    """``a`` cast to a float dtype (what computed it, and the cast: a prologue the GEMM may apply
    at load; kept in the pool, so later steps may reduce it over the contracted axis) times a new
    weight: ``linear`` (the weight read transposed) or ``matmul`` (1-D ``a``: a reduction); now
    and then a loss over the same product too (:func:`_head_loss`: its logits never written)."""
    dtype = draw(st.sampled_from(FLOATS))
    k, n = a.shape[-1], draw(st.sampled_from(DIMS))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 99)))
    operand = rx.cast(a.expr, dtype)
    pool.append(Value(operand, a.shape, "float"))
    name = draw(st.sampled_from(["linear", "matmul"]))
    shape = (k, n) if name == "matmul" else (n, k)
    # the weight cast too (a prologue of B): the float64 reference feeds every input as float64
    w = rx.cast(new_input(torch.randn(shape, generator=gen).to(dtype)), dtype)
    product = rx.linear(operand, w) if name == "linear" else rx.matmul(operand, w)
    pool.append(Value(product, (*a.shape[:-1], n), "float"))
    rows = a.shape[:-1]
    if name == "linear" and n and all(rows) and draw(st.integers(0, 2)) == 0:
        loss = _head_loss(draw, operand, w, rows, n, dtype, gen, new_input)
        pool.append(loss)
        return "head loss"
    return name


def _head_loss(
    draw: Any, h: Any, w: Any, rows: tuple[int, ...], n: int, dtype: torch.dtype, gen: torch.Generator,
    new_input: Callable[[torch.Tensor], Any],
) -> Value:  # fmt: skip
    """A loss over the head ``h @ w.T`` (its logits never written, one row kernel per model): a
    cross-entropy with Liger's options, a preference loss of sequences (DPO with a reference head,
    ORPO, CPO, SimPO; KTO), GRPO, a distillation loss or the fused linear JSD against a teacher's
    head. One of its outputs is the program's."""
    target = torch.randint(0, n, rows, generator=gen)
    if target.numel() > 1:
        target.view(-1)[1] = -100  # an ignored token
    kinds = ["cross_entropy", "distillation", "linear_jsd"]
    if len(rows) == 2 and rows[1] > 1:  # sequences of tokens: the first of each always counts
        target[:, 0] = torch.randint(0, n, (rows[0],), generator=gen)
        kinds += ["kto", "grpo"] + (["preference"] if rows[0] % 2 == 0 else [])
    kind = draw(st.sampled_from(kinds))
    t = new_input(target)

    def cast(e: Any) -> Any:  # the float64 reference feeds every input as float64: cast as h is
        return rx.cast(e, dtype)

    def head(width: int) -> tuple[Any, Any]:  # another model's head over the same rows
        hh = torch.randn((*rows, width), generator=gen).to(dtype)
        return cast(new_input(hh)), cast(new_input(torch.randn(n, width, generator=gen).to(dtype)))

    if kind == "cross_entropy":
        reduction = draw(st.sampled_from(["none", "mean", "sum"]))
        options = {
            "label_smoothing": draw(st.sampled_from([0.0, 0.1])),
            "z_loss": draw(st.sampled_from([0.0, 1e-2])),
            "softcap": draw(st.sampled_from([None, 5.0])),
        }
        # float32 logits far from zero a quarter of the time: a bias of 1e4 on every class leaves the
        # loss as it is, which ``lse - x[t]`` rounded at that magnitude (3.7e-4 off, an ulp of 1e4)
        shift = draw(st.sampled_from([0.0, 0.0, 0.0, 1e4])) if dtype is torch.float32 else 0.0
        bias = cast(new_input(torch.full((n,), shift, dtype=dtype))) if shift else None
        e = rx.linear_cross_entropy(h, w, t, bias, reduction=reduction, **options)
        return Value(e, rows if reduction == "none" else (), "float")
    if kind == "linear_jsd":
        label = t if draw(st.booleans()) else None
        e = rx.linear_jsd(h, w, *head(draw(st.sampled_from(DIMS))), label, beta=draw(st.sampled_from([0.0, 0.5, 1.0])))
        return Value(e, (), "float")
    if kind == "distillation":
        loss = draw(st.sampled_from(["jsd", "cosine"]))
        outs = rx.distillation_outputs(loss, h, w, *head(draw(st.sampled_from(DIMS))), t, temperature=2.0)
    elif kind == "preference":
        loss = draw(st.sampled_from(["dpo", "orpo", "cpo", "simpo"]))
        ref = (*head(draw(st.sampled_from(DIMS))), None) if loss == "dpo" and draw(st.booleans()) else None
        outs = rx.preference_outputs(loss, h, w, t, ref=ref)
    elif kind == "kto":
        labels = new_input(torch.rand(rows[0], generator=gen) < 0.5)
        outs = rx.kto_outputs(h, w, t, labels)
    else:
        mask = cast(new_input((target != -100).to(dtype)))
        advantages = cast(new_input(torch.randn(rows[0], generator=gen).to(dtype)))
        loss_type = draw(st.sampled_from(["grpo", "dapo", "bnpo", "dr_grpo"]))
        extra = {"max_completion_length": rows[1]} if loss_type == "dr_grpo" else {}
        ref_lp = cast(new_input(-torch.rand(rows, generator=gen).to(dtype))) if draw(st.booleans()) else None
        outs = rx.grpo_outputs(h, w, t, mask, advantages, ref_logps=ref_lp, loss_type=loss_type,
                               beta=0.04 if ref_lp is not None else 0.0, **extra)  # fmt: skip
    # the scalar outputs (the per-sequence ones are checked by each loss's own tests)
    key = draw(st.sampled_from([k for k in ("loss", "hard_loss", "soft_loss") if k in outs]))
    return Value(outs[key], (), "float")


@st.composite
def programs(draw: Any, max_steps: int = 6, float_only: bool = False) -> Program:
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rank = draw(st.integers(0, 3))
    base = tuple(draw(st.sampled_from(DIMS)) for _ in range(rank))
    if rank and draw(st.integers(0, 11)) == 0:
        base = tuple(0 if i == 0 else s for i, s in enumerate(base))  # empty
    inputs: dict[str, torch.Tensor] = {}
    pool: list[Value] = []
    for i in range(draw(st.integers(1, 3))):
        shape = _input_shape(draw, base)
        if float_only:
            dtype = draw(st.sampled_from(FLOATS))
        else:
            dtype = draw(st.sampled_from([*FLOATS, *FLOATS, torch.int32, torch.int64, torch.bool]))
        name = f"in{i}"
        inputs[name] = _tensor(draw, shape, dtype, gen)
        kind = "float" if dtype.is_floating_point else "bool" if dtype is torch.bool else "int"
        pool.append(Value(rx.var(name), shape, kind))
    steps: list[str] = []

    def new_input(t: torch.Tensor) -> Any:
        name = f"in{len(inputs)}"
        inputs[name] = t
        return rx.var(name)

    for _ in range(draw(st.integers(1, max_steps))):
        _step(draw, pool, steps, new_input)
    distinct = {id(v.expr): v for v in pool[len(inputs) :] if not isinstance(v.expr, (int, float))}
    computed = list(distinct.values()) or pool
    n_out = draw(st.integers(1, min(3, len(computed))))
    outs = draw(st.lists(st.sampled_from(computed), min_size=n_out, max_size=n_out, unique_by=lambda v: id(v.expr)))
    outputs = {f"o{k}": v.expr for k, v in enumerate(outs)}
    used = {v.attr("name") for e in outputs.values() for v in _vars(e)}
    return Program({n: t for n, t in inputs.items() if n in used}, outputs, steps)


@st.composite
def head_programs(draw: Any) -> Program:
    """Programs that end in a loss over a head (:func:`_head_loss`): hidden states ``[rows...,
    hidden]`` (sequences of tokens half the time, an even number of them for the preference
    losses), a few ops on them, then the loss, as one output beside another value. The general
    draw reaches these losses rarely; this one always does."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rows = (draw(st.sampled_from([2, 4])), draw(st.sampled_from([2, 3, 5]))) if draw(st.booleans()) else (7,)
    dtype = draw(st.sampled_from(FLOATS))
    inputs: dict[str, torch.Tensor] = {"in0": _tensor(draw, (*rows, draw(st.sampled_from([3, 5, 13]))), dtype, gen)}

    def new_input(t: torch.Tensor) -> Any:
        name = f"in{len(inputs)}"
        inputs[name] = t
        return rx.var(name)

    pool = [Value(rx.var("in0"), inputs["in0"].shape, "float")]
    steps: list[str] = []
    for _ in range(draw(st.integers(0, 2))):
        _step(draw, pool, steps, new_input)
    a = draw(st.sampled_from([v for v in pool if v.kind == "float" and v.shape == pool[0].shape] or pool[:1]))
    classes = draw(st.sampled_from(DIMS[2:]))
    w = rx.cast(new_input(torch.randn(classes, a.shape[-1], generator=gen).to(dtype)), dtype)
    loss = _head_loss(draw, rx.cast(a.expr, dtype), w, a.shape[:-1], classes, dtype, gen, new_input)
    outputs = {"o0": loss.expr} | ({"o1": a.expr} if a is not pool[0] else {})
    used = {v.attr("name") for e in outputs.values() for v in _vars(e)}  # a loss may not read its target
    return Program({n: t for n, t in inputs.items() if n in used}, outputs, [*steps, "head loss"])


def _vars(e: Any) -> list[Any]:
    return [n for n in walk([e]) if n.op == "var"]


def float64(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.dtype.is_floating_point else t


def coarsest(p: Program) -> torch.dtype | None:
    """The least precise float dtype the program computes in (inputs and casts)."""
    dts = [t.dtype for t in p.inputs.values() if t.dtype.is_floating_point]
    dts += [n.attr("dtype") for n in walk(list(p.outputs.values())) if n.op == "cast"]
    dts = [d for d in dts if d.is_floating_point]
    return max(dts, key=lambda d: TOLERANCE[d][0]) if dts else None


def check_close(
    out: torch.Tensor,
    ref64: torch.Tensor,
    what: str,
    coarse: torch.dtype | None = None,
    eager: torch.Tensor | None = None,
) -> None:
    """``out`` against the float64 reference rounded to ``out``'s dtype; ints and bools exactly, each
    element as float64's or as ``eager``'s (torch in the program's dtypes): a comparison at a tie goes
    either way (``x < cast(x, float32)`` for an fp32 ``x`` is False in fp32, and True in float64 where
    the cast rounds up). The tolerance is the coarser of the output's and ``coarse`` (the program's
    least precise dtype)."""
    assert out.shape == ref64.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    if not out.dtype.is_floating_point:
        exact = out == ref64.to(out.dtype)
        if eager is not None:
            exact |= out == eager
        assert bool(exact.all()), f"{what}: {out} != {ref64}"
        return
    want = ref64.to(out.dtype).double()
    got = out.double()
    finite = want[torch.isfinite(want)]
    scale = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
    atol, rtol = TOLERANCE[out.dtype]
    if coarse is not None:
        atol, rtol = max(atol, TOLERANCE[coarse][0]), max(rtol, TOLERANCE[coarse][1])
    torch.testing.assert_close(got, want, atol=atol * scale, rtol=rtol, equal_nan=True, msg=lambda m: f"{what}: {m}")


# ---- lazy programs --------------------------------------------------------------------------------
LAZY_UNARY = {
    "relu": torch.relu,
    "exp": lambda t: torch.exp(t.clamp(-5, 5)),
    "sigmoid": torch.sigmoid,
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "neg": lambda t: -t,
    "abs_method": lambda t: t.abs(),
    "tanh_method": lambda t: t.tanh(),
    "half_roundtrip": lambda t: t.half().float(),
    "softmax": lambda t: torch.softmax(t, dim=-1),
    "log_softmax": lambda t: torch.log_softmax(t, -1),
    "layer_norm": lambda t: torch.nn.functional.layer_norm(t, t.shape[-1:]),
    "sum_keep": lambda t: t.sum(-1, keepdim=True),
    "mean_keep": lambda t: t.mean(dim=-1, keepdim=True),
    "amax_keep": lambda t: t.amax(-1, keepdim=True),
    "var_keep": lambda t: t.var(-1, keepdim=True),
    "clamp": lambda t: t.clamp(min=-0.5),
    "where": lambda t: torch.where(t > 0, t, t * 0.1),
    "scale": lambda t: t * 1.5 + 0.25,
    "rsub": lambda t: 1 - t,
}
LAZY_BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: torch.sub(a, b, alpha=2),
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / (b.abs() + 1),
    "maximum": torch.maximum,
    "add_method": lambda a, b: a.add(b),
}
LAZY_INPLACE = {
    "add_": lambda t, o: t.add_(o),
    "mul_": lambda t, o: t.mul_(o),
    "sub_": lambda t, o: t.sub_(o, alpha=0.5),
    "iadd": lambda t, o: t.__iadd__(o),
    "clamp_": lambda t, o: t.clamp_(min=-1.0),
    "relu_": lambda t, o: t.relu_(),
}
LAZY_VIEWS = {
    "flat": lambda t: t.view(-1),
    "t": lambda t: t.t(),
    "unsqueeze": lambda t: t.unsqueeze(0),
    "slice": lambda t: t[1:],
    "reshape": lambda t: t.reshape(t.shape[-1], -1),
    "contiguous": lambda t: t.contiguous(),
}


@st.composite
def lazy_programs(draw: Any, max_steps: int = 10) -> tuple[list[torch.Tensor], list[tuple]]:
    """Plain tensors and a list of steps over slots (see ``run_lazy_program``)."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rows, cols = draw(st.sampled_from([(3, 5), (2, 7), (4, 3)]))
    plain = [torch.randn(rows, cols, generator=gen) for _ in range(draw(st.integers(1, 3)))]
    plain.append(torch.randn(cols, generator=gen))  # a broadcast operand
    shapes = []  # shape of each slot, to pick compatible operands
    steps: list[tuple] = []
    for p in range(len(plain) - 1):
        steps.append(("wrap", p))
        shapes.append((rows, cols))
    for _ in range(draw(st.integers(1, max_steps))):
        i = draw(st.integers(0, len(shapes) - 1))
        same = [j for j, s in enumerate(shapes) if s == shapes[i]]
        kind = draw(st.integers(0, 10))
        two_d = len(shapes[i]) == 2
        if kind <= 2:
            name = draw(st.sampled_from(sorted(LAZY_UNARY)))
            if (
                not shapes[i]
                or (name.endswith("_keep") or name in ("softmax", "log_softmax", "layer_norm"))
                and not two_d
            ):
                continue
            steps.append(("unary", i, name))
            keep = name.endswith("_keep")
            shapes.append((*shapes[i][:-1], 1) if keep else shapes[i])
        elif kind <= 4:
            steps.append(("binary", i, draw(st.sampled_from(same)), draw(st.sampled_from(sorted(LAZY_BINARY)))))
            shapes.append(shapes[i])
        elif kind == 5 and shapes[i] == (rows, cols):
            p = draw(st.integers(0, len(plain) - 1))  # a plain tensor (maybe aliased by pending writes)
            view = draw(st.sampled_from(["whole", "view"]))
            steps.append(("plain", i, p, view, draw(st.sampled_from(sorted(LAZY_BINARY)))))
            shapes.append(shapes[i])
        elif kind == 6:
            name = draw(st.sampled_from(sorted(LAZY_INPLACE)))
            operand = draw(st.sampled_from([*same, "const"]))
            steps.append(("inplace", i, operand, name))
        elif kind == 7 and two_d:
            name = draw(st.sampled_from(sorted(LAZY_VIEWS)))
            steps.append(("view", i, name))
            shapes.append(tuple(LAZY_VIEWS[name](torch.empty(shapes[i])).shape))
        elif kind == 8 and two_d:
            steps.append(("matmul", i))  # x @ x.t(): a GEMM recorded with the rest (a sync point once)
            shapes.append((shapes[i][0], shapes[i][0]))
        elif kind == 9:
            steps.append(("access", i))
        elif kind == 10 and shapes[i] == (rows, cols):
            p = draw(st.integers(0, len(plain) - 2))
            steps.append(("plain_inplace", p, draw(st.sampled_from(["whole", "row"]))))
    return plain, steps


def run_lazy_program(plain: list[torch.Tensor], steps: list[tuple], fusion: Any | None) -> list[Any]:
    """Run ``steps`` eagerly (``fusion`` None) or on lazy tensors; return every value it made."""
    plain = [t.clone() for t in plain]
    slots: list[Any] = []
    seen: list[Any] = []

    def real(t: Any) -> torch.Tensor:
        return t.torch() if fusion is not None and isinstance(t, rx.LazyTensor) else t

    for step in steps:
        kind = step[0]
        if kind == "wrap":
            slots.append(fusion.lazy(plain[step[1]]) if fusion is not None else plain[step[1]])
        elif kind == "unary":
            slots.append(LAZY_UNARY[step[2]](slots[step[1]]))
        elif kind == "binary":
            slots.append(LAZY_BINARY[step[3]](slots[step[1]], slots[step[2]]))
        elif kind == "plain":
            _, i, p, view, name = step
            other = plain[p] if view == "whole" else plain[p].view(plain[p].shape)
            slots.append(LAZY_BINARY[name](slots[step[1]], other))
        elif kind == "inplace":
            _, i, j, name = step
            LAZY_INPLACE[name](slots[i], 0.5 if j == "const" else slots[j])
        elif kind == "view":
            slots.append(LAZY_VIEWS[step[2]](slots[step[1]]))
        elif kind == "matmul":
            t = slots[step[1]]
            slots.append(t @ t.t())
        elif kind == "access":
            seen.append(slots[step[1]].sum().item())
        elif kind == "plain_inplace":
            _, p, where = step
            target = plain[p] if where == "whole" else plain[p][0]
            (fusion.lazy(target) if fusion is not None else target).mul_(2.0)
    if fusion is not None:
        fusion.sync()
    return [real(s).clone() for s in slots] + [t.clone() for t in plain] + seen
