"""Kernels as ``torch.library`` custom ops: what ``torch.compile`` sees.

Inside ``torch.compile`` a ``Kernel`` call becomes one node of ``rtxdsl::kernel(key, inputs)``, a
single op registered at import (registering an op per kernel costs ~4 ms, too much for the lazy
stream's plans): ``key`` names the kernel in this process. ``k.torch_op`` is the kernel's own op
(``rtxdsl::k_<hash>``, named from its expressions, input names and config, so stable across
processes), taking its inputs positionally and returning its outputs (a tuple in ``k.outputs``
order for several), made on first use. Both fake their results by running the kernel's torch
reference op by op on the fake tensors (symbolic sizes included, no launch), and differentiate
by recomputing the fused forward with grad and running rtxdsl's fused backward.
"""

from __future__ import annotations

import hashlib
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .errors import RtxError

_OPS: dict[str, Any] = {}  # op name -> the registered op (a structure registers once per process)

#: kernels by their key in this process: what ``rtxdsl::kernel`` (the op torch.compile traces) calls
KERNELS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_keys = itertools.count()


def register_kernel(kernel: Any) -> str:
    """A key for ``kernel`` in ``KERNELS`` (cheap: registering a custom op per kernel costs ~4 ms)."""
    key = f"k{next(_keys)}"
    KERNELS[key] = kernel
    return key


def _as_list(kernel: Any, result: Any) -> list[Tensor]:
    return [result] if kernel.outputs == ("out",) else [result[k] for k in kernel.outputs]


@torch.library.custom_op("rtxdsl::kernel", mutates_args=())
def kernel_op(key: str, inputs: list[Tensor]) -> list[Tensor]:
    """Any rtxdsl kernel, by key: the node a traced ``Kernel`` call becomes in a torch.compile graph."""
    kernel = KERNELS[key]
    return _as_list(kernel, kernel(*inputs))


@kernel_op.register_fake
def _kernel_fake(key: str, inputs: list[Tensor]) -> list[Tensor]:
    kernel = KERNELS[key]
    return _as_list(kernel, kernel.reference_on(tuple(inputs)))


def _kernel_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.key = inputs[0]
    ctx.save_for_backward(*inputs[1])


def _kernel_backward(ctx: Any, grads: list[Tensor]) -> tuple[None, list[Tensor | None]]:
    saved = ctx.saved_tensors
    out = kernel_grad_op(ctx.key, list(saved), list(grads))
    return None, [g if t.is_floating_point() else None for g, t in zip(out, saved)]


@torch.library.custom_op("rtxdsl::kernel_grad", mutates_args=())
def kernel_grad_op(key: str, inputs: list[Tensor], grads: list[Tensor | None]) -> list[Tensor]:
    """Input gradients of ``rtxdsl::kernel`` (an op too, so AOT autograd does not trace into it)."""
    kernel = KERNELS[key]
    got = _recompute_grads(kernel, lambda *ts: _as_list(kernel, kernel(*ts)), tuple(inputs), grads)
    return [g if g is not None else torch.zeros_like(t) for g, t in zip(got, inputs)]


@kernel_grad_op.register_fake
def _kernel_grad_fake(key: str, inputs: list[Tensor], grads: list[Tensor | None]) -> list[Tensor]:
    return [torch.empty_like(t) for t in inputs]


kernel_op.register_autograd(_kernel_backward, setup_context=_kernel_setup)


def _recompute_grads(kernel: Any, run: Callable[..., Any], saved: tuple[Tensor, ...], grads: Any) -> tuple:
    """Input gradients: the fused forward again with grad, then rtxdsl's fused backward."""
    if kernel.draws_seeds:
        raise RtxError("this kernel draws random seeds per call: differentiate it outside torch.compile")
    ins = [t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, Tensor) else t for t in saved]
    with torch.enable_grad():
        outs = run(*ins)
    outs = outs if isinstance(outs, (list, tuple)) else (outs,)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    wanted = [t for t in ins if isinstance(t, Tensor) and t.requires_grad]
    if not pairs or not wanted:
        return tuple(None for _ in ins)
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
    return tuple(next(got) if isinstance(t, Tensor) and t.requires_grad else None for t in ins)


def op_name(exprs: tuple[tuple[str, Any], ...], inputs: tuple[str, ...], config: Any) -> str:
    text = "|".join([*(f"{k}={e.digest}" for k, e in exprs), ",".join(inputs), repr(config)])
    return "k_" + hashlib.sha256(text.encode()).hexdigest()[:16]


#: schema types of a call's inputs: a tensor, or a python number (kept as its own type: an int
#: scalar types a result differently from a float one)
KINDS = {bool: "bool", int: "int", float: "float"}


def kinds_of(values: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple("Tensor" if isinstance(v, Tensor) else KINDS[type(v)] for v in values)


def make_op(kernel: Any, kinds: tuple[str, ...] | None = None) -> Any:
    """Register (once per structure) and return the kernel's own op, ``rtxdsl::k_<hash>``: every
    input a tensor, or with ``kinds`` some of them python numbers (``k_<hash>_<kinds>``)."""
    kinds = kinds or ("Tensor",) * len(kernel.inputs)
    name = op_name(kernel.expressions, kernel.inputs, kernel.config)
    if set(kinds) != {"Tensor"}:
        name += "_" + "".join(k[0].lower() for k in kinds)
    if name in _OPS:
        return _OPS[name]
    inputs, outputs, run = kernel.inputs, kernel.outputs, kernel
    single = outputs == ("out",)
    args = ", ".join(f"{n}: {k}" for n, k in zip(inputs, kinds))
    ret = "Tensor" if single else f"tuple[{', '.join(['Tensor'] * len(outputs))}]"
    # a fixed template: input names are identifiers (vars), kinds come from KINDS, nothing else
    src = f"def {name}({args}) -> {ret}:\n    return PACK(RUN({', '.join(inputs)}))\n"
    scope: dict[str, Any] = {"Tensor": Tensor, "RUN": run, "PACK": _packer(outputs, single)}
    exec(src, scope)  # noqa: S102
    op = torch.library.custom_op(f"rtxdsl::{name}", mutates_args=())(scope[name])

    @op.register_fake
    def _fake(*values: Any) -> Any:
        return _packer(outputs, single)(kernel.reference_on(values))

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*[v for v in inputs if isinstance(v, Tensor)])
        ctx.numbers = {i: v for i, v in enumerate(inputs) if not isinstance(v, Tensor)}

    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        saved = iter(ctx.saved_tensors)
        values = tuple(ctx.numbers[i] if i in ctx.numbers else next(saved) for i in range(len(inputs)))
        return _recompute_grads(kernel, lambda *vs: _packer(outputs, single)(run(*vs)), values, grads)

    op.register_autograd(backward, setup_context=setup_context)
    _OPS[name] = op
    return op


def _packer(outputs: tuple[str, ...], single: bool) -> Callable[[Any], Any]:
    if single:
        return lambda r: r
    return lambda r: tuple(r[k] for k in outputs)
