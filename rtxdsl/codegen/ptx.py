"""Compile generated kernels for an NVIDIA target without a GPU, and read facts off the result.

Triton compiles to PTX and a cubin for any target (``GPUTarget("cuda", 90, 32)`` is an
H100/H200) on a machine with no GPU. The facts that matter for memory-bound kernels —
128-bit vector loads and stores, registers per thread, spills — are deterministic, so
tests assert them and the compile report prints them.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ..dtypes import POINTER_TYPE


@dataclass(frozen=True)
class CompileFacts:
    name: str
    seconds: float  # Triton's own compile, cold (empty Triton cache)
    v4_loads: int  # ld.global.v4 (128-bit for 32-bit elements) in the PTX
    v4_stores: int
    ptx: str
    arch: int = 90
    signature: str = ""  # the kernel's structural signature (filled by rtxdsl.build)

    @cached_property
    def _usage(self) -> tuple[int | None, int | None]:  # ptxas -v once, on the first read
        return _ptxas_usage(self.ptx, self.arch)

    @property
    def registers(self) -> int | None:
        """Registers per thread, from ``ptxas -v`` (run when first asked: a compile check needs none)."""
        return self._usage[0]

    @property
    def spill_bytes(self) -> int | None:
        return self._usage[1]


def _int_type(v: int) -> str:
    return "i32" if -(2**31) <= v < 2**31 else "i64"


def compile_call(jit: Any, call: Any, tensors: list[torch.Tensor], arch: int = 90) -> CompileFacts:
    """Compile one kernel call of a Program for ``sm_{arch}`` the way Triton specializes it on a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = jit if isinstance(jit, JITFunction) else JITFunction(jit.fn)
    names = fn.arg_names
    meta = dict(call.meta)
    values = list(tensors) + list(call.args)
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, (name, v) in enumerate(zip(names, values)):
        if name in call.meta:  # a constexpr passed in its place (a hand-written peer's argument list)
            continue
        if v is None or (isinstance(v, int) and not isinstance(v, bool) and v == 1):
            # an absent optional pointer, an integer equal to 1: constexprs, as Triton's launcher makes them
            signature[name] = "constexpr"
            meta[name] = v
        elif isinstance(v, torch.Tensor):
            signature[name] = POINTER_TYPE[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[name] = "fp32"
        else:
            signature[name] = _int_type(int(v))
            if int(v) % 16 == 0 and int(v) != 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = {k: v for k, v in meta.items() if k in names}
    for k in constexprs:
        signature[k] = "constexpr"
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    with tempfile.TemporaryDirectory() as cache:
        old = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            start = time.perf_counter()
            compiled = triton.compile(
                src, target=GPUTarget("cuda", arch, 32), options={"num_warps": meta.get("num_warps", 4)}
            )
            seconds = time.perf_counter() - start
        finally:
            if old is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = old
    ptx = compiled.asm["ptx"]
    return CompileFacts(
        fn.__name__,
        seconds,
        len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx)),
        len(re.findall(r"st\.global(?:\.\w+)*\.v4", ptx)),
        ptx,
        arch,
    )


def _ptxas(arch: int) -> Path | None:
    """The ptxas Triton itself uses for ``sm_{arch}`` (bundled with its wheel), if any."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        tool = get_ptxas(arch) if "arch" in str(inspect.signature(get_ptxas)) else get_ptxas()
        path = Path(tool.path)
    except (ImportError, AttributeError, TypeError):
        return None
    return path if path.exists() else None


@dataclass(frozen=True)
class Sass:
    instructions: int  # static SASS instructions of the kernel, NOPs excluded
    barriers: int  # BAR instructions (block-wide synchronizations)
    #: the instructions inside its loops (between a branch back to an earlier instruction and that
    #: instruction), NOPs excluded: what a looped row issues per block of each pass, a row kernel
    #: per row of its programs' loop; 0 where the kernel has none
    loop: int = 0
    #: the same per outermost loop, in code order (a scan, then a split K loop's two loops)
    loops: tuple[int, ...] = ()


def sass_counts(ptx: str, arch: int = 90) -> Sass | None:
    """Assemble ``ptx`` for ``sm_{arch}`` and count its SASS (``cuobjdump -sass``, from Triton's wheel)."""
    ptxas = _ptxas(arch)
    cuobjdump = ptxas.parent / "cuobjdump" if ptxas else None
    if ptxas is None or cuobjdump is None or not cuobjdump.exists():
        return None
    with tempfile.TemporaryDirectory() as d:
        src, obj = Path(d) / "k.ptx", Path(d) / "k.o"
        src.write_text(ptx)
        assemble = [str(ptxas), f"--gpu-name=sm_{arch}a", str(src), "-o", str(obj)]
        subprocess.run(assemble, check=True, capture_output=True)
        text = subprocess.run([str(cuobjdump), "-sass", str(obj)], check=True, capture_output=True, text=True).stdout
    found = re.finditer(r"/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", text)
    code = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in found if not m.group(2).startswith("NOP")]
    spans = []
    for at, op, rest in code:  # a branch to an earlier address closes a loop
        back = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if back is not None and int(back.group(1), 16) < at:
            spans.append((int(back.group(1), 16), at))
    looped = sum(1 for a, _, _ in code if any(lo <= a <= hi for lo, hi in spans))
    outer = [
        (lo, hi) for lo, hi in sorted(spans) if not any(a <= lo and hi <= b and (a, b) != (lo, hi) for a, b in spans)
    ]
    loops = tuple(sum(1 for a, _, _ in code if lo <= a <= hi) for lo, hi in outer)
    return Sass(len(code), sum(o.startswith("BAR") for _, o, _ in code), looped, loops)


def _ptxas_usage(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """Registers per thread and spill bytes, from ``ptxas -v`` (bundled with Triton)."""
    ptxas = _ptxas(arch)
    if ptxas is None:
        return None, None
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run(
            [str(ptxas), "-v", f"--gpu-name=sm_{arch}a", str(src), "-o", str(Path(d) / "k.o")],
            capture_output=True,
            text=True,
        )
    text = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    return (int(regs.group(1)) if regs else None, int(spill.group(1)) if spill else None)
