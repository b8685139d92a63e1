"""Source templates with checked placeholders: a missing or unused value is a bug, not a blank."""

from __future__ import annotations

import re
import textwrap

_PLACEHOLDER = re.compile(r"\$\{(\w+)\}")


def placeholders(template: str) -> set[str]:
    return set(_PLACEHOLDER.findall(template))


def render(template: str, **values: str) -> str:
    """Fill ``${name}`` placeholders; every placeholder needs a value and every value a placeholder.

    A multi-line value is indented to the column of its placeholder.
    """
    wanted = placeholders(template)
    missing = wanted - values.keys()
    extra = values.keys() - wanted
    if missing or extra:
        raise KeyError(f"template placeholders missing {sorted(missing)}, unexpected {sorted(extra)}")
    out = []
    for line in template.splitlines():
        m = _PLACEHOLDER.fullmatch(line.strip())
        if m:  # a placeholder alone on its line: a block, indented like the placeholder
            indent = line[: len(line) - len(line.lstrip())]
            block = values[m.group(1)]
            if block:
                out.append(textwrap.indent(block, indent))
            continue
        out.append(_PLACEHOLDER.sub(lambda mm: values[mm.group(1)], line))
    return "\n".join(out) + "\n"
