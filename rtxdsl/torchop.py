"""Kernels as ``torch.library`` custom ops: what ``torch.compile`` sees.

Inside ``torch.compile`` a ``Kernel`` call becomes one node of ``rtxdsl::kernel(key, inputs)``, a
single op registered at import (registering an op per kernel costs ~4 ms, too much for the lazy
stream's plans): ``key`` names the kernel in this process. ``k.torch_op`` is the kernel's own op
(``rtxdsl::k_<hash>``, named from its expressions, input names and config, so stable across
processes), taking its inputs positionally and returning its outputs (a tuple in ``k.outputs``
order for several), made on first use. Both fake their results by running the kernel's torch
reference op by op on the fake tensors (symbolic sizes included, no launch), and differentiate
by recomputing the fused forward with grad and running rtxdsl's fused backward.

A differentiated call at fixed sizes is ``rtxdsl::kernel_saving`` instead: its gradient plan's
forward, whose row statistics autograd saves for the fused backward (no forward again).

Every output of every op here, real or fake, is laid out by one rule (:func:`op_outputs`): a
tensor of its own, contiguous. The kernels write such buffers; the torch reference a fake runs
keeps its inputs' order instead (a transposed input gives a transposed result), and a real call
can hand back an input, a view of one or a broadcast gradient: both are restated by the rule, so
Inductor's stride checks and the graphs it caches on disk see what the kernels return.

On CUDA with fixed sizes, AOT autograd replaces these ops by their launches
(:func:`expose_launches`, ``wrap_triton``), so Inductor sees each generated kernel.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

from .errors import RtxError
from .handle import KernelHandle
from .lower.vjp import COTANGENT

_OPS: dict[str, Any] = {}  # op name -> the registered op (a structure registers once per process)


class _LiveKernels:
    """Kernels by their structural key: what ``rtxdsl::kernel`` (the op torch.compile traces) calls.

    Several live kernels can share a key (the same expression compiled twice); any of them serves,
    and one dying leaves the others reachable (a weak dict holding the last one registered would
    forget the key while the first is still in use)."""

    def __init__(self) -> None:
        self._refs: dict[str, list[weakref.ref[KernelHandle]]] = {}

    def add(self, key: str, kernel: KernelHandle) -> None:
        refs = [r for r in self._refs.get(key, ()) if r() is not None]
        refs.append(weakref.ref(kernel, lambda _, key=key: self._prune(key)))
        self._refs[key] = refs

    def _prune(self, key: str) -> None:
        refs = [r for r in self._refs.get(key, ()) if r() is not None]
        if refs:
            self._refs[key] = refs
        else:
            self._refs.pop(key, None)

    def get(self, key: str) -> KernelHandle | None:
        return next((k for r in reversed(self._refs.get(key, ())) if (k := r()) is not None), None)


KERNELS = _LiveKernels()


def register_kernel(kernel: KernelHandle, into: Any = (), seeds: bool = False) -> str:
    """``kernel``'s key in ``KERNELS``: a hash of its structure (expressions, input order, config,
    return form, inputs it writes into, random seeds), so a graph torch saved in its on-disk
    compile cache names the same kernel in any process (cheap: no custom op is registered)."""
    key = op_name(kernel.expressions, kernel.inputs, kernel.config, kernel.returns_tensor)
    if into or seeds:
        key += "_" + hashlib.sha256(repr((sorted(dict(into).items()), seeds)).encode()).hexdigest()[:8]
    KERNELS.add(key, kernel)
    return key


def kernel_of(key: str) -> Any:
    """The kernel a graph names, built in this process, or a clear error (never another kernel)."""
    kernel = KERNELS.get(key)
    if kernel is None:
        raise RtxError(
            f"a compiled graph calls rtxdsl kernel {key!r}, which this process has not built: compile the "
            "same expression (rx.compile, or run the rtxdsl code once) before running the graph, or clear "
            "torch's compile cache"
        )
    return kernel


def _as_list(kernel: KernelHandle, result: Any) -> list[Tensor]:
    return [result] if kernel.returns_tensor else [result[k] for k in kernel.outputs]


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``torch.empty(shape)``'s strides: row-major, a zero-size dim counted as one."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def op_outputs(results: Any, inputs: Any = (), fake: bool = False) -> list[Any]:
    """The outputs of an rtxdsl op as it returns them, real and fake alike: each a tensor of its own
    (no alias of an input or of another output: custom ops may return neither) with contiguous
    strides. A real result already laid out so is returned as it is (kernels allocate their outputs
    so); another (an input handed through, a view of one, a broadcast gradient) is copied; a fake
    one (``fake``: the torch reference's layout) is restated. None stays None (no gradient)."""
    if fake:
        return [None if t is None else t.new_empty(t.shape) for t in results]
    taken = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, Tensor) and t.numel()}
    out = []
    for t in results:
        if t is not None:
            mem = t.untyped_storage().data_ptr() if t.numel() else None
            if mem in taken or t.stride() != contiguous_strides(t.shape):
                t = t.clone(memory_format=torch.contiguous_format)
                mem = t.untyped_storage().data_ptr() if t.numel() else None
            if mem is not None:
                taken.add(mem)
        out.append(t)
    return out


@torch.library.custom_op("rtxdsl::kernel", mutates_args=())
def kernel_op(key: str, inputs: list[Tensor]) -> list[Tensor]:
    """Any rtxdsl kernel, by key: the node a traced ``Kernel`` call becomes in a torch.compile graph."""
    kernel = kernel_of(key)
    return op_outputs(_as_list(kernel, kernel(*inputs)), inputs)


@kernel_op.register_fake
def _kernel_fake(key: str, inputs: list[Tensor]) -> list[Tensor]:
    kernel = kernel_of(key)
    return op_outputs(_as_list(kernel, kernel.reference_on(tuple(inputs))), fake=True)


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
    kernel = kernel_of(key)
    got = _recompute_grads(kernel, lambda *ts: _as_list(kernel, kernel(*ts)), tuple(inputs), grads)
    # a residual's two gradients are one tensor, the cotangent itself; a broadcast input's is expanded
    got = [g if g is not None else t.new_zeros(t.shape) for g, t in zip(got, inputs)]
    return op_outputs(got, (*inputs, *grads))


@kernel_grad_op.register_fake
def _kernel_grad_fake(key: str, inputs: list[Tensor], grads: list[Tensor | None]) -> list[Tensor]:
    return op_outputs(inputs, fake=True)  # each input's shape and dtype


kernel_op.register_autograd(_kernel_backward, setup_context=_kernel_setup)


def fixed_sizes(values: Any) -> bool:
    """Are the tensors' sizes and strides plain ints (not torch.compile's symbolic sizes)?"""
    return all(isinstance(s, int) for t in values if isinstance(t, Tensor) for s in (*t.shape, *t.stride()))


def _decomposable(types: Any) -> bool:
    """May this call be replaced by its launches: tensors torch.compile traces (no subclass such
    as DTensor), and not inside ``torch.export`` (which keeps custom ops whole, as for triton_op)?"""
    from torch.export._trace import custom_triton_ops_decomposition_disabled

    known = all(issubclass(t, (FakeTensor, FunctionalTensor)) or t is Tensor for t in types)
    return known and not custom_triton_ops_decomposition_disabled()


def expose_launches(op: Any, unpack: Callable[[tuple], tuple[Any, tuple, Callable[[Any], Any]]]) -> None:
    """On CUDA, torch.compile's graph holds the kernel's launches instead of the opaque op.

    This is the decomposition ``torch.library.triton_op`` registers (under AOT autograd's
    functionalization, run a body of torch allocations and ``wrap_triton`` launches, so Inductor
    sees and schedules each generated Triton kernel), made conditional: ``triton_op`` always
    decomposes, and its body would have to trace on CPU (the interpreter reads data pointers) and
    with symbolic sizes (one launch plan per size: a recompile each). Where
    :meth:`Kernel.graph_run` says a call is not one fixed list of launches, the op stays opaque.
    ``unpack(args)`` gives (kernel, its input values, how to pack its result as the op's).
    """

    def decompose(mode: Any, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        return _launches_or_opaque(mode, func, types, args, kwargs, *unpack(args))

    op.register_torch_dispatch(FunctionalTensorMode, decompose)


def _launches_or_opaque(
    mode: Any, func: Any, types: Any, args: tuple, kwargs: dict, kernel: KernelHandle, values: tuple, pack: Callable
) -> Any:
    """Under functionalization: the call's launches (:meth:`Kernel.graph_run`), else the op whole."""
    run = kernel.graph_run(values) if _decomposable(types) else None
    if run is None:
        return mode.__torch_dispatch__(func, types, args, kwargs)
    with mode:
        return pack(run(values))


expose_launches(kernel_op, lambda args: (kernel_of(args[0]), tuple(args[1]), lambda r: _as_list(kernel_of(args[0]), r)))


def _forward_values(plan: Any, inputs: list[Tensor]) -> tuple[Tensor, ...]:
    feed = dict(zip(plan.input_names, inputs))
    return tuple(feed[n] for n in plan.forward.inputs)


def _with_saved(plan: Any, outs: dict[str, Tensor]) -> list[Tensor]:
    g = plan.grads
    return [outs[k] for k in (*g.user_keys, *g.saved_keys)]


@torch.library.custom_op("rtxdsl::kernel_saving", mutates_args=())
def saving_op(key: str, needs: str, inputs: list[Tensor]) -> list[Tensor]:
    """A differentiated call of kernel ``key`` inside ``torch.compile`` (``needs``: one 0/1 per
    input, which require grad): its gradient plan's forward kernel, returning the call's outputs,
    then the row statistics the fused backward reads (saved by autograd: no forward again).

    At symbolic sizes a plan (made for fixed sizes) cannot say the statistics' shapes: the call
    is then ``rtxdsl::kernel`` (AOT autograd's graph holds that op; its fake lists the outputs
    only) and the backward runs the forward again, as ``rtxdsl::kernel_grad`` does."""
    plan = kernel_of(key).saving_plan(tuple(inputs), needs)
    return op_outputs(_with_saved(plan, plan.forward(*_forward_values(plan, inputs))), inputs)


@saving_op.register_fake
def _saving_fake(key: str, needs: str, inputs: list[Tensor]) -> list[Tensor]:
    kernel = kernel_of(key)
    if not fixed_sizes(inputs):
        return op_outputs(_as_list(kernel, kernel.reference_on(tuple(inputs))), fake=True)
    plan = kernel.saving_plan(tuple(inputs), needs)
    return op_outputs(_with_saved(plan, plan.forward.reference_on(_forward_values(plan, inputs))), fake=True)


def _saving_setup(ctx: Any, inputs: tuple[Any, ...], output: list[Tensor]) -> None:
    ctx.key, ctx.needs, values = inputs
    ctx.n = len(values)
    ctx.save_for_backward(*values, *output[len(kernel_of(ctx.key).outputs) :])


def _saving_backward(ctx: Any, grads: list[Tensor]) -> tuple[None, None, list[Tensor | None]]:
    saved = ctx.saved_tensors
    inputs, stats = list(saved[: ctx.n]), list(saved[ctx.n :])
    kernel = kernel_of(ctx.key)
    if not fixed_sizes(inputs):  # traced at symbolic sizes: nothing was saved, the forward runs again
        got = kernel_grad_op(ctx.key, inputs, grads[: len(kernel.outputs)])
        return None, None, [g if t.is_floating_point() else None for g, t in zip(got, inputs)]
    plan = kernel.saving_plan(tuple(inputs), ctx.needs)
    if len(stats) != len(plan.grads.saved_keys):  # never guess which statistic is which
        raise RtxError(
            f"the gradient plan reads {len(plan.grads.saved_keys)} saved statistics, the forward saved {len(stats)}"
        )
    return None, None, backward_of(plan, inputs, stats, grads)


def backward_of(plan: Any, inputs: list[Tensor], stats: list[Tensor], grads: list[Tensor]) -> list[Tensor | None]:
    """Input gradients from the saved statistics through the fused backward kernel's op (its
    launches, in a CUDA graph at fixed sizes); None for an input without one."""
    g = plan.grads
    feed = dict(zip(plan.input_names, inputs))
    feed.update(zip(g.saved_keys, stats))
    # custom ops' autograd hands zeros for an output nothing read (grads are materialized)
    feed.update((f"{COTANGENT}{i}", grad) for i, (grad, floating) in enumerate(zip(grads, g.float_outputs)) if floating)
    backward = plan.backward
    got = (
        {}
        if backward is None
        else dict(zip(backward.outputs, kernel_op(backward.op_key, [feed[n] for n in backward.inputs])))
    )
    got.update((key, feed[name].clone()) for key, name in plan.passthrough)  # never an alias of an input
    grad_of = dict(g.grad_of)
    return [got[grad_of[n]].expand(t.shape) if n in grad_of else None for n, t in zip(plan.input_names, inputs)]


saving_op.register_autograd(_saving_backward, setup_context=_saving_setup)


def _saving_in_graph(mode: Any, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
    """``rtxdsl::kernel_saving`` under AOT autograd: at symbolic sizes ``rtxdsl::kernel`` (as its
    fake says); at fixed sizes its plan's forward, launched in the graph on CUDA."""
    key, needs, inputs = args
    if not fixed_sizes(inputs):
        with mode:
            return kernel_op(key, list(inputs))
    plan = kernel_of(key).saving_plan(tuple(inputs), needs)
    pack = partial(_with_saved, plan)
    return _launches_or_opaque(mode, func, types, args, kwargs, plan.forward, _forward_values(plan, inputs), pack)


saving_op.register_torch_dispatch(FunctionalTensorMode, _saving_in_graph)


def _recompute_grads(kernel: KernelHandle, run: Callable[..., Any], saved: tuple[Tensor, ...], grads: Any) -> tuple:
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


def op_name(exprs: tuple[tuple[str, Any], ...], inputs: tuple[str, ...], config: Any, single: bool) -> str:
    """``k_<hash>`` of the expressions, input order, config and return form (a tensor or a tuple)."""
    text = "|".join([*(f"{k}={e.digest}" for k, e in exprs), ",".join(inputs), repr(config), str(single)])
    return "k_" + hashlib.sha256(text.encode()).hexdigest()[:16]


#: schema types of a call's inputs: a tensor, or a python number (kept as its own type: an int
#: scalar types a result differently from a float one)
KINDS = {bool: "bool", int: "int", float: "float"}


def kinds_of(values: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple("Tensor" if isinstance(v, Tensor) else KINDS[type(v)] for v in values)


def own_op_name(kernel: KernelHandle, kinds: tuple[str, ...] | None = None) -> str:
    """The name of the kernel's own op in the ``rtxdsl`` namespace: ``k_<hash>``, or with ``kinds``
    (some inputs python numbers) ``k_<hash>_<kinds>``."""
    name = op_name(kernel.expressions, kernel.inputs, kernel.config, kernel.returns_tensor)
    if kinds and set(kinds) != {"Tensor"}:
        name += "_" + "".join(k[0].lower() for k in kinds)
    return name


def make_op(kernel: KernelHandle, kinds: tuple[str, ...] | None = None) -> Any:
    """Register (once per structure) and return the kernel's own op, ``rtxdsl::k_<hash>``: every
    input a tensor, or with ``kinds`` some of them python numbers (``k_<hash>_<kinds>``)."""
    kinds = kinds or ("Tensor",) * len(kernel.inputs)
    name = own_op_name(kernel, kinds)
    if name in _OPS:
        return _OPS[name]
    inputs, outputs, run = kernel.inputs, kernel.outputs, kernel
    single = kernel.returns_tensor
    args = ", ".join(f"{n}: {k}" for n, k in zip(inputs, kinds))
    ret = "Tensor" if single else f"tuple[{', '.join(['Tensor'] * len(outputs))}]"
    # a fixed template: input names are identifiers (vars), kinds come from KINDS, nothing else
    values = ", ".join(inputs)
    src = f"def {name}({args}) -> {ret}:\n    return PACK(RUN({values}), ({values}{',' if inputs else ''}))\n"
    scope: dict[str, Any] = {"Tensor": Tensor, "RUN": run, "PACK": _laid_out(outputs, single)}
    exec(src, scope)  # noqa: S102
    op = torch.library.custom_op(f"rtxdsl::{name}", mutates_args=())(scope[name])

    @op.register_fake
    def _fake(*values: Any) -> Any:
        return _laid_out(outputs, single, fake=True)(kernel.reference_on(values))

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*[v for v in inputs if isinstance(v, Tensor)])
        ctx.numbers = {i: v for i, v in enumerate(inputs) if not isinstance(v, Tensor)}

    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        if not ctx.numbers:  # through rtxdsl::kernel_grad: an op, so AOT autograd does not trace into it
            saved = list(ctx.saved_tensors)
            got = kernel_grad_op(kernel.op_key, saved, list(grads))
            return tuple(g if t.is_floating_point() else None for g, t in zip(got, saved))
        saved = iter(ctx.saved_tensors)
        values = tuple(ctx.numbers[i] if i in ctx.numbers else next(saved) for i in range(len(inputs)))
        return _recompute_grads(kernel, lambda *vs: _packer(outputs, single)(run(*vs)), values, grads)

    op.register_autograd(backward, setup_context=setup_context)
    expose_launches(op, lambda args: (kernel, tuple(args), _packer(outputs, single)))
    _OPS[name] = op
    return op


def _packer(outputs: tuple[str, ...], single: bool) -> Callable[[Any], Any]:
    if single:
        return lambda r: r
    return lambda r: tuple(r[k] for k in outputs)


def _laid_out(outputs: tuple[str, ...], single: bool, fake: bool = False) -> Callable[..., Any]:
    """``f(result, inputs)``: a kernel's result (a tensor, or a dict by output key) as its own op
    returns it, each output laid out by :func:`op_outputs`."""
    listed = (lambda r: [r]) if single else (lambda r: [r[k] for k in outputs])
    packed = (lambda ts: ts[0]) if single else tuple
    return lambda r, ins=(): packed(op_outputs(listed(r), ins, fake))
