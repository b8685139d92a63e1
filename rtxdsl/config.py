"""FusionConfig: the frozen, validated settings of a Kernel or a Fusion stream."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, ValidationError, model_validator

from .errors import ConfigError

Backend = Literal["auto", "triton", "interpreter", "torch"]


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rtxdsl")


class FusionConfig(BaseModel):
    """Settings for fusion, caching and execution.

    Example:
        >>> import rtxdsl as rx
        >>> cfg = rx.FusionConfig().with_max_fusion_ops(32).with_cache_size(256)
        >>> cfg.max_fusion_ops, cfg.enabled
        (32, True)
    """

    # strict: a field takes its own type only ("8", 8.0 or True for a size, "off" for a switch are
    # refused, not coerced); files and environment variables are converted before (``load``)
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, strict=True)

    enabled: bool = True
    """Fuse at all; when False every op runs eagerly through torch, one kernel each."""
    min_fusion_ops: int = 1
    """Groups with fewer ops than this are split into one kernel per op. Ops are counted as
    written: a composite (softmax, cross_entropy, sparsemax) is one op and stays one kernel."""
    max_fusion_ops: int = 64
    """No kernel fuses more ops than this (counted as written, as ``min_fusion_ops``)."""
    cache_size: int = 1024
    """Compiled kernels kept in memory (LRU)."""
    cache_dir: str | None = None
    """Where generated sources are written; None: ``$XDG_CACHE_HOME/rtxdsl`` or ``~/.cache/rtxdsl``."""
    backend: Backend = "auto"
    """auto: compiled Triton on CUDA, Triton's interpreter on CPU; torch: reference ops."""
    dry_run: bool = False
    """Do all host work of a call (outputs allocated) but launch nothing."""
    max_queued_ops: int = 256
    """Lazy streams flush when this many ops are queued."""
    launch_cache_size: int = 64
    """Per-kernel memo of prepared launches for distinct input layouts (LRU)."""
    check_indices: bool = True
    """Gathered indices are checked: out of range raises RtxError (one flag read after the launch).
    False skips the check; an out-of-range index then reads 0 (its load is masked)."""
    allow_tf32: StrictBool | None = None
    """fp32 contractions multiply on tensor cores in TF32 (10-bit mantissas, fp32 sums); None follows
    ``torch.backends.cuda.matmul.allow_tf32`` as it is when a plan is made (torch's default: False)."""
    deterministic: StrictBool = True
    """Bit-identical reruns: no kernel sums floats with atomics (each element of a reduction or a
    product is summed by one program, in a fixed order). Every kernel rtxdsl generates is
    deterministic today (linear cross-entropy's backward recomputes logit tiles instead of adding
    partial gradients atomically); False only permits atomics where a later kernel is faster with them."""
    chunk_budget: float = 0.02
    """Memory a backward may spend to compute a product once instead of recomputing it in every
    GEMM tile that needs it (linear cross-entropy's logits: their gradient feeds the hidden states'
    and the weight's GEMMs), as a fraction of the product's bytes: the product is then computed
    one chunk of its last dim at a time (at least one 128-wide tile) into a buffer of that size,
    which both GEMMs read in the same loop. 0 keeps the recompute plan (no buffer)."""
    autotune: bool = False
    """Time each kernel's launch options (warps, stages, a pointwise block) on its first launch and
    keep the fastest, stored under ``cache_dir/tuned`` per signature, device and Triton version.
    Meant for CUDA devices (CUDA-event timing); on CPU it times the interpreter, which only tests it."""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(_explain(exc)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise ConfigError(f"FusionConfig is frozen: {name} cannot be set; use cfg.replace({name}=...)")

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> FusionConfig:  # type: ignore[override]
        if isinstance(obj, dict) and not kwargs:
            return cls(**obj)
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise ConfigError(_explain(exc)) from None

    @classmethod
    def model_validate_json(cls, json_data: Any, **kwargs: Any) -> FusionConfig:  # type: ignore[override]
        try:
            return super().model_validate_json(json_data, **kwargs)
        except ValidationError as exc:
            raise ConfigError(_explain(exc)) from None

    def model_copy(self, *, update: Any = None, deep: bool = False) -> FusionConfig:  # type: ignore[override]
        """A copy with ``update`` applied, validated (pydantic's own copy would skip the checks)."""
        return self.replace(**(update or {}))

    @model_validator(mode="after")
    def _consistent(self) -> FusionConfig:
        for name in ("min_fusion_ops", "max_fusion_ops", "cache_size", "max_queued_ops", "launch_cache_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cache_dir is not None and not self.cache_dir.strip():
            raise ValueError("cache_dir must name a directory (None: the default one), got ''")
        if not 0 <= self.chunk_budget <= 1:
            raise ValueError(f"chunk_budget must be within [0, 1], got {self.chunk_budget}")
        if self.min_fusion_ops > self.max_fusion_ops:
            raise ValueError(
                f"min_fusion_ops ({self.min_fusion_ops}) must be <= max_fusion_ops ({self.max_fusion_ops})"
            )
        return self

    @property
    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir or os.environ.get("RTXDSL_CACHE_DIR") or _default_cache_dir())

    # ---- the seed's builders --------------------------------------------------------
    def replace(self, **changes: Any) -> FusionConfig:
        """A copy with ``changes`` applied and validated."""
        return FusionConfig(**{**self.model_dump(), **changes})

    def with_enabled(self, enabled: bool) -> FusionConfig:
        return self.replace(enabled=enabled)

    def with_min_fusion_ops(self, n: int) -> FusionConfig:
        return self.replace(min_fusion_ops=n)

    def with_max_fusion_ops(self, n: int) -> FusionConfig:
        return self.replace(max_fusion_ops=n)

    def with_cache_size(self, n: int) -> FusionConfig:
        return self.replace(cache_size=n)

    # ---- files and environment --------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike[str], *, env: bool = True) -> FusionConfig:
        """Read a .toml, .json or .yaml file (top level, or a ``[rtxdsl]`` table); ``RTXDSL_*`` overrides.

        Example:
            >>> cfg = FusionConfig.load("rtxdsl.toml")  # doctest: +SKIP
        """
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"config file: path must be a str or a path, got {path!r}")
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} " + ("is a directory" if p.is_dir() else "does not exist"))
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {str(p)!r} is not UTF-8 text: {exc}") from None
        suffix = p.suffix.lower()
        try:
            if suffix == ".toml":
                try:
                    import tomllib
                except ModuleNotFoundError:  # Python 3.10
                    import tomli as tomllib  # type: ignore[no-redef]
                data = tomllib.loads(text)
            elif suffix == ".json":
                data = json.loads(text)
            elif suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text) or {}
            else:
                raise ConfigError(f"config file {str(p)!r}: unknown format {suffix!r} (use .toml, .json or .yaml)")
        except ConfigError:
            raise
        except Exception as exc:  # parse errors of the three formats
            raise ConfigError(f"config file {str(p)!r} is not valid {suffix[1:]}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a table of settings")
        if isinstance(data.get("rtxdsl"), dict) and len(data) == 1:
            data = data["rtxdsl"]
        if env:
            data = {**data, **env_overrides()}
        try:
            return cls(**data)
        except ConfigError as exc:
            raise ConfigError(f"config file {str(p)!r}: {exc}") from None

    @classmethod
    def from_env(cls) -> FusionConfig:
        """Defaults with ``RTXDSL_<FIELD>`` environment variables applied."""
        return cls(**env_overrides())


def env_overrides() -> dict[str, Any]:
    """``RTXDSL_<FIELD>=value`` for every config field that is set in the environment."""
    out: dict[str, Any] = {}
    for name, info in FusionConfig.model_fields.items():
        raw = os.environ.get(f"RTXDSL_{name.upper()}")
        if raw is None:
            continue
        if info.annotation in (bool, StrictBool | None):
            low = raw.strip().lower()
            if low in ("", "none") and info.annotation is not bool:
                out[name] = None  # an optional switch: unset follows its default source
                continue
            if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ConfigError(f"environment variable RTXDSL_{name.upper()}={raw!r} is not a boolean")
            out[name] = low in ("1", "true", "yes", "on")
        elif info.annotation in (int, float):
            try:
                out[name] = info.annotation(raw)
            except ValueError:
                what = "an integer" if info.annotation is int else "a number"
                raise ConfigError(f"environment variable RTXDSL_{name.upper()}={raw!r} is not {what}") from None
        else:
            out[name] = raw
    return out


def _explain(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field (known: {', '.join(FusionConfig.model_fields)})"
        parts.append(f"{field}: {msg}")
    return "invalid FusionConfig: " + "; ".join(parts)


_default: FusionConfig | None = None


def get_config() -> FusionConfig:
    """The process-wide default config (``RTXDSL_*`` environment applied on first use)."""
    global _default
    if _default is None:
        _default = FusionConfig.from_env()
    return _default


def set_config(config: FusionConfig) -> None:
    """Replace the process-wide default config."""
    global _default
    if not isinstance(config, FusionConfig):
        raise ConfigError(f"set_config expects a FusionConfig, got {type(config).__name__}")
    _default = config
