"""Autograd: symbolic vector-Jacobian products, compiled through the same fusion pipeline.

When an input requires grad, a kernel call goes through :class:`_Apply`, a
``torch.autograd.Function``. Its plan, built once per input layout, holds:

* a forward kernel computing the outputs plus the row statistics the backward reads
  (every reduction of the forward: max, sum of exp, mean, rstd...): saved, not recomputed;
* a backward kernel computing every needed input gradient from the forward inputs, those
  statistics and the output cotangents. Cheap elementwise values are recomputed inside it,
  not saved, and broadcast operands get their gradient summed back to their shape, so the
  backward is fused like any expression (gelu(x + b): one elementwise kernel plus the
  bias reduction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .analyzer import is_leaf
from .bind import Bound, Info, infer_all
from .errors import RtxError
from .expr import Expr, node, walk
from .ops import REGISTRY, OpKind
from .ops.derivatives import D
from .ops.reduction import axes_of

if TYPE_CHECKING:
    from .runtime import Kernel


def _sum_to(c: Expr, have: tuple[int, ...], want: tuple[int, ...]) -> Expr:
    """Sum a cotangent over the dims its operand was broadcast along.

    A cotangent smaller than its operand (it broadcasts to it) is left as it is: it is
    expanded on the host, for free, when handed back to autograd.
    """
    if len(have) < len(want):
        have = (1,) * (len(want) - len(have)) + tuple(have)
    lead = len(have) - len(want)
    keep = tuple(lead + i for i, s in enumerate(want) if s == 1 and have[lead + i] != 1)
    if keep:
        c = node("sum", c, axis=keep, keepdim=True)
    if lead:
        c = node("sum", c, axis=tuple(range(lead)), keepdim=False)
    return c


@dataclass
class GradPlan:
    """Forward (outputs + saved statistics) and backward kernels for one input layout."""

    forward: Kernel
    backward: Kernel
    user_keys: list[str]
    saved_keys: list[str]
    input_names: tuple[str, ...]
    grad_of: dict[str, str]  # input name -> backward output key
    float_outputs: list[bool]


def build(kernel: Kernel, bound: Bound, needs: list[bool]) -> GradPlan:
    """Differentiate ``kernel``'s bound graph with respect to the inputs flagged in ``needs``."""
    from .runtime import Kernel  # runtime imports this module lazily too

    info: dict[int, Info] = dict(bound.info)
    keep: list[Expr] = []  # new nodes, alive while their ids key ``info``
    grads: dict[int, Expr] = {}
    floats = []
    for k, (_, root) in enumerate(bound.outputs):
        ri = bound.of(root)
        floats.append(ri.dtype.is_floating_point)
        if not ri.dtype.is_floating_point:
            continue
        g = Expr("var", (), {"name": f"_g{k}", "dtype": None})
        info[id(g)] = Info.tensor(ri.shape, ri.dtype)
        keep.append(g)
        grads[id(root)] = g if id(root) not in grads else node("add", grads[id(root)], g)

    def typed(e: Expr) -> Info:
        keep.extend(infer_all([e], info))
        return info[id(e)]

    for n in reversed(bound.nodes):
        g = grads.get(id(n))
        if g is None or is_leaf(n, bound):
            continue
        opdef = REGISTRY[n.op]
        if opdef.derivative is None:
            raise RtxError(f"op {n.op!r} has no derivative rule")
        y = n
        if opdef.kind is OpKind.REDUCTION and not n.attr("keepdim"):
            axes = axes_of(n.attr("axis"), len(bound.of(n.srcs[0]).shape))
            g, y = node("unsqueeze", g, axes=axes), node("unsqueeze", n, axes=axes)
        rule_in = D(n, g, y, g_ndim=len(typed(g).shape), n_ndim=len(info[id(n)].shape))
        for s, c in zip(n.srcs, opdef.derivative(rule_in)):
            si = info[id(s)]
            if c is None or si.is_scalar or not si.dtype.is_floating_point:
                continue
            c = _sum_to(c, typed(c).shape, si.shape)
            grads[id(s)] = c if id(s) not in grads else node("add", grads[id(s)], c)

    # the forward's reductions are saved by the forward kernel and read back as inputs
    reductions = [n for n in bound.nodes if REGISTRY[n.op].kind is OpKind.REDUCTION]
    saved = {id(r): Expr("var", (), {"name": f"_s{k}", "dtype": None}) for k, r in enumerate(reductions)}
    outputs: dict[str, Expr] = {}
    grad_of: dict[str, str] = {}
    for v, need in zip(kernel._vars, needs):
        if not need or id(v) not in grads:
            continue
        e = grads[id(v)]
        if typed(e).dtype != bound.of(v).dtype:
            e = node("cast", e, dtype=bound.of(v).dtype)
        grad_of[v.attr("name")] = key = f"_d{len(outputs)}"
        outputs[key] = _substitute(e, saved)
    used = {id(n) for e in outputs.values() for n in walk([e])}
    saved_keys = [f"_s{k}" for k, r in enumerate(reductions) if id(saved[id(r)]) in used]
    fwd_outputs = dict(kernel._outputs)
    fwd_outputs.update({f"_s{k}": r for k, r in enumerate(reductions) if f"_s{k}" in saved_keys})
    if not outputs:
        raise RtxError("no input that requires grad reaches a floating-point output")
    return GradPlan(
        forward=Kernel(fwd_outputs, kernel._config, stats=kernel._stats),
        backward=Kernel(outputs, kernel._config, stats=kernel._stats),
        user_keys=[k for k, _ in kernel._outputs],
        saved_keys=saved_keys,
        input_names=kernel.inputs,
        grad_of=grad_of,
        float_outputs=floats,
    )


def _substitute(e: Expr, repl: dict[int, Expr]) -> Expr:
    memo: dict[int, Expr] = {}
    for n in walk([e]):
        if id(n) in repl:
            memo[id(n)] = repl[id(n)]
        elif n.srcs:
            srcs = tuple(memo[id(s)] for s in n.srcs)
            memo[id(n)] = n if all(a is b for a, b in zip(srcs, n.srcs)) else Expr(n.op, srcs, n.attr_dict)
        else:
            memo[id(n)] = n
    return memo[id(e)]


class _Apply(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: GradPlan, *tensors: torch.Tensor) -> Any:
        outs = plan.forward(**dict(zip(plan.input_names, tensors)))
        ctx.plan = plan
        ctx.save_for_backward(*tensors, *[outs[k] for k in plan.saved_keys])
        results = tuple(outs[k] for k in plan.user_keys)
        ctx.mark_non_differentiable(*[r for r, f in zip(results, plan.float_outputs) if not f])
        return results

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        if torch.is_grad_enabled():
            raise RtxError("double backward through an rtxdsl kernel is not supported (create_graph=True)")
        plan: GradPlan = ctx.plan
        saved = ctx.saved_tensors
        n = len(plan.input_names)
        feed = dict(zip(plan.input_names, saved[:n]))
        feed.update(zip(plan.saved_keys, saved[n:]))
        feed.update({f"_g{k}": g for k, g in enumerate(grads) if plan.float_outputs[k]})
        needed = {name: feed[name] for name in plan.backward.inputs}
        outs = plan.backward(**needed)
        grads_in = []
        for name, t in zip(plan.input_names, saved[:n]):
            g = outs[plan.grad_of[name]] if name in plan.grad_of else None
            grads_in.append(g if g is None or g.shape == t.shape else g.expand(t.shape))
        return (None, *grads_in)


def call(kernel: Kernel, plan: GradPlan, tensors: tuple[torch.Tensor, ...]) -> Any:
    results = _Apply.apply(plan, *tensors)
    if kernel._single:
        return results[0]
    return dict(zip(plan.user_keys, results))
