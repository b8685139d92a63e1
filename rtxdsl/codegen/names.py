"""The user's names in a generated module: ``in0_ptr`` becomes ``x_ptr``, a load ``x0_3`` becomes
``x``, a scalar input ``s2`` becomes ``lr``.

The writers name what a kernel reads and writes by position (``in{j}``, ``out{k}``, ``s{k}``, a
load ``x{j}_{n}``, a GEMM's ``x{k}``), which every layer below agrees on; this pass, the last step
of rendering, renames the kernel's and its tail's identifiers to the names the spec carries
(``KernelSpec.names``, ``out_names``, ``scalar_names``). A name already in the function (``mask``,
``rows``, another input's) or a python word takes ``_in`` / ``_out`` (and a number after, if it
must): the rename never captures an identifier. Parameters keep their order, so launches (which
pass arguments by position) are unchanged.
"""

from __future__ import annotations

import builtins
import keyword
import re

from ..lower.spec import KernelSpec

#: an identifier the writers name by position: ``[t_]in3_ptr``, ``out0_stride1``, ``in2_4_stride0``
#: (an input loaded again, re-laid-out), ``x5_12`` / ``x5`` (a load's value), ``s2`` (a scalar)
POSITIONAL = re.compile(r"^(t_)?(?:(in|out)(\d+)((?:_\d+)?_(?:ptr|stride\w*))|x(\d+)(_\d+)?|s(\d+))$")
IDENT = re.compile(r"\b[A-Za-z_]\w*\b")
#: where a top-level function starts: its decorator
FUNCTION = re.compile(r"^@triton\.jit\ndef (\w+)\(", re.M)
#: words a kernel's body may use besides its own names
WORDS = {"tl", "triton", *dir(builtins)}


def user_names(module: str, spec: KernelSpec, kernel: str) -> str:
    """``module`` (one kernel called ``kernel``, its tail ``<kernel>_tail`` and helpers) with the
    kernel's and its tail's positional names renamed after ``spec``'s (helpers untouched)."""
    starts = [(m.start(), m.group(1)) for m in FUNCTION.finditer(module)]
    out, last = [], 0
    for (start, name), end in zip(starts, [s for s, _ in starts[1:]] + [len(module)]):
        out.append(module[last:start])
        block = module[start:end]
        if name == kernel:
            block = _rename(block, {"": spec, "t_": spec.tail})
        elif name == f"{kernel}_tail" and spec.tail is not None:
            block = _rename(block, {"": spec.tail})
        out.append(block)
        last = end
    return "".join(out) + module[last:]


def _rename(block: str, specs: dict[str, KernelSpec | None]) -> str:
    idents = set(IDENT.findall(block))
    groups: dict[tuple[str, str, int], list[str]] = {}  # (prefix, kind, index) -> positional identifiers
    for ident in sorted(idents, key=_order):
        m = POSITIONAL.match(ident)
        if m is None or specs.get(m.group(1) or "") is None:
            continue
        prefix, io, j, _, load, _, scalar = m.groups()
        kind, index = (io, int(j)) if io else ("load", int(load)) if load is not None else ("scalar", int(scalar))
        groups.setdefault((prefix or "", kind, index), []).append(ident)
    bases = {key: _base(specs[key[0]], key[1], key[2]) for key in groups}  # type: ignore[arg-type]
    # every identifier but those renamed stays (a constant's ``s0`` too)
    taken = idents - {i for key, ids in groups.items() if bases[key] for i in ids} | WORDS
    renames: dict[str, str] = {}
    for (prefix, kind, index), ids in groups.items():
        base = bases[(prefix, kind, index)]
        if not base:
            continue
        for suffix in ("", "_out" if kind == "out" else "_in", *(f"_{n}" for n in range(2, 99))):
            wanted = {i: _target(i, prefix, base + suffix, kind, k) for k, i in enumerate(ids)}
            targets = set(wanted.values())
            if len(targets) == len(ids) and not targets & taken and not keyword.iskeyword(base + suffix):
                renames.update(wanted)
                taken |= targets
                break
    if not renames:
        return block
    return IDENT.sub(lambda m: renames.get(m.group(0), m.group(0)), block)


def _order(ident: str) -> tuple:
    """Positional identifiers in a stable order: by their numbers, so a load's values are numbered
    in the order the writer made them."""
    return tuple(int(n) for n in re.findall(r"\d+", ident)), ident


def _base(spec: KernelSpec, kind: str, index: int) -> str:
    """The spec's name for input / output / load / scalar ``index`` ("" where it has none)."""
    if kind == "in":
        return spec.names[index] if index < len(spec.names) else ""
    if kind == "out":
        return spec.out_names[index] if index < len(spec.out_names) else ""
    if kind == "load":
        j = spec.loads[index].input if index < len(spec.loads) else len(spec.names)
        return spec.names[j] if j < len(spec.names) else ""
    return spec.scalar_names[index] if index < len(spec.scalar_names) else ""


def _target(ident: str, prefix: str, base: str, kind: str, k: int) -> str:
    """``ident``'s new name: its positional stem replaced by ``base`` (a load's ``k``-th value
    numbered after the first)."""
    if kind == "load":
        return f"{base}_{k}" if k else base
    if kind == "scalar":  # (a tail's, passed by its head: ``t_count``)
        return f"{prefix}{base}"
    m = POSITIONAL.match(ident)
    assert m is not None
    return f"{prefix}{base}{m.group(4)}"
