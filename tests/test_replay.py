"""Process replay: the kernels the catalog generates match the committed snapshot (tests/replay).

A refactor that should not change kernels shows no diff; one that should is committed with
its new snapshot: ``python -m benches.replay --out tests/replay``.
"""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

import pytest

from benches.replay import replay

SNAPSHOT = Path(__file__).parent / "replay"


def test_generated_kernels_match_the_snapshot():
    fresh = replay()
    kept = {p.name: p.read_text() for p in SNAPSHOT.glob("*.py")}
    added, removed = sorted(fresh.keys() - kept.keys()), sorted(kept.keys() - fresh.keys())
    changed = sorted(n for n in fresh.keys() & kept.keys() if fresh[n] != kept[n])
    if added or removed or changed:
        report = [f"generated kernels differ from {SNAPSHOT}:"]
        report += [f"  new: {n}" for n in added] + [f"  gone: {n}" for n in removed]
        for n in changed[:5]:
            report += difflib.unified_diff(
                kept[n].splitlines(), fresh[n].splitlines(), f"snapshot/{n}", f"now/{n}", lineterm="", n=2
            )
        report.append(f"{len(changed)} changed; accept with: python -m benches.replay --out tests/replay")
        raise AssertionError("\n".join(report))


def test_generated_kernels_round_half_values_by_a_plain_cast():
    """No kernel rounds a bf16 value by integer ops on its bits: a plain ``.to(tl.bfloat16)``
    rounds to nearest even on a GPU and, with rtxdsl's interpreter fix, on CPU."""
    kept = {p.name: p.read_text() for p in SNAPSHOT.glob("*.py")}
    assert [n for n, src in kept.items() if "0x7FFF" in src or "bitcast=True" in src] == []
    assert any(".to(tl.bfloat16)" in src for src in kept.values())


#: forward row patterns -> their block reductions (tl.max / tl.min / tl.sum / tl.reduce) with the
#: row whole and looped, as the tutorials run them: softmax and logsumexp a max and a sum (no NaN
#: flag: the sum carries a NaN), RMSNorm a sum, layer norm a sum and the deviations' sum with their
#: squares' in one tree (each block's, a looped row's: its Welford mean is the norm's mean)
REDUCTIONS = {"softmax": (2, 2), "logsumexp": (2, 2), "log_softmax": (2, 2), "rms_norm": (1, 1), "layer_norm": (2, 2)}


@pytest.mark.parametrize("pattern", sorted(REDUCTIONS))
def test_row_patterns_reduce_as_often_as_the_tutorials(pattern):
    kernels = sorted(SNAPSHOT.glob(f"composite.{pattern}.*.fwd0.py"))
    assert kernels, pattern
    for path in kernels:
        src = path.read_text()
        if "SPLIT_BLOCK" in src:  # a split row: partials and their finish, one launch each
            continue
        want = REDUCTIONS[pattern]["for col_start" in src]
        assert len(re.findall(r"tl\.(?:max|min|sum|reduce)\(", src)) == want, path.name


def test_softmax_computes_one_exp_per_element():
    """The output reuses the logsumexp tile's exp(x - max) over its sum, as the tutorial's exp(x - max) / sum."""
    for path in sorted(SNAPSHOT.glob("composite.softmax.5x33.*.fwd0.py")):
        src = path.read_text()
        # the tile's, and none per row: times 1 / sum, the total read off the logsumexp's own state
        assert (src.count("tl.exp2("), src.count("tl.exp(")) == (1, 0), path.name


def _bodies() -> dict[str, list[str]]:
    """Each snapshot kernel's body lines, dedented (a module holds one function or two: a tail)."""
    out = {}
    for path in sorted(SNAPSHOT.glob("*.py")):
        for k, fn in enumerate(path.read_text().split("@triton.jit")[1:]):
            lines = fn.split("):\n", 1)[1].splitlines()
            out[f"{path.name}#{k}"] = [ln[4:] for ln in lines if ln.strip()]
    return out


def test_snapshot_kernels_are_rewritten_to_their_fixpoint():
    """No identity cast, no self-copy, no common subexpression, no dead value is left: the
    rewrite table changes nothing in a generated kernel."""
    from rtxdsl.codegen.rewrite import simplify

    def printed(body: list[str]) -> list[str]:  # as the rewrite prints statements (no comments)
        return [line for stmt in ast.parse("\n".join(body)).body for line in ast.unparse(stmt).splitlines()]

    unsettled = [name for name, body in _bodies().items() if simplify(body) != printed(body)]
    assert unsettled == []


def test_snapshot_kernels_have_no_identity_cast_or_self_copy():
    casts = re.compile(r"^(\w+) = .*\.to\((tl\.\w+)\)$")
    copies, identity = [], []
    for name, body in _bodies().items():
        typed = {m.group(1): m.group(2) for m in map(casts.match, body) if m}
        assigned = [ln.split(" = ")[0].strip() for ln in body if " = " in ln]
        for ln in body:
            m = re.match(r"^(\w+) = ([A-Za-z_]\w*)$", ln.strip())  # (``pid = 0`` is no copy)
            if m and assigned.count(m.group(1)) == 1:
                copies.append(f"{name}: {ln}")
            for v, t in re.findall(r"\b(\w+)\.to\((tl\.\w+)\)", ln):
                if typed.get(v) == t and assigned.count(v) == 1:
                    identity.append(f"{name}: {ln}")
    assert copies == [] and identity == []


def test_snapshot_kernels_pad_no_pointer_that_has_its_shape():
    """``x_ptr + rows * x_stride0 + v6 + rows * 0``: the last term only gave a scalar offset the
    tile's shape, and ``rows * x_stride0`` has it already. A pad stays where it is the only term
    of its index (a scalar's pointer stored to per row); a tail runs as program ``0``, not
    ``tl.program_id(0) * 0``."""
    padded = []
    for name, body in _bodies().items():
        for ln in body:
            assert "tl.program_id(0) * 0" not in ln, f"{name}: {ln}"
            for ptr in re.findall(r"tl\.(?:load|store)\((.*?), (?:mask=|\w+\.to|v|\d)", ln):
                for index in re.findall(r"\b(\w+) \* 0\b", ptr):
                    if re.search(rf"\b{index} \* (?!0\b)|\+ {index}\b(?! \*)|^{index}\b", ptr) or " + 0 " in ptr:
                        padded.append(f"{name}: {ln}")
    assert padded == []


@pytest.mark.parametrize("pattern", ["softmax", "layer_norm", "rms_norm"])
def test_a_row_patterns_forward_kernel_is_named_after_it(pattern):
    """``softmax_row_<signature>``, as a tutorial names its kernel after what it computes."""
    for path in sorted(SNAPSHOT.glob(f"composite.{pattern}.*.fwd0.py")):
        if "SPLIT_BLOCK" not in path.read_text():
            assert re.search(rf"^def {pattern}_row_SIG\(", path.read_text(), re.M), path.name


def test_cross_entropy_reads_the_target_logit_once_per_row():
    """The picked logit is a load at the target (as Liger's ``tl.load(X_ptr + y)``), not a select
    and an add per element and a block reduction: the forward reduces the row twice (the max,
    then the sum of exps and label smoothing's sum of the logits in one tree: ``sibling_sums``)."""
    src = (SNAPSHOT / "workload.cross_entropy.fwd0.py").read_text()
    head = src.split("@triton.jit")[-1]  # the row kernel (the first functions are its tail and a helper)
    assert len(re.findall(r"tl\.(?:max|min|sum|reduce)\(", head)) == 2
    assert re.search(r"tl\.load\(x_ptr \+ rows \* x_stride0 \+ v\d+\b", head)  # x: the logits
