"""Targets: what launch configurations are shaped for.

A GPU wants many programs (two waves over its SMs) of modest blocks kept in registers; Triton's
interpreter runs one program at a time in numpy, where each program costs a fixed overhead, so
it wants few, wide programs. The *code* is the same for both: only the launch configuration
(block, rows per program, split) and therefore the signature's block bucket differ.

A reduction whose rows would leave the GPU idle (fewer programs than two waves over its SMs)
and whose reduced extent is long is *split*: several programs per row write partial states,
a second kernel merges them and writes the outputs. Operands laid out differently (``x.t() + y``)
are read in 2-D tiles. The interpreter does neither (one program at a time gains nothing from
them); a test target with a few SMs and tiny tiles runs those code paths on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Target:
    name: str
    sm_count: int  # programs that run at once; a launch wants two waves of them
    pointwise_block: int  # elements per program of a pointwise kernel
    row_tile: int  # elements per program of a row kernel with short rows (several rows each)
    max_row_block: int  # the longest row kept whole in registers
    loop_block: int  # the column block of a looped row
    #: the longest row kept whole by a kernel of at most ``WIDE_TILES`` full-size tiles (a softmax,
    #: a cross-entropy), with ``wide_warps`` warps: one block and no loop where Liger-Kernel takes
    #: one, the registers a tile needs per thread no more than at ``max_row_block``
    wide_row_block: int = 32768
    wide_warps: int = 32
    col_rows: int = 64  # kept elements per program of a column tile (reducing a strided axis)
    split_min: int = 0  # the fewest elements (all rows) a reduction needs to be split (0: never split)
    #: rows x columns of a 2-D pointwise tile for operands laid out differently (None: flat blocks)
    tile: tuple[int, int] | None = (32, 64)
    #: a contraction's tile for 16-bit operands (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps,
    #: num_stages); 4-byte operands halve BLOCK_K
    gemm: tuple[int, int, int, int, int, int] = (128, 128, 64, 8, 8, 3)
    #: the widest contracted size a GEMM prologue's recomputed product takes as one slice (its
    #: operand tile the K loop does not move loaded once: attention's ``q``, as tutorial 06 loads
    #: it). The GPU's MMA sums K in order, so one slice and a loop of slices should give the same
    #: bits in every kernel recomputing the product (not measured: no GPU here); numpy's matmul
    #: (the interpreter's) blocks K its own
    #: way, so there a whole forward beside a sliced backward made a hand-written softmax's
    #: gradient 10x eager's error: 0, every product in slices
    whole_k: int = 128

    @property
    def waves(self) -> int:
        """Programs a launch wants at least: two waves over the SMs."""
        return 2 * self.sm_count


#: an H100 / H200 (sm_90): 132 SMs
GPU = Target(
    "sm_90", sm_count=132, pointwise_block=1024, row_tile=4096, max_row_block=16384, loop_block=4096, split_min=1 << 18
)
#: Triton's interpreter on CPU tensors: the GPU's structure decisions (which rows loop, the same
#: longest row and loop block), with few, wide programs: one at a time, no split, no 2-D tiles,
#: no pipeline to fill
INTERPRETER = replace(
    GPU,
    name="interpreter",
    sm_count=1,
    pointwise_block=1 << 16,
    row_tile=1 << 16,
    split_min=0,
    tile=None,
    gemm=(64, 64, 64, 1, 4, 1),
    whole_k=0,
)


def target_for(device: torch.device, interpreted: bool) -> Target:
    """The target a call on ``device`` runs on: the interpreter, or the CUDA device's SM count."""
    if interpreted or device.type != "cuda":
        return INTERPRETER
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return GPU if sms == GPU.sm_count else replace(GPU, name=f"cuda-{sms}sm", sm_count=sms)
