"""Targets: what launch configurations are shaped for.

A GPU wants many programs (two waves over its SMs) of modest blocks kept in registers; Triton's
interpreter runs one program at a time in numpy, where each program costs a fixed overhead, so
it wants few, wide programs. The *code* is the same for both: only the launch configuration
(block, rows per program, split) and therefore the signature's block bucket differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Target:
    name: str
    sm_count: int  # programs that run at once; a launch wants two waves of them
    pointwise_block: int  # elements per program of a pointwise kernel
    row_tile: int  # elements per program of a row kernel with short rows (several rows each)
    max_row_block: int  # the longest row kept whole in registers
    loop_block: int  # the column block of a looped row


#: an H100 / H200 (sm_90): 132 SMs
GPU = Target("sm_90", sm_count=132, pointwise_block=1024, row_tile=4096, max_row_block=16384, loop_block=4096)
#: Triton's interpreter on CPU tensors: the same structure decisions (which rows loop), wide programs
INTERPRETER = Target(
    "interpreter", sm_count=1, pointwise_block=1 << 16, row_tile=1 << 16, max_row_block=16384, loop_block=4096
)


def target_for(device: torch.device, interpreted: bool) -> Target:
    """The target a call on ``device`` runs on: the interpreter, or the CUDA device's SM count."""
    if interpreted or device.type != "cuda":
        return INTERPRETER
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return GPU if sms == GPU.sm_count else Target(f"cuda-{sms}sm", sms, 1024, 4096, 16384, 4096)
