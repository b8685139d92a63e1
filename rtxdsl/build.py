"""Ahead-of-time builds: every kernel a call launches, generated, cached and compiled for a GPU
target on a machine without that GPU (Triton's compiler with a ``GPUTarget``).

``prepare`` does rtxdsl's own host work (lower, generate, write, import); ``compile_kernel``
adds Triton's compile for ``sm_<arch>`` and reads the facts that matter off the result.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from .cache import GLOBAL_CACHE, CompiledKernel
from .codegen.module import kernel_source
from .codegen.ptx import CompileFacts, compile_call
from .lower import GPU, Program, Target
from .runtime import Kernel


def prepare(kernel: Kernel, inputs: dict[str, Any], target: Target = GPU) -> tuple[Program, list[CompiledKernel]]:
    """Lower ``kernel`` for ``inputs`` on ``target`` and fetch (generate or load) every kernel's source."""
    program = kernel.lower_for(target, *[inputs[n] for n in kernel.inputs])
    cfg = kernel.config
    compiled = [
        GLOBAL_CACHE.get(c.spec, c.summary, cfg.cache_size, cfg.resolved_cache_dir, kernel_source)
        for c in program.kernels
    ]
    return program, compiled


def compile_kernel(kernel: Kernel, inputs: dict[str, Any], arch: int = 90) -> list[CompileFacts]:
    """Facts for every kernel a call of ``kernel`` with ``inputs`` launches (inputs may be CPU tensors)."""
    program, compiled = prepare(kernel, inputs)
    bufs: list[Any] = [inputs[n] for n in kernel.inputs]
    bufs += [0] * (program.n_inputs - len(bufs))  # drawn seeds: scalars, not buffers
    bufs += [torch.empty(b.shape, dtype=b.dtype) for b in program.buffers]
    return [
        replace(compile_call(c.jit, call, [bufs[i] for i in call.buffers], arch), signature=c.signature)
        for c, call in zip(compiled, program.kernels)
    ]
