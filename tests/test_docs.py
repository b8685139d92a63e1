"""The docs cannot rot: every docstring example in the package runs and prints what it shows, and
every ``python`` example in README.md and docs/*.md runs as written."""

from __future__ import annotations

import contextlib
import doctest
import importlib
import io
import pkgutil
import re
from pathlib import Path

import pytest

import rtxdsl

MODULES = sorted(m.name for m in pkgutil.walk_packages(rtxdsl.__path__, "rtxdsl.") if not m.name.endswith("__main__"))
ROOT = Path(__file__).resolve().parent.parent
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
#: a block that cannot run here says so on a line of its own, with the reason (rare)
SKIP = "# doc-test: skip ("
#: a toml block whose first line is ``# <name>.toml`` is that file, for the examples after it
FILE = re.compile(r"# ([\w.-]+\.toml)\n")


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} fail (run python -m doctest)"


def blocks(path: Path) -> list[tuple[str, str, int]]:
    """(language, body, line of the body's first line) of every fenced block of a markdown file."""
    text = path.read_text()
    return [(m[1], m[2], text.count("\n", 0, m.start(2)) + 1) for m in FENCE.finditer(text)]


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
def test_markdown_examples_run_as_written(path, tmp_path, monkeypatch):
    """A file's ``python`` blocks run in order in one namespace (in an empty directory, holding the
    files its toml blocks name); a traceback points at the markdown line."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"doc_{path.stem}"}
    for lang, body, line in blocks(path):
        if lang == "toml" and (named := FILE.match(body)):
            (tmp_path / named[1]).write_text(body)
        if lang != "python" or SKIP in body:
            continue
        code = compile("\n" * (line - 1) + body, str(path), "exec")
        with contextlib.redirect_stdout(io.StringIO()):
            exec(code, namespace)  # noqa: S102 - the docs' own examples


def test_markdown_examples_are_found_and_seldom_skipped():
    found = {p.name: [b for lang, b, _ in blocks(p) if lang == "python"] for p in MARKDOWN}
    assert len(found["README.md"]) >= 2 and len(found["guide.md"]) >= 8, found.keys()
    skipped = [b for bs in found.values() for b in bs if SKIP in b]
    assert len(skipped) <= 2, skipped  # a skipped example is one a reader cannot trust: keep them rare
