"""Reduction primitives as mergeable states: sum, amax, amin, the online logsumexp and Welford's
sum of squared deviations (``m2``), plus the reduced-element count.

mean, variance, std, softmax, log_softmax and the norms are composites over these. Each state
merges associatively, so one declaration serves a row kept in registers, a row looped over
in blocks (at most two reads: the statistics pass and the output pass) and a row split across
programs whose partial states a second kernel merges. Accumulation runs in fp32 for half types
(the compute dtype); NaN wins in amax/amin and propagates through logsumexp and m2.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from ..dtypes import TRITON_TYPE, highest, lowest
from ..errors import ShapeError
from ..expr import Expr, node
from ..registry import ANY, FLOATING, NUMERIC, EmitCtx, Front, OpDef, OpKind, Pattern, ReduceSpec, Unsupported, register
from .elementwise import nan_max, nan_min
from .helpers import D, reduction_fn, torch_fns


def norm_axes(axis: Any, ndim: int) -> tuple[int, ...]:
    """Normalized, sorted reduction axes; ``None`` means all."""
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    for a in axes:
        if not (-max(ndim, 1) <= a < max(ndim, 1)):
            raise ShapeError(f"axis {a} is out of range for a tensor of rank {ndim}")
    out = sorted({a % ndim if ndim else 0 for a in axes})
    if len(out) != len(axes):
        raise ShapeError(f"axis {axis!r} names a dimension twice")
    return tuple(out) if ndim else ()


def reduced_shape(shape: tuple[int, ...], axis: Any, keepdim: bool) -> tuple[int, ...]:
    axes = set(norm_axes(axis, len(shape)))
    if keepdim:
        return tuple(1 if d in axes else s for d, s in enumerate(shape))
    return tuple(s for d, s in enumerate(shape) if d not in axes)


def _shape(shapes: list[tuple[int, ...]], axis: Any, keepdim: bool) -> tuple[int, ...]:
    return reduced_shape(shapes[0], axis, keepdim)


def _nonempty_shape(op: str):
    def shape(shapes: list[tuple[int, ...]], axis: Any, keepdim: bool) -> tuple[int, ...]:
        x = shapes[0]
        if any(x[a] == 0 for a in norm_axes(axis, len(x))):
            raise ShapeError(f"op {op!r}: cannot reduce over a dimension of size 0 (torch.{op} has no identity)")
        return reduced_shape(x, axis, keepdim)

    return shape


def _dims(axis: Any) -> Any:
    return () if axis is None else axis


def _all_if_none(axis: Any, ndim: int) -> tuple[int, ...]:
    """Explicit dims for refs whose torch op has no "all" spelling (axis 0 is not "all")."""
    if axis is None or axis == ():
        return tuple(range(ndim))
    return (axis,) if isinstance(axis, int) else tuple(axis)


#: a tile reduced along its columns (a row's states) or along its rows (a column's), its reduced
#: dim kept: the index that puts it back
KEEP_AXIS = {1: "[:, None]", 0: "[None, :]"}


def _tile_sum(v: str, axis: int = 1) -> str:
    return f"tl.sum({v}, axis={axis}){KEEP_AXIS[axis]}"


def _tile_extreme(which: str, axis: int = 1):
    def tile(ctx: EmitCtx, st: tuple[str, ...]) -> tuple[str, ...]:
        (acc,) = st
        red = f"tl.{which}({acc}, axis={axis}){KEEP_AXIS[axis]}"
        if not ctx.is_float:
            return (red,)
        # tl.max/tl.min may drop NaN; the lanes kept it, so look for it
        has_nan = f"tl.max(({acc} != {acc}).to(tl.int32), axis={axis}){KEEP_AXIS[axis]} > 0"
        return (f"tl.where({has_nan}, float('nan'), {red})",)

    return tile


SUM = ReduceSpec(
    state=("acc",),
    identity=lambda dt: ("0",),
    lift=lambda c, x: (x,),
    tile=lambda c, st: (_tile_sum(st[0]),),
    merge=lambda c, a, b: (f"{a[0]} + {b[0]}",),
    value=lambda c, st: st[0],
    single=lambda c, x: x,
    lanes=True,
    columns=lambda c, st: (_tile_sum(st[0], axis=0),),
    partial="sum",
)


def _extreme_spec(which: str, identity, pick) -> ReduceSpec:
    int_pick = f"tl.{which}imum"
    return ReduceSpec(
        state=("acc",),
        identity=lambda dt: (identity(dt),),
        lift=lambda c, x: (x,),
        tile=_tile_extreme(which),
        merge=lambda c, a, b: (pick(b[0], a[0]) if c.is_float else f"{int_pick}({a[0]}, {b[0]})",),
        value=lambda c, st: st[0],
        single=lambda c, x: x,
        lanes=True,
        columns=_tile_extreme(which, axis=0),
        exact=True,
    )


def exp_below(x: str, big: str) -> str:
    """``exp(x - big)`` per element of a tile whose ``big`` is its row's max, as Liger-Kernel
    computes it: ``exp2`` of the difference in base 2, which Triton lowers to the flush-to-zero
    ``ex2.approx.ftz`` (one FADD, FMUL and MUFU, where ``tl.exp`` adds a range test and two
    rescales per element for results below 2**-126). Terms that small cannot move a sum that holds
    the max's own term 1 (in fp32, anything under 2**-24 of it is rounded away); a softmax reading
    the same tile (``Writer._shared_exp``) gives 0 for them, within 2**-126 of the exact value. The
    interpreter's ``exp2`` (numpy's) flushes nothing."""
    return f"tl.exp2(({x} - {big}) * 1.4426950408889634)"


def _lse_tile(c: EmitCtx, st: tuple[str, ...]) -> tuple[str, ...]:
    m, s = st
    # tl.max may drop a NaN, and needs no flag for it here: the NaN lane's exp(NaN - big) makes
    # the sum NaN, and so the logsumexp (a row of +inf and NaN too: NaN != big)
    big = c.tmp(f"tl.max({m}, axis=1)[:, None]")
    return big, _tile_sum(f"tl.where({m} == {big}, {s}, {s} * {exp_below(m, big)})")


def _lse_merge(c: EmitCtx, a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    big = c.tmp(nan_max(a[0], b[0]))

    def scale(m: str, s: str) -> str:
        s = s if s.isidentifier() else c.tmp(s)  # a block's sum: computed once, read twice
        return f"tl.where({m} == {big}, {s}, {s} * tl.exp({m} - {big}))"

    return big, f"{scale(*a)} + {scale(*b)}"


def _masked(mask: str, x: str, other: str) -> str:
    """``x`` where ``mask``, ``other`` elsewhere (``mask`` "": every lane counts)."""
    return f"tl.where({mask}, {x}, {other})" if mask else x


def _lse_tile_of(c: EmitCtx, x: str, mask: str, count: str) -> tuple[str, ...]:
    m = c.tmp(_masked(mask, x, "float('-inf')"))
    big = c.tmp(f"tl.max({m}, axis=1)[:, None]")
    # shift by the max, or by 0 where it is +-inf: no lane computes inf - inf, so a row of -inf sums
    # to 0 (logsumexp -inf) and one holding +inf to inf; a NaN lane's exp is NaN (tl.max may drop it)
    shift = c.tmp(f"tl.where(tl.abs({big}) == float('inf'), 0.0, {big})")
    e = c.tmp(exp_below(m, shift))
    c.facts.update(exp=e, shift=shift)
    return big, _tile_sum(e)


#: online logsumexp: the running max and the sum of exp(x - max) (rescaled when the max grows)
LOGSUMEXP = ReduceSpec(
    state=("m", "s"),
    identity=lambda dt: ("float('-inf')", "0.0"),
    lift=lambda c, x: (x, "1.0"),
    tile=_lse_tile,
    merge=_lse_merge,
    value=lambda c, st: f"{st[0]} + tl.log({st[1]})",
    single=lambda c, x: x,
    tile_of=_lse_tile_of,
)


def _m2_tile(c: EmitCtx, st: tuple[str, ...]) -> tuple[str, ...]:
    n, mean, m2 = st
    total = c.tmp(_tile_sum(n))
    safe = c.tmp(f"tl.where({total} == 0, 1.0, {total})")
    # the weighted mean, corrected by its residual (see ``_m2_tile_of``): parts of one value give it
    mu0 = c.tmp(f"{_tile_sum(f'{n} * {mean}')} / {safe}")
    dm = c.tmp(f"{mean} - {mu0}")
    return total, *_corrected(c, mu0, _tile_sum(f"{n} * {dm}"), _tile_sum(f"{m2} + {n} * {dm} * {dm}"), total, safe)


def _m2_merge(c: EmitCtx, a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    (n1, mu1, q1), (n2, mu2, q2) = a, b
    total = c.tmp(f"{n1} + {n2}")
    safe = c.tmp(f"tl.where({total} == 0, 1.0, {total})")
    delta = c.tmp(f"{mu2} - {mu1}")
    return total, f"{mu1} + {delta} * ({n2} / {safe})", f"{q1} + {q2} + {delta} * {delta} * ({n1} * {n2} / {safe})"


#: a reduction's combine of two sums at once
ADD_PAIRS = """@triton.jit
def add_pairs(a0, a1, b0, b1):
    return a0 + b0, a1 + b1"""


def _corrected(c: EmitCtx, mu0: str, s1: str, s2: str, n: str, safe: str) -> tuple[str, str]:
    """``(mean, m2)`` from a first mean ``mu0`` and the (weighted) sums ``s1`` of the deviations
    from it and ``s2`` of their squares over ``n`` elements (``safe``: ``n``, at least 1)."""
    fix = c.tmp(f"{s1} / {safe}")
    # a row holding +-inf has the mean +-inf (or NaN) already and deviations inf - inf: no correction
    fix = c.tmp(f"tl.where({fix} == {fix}, {fix}, 0.0)")
    # a sum of squares past the dtype's range is inf, corrected or not (its correction would be inf
    # too, and inf - inf NaN: var of [1.5e30, 1e30, 1] in float32)
    s2 = c.tmp(s2)
    q = c.tmp(f"tl.where({s2} == float('inf'), {s2}, {s2} - {n} * {fix} * {fix})")
    # the corrected sum of squares rounds a hair below 0 on a row of one value; NaN stays NaN
    return f"{mu0} + {fix}", f"tl.where({q} < 0, 0.0, {q})"


def _m2_tile_of(c: EmitCtx, x: str, mask: str, count: str) -> tuple[str, ...]:
    # ``count + zeros``, not ``count.to(...)``: a size argument equal to 1 is a constexpr on the GPU
    n = c.tmp(f"({count}) + tl.zeros([1, 1], dtype={TRITON_TYPE[c.dtype]})")
    safe = c.tmp(f"tl.maximum({n}, 1.0)")
    # the corrected two-pass (Chan, Golub & LeVeque): the tile's mean, the deviations from it, and
    # the mean corrected by their sum. ``sum(x) / n`` can miss a row of one value by an ulp, which
    # a layer norm scales by ``1 / sqrt(eps)``; the corrected mean is that value exactly
    mu0 = c.tmp(f"{_tile_sum(c.tmp(_masked(mask, x, '0')))} / {safe}")
    d = c.tmp(_masked(mask, f"{x} - {mu0}", "0.0"))
    # both sums in one reduction tree: one pass through shared memory, as the tutorial's variance
    sums = c.tmp(f"tl.reduce(({d}, {d} * {d}), 1, {c.helper('add_pairs', ADD_PAIRS)})")
    return n, *_corrected(c, mu0, f"{sums}[0][:, None]", f"{sums}[1][:, None]", n, safe)


#: Welford / Chan: count, mean and sum of squared deviations; two-pass exact within a tile
M2 = ReduceSpec(
    state=("n", "mean", "m2"),
    identity=lambda dt: ("0.0", "0.0", "0.0"),
    lift=lambda c, x: ("1.0", x, "0.0"),
    tile=_m2_tile,
    merge=_m2_merge,
    value=lambda c, st: st[2],
    single=lambda c, x: f"({x} - {x}) * ({x} - {x})",
    of_values=False,
    tile_of=_m2_tile_of,
)

#: the mean Welford's state holds (``m2``'s twin: one state computed for both)
M2_MEAN = replace(M2, value=lambda c, st: st[1], single=lambda c, x: x)


def _reduction(
    name: str,
    ref,
    spec: ReduceSpec,
    derivative,
    text: str,
    *,
    accepts=ANY,
    eager_launches: int = 1,
    names: tuple[str, ...] = (),
    methods: tuple[str, ...] = (),
    torch_names: tuple[str, ...] = (),
    shape=_shape,
) -> OpDef:
    fn = reduction_fn(name, text)
    return register(
        OpDef(
            name=name,
            kind=OpKind.REDUCTION,
            arity=1,
            ref=ref,
            reduce=spec,
            derivative=derivative,
            shape=shape,
            canonical=lambda shapes, axis, keepdim: {"axis": norm_axes(axis, len(shapes[0])), "keepdim": keepdim},
            eager_launches=eager_launches,
            accepts=accepts,
            pattern=Pattern.REDUCTION,
            front=Front(
                fn=fn if names or methods or torch_names else None,
                names=names,
                methods=dict.fromkeys(methods),
                torch=dict.fromkeys(torch_fns(*torch_names), _torch_reduction(fn)),
            ),
        )
    )


def _torch_reduction(fn):
    """torch.sum(x, dim, keepdim) and friends; dtype=, out= and named dims run eagerly."""

    def build(a: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None, out: Any = None) -> Expr:
        if dtype is not None or out is not None:
            raise Unsupported
        if isinstance(dim, (list, tuple)):
            if not all(isinstance(d, int) for d in dim):
                raise Unsupported
            dim = tuple(dim)
        elif dim is not None and not isinstance(dim, int):
            raise Unsupported
        return fn(a, dim, keepdim)

    return build


def _extreme_derivative(d: D) -> tuple:
    """amax/amin: spread evenly over the elements equal to the result, both as eager holds them
    (a bf16 layer norm reduced by amax in another kernel: its values recomputed in fp32 matched
    none of the rounded maximum, and 0 / 0 made every gradient NaN; ties are eager's too)."""
    hit = node("cast", node("eq", d.as_eager_holds(d.a), d.as_eager_holds(d.y)), dtype=torch.float32)
    count = node("sum", hit, axis=d.n.attr("axis"), keepdim=True)
    return (node("div", node("mul", d.g, hit), count),)


def mean_of(x: Expr, axis: Any, keepdim: bool) -> Expr:
    return node("div", node("sum", x, axis=axis, keepdim=keepdim), node("rcount", x, axis=axis))


def deviations(x: Expr, axis: Any) -> tuple[Expr, Expr]:
    """``(x - mean, m2)`` over ``axis`` (kept), both off one Welford state (``m2_mean``, ``m2``):
    the norms' centred input and sum of squared deviations, exact (0) on a row of one value."""
    return (
        node("sub", x, node("m2_mean", x, axis=axis, keepdim=True)),
        node("m2", x, axis=axis, keepdim=True),
    )


def lse_shift(x: Expr, axis: Any) -> Expr:
    """logsumexp over ``axis`` (kept), the shift softmax, log_softmax and cross-entropy subtract,
    detached (``softmax_parts``).

    torch takes log_softmax first: a row whose logsumexp is +-inf or NaN (a +inf logit, only -inf
    ones, a NaN) is NaN at every element, value and gradient: ``finite_or_nan`` makes it so."""
    return node("finite_or_nan", node("logsumexp", x, axis=axis, keepdim=True))


def softmax_parts(x: Expr, axis: Any) -> tuple[Expr, Expr]:
    """``(x - c, sum(exp(x - c)))`` over ``axis`` (kept), ``c`` the row's rounded logsumexp
    (``lse_shift``, detached): softmax is ``exp(x - c) / total``, log_softmax ``(x - c) - log(total)``.

    ``c`` is only a shift: the total is 1 up to its rounding, and dividing by it makes every row
    exact whatever ``c`` holds. A row of equal values far from zero (``masked_fill(mask, -1e9)``
    over a whole row, Hugging Face's ``finfo.min`` padding) has ``c`` equal to them (``log n`` lies
    under their spacing), so ``exp(x - c)`` is 1 everywhere and the total n: the uniform row torch
    gives, where ``exp(x - c)`` alone would be 1 per element. The total is the logsumexp's own
    state (``softmax_sum``): no second pass over the row."""
    return node("sub", x, node("detach", lse_shift(x, axis))), node("softmax_sum", x, axis=axis, keepdim=True)


def softmax_of(e: Expr) -> tuple[Expr, Expr] | None:
    """``(exp(x - c), total)`` where ``e`` is ``exp(x - c) * (1 / total)`` as ``softmax_parts``
    builds a softmax (either order), ``total = softmax_sum(x)``; else None."""
    if e.op != "mul":
        return None
    for u, r in (e.srcs, e.srcs[::-1]):
        if u.op == "exp" and u.srcs[0].op == "sub" and r.op == "reciprocal" and r.srcs[0].op == "softmax_sum":
            if u.srcs[0].srcs[0] is r.srcs[0].srcs[0]:
                return u, r.srcs[0]
    return None


def factors(node: Any) -> tuple[Any, ...]:
    """The operands of a product (an ``Expr`` or a kernel's node spec), () for any other node."""
    return tuple(node.srcs) if node.op == "mul" else ()


def reciprocal_of(node: Any) -> Any:
    """The operand ``y`` of ``1 / y`` (an ``Expr`` or a kernel's node spec), None for any other node."""
    return node.srcs[0] if node.op == "reciprocal" else None


def exp_of_logsumexp(node: Any, node_at: Any) -> tuple[Any, int, Any] | None:
    """``exp(x - lse)`` with ``lse = logsumexp(x)`` (bare, guarded by ``finite_or_nan`` as softmax
    writes it, or cast as a saved statistic is): ``(x, lse's node index, the subtrahend)``, refs as
    ``node.srcs`` holds them; None for any other node. ``node_at(ref)`` is ``(index, node)`` for a
    node's ref, else None. A writer that reduced ``lse`` whole computes the exp from the
    reduction's own tile, times ``exp(shift - subtrahend)``: exact whatever the subtrahend holds."""
    sub = node_at(node.srcs[0]) if node.op == "exp" else None
    if sub is None or sub[1].op != "sub":
        return None
    x, y = sub[1].srcs
    red = node_at(y)
    while red is not None and red[1].op in ("finite_or_nan", "cast", "detach"):
        red = node_at(red[1].srcs[0])
    if red is None or red[1].op != "logsumexp" or red[1].srcs[0] != x:
        return None
    return x, red[0], y


def exp_of_shift(node: Any, node_at: Any) -> tuple[Any, Any] | None:
    """``exp(x - detach(c))``: an exp of a value less a detached shift, the idiom every softmax and
    logsumexp here is written in (``c`` its row's max or logsumexp: the value at most 1), among
    them a backward's probabilities recomputed from a saved logsumexp (attention's dQ and dK):
    ``(x, the subtrahend)``, refs as ``node.srcs`` holds them; None for any other node. A writer
    computes it as :func:`exp_below` does (flush-to-zero ``exp2``: the same value but under
    2**-126, which it gives as 0; 3 instructions per element fewer than ``tl.exp`` on sm_90)."""
    sub = node_at(node.srcs[0]) if node.op == "exp" else None
    if sub is None or sub[1].op != "sub":
        return None
    x, y = sub[1].srcs
    shift = node_at(y)
    return (x, y) if shift is not None and shift[1].op == "detach" else None


_reduction(
    "sum",
    lambda x, axis, keepdim: torch.sum(x, dim=_dims(axis), keepdim=keepdim),
    SUM,
    lambda d: (d.g,),
    "Sum (ints accumulate in int64, half types in fp32)",
    names=("sum",),
    methods=("sum",),
    torch_names=("sum",),
)
_reduction(
    "amax",
    lambda x, axis, keepdim: torch.amax(x, dim=_dims(axis), keepdim=keepdim),
    _extreme_spec("max", lowest, nan_max),
    _extreme_derivative,
    "Maximum (NaN wins); values only, like torch.amax",
    accepts=NUMERIC | {"bool"},
    names=("amax", "max"),
    methods=("amax", "max"),
    torch_names=("amax",),
    shape=_nonempty_shape("amax"),
)
_reduction(
    "amin",
    lambda x, axis, keepdim: torch.amin(x, dim=_dims(axis), keepdim=keepdim),
    _extreme_spec("min", highest, nan_min),
    _extreme_derivative,
    "Minimum (NaN wins); values only, like torch.amin",
    accepts=NUMERIC | {"bool"},
    names=("amin", "min"),
    methods=("amin", "min"),
    torch_names=("amin",),
    shape=_nonempty_shape("amin"),
)
# eager logsumexp: amax, masked fill, sub, exp, sum, log, add
_reduction(
    "logsumexp",
    lambda x, axis, keepdim: torch.logsumexp(x, dim=_all_if_none(axis, x.ndim), keepdim=keepdim),
    LOGSUMEXP,
    lambda d: (node("mul", d.g, node("exp", node("sub", d.a, d.y))),),
    "log(sum(exp(x))), computed online in one pass",
    accepts=ANY,
    eager_launches=7,
    names=("logsumexp",),
    methods=("logsumexp",),
    torch_names=("logsumexp",),
)


def _softmax_sum_value(c: EmitCtx, st: tuple[str, ...]) -> str:
    # the state's sum taken at the shift a softmax subtracts, ``finite_or_nan(m + log(s))``
    lse = c.tmp(f"{st[0]} + tl.log({st[1]})")
    return f"{st[1]} * tl.exp({st[0]} - ({lse} + ({lse} - {lse})))"


def _softmax_sum_of_pieces(totals: Expr, lses: Expr, lse: Expr) -> Expr:
    """``softmax_sum`` of the whole from its pieces' (stacked along axis 0, with their logsumexps
    ``lses`` and the whole's ``lse``): each piece's total, taken at its own rounded logsumexp,
    rescaled to the whole's, ``sum_i total_i * exp(lse_i - c)``; a piece of no mass (its logsumexp
    -inf) adds 0, a NaN or +inf one makes it NaN, as the whole's would."""
    # the pieces' logsumexps only shift (detached): the gradient is each total's, exp(x - c_i) * exp(c_i - c)
    c = node("detach", node("finite_or_nan", lse))
    scaled = node("mul", totals, node("exp", node("sub", node("detach", lses), c)))
    return node("sum", node("where", node("eq", lses, float("-inf")), 0.0, scaled), axis=(0,), keepdim=False)


#: sum(exp(x - c)) for ``c = lse_shift(x)``: logsumexp's state, read off at its own rounded value;
#: pieces of a row (a vocabulary split across ranks) merge beside their logsumexps
SOFTMAX_SUM = replace(
    LOGSUMEXP,
    value=_softmax_sum_value,
    single=lambda c, x: f"1.0 + ({x} - {x})",
    of_values=False,
    merged_with=("logsumexp", _softmax_sum_of_pieces),
)


def _softmax_sum_ref(x: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    lse = torch.logsumexp(x, dim=dims, keepdim=True).detach()  # a shift: see _softmax_sum_derivative
    return torch.exp(x - (lse + (lse - lse))).sum(dim=dims, keepdim=keepdim)


def _softmax_sum_derivative(d: D) -> tuple[Expr]:
    # the shift is detached: d/dx sum(exp(x - c)) = exp(x - c), the very exp the softmax computes
    lse = node("logsumexp", d.a, axis=d.n.attr("axis"), keepdim=True)
    return (node("mul", d.g, node("exp", node("sub", d.a, node("detach", node("finite_or_nan", lse))))),)


_reduction(
    "softmax_sum",
    lambda x, axis, keepdim: _softmax_sum_ref(x, _all_if_none(axis, x.ndim), keepdim),
    SOFTMAX_SUM,
    _softmax_sum_derivative,
    "sum(exp(x - logsumexp(x))) as softmax divides by it: 1 up to the logsumexp's rounding",
)
_reduction(
    "m2",
    lambda x, axis, keepdim: (
        torch.var(x, dim=_all_if_none(axis, x.ndim), correction=0, keepdim=keepdim)
        * math.prod(x.shape[a] for a in norm_axes(axis, x.ndim))
    ),
    M2,
    lambda d: (node("mul", node("mul", d.g, 2.0), deviations(d.a, d.n.attr("axis"))[0]),),
    "Sum of squared deviations from the mean (Welford)",
    accepts=FLOATING,
    eager_launches=2,
)
_reduction(
    "m2_mean",
    lambda x, axis, keepdim: torch.mean(x, dim=_all_if_none(axis, x.ndim), keepdim=keepdim),
    M2_MEAN,
    lambda d: (node("div", d.g, node("rcount", d.a, axis=d.n.attr("axis"))),),
    "The mean as Welford's state holds it: the norms' mean, computed with their m2",
    accepts=FLOATING,
)


def rcount_value(x: Any, axis: Any) -> float:
    """How many elements a reduction over ``axis`` combines (a per-call kernel argument)."""
    if not hasattr(x, "shape") or not x.shape:
        return 1.0
    return float(math.prod(x.shape[a] for a in norm_axes(axis, len(x.shape))))


#: the number of elements reduced over ``axis`` (a scalar argument)
register(
    OpDef(
        name="rcount",
        kind=OpKind.SCALAR,
        arity=1,
        eager_launches=0,
        accepts=ANY,
        ref=rcount_value,
    )
)

#: the machine epsilon of the dtype the operand is computed in (rms_norm's eps=None, as torch)
register(
    OpDef(
        name="eps_of",
        kind=OpKind.SCALAR,
        arity=1,
        eager_launches=0,
        accepts=ANY,
        # torch takes the epsilon of the dtype it computes in: float32 for fp16 / bf16 (and ints)
        ref=lambda x: float(torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps),
    )
)

#: what a reduction over no dims (a 0-dim operand) is, per op: the operand itself, or m2's 0
SINGLE = {
    "m2": lambda x: node("mul", node("sub", x, x), node("sub", x, x)),
    # exp(x - x) with the shift detached: 1, NaN where x is not finite, its derivative softmax's
    "softmax_sum": lambda x: node("exp", node("sub", x, node("detach", node("finite_or_nan", x)))),
}
