"""Autograd for kernels: gradient plans (a forward saving row statistics and a fused backward)
and the ``torch.autograd.Function`` that runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from .dtensor import is_dtensor
from .errors import RtxError
from .expr import Expr, substitute, walk
from .handle import KernelHandle
from .lower import Graph
from .lower.analyze import read_srcs
from .lower.vjp import COTANGENT, PRE, SAVED, Gradients
from .ops import REGISTRY, OpKind


@dataclass(frozen=True)
class GradPlan:
    """Forward (outputs + saved statistics) and backward kernels for one input layout.

    ``passthrough``: gradients that are a cotangent as it is (a residual add's), handed on
    without a kernel, as torch's ``AddBackward`` does (gradient key -> the cotangent's name);
    ``backward`` computes the rest (None when nothing is left)."""

    forward: KernelHandle
    backward: KernelHandle | None
    grads: Gradients
    input_names: tuple[str, ...]
    passthrough: tuple[tuple[str, str], ...] = ()
    #: the plan whose backward builds no path from the outputs (by position) the loss does not use
    #: (``lower.vjp.differentiate``'s ``absent``), None where no input's gradient is left; built
    #: once per set, on first use
    without: Callable[[frozenset[int]], GradPlan | None] | None = None
    _without: dict[frozenset[int], GradPlan | None] = field(default_factory=dict, compare=False, repr=False)

    def for_used(self, absent: frozenset[int]) -> GradPlan | None:
        """This plan, or where outputs go unused (``absent``) the one whose backward leaves their
        paths out: a zero cotangent times an infinite derivative (an unused ``log`` of a 0, a
        variance over too few elements) is NaN, which eager, never reaching them, does not add."""
        if not absent or self.without is None:
            return self
        if absent not in self._without:
            self._without[absent] = self.without(absent)
        return self._without[absent]

    @cached_property
    def cotangents_read(self) -> dict[str, frozenset[str]]:
        """The cotangents (``_g<k>``) each gradient reads, by gradient key."""
        out = {key: frozenset({name}) for key, name in self.passthrough}
        for key, e in self.grads.backward:
            names = (n.attr("name") for n in walk([e]) if n.is_var)
            out.setdefault(key, frozenset(n for n in names if n.startswith(COTANGENT)))
        return out

    def gradients(self, feed: Mapping[str, Any]) -> dict[str, Any]:
        """Every gradient by key: the backward kernel's, and the passed-through cotangents."""
        b = self.backward
        outs = dict(b(**{name: feed[name] for name in b.inputs})) if b is not None else {}
        outs.update((key, feed[name]) for key, name in self.passthrough)
        return outs

    def backward_feed(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Everything the backward reads for these inputs, the forward's outputs as empty tensors
        shaped as the forward plans them (cotangents and saved statistics): enough to plan or
        compile the backward without running the forward.

        Example:
            >>> import torch, rtxdsl as rx
            >>> g = rx.compile(rx.softmax(rx.var("x"))).grad_plan(x=torch.empty(4, 8))
            >>> {k: tuple(v.shape) for k, v in g.backward_feed({"x": torch.empty(4, 8)}).items()}
            {'_g0': (4, 8), 'x': (4, 8), '_s0': (4, 1), '_s1': (4, 1)}
        """
        graph = self.forward.analysis(**{n: inputs[n] for n in self.forward.inputs}).graph
        feed = dict(inputs)
        for key, root in graph.outputs:
            info = graph.of(root)
            if key in self.grads.saved_keys:
                feed[key] = torch.empty(info.shape, dtype=info.dtype)
            elif key in self.grads.user_keys:
                feed[f"{COTANGENT}{self.grads.user_keys.index(key)}"] = torch.empty(info.shape, dtype=info.dtype)
        return {name: feed[name] for name in self.backward.inputs}


class GradFunction(torch.autograd.Function):
    """Fused forward saving the row statistics; fused backward reading them.

    An input whose gradient reads only the cotangents of outputs the loss does not use gets no
    gradient (None), as eager torch, where no op's backward reaches it: a leaf's ``.grad`` stays
    None (an optimizer skips it; a zero gradient would decay and move its moments). The other
    unused outputs' cotangents are zeros."""

    @staticmethod
    def forward(ctx: Any, plan: GradPlan, *inputs: Any) -> Any:
        outs = plan.forward(**dict(zip(plan.input_names, inputs)))
        g = plan.grads
        ctx.plan = plan
        results = tuple(outs[k] for k in g.user_keys)
        # (a DTensor's zero cotangent is autograd's to make, placements and all)
        ctx.set_materialize_grads(any(is_dtensor(r) for r in results))
        ctx.metas = [(r.shape, r.dtype, r.device) for r in results]
        ctx.scalars = {i: v for i, v in enumerate(inputs) if not isinstance(v, torch.Tensor)}
        ctx.shapes = [v.shape if isinstance(v, torch.Tensor) else None for v in inputs]
        # only the inputs the backward reads, as eager saves per op (a product with a frozen weight
        # keeps the weight, not its input): a later in-place write to the others is no error
        read = plan.backward.inputs if plan.backward is not None else ()
        kept = [t if name in read else None for name, t in zip(plan.input_names, inputs) if isinstance(t, torch.Tensor)]
        ctx.save_for_backward(*kept, *[outs[k] for k in g.saved_keys])
        ctx.mark_non_differentiable(*[r for r, f in zip(results, g.float_outputs) if not f])
        return results

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        if torch.is_grad_enabled():
            raise RtxError("double backward through an rtxdsl kernel is not supported (create_graph=True)")
        plan: GradPlan = ctx.plan
        g = plan.grads
        saved = iter(ctx.saved_tensors)
        inputs = [ctx.scalars[i] if i in ctx.scalars else next(saved) for i in range(len(plan.input_names))]
        feed = dict(zip(plan.input_names, inputs))
        feed.update(zip(g.saved_keys, saved))
        # outputs the loss does not use (their cotangents None): the backward without their paths
        unused = frozenset(k for k, (gr, f) in enumerate(zip(grads, g.float_outputs)) if f and gr is None)
        used = plan.for_used(unused)
        if used is None:  # no input's gradient reads a cotangent the loss gives
            return (None, *[None for _ in plan.input_names])
        read_by_any = frozenset().union(*used.cotangents_read.values())
        for k, (gr, f, (shape, dtype, device)) in enumerate(zip(grads, g.float_outputs, ctx.metas)):
            name = f"{COTANGENT}{k}"
            if f and (gr is not None or name in read_by_any):  # zeros only where still read
                feed[name] = gr if gr is not None else torch.zeros(shape, dtype=dtype, device=device)
        outs = used.gradients(feed)
        grad_of, read = dict(used.grads.grad_of), used.cotangents_read
        absent = {f"{COTANGENT}{k}" for k in unused}
        grads_in = []
        for name, shape in zip(plan.input_names, ctx.shapes):
            gi = outs[grad_of[name]] if name in grad_of and not read[grad_of[name]] <= absent else None
            grads_in.append(gi if gi is None or gi.shape == shape else gi.expand(shape))
        return (None, *grads_in)


class InForward:
    """The forward of a loss marked ``grad_in_forward=True``: two kernel programs (see
    :func:`in_forward_programs`), the first one's outputs fed to the second, and the cotangent a 1
    of the loss's dtype. ``kept``: the output names of the gradients, saved for the backward to
    scale."""

    def __init__(
        self, first: KernelHandle | None, then: KernelHandle, kept: tuple[str, ...], logits: str, dtype: torch.dtype
    ) -> None:
        self.first, self.then, self.kept, self.logits, self.dtype = first, then, kept, logits, dtype
        self.inputs = tuple(dict.fromkeys((*(first.inputs if first is not None else ()), *then.inputs)))

    def __call__(self, **feed: Any) -> dict[str, Any]:
        outs = dict(self.first(**{n: feed[n] for n in self.first.inputs})) if self.first is not None else {}
        x = feed[self.logits]
        feed = {**feed, **outs, f"{COTANGENT}0": _one(self.dtype, x.device)}
        outs.update(self.then(**{n: feed[n] for n in self.then.inputs}))
        for j in self.kept:
            if outs[j] is x:  # the input's memory holds its gradient now: autograd must know
                torch.autograd.graph.increment_version(x)
        return {"out": outs["out"], **{j: outs[j] for j in self.kept}}


def in_forward_programs(
    forward: Mapping[str, Expr], units: Mapping[str, Expr], logits: str
) -> tuple[dict[str, Expr], dict[str, Expr]]:
    """The outputs of :class:`InForward`'s two programs, from ``forward`` (the loss and its saved
    statistics ``_s<k>``) and ``units`` (gradients reading those and the cotangent ``_g0``).

    One program computes the loss and the gradients, each saved statistic replaced by its own
    expression, so a row kernel reads the logits once for both (Liger-Kernel's cross-entropy); the
    first computes what the gradients reduce of the other inputs alone (``_p<k>``: the count of
    non-ignored targets a mean divides by, which each row's gradient needs before the rows' losses
    are summed), or nothing. Gradients computed by GEMMs (a linear cross-entropy's ``dh``, ``dw``)
    keep the loss kernel apart, first: the GEMMs recompute the product from its statistics."""
    saved = {k: e for k, e in forward.items() if k.startswith(SAVED)}
    if any(REGISTRY[n.op].kind is OpKind.CONTRACTION for n in walk(list(units.values()))):
        return dict(forward), dict(units)
    grads = substitute(list(units.values()), lambda n: saved.get(n.attr("name")) if n.is_var else None)
    apart: list[Expr] = []  # outermost first: a reduction inside another one stays inside it
    inside: set[Expr] = set()
    for n in reversed(walk(grads)):
        if REGISTRY[n.op].kind is OpKind.REDUCTION and n not in inside and not _reads(n, logits):
            apart.append(n)
            inside.update(walk([n]))
    pre = {f"{PRE}{k}": r for k, r in enumerate(apart)}
    read = {r: named_var(k) for k, r in pre.items()}
    user = {k: e for k, e in forward.items() if k not in saved}
    roots = substitute([*user.values(), *grads], lambda n: read.get(n))
    return pre, dict(zip([*user, *units], roots))


def _reads(e: Expr, logits: str) -> bool:
    """Does ``e`` read the values of input ``logits`` or of the cotangent (not only a shape, as
    positions along the classes do)?"""
    stack, seen = [e], set()
    while stack:
        n = stack.pop()
        if n.is_var and n.attr("name") in (logits, f"{COTANGENT}0"):
            return True
        seen.add(n)
        stack.extend(s for s in read_srcs(n) if s not in seen)
    return False


def land(result: torch.Tensor, target: torch.Tensor) -> None:
    """Leave a kernel's ``result`` in ``target``: where the kernel wrote it there itself (``into``)
    only autograd is told (the version counter), otherwise it is copied in. A DTensor's kernel runs
    as a functional op, and its wrapper's ``data_ptr`` says nothing about its pieces: always copied."""
    if not is_dtensor(target) and result.data_ptr() == target.data_ptr() and result.stride() == target.stride():
        torch.autograd.graph.increment_version(target)
    else:
        target.copy_(result)


_ONES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _one(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-dim 1 made once per dtype and device and never written: no fill launch per call."""
    t = _ONES.get((dtype, device))
    if t is None:
        t = _ONES[(dtype, device)] = torch.ones((), dtype=dtype, device=device)
    return t


def dtype_of_input(graph: Graph, name: str) -> torch.dtype:
    return graph.of(next(v for v in graph.inputs if v.attr("name") == name)).dtype


def named_var(name: str) -> Expr:
    return Expr("var", (), {"name": name, "dtype": None})


def gradient_in_forward(outputs: tuple[tuple[str, Expr], ...]) -> str | None:
    """The first input's name when the kernel's one output is a loss marked ``grad_in_forward=True``
    over input tensors (``cross_entropy(logits, ...)``: the logits, whose memory may then hold their
    gradient; ``linear_cross_entropy(h, w, ...)``: the hidden states)."""
    if len(outputs) != 1:
        return None
    root = outputs[0][1]
    if not root.attr("grad_in_forward") or not root.srcs[0].is_var:
        return None
    return root.srcs[0].attr("name")
