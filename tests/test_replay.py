"""Process replay: the kernels the catalog generates match the committed snapshot (tests/replay).

A refactor that should not change kernels shows no diff; one that should is committed with
its new snapshot: ``python -m benches.replay --out tests/replay``.
"""

from __future__ import annotations

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


#: forward row patterns -> their block reductions (tl.max / tl.min / tl.sum), as the tutorials run
#: them: softmax and logsumexp a max and a sum (no NaN flag: the sum carries a NaN), RMSNorm a sum
REDUCTIONS = {"softmax": 2, "logsumexp": 2, "log_softmax": 2, "rms_norm": 1}


@pytest.mark.parametrize("pattern", sorted(REDUCTIONS))
def test_row_patterns_reduce_as_often_as_the_tutorials(pattern):
    kernels = sorted(SNAPSHOT.glob(f"composite.{pattern}.*.fwd0.py"))
    assert kernels, pattern
    for path in kernels:
        src = path.read_text()
        if "SPLIT_BLOCK" in src:  # a split row: partials and their finish, one launch each
            continue
        assert len(re.findall(r"tl\.(?:max|min|sum)\(", src)) == REDUCTIONS[pattern], path.name
