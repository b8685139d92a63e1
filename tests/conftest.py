"""Shared test setup: interpreter mode, a private kernel cache, tolerances, references."""

from __future__ import annotations

import os
import subprocess
import tempfile

# Before triton or rtxdsl are imported: CPU tensors run under Triton's interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("RTXDSL_CACHE_DIR", tempfile.mkdtemp(prefix="rtxdsl-test-cache-"))
# every interpreted launch checks that each load, store and atomic lies inside its tensors
os.environ.setdefault("RTXDSL_CHECK_BOUNDS", "1")

from collections import Counter  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import rtxdsl as rx  # noqa: E402

try:  # Triton's interpreter checks every int32 add and mul for overflow, a quarter of its time on
    # these kernels: the bounds checks above subsume it (an overflowed offset addresses no tensor)
    import dataclasses

    from triton.runtime import interpreter as _interpreter

    _builder = _interpreter.interpreter_builder
    _builder.options = dataclasses.replace(_builder.options, sanitize_overflow=False)
except (ImportError, AttributeError, TypeError):  # another Triton: its own default
    pass

# (dtype, atol, rtol): kernels compute in fp32, so half-type error is the output rounding.
FLOAT_TOLERANCES = [
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 1e-3, 1e-3),
    (torch.bfloat16, 8e-3, 1.6e-2),
]


def assert_grads_agree(loss, want_loss, leaves: list, atol: float, rtol: float) -> None:
    """The gradients of ``loss`` and of a peer's ``want_loss`` (``leaves``: ``(name, ours, theirs)``)
    agree, ``atol`` scaled by the largest expected magnitude (at least 1)."""
    grads = torch.autograd.grad(loss, [ours for _, ours, _ in leaves])
    want_grads = torch.autograd.grad(want_loss, [theirs for _, _, theirs in leaves])
    for (name, _, _), got, want in zip(leaves, grads, want_grads):
        scale = max(1.0, want.abs().max().item())
        assert_close(got, want, atol * scale, rtol, f"d{name}")


def assert_close(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float, what: str = "") -> None:
    """``out`` against a float64 (or exact) reference, NaNs in the same places."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if not ref.dtype.is_floating_point:
        assert torch.equal(out, ref), f"{what}: {out} != {ref}"
        return
    # the float64 reference rounded to the output dtype (so overflow to inf agrees), compared in float64
    want = ref.to(out.dtype).double() if out.dtype.is_floating_point else ref.double()
    torch.testing.assert_close(out.double(), want, atol=atol, rtol=rtol, equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.fixture(autouse=True)
def _fresh_stats():
    rx.reset_fusion_stats()
    yield


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


#: OpInfo conformance counts (agree / tried / skip), summed over xdist workers at the end
OPINFO: Counter[str] = Counter()


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the counts to the controller
        session.config.workeroutput["opinfo"] = dict(OPINFO)


def pytest_testnodedown(node, error):
    OPINFO.update(node.workeroutput.get("opinfo", {}))


def pytest_terminal_summary(terminalreporter):
    if OPINFO["tried"]:
        terminalreporter.write_line(
            f"OpInfo: {OPINFO['agree']} samples agree with torch / {OPINFO['tried']} tried "
            f"({OPINFO['skip']} skipped: arguments outside rtxdsl's API)"
        )


def commit_seed(env: str) -> int:
    """A fuzz seed: ``env`` when set, else one from the commit, so each submission draws programs
    no earlier run drew (the header of every pytest run prints it; set ``env`` to reproduce)."""
    if os.environ.get(env):
        return int(os.environ[env])
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
        return int(head[:7], 16)
    except (OSError, subprocess.CalledProcessError, ValueError):
        return 0


def pytest_report_header(config) -> str:
    seeds = {env: commit_seed(env) for env in ("RTXDSL_FUZZ_SEED", "RTXDSL_LAZY_FUZZ_SEED", "RTXDSL_OPINFO_OFFSET")}
    return "fuzz seeds from the commit: " + ", ".join(f"{env}={s}" for env, s in seeds.items()) + " (set to reproduce)"


class ShapesSeen(torch.utils._python_dispatch.TorchDispatchMode):
    """Every tensor shape an aten op returns while the mode is on (our kernels' buffers included)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out
