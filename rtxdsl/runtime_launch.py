"""Prepared calls: a lowered program made runnable for one input layout.

A :class:`PreparedCall` holds a generated ``run(tensors)``: straight-line python that allocates
the outputs, launches each compiled kernel with its precomputed arguments (through Triton's
interpreter on CPU tensors), reads index-check flags, counts, and packs the result.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import torch
from torch.library import wrap_triton

from . import interpret
from .cache import GLOBAL_CACHE, CompiledKernel
from .codegen.module import kernel_source
from .config import FusionConfig
from .errors import BackendError, IndexOutOfRangeError, ZeroDivisorError
from .handle import KernelHandle
from .lower import Plan, Program
from .lower.params import ParamKind, slots
from .lower.schedule import DivisorCheck, IndexCheck, candidates, encode_scalar
from .lower.spec import ChunkLoop
from .ops import REGISTRY, apply_ref
from .tune import Tuned, tuned_path

#: Triton's interpreter keeps global state (the current program id, patched tl functions)
INTERPRETER_LOCK = threading.Lock()


class PreparedCall:
    """A prepared call for one input layout: a generated ``run(tensors)`` that allocates the
    outputs, launches each kernel with its precomputed arguments, counts, and packs the result."""

    __slots__ = ("plan", "program", "backend", "note", "config", "device", "any_grad", "run", "source")

    def __init__(
        self, kernel: KernelHandle, plan: Plan, program: Program, config: FusionConfig, tensors: tuple[Any, ...]
    ) -> None:
        device = device_of(tensors)
        self.plan = plan  # the fusion groups and the bound graph (explain, autograd)
        self.program = program
        self.config = config
        self.device = device
        self.any_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
        self.backend, self.note = backend_for(config, device)
        if self.backend == "torch":
            p, record = program, kernel.stats.record

            def run(ts: tuple[Any, ...]) -> Any:
                results = kernel.reference(ts)
                record(p.eager_launches, 0, p.eager_launches, p.eager_bytes, p.eager_bytes, p.minimum_flops)
                return results

            self.run, self.source = run, ""
        else:
            self.run, self.source = generate_run(kernel, program, config, tensors, self.backend == "interpreter")


def generate_run(
    kernel: KernelHandle,
    program: Program,
    config: FusionConfig,
    tensors: tuple[Any, ...],
    interpret: bool,
    graph: bool = False,
) -> tuple[Any, str]:
    """``run(tensors)`` for one launch, as straight-line python (a fixed template, no user text).

    ``graph``: the run torch.compile's graph holds on CUDA (:meth:`Kernel.graph_run`): each launch
    through ``torch.library.wrap_triton`` (traceable, so Inductor sees the kernel), a tail's counter
    zeroed per call (a graph keeps no state between calls), no tuning, no counting."""
    scope: dict[str, Any] = {"empty_like": torch.empty_like, "empty": torch.empty, "DEV": device_of(tensors)}
    scope["CONTIGUOUS"] = torch.contiguous_format
    n = len(tensors)
    lines = ["def run(tensors):"]
    if n:
        lines.append(f"    {', '.join(f't{i}' for i in range(n))}, = tensors")
    names = [f"t{i}" for i in range(n)]
    lines += _buffer_lines(program, tensors, graph, scope, names)
    repeats = repeated_outputs(program, kernel.shared_outputs)
    if not config.dry_run:
        if program.divisors and scope["DEV"].type == "cpu":
            scope["ZERO_DIVISORS"] = _ZeroDivisors(program.divisors)
            lines.append("    ZERO_DIVISORS(tensors)")
        lines += _launch_lines(program, config, interpret, graph, scope, names)
        if not graph:
            p = program
            copies = sum(_nbytes(p.buffers[slot - p.n_inputs]) for slot in repeats.values() if slot >= p.n_inputs)
            scope["record"] = kernel.stats.record
            lines.append(
                f"    record({p.kernels_launched + len(repeats)}, {p.fused}, {p.eager_launches}, "
                f"{p.bytes_moved + 2 * copies}, {p.eager_bytes}, {p.flops})"
            )
    if program.scalar_outputs:
        scope["finish"] = _finisher(kernel, program, scope["DEV"])
        lines.append(f"    return finish([{', '.join(names)}])")
    elif kernel.returns_tensor:
        lines.append(f"    return {names[program.outputs[0][1]]}")
    else:
        packed = ", ".join(
            f"{key!r}: {names[slot]}{'.clone()' if key in repeats else ''}" for key, slot in program.outputs
        )
        lines.append(f"    return {{{packed}}}")
    source = "\n".join(lines) + "\n"
    exec(source, scope)  # noqa: S102 - generated from the program's structure, no user text
    return scope["run"], source


def _buffer_lines(
    program: Program, tensors: tuple[Any, ...], graph: bool, scope: dict[str, Any], names: list[str]
) -> list[str]:
    """The run's allocations, one line per buffer (its name appended to ``names``)."""
    lines = []
    for k, b in enumerate(program.buffers):
        names.append(f"b{k}")
        if b.persistent and not graph:  # a tail's counter: zeroed once (per CUDA stream), left at zero
            device = device_of(tensors)
            if device.type == "cuda":
                scope[f"KEPT{k}"] = _PerStream(b.shape, b.dtype, device)
                lines.append(f"    b{k} = KEPT{k}()")
            else:  # launches are serialized (the interpreter's lock): one is enough
                scope[f"KEPT{k}"] = torch.zeros(b.shape, dtype=b.dtype, device=device)
                lines.append(f"    b{k} = KEPT{k}")
            continue
        if b.zero or b.persistent:  # index-check flags; a tail's counter in a graph
            scope[f"SHAPE{k}"], scope[f"DT{k}"], scope["zeros"] = b.shape, b.dtype, torch.zeros
            lines.append(f"    b{k} = zeros(SHAPE{k}, dtype=DT{k}, device=DEV)")
            continue
        same = next(
            (i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and tuple(t.shape) == b.shape
             and t.dtype == b.dtype and t.is_contiguous()),
            None,
        )  # fmt: skip
        if same is not None:  # empty_like of a matching contiguous input is the cheapest allocation
            # (contiguous strides: an input's own strides along its size-1 dims are not eager's)
            lines.append(f"    b{k} = empty_like(t{same}, memory_format=CONTIGUOUS)")
        else:
            scope[f"SHAPE{k}"], scope[f"DT{k}"] = b.shape, b.dtype
            lines.append(f"    b{k} = empty(SHAPE{k}, dtype=DT{k}, device=DEV)")
    return lines


def _launch_lines(
    program: Program, config: FusionConfig, interpret: bool, graph: bool, scope: dict[str, Any], names: list[str]
) -> list[str]:
    """The run's launches, then the index checks read after them."""
    lines = []
    for j, call in enumerate(program.launched):
        compiled = compiled_kernel(call.spec, call.summary, config)
        fn = compiled.function(interpret)
        # a kernel writing into an input cannot be timed by running it again: never tuned
        in_place = any(slot < program.n_inputs for slot in slots(call, ParamKind.OUTPUT))
        if graph:
            scope[f"L{j}"] = Interpreted(fn, call.grid) if interpret else wrap_triton(fn)[call.grid]
        elif config.autotune and not in_place:
            scope[f"L{j}"] = _tuned(fn, interpret, call, compiled.signature, config, scope["DEV"])
        else:
            scope[f"L{j}"] = Interpreted(fn, call.grid) if interpret else fn[call.grid]
        scope[f"META{j}"] = dict(call.meta)
        operands = ", ".join(names[i] for i in call.buffers)
        if call.scalar_inputs:
            scope[f"ARGS{j}"] = _ArgFill(call.args, call.scalar_inputs)
            args = f"*ARGS{j}(tensors)"
        else:
            scope[f"ARGS{j}"] = call.args
            args = f"*ARGS{j}"
        if call.chunk is None:
            lines.append(f"    L{j}({operands}, {args}, **META{j})")
            continue
        loop = call.chunk
        before = program.launched[j - 1].chunk if j else None
        if before is None or before.loop != loop.loop:  # the loop's first kernel: the loop begins
            lines.append(f"    for lo in range(0, {loop.extent}, {loop.size}):  # chunk loop {loop.loop}")
        scope[f"CHUNK{j}"] = _Chunked(loop)
        lines.append(f"        L{j}({operands}, *CHUNK{j}(lo, [{args}]), **META{j})")
    for j, call in enumerate(program.launched):
        if call.checks and checking(config, scope["DEV"]):  # one flag read after the launch
            scope[f"CHECK{j}"] = _IndexCheck(call.checks)
            lines.append(f"    CHECK{j}({names[slots(call, ParamKind.FLAGS)[0]]}, tensors)")
    return lines


def checking(config: FusionConfig, device: torch.device) -> bool:
    """Are gathers' index-check flags read after the launch (always on CPU; on CUDA unless turned off)?"""
    return config.check_indices or device.type == "cpu"


def _tuned(fn: Any, interpret: bool, call: Any, signature: str, config: FusionConfig, device: torch.device) -> Tuned:
    """A launcher that times its family's launch options on first use (or reads the stored winner)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-interpreter"

    def launch_for(grid: tuple[int, ...]) -> Any:
        return Interpreted(fn, grid) if interpret else fn[grid]

    options = candidates(call.spec, call.meta, call.grid, call.args)
    return Tuned(launch_for, options, tuned_path(config.resolved_cache_dir, signature, name), name)


class _PerStream:
    """A tail's counter per CUDA stream: launches of one kernel on two streams may overlap, and a
    shared counter would hand the last ticket to the wrong launch."""

    __slots__ = ("shape", "dtype", "device", "kept")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self.kept: dict[int, torch.Tensor] = {}

    def __call__(self) -> torch.Tensor:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        t = self.kept.get(stream)
        if t is None:
            t = self.kept[stream] = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return t


class _IndexCheck:
    """Raises for the first flag a kernel set: an index it was asked to read was out of range,
    named by its first value out of range, as torch names it (found on the host from the call's
    inputs, after the flag is set: the hot path only reads the flags)."""

    __slots__ = ("checks",)

    def __init__(self, checks: tuple[IndexCheck, ...]) -> None:
        self.checks = checks

    def __call__(self, flags: torch.Tensor, tensors: tuple[Any, ...]) -> None:
        if flags.any():
            check = self.checks[int(flags.nonzero()[0, 0])]
            raise IndexOutOfRangeError(check.message.replace("{index}", first_out_of_range(check, tensors)))


def first_out_of_range(check: IndexCheck, tensors: tuple[Any, ...]) -> str:
    """The first value of the checked index outside ``[0, size)`` (in the index's element order),
    computed with torch from the call's inputs; "..." where the check cannot say."""
    if check.index is None:
        return "..."
    try:
        index = torch.as_tensor(host_value(check.steps, check.index, tensors)).reshape(-1)
    except Exception:  # the error is raised anyway, only less precisely worded
        return "..."
    bad = index[(index < 0) | (index >= check.size)]
    return str(int(bad[0])) if bad.numel() else "..."


def host_value(steps: tuple, ref: Any, tensors: tuple[Any, ...]) -> Any:
    """The value at ``ref`` of a cone of host steps (``IndexCheck``, ``DivisorCheck``), computed
    with the ops' torch references from the call's inputs."""
    vals: list[Any] = []

    def operand(r: Any) -> Any:
        return vals[r] if isinstance(r, int) else tensors[r[1]] if r[0] == "in" else r[1]

    with torch.no_grad():
        for op, attrs, refs in steps:
            vals.append(apply_ref(REGISTRY[op], [operand(r) for r in refs], dict(attrs)))
        return operand(ref)


class _ZeroDivisors:
    """Raises before a CPU launch where an integer division's divisor holds a zero, as torch's CPU
    kernels raise ZeroDivisionError (the kernel would give 0 there without a word)."""

    __slots__ = ("checks",)

    def __init__(self, checks: tuple[DivisorCheck, ...]) -> None:
        self.checks = checks

    def __call__(self, tensors: tuple[Any, ...]) -> None:
        for check in self.checks:
            try:
                zero = bool((torch.as_tensor(host_value(check.steps, check.divisor, tensors)) == 0).any())
            except RuntimeError as e:  # a division inside the divisor's own cone
                zero = "ZeroDivisionError" in str(e)
            if zero:
                raise ZeroDivisorError(check.message)


class _Chunked:
    """A chunk loop's kernel's arguments for the chunk starting at ``lo``: the windowed dim's
    extent cut to the chunk's end, ``W_LO`` and (accumulating) ``W_LAST``."""

    def __init__(self, loop: ChunkLoop) -> None:
        self.loop = loop

    def __call__(self, lo: int, args: list[Any]) -> list[Any]:
        loop = self.loop
        hi = min(lo + loop.size, loop.extent)
        args[loop.hi_arg], args[loop.lo_arg] = hi, lo
        if loop.last_arg >= 0:
            args[loop.last_arg] = int(hi == loop.extent)
        return args


class _ArgFill:
    """A kernel's arguments with the scalar inputs of this call filled in."""

    __slots__ = ("args", "fills")

    def __init__(self, args: tuple[Any, ...], fills: tuple[tuple[int, int, str], ...]) -> None:
        self.args = args
        self.fills = fills

    def __call__(self, tensors: tuple[Any, ...]) -> list[Any]:
        out = list(self.args)
        for pos, j, kind in self.fills:
            out[pos] = encode_scalar(tensors[j], kind)
        return out


class Interpreted:
    """An interpreted kernel launch: serialized, numpy's floating-point warnings silenced
    (masked lanes compute e.g. log(0))."""

    __slots__ = ("launcher", "name", "arg_names")

    def __init__(self, fn: Any, grid: tuple[int, ...]) -> None:
        self.launcher = fn[grid]
        self.name, self.arg_names = fn.__name__, list(fn.arg_names)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with INTERPRETER_LOCK, np.errstate(all="ignore"):
            if not interpret.CHECK_BOUNDS:
                return self.launcher(*args, **kwargs)
            pointers = [(n, a) for n, a in zip(self.arg_names, args) if isinstance(a, torch.Tensor)]
            with interpret.bounds_checked(self.name, [n for n, _ in pointers], [a for _, a in pointers]):
                return self.launcher(*args, **kwargs)


def compiled_kernel(spec: Any, summary: str, config: FusionConfig) -> CompiledKernel:
    return GLOBAL_CACHE.get(spec, summary, config.cache_size, config.resolved_cache_dir, kernel_source)


def interpreter_active() -> bool:
    """Triton's interpreter works only when TRITON_INTERPRET was set before triton was imported."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def backend_for(cfg: FusionConfig, device: torch.device) -> tuple[str, str]:
    """(backend, note): torch, triton (compiled, CUDA) or interpreter (Triton's, any device)."""
    if cfg.backend == "torch" or not cfg.enabled:
        return "torch", "" if cfg.enabled else "fusion disabled: op by op"
    if cfg.backend == "triton" or (cfg.backend == "auto" and device.type == "cuda" and not interpreter_active()):
        return "triton", ""
    if interpreter_active():
        return "interpreter", ""
    if cfg.backend == "interpreter":
        raise BackendError(
            "backend 'interpreter' needs TRITON_INTERPRET=1 in the environment before triton is "
            "imported (import rtxdsl first on a machine without CUDA, or set it yourself)"
        )
    return "torch", "Triton's interpreter is off (TRITON_INTERPRET unset at import), so CPU tensors run through torch"


def device_of(tensors: tuple[Any, ...]) -> torch.device:
    return next((t.device for t in tensors if isinstance(t, torch.Tensor)), torch.device("cpu"))


def repeated_outputs(program: Program, shared: tuple[str, ...]) -> dict[str, int]:
    """Output keys whose buffer an earlier key returns, with its slot: two roots that are one node
    (a key given twice; a reduction over no extent, simplified away) get a copy each, as eager's
    two results are two tensors (an in-place write to one must not change the other). A key in
    ``shared`` (a gradient plan's saved output, ``vjp._read_back``) is the very tensor returned, as
    eager autograd saves it: autograd's version counter refuses a backward after an in-place write."""
    seen: set[int] = set()
    repeats = {}
    for key, slot in program.outputs:
        if slot is not None and slot in seen and key not in shared:
            repeats[key] = slot
        seen.add(slot)  # type: ignore[arg-type]
    return repeats


def _nbytes(b: Any) -> int:
    return math.prod(b.shape) * b.dtype.itemsize


def _finisher(kernel: KernelHandle, program: Program, device: torch.device) -> Any:
    """Packs the call's buffers into its result: one tensor, or a dict by output key."""
    slots = list(program.outputs)
    scalars = program.scalar_outputs
    repeats = repeated_outputs(program, kernel.shared_outputs)
    if kernel.returns_tensor and not scalars:
        slot = slots[0][1]
        return lambda bufs: bufs[slot]

    def finish(bufs: list[Any]) -> Any:
        res = {
            k: (bufs[s].clone() if k in repeats else bufs[s])
            if s is not None
            else torch.tensor(scalars[k][0], dtype=scalars[k][1], device=device)
            for k, s in slots
        }
        return res["out"] if kernel.returns_tensor else res

    return finish
