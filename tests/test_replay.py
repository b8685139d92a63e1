"""Process replay: the kernels the catalog generates match the committed snapshot (tests/replay).

A refactor that should not change kernels shows no diff; one that should is committed with
its new snapshot: ``python -m benches.replay --out tests/replay``.
"""

from __future__ import annotations

import difflib
from pathlib import Path

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
