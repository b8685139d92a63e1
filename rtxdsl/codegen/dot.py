"""A product's tile as source text: Triton tutorial 03's K loop, shared by every kernel that computes
one (a GEMM's prologue recomputing a product, a row kernel reducing one)."""

from __future__ import annotations

import torch

from ..dtypes import TRITON_TYPE, accumulator


def k_loop(
    acc: str, shape: str, operand: torch.dtype, size: str, k: str, left: tuple[str, str], right: tuple[str, str],
    precision: str, stored: tuple[torch.dtype, torch.dtype] | None = None,
) -> list[str]:  # fmt: skip
    """Lines computing ``acc`` (a ``shape`` tile, the accumulator of ``operand`` tiles) over ``size``
    elements of the contracted axis in ``BLOCK_K`` slices indexed by ``k``: each slice loads
    ``left`` and ``right`` (pointer + offset, mask) and adds their ``tl.dot`` (``precision``: fp32
    operands' ``input_precision``). ``stored``: the operands' buffer dtypes, where one may differ
    from ``operand`` (a per-row statistic kept in fp32): cast to it as loaded."""
    option = f', input_precision="{precision}"' if operand == torch.float32 else ""
    tiles = zip(("lhs", "rhs"), (left, right), stored or (operand, operand))
    loads = [
        f"{name} = {load_as(f'tl.load({ptr}, mask={mask}, other=0)', dt, operand)}" for name, (ptr, mask), dt in tiles
    ]
    return [
        f"{acc} = tl.zeros({shape}, dtype={TRITON_TYPE[accumulator(operand)]})",
        f"for {k}_start in range(0, {size}, BLOCK_K):",
        f"    {k} = {k}_start + tl.arange(0, BLOCK_K)",
        *(f"    {line}" for line in loads),
        f"    {acc} = tl.dot(lhs, rhs, {acc}{option})",
    ]


def one_slice(
    acc: str, operand: torch.dtype, k: str, block: int, loads: list[tuple[str, str]], precision: str,
    stored: tuple[torch.dtype, torch.dtype], fixed: int,
) -> tuple[list[str], list[str]]:  # fmt: skip
    """A product whose contracted size fits one ``block`` (a power of two, masked beyond the size):
    ``(before, at)``, the lines before the enclosing loop (the index vector ``k`` and operand
    ``fixed``, the one the loop does not move: loaded once, as tutorial 06 loads ``q``) and the
    lines at each tile (the other operand, one ``tl.dot`` without a zero accumulator)."""
    option = f', input_precision="{precision}"' if operand == torch.float32 else ""
    names = [f"{side}_{acc}" for side in ("lhs", "rhs")]
    lines = [
        f"{n} = {load_as(f'tl.load({ptr}, mask={mask}, other=0)', dt, operand)}"
        for n, (ptr, mask), dt in zip(names, loads, stored)
    ]
    before = [f"{k} = tl.arange(0, {block})", lines[fixed]]
    return before, [lines[1 - fixed], f"{acc} = tl.dot({names[0]}, {names[1]}{option})"]


def load_as(load: str, stored: torch.dtype, operand: torch.dtype) -> str:
    """A product operand's tile load, cast to the dtype the product multiplies in when its buffer
    holds another (an intermediate written in fp32, read by a half-precision GEMM: rounded where
    eager would have stored it)."""
    return load if stored == operand else f"{load}.to({TRITON_TYPE[operand]})"
