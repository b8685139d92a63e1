"""Every op's torch reference against its kernel and torch itself (issue 33 follow-ups).

A kernel's result is typed by its ops' references: binding runs each reference on one-element
probes (or, where probes cannot tell, an op's own dtype rule), and inside ``torch.compile`` the
op's fake *is* the reference run on fake tensors. So for every op in the registry, on a
representative input:

* over the float dtype mixes of its operands, ``rx.compile(expr)(...)`` returns the dtype and
  shape ``kernel.reference(...)`` does, and, where torch has the op, torch's own call does; where
  the reference raises, the kernel raises too (a fake that raises fails torch.compile where the
  eager call runs). PolyNorm with bf16 ``x`` and fp32 weights returned fp32 where torch (and
  Liger's kernel) give bf16: a dtype rule promoted the 0-dim weights ``w[k]`` as tensors.
* the reference runs on fake tensors, at fixed and at symbolic sizes, as torch.compile runs it:
  no ``.item()``, ``int(tensor)``, ``.tolist()`` or branching on values (TVD's ``int(valid.sum())``
  failed ``rx.nn.TVDLoss`` with labels under torch.compile; gather's range check read the index).

The kernels are called with ``FusionConfig(dry_run=True)``: all host work of a call (planning,
code generation, the outputs allocated as a launch returns them), no launch: the interpreter
would take ~0.1 s per call, and a launch writes values, never a dtype or shape.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import rtxdsl as rx
from rtxdsl.expr import Expr, node, walk
from rtxdsl.ops import FLOAT, REGISTRY, OpKind

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
x, y, w, b, t = (rx.var(n) for n in "xywbt")
DRY = rx.FusionConfig(dry_run=True)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


@dataclass(frozen=True)
class Case:
    """An expression over named inputs (float ones given in fp64, cast to each dtype mix), and
    ``torch_fn``: the op as torch computes it (or, for an op torch lacks, the library that
    defines it), over the kernel's inputs in order."""

    id: str
    expr: Expr
    inputs: dict[str, torch.Tensor]
    torch_fn: Callable[..., Any] | None = None


# ---- generic cases: an op's kind and arity say how to call it ---------------------------------------
X, Y = _randn(4, 6, seed=1), _randn(6, seed=2)  # a row-major operand and one broadcast against it
INTS, SMALL = torch.tensor([[3, -2, 0], [7, 1, -5]]), torch.tensor([1, 2, 3], dtype=torch.int32)


def _torch_function(op: str) -> Callable[..., Any] | None:
    """The first plain ``torch.<fn>`` (or ``F.<fn>``) the lazy stream records as ``op``."""
    for fn in REGISTRY[op].front.torch:
        if getattr(torch, getattr(fn, "__name__", ""), None) is fn or getattr(F, getattr(fn, "__name__", ""), 0) is fn:
            return fn
    return None


def _generic(op: str) -> list[Case]:
    d = REGISTRY[op]
    fn = _torch_function(op)
    floats = FLOAT in d.accepts
    if d.kind is OpKind.ELEMENTWISE and d.arity == 1:
        return [Case(op, node(op, x), {"x": X if floats else INTS}, fn and (lambda x: fn(x)))]
    if d.kind is OpKind.ELEMENTWISE and d.arity == 2:
        ins = {"x": X, "y": Y} if floats else {"x": INTS, "y": SMALL}
        return [Case(op, node(op, x, y), ins, fn and (lambda x, y: fn(x, y)))]
    if d.kind is OpKind.REDUCTION:
        by_torch = fn and (lambda x: fn(x, dim=-1, keepdim=False))
        return [Case(op, node(op, x, axis=(-1,), keepdim=False), {"x": X}, by_torch)]
    return []


# ---- every other op: its own cases -------------------------------------------------------------------
def _liger_poly_norm(x: torch.Tensor, w: torch.Tensor, b: Any, eps: float = 1e-6) -> torch.Tensor:
    """PolyNorm as Liger-Kernel's tests (and PolyCom) define it: 0-dim weights ``w[k]``, a bias."""

    def norm(u: torch.Tensor) -> torch.Tensor:
        return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)

    return w[0] * norm(x**3) + w[1] * norm(x**2) + w[2] * norm(x) + b


def _hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face Llama's apply_rotary_pos_emb for one tensor (rotate_half)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


LABELS = torch.tensor([0, -100, 2, 1])  # per row of X: one ignored
TARGETS = torch.tensor([0, 5, 2, 1])
LOGP, LOGQ = torch.log_softmax(X, -1), torch.log_softmax(X.flip(0), -1)


def _elementwise_cases() -> list[Case]:
    pairs = {"x": X, "y": X.flip(0)}
    return [
        Case("gelu", rx.gelu(x), {"x": X}, F.gelu),
        Case("gelu-tanh", rx.gelu(x, "tanh"), {"x": X}, lambda x: F.gelu(x, approximate="tanh")),
        Case("leaky_relu", rx.leaky_relu(x, 0.2), {"x": X}, lambda x: F.leaky_relu(x, 0.2)),
        Case("elu", rx.elu(x, 0.5), {"x": X}, lambda x: F.elu(x, 0.5)),
        Case("softplus", rx.softplus(x, 2.0, 1.0), {"x": X}, lambda x: F.softplus(x, 2.0, 1.0)),
        Case("where", rx.where(x > y, x, y), pairs, lambda x, y: torch.where(x > y, x, y)),
        Case("where-0-dim", rx.where(x > 0.0, x, y), {"x": X, "y": _randn()}, lambda x, y: torch.where(x > 0, x, y)),
        Case("pow-python-exponent", x**3.0, {"x": X}, lambda x: torch.pow(x, 3.0)),
        Case("cast", rx.cast(x, F32), {"x": X}, lambda x: x.to(F32)),
        Case("cast-bf16", rx.cast(x, BF16), {"x": X}, lambda x: x.to(BF16)),
        Case("add-0-dim", x + y, {"x": X, "y": _randn()}, torch.add),
        Case("invert-bool", ~(x > 0.0), {"x": X}, lambda x: ~(x > 0)),
    ]


def _row_cases() -> list[Case]:
    affine = {"x": X, "w": _randn(6, seed=3), "b": _randn(6, seed=4)}
    groups = {"x": _randn(3, 4, 2, seed=5), "w": _randn(4, seed=3), "b": _randn(4, seed=4)}
    poly = {"x": X, "w": _randn(3, seed=3)}
    return [
        Case("mean", rx.mean(x, -1), {"x": X}, lambda x: torch.mean(x, -1)),
        Case("variance", rx.variance(x, -1), {"x": X}, lambda x: torch.var(x, -1)),
        Case("std", rx.std(x, -1), {"x": X}, lambda x: torch.std(x, -1)),
        Case("softmax", rx.softmax(x), {"x": X}, lambda x: torch.softmax(x, -1)),
        Case("log_softmax", rx.log_softmax(x), {"x": X}, lambda x: torch.log_softmax(x, -1)),
        Case("layer_norm", rx.layer_norm(x, w, b), affine, lambda x, w, b: F.layer_norm(x, (6,), w, b)),
        Case("layer_norm-no-affine", rx.layer_norm(x), {"x": X}, lambda x: F.layer_norm(x, (6,))),
        Case("rms_norm", rx.rms_norm(x, w), affine, lambda x, w: F.rms_norm(x, (6,), w, 1e-6)),
        Case("rms_norm-eps_of", node("rms_norm", x, w, node("eps_of", x)), affine, lambda x, w: F.rms_norm(x, (6,), w)),
        Case("group_norm", rx.group_norm(x, 2, w, b), groups, lambda x, w, b: F.group_norm(x, 2, w, b)),
        Case("group_norm-weight", rx.group_norm(x, 2, w), groups, lambda x, w: F.group_norm(x, 2, w)),
        # rx.nn.PolyNorm's 0-dim bias, a [1] bias and a python number
        Case("poly_norm", rx.poly_norm(x, w, b), poly | {"b": _randn(seed=4)}, _liger_poly_norm),
        Case("poly_norm-1-bias", rx.poly_norm(x, w, b), poly | {"b": _randn(1, seed=4)}, _liger_poly_norm),
        Case("poly_norm-python-bias", rx.poly_norm(x, w, 0.1), poly, lambda x, w: _liger_poly_norm(x, w, 0.1)),
        Case("sparsemax", rx.sparsemax(x), {"x": X}),
        Case("swiglu", rx.swiglu(x, y), {"x": X, "y": X.flip(0)}, lambda x, y: F.silu(x) * y),
        Case("geglu", rx.geglu(x, y, "tanh"), {"x": X, "y": X.flip(0)}, lambda x, y: F.gelu(x, approximate="tanh") * y),
        Case("clamp", rx.clamp(x, -0.5, 0.5), {"x": X}, lambda x: torch.clamp(x, -0.5, 0.5)),
        Case("clamp-tensors", rx.clamp(x, y, w), {"x": X, "y": -Y.abs(), "w": Y.abs()}, torch.clamp),
        Case("clamp_min", rx.clamp(x, y), {"x": X, "y": Y}, lambda x, y: torch.clamp(x, min=y)),
        Case("clamp_max", rx.clamp(x, None, y), {"x": X, "y": Y}, lambda x, y: torch.clamp(x, max=y)),
        Case("dyt", rx.dyt(x, y, w, b), affine | {"y": _randn(1, seed=5)}),
        Case("relu_squared", rx.relu_squared(x), {"x": X}, lambda x: torch.relu(x) ** 2),
        Case("rcount", x / node("rcount", x, axis=(-1,)), {"x": X}, lambda x: x / x.shape[-1]),
    ]


def _product_cases() -> list[Case]:
    h, vocab = _randn(4, 3, seed=6), _randn(6, 3, seed=7)
    return [
        Case("matmul", rx.matmul(x, y), {"x": X, "y": _randn(6, 2, seed=8)}, torch.matmul),
        Case("contract", rx.contract(x, y, tb=True), {"x": X, "y": _randn(2, 6, seed=8)}, lambda x, y: x @ y.mT),
        Case("linear", rx.linear(x, w, b), {"x": h, "w": vocab, "b": _randn(6, seed=9)}, F.linear),
        Case(
            "linear_cross_entropy",
            rx.linear_cross_entropy(x, w, t, label_smoothing=0.1),
            {"x": h, "w": vocab, "t": LABELS},
            lambda x, w, t: F.cross_entropy(F.linear(x, w), t, label_smoothing=0.1),
        ),
        Case(
            "linear_logps",
            rx.linear_logps(x, w, t, b),
            {"x": h, "w": vocab, "t": LABELS, "b": _randn(6, seed=9)},
            lambda x, w, t, b: (
                -F.cross_entropy(F.linear(x, w, b).to(torch.promote_types(x.dtype, F32)), t, reduction="none")
            ),
        ),
        Case(
            "linear_logps-temperature",
            rx.linear_logps(x, w, t, temperature=0.7),
            {"x": h, "w": vocab, "t": LABELS},
            lambda x, w, t: (
                -F.cross_entropy(F.linear(x, w).to(torch.promote_types(x.dtype, F32)) / 0.7, t, reduction="none")
            ),
        ),
        Case(
            "linear_logits",
            rx.linear_logits(x, w, b, temperature=2.0),
            {"x": h, "w": vocab, "b": _randn(6, seed=9)},
            lambda x, w, b: F.linear(x, w, b).to(torch.promote_types(x.dtype, F32)) / 2.0,
        ),
        Case(
            "attention",
            rx.attention(x, y, w, causal=True, enable_gqa=True),
            {"x": _randn(1, 4, 5, 3, seed=11), "y": _randn(1, 2, 7, 3, seed=12), "w": _randn(1, 2, 7, 2, seed=13)},
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        ),
    ]


def _loss_cases() -> list[Case]:
    cls_weight = _randn(6, seed=10).abs()
    probs = torch.softmax(X.flip(0), -1)
    ce = [
        ("cross_entropy", {}, LABELS),
        ("cross_entropy-sum-smoothed", {"reduction": "sum", "label_smoothing": 0.1}, LABELS),
        ("cross_entropy-none", {"reduction": "none"}, TARGETS),
    ]
    cases = [Case(i, rx.cross_entropy(x, t, **kw), {"x": X, "t": tg}, lambda x, t, kw=kw: F.cross_entropy(x, t, **kw))
             for i, kw, tg in ce]  # fmt: skip
    cases += [
        Case("cross_entropy-z_loss", rx.cross_entropy(x, t, z_loss=0.01), {"x": X, "t": LABELS}),
        Case(
            "cross_entropy-weighted",
            rx.cross_entropy(x, t, w),
            {"x": X, "t": LABELS, "w": cls_weight},
            lambda x, t, w: F.cross_entropy(x, t, w),
        ),
        Case(
            "cross_entropy-probabilities",
            rx.cross_entropy(x, y),
            {"x": X, "y": probs},
            lambda x, y: F.cross_entropy(x, y),
        ),
        Case("z_loss_term", rx.z_loss_term(x, t, 0.01), {"x": X, "t": LABELS}),
        Case("token_accuracy", rx.token_accuracy(x, t), {"x": X, "t": LABELS}),
        Case(
            "predicted_tokens",
            rx.predicted_tokens(x, t),
            {"x": X, "t": LABELS},
            lambda x, t: torch.where(t != -100, x.argmax(-1), -1),
        ),
        Case(
            "kl_div",
            rx.kl_div(x, y, "batchmean"),
            {"x": LOGQ, "y": probs},
            lambda x, y: F.kl_div(x, y, reduction="batchmean"),
        ),
        Case(
            "kl_div-log-target",
            rx.kl_div(x, y, "none", log_target=True),
            {"x": LOGQ, "y": LOGP},
            lambda x, y: F.kl_div(x, y, reduction="none", log_target=True),
        ),
        Case("jsd", rx.jsd(x, y, beta=0.3), {"x": LOGQ, "y": LOGP}),
        Case("jsd-labels", rx.jsd(x, y, t), {"x": LOGQ, "y": LOGP, "t": LABELS}),
    ]
    for reduction in ("batchmean", "mean", "sum", "none"):
        ins = {"x": LOGQ.exp(), "y": LOGP.exp(), "t": LABELS}
        cases.append(Case(f"tvd-labels-{reduction}", rx.tvd(x, y, t, reduction), ins))
    cases.append(Case("tvd", rx.tvd(x, y), {"x": LOGQ.exp(), "y": LOGP.exp()}))
    return cases


def _rope_cases() -> list[Case]:
    q, cos, sin = _randn(2, 3, 4, 6, seed=11), _randn(4, 6, seed=12), _randn(4, 6, seed=13)
    tables = {"y": _randn(3, 2, 4, 6, seed=12), "w": _randn(3, 2, 4, 6, seed=13)}
    return [
        Case("rope", rx.rope(x, y, w), {"x": q, "y": cos, "w": sin}, _hf_rope),
        Case("rope-interleaved", rx.rope(x, y, w, interleaved=True), {"x": q, "y": cos, "w": sin}),
        Case("mrope", rx.mrope(x, y, w, (1, 1, 1)), {"x": q} | tables),
    ]


def _movement_cases() -> list[Case]:
    index = torch.tensor([[0, 5, 5], [1, 2, 1], [3, 3, 3], [5, 4, 0]])
    both = {"x": X, "y": X.flip(0)}
    return [
        Case("unsqueeze", node("unsqueeze", x, axes=(0,)), {"x": X}, lambda x: torch.unsqueeze(x, 0)),
        Case("expand", node("expand", x, shape=(3, 6)), {"x": Y}, lambda x: x.expand(3, 6)),
        Case("slice", node("slice", x, axis=1, start=1, stop=None, step=2), {"x": X}, lambda x: x[:, 1::2]),
        Case("unslice", node("unslice", x, axis=1, start=1, step=2, size=8), {"x": X[:, :3]}),
        Case("flip", rx.flip(x, -1), {"x": X}, lambda x: torch.flip(x, (-1,))),
        Case("permute", rx.permute(x, (1, 0)), {"x": X}, lambda x: torch.permute(x, (1, 0))),
        Case("transpose", rx.transpose(x, 0, 1), {"x": X}, lambda x: torch.transpose(x, 0, 1)),
        Case("reshape", rx.reshape(x, (3, 8)), {"x": X}, lambda x: torch.reshape(x, (3, 8))),
        Case("narrow", rx.narrow(x, -1, 1, 3), {"x": X}, lambda x: torch.narrow(x, -1, 1, 3)),
        Case("cat", rx.cat([x, y], -1), both, lambda x, y: torch.cat([x, y], -1)),
        Case("stack", rx.stack([x, y], 0), both, lambda x, y: torch.stack([x, y], 0)),
        Case("select", node("select", x, axis=0, index=3), {"x": X}, lambda x: x[3]),
        Case("gather", rx.gather(x, t, -1), {"x": X, "t": index}, lambda x, t: torch.gather(x, -1, t)),
        Case("arange_like", rx.arange_like(x, -1) * x, {"x": X}, lambda x: torch.arange(6) * x),
        Case("rand_like", rx.rand_like(x, seed=3), {"x": X}, torch.rand_like),
        Case("rand_like-drawn-seed", rx.rand_like(x) + x, {"x": X}, lambda x: torch.rand_like(x) + x),
        Case("dropout", rx.dropout(x, 0.5, seed=3), {"x": X}, lambda x: torch.dropout(x, 0.5, True)),
    ]


#: ops no expression can hold on its own, and why
SKIP = {
    "var": "a leaf: the input itself",
    "const": "a leaf: a python number",
    "attention_slot": "a placeholder inside a score_mod / mask_mod template, never an expression's own node",
}

OWN = [*_elementwise_cases(), *_row_cases(), *_product_cases(), *_loss_cases(), *_rope_cases(), *_movement_cases()]
_OWNED = {c.id for c in OWN}  # an op with a case of its own id needs no generic one
CASES = OWN + [c for d in REGISTRY.values() if d.name not in _OWNED and d.name not in SKIP for c in _generic(d.name)]


def test_every_op_has_a_case_and_torchs_own_where_torch_has_it():
    """A new op is covered as it is declared: generically (elementwise ops and reductions by arity),
    by a case of its own here, or it says why not; an op the lazy stream records from a torch
    function is compared with that function."""
    covered = {n.op for c in CASES for n in walk([c.expr])}
    missing = [d.name for d in REGISTRY.values() if d.name not in covered and d.name not in SKIP]
    assert not missing, f"no reference case for {missing}: add one (or a reason to SKIP)"
    against_torch = {c.expr.op for c in CASES if c.torch_fn is not None}
    untested = [d.name for d in REGISTRY.values() if d.front.torch and d.name not in against_torch]
    assert not untested, f"torch has {untested}, but no case compares with it: give a case its torch_fn"
    assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


# ---- dtype mixes -----------------------------------------------------------------------------------
PAIRS = [(BF16, F32), (F16, F32), (BF16, F16)]


def dtype_mixes(n: int) -> list[tuple[torch.dtype, ...]]:
    """Every operand in one dtype (fp64 too), then for n > 1, each pair of fp32 / fp16 / bf16 with one
    operand in one and the rest in the other, both ways."""
    mixes = [(d,) * n for d in (F32, F16, BF16, F64)]
    for (a, c), i in itertools.product(PAIRS, range(n if n > 1 else 0)):
        for one, rest in ((a, c), (c, a)):
            mix = tuple(one if j == i else rest for j in range(n))
            if mix not in mixes:
                mixes.append(mix)
    return mixes


def _inputs(case: Case, kernel: rx.Kernel, mix: tuple[torch.dtype, ...]) -> tuple[torch.Tensor, ...]:
    floats = iter(mix)
    return tuple(
        case.inputs[n].to(next(floats)) if case.inputs[n].is_floating_point() else case.inputs[n] for n in kernel.inputs
    )


def _float_inputs(case: Case, kernel: rx.Kernel) -> int:
    return sum(case.inputs[n].is_floating_point() for n in kernel.inputs)


def _outcome(fn: Callable[[], Any]) -> Any:
    """``fn()``'s (dtype, shape) per output, or the exception it raised."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = fn()
    except Exception as exc:  # noqa: BLE001 - compared, and named in the failure
        return exc
    outs = out.values() if isinstance(out, dict) else [out]
    return [(o.dtype, tuple(int(s) for s in o.shape)) for o in outs]  # a symbolic size by its hint


def _same(got: Any, want: Any) -> bool:
    return isinstance(want, Exception) == isinstance(got, Exception) and (isinstance(want, Exception) or got == want)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_kernels_result_is_typed_as_its_reference_and_torch(case):
    """For every dtype mix of its float operands: the kernel's result dtype and shape are the
    reference's, and torch's own where torch has the op; where they raise, the kernel does."""
    kernel = rx.compile(case.expr, DRY)
    wrong = []
    for mix in dtype_mixes(_float_inputs(case, kernel)):
        args = _inputs(case, kernel, mix)
        want = _outcome(lambda: kernel.reference_on(args))
        got = _outcome(lambda: kernel(*args))
        named = dict(zip(kernel.inputs, args))
        torchs = None if case.torch_fn is None else _outcome(lambda: case.torch_fn(*args))
        mixed = ", ".join(f"{n}={str(a.dtype)[6:]}" for n, a in named.items())
        if not _same(got, want):
            wrong.append(f"{mixed}: the kernel gives {got!r}, its reference {want!r}")
        if torchs is not None and not _same(want, torchs):
            wrong.append(f"{mixed}: the reference gives {want!r}, torch {torchs!r}")
        if isinstance(got, Exception) and not isinstance(got, rx.RtxError):
            wrong.append(f"{mixed}: the kernel raised {got!r}, not an RtxError")
    assert not wrong, f"{case.id}:\n" + "\n".join(wrong)


# ---- fake tensors ----------------------------------------------------------------------------------
def _fakes(mode: FakeTensorMode, args: tuple[torch.Tensor, ...], symbolic: bool) -> tuple[torch.Tensor, ...]:
    if not symbolic:
        return tuple(mode.from_tensor(a) for a in args)
    dynamic = [StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * a.dim()) for a in args]
    return tuple(mode.from_tensor(a, symbolic_context=c) for a, c in zip(args, dynamic))


@pytest.mark.parametrize("symbolic", [False, True], ids=["fixed-sizes", "symbolic-sizes"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_reference_runs_on_fake_tensors(case, symbolic):
    """``Kernel.reference_on`` on fake tensors, as the fake of ``rtxdsl::kernel`` runs it inside
    torch.compile (``dynamic=True``: symbolic sizes): the dtypes and shapes of the reference on the
    real tensors, with no data read (``.item()``, ``int(t)``, ``.tolist()`` and branching on values
    raise ``DataDependentOutputException`` here, as they break a compiled graph). The operands are
    fp32 and bf16 (each op's first two float operands apart)."""
    kernel = rx.compile(case.expr)
    n = _float_inputs(case, kernel)
    for mix in [(F32,) * n, *([(BF16, *(F32,) * (n - 1))] if n > 1 else [])]:
        args = _inputs(case, kernel, mix)
        want = _outcome(lambda: kernel.reference_on(args))
        if isinstance(want, Exception):  # torch raises (a matmul of two dtypes): its fakes need not
            continue
        mode = FakeTensorMode(shape_env=ShapeEnv() if symbolic else None)

        def on_fakes():
            with mode:
                return kernel.reference_on(_fakes(mode, args, symbolic))

        got = _outcome(on_fakes)
        assert _same(got, want), (
            f"{case.id} with {[str(d)[6:] for d in mix]}: fakes give {got!r}, real tensors {want!r}"
        )
