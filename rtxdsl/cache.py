"""KernelCache: signature -> compiled kernel, an in-memory LRU over an on-disk source cache.

Generated modules are written to ``cache_dir`` (atomically: temp file + rename) beside
a JSON record of their spec, and imported from there, so Triton and people can read
them and a new process finds them without generating code again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import triton

from .codegen.source import kernel_source
from .codegen.spec import KernelSpec

FORMAT_VERSION = 1


def _generator_digest() -> str:
    """Hash of the code that turns specs into source: a changed generator never reuses stale files."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    for path in sorted([*root.glob("codegen/*.py"), *root.glob("ops/*.py")]):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


GENERATOR = _generator_digest()


@dataclass(frozen=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    compiles: int = 0  # sources generated in this process
    disk_hits: int = 0  # misses served from cache_dir without generating code
    evictions: int = 0
    entries: int = 0


@dataclass
class CompiledKernel:
    """One generated kernel: its source, where it lives, and launchable functions."""

    signature: str
    name: str
    source: str
    path: Path
    spec: KernelSpec
    jit: Any  # what the module's @triton.jit produced
    _interpreted: Any = field(default=None, repr=False)

    def function(self, interpret: bool) -> Any:
        """The compiled JIT function, or the same kernel under Triton's interpreter."""
        from triton.runtime.interpreter import InterpretedFunction

        if isinstance(self.jit, InterpretedFunction) or not interpret:
            return self.jit
        if self._interpreted is None:
            self._interpreted = InterpretedFunction(self.jit.fn)
        return self._interpreted


def signature_of(spec: KernelSpec) -> str:
    text = f"v{FORMAT_VERSION}|{GENERATOR}|triton-{triton.__version__}|{spec!r}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def kernel_name(spec: KernelSpec, signature: str) -> str:
    ops: list[str] = []
    for n in spec.nodes:
        if n.op not in ops and n.op != "cast":
            ops.append(n.op)
    words = "_".join(ops[:4]) or "copy"
    return f"{spec.kind}_{words}_{signature[:8]}"


class KernelCache:
    """Process-wide: bounded LRU in memory, unbounded sources on disk."""

    def __init__(self) -> None:
        self._mem: OrderedDict[str, CompiledKernel] = OrderedDict()
        self._lock = threading.Lock()
        self._counts = dict(hits=0, misses=0, compiles=0, disk_hits=0, evictions=0)

    def stats(self) -> CacheStats:
        return CacheStats(**self._counts, entries=len(self._mem))

    def clear(self, reset_stats: bool = True) -> None:
        with self._lock:
            self._mem.clear()
            if reset_stats:
                self._counts = dict.fromkeys(self._counts, 0)

    def get(self, spec: KernelSpec, summary: str, capacity: int, cache_dir: Path) -> CompiledKernel:
        sig = signature_of(spec)
        with self._lock:
            hit = self._mem.get(sig)
            if hit is not None:
                self._mem.move_to_end(sig)
                self._counts["hits"] += 1
                return hit
            self._counts["misses"] += 1
            entry = self._load_or_generate(spec, sig, summary, cache_dir)
            self._mem[sig] = entry
            while len(self._mem) > capacity:
                self._mem.popitem(last=False)
                self._counts["evictions"] += 1
            return entry

    def _load_or_generate(self, spec: KernelSpec, sig: str, summary: str, cache_dir: Path) -> CompiledKernel:
        name = kernel_name(spec, sig)
        directory = cache_dir / f"v{FORMAT_VERSION}"
        src_path, meta_path = directory / f"{sig}.py", directory / f"{sig}.json"
        source = None
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("spec") == repr(spec) and src_path.is_file():
                source = src_path.read_text()
                self._counts["disk_hits"] += 1
        except (OSError, ValueError):
            pass
        if source is None:
            source = kernel_source(spec, name, sig, summary)
            self._counts["compiles"] += 1
            directory.mkdir(parents=True, exist_ok=True)
            _atomic_write(src_path, source)
            _atomic_write(
                meta_path,
                json.dumps(
                    {
                        "signature": sig,
                        "name": name,
                        "spec": repr(spec),
                        "summary": summary,
                        "triton": triton.__version__,
                    },
                    indent=1,
                ),
            )
        module = _import(f"rtxdsl_kernels.{name}", src_path)
        return CompiledKernel(sig, name, source, src_path, spec, getattr(module, name))


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _import(module_name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GLOBAL_CACHE = KernelCache()


def cache_stats() -> CacheStats:
    """Counters of the process-wide kernel cache.

    Example:
        >>> import rtxdsl as rx
        >>> rx.cache_stats().entries >= 0
        True
    """
    return GLOBAL_CACHE.stats()
