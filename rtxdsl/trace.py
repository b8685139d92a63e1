"""A memory-access trace of generated kernels: what a GPU would see, measured on CPU.

:func:`memory_trace` runs a kernel's program, lowered with a GPU's launch configurations (or
any :class:`~rtxdsl.lower.Target`), under Triton's interpreter with ``tl.load`` / ``tl.store``
instrumented, and reports per launch and per tensor:

- **re-read**: bytes loaded from a tensor / its unique bytes (1.0: every byte read once; a
  looped or split row that reads its input for statistics and again for the output: 2.0);
- **sector use**: bytes loaded / (32-byte sectors the load instructions touch x 32), weighted
  by bytes. One load instruction here is one ``tl.load`` of a program's whole tile (the
  interpreter runs a program as one numpy step): strided loads along a tile show up as one
  sector per element (0.125 for fp32), loads along a contiguous axis as 1.0;
- **programs** per launch, and the traffic model's bytes next to the traced bytes.

The traced bytes a GPU would move count each tensor's bytes once per launch plus, for *big*
tensors (at least half the launch's largest), their re-reads: bytes a program loads again after
more than ``reuse_bytes`` of other loads (a looped row's second pass). A reload within that
window is on chip (RoPE's partner half, a value loaded twice in one tile); bytes another program
already loaded, and small tensors (a weight, a per-row statistic, a scalar), are L2 hits.
Re-read and sector use are reported for big tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from triton.runtime import interpreter as _interp

from .errors import RtxError
from .lower import GPU, Target
from .lower.params import ParamKind, pointers
from .runtime import Kernel
from .runtime_launch import Interpreted, PreparedCall

SECTOR = 32


@dataclass(frozen=True)
class TensorTraffic:
    """What one launch loaded from and stored to one tensor."""

    name: str  # "in0" (the kernel's first input), "out0", "part0" (split partial states), ...
    nbytes: int  # the tensor's size
    loaded: int  # bytes from DRAM: unique bytes + a program's re-reads (hits on chip or in L2 excluded)
    unique: int  # distinct bytes loaded
    sectors: int  # 32-byte sectors touched, summed over load instructions
    stored: int  # bytes stored
    issued: int = 0  # bytes the load instructions asked for (hits included)
    address: int = 0  # where the tensor lives (the same tensor across launches has the same one)

    @property
    def re_read(self) -> float:
        return self.loaded / self.unique if self.unique else 0.0

    @property
    def sector_use(self) -> float:
        return self.issued / (self.sectors * SECTOR) if self.sectors else 1.0


@dataclass(frozen=True)
class LaunchTrace:
    """One kernel launch: its summary, programs, split phase, the model's bytes and the traffic."""

    summary: str
    split: str
    programs: int
    model_bytes: int
    tensors: tuple[TensorTraffic, ...]

    @property
    def big(self) -> tuple[TensorTraffic, ...]:
        """The tensors whose re-reads reach DRAM (at least half the largest one)."""
        largest = max((t.nbytes for t in self.tensors), default=0)
        return tuple(t for t in self.tensors if t.nbytes * 2 >= largest and t.loaded)

    @property
    def traced_bytes(self) -> int:
        """DRAM bytes: big tensors with their re-reads, small ones once (they stay in L2), stores."""
        big = {t.name for t in self.big}
        return sum((t.loaded if t.name in big else t.unique) + t.stored for t in self.tensors)

    @property
    def re_read(self) -> float:
        """The most re-read big tensor's factor."""
        return max((t.re_read for t in self.big), default=0.0)

    @property
    def sector_use(self) -> float:
        """Bytes-weighted sector use of the loads from big tensors."""
        loaded = sum(t.issued for t in self.big)
        sectors = sum(t.sectors for t in self.big)
        return loaded / (sectors * SECTOR) if sectors else 1.0


@dataclass(frozen=True)
class Trace:
    """Every launch of one call, and the call's outputs (computed by the traced kernels)."""

    launches: tuple[LaunchTrace, ...]
    result: Any = field(repr=False)

    @property
    def model_bytes(self) -> int:
        return sum(t.model_bytes for t in self.launches)

    @property
    def traced_bytes(self) -> int:
        return sum(t.traced_bytes for t in self.launches)

    @property
    def re_read(self) -> float:
        """Reads of the most-read tensor over all launches (a split row's two kernels add up)."""
        total: dict[int, float] = {}
        for launch in self.launches:
            for t in launch.big:
                total[t.address] = total.get(t.address, 0.0) + t.re_read
        return max(total.values(), default=0.0)

    @property
    def sector_use(self) -> float:
        loaded = sum(t.issued for launch in self.launches for t in launch.big)
        sectors = sum(t.sectors for launch in self.launches for t in launch.big)
        return loaded / (sectors * SECTOR) if sectors else 1.0

    @property
    def programs(self) -> int:
        """Programs of the widest launch."""
        return max((t.programs for t in self.launches), default=0)

    def table(self) -> str:
        """One line per launch: programs, re-read, sector use, model and traced bytes."""
        head = ("kernel", "split", "programs", "re-read", "sectors", "model", "traced")
        lines = ["{:42s} {:8s} {:>8s} {:>7s} {:>7s} {:>10s} {:>10s}".format(*head)]
        for t in self.launches:
            lines.append(
                f"{t.summary[:42]:42s} {t.split or '-':8s} {t.programs:8d} {t.re_read:7.2f} {t.sector_use:7.2f} "
                f"{t.model_bytes:10d} {t.traced_bytes:10d}"
            )
        return "\n".join(lines)


class _Recorder:
    """Loads and stores of the current launch, attributed to its pointer arguments.

    A load's bytes are *new* the first time the launch touches them (DRAM), an on-chip hit when
    the same program loaded them within its last ``reuse_bytes`` of loads, and a *re-read* when
    the same program loaded them longer ago (a looped row's next pass). Bytes another program
    already loaded are L2 hits (a weight every row reads, a neighbour's half): not re-reads.
    """

    def __init__(self, reuse_bytes: int) -> None:
        self.reuse_bytes = reuse_bytes
        self.ranges: list[tuple[int, int, str]] = []
        self.loads: dict[str, list[tuple[np.ndarray, int, int, int]]] = {}  # (addresses, itemsize, sectors, re-read)
        self.stored: dict[str, int] = {}
        self.program: Any = None
        self.recent: list[np.ndarray] = []  # this program's latest loads, newest last
        self.recent_bytes = 0
        self.seen: dict[str, np.ndarray] = {}  # per tensor: what this program has loaded

    def begin(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        self.ranges = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes(), n) for n, t in zip(names, tensors)]
        self.loads, self.stored = {}, {}
        self.program, self.recent, self.recent_bytes, self.seen = None, [], 0, {}

    def owner(self, addresses: np.ndarray) -> str:
        a = int(addresses[0])
        return next((n for lo, hi, n in self.ranges if lo <= a < hi), "?")

    def load(self, ptrs: Any, mask: Any) -> None:
        addresses = ptrs.data[mask.data.astype(bool)]
        if not addresses.size:
            return
        item = np.dtype(_interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        sectors = len(np.unique(addresses // SECTOR))
        flat = addresses.ravel().copy()
        name = self.owner(flat)
        self._enter_program()
        on_chip = np.isin(flat, np.concatenate(self.recent)) if self.recent else np.zeros(flat.size, dtype=bool)
        seen = self.seen.get(name)
        again = np.isin(flat, seen) & ~on_chip if seen is not None else np.zeros(flat.size, dtype=bool)
        self.seen[name] = flat if seen is None else np.union1d(seen, flat)
        self.recent.append(flat)
        self.recent_bytes += flat.size * item
        while len(self.recent) > 1 and self.recent_bytes - self.recent[0].size * item >= self.reuse_bytes:
            self.recent_bytes -= self.recent.pop(0).size * item
        self.loads.setdefault(name, []).append((flat, item, sectors, int(again.sum())))

    def _enter_program(self) -> None:
        """A new program starts with nothing on chip and nothing loaded."""
        program = _interp.interpreter_builder.grid_idx
        if program != self.program:
            self.program, self.recent, self.recent_bytes, self.seen = program, [], 0, {}

    def store(self, ptrs: Any, mask: Any) -> None:
        addresses = ptrs.data[mask.data.astype(bool)]
        if addresses.size:
            item = np.dtype(_interp._get_np_dtype(ptrs.get_element_ty())).itemsize
            name = self.owner(addresses)
            self.stored[name] = self.stored.get(name, 0) + addresses.size * item

    def traffic(self, names: list[str], tensors: list[torch.Tensor]) -> tuple[TensorTraffic, ...]:
        out = []
        for n, t in zip(names, tensors):
            loads = self.loads.get(n, [])
            unique = len(np.unique(np.concatenate([a for a, _, _, _ in loads]))) * loads[0][1] if loads else 0
            loaded = unique + sum(again * item for _, item, _, again in loads)
            sectors = sum(s for _, _, s, _ in loads)
            issued = sum(a.size * item for a, item, _, _ in loads)
            nbytes = t.numel() * t.element_size()
            out.append(TensorTraffic(n, nbytes, loaded, unique, sectors, self.stored.get(n, 0), issued, t.data_ptr()))
        return tuple(out)


@contextlib.contextmanager
def _instrumented(recorder: _Recorder) -> Iterator[None]:
    builder = _interp.interpreter_builder
    load, store = builder.create_masked_load, builder.create_masked_store

    def traced_load(ptrs, mask, other, cache_policy, is_volatile):  # noqa: ANN001, ANN202 - the builder's signature
        recorder.load(ptrs, mask)
        return load(ptrs, mask, other, cache_policy, is_volatile)

    def traced_store(ptrs, value, mask, cache_policy):  # noqa: ANN001, ANN202
        recorder.store(ptrs, mask)
        return store(ptrs, value, mask, cache_policy)

    # the builder's own attributes before (none: its class's methods, which other wrappers such as
    # rtxdsl.interpret's bounds checks may patch later): restored as they were, never pinned
    names = ("create_masked_load", "create_masked_store")
    own = {n: vars(builder)[n] for n in names if n in vars(builder)}
    builder.create_masked_load, builder.create_masked_store = traced_load, traced_store
    try:
        yield
    finally:
        for n in names:
            if n in own:
                setattr(builder, n, own[n])
            else:
                delattr(builder, n)


def memory_trace(
    kernel: Kernel, *args: Any, target: Target = GPU, reuse_bytes: int = 32 * 1024, **kwargs: Any
) -> Trace:
    """Run ``kernel`` on CPU tensors with ``target``'s launch configurations under Triton's
    interpreter and trace every load and store (``reuse_bytes``: how far back a program's own
    loads count as on chip).

    Example::

        >>> import torch, rtxdsl as rx
        >>> k = rx.compile(rx.sum(rx.var("x"), axis=0))          # a column sum: a bias gradient
        >>> x = torch.randn(300, 128)
        >>> t = rx.memory_trace(k, x=x)
        >>> t.programs, t.re_read, t.sector_use                 # 64 columns side by side per program
        (2, 1.0, 1.0)
        >>> torch.allclose(t.result, x.sum(0), atol=1e-5)
        True
    """
    if not isinstance(kernel, Kernel):
        raise RtxError(f"memory_trace: kernel must be an rx.Kernel (rx.compile), got {type(kernel).__name__}")
    if not isinstance(target, Target):
        raise RtxError(f"memory_trace: target must be a Target (rtxdsl.lower.GPU), got {target!r}")
    if isinstance(reuse_bytes, bool) or not isinstance(reuse_bytes, int) or reuse_bytes < 0:
        raise RtxError(f"memory_trace: reuse_bytes must be an int >= 0, got {reuse_bytes!r}")
    tensors = kernel.collect(args, kwargs)
    program = kernel.lower_for(target, *args, **kwargs)
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise RtxError("memory_trace runs under Triton's interpreter: pass CPU tensors")
    launch = PreparedCall(
        kernel, kernel.analysis(*args, **kwargs), program, kernel.config.replace(backend="interpreter"), tensors
    )
    recorder = _Recorder(reuse_bytes)
    calls = iter(program.launch_order())
    traces: list[LaunchTrace] = []
    real_call = Interpreted.__call__

    def call(self: Interpreted, *a: Any, **kw: Any) -> Any:
        spec_call = next(calls)
        names = _pointer_names(spec_call)
        ptrs = [x for x in a if isinstance(x, torch.Tensor)]
        recorder.begin(names, ptrs)
        out = real_call(self, *a, **kw)
        traces.append(
            LaunchTrace(
                spec_call.summary,
                spec_call.spec.split.value,
                int(np.prod(spec_call.grid)),
                spec_call.bytes // (spec_call.chunk.chunks if spec_call.chunk else 1),  # a chunk loop's: per chunk
                recorder.traffic(names, ptrs),
            )
        )
        return out

    Interpreted.__call__ = call  # type: ignore[method-assign]
    try:
        with _instrumented(recorder):
            result = launch.run(tensors)
    finally:
        Interpreted.__call__ = real_call  # type: ignore[method-assign]
    return Trace(tuple(traces), result)


#: how the trace names a pointer parameter of each kind (a tail's as ``tail.<name>``)
_TRACE_NAME = {
    ParamKind.INPUT: "in{}",
    ParamKind.OUTPUT: "out{}",
    ParamKind.PARTIAL: "part{}",
    ParamKind.FLAGS: "flags",
    ParamKind.COUNTER: "counter",
}


def _pointer_names(call: Any) -> list[str]:
    return [
        ("tail." if p.name.startswith("t_") else "") + _TRACE_NAME[p.kind].format(p.index) for p, _ in pointers(call)
    ]
