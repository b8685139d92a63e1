"""KernelCache: signature -> loaded kernel, an in-memory LRU over an on-disk source cache.

Generated modules are written to ``cache_dir`` (atomically: temp file + rename) beside a
JSON record of their spec and a digest of their source, and imported from there, so Triton
and people can read them and a new process finds them without generating code again. An
entry whose digest, spec or import fails is regenerated (a WARNING says so); a cache
directory that cannot be written degrades to kernels held in memory (one WARNING), never to
a failure. The cache does not know how source is made: callers pass the generator.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import linecache
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import triton

from . import interpret
from .fileio import atomic_write
from .log import log
from .lower import plans
from .lower.spec import KernelSpec
from .lru import LRU
from .ops import REGISTRY, DtypeRule, Pattern

interpret.install()  # Triton's interpreter multiplies bf16 bits in tl.dot: converted first

FORMAT_VERSION = 2

#: (spec, kernel name, signature, summary) -> module source
Generator = Callable[[KernelSpec, str, str, str], str]


def generator_digest() -> str:
    """Hash of the code that turns specs into source: a changed generator never reuses stale files.
    ``lower/`` too: some of it writes source text from a spec (block sparsity's tile scan,
    ``lower.sparsity.may_hold``; online softmax's names), which a changed rule changed with the
    spec the same (a scan through a view of document ids was served from a file without it)."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    code = [*root.glob("codegen/*.py"), *root.glob("lower/*.py"), *root.glob("ops/*.py")]
    for path in sorted([*code, root / "registry.py", root / "dtypes.py"]):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


GENERATOR = generator_digest()


@dataclass(frozen=True)
class CacheStats:
    """Counters of the kernel cache (and of planning, which sits above it)."""

    hits: int = 0
    misses: int = 0
    compiles: int = 0  # sources generated in this process
    disk_hits: int = 0  # misses served from cache_dir without generating code
    evictions: int = 0
    entries: int = 0
    plans_built: int = 0  # programs lowered for a new layout: a steady loop stops planning
    plans_reused: int = 0  # of those, analyses reused from a graph of the same structure (a new size)
    healed: int = 0  # cached entries found corrupt and regenerated


@dataclass
class CompiledKernel:
    """One generated kernel: its source, where it lives, and launchable functions."""

    signature: str
    name: str
    source: str
    path: Path | None  # None: held in memory only (the cache directory is not writable)
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


#: patterns too general to name a kernel by: its first ops name it
_GENERAL = frozenset(
    {Pattern.CONTRACTION, Pattern.REDUCTION, Pattern.ACTIVATION, Pattern.ELEMENTWISE_CHAIN, Pattern.SINGLE}
)


def kernel_name(spec: KernelSpec, signature: str, summary: str = "") -> str:
    """``softmax_row_8fd7e45e``: the fusion pattern its ``summary`` names first, the kernel's family
    and signature; a kernel of a general pattern (an elementwise chain, a reduction) is named by
    its first four ops, ``row_sum_div_sub_mul_<signature>``."""
    pattern = next((p for p in Pattern if p.value == summary.split(":", 1)[0]), None)
    if pattern is not None and pattern not in _GENERAL:
        return f"{pattern.name.lower()}_{spec.kind}_{signature[:8]}"
    ops: list[str] = []
    for n in spec.nodes:
        if n.op not in ops and REGISTRY[n.op].rule is not DtypeRule.CAST:
            ops.append(n.op)
    words = "_".join(ops[:4]) or "copy"
    return f"{spec.kind}_{words}_{signature[:8]}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class KernelCache:
    """Process-wide: bounded LRU in memory, sources on disk."""

    def __init__(self, capacity: int = 1024) -> None:
        self._mem: LRU[str, CompiledKernel] = LRU(capacity)
        self._lock = threading.RLock()
        self._counts = dict(compiles=0, disk_hits=0, plans_built=0, healed=0)
        self._readonly: set[str] = set()  # cache dirs already reported as not writable

    def stats(self) -> CacheStats:
        m = self._mem
        return CacheStats(
            hits=m.hits,
            misses=m.misses,
            evictions=m.evictions,
            entries=len(m),
            plans_reused=plans.reused(),
            **self._counts,
        )

    def count_plan(self) -> None:
        with self._lock:
            self._counts["plans_built"] += 1

    def clear(self, reset_stats: bool = True) -> None:
        with self._lock:
            self._mem.clear()
            plans.clear(reset_stats)
            if reset_stats:
                self._mem.hits = self._mem.misses = self._mem.evictions = 0
                self._counts = dict.fromkeys(self._counts, 0)

    def get(
        self, spec: KernelSpec, summary: str, capacity: int, cache_dir: Path, generate: Generator
    ) -> CompiledKernel:
        sig = signature_of(spec)
        hit = self._mem.get(sig)
        if hit is not None:
            return hit
        with self._lock:  # one generator at a time: imports and Triton's JIT are not thread-safe
            entry = self._mem.peek(sig)
            if entry is None:
                entry = self._load_or_generate(spec, sig, summary, cache_dir, generate)
                if self._mem.capacity != capacity:
                    self._mem.resize(capacity)
                self._mem.put(sig, entry)
            return entry

    # ---- disk ----------------------------------------------------------------------------
    def _load_or_generate(
        self, spec: KernelSpec, sig: str, summary: str, cache_dir: Path, generate: Generator
    ) -> CompiledKernel:
        name = kernel_name(spec, sig, summary)
        directory = cache_dir / f"v{FORMAT_VERSION}"
        src_path, meta_path = directory / f"{sig}.py", directory / f"{sig}.json"
        cached = self._read(src_path, meta_path, spec)
        if cached is not None:
            cached, name = cached  # the name it was generated under (another graph of this spec may name it)
            try:
                jit = _import(f"rtxdsl_kernels.{name}", src_path, name)
                self._counts["disk_hits"] += 1
                log.debug("kernel %s loaded from %s", name, src_path)
                return CompiledKernel(sig, name, cached, src_path, spec, jit)
            except Exception as exc:  # a garbled module: heal it below
                self._heal(src_path, f"it does not import ({type(exc).__name__}: {exc})")
        source = generate(spec, name, sig, summary)
        self._counts["compiles"] += 1
        log.debug("kernel %s generated (%s)", name, summary)
        path = self._write(directory, src_path, meta_path, source, spec, sig, name, summary)
        jit = _import(f"rtxdsl_kernels.{name}", path, name) if path else _import_text(name, sig, source)
        return CompiledKernel(sig, name, source, path, spec, jit)

    def _read(self, src_path: Path, meta_path: Path, spec: KernelSpec) -> tuple[str, str] | None:
        """The cached source and kernel name if its record matches this spec and its digest, else None."""
        try:
            meta = json.loads(meta_path.read_text())
            source = src_path.read_text()
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            self._heal(src_path, f"its record cannot be read ({exc})")
            return None
        if not isinstance(meta, dict) or meta.get("spec") != repr(spec):
            self._heal(src_path, "its record belongs to another spec")
            return None
        if meta.get("digest") != _digest(source):
            self._heal(src_path, "its source does not match the recorded digest (truncated or edited)")
            return None
        name = meta.get("name")
        if not isinstance(name, str) or not name.isidentifier():
            self._heal(src_path, "its record names no kernel")
            return None
        return source, name

    def _heal(self, path: Path, why: str) -> None:
        self._counts["healed"] += 1
        log.warning("cached kernel %s is unusable: %s; regenerating it", path, why)

    def _write(
        self,
        directory: Path,
        src_path: Path,
        meta_path: Path,
        source: str,
        spec: KernelSpec,
        sig: str,
        name: str,
        summary: str,
    ) -> Path | None:
        meta = {
            "signature": sig,
            "name": name,
            "spec": repr(spec),
            "summary": summary,
            "digest": _digest(source),
            "triton": triton.__version__,
        }
        try:
            directory.mkdir(parents=True, exist_ok=True)
            atomic_write(src_path, source)
            atomic_write(meta_path, json.dumps(meta, indent=1))
            return src_path
        except OSError as exc:
            key = str(directory)
            if key not in self._readonly:
                self._readonly.add(key)
                log.warning("cache_dir %s cannot be written (%s): kernels stay in memory", directory, exc)
            return None


def _import(module_name: str, path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def _import_text(name: str, sig: str, source: str) -> Any:
    """A module from source held in memory; linecache lets Triton (inspect) read it back."""
    filename = f"<rtxdsl-kernel {sig}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    module = types.ModuleType(f"rtxdsl_kernels.{name}")
    module.__file__ = filename
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - our own generated source
    return getattr(module, name)


GLOBAL_CACHE = KernelCache()


def cache_stats() -> CacheStats:
    """Counters of the process-wide kernel cache.

    Example:
        >>> import rtxdsl as rx
        >>> rx.cache_stats().entries >= 0
        True
    """
    return GLOBAL_CACHE.stats()
