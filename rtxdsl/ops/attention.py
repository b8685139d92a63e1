"""Attention: ``softmax(q @ k.mT * scale + score terms) @ v`` as one composite (DESIGN section 8).

``rx.attention`` is declared once, as a decomposition into primitives (two contractions, the
row statistics of the scores, the masks): its derivatives (dq, dk, dv, and the gradient of every
float tensor a ``score_mod`` reads) come from the VJP of that decomposition, and its torch
reference (``backend="torch"``, the tests' oracle) is written out with torch ops beside it.

``score_mod(s, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` are python functions
over expressions, called once when the attention is built. What they return is kept as a
*template*: an expression whose leaves are ``attention_slot`` nodes, standing for the scaled
scores and the four positions (``b``, ``h``, ``q_idx``, ``kv_idx``, int64, broadcasting over the
scores ``[B, Hq, Tq, Tk]``) and for the tensors the function reads, which become operands of the
attention node. The decomposition fills the slots; the reference evaluates the template with
torch ops. A change of sequence length changes no template, so it compiles nothing new.

A fully masked row gives output 0, logsumexp ``-inf`` and zero gradients, never NaN: the row's
statistics are made finite where its sum is 0 (the ``where`` sits on the statistic, not on the
probabilities, so no branch of the backward divides by 0).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from ..errors import DtypeMismatchError, RtxError, ShapeError
from ..expr import Expr, as_expr, node, substitute, walk
from ..registry import ANY, REGISTRY, Front, OpDef, OpKind, Pattern, Unsupported, apply_ref, register
from .contraction import contract
from .helpers import ExprLike, scalar_arg, torch_fns
from .random import draw_seed, seed_operand

#: the positions a score or mask function receives, in order, and the axis of the scores each counts
POSITIONS = ("b", "h", "q_idx", "kv_idx")

#: split-KV decoding (FlashDecoding): a decoding step (one query per head) over at least
#: ``min_keys`` keys whose programs (one per key head and batch) would not fill ``programs``
#: programs splits its keys into a power of two of chunks, at most ``most``, one program each
#: (``_splits``); the chunks' outputs merge by their logsumexps (``_merged``)
SPLIT_KV = {"min_keys": 4096, "programs": 128, "most": 16}


def _slot(name: str | int) -> Expr:
    return Expr("attention_slot", (), {"slot": name})


# a hole in a score_mod / mask_mod template: the scores, a position, or operand ``slot`` (an int)
register(OpDef(name="attention_slot", kind=OpKind.LEAF, arity=0, ref=lambda **_: None, eager_launches=0))


def _template(fn: Callable[..., Any], slots: tuple[str, ...], what: str, operands: list[Expr]) -> Expr:
    """``fn`` called on slots; each subexpression it reads that holds no slot (a tensor, a lazy
    value) becomes an operand (appended to ``operands``, offset 3 past q, k, v) and a slot, but
    elementwise math over such operands stays in the template, computed at the scores' tiles:
    ``doc_q == doc_k`` compares ids per score where, lifted whole, it was a ``[Tq, Tk]`` mask
    computed apart (grouped-query attention wrote it at the scores' size)."""
    try:
        inspect.signature(fn).bind(*slots)
    except TypeError:
        raise RtxError(f"attention: {what} must take ({', '.join(slots)}), got {fn!r}") from None
    except ValueError:  # no signature to read (a builtin): called as it is
        pass
    try:
        out = fn(*[_slot(s) for s in slots])
    except RtxError as exc:
        raise type(exc)(f"attention: {what}: {exc}") from None
    if isinstance(out, bool) or not isinstance(out, (Expr, int, float)):
        raise RtxError(f"attention: {what} must return an expression, got {type(out).__name__}")
    out = as_expr(out, f"attention: {what}")
    free: dict[Expr, bool] = {}
    maximal: set[Expr] = set()

    def inline(n: Expr) -> bool:  # kept in the template: it holds a slot, or is elementwise math
        return not free[n] or (REGISTRY[n.op].kind is OpKind.ELEMENTWISE and bool(n.srcs))

    for n in walk([out]):
        free[n] = n.op != "attention_slot" and all(free[s] for s in n.srcs)
    for n in walk([out]):
        if inline(n):
            maximal.update(s for s in n.srcs if free[s] and not s.is_const and not inline(s))
    if not inline(out) and not out.is_const:
        maximal.add(out)

    def lift(n: Expr) -> Expr | None:
        if n not in maximal:
            return None
        at = next((i for i, o in enumerate(operands) if o is n), None)
        if at is None:
            at = len(operands)
            operands.append(n)
        return _slot(3 + at)

    return substitute([out], lift)[0]


def attention(
    q: ExprLike,
    k: ExprLike,
    v: ExprLike,
    scale: float | None = None,
    causal: bool = False,
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    return_lse: bool = False,
    *,
    attn_mask: ExprLike | None = None,
    seed: int | None = None,
) -> Any:
    """Scaled dot-product attention: ``softmax(q @ k.mT * scale + score terms) @ v``.

    ``q`` is ``[B, Hq, Tq, D]``, ``k`` ``[B, Hkv, Tk, D]``, ``v`` ``[B, Hkv, Tk, Dv]``; ``scale``
    defaults to ``1 / sqrt(D)``. ``causal=True`` keeps ``q_idx >= kv_idx`` (torch SDPA's top-left
    alignment). ``score_mod(s, b, h, q_idx, kv_idx)`` returns the modified score (``s`` arrives
    scaled; positions are int64 expressions broadcasting over ``[B, Hq, Tq, Tk]``, ``h`` the query
    head); ``mask_mod(b, h, q_idx, kv_idx)`` returns a bool expression, True where a score is
    kept. Tensors they read are ``rx.var`` inputs and get gradients. ``dropout_p`` drops
    probabilities after the softmax (scaled by ``1 / (1 - p)``; the mask is regenerated, never
    stored; ``seed=None`` draws one per call from torch's generator). With ``enable_gqa`` ``Hq``
    is a multiple of ``Hkv`` and each key/value head serves ``Hq / Hkv`` query heads (broadcast,
    not copied). A fully masked row gives 0 and a logsumexp of ``-inf``. ``return_lse=True``
    returns ``(out, lse)``, the natural-log logsumexp of the scores, ``[B, Hq, Tq]``, float32
    (float64 for float64 inputs), differentiable. ``attn_mask`` is SDPA's: a bool tensor (True
    keeps) or a float one added to the scores, broadcasting to ``[B, Hq, Tq, Tk]``.

    Example:
        >>> import torch, rtxdsl as rx
        >>> q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
        >>> kern = rx.compile(rx.attention(rx.var("q"), rx.var("k"), rx.var("v"), causal=True))
        >>> out = kern(q=q, k=k, v=v)
        >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> bool(torch.allclose(out, ref, atol=1e-5))
        True
    """
    if scale is not None:
        scale = scalar_arg(scale, "attention", "scale")
    for name, flag in (("causal", causal), ("enable_gqa", enable_gqa), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise RtxError(f"attention: {name} must be a bool, got {flag!r}")
    p = scalar_arg(dropout_p, "attention", "dropout_p")
    if not 0.0 <= p < 1.0:
        raise RtxError(f"attention: dropout_p must be in [0, 1), got {dropout_p!r}")
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise RtxError(f"attention: {name} must be a function, got {fn!r}")
    operands: list[Expr] = []
    mods = {
        "score_mod": None if score_mod is None else _template(score_mod, ("s", *POSITIONS), "score_mod", operands),
        "mask_mod": None if mask_mod is None else _template(mask_mod, POSITIONS, "mask_mod", operands),
    }
    mask_at = None
    if attn_mask is not None:
        mask_at = 3 + len(operands)
        operands.append(as_expr(attn_mask, "attention: attn_mask"))
    srcs = [q, k, v, *operands]
    if p > 0.0:
        srcs.append(seed_operand(seed, "attention"))
    attrs = dict(scale=scale, causal=causal, dropout_p=p, enable_gqa=enable_gqa, attn_mask=mask_at, **mods)
    out = node("attention", *srcs, output="out", **attrs)
    return (out, node("attention", *srcs, output="lse", **attrs)) if return_lse else out


# ---- shapes and dtypes ------------------------------------------------------------------------------
def _check(shapes: list[tuple[int, ...]], enable_gqa: bool) -> tuple[int, int, int, int, int, int, int]:
    """(B, Hq, Hkv, Tq, Tk, D, Dv), or an error naming the input at fault."""
    q, k, v = shapes[:3]
    for name, s in (("q", q), ("k", k), ("v", v)):
        if len(s) != 4:
            raise ShapeError(f"attention: {name} must be 4-D [B, H, T, D], got shape {list(s)}")
    (b, hq, tq, d), (bk, hkv, tk, dk), (bv, hv, tv, dv) = q, k, v
    if bk != b or dk != d:
        raise ShapeError(f"attention: k has shape {list(k)}; expected [{b}, H, Tk, {d}] (q is {list(q)})")
    if (bv, hv, tv) != (b, hkv, tk):
        raise ShapeError(f"attention: v has shape {list(v)}; expected [{b}, {hkv}, {tk}, Dv] (k is {list(k)})")
    if hkv != hq and not (enable_gqa and hkv > 0 and hq % hkv == 0):
        why = "a multiple of k's" if enable_gqa else "k's (or pass enable_gqa=True)"
        raise ShapeError(f"attention: q has {hq} heads and k {hkv}; q's heads must equal {why}")
    return b, hq, hkv, tq, tk, d, dv


def _shape(shapes: list[tuple[int, ...]], enable_gqa: bool, output: str, **_: Any) -> tuple[int, ...]:
    b, hq, _hkv, tq, _tk, _d, dv = _check(shapes, enable_gqa)
    return (b, hq, tq, dv) if output == "out" else (b, hq, tq)


def _default_scale(d: int) -> float:
    """``1 / sqrt(D)``; a head dim of 0 has no score to scale (its scores are all 0, as eager's)."""
    return 1.0 / math.sqrt(d) if d else 1.0


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dtype(dtypes: list[torch.dtype], output: str, attn_mask: int | None = None, **_: Any) -> torch.dtype:
    q, k, v = dtypes[:3]
    for name, d in (("k", k), ("v", v)):
        if d != q:
            raise DtypeMismatchError(f"attention: q is {q} and {name} is {d}; q, k and v must have one dtype")
    if attn_mask is not None and dtypes[attn_mask] not in (torch.bool, q):
        m = dtypes[attn_mask]
        raise DtypeMismatchError(f"attention: attn_mask is {m}; as SDPA's, it must be bool or q's dtype ({q})")
    if not q.is_floating_point:
        raise RtxError(f"attention: q, k and v must be floating point, got {q}")
    return q if output == "out" else _stat_dtype(q)


# ---- the templates, filled ----------------------------------------------------------------------
def _fill(template: Expr, values: dict[str | int, Any]) -> Any:
    """The template with its slots replaced by expressions (``substitute``)."""
    return substitute([template], lambda n: values[n.attr("slot")] if n.op == "attention_slot" else None)[0]


def _evaluate(template: Expr, values: dict[str | int, Any]) -> Any:
    """The template evaluated with torch ops (each op's reference) on ``values``."""
    vals: dict[Expr, Any] = {}
    for n in walk([template]):
        if n.op == "attention_slot":
            vals[n] = values[n.attr("slot")]
        elif n.is_const:
            vals[n] = n.attr("value")
        else:
            vals[n] = apply_ref(REGISTRY[n.op], [vals[s] for s in n.srcs], n.attr_dict)
    return vals[template]


def _probe(
    template: Expr, what: str, scores: tuple[int, ...], s_dtype: torch.dtype, shapes: list, dtypes: list
) -> None:
    """The template's result on meta tensors: shaped as the scores (or broadcasting to them), and
    float for a score_mod, bool for a mask_mod; otherwise an error naming the function. Planned
    inside torch.compile's fake mode too: these are real meta tensors, made outside it."""
    meta = torch.device("meta")
    with _outside_fake_mode():
        values: dict[str | int, Any] = {"s": torch.empty(scores, dtype=s_dtype, device=meta)}
        for axis, name in enumerate(POSITIONS):
            shape = [n if a == axis else 1 for a, n in enumerate(scores)]
            values[name] = torch.empty(shape, dtype=torch.int64, device=meta)
        for i, (s, d) in enumerate(zip(shapes, dtypes)):
            values[i] = torch.empty(s, dtype=d, device=meta) if d is not None else 1
        try:
            out = torch.as_tensor(_evaluate(template, values))
            shape = torch.broadcast_shapes(out.shape, scores)
        except (RuntimeError, TypeError, ValueError, IndexError) as exc:
            if isinstance(exc, RtxError):
                raise
            raise ShapeError(f"attention: {what} does not apply to scores of shape {list(scores)}: {exc}") from None
    if tuple(shape) != scores:
        raise ShapeError(f"attention: {what} gives shape {list(out.shape)}, which does not broadcast to {list(scores)}")
    want = "bool" if what == "mask_mod" else "floating"
    if (out.dtype == torch.bool) != (want == "bool") or (want == "floating" and not out.dtype.is_floating_point):
        raise RtxError(f"attention: {what} must return a {want} expression, got {out.dtype}")


def _outside_fake_mode() -> Any:
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # another torch: no fake mode to leave
        return contextlib.nullcontext()
    return unset_fake_temporarily()


def _mask_shape(mask: tuple[int, ...], scores: tuple[int, ...]) -> None:
    try:
        if tuple(torch.broadcast_shapes(mask, scores)) == scores:
            return
    except RuntimeError:
        pass
    raise ShapeError(f"attention: attn_mask has shape {list(mask)}, which does not broadcast to {list(scores)}")


def _positions(scores: Expr, rank: int, groups: int | None = None, split: bool = False) -> dict[str | int, Any]:
    """The four positions over the scores ``[B, Hq, Tq, Tk]``; over grouped scores (``groups``:
    ``[B, Hkv, G, Tq, Tk]``, or a decoding step's ``[B, Hkv, G, Tk]``, its one query a row per
    head) the query head is ``kv_head * G + g``; a split decoding step's (``split``) have a chunk
    axis before the rows: ``[B, Hq, C, 1, Tk]``, ``[B, Hkv, C, G, Tk]``."""
    at = [node("arange_like", scores, axis=axis) for axis in range(rank)]
    if split:  # the chunk axis is no position a score function sees: the step's own, unsplit
        at, rank = at[:2] + at[3:], rank - 1
    if groups is None:
        return dict(zip(POSITIONS, at))
    query = at[3] if rank == 5 else as_expr(0)  # a decoding step's one query: position 0
    return {"b": at[0], "h": node("add", node("mul", at[1], groups), at[2]), "q_idx": query, "kv_idx": at[-1]}


def _groupable(mods: list[Expr | None], operands: list[tuple[int, ...] | None]) -> bool:
    """Can the scores be computed grouped, ``[B, Hkv, G, Tq, Tk]``? Where every tensor the score
    and mask functions (and ``attn_mask``) read is the same for every head (size 1 on the head
    axis: a padding or causal mask, positions), reaching the result through elementwise ops only
    (a tensor gathered by a position keeps its own indexing): it broadcasts over the group."""
    if any(s is not None and len(s) >= 3 and s[-3] != 1 for s in operands):
        return False
    for template in mods:
        if template is None:
            continue
        reads: dict[Expr, bool] = {}  # per node: is an operand slot among what it reads
        for n in walk([template]):
            inner = any(reads[x] for x in n.srcs)
            if n.op == "attention_slot":
                reads[n] = isinstance(n.attr("slot"), int)
            elif inner and REGISTRY[n.op].kind != OpKind.ELEMENTWISE:
                return False
            else:
                reads[n] = inner
    return True


def _grouped(e: Expr, shape: tuple[int, ...]) -> Expr:
    """A tensor broadcasting to the scores ``[B, Hq, Tq, Tk]`` with one head (``_groupable``), as
    it broadcasts to the grouped scores ``[B, Hkv, G, Tq, Tk]``: a view with a group axis of one."""
    if len(shape) < 3:  # no head axis: broadcasts as it is
        return e
    return node("unsqueeze", node("unsqueeze", e, axes=(0,)) if len(shape) == 3 else e, axes=(2,))


def _heads(e: Expr, b: int, hkv: int, groups: int, t: int, d: int) -> Expr:
    """Key or value heads ``[B, Hkv, T, D]`` repeated for their ``G`` query heads, ``[B, Hq, T, D]``
    (``repeat_interleave``): a copy of ``G`` times the keys, only where the scores cannot be
    grouped (a tensor the scores read differs per query head: see ``_groupable``)."""
    if groups == 1:
        return e
    wide = node("expand", node("unsqueeze", e, axes=(2,)), shape=(b, hkv, groups, t, d))
    return node("reshape", wide, shape=(b, hkv * groups, t, d))


def _splits(b: int, heads: int, tq: int, tk: int, dropout_p: float, tensors: list, attn_mask: int | None) -> int:
    """How many chunks a decoding step splits its keys into (``SPLIT_KV``); 1: none. Not where a
    tensor a score or mask function reads has a head or query axis (it may index them by
    position); ``attn_mask`` only broadcasts, and takes a chunk axis of one (``_chunk_axis``)."""
    if tq != 1 or tk < SPLIT_KV["min_keys"] or dropout_p > 0.0:
        return 1
    if any(s is not None and len(s) >= 3 and j + 3 != attn_mask for j, s in enumerate(tensors)):
        return 1
    most = min(SPLIT_KV["most"], SPLIT_KV["programs"] // max(1, b * heads))
    return 1 << (most.bit_length() - 1) if most >= 2 else 1


def _chunk_axis(e: Expr, shape: tuple[int, ...]) -> Expr:
    """A mask broadcasting to the scores ``[..., H, Tq, Tk]`` as it broadcasts to the split
    scores ``[..., H, C, Tq, Tk]``: a view with a chunk axis of one before its query axis."""
    return node("unsqueeze", e, axes=(len(shape) - 2,)) if len(shape) >= 3 else e


def _rows(s: Expr) -> tuple[Expr, Expr, Expr]:
    """Softmax over the last axis of ``s``, by parts: ``(exp(s - m), its row sum, logsumexp)``.
    The shift ``m`` is the row's logsumexp (one online pass: logsumexp's state), made finite and
    detached: a shift, not a value the gradient flows through (a fully masked row's ``-inf`` would
    give ``exp(-inf + inf)``). The row sum is 1 up to rounding, made 1 on a fully masked row (its
    probabilities 0, its logsumexp ``-inf``): dividing by it after ``P @ v`` gives the softmax's
    gradient its row term, and a kernel computes it in the ``P @ v`` product's K loop."""
    lse0 = node("logsumexp", s, axis=-1, keepdim=True)
    m = node("detach", node("where", node("eq", lse0, float("-inf")), 0.0, lse0))
    u = node("exp", node("sub", s, m))
    total = node("sum", u, axis=-1, keepdim=True)
    empty = node("eq", total, 0.0)
    total = node("where", empty, 1.0, total)
    return u, total, node("where", empty, float("-inf"), node("add", m, node("log", total)))


def _merged(out: Expr, lse: Expr, shape: tuple[int, int, int, int, int]) -> tuple[Expr, Expr]:
    """The chunks' outputs ``[B, H, C, R, Dv]`` (each normalized over its own keys) and logsumexps
    ``[B, H, C, R, 1]`` merged: ``sum_c exp(lse_c - lse) * out_c`` with ``lse = logsumexp_c(lse_c)``
    (``_rows`` over the chunks), one row kernel over the chunks read transposed (a weighted sum
    after the chunks' product: its epilogue, were the weights its own, would read what is computed
    from its logsumexp); a chunk with no key (``-inf``) weighs 0, a row with none anywhere gives 0
    and ``-inf``. Returns ``[B, H, R, Dv]`` and ``[B, H, R, 1]``."""
    b, h, c, r, _ = shape
    weights, total, whole = _rows(node("permute", node("reshape", lse, shape=(b, h, c, r)), dims=(0, 1, 3, 2)))
    chunks = node("permute", out, dims=(0, 1, 3, 4, 2))
    merged = node("sum", node("mul", node("unsqueeze", weights, axes=(3,)), chunks), axis=-1, keepdim=False)
    return node("div", merged, total), whole


def _decompose(
    q: Expr, k: Expr, v: Expr, *rest: Expr, scale: float | None, causal: bool, dropout_p: float, enable_gqa: bool,
    score_mod: Expr | None, mask_mod: Expr | None, attn_mask: int | None, output: str, shapes: list, dtypes: list,
) -> Expr:  # fmt: skip
    b, hq, hkv, tq, tk, d, dv = _check(shapes, enable_gqa)
    f = _stat_dtype(dtypes[0])
    g = hq // hkv if hkv else 1  # (no head at all: an empty result, as eager's)
    # grouped-query attention: each key/value head's G query heads are one batch of the products,
    # [B, Hkv, G, Tq, D] against [B, Hkv, 1, Tk, D] (views: keys and values are read as they are,
    # never repeated, and their gradients sum over the group inside the contraction)
    tensors = [s if d is not None else None for s, d in zip(shapes[3:], dtypes[3:])]
    grouped = g > 1 and _groupable([score_mod, mask_mod], tensors)
    rank = 4
    if grouped and tq == 1:  # decoding: the group's queries are the rows of one product per key head,
        q = node("reshape", q, shape=(b, hkv, g, d))  # so each key and value is read once, not G times
    elif grouped:
        q, rank = node("reshape", q, shape=(b, hkv, g, tq, d)), 5
        k, v = node("reshape", k, shape=(b, hkv, 1, tk, d)), node("reshape", v, shape=(b, hkv, 1, tk, dv))
        rest = tuple(x if s is None else _grouped(x, s) for x, s in zip(rest, tensors))
    else:
        k, v = _heads(k, b, hkv, g, tk, d), _heads(v, b, hkv, g, tk, dv)
    # split-KV decoding: a chunk axis before the rows (q a view repeated along it, k and v one
    # chunk of one), each program the keys of its chunk (a guard of positions: the other tiles
    # are skipped), the chunks merged after
    heads, rows = (hkv, g) if grouped else (hq, tq)
    chunks = _splits(b, heads, tq, tk, dropout_p, tensors, attn_mask)
    if chunks > 1:
        q = node("expand", node("unsqueeze", q, axes=(2,)), shape=(b, heads, chunks, rows, d))
        k, v = node("unsqueeze", k, axes=(2,)), node("unsqueeze", v, axes=(2,))
        rank = 5
        if attn_mask is not None:
            j = attn_mask - 3
            rest = (*rest[:j], _chunk_axis(rest[j], shapes[attn_mask]), *rest[j + 1 :])
    # the scores in fp32 (the product's accumulator, never rounded to q's dtype: SDPA's, as the
    # reference's ``q.to(f) @ k.mT``); their cotangent multiplies in q's dtype
    qk = contract(q, k, tb=True, dtype=f)
    s = node("mul", qk, _default_scale(d) if scale is None else scale)
    scores = (b, hq, tq, tk)
    values = {**_positions(s, rank, g if grouped else None, chunks > 1), **dict(enumerate(rest, 3)), "s": s}
    if score_mod is not None:
        _probe(score_mod, "score_mod", scores, f, shapes, dtypes)
        s = node("cast", _fill(score_mod, values), dtype=f)
    keep = None
    if mask_mod is not None:
        _probe(mask_mod, "mask_mod", scores, f, shapes, dtypes)
        keep = _fill(mask_mod, values)
    if causal:
        tri = node("ge", values["q_idx"], values["kv_idx"])
        keep = tri if keep is None else node("and", keep, tri)
    if attn_mask is not None:
        _mask_shape(shapes[attn_mask], scores)
        mask = values[attn_mask]
        if dtypes[attn_mask] == torch.bool:
            keep = mask if keep is None else node("and", keep, mask)
        elif dtypes[attn_mask].is_floating_point:
            s = node("add", s, mask)
        else:
            raise RtxError(f"attention: attn_mask must be bool or floating point, got {dtypes[attn_mask]}")
    if chunks > 1:  # this program's chunk of the keys, ceil(Tk / chunks) of them
        size = -(-tk // chunks)
        start = node("mul", node("arange_like", s, axis=2), size)
        mine = node("and", node("ge", values["kv_idx"], start), node("lt", values["kv_idx"], node("add", start, size)))
        keep = mine if keep is None else node("and", keep, mine)
    if keep is not None:
        s = node("where", keep, s, float("-inf"))
    u, total, lse = _rows(s)
    if output == "lse" and chunks == 1:  # per row, then its keepdim dim dropped (a view of what the kernel writes)
        return node("reshape", lse, shape=(b, hq, tq))
    p = node("dropout", u, rest[-1], p=dropout_p) if dropout_p > 0.0 else u
    p = node("cast", p, dtype=dtypes[2])
    if chunks > 1:  # each chunk's output kept in fp32 for the merge, rounded once after it
        chunked = node("div", contract(p, v, dtype=f), total)
        out, lse = _merged(chunked, lse, (b, heads, chunks, rows, dv))
        if output == "lse":
            return node("reshape", lse, shape=(b, hq, tq))
        return node("reshape", node("cast", out, dtype=dtypes[2]), shape=(b, hq, tq, dv))
    out = node("cast", node("div", contract(p, v), total), dtype=dtypes[2])
    return node("reshape", out, shape=(b, hq, tq, dv)) if grouped else out


# ---- the reference: the same math with torch ops ---------------------------------------------------
def _ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any, scale: float | None, causal: bool,
    dropout_p: float, enable_gqa: bool, score_mod: Expr | None, mask_mod: Expr | None, attn_mask: int | None,
    output: str,
) -> torch.Tensor:  # fmt: skip
    _dtype([q.dtype, k.dtype, v.dtype], output)  # torch's SDPA refuses mixed dtypes too
    f = _stat_dtype(q.dtype)
    g = q.shape[1] // max(k.shape[1], 1)
    kf, vf = (t.to(f).repeat_interleave(g, dim=1) for t in (k, v))
    s = q.to(f) @ kf.mT * (_default_scale(q.shape[-1]) if scale is None else scale)
    values: dict[str | int, Any] = dict(enumerate(rest, 3))
    for axis, name in enumerate(POSITIONS):
        shape = [n if a == axis else 1 for a, n in enumerate(s.shape)]
        values[name] = torch.arange(s.shape[axis], device=s.device).reshape(shape)
    if score_mod is not None:
        s = torch.as_tensor(_evaluate(score_mod, {**values, "s": s})).to(f).expand(s.shape)
    keep = torch.ones((), dtype=torch.bool, device=s.device)
    if mask_mod is not None:
        keep = torch.as_tensor(_evaluate(mask_mod, values)).to(s.device)
    if causal:
        keep = keep & (values["q_idx"] >= values["kv_idx"])
    if attn_mask is not None:
        mask = values[attn_mask]
        if mask.dtype == torch.bool:
            keep = keep & mask
        else:
            s = s + mask.to(f)
    s = s.masked_fill(~keep, float("-inf"))
    # the decomposition's statistics: a finite shift, the probabilities and their row sum
    lse = torch.logsumexp(s, dim=-1, keepdim=True).detach()
    u = torch.exp(s - torch.where(lse == float("-inf"), 0.0, lse))
    total = u.sum(-1, keepdim=True)
    empty = total == 0
    total = torch.where(empty, 1.0, total)
    if output == "lse":
        return torch.where(empty, float("-inf"), torch.where(lse == float("-inf"), 0.0, lse) + total.log()).squeeze(-1)
    if dropout_p > 0.0:  # rx.dropout's own reference: the same draws from the seed
        u = REGISTRY["dropout"].ref(u, rest[-1], p=dropout_p)
    return ((u.to(v.dtype).to(f) @ vf).to(v.dtype).to(f) / total).to(q.dtype)


def _eager(operands: list[int], result: int, shapes: list, dtypes: list, *, output: str, **_: Any) -> tuple[int, int]:
    """Eager torch's SDPA: one fused kernel reading q, k, v (and a mask) and writing the output
    (the logsumexp beside it: no second launch)."""
    if output == "lse":
        return 0, 0
    return 1, sum(operands) + result


def _torch_sdpa(
    query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
    scale: float | None = None, enable_gqa: bool = False,
) -> Expr:  # fmt: skip
    """``F.scaled_dot_product_attention`` recorded by the lazy stream: a bool ``attn_mask`` is a
    ``mask_mod``, a float one a score term; a dropout seed is drawn now, in program order."""
    if not isinstance(is_causal, bool) or not isinstance(enable_gqa, bool):
        raise Unsupported
    if attn_mask is not None and not isinstance(attn_mask, Expr):
        raise Unsupported
    seed = draw_seed() if dropout_p else None
    return attention(
        query, key, value, scale, is_causal, dropout_p=dropout_p, enable_gqa=enable_gqa, attn_mask=attn_mask, seed=seed
    )


register(
    OpDef(
        name="attention",
        kind=OpKind.COMPOSITE,
        arity=None,
        ref=_ref,
        decompose=_decompose,
        typed_decompose=True,
        shape=_shape,
        result_dtype=_dtype,
        eager_launches=1,
        eager=_eager,
        pattern=Pattern.ATTENTION,
        reads_output=True,
        accepts=ANY,
        front=Front(fn=attention, torch=dict.fromkeys(torch_fns("scaled_dot_product_attention"), _torch_sdpa)),
    )
)
