"""The model-shaped differential fuzzer (``tests/model_fuzz.py``) at a CI budget.

Programs drawn as models are written (attention by hand, gated MLPs, norms, residuals, logits
heads with cross-entropy, linear cross-entropy, mean pooling; fp32 / fp16 / bf16; gradients,
inference with in-place writes, a second step) run in both rtxdsl modes, ``dsl`` (``rx.compile``
of expressions) and ``lazy`` (the torch text on ``f.lazy`` tensors), against float64 torch, at a
fixed seed and at a seed from the commit (``RTXDSL_MODEL_FUZZ_SEED`` sets it; the pytest header
prints the lazy and expression fuzzers' seeds, this one is in the test's id). A crash or a wrong
answer fails; refusals (an ``RtxError`` naming what rtxdsl does not fuse) are bounded.

``RTXDSL_MODEL_FUZZ_PROGRAMS=N`` sets the programs per seed and mode (interpreted kernels cost
seconds per program: the default keeps this file near a minute on two cores). Reproduce a failure
with ``python tests/model_fuzz.py --one ID --mode MODE``; ``--show ID`` prints its texts.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import commit_seed
from model_fuzz import MODES, _spreads, check, compare, generate, program_ids, run_dsl, run_torch

PROGRAMS = int(os.environ.get("RTXDSL_MODEL_FUZZ_PROGRAMS", "3"))
SEEDS = [("fixed", 33), ("commit", commit_seed("RTXDSL_MODEL_FUZZ_SEED"))]
#: the done criterion: refusals under 2% (at least one tolerated in a small budget)
REFUSALS = 0.02


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("label,seed", SEEDS, ids=[f"{label}-{seed}" for label, seed in SEEDS])
def test_model_programs_match_float64_torch(mode: str, label: str, seed: int) -> None:
    """Every output and gradient as close to float64 torch as eager torch's own; each failure
    names its program id and prints the program."""
    bad, refused, skipped = [], 0, 0
    for pid in program_ids(seed, PROGRAMS):
        p = generate(pid)
        out = check(p, mode)
        refused += out.verdict == "refusal"
        skipped += out.verdict == "skip"
        if out.verdict in ("wrong", "crash"):
            bad.append(f"program {pid} ({label} seed, {mode}): {out.verdict}: {out.detail}\n{p.source()}")
    report = f"{len(bad)} of {PROGRAMS} program(s) failed (python tests/model_fuzz.py --one ID --mode {mode})"
    print(report + "\n\n" + "\n\n".join(bad))
    assert not bad, report + "\n\n" + "\n\n".join(bad[:3])
    assert refused <= max(1, math.floor(REFUSALS * PROGRAMS)), f"{refused} of {PROGRAMS} refused"
    # a program eager itself rejects is skipped: rare by construction, never the whole budget
    assert skipped <= PROGRAMS // 2, f"{skipped} of {PROGRAMS} skipped (eager raised): the draw is broken"


#: programs the fuzzer found failing, each with the mode it failed in and what it hit
FOUND = [
    # attention into a JSD distillation, lazily: a node a kernel recomputes only at a view's
    # coordinates (its cone) read a value another kernel computes; the analyzer's output pass
    # looked for its readers among members only (KeyError)
    (2026150500026, "lazy"),
    # bf16 linear cross-entropy over an RMSNorm of a tied, gathered embedding (the chunk loop): the
    # kernel recomputing the normed rows for the loop's dh GEMM sat between the loop's kernels
    # (AssertionError in lower._loops_together)
    (2026120700108, "dsl"),
    # fp16 hand-written attention over one key, with gradients: the softmax's logsumexp stayed in
    # a kernel of its own, and the one-pass GEMM's spec took it for its own (KeyError in _online)
    (2026121000112, "dsl"),
    (2026121000139, "lazy"),
    # a layer norm backward beside a residual (a pre-norm block): the rewrite rule sibling_sums
    # moved the lines read off the first row sum in a set's order, so one read a value before the
    # line assigning it (a helper, seed 20273001)
    (2027300100033, "dsl"),
    # two products sharing a weight, one's operand a residual over the other's value: summed in one
    # K loop, its operand read at the tile before the other's product existed (a helper, seed 20275012)
    (2027501200038, "dsl"),
    # a softcapped linear cross-entropy over hidden states near 1000: tanh's gradient 1 - y * y from
    # a y within an ulp of 1 (7x eager's error in dw; a helper, seed 20275015)
    (2027501500043, "dsl"),
]


@pytest.mark.parametrize(("pid", "mode"), FOUND)
def test_found_programs_match_float64_torch(pid: int, mode: str) -> None:
    p = generate(pid)
    out = check(p, mode)
    assert out.verdict == "ok", f"program {pid} ({mode}): {out.verdict}: {out.detail}\n{p.source()}"


#: programs the fuzzer found failing that are not fixed yet: each must still fail (strict), so a fix
#: shows here and moves it to FOUND
OPEN: list[tuple[int, str]] = []


@pytest.mark.xfail(strict=True, reason="found by the model fuzzer, open: see OPEN")
@pytest.mark.parametrize(("pid", "mode"), OPEN)
def test_open_programs_still_fail(pid: int, mode: str) -> None:
    p = generate(pid)
    out = check(p, mode)
    assert out.verdict == "ok", f"program {pid} ({mode}): {out.verdict}: {out.detail}"


#: fp16 programs with an ill-conditioned gradient element: rounding every input once more moves
#: float64's answer farther than rtxdsl is from it, so neither is wrong (eager is close by luck)
ILL_CONDITIONED = [
    # d/dg20[0] (an RMSNorm weight after two residual blocks over a gathered, tied embedding):
    # rtxdsl 0.229, eager 0.2463, float64 0.2460, and 0.2175 to 0.2745 at inputs rounded again
    *((22750215300000, mode) for mode in MODES),
    # d/dE1[17, 2] of a tied embedding: rtxdsl -0.912 (dsl) and -0.800 (lazy), eager -0.870,
    # float64 -0.868; one ulp of eager's own inputs moves another element from 0.211 to 0.263
    *((2026180300152, mode) for mode in MODES),
]


@pytest.mark.parametrize(("pid", "mode"), ILL_CONDITIONED)
def test_ill_conditioned_elements_are_judged_by_their_sensitivity(pid: int, mode: str) -> None:
    assert check(generate(pid), mode).verdict == "ok"


def test_the_sensitivity_bound_still_finds_a_wrong_gradient() -> None:
    """The widened bound is per element: a well-conditioned gradient 3% off, or the ill-conditioned
    element 0.1 off (beyond its spread), is still wrong."""
    p = generate(22750215300000)
    eager = run_torch(p, 0)
    ref = run_torch(p, 0, reference=True, eager=eager)
    spread = _spreads(p, 0, eager, ref)["grad"]
    got = run_dsl(p, 0, [], eager).grads
    assert compare(got["b33"], eager.grads["b33"], ref.grads["b33"], p.dtype, spread=spread["b33"]) is None
    assert compare(got["b33"] * 1.03, eager.grads["b33"], ref.grads["b33"], p.dtype, spread=spread["b33"])
    off = got["g20"] + torch.tensor([0.1, 0, 0, 0, 0, 0, 0], dtype=got["g20"].dtype)
    assert compare(got["g20"], eager.grads["g20"], ref.grads["g20"], p.dtype, spread=spread["g20"]) is None
    assert compare(off, eager.grads["g20"], ref.grads["g20"], p.dtype, spread=spread["g20"])
