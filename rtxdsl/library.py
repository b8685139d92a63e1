"""Kernel libraries in files: ``rx.load_library("kernels.toml")`` -> a :class:`Library` of Kernels.

A file (TOML, YAML or JSON) holds an optional ``[config]`` table (FusionConfig fields, applied
to its kernels only) and ``[kernels.NAME]`` tables, each with ``expr`` or ``outputs``
(``rx.parse`` text), ``inputs`` (``name = "dtype[dim, ...]"``, dims ints or symbols), ``sizes``
(symbol -> list of positive ints: the sizes to check, build and bench) and an optional
``tolerance`` (``atol``, ``rtol``). Every problem is reported with the file, line and column
(of the syntax error, of the key at fault, or inside the expression text), all of them at
once, and nothing is compiled from a file with any.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from .config import FusionConfig
from .errors import RtxError
from .expr import Expr, variables
from .parse import DTYPES, parse
from .runtime import Kernel

SUFFIXES = (".toml", ".yaml", ".yml", ".json")
_SPEC = re.compile(r"^\s*(\w+)\s*\[(.*)\]\s*$")


class LibraryError(RtxError):
    """A kernel file is invalid; ``problems`` lists every finding as ``file:line:col: message``."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


# ---- the schema -------------------------------------------------------------------------------
class Tolerance(BaseModel):
    model_config = ConfigDict(extra="forbid")
    atol: float
    rtol: float


class KernelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    expr: str | None = None
    outputs: dict[str, str] | None = None
    inputs: dict[str, str]
    sizes: dict[str, list[int]] = {}
    tolerance: Tolerance | None = None

    @field_validator("sizes")
    @classmethod
    def _positive(cls, v: dict[str, list[int]]) -> dict[str, list[int]]:
        for sym, vals in v.items():
            if not vals or any(isinstance(s, bool) or s < 1 for s in vals):
                raise ValueError(f"sizes of {sym!r} must be a non-empty list of positive ints, got {vals!r}")
        return v


class LibraryFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    config: dict[str, Any] = {}
    kernels: dict[str, dict[str, Any]]  # each validated on its own, so every bad kernel is reported


@dataclass(frozen=True)
class InputSpec:
    dtype: torch.dtype
    dims: tuple[int | str, ...]

    def shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else sizes[d] for d in self.dims)


@dataclass(frozen=True)
class Entry:
    """One validated kernel of a file: its Kernel, input specs, size grid and tolerance."""

    name: str
    kernel: Kernel
    inputs: dict[str, InputSpec]
    sizes: dict[str, list[int]]
    tolerance: tuple[float, float] | None

    def size_grid(self) -> Iterator[dict[str, int]]:
        """Every combination of the symbolic sizes (one empty combination when there are none)."""
        syms = sorted(self.sizes)
        for combo in itertools.product(*(self.sizes[s] for s in syms)):
            yield dict(zip(syms, combo))

    def random_inputs(self, sizes: dict[str, int], seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        out = {}
        for name, spec in self.inputs.items():
            shape = spec.shape(sizes)
            if spec.dtype.is_floating_point:
                t = torch.randn(shape, generator=gen)
            elif spec.dtype is torch.bool:
                t = torch.rand(shape, generator=gen) < 0.5
            else:
                t = torch.randint(0, 8, shape, generator=gen)
            out[name] = t.to(device=device, dtype=spec.dtype)
        return out


class Library:
    """The kernels of a file, by name: ``lib.bias_gelu(x=..., b=...)``, ``lib["residual_norm"]``.

    Example:
        >>> import rtxdsl as rx, tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "k.toml"
        >>> _ = p.write_text('[kernels.act]\\nexpr = "relu(x)"\\ninputs = { x = "float32[4]" }\\n')
        >>> rx.load_library(p).names
        ('act',)
    """

    def __init__(self, path: Path, entries: dict[str, Entry], config: FusionConfig) -> None:
        self.path = path
        self.entries = entries
        self.config = config

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    def __getitem__(self, name: str) -> Kernel:
        entry = self.entries.get(name)
        if entry is None:
            raise RtxError(f"{self.path}: no kernel named {name!r}; it has {', '.join(self.names)}")
        return entry.kernel

    def __getattr__(self, name: str) -> Kernel:
        if name.startswith("_") or name in ("path", "entries", "config"):
            raise AttributeError(name)
        return self[name]

    def __repr__(self) -> str:
        return f"rx.Library({str(self.path)!r}, kernels={self.names})"


def load_library(path: str | Path) -> Library:
    """Read, validate and compile the kernels of a TOML / YAML / JSON file (see the module docstring)."""
    if not isinstance(path, (str, os.PathLike)):
        raise LibraryError([f"load_library: path must be a str or a path, got {path!r}"])
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LibraryError([f"{path}: cannot read: {exc.strerror}"]) from None
    except UnicodeDecodeError as exc:
        raise LibraryError([f"{path}: not UTF-8 text: {exc}"]) from None
    raw = _load(path, text)
    where = _Locator(path, text)
    try:
        data = LibraryFile.model_validate(raw)
    except ValidationError as exc:
        raise LibraryError([where.at(tuple(str(p) for p in e["loc"]), e["msg"]) for e in exc.errors()]) from None
    problems: list[str] = []
    try:
        config = FusionConfig(**data.config)
    except (RtxError, ValidationError) as exc:
        problems.append(where.at(("config",), str(exc).splitlines()[0]))
        config = FusionConfig()
    entries: dict[str, Entry] = {}
    for name, raw_entry in data.kernels.items():
        try:
            k = KernelEntry.model_validate(raw_entry)
        except ValidationError as exc:
            loc = ("kernels", name)
            problems += [where.at((*loc, *(str(p) for p in e["loc"])), e["msg"]) for e in exc.errors()]
            continue
        entry = _entry(name, k, config, where, problems)
        if entry is not None:
            entries[name] = entry
    if problems:
        raise LibraryError(problems)
    return Library(path, entries, config)


def _load(path: Path, text: str) -> Any:
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            return tomllib.loads(text)
        if suffix in (".yaml", ".yml"):
            return yaml.safe_load(text) or {}
        if suffix == ".json":
            return json.loads(text)
    except json.JSONDecodeError as exc:
        raise LibraryError([f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        pos = f"{mark.line + 1}:{mark.column + 1}" if mark is not None else "1:1"
        raise LibraryError([f"{path}:{pos}: invalid YAML: {getattr(exc, 'problem', exc)}"]) from None
    except ValueError as exc:  # tomllib.TOMLDecodeError: "... (at line L, column C)"
        m = re.search(r"at line (\d+), column (\d+)", str(exc))
        pos = f"{m.group(1)}:{m.group(2)}" if m else "1:1"
        raise LibraryError([f"{path}:{pos}: invalid TOML: {str(exc).split(' (at line')[0]}"]) from None
    raise LibraryError([f"{path}: a kernel file is {', '.join(SUFFIXES)}, not {suffix or 'no suffix'}"])


def _entry(name: str, k: KernelEntry, config: FusionConfig, where: _Locator, problems: list[str]) -> Entry | None:
    base = ("kernels", name)
    start = len(problems)
    if (k.expr is None) == (k.outputs is None):
        problems.append(where.at(base, "give exactly one of 'expr' or 'outputs'"))
        return None
    texts = {"out": k.expr} if k.expr is not None else dict(k.outputs or {})
    exprs: dict[str, Expr] = {}
    for key, text in texts.items():
        loc = (*base, "expr") if k.expr is not None else (*base, "outputs", key)
        try:
            exprs[key] = parse(text)
        except RtxError as exc:
            problems.append(where.inside(loc, text, str(exc)))
    specs: dict[str, InputSpec] = {}
    for iname, spec in k.inputs.items():
        parsed = _input_spec(spec)
        if isinstance(parsed, str):
            problems.append(where.at((*base, "inputs", iname), parsed))
            continue
        specs[iname] = parsed
        for d in parsed.dims:
            if isinstance(d, str) and d not in k.sizes:
                problems.append(where.at((*base, "inputs", iname), f"dim {d!r} has no entry in 'sizes'"))
    used = {d for s in specs.values() for d in s.dims if isinstance(d, str)}
    for sym in k.sizes:
        if sym not in used:
            problems.append(where.at((*base, "sizes", sym), f"size {sym!r} is not a dim of any input"))
    if exprs:
        reads = {v.attr("name") for v in variables(list(exprs.values()))}
        for missing in sorted(reads - k.inputs.keys()):
            problems.append(where.at((*base, "inputs"), f"the expression reads {missing!r}, which is not declared"))
        for unused in sorted(k.inputs.keys() - reads):
            problems.append(where.at((*base, "inputs", unused), f"input {unused!r} is not used by the expression"))
    if len(problems) > start:
        return None
    kernel = Kernel(exprs["out"] if k.expr is not None else exprs, config, inputs=tuple(k.inputs))
    tol = (k.tolerance.atol, k.tolerance.rtol) if k.tolerance is not None else None
    return Entry(name, kernel, specs, k.sizes, tol)


def _input_spec(text: str) -> InputSpec | str:
    m = _SPEC.match(text)
    if not m:
        return f"expected 'dtype[dim, ...]' (e.g. 'float32[B, 4096]'), got {text!r}"
    dtype = DTYPES.get(m.group(1))
    if dtype is None:
        return f"unknown dtype {m.group(1)!r}; one of {', '.join(DTYPES)}"
    dims: list[int | str] = []
    for part in (p.strip() for p in m.group(2).split(",")) if m.group(2).strip() else ():
        if part.isdigit():
            dims.append(int(part))
        elif part.isidentifier():
            dims.append(part)
        else:
            return f"dim {part!r} is neither a non-negative int nor a symbol"
    return InputSpec(dtype, tuple(dims))


class _Locator:
    """Line and column of a key path in the file's text (TOML tables and inline tables, YAML)."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        self.lines = text.splitlines()

    def find(self, loc: tuple[str, ...]) -> tuple[int, int]:
        line, col, start = 0, 0, 0
        for n in range(len(loc), 0, -1):  # the deepest TOML table header naming a prefix: [kernels.NAME]
            header = re.compile(rf"^\s*\[\s*{re.escape('.'.join(loc[:n]))}\s*\]")
            hit = next((i for i, text in enumerate(self.lines) if header.match(text)), None)
            if hit is not None:
                line, col, start = hit, 0, n
                break
        for depth, key in enumerate(loc[start:], start):
            if key.isdigit() and depth:  # a list index: stay on the list's key
                continue
            pat = re.compile(rf"(^|[\s{{,.\[\"'])({re.escape(key)})[\"']?\s*(=|:|\]|\.)")
            for i in range(line + (1 if depth == start and start else 0), len(self.lines)):
                m = pat.search(self.lines[i], col if i == line and depth > start else 0)
                if m:
                    line, col = i, m.start(2)
                    break
            else:
                break
        return line + 1, col + 1

    def at(self, loc: tuple[str, ...], msg: str) -> str:
        line, col = self.find(loc)
        return f"{self.path}:{line}:{col}: {'.'.join(loc)}: {msg}"

    def inside(self, loc: tuple[str, ...], text: str, msg: str) -> str:
        """A position inside an expression string: its column within the text, if the error says one."""
        line, col = self.find(loc)
        src = self.lines[line - 1] if line - 1 < len(self.lines) else ""
        start = src.find(text)
        m = re.search(r"column (\d+)", msg)
        if start >= 0:
            col = start + 1 + (int(m.group(1)) - 1 if m else 0)
        return f"{self.path}:{line}:{col}: {'.'.join(loc)}: {msg}"


def size_label(sizes: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items()) or "fixed"
