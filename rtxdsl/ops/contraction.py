"""Contractions: ``rx.matmul`` / ``@`` and ``rx.linear``, over one primitive, ``contract``.

``contract(a, b, ta, tb)`` is ``A @ B`` for ``A = a.mT if ta else a`` and ``B = b.mT if tb else
b``: both operands at least 2-D, their batch dims (all but the last two) broadcast as
torch.matmul's, fp32 accumulation. The transposes are flags, not copies: a kernel reads the
operand through swapped strides (a linear's weight, the backward's ``g @ B.mT``). With
``sum_batch`` the batch dims are contracted too (a weight gradient: ``sum_b A_b @ B_b``), so the
product of a batched input with an unbatched weight never materializes per batch.

A backward marks a product its forward never wrote (one reduced in tiles inside a row kernel)
``recompute=True``: the kernels that read it compute its tiles where they need them, and nothing
writes it (linear cross-entropy's logits, forward and backward). A backward's ``summed=j``: the
last ``j`` batch dims are summed in each program's K loop and kept as dims of one (the gradient
of an operand broadcast along them, ``lower.vjp.sum_to``: grouped-query attention's ``dk`` and
``dv``, summed over each key head's query heads without writing them per query head). With
``dtype`` (its accumulator's: fp32 for half-precision operands) the product is that dtype,
never rounded to the operands' (attention's scores, as FlashAttention keeps them: rounded to
bf16, scores near 200 would move each probability by up to 50%); its operands' cotangents are
theirs (``lower.vjp``).

``matmul`` decomposes by rank: a 1-D operand makes a matrix-vector or dot product, which is a
row (or column) reduction (memory-bound: a GEMM tile would be one row); everything else is one
``contract``. ``linear(x, w, b)`` is ``contract(x, w, tb=True) + b``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..dtypes import accumulator
from ..errors import DtypeMismatchError, RtxError, ShapeError
from ..expr import Expr, node
from ..registry import FLOATING, Front, OpDef, OpKind, Pattern, Unsupported, register
from .helpers import D, ExprLike, flag_arg, tensor_arg, torch_fns


def _batch(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape[:-2]


def _broadcast(a: tuple[int, ...], b: tuple[int, ...], what: str) -> tuple[int, ...]:
    try:
        return tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        raise ShapeError(f"{what}: batch dims {list(a)} and {list(b)} do not broadcast") from None


def _matrix(shape: tuple[int, ...], transposed: bool) -> tuple[int, int]:
    r, c = shape[-2], shape[-1]
    return (c, r) if transposed else (r, c)


def _contract_shape(
    shapes: list[tuple[int, ...]],
    ta: bool = False,
    tb: bool = False,
    sum_batch: bool = False,
    recompute: bool = False,
    summed: int = 0,
    dtype: torch.dtype | None = None,
) -> tuple[int, ...]:
    a, b = shapes
    if len(a) < 2 or len(b) < 2:
        raise ShapeError(f"contract: operands must be at least 2-D, got shapes {list(a)} and {list(b)}")
    (m, k), (k2, n) = _matrix(a, ta), _matrix(b, tb)
    if k != k2:
        sa, sb = ("a.mT" if ta else "a"), ("b.mT" if tb else "b")
        raise ShapeError(
            f"matmul: a of shape {list(a)} and b of shape {list(b)} cannot be multiplied "
            f"({sa} has {k} columns, {sb} has {k2} rows)"
        )
    batch = _broadcast(_batch(a), _batch(b), "matmul")
    if summed:  # the last batch dims summed, kept as dims of one
        batch = (*batch[: len(batch) - summed], *(1,) * summed)
    return (m, n) if sum_batch else (*batch, m, n)


def _contract_dtype(dtypes: list[torch.dtype], dtype: torch.dtype | None = None, **_: Any) -> torch.dtype:
    a, b = dtypes
    if a != b:
        raise DtypeMismatchError(f"matmul: a is {a} and b is {b}; torch.matmul needs one dtype (cast one of them)")
    if not a.is_floating_point:
        raise RtxError(f"matmul: {a} operands are not supported (fp32, fp16, bf16 or fp64)")
    if dtype is not None and dtype not in (a, accumulator(a)):
        raise DtypeMismatchError(f"contract: dtype must be the operands' ({a}) or their accumulator's, got {dtype}")
    return a if dtype is None else dtype


def _summed_in_fp32(product: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``product(a, b)``; of 16-bit operands summed in fp32 and rounded once, as the kernels and a
    GPU's MMA compute it (torch's batched bf16 matmul on the CPU gave NaN for a row holding an inf
    where every sum is +-inf: expression fuzzer seed 20261324)."""
    if a.dtype in (torch.float16, torch.bfloat16) and b.dtype == a.dtype:
        return product(a.float(), b.float()).to(a.dtype)
    return product(a, b)


def _contract_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    ta: bool,
    tb: bool,
    sum_batch: bool,
    recompute: bool = False,
    summed: int = 0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    if dtype is not None:  # exact products of the operands' values, summed in ``dtype``
        a, b = a.to(dtype), b.to(dtype)
    out = _summed_in_fp32(torch.matmul, a.mT if ta else a, b.mT if tb else b)
    if summed:
        out = out.sum(tuple(range(out.dim() - 2 - summed, out.dim() - 2)), keepdim=True)
    return out.sum(tuple(range(out.dim() - 2))) if sum_batch else out


def contract(
    a: ExprLike,
    b: ExprLike,
    ta: bool = False,
    tb: bool = False,
    sum_batch: bool = False,
    dtype: torch.dtype | None = None,
) -> Expr:
    """The primitive contraction (see the module's docstring); prefer :func:`matmul` / :func:`linear`.
    ``dtype``: the product kept at its accumulator's dtype (fp32 for half operands), not rounded.

    Example:
        >>> import rtxdsl as rx
        >>> rx.contract(rx.var("g"), rx.var("w"), tb=True)
        contract(g, w, sum_batch=False, ta=False, tb=True)
    """
    kept = {} if dtype is None else {"dtype": dtype}
    flags = {k: flag_arg(v, "contract", k) for k, v in (("ta", ta), ("tb", tb), ("sum_batch", sum_batch))}
    return node("contract", tensor_arg(a, "contract", "a"), tensor_arg(b, "contract", "b"), **flags, **kept)


def _contract_grad(d: D) -> tuple[Expr, Expr]:
    """``dA = g @ B.mT`` and ``dB = A.mT @ g`` (as stored: transposed back where an operand was
    read transposed); an operand with no batch dims of its own takes the batch-summed product.
    A product kept at its accumulator's dtype keeps its operands' gradients so too: they are
    rounded to the operands' dtype once, where they reach a leaf, not after each product. So does
    the gradient of an operand cast to the product's dtype (``softmax(s).to(bf16) @ v``): the
    cast's own derivative widens it back at once, and a rounding between would only add noise
    (the softmax's backward then subtracts two sums of it that are equal in exact arithmetic)."""
    ta, tb = d.n.attr("ta"), d.n.attr("tb")
    kept = d.n.attr_dict.get("dtype")
    narrowed = d.a.op == "cast" and d.a.attr("dtype") in (torch.float16, torch.bfloat16)
    dtype = torch.float32 if kept is None and narrowed else kept
    a_rank, b_rank = (len(s) for s in d.src_shapes)
    out_batched = d.n_ndim > 2

    def own(rank: int) -> bool:  # a 2-D operand of a batched product: contract the batch dims too
        return rank == 2 and out_batched

    if not ta:
        da = contract(d.g, d.b, tb=not tb, sum_batch=own(a_rank), dtype=dtype)
    else:
        da = contract(d.b, d.g, ta=tb, tb=True, sum_batch=own(a_rank), dtype=dtype)
    if not tb:
        db = contract(d.a, d.g, ta=not ta, sum_batch=own(b_rank), dtype=kept)
    else:
        db = contract(d.g, d.a, ta=True, tb=ta, sum_batch=own(b_rank), dtype=kept)
    return da, db


register(
    OpDef(
        name="contract",
        kind=OpKind.CONTRACTION,
        arity=2,
        ref=_contract_ref,
        eager_launches=1,
        shape=_contract_shape,
        result_dtype=_contract_dtype,
        accepts=FLOATING,
        derivative=_contract_grad,
        launch_args=lambda shapes, out, ta, **_: (_matrix(shapes[0], ta)[1],),
        pattern=Pattern.CONTRACTION,
        front=Front(fn=contract),
    )
)


# ---- matmul ----------------------------------------------------------------------------------------
def matmul(a: ExprLike, b: ExprLike, *, rank: int | None = None) -> Expr:
    """``torch.matmul``: 1-D, 2-D and batched operands (batch dims broadcast); also ``a @ b``.
    ``rank=2`` is ``torch.mm`` and ``rank=3`` ``torch.bmm``: both operands exactly that rank (and,
    for bmm, the same batch), as those functions require.

    Example:
        >>> import rtxdsl as rx
        >>> rx.var("x") @ rx.var("w")
        matmul(x, w)
    """
    if rank not in (None, 2, 3):
        raise RtxError(f"matmul: rank must be None, 2 (mm) or 3 (bmm), got {rank!r}")
    a, b = tensor_arg(a, "matmul", "a"), tensor_arg(b, "matmul", "b")
    return node("matmul", a, b) if rank is None else node("matmul", a, b, rank=rank)


def _peel(e: Expr, rank: int) -> tuple[Expr, bool]:
    """An operand that is a transpose of its last two dims: (what it transposes, True)."""
    if e.op == "permute" and rank >= 2:
        dims = tuple(d % rank for d in e.attr("dims"))
        if dims == (*range(rank - 2), rank - 1, rank - 2):
            return e.srcs[0], True
    return e, False


def _matmul_shape(shapes: list[tuple[int, ...]], rank: int | None = None) -> tuple[int, ...]:
    a, b = shapes
    if rank is not None:
        what = {2: "mm", 3: "bmm"}[rank]
        for name, s in (("self", a), ("mat2", b)):
            if len(s) != rank:
                raise ShapeError(f"{what}: {name} must be a {rank}-D tensor, got shape {list(s)}")
        if rank == 3 and a[0] != b[0]:
            raise ShapeError(f"bmm: batch sizes differ, {a[0]} and {b[0]} (shapes {list(a)} and {list(b)})")
    if not a or not b:
        raise ShapeError(f"matmul: both operands need at least one dim, got shapes {list(a)} and {list(b)}")
    k_a, k_b = a[-1], (b[0] if len(b) == 1 else b[-2])
    if k_a != k_b:
        raise ShapeError(f"matmul: a of shape {list(a)} and b of shape {list(b)} cannot be multiplied ({k_a} != {k_b})")
    if len(a) == 1 and len(b) == 1:
        return ()
    if len(b) == 1:
        return a[:-1]
    if len(a) == 1:
        return (*b[:-2], b[-1])
    return (*_broadcast(_batch(a), _batch(b), "matmul"), a[-2], b[-1])


def _matmul_decompose(a: Expr, b: Expr, shapes: list, dtypes: list, rank: int | None = None) -> Expr:
    _contract_dtype(list(dtypes))
    sa, sb = shapes
    if len(sa) == 1 and len(sb) == 1:  # a dot product
        return node("sum", node("mul", a, b), axis=(0,), keepdim=False)
    if len(sb) == 1:  # matrix-vector: a row reduction over a's last dim
        return node("sum", node("mul", a, b), axis=(len(sa) - 1,), keepdim=False)
    if len(sa) == 1:  # vector-matrix: a reduction over b's rows
        col = node("unsqueeze", a, axes=(1,))  # [K, 1] against b's [..., K, N]
        return node("sum", node("mul", col, b), axis=(len(sb) - 2,), keepdim=False)
    pa, ta = _peel(a, len(sa))
    pb, tb = _peel(b, len(sb))
    return node("contract", pa, pb, ta=ta, tb=tb, sum_batch=False)


def _torch_product(rank: int | None) -> Any:
    """``torch.matmul`` (rank None), ``torch.mm`` (2) or ``torch.bmm`` (3) as it is called."""

    def build(a: Any, b: Any, *, out: Any = None, **kwargs: Any) -> Expr:
        if out is not None or kwargs:
            raise Unsupported
        return matmul(a, b, rank=rank)

    return build


def _torch_addmm(
    bias: Any, a: Any, b: Any, *, beta: float = 1, alpha: float = 1, out: Any = None, **kwargs: Any
) -> Expr:
    if out is not None or kwargs:
        raise Unsupported
    product = matmul(a, b, rank=2)
    product = product if alpha == 1 else product * alpha
    return product + (bias if beta == 1 else bias * beta)


register(
    OpDef(
        name="matmul",
        kind=OpKind.COMPOSITE,
        arity=2,
        ref=lambda a, b, rank=None: _summed_in_fp32(
            torch.matmul if rank is None else (torch.mm if rank == 2 else torch.bmm), a, b
        ),
        decompose=_matmul_decompose,
        typed_decompose=True,
        shape=_matmul_shape,
        result_dtype=_contract_dtype,
        eager_launches=1,
        accepts=FLOATING,
        pattern=Pattern.CONTRACTION,
        front=Front(
            fn=matmul,
            operators=("__matmul__", "__rmatmul__"),
            methods={"matmul": None},
            torch={
                **dict.fromkeys((*torch_fns("matmul"), torch.Tensor.__matmul__), _torch_product(None)),
                torch.Tensor.__rmatmul__: lambda a, b: matmul(b, a),
                **dict.fromkeys(torch_fns("mm"), _torch_product(2)),
                **dict.fromkeys(torch_fns("bmm"), _torch_product(3)),
                **dict.fromkeys(torch_fns("addmm"), _torch_addmm),
            },
        ),
    )
)


# ---- linear ----------------------------------------------------------------------------------------
def linear(x: ExprLike, weight: ExprLike, bias: ExprLike | None = None) -> Expr:
    """``F.linear``: ``x @ weight.mT + bias``; the weight (``[out, in]``) is read transposed in
    place, and the bias add runs in the product's kernel.

    Example:
        >>> import rtxdsl as rx
        >>> rx.linear(rx.var("x"), rx.var("w"), rx.var("b"))
        linear(x, w, b)
    """
    x, weight = tensor_arg(x, "linear", "x"), tensor_arg(weight, "linear", "weight")
    return node("linear", x, weight, 0.0 if bias is None else bias)


def linear_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """``F.linear``'s result shape from ``[x, weight(, bias)]``'s, or a ShapeError naming the mismatch."""
    x, w = shapes[0], shapes[1]
    b = shapes[2] if len(shapes) > 2 else ()
    if len(w) != 2:
        raise ShapeError(f"linear: weight must be 2-D [out, in], got shape {list(w)}")
    if not x or x[-1] != w[1]:
        raise ShapeError(f"linear: x of shape {list(x)} and weight of shape {list(w)} do not match (in = {w[1]})")
    out = (*x[:-1], w[0])
    if b and b not in ((w[0],), (1,)):
        raise ShapeError(f"linear: bias of shape {list(b)}; expected [{w[0]}]")
    return out


def _linear_decompose(x: Expr, w: Expr, b: Expr, shapes: list, dtypes: list) -> Expr:
    dtype = _contract_dtype(list(dtypes[:2]))
    if len(shapes) > 2 and shapes[2] and dtypes[2] != dtypes[0]:
        raise DtypeMismatchError(f"linear: bias is {dtypes[2]} and x is {dtypes[0]}; torch needs one dtype")
    biased = not (b.op == "const" and b.attr("value") == 0.0)
    # with a bias in half precision, torch's addmm adds it to the float32 accumulator and rounds
    # once: the product is kept unrounded (rounded, then added, a bf16 result was an ulp off)
    wide = torch.float32 if biased and dtype in (torch.float16, torch.bfloat16) else None
    if len(shapes[0]) == 1:
        pair = (x, w) if wide is None else (node("cast", x, dtype=wide), node("cast", w, dtype=wide))
        y = node("sum", node("mul", *pair), axis=(1,), keepdim=False)
    else:
        y = contract(x, w, tb=True, dtype=wide)
    if not biased:
        return y
    return node("add", y, b) if wide is None else node("cast", node("add", y, b), dtype=dtype)


def _linear_ref(x: torch.Tensor, w: torch.Tensor, b: Any) -> torch.Tensor:
    bias = b if isinstance(b, torch.Tensor) else None
    if bias is not None and bias.dtype != x.dtype:
        return F.linear(x, w, bias)  # (torch's error, or its answer)

    def product(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return F.linear(a, c, None if bias is None else bias.to(a.dtype))

    return _summed_in_fp32(product, x, w) + (0 if bias is not None else b)


def _torch_linear(x: Any, weight: Any, bias: Any = None) -> Expr:
    return linear(x, weight, bias)


register(
    OpDef(
        name="linear",
        kind=OpKind.COMPOSITE,
        arity=3,
        ref=_linear_ref,
        decompose=_linear_decompose,
        typed_decompose=True,
        shape=linear_shape,
        result_dtype=lambda dtypes, **_: _contract_dtype(list(dtypes[:2])),
        eager_launches=1,
        accepts=FLOATING,
        pattern=Pattern.CONTRACTION,
        front=Front(fn=linear, torch=dict.fromkeys(torch_fns("linear"), _torch_linear)),
    )
)
