"""The names a kernel's source gives what it reads and writes: the user's.

A kernel is generated with positional names (``in0_ptr``, ``out0_ptr``, ``s1``, a load ``x0_3``);
its spec also carries, per input, output and scalar input, the name the user gave it (a var's
name, an output's key), so the printed kernel reads ``x_ptr``, ``weight_ptr``, ``lr`` and
``x = tl.load(x_ptr + ...)`` as the Triton tutorials do (``codegen.names`` renames the module).
Names are part of the signature: the same structure under other names is another kernel source.

The backward's own inputs and outputs (``_g0``: a cotangent, ``_s0``: a saved statistic, ``_d0``:
a gradient) are spelled out; an intermediate another kernel wrote is named after its op.
"""

from __future__ import annotations

import re

from ..expr import Expr
from ..ops import REGISTRY
from .analyze import Group
from .expand import Graph
from .vjp import COTANGENT, GRADIENT, KEPT, PRE, SAVED

#: the backward's placeholder prefixes -> what they are
ROLES = {COTANGENT: "dout", SAVED: "stat", GRADIENT: "grad", KEPT: "kept", PRE: "pre"}


def readable(raw: str) -> str:
    """``raw`` as a python identifier a reader recognizes (placeholders spelled out); "" if none."""
    for prefix, word in ROLES.items():
        if raw.startswith(prefix) and raw[len(prefix) :].isdigit():
            return f"{word}{raw[len(prefix) :]}"
    name = re.sub(r"\W", "_", raw).strip("_")
    return name if name and not name[0].isdigit() else ""


def io_names(group: Group, graph: Graph) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The names of a group's inputs and outputs: a var's name, an output's key, else its op's."""
    keys = {e: k for k, e in graph.outputs}
    for k, e in graph.outputs:  # a value an output only regroups is written as that output
        while REGISTRY[e.op].regroups and e.srcs:
            e = e.srcs[0]
            keys.setdefault(e, k)

    def name(n: Expr) -> str:
        raw = n.attr("name") if n.is_var else keys.get(n, n.op)
        return readable(raw) or n.op

    return tuple(name(n) for n in group.inputs), tuple(name(o) for o in group.outputs)


def scalar_names(slots: tuple[Expr, ...]) -> tuple[str, ...]:
    """Per scalar slot: a scalar input's name, a constant's origin (a composite's parameter, ``eps``;
    the op a folded scalar came from, ``rcount``: a reduction's count), "" for a number written in
    the expression."""
    return tuple(readable(s.attr("name") if s.is_var else s.attr("of") or s.attr("folded") or "") for s in slots)
