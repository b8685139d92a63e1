"""What the modules below ``runtime`` (torch integration, DTensor calls, prepared calls,
gradient plans and inspection) may ask of a kernel.

``runtime.Kernel`` implements it; the modules below runtime hold kernels through this protocol,
so the one-way module graph is also one-way in what is read: no ``Any`` handles, no private fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from .config import FusionConfig
from .expr import Expr


class KernelHandle(Protocol):
    """A compiled kernel, as the modules below ``runtime`` see it."""

    inputs: tuple[str, ...]
    op_key: str  # its name for ``rtxdsl::kernel`` (structural, the same in every process)

    @property
    def outputs(self) -> tuple[str, ...]: ...

    @property
    def returns_tensor(self) -> bool: ...

    @property
    def expressions(self) -> tuple[tuple[str, Expr], ...]: ...

    @property
    def variables(self) -> tuple[Expr, ...]: ...

    @property
    def config(self) -> FusionConfig: ...

    @property
    def draws_seeds(self) -> bool: ...

    @property
    def shared_outputs(self) -> tuple[str, ...]: ...

    @property
    def torch_op(self) -> Any: ...

    @property
    def stats(self) -> Any: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def reference(self, tensors: tuple) -> Any: ...

    def derived(self, outputs: Mapping[str, Expr]) -> KernelHandle: ...

    def reference_on(self, tensors: tuple[Any, ...]) -> Any: ...

    def graph_run(self, tensors: tuple[Any, ...]) -> Any | None: ...

    def saving_plan(self, values: tuple[Any, ...], needs: str) -> Any: ...
