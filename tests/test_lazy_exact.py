"""The lazy stream is eager-exact: every numbered defect of issue 21 as a program run both ways,
then the differential fuzzer (``tests/lazy_fuzz.py``) with a seed taken from the commit.

Each case is straight-line torch text over inputs ``t0, t1, ...`` that the lazy run wraps
(``x0 = L(t0)``): every name it binds and every input must agree with eager in dtype, shape and
value, and a line must raise in lazy exactly when it raises in eager.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import commit_seed
from lazy_fuzz import ACCEPTED, Program, _deferred, _differ, check, generate

import rtxdsl as rx

F32 = "t0 = torch.arange(6.0).reshape(2, 3) - 2.5"
F32_1D = "t0 = torch.tensor([1.0, -2.0, 3.0])"
CASES = {
    # 1. torch.narrow is a view, as Tensor.narrow is
    "01_torch_narrow": ([F32], ["torch.narrow(x0, 0, 1, 1).mul_(10)"]),
    # 2. ops that return self (or an alias) in eager return the same value
    "02_float_is_self": ([F32], ["x0.float().add_(10)"]),
    "02_to_same_dtype": ([F32], ["x0.to(x0.dtype).add_(10)", "v = x0 * 2", "v.to(torch.float32).mul_(3)"]),
    "02_eval_dropout": ([F32], ["F.dropout(x0, 0.5, training=False).add_(1)", "F.dropout(x0, 0.0).mul_(2)"]),
    "02_dropout_module": ([F32], ["torch.nn.Dropout().eval()(x0).sub_(1)"]),
    "02_clone_copies": ([F32], ["v = x0.clone()", "v.add_(1)", "w = (x0 * 2).clone()", "w.mul_(3)"]),
    # 3. in-place ops the stream does not record flush their pending readers first
    "03_zero_": ([F32], ["s = x0 * 2", "x0.zero_()"]),
    "03_fill_copy_": ([F32, "t1 = torch.ones(3)"], ["s = x0 * 2", "x0.fill_(3.0)", "u = x0 + 1", "x0.copy_(x1)"]),
    "03_masked_lerp_addcmul": (
        [F32, "t1 = torch.full((2, 3), 0.5)"],
        [
            "s = x0 * 2",
            "x0.masked_fill_(x0 > 0, 1.0)",
            "r = x0 + 1",
            "x0.lerp_(x1, 0.3)",
            "q = x0 - 1",
            "x0.addcmul_(x1, x1, value=2)",
            "x0.clamp_min_(0.1)",
        ],
    ),  # fmt: skip
    "03_logical_not_": (["t0 = torch.tensor([True, False, True])"], ["s = x0 & True", "x0.logical_not_()"]),
    "03_remainder_": ([F32], ["s = x0 * 2", "x0.remainder_(2)"]),
    "03_torch_inplace_fns": (
        [F32],
        [
            "s = x0 * 2",
            "torch.sigmoid_(x0)",
            "r = x0 + 0",
            "torch.relu_(x0)",
            "q = x0 * 1.5",
            "torch.clamp_(x0, 0.1, 0.6)",
        ],
    ),
    "03_threshold_": ([F32], ["s = x0 * 2", "F.threshold_(x0, 0.1, 20.0)"]),
    "03_itruediv": ([F32], ["s = x0 * 2", "x0 /= 4", "r = x0 + 1"]),
    # 4. inplace=True is honoured
    "04_leaky_relu_inplace": ([F32], ["v = F.leaky_relu(x0, 0.25, inplace=True)", "w = x0 * 1"]),
    "04_elu_inplace": ([F32], ["v = F.elu(x0, inplace=True)", "w = x0 * 1"]),
    # 5. recorded views of a pending value alias it
    "05_unsqueeze_fill": ([F32_1D], ["a = x0 * 2", "u = a.unsqueeze(0)", "u.fill_(7.)"]),
    "05_base_write_seen_by_view": ([F32_1D], ["a = x0 * 2", "u = a.unsqueeze(0)", "a.add_(1.)", "w = u * 1"]),
    "05_view_of_view": ([F32], ["a = x0 * 2", "u = a.unsqueeze(0)[0].t()", "u.mul_(5.)", "w = a + 0"]),
    # 6. a plain write to a plain tensor that a pending op reads is a sync point
    "06_plain_write": ([F32_1D, "p = torch.ones(3)"], ["s = x0 + p", "p.mul_(0.5)"]),
    "06_plain_write_view": ([F32_1D, "p = torch.ones(3)"], ["s = x0 + p", "p.view(-1)[0] = 9.0", "p[1:].zero_()"]),
    # 7. plain reads of an input see writes through every alias
    "07_write_through_row_of_transposed": (["t0 = torch.zeros(3, 2).t()"], ["x0[0].add_(1.)", "r = t0 + 0"]),
    "07_write_through_detach": ([F32], ["x0.detach().add_(1.)", "r = t0 * 1"]),
    # 8. two equal expressions are two tensors
    "08_equal_expressions": ([F32], ["a = x0 * 0.5", "b = x0 * 0.5", "_ = a.sum().item()", "a.add_(10.)"]),
    # 9. contiguous() of a non-contiguous value copies, as in eager
    "09_contiguous_copies": (["t0 = torch.zeros(2, 4)[:, ::2]"], ["x0.add_(1.)", "x0.contiguous().mul_(5.)"]),
    "09_contiguous_of_transposed_result": (
        ["t0 = torch.ones(3, 2).t()"],
        ["a = x0 * 2", "c = a.contiguous()", "c.mul_(5.)"],
    ),  # fmt: skip
    # 10. cross-entropy after a reduction, in the lazy stream and rx.compile
    "10_ce_of_sum": (
        ["t0 = torch.arange(6.0).reshape(2, 3) / 5"],
        ["l = F.cross_entropy(x0.sum(0) * 2, torch.tensor(1))"],
    ),  # fmt: skip
    "10_ce_of_mean_3d": (
        ["t0 = torch.arange(24.0).reshape(4, 2, 3).sin()"],
        [
            "l = F.cross_entropy(x0.mean(0), torch.tensor([1, 0]))",
            "m = F.cross_entropy(x0.var(0), torch.tensor([2, 0]), label_smoothing=0.2)",
            "n = F.cross_entropy(x0.amax(0) * 2, torch.tensor([1, 1]))",
        ],
    ),  # fmt: skip
    "10_ce_after_inplace_with_sum": (
        ["t0 = torch.arange(6.0).reshape(2, 3).cos()"],
        ["x0.mul_(2)", "s = x0.sum()", "ce = F.cross_entropy(x0, torch.tensor([0, 2]))"],
    ),
    "10_ce_inf_row": (
        ["t0 = torch.tensor([[1.0, float('inf'), 0.0], [0.0, 1.0, 2.0]])"],
        ["ce = F.cross_entropy(x0, torch.tensor([0, 1]))"],
    ),  # fmt: skip
    # 11. type promotion: 0-dim tensors and python scalars
    "11_zero_dim_half": (
        [
            "t0 = torch.tensor(1.5, dtype=torch.float16)",
            "t1 = torch.tensor(2, dtype=torch.int32)",
            "t2 = torch.tensor(1.25, dtype=torch.bfloat16)",
        ],
        [
            "a = 2.5 * x0",
            "b = 2.5 / x0",
            "c = torch.where(x0 > 0, x0, 2.0)",
            "d = 2.5 * x2",
            "e = x1 * 3",
            "g = x1 / 2",
            "h = torch.add(x1, torch.tensor(True), alpha=2)",
            "i = torch.sub(x0, torch.tensor(3), alpha=0.5)",
        ],
    ),  # fmt: skip
    # 12. //= and %= write in place
    "12_ifloordiv_imod": ([F32], ["y = x0", "x0 //= 2", "z = x0", "x0 %= 3"]),
    # 13. in-place op on a plain tensor with a lazy operand
    "13_plain_target": (
        [F32_1D, "p = torch.ones(3)"],
        ["p.add_(x0)", "p += x0", "p.mul_(x0)", "p.sub_(x0, alpha=2)", "r = p + 0"],
    ),  # fmt: skip
    # 14. T and mT
    "14_T_mT": ([F32], ["a = x0.T", "b = x0.mT", "c = (x0 * 2).T", "d = (x0 * 2).mT", "c.add_(1)"]),
    # 15. named tuples keep their names
    "15_named_tuples": (
        [F32],
        [
            "a = torch.sort(x0, -1).values",
            "b = torch.topk(x0, 1).values",
            "c = x0.max(-1).values",
            "d = (x0 * 2).max(-1).indices",
            "e = (x0 + 1).min(0).values",
        ],
    ),  # fmt: skip
    # 16. dropout with p=1 (after p=0 of the same shape: torch's answer is cached per value, not per type)
    "16_dropout_p1": (
        [F32],
        ["z = F.dropout(x0, 0.0)", "a = F.dropout(x0, 1.0)", "b = F.dropout(x0 * 2, 1.0, training=False)"],
    ),
    # 17. in-place results wider than the target are cast back
    "17_inplace_casts_back": (
        [
            "t0 = torch.ones(3, dtype=torch.float16)",
            "t1 = torch.ones(3, dtype=torch.bfloat16)",
            "t2 = torch.ones(3)",
            "t3 = torch.full((3,), 0.3, dtype=torch.float64)",
        ],
        ["x0.add_(x2 * 0.1)", "x1 += x2 / 3", "x2.sub_(x3)", "i = torch.ones(3, dtype=torch.int32)", "L(i).add_(x2)"],
    ),  # fmt: skip
    # 18. a guarded tensor and a lazy tensor in one call
    "18_guarded_and_lazy": (
        [F32_1D, "t1 = torch.ones(3)"],
        ["x1.mul_(3)", "r = torch.maximum(t1, x0)", "q = torch.add(t1, x0 * 2)"],
    ),  # fmt: skip
    # 19. a row reduction with a 0-dim operand
    "19_row_reduction_with_0dim": (
        ["t0 = torch.tensor([[1, 2]])", "t1 = torch.tensor(0.5)"],
        ["r = x0.sum(-1) % (x1.abs() + 1)", "q = x0.float().mean(-1) * x1"],
    ),
    # 20. mixed dtypes the kernels do not take run eagerly
    "20_ce_bf16_prob_targets": (
        [
            "t0 = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).bfloat16()",
            "t1 = torch.softmax(torch.ones(3, 4), -1)",
        ],
        ["l = F.cross_entropy(x0, x1)"],
    ),
    "20_bool_clamp": (["t0 = torch.tensor([True, False])"], ["c = x0.clamp(-1.5, 1.5)"]),
    # 21. item assignment
    "21_setitem": (
        [F32, "t1 = torch.full((3,), 4.0)"],
        ["s = x0 * 1", "x0[0] = 1.5", "x0[1] = x1", "a = x0 * 2", "a[:, 0] = x0[0, 1]"],
    ),  # fmt: skip
    # 22. torch's errors at the statement that raises them
    "22_layer_norm_shape": ([F32], ["a = F.layer_norm(x0, (3,))", "b = F.layer_norm(x0 * 2, (2,))"]),
    "22_unsqueeze_range": ([F32], ["a = (x0 * 2).unsqueeze(5)", "b = (x0 * 2).unsqueeze(-4)"]),
    "22_partial_overlap": (["t0 = torch.arange(5.0)"], ["x0[1:].add_(x0[:-1])", "s = x0 * 1"]),
}


def _program(prelude: list[str], lines: list[str]) -> Program:
    names = []
    for line in prelude:
        name = line.split("=")[0].strip()
        if name.startswith("t"):
            names.append(f"x{name[1:]} = L({name})")
    env: dict = {"torch": torch, "F": torch.nn.functional, "L": lambda t: t}
    raises = []
    for line in prelude + names:
        exec(line, env)
    for line in lines:
        try:
            exec(line, env)
            raises.append(False)
        except Exception:
            raises.append(True)
    return Program(prelude + names, lines, {"s0": 1.0, "s1": 2.0}, raises)


@pytest.mark.parametrize("case", sorted(CASES))
def test_issue_21_programs_agree_with_eager(case):
    verdict, detail = check(_program(*CASES[case]))
    assert verdict == "ok", f"{case}: {verdict}: {detail}"


FUZZ_PROGRAMS = int(os.environ.get("RTXDSL_LAZY_FUZZ_PROGRAMS", "100"))
FUZZ_SEEDS = [("fixed", 21), ("commit", commit_seed("RTXDSL_LAZY_FUZZ_SEED"))]
#: a ratchet, not the goal (every program agrees): 5% disagreed when this test was written; after
#: the kernel fixes, 400 of 400 programs agree (seeds 1 and 2 of tests/lazy_fuzz.py). One program
#: in a hundred is tolerated so that a fresh commit seed that finds a new corner reports it
#: (printed) without blocking every submission; a second one fails
TOLERATED = 0.01


def test_an_index_error_raised_at_the_flush_is_the_eager_one_deferred():
    """``F.cross_entropy`` with a target out of range raises in eager at its line; the stream raises
    it (an RtxError) at the flush that runs its kernel, at a later line (here the next line, where
    the queue's cap of 5 ops is reached). The harness called that a disagreement (seed 2026140200048); a stream
    that never raised, or raised something else, still is one."""
    p = generate(2026140200048)
    assert p.raises[1] and "cross_entropy" in p.lines[1]
    assert check(p) == ("deferred", "line 1's index error raised at line 2's flush")
    index_error = rx.RtxError("cross_entropy: Target 1 is out of bounds.")
    quiet = [None, None]  # eager raises at no later line
    assert _deferred(p, 1, [None, None], quiet)[0] == "wrong"
    assert _deferred(p, 1, [None, ValueError("out of bounds")], quiet)[0] == "wrong"
    assert _deferred(p, 1, [None, index_error], quiet)[0] == "deferred"
    # a later line where eager raises too (the same error) is passed over (program 2027100000210)
    assert _deferred(p, 1, [IndexError("dim"), index_error], [IndexError("dim"), None])[0] == "deferred"


def test_half_precision_gradients_are_compared_at_the_scale_of_the_largest():
    """Eager's bf16 backward is off by its steps at the largest gradient's scale (seed
    2026150400020); a small gradient of the wrong sign, or one beyond the relative tolerance, still differs."""
    want = torch.tensor([44.0, -0.75, 28.5])
    assert _differ(want, torch.tensor([43.92, -0.875, 28.56]), torch.bfloat16, grads=True) is None
    assert _differ(want, torch.tensor([43.92, -0.875, 28.56]), torch.bfloat16) is not None  # not a gradient
    assert _differ(want, torch.tensor([44.0, 0.75, 28.5]), torch.bfloat16, grads=True) is not None
    assert _differ(want, torch.tensor([44.0, -0.75, 32.0]), torch.bfloat16, grads=True) is not None
    assert _differ(want, torch.tensor([44.0, -0.875, 28.5]), None, grads=True) is not None  # an fp32 program


@pytest.mark.parametrize("label,seed", FUZZ_SEEDS, ids=[s[0] for s in FUZZ_SEEDS])
def test_lazy_programs_agree_with_eager(label, seed):
    """A budget of fuzzed programs (a fixed seed, and one from the commit: every submission tries
    programs no earlier run tried); every failure names its seed and prints the program."""
    bad, refused = [], 0
    for k in range(FUZZ_PROGRAMS):
        s = seed * 100_000 + k
        p = generate(s)
        verdict, detail = check(p)
        refused += verdict == "refused"
        if verdict not in ACCEPTED:
            bad.append(f"seed {s} ({label}): {verdict}: {detail}\n{p.source()}")
    report = f"{len(bad)} of {FUZZ_PROGRAMS} program(s) disagree (python tests/lazy_fuzz.py --one SEED)"
    print(report + "\n\n" + "\n\n".join(bad))
    assert len(bad) <= TOLERATED * FUZZ_PROGRAMS, report + "\n\n" + "\n\n".join(bad[:3])
    assert refused <= 0.05 * FUZZ_PROGRAMS, f"{refused} refusals"


def test_contiguous_of_a_value_eager_lays_out_transposed_is_contiguous():
    """``v1`` is computed over a transposed input, so eager lays it out transposed too, and
    ``v1.contiguous()`` is a row-major copy: a flat view of it is valid. The stream computed one
    kernel output for both and copied it for ``v2`` keeping the transposed strides, so the view
    raised (lazy fuzzer seed 20261628, program 2026162800283, where it failed a flush)."""
    f = rx.Fusion()
    t = torch.randn(5, 3).t()
    v1 = 2.5 * f.lazy(t * 1)
    v2 = v1.contiguous()
    flat = v2.view(-1)
    assert v2.torch().is_contiguous() and not v1.torch().is_contiguous()
    assert torch.equal(flat.torch(), (2.5 * t).contiguous().view(-1))


# programs the fuzzer found at fresh seeds, each a fault fixed (python tests/lazy_fuzz.py --one ID --steps N)
FOUND = [
    (2026162800283, 10, "contiguous() of a transposed value copied transposed: a view of it failed a flush"),
    (2027010700177, 10, "a leaf's grad_fn probed at every read: .int() of a view autograd refuses raised"),
    (2027012200346, 10, "a recorded view made again at the flush under its base's grad mode, not its own"),
    (2027012000349, 10, "(x @ x.T).reshape(-1): the row-flattening rule made a 1-d operand of the product"),
    (2027013000031, 10, "x @ log_softmax(x).T, x = a + b: B's prologue read A's x, at A's tile"),
    (2027013700212, 10, "the backward of linear(x, w) * x with K = 1: a copied value's writer made a cycle"),
    (2027102300140, 20, "2.0 * x of a [4, 1] transposed view: eager's strides (1, 4), the stream's (1, 1)"),
    (2027103100042, 30, "a refused view read under no_grad, then with grad: its leaf was never probed"),
    (2027100000210, 10, "the harness: a deferred index error, then a line eager raises at too (deferred)"),
    (2027200400059, 30, "where(v > 0, a, b) of a refused view v: a compare reads it without differentiating"),
    (2027201000058, 30, "a refused view with a second holder: its snapshot and saved-result count raised"),
    (2027200300061, 20, "the harness: an index error a queue cap's flush raises at eager's line (deferred)"),
    (2027310400130, 30, "a call recorded, then run eagerly (int logits): its flush computed the recording"),
    (2027310300055, 20, "the fuzzer's float32 check: a layer norm of bf16 draws, taken unrounded (a false alarm)"),
    (2027700900073, 30, "where(p > x, p, x) of a plain p with a history, flushed, then relu_(p): a version error"),
    (2027811800005, 50, "a bf16 F.linear with a bias rounded the product, then the sum: torch rounds once"),
    (2027812400026, 50, "SDPA of q, k, v with no head (x[1:][1:]): hq // hkv divided by zero at the flush"),
    (2027702700209, 30, "x16 - s subtracted the float32 number where CPU eager subtracts it rounded to x's dtype"),
]


# CPU eager casts a Python number to a float16 / bfloat16 tensor's dtype before these ops
# (TensorIterator's wrapped scalars; CUDA computes with the float32 number), so ``x - s`` is exactly
# 0 where x holds s rounded and ``x == s`` is True there. The lazy stream rounds the number on CPU
# tensors too: it subtracted the float32 number, and a ``where(v > 0, ...)`` over ``x - s`` took the
# other branch (lazy fuzzer program 2027702700209). Each line compared bit for bit.
NUMBER_LINES = [
    "x - s",
    "s - x",
    "torch.sub(x, s, alpha=1)",
    "x.clone().sub_(s)",
    "x + (-s)",
    "x == s",
    "x >= s",
    "x < s",
    "torch.clamp(x, min=s) - x",
    "x ** s",
    "x % s",
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("line", NUMBER_LINES)
def test_a_number_meets_a_half_tensor_rounded_as_cpu_eager_rounds_it(line, dtype):
    s = 0.3871234
    held = torch.tensor(s).to(dtype)  # s rounded, and its neighbours: where the rounding decides
    x = torch.cat([held.view(1), held.float().nextafter(torch.tensor(1.0)).to(dtype).view(1), -held.view(1)])
    x = torch.cat([x, (torch.randn(7, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)])
    want = eval(line, {"torch": torch, "x": x, "s": s})
    got = eval(line, {"torch": torch, "x": rx.Fusion().lazy(x), "s": s}).torch()
    assert got.dtype == want.dtype
    assert (
        torch.equal(got, want)
        or torch.equal(got.isnan(), want.isnan())
        and torch.equal(got.nan_to_num(), want.nan_to_num())
    ), f"{line}: {got} != {want}"


@pytest.mark.parametrize("seed, steps, what", FOUND, ids=[str(s) for s, _, _ in FOUND])
def test_programs_the_fuzzer_found_agree_with_eager(seed, steps, what):
    verdict, detail = check(generate(seed, steps))
    assert verdict == ("deferred" if what.endswith("(deferred)") else "ok"), f"{what}: {verdict}: {detail}"
