"""Every op is declared once with everything the pipeline needs."""

from __future__ import annotations

import pytest

from rtxdsl.ops import REGISTRY, OpKind

COMPUTING = [op for op in REGISTRY.values() if op.kind is not OpKind.LEAF]


@pytest.mark.parametrize("op", COMPUTING, ids=lambda o: o.name)
def test_op_has_reference_and_lowering(op):
    assert callable(op.ref), f"{op.name} lacks a torch reference"
    if op.kind is OpKind.ELEMENTWISE:
        assert callable(op.emit), f"{op.name} lacks a Triton emitter"
    elif op.kind is OpKind.REDUCTION:
        assert op.reduce is not None, f"{op.name} lacks a reduction spec"
    elif op.kind is OpKind.COMPOSITE:
        assert callable(op.decompose), f"{op.name} lacks a decomposition"
    assert op.accepts, f"{op.name} accepts no dtype"
    assert op.eager_launches >= (0 if op.kind is OpKind.SCALAR or op.view or op.name == "detach" else 1), (
        f"{op.name}: eager launch count"
    )


@pytest.mark.parametrize(
    "op", [o for o in COMPUTING if o.kind in (OpKind.ELEMENTWISE, OpKind.REDUCTION)], ids=lambda o: o.name
)
def test_op_has_derivative(op):
    assert op.derivative is not None, f"{op.name} has no derivative rule"


def test_public_functions_cover_every_op():
    import rtxdsl as rx

    internal = {
        "var",
        "const",
        "rcount",
        "add",
        "sub",
        "mul",
        "div",
        "floordiv",
        "remainder",
        "lt",
        "le",
        "gt",
        "ge",
        "eq",
        "ne",
        "and",
        "or",
        "xor",
        "invert",
        "clamp_min",
        "clamp_max",
        "unsqueeze",  # the gradient of keepdim=False reductions
        "detach",  # the stability shift of softmax
    }  # operators / helpers
    for name in REGISTRY:
        if name in internal:
            continue
        assert hasattr(rx, name), f"op {name} has no rx.{name}"
