"""Every op is declared once with everything the pipeline needs."""

from __future__ import annotations

import pytest

import rtxdsl as rx
from rtxdsl.ops import REGISTRY, OpKind

COMPUTING = [op for op in REGISTRY.values() if op.kind is not OpKind.LEAF]
#: ops users do not call by name: built by other ops (element counts, gradients, decompositions)
INTERNAL = {
    "rcount",
    "m2",
    "m2_mean",
    "softmax_sum",
    "finite_or_nan",
    "unsqueeze",
    "clamp_min",
    "clamp_max",
    "expand",
    "unslice",
}


@pytest.mark.parametrize("op", COMPUTING, ids=lambda o: o.name)
def test_op_has_reference_and_lowering(op):
    assert callable(op.ref), f"{op.name} lacks a torch reference"
    if op.kind is OpKind.ELEMENTWISE:
        assert callable(op.emit), f"{op.name} lacks a Triton emitter"
    elif op.kind is OpKind.MOVEMENT:
        assert callable(op.remap), f"{op.name} lacks a coordinate remap"
        assert callable(op.emit) or not op.view, f"view {op.name} lacks its flat emitter"
    elif op.kind is OpKind.REDUCTION:
        assert op.reduce is not None and op.canonical is not None, f"{op.name} lacks a reduction state"
    elif op.kind is OpKind.COMPOSITE:
        assert callable(op.decompose), f"{op.name} lacks a decomposition"
    assert op.accepts, f"{op.name} accepts no dtype"
    free = op.kind in (OpKind.SCALAR, OpKind.MOVEMENT) or op.name in ("detach", "narrow", "transpose")  # views in torch
    assert op.eager_launches >= (0 if free else 1), f"{op.name}: eager launch count"


@pytest.mark.parametrize(
    "op",
    [o for o in COMPUTING if o.kind in (OpKind.ELEMENTWISE, OpKind.REDUCTION, OpKind.MOVEMENT)],
    ids=lambda o: o.name,
)
def test_op_has_derivative(op):
    assert op.derivative is not None, f"{op.name} has no derivative rule"


def test_public_functions_cover_every_op():
    for op in COMPUTING:
        if op.name in INTERNAL or op.kind is OpKind.SCALAR:
            continue
        assert op.public, f"op {op.name} has no public function"
        for name in op.public:
            assert getattr(rx, name) is op.front.fn, f"rx.{name} is not op {op.name}'s function"
            assert name in rx.__all__
