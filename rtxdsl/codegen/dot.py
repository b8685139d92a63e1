"""A product's tile as source text: Triton tutorial 03's K loop, shared by every kernel that computes
one (a GEMM's prologue recomputing a product, a row kernel reducing one)."""

from __future__ import annotations

import torch

from ..dtypes import TRITON_TYPE, accumulator


def k_loop(
    acc: str, shape: str, operand: torch.dtype, size: str, k: str, left: tuple[str, str], right: tuple[str, str],
    precision: str,
) -> list[str]:  # fmt: skip
    """Lines computing ``acc`` (a ``shape`` tile, the accumulator of ``operand`` tiles) over ``size``
    elements of the contracted axis in ``BLOCK_K`` slices indexed by ``k``: each slice loads
    ``left`` and ``right`` (pointer + offset, mask) and adds their ``tl.dot`` (``precision``: fp32
    operands' ``input_precision``)."""
    option = f', input_precision="{precision}"' if operand == torch.float32 else ""
    tiles = zip(("lhs", "rhs"), (left, right))
    loads = [f"{name} = tl.load({ptr}, mask={mask}, other=0)" for name, (ptr, mask) in tiles]
    return [
        f"{acc} = tl.zeros({shape}, dtype={TRITON_TYPE[accumulator(operand)]})",
        f"for {k}_start in range(0, {size}, BLOCK_K):",
        f"    {k} = {k}_start + tl.arange(0, BLOCK_K)",
        *(f"    {line}" for line in loads),
        f"    {acc} = tl.dot(lhs, rhs, {acc}{option})",
    ]
