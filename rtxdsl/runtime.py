"""Kernel: the user's compiled expression. A call runs a :class:`PreparedCall` built from the
:class:`~rtxdsl.lower.Program` that ``lower()`` made for the inputs' layout.

The hot path is a key over the inputs' dtypes, shapes, strides, device and requires_grad, an
LRU lookup of the prepared launch, output allocation and a direct launch of each kernel with
precomputed arguments: no analysis, no hashing of the expression, no code generation. A miss
lowers (bind, analyze, schedule), fetches each kernel from the signature-keyed KernelCache
(which generates only structures it has not seen) and prepares the launch.

Backends: ``triton`` (compiled, CUDA tensors), ``interpreter`` (the same kernels under
Triton's interpreter, CPU tensors; it is not thread-safe, so launches are serialized) and
``torch`` (the expression evaluated op by op with torch: the reference).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.compiler import is_dynamo_compiling

from .cache import GLOBAL_CACHE
from .config import FusionConfig, get_config
from .dtensor import DistributedCall, is_dtensor, offer_sharding
from .dtypes import SHORT_NAME, check_dense, check_supported
from .errors import (
    BackendError,
    DeviceMismatchError,
    DtypeMismatchError,
    MissingInputError,
    RtxError,
    UnknownInputError,
)
from .expr import Expr, as_expr, node, variables, walk
from .handle import KernelHandle
from .lower import Graph, InputMeta, Layout, Plan, Program, Target, plan_for, target_for, tf32_of
from .lower import program as program_of
from .lower.vjp import COTANGENT, GRADIENT, KEPT, Gradients, differentiate
from .lru import LRU
from .ops import REGISTRY, apply_ref
from .ops.random import SEED_PREFIX, draw_seed
from .runtime_explain import PlanSummary, explain_text
from .runtime_grad import (
    GradFunction,
    GradPlan,
    InForward,
    dtype_of_input,
    gradient_in_forward,
    in_forward_programs,
    named_var,
)
from .runtime_launch import (
    PreparedCall,
    backend_for,
    checking,
    compiled_kernel,
    device_of,
    generate_run,
    interpreter_active,
)
from .stats import GLOBAL_STATS, FusionStats
from .torchop import fixed_sizes, kernel_op, make_op, register_kernel, saving_op


class Kernel:
    """A compiled expression (or dict of expressions); call it with tensors.

    Example:
        >>> import torch, rtxdsl as rx
        >>> x, b = rx.var("x"), rx.var("b")
        >>> k = rx.compile(rx.relu(x * b + 1.0))
        >>> k.inputs
        ('x', 'b')
        >>> k(x=torch.ones(3), b=-torch.ones(3)).tolist()
        [0.0, 0.0, 0.0]
    """

    def __init__(
        self,
        outputs: Expr | Mapping[str, Any] | tuple | list,
        config: FusionConfig | None = None,
        *,
        inputs: tuple[str, ...] | None = None,
        stats: FusionStats | None = None,
        draw_seeds: bool = True,
        into: Mapping[str, str] | None = None,
        shared: tuple[str, ...] = (),
    ) -> None:
        if config is not None and not isinstance(config, FusionConfig):
            raise RtxError(f"config must be a FusionConfig, got {type(config).__name__}")
        if isinstance(outputs, Mapping):
            if not outputs:
                raise RtxError("compile needs at least one output expression")
            for key in outputs:
                if not isinstance(key, str):
                    raise RtxError(f"output keys must be strings, got {key!r}")
            self._outputs = tuple((k, as_expr(e, f"output {k!r}")) for k, e in outputs.items())
            self._single = False
        elif isinstance(outputs, (tuple, list)):  # several outputs returned as a tuple, keyed "0", "1", ...
            if not outputs:
                raise RtxError("compile needs at least one output expression")
            self._outputs = tuple((str(i), as_expr(e, f"output {i}")) for i, e in enumerate(outputs))
            self._single = False
        else:
            self._outputs = (("out", as_expr(outputs, "compile")),)
            self._single = True
        self._tuple = isinstance(outputs, (tuple, list))
        found = variables([e for _, e in self._outputs])
        if inputs is not None:  # an explicit positional order (@rx.fuse: the function's parameters)
            by_name = {v.attr("name"): v for v in found}
            unused = [n for n in inputs if n not in by_name]
            if unused:
                raise RtxError(f"input {unused[0]!r} is not used by the expression")
            drawn = [n for n in by_name if draw_seeds and n.startswith(SEED_PREFIX)]
            missing = [n for n in by_name if n not in inputs and n not in drawn]
            if missing:
                raise RtxError(f"the expression reads {missing[0]!r}, which is not among the inputs {inputs}")
            found = tuple(by_name[n] for n in (*inputs, *drawn))
        # per-call random seeds (rx.rand_like / rx.dropout with seed=None): hidden inputs drawn
        # on every call and handed to the backward, last among the variables
        hidden = tuple(v for v in found if draw_seeds and v.attr("name").startswith(SEED_PREFIX))
        found = tuple(v for v in found if all(v is not h for h in hidden)) + hidden
        self._seeds = len(hidden)
        self._vars = found
        self.inputs: tuple[str, ...] = tuple(v.attr("name") for v in found[: len(found) - len(hidden)])
        self._index = {n: i for i, n in enumerate(self.inputs)}
        self._config = config
        self._stats = stats or GLOBAL_STATS
        self._seen_config: FusionConfig | None = None
        self._launches: LRU[tuple, PreparedCall] = LRU((config or get_config()).launch_cache_size)
        self._grads: LRU[tuple, GradPlan] = LRU((config or get_config()).launch_cache_size)
        self._key = _key_function(len(self.inputs))
        self._arity = len(self.inputs)
        self._last: tuple[Any, Any] = (None, None)  # (key, launch) of the last call
        self._op: Any = None  # the kernel's own torch.library op, made on first use
        self._into = dict(into or {})  # output key -> input name it may be written into (internal)
        self._shared = shared  # output keys returned as an earlier key's very buffer (internal)
        # its name for rtxdsl::kernel (torch.compile): structural, the same in every process
        self.op_key: str = register_kernel(self, self._into, bool(self._seeds))
        # saving plans made while torch.compile traces (fake tensors), apart from the real ones
        self._traced_plans: LRU[tuple, GradPlan] = LRU((config or get_config()).launch_cache_size)
        self._in_forward = gradient_in_forward(self._outputs)  # a loss(..., grad_in_forward=True)

    @property
    def config(self) -> FusionConfig:
        return self._config or get_config()

    @property
    def stats(self) -> FusionStats:
        """The counters this kernel's calls record into (the global ones unless given)."""
        return self._stats

    def derived(self, outputs: Mapping[str, Expr]) -> Kernel:
        """A kernel of other outputs with this one's configuration and statistics (the pieces
        of a call run in pieces across ranks: ``rtxdsl.dtensor``).

        Example:
            >>> import rtxdsl as rx
            >>> k = rx.compile(rx.var("x") + 1.0, rx.FusionConfig(max_fusion_ops=8))
            >>> k.derived({"y": rx.var("x") * 2.0}).config.max_fusion_ops
            8
        """
        return Kernel(dict(outputs), self._config, stats=self._stats)

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self._outputs)

    @property
    def returns_tensor(self) -> bool:
        """Does a call return one tensor (an expression was compiled), not a dict by output key
        (a mapping was, even one whose only key is ``"out"``)?"""
        return self._single

    @property
    def expressions(self) -> tuple[tuple[str, Expr], ...]:
        """The output expressions, by key."""
        return self._outputs

    @property
    def variables(self) -> tuple[Expr, ...]:
        """The input ``var`` nodes, in ``inputs`` order."""
        return self._vars

    def __repr__(self) -> str:
        body = self._outputs[0][1] if self._single else dict(self._outputs)
        body = tuple(e for _, e in self._outputs) if self._tuple else body
        return f"rx.Kernel({body!r}, inputs={self.inputs})"

    # ---- calling --------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._call(args, kwargs)
        return tuple(out.values()) if self._tuple else out

    def _call(self, args: tuple, kwargs: dict) -> Any:
        if is_dynamo_compiling():  # inside torch.compile: one opaque custom op in the graph
            return self._traced(args, kwargs)
        cfg = self._current_config()
        tensors = args if not kwargs and len(args) == self._arity else self._collect_given(args, kwargs)
        key = self._key_of(tensors)
        if self._seeds:
            tensors = (*tensors, *[draw_seed() for _ in range(self._seeds)])
        last_key, launch = self._last
        if key != last_key:  # the same layout as the last call needs no hashing: steady loops
            launch = self._launches.get(key)
            if launch is None:
                joining = next((t for t in tensors if hasattr(type(t), "__rtxdsl_record__")), None)
                if joining is not None:  # lazy operands: the kernel's expressions join their segment
                    return joining.__rtxdsl_record__(self, tensors)
                launch = self._prepare(tensors, cfg)
                self._launches.put(key, launch)
            self._last = (key, launch)
        if launch.any_grad and torch.is_grad_enabled():
            # op by op through torch (backend "torch", fusion off): torch's own autograd records it,
            # so the oracle's gradients are eager's, not rtxdsl's derivative rules evaluated by torch
            by_torch = isinstance(launch, PreparedCall) and launch.backend == "torch"
            if not by_torch and not (isinstance(launch, DistributedCall) and launch.differentiates(tensors)):
                return self._grad_call(tensors, launch, key)
        return launch.run(tensors)

    def _current_config(self) -> FusionConfig:
        cfg = self._config or get_config()
        if cfg is not self._seen_config:  # launches are prepared for one config
            self._launches.clear()
            self._grads.clear()
            self._launches.resize(cfg.launch_cache_size)
            self._grads.resize(cfg.launch_cache_size)
            self._seen_config = cfg
            self._last = (None, None)
        return cfg

    def _key_of(self, tensors: tuple) -> Any:
        try:
            return self._key(*tensors)
        except AttributeError:  # a python number for a scalar input (or a wrong argument)
            return _mixed_key(tensors)
        except RuntimeError:  # a tensor without strides (nested): the layout check names it
            self._check_types(tensors)
            raise

    def prepared(self, *args: Any) -> PreparedCall | DistributedCall:
        """What a call with these inputs (tensors, positionally in ``inputs`` order) runs: lowered
        once and kept in the kernel's launch cache, so the call that follows reuses it (the lazy
        stream reads a segment's program this way before it lets the kernel write a user tensor).

        Example:
            >>> import torch, rtxdsl as rx
            >>> k = rx.compile(rx.relu(rx.var("x")))
            >>> len(k.prepared(torch.ones(3)).program.launched)
            1
        """
        cfg = self._current_config()
        key = self._key_of(args)
        launch = self._launches.get(key)
        if launch is None:  # (a seed's value never shapes a launch: zeros stand for the drawn ones)
            launch = self._prepare((*args, *[0] * self._seeds), cfg)
            self._launches.put(key, launch)
        return launch

    @property
    def torch_op(self) -> Any:
        """This kernel as a ``torch.library`` custom op (``rtxdsl::k_<hash>``): inputs positionally in
        ``inputs`` order, outputs as a tensor or a tuple in ``outputs`` order; fake and autograd
        implementations included, and its sharding rule for DTensor. ``torch.compile`` sees a call
        of the kernel as this op.

        Example:
            >>> import torch, rtxdsl as rx
            >>> k = rx.compile(rx.relu(rx.var("x")))
            >>> k.torch_op(torch.tensor([-1.0, 2.0])).tolist()
            [0.0, 2.0]
        """
        if self._op is None:
            self._op = make_op(self)
            offer_sharding(self)
        return self._op

    def graph_run(self, tensors: tuple[Any, ...]) -> Any | None:
        """This call as the launches torch.compile's graph holds on CUDA: ``run(tensors)`` launching
        each generated kernel through ``torch.library.wrap_triton`` (so Inductor sees them), or None
        where a call is not one fixed list of launches and stays the opaque op: CPU tensors (the
        interpreter cannot be traced), symbolic sizes (the opaque op serves every size without a
        recompile), random seeds drawn per call, index flags read on the host, DTensors.

        Example (on CPU, None: the opaque op it is):
            >>> import torch, rtxdsl as rx
            >>> rx.compile(rx.relu(rx.var("x"))).graph_run((torch.ones(3),)) is None
            True
        """
        cfg = self.config
        if self._seeds or cfg.dry_run or backend_for(cfg, device_of(tensors))[0] != "triton":
            return None
        if any(is_dtensor(t) for t in tensors) or not fixed_sizes(tensors):
            return None
        return self._graph_run(tensors, cfg, interpret=False)

    def _graph_run(self, tensors: tuple[Any, ...], cfg: FusionConfig, interpret: bool) -> Any | None:
        self._validate(tensors, cfg)
        program = self._lower(tensors, cfg)
        if checking(cfg, device_of(tensors)) and any(c.checks for c in program.launched):
            return None
        return generate_run(self, program, cfg, tensors, interpret, graph=True)[0]

    @property
    def draws_seeds(self) -> bool:
        """Does a call draw fresh random seeds (``rand_like`` / ``dropout`` with ``seed=None``)?"""
        return bool(self._seeds)

    @property
    def shared_outputs(self) -> tuple[str, ...]:
        """Output keys returned as the very buffer of an earlier key, not a copy of it (a gradient
        plan's forward: the output its backward reads back)."""
        return self._shared

    def reference_on(self, tensors: tuple[Any, ...]) -> Any:
        """The torch reference, op by op, on the given inputs (fake tensors too; seeds 0)."""
        return self.reference((*tensors, *[0] * self._seeds))

    def _traced(self, args: tuple, kwargs: dict) -> Any:
        """The call as torch.compile records it: ``rtxdsl::kernel``; differentiated at fixed sizes,
        ``rtxdsl::kernel_saving`` (its outputs and the row statistics the backward reads)."""
        values = self._collect_given(args, kwargs)
        needs = tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in values)
        if torch.is_grad_enabled() and any(needs) and self._saves(values):
            # a gradient for every floating input: Dynamo's fake tensors can miss that one needs it (a
            # tensor filled in place, DeepSeek-V3's key: its gradient was lost); autograd keeps those it needs
            floating = "".join("01"[t.is_floating_point()] for t in values)
            result = saving_op(self.op_key, floating, list(values))
        else:
            result = kernel_op(self.op_key, list(values))
        return result[0] if self._single else dict(zip(self.outputs, result))

    def _saves(self, values: tuple[Any, ...]) -> bool:
        """Can a differentiated call inside torch.compile save its row statistics? Not with
        random seeds drawn per call, DTensors or python numbers: then ``rtxdsl::kernel``, whose
        backward runs the forward again (as ``rtxdsl::kernel_saving`` does at symbolic sizes)."""
        return not self._seeds and all(isinstance(t, torch.Tensor) and not is_dtensor(t) for t in values)

    def saving_plan(self, values: tuple[Any, ...], needs: str) -> GradPlan:
        """The gradient plan ``rtxdsl::kernel_saving`` runs for these inputs (fixed sizes;
        ``needs``: a 0/1 per input, which require grad). Those made while torch.compile traces
        (fake tensors) and those for real tensors are cached apart, each in a bounded LRU; a
        compiled graph's call runs on real tensors, so an evicted traced plan is never needed."""
        key = ("saving", _mixed_key(values), needs)
        traced = any(isinstance(t, (FakeTensor, FunctionalTensor)) for t in values)
        plan = self._traced_plans.get(key) if traced else self._grads.get(key)
        if plan is None:
            self._validate(values, self.config)
            graph = plan_for(self._outputs, self._vars, _metas(values), self.config).graph
            plan = self._grad_plan(graph, tuple(c == "1" for c in needs))
            (self._traced_plans if traced else self._grads).put(key, plan)
        return plan

    def _grad_call(self, tensors: tuple, launch: PreparedCall, key: tuple) -> Any:
        """Through torch.autograd: fused forward (saving row statistics) and fused backward."""
        needs = tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
        mode = self._in_forward_mode(tensors)
        plan = self._grads.get((key, needs, mode))
        if plan is None:
            plan = self._grad_plan(launch.plan.graph, needs, mode)
            self._grads.put((key, needs, mode), plan)
        results = GradFunction.apply(plan, *tensors)
        if self._single:
            return results[0]
        return dict(zip(plan.grads.user_keys, results))

    def _in_forward_mode(self, tensors: tuple) -> str:
        """cross_entropy(..., grad_in_forward=True): "reuse" the logits' memory for their gradient,
        or a "fresh" one where they are a leaf (their .grad would alias them); "" otherwise."""
        if self._in_forward is None:
            return ""
        logits = tensors[self._index[self._in_forward]]
        # DTensors run each kernel as a functional torch op (no input may be written): as usual
        return "" if is_dtensor(logits) else "reuse" if logits.grad_fn is not None else "fresh"

    def _grad_plan(self, graph: Graph, needs: tuple[bool, ...], mode: str = "") -> GradPlan:
        if mode:
            return self._plan_in_forward(graph, needs, mode == "reuse")
        grads = differentiate(graph, self._outputs, needs)
        stats, shared = self._stats, grads.shared_keys
        forward = Kernel(dict(grads.forward), self._config, stats=stats, draw_seeds=False, shared=shared)
        return self._backward_plan(forward, grads, lambda absent: differentiate(graph, self._outputs, needs, absent))

    def _backward_plan(
        self, forward: KernelHandle, grads: Gradients, without: Callable[[frozenset[int]], Gradients] | None
    ) -> GradPlan:
        """The plan of ``forward`` and the backward of ``grads``; ``without(absent)``: the gradients
        when outputs go unused (GradPlan.for_used), each planned on first use over the same forward."""

        def unused(absent: frozenset[int]) -> GradPlan | None:
            try:
                return self._backward_plan(forward, without(absent), None)  # type: ignore[misc]
            except RtxError:  # no input's gradient is left
                return None

        passthrough = tuple((k, e.attr("name")) for k, e in grads.backward if e.is_var)
        computed = {k: e for k, e in grads.backward if not e.is_var}
        return GradPlan(
            forward=forward,
            backward=Kernel(computed, self._config, stats=self._stats, draw_seeds=False) if computed else None,
            grads=grads,
            input_names=tuple(v.attr("name") for v in self._vars),
            passthrough=passthrough,
            without=unused if without is not None else None,
        )

    def _plan_in_forward(self, graph: Graph, needs: tuple[bool, ...], reuse: bool) -> GradPlan:
        """A loss marked ``grad_in_forward=True``: the forward runs the loss and its gradients for a
        unit cotangent in one program where it can (:func:`in_forward_programs`; cross-entropy's logits gradient
        written into the logits where that is safe and ``reuse`` is on: a leaf's .grad must not
        alias it); the backward only scales each gradient, in place, by the cotangent."""
        name = self._in_forward
        grads = differentiate(graph, self._outputs, needs)
        input_of = {key: v for v, key in grads.grad_of}
        units, scaled, grad_of = {}, {}, []
        for k, (key, unit) in enumerate(grads.backward):
            dtype = dtype_of_input(graph, input_of[key])
            units[f"{KEPT}{k}"] = node("cast", unit, dtype=dtype)  # expand drops a cast to the dtype it has
            scaled[f"{GRADIENT}{k}"] = node(
                "cast", node("mul", named_var(f"{KEPT}{k}"), named_var(f"{COTANGENT}0")), dtype=dtype
            )
            grad_of.append((input_of[key], f"{GRADIENT}{k}"))
        before, outs = in_forward_programs(dict(grads.forward), units, name)
        config, stats = self._config, self._stats
        into = dict.fromkeys((j for j, (key, _) in zip(units, grads.backward) if input_of[key] == name), name)
        then = Kernel(outs, config, stats=stats, draw_seeds=False, into=into if reuse else None)
        in_place = {d: j for d, j in zip(scaled, units)}
        backward = Kernel(scaled, config, stats=stats, draw_seeds=False, into=in_place)
        plan = Gradients(
            forward=(*((k, e) for k, e in grads.forward if k in grads.user_keys), *units.items()),
            backward=tuple(scaled.items()),
            user_keys=grads.user_keys,
            saved_keys=tuple(units),
            grad_of=tuple(grad_of),
            float_outputs=grads.float_outputs,
        )
        dtype = graph.of(dict(graph.outputs)[grads.user_keys[0]]).dtype
        first = Kernel(before, config, stats=stats, draw_seeds=False) if before else None
        forward = InForward(first, then, tuple(units), name, dtype)
        return GradPlan(forward, backward, plan, tuple(v.attr("name") for v in self._vars))  # type: ignore[arg-type]

    def grad_plan(self, *args: Any, **kwargs: Any) -> GradPlan:
        """The forward and backward kernels autograd runs for these inputs: with respect to the
        inputs that require grad, or every floating-point tensor input when none does.

        Example:
            >>> import torch, rtxdsl as rx
            >>> g = rx.compile(rx.softmax(rx.var("x"))).grad_plan(x=torch.empty(4, 8))
            >>> g.backward.inputs, g.grads.saved_keys
            (('_g0', 'x', '_s0', '_s1'), ('_s0', '_s1'))
        """
        tensors = self.collect(args, kwargs)
        needs = tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
        if not any(needs):
            needs = tuple(isinstance(t, torch.Tensor) and t.dtype.is_floating_point for t in tensors)
        return self._grad_plan(self.analysis(*tensors).graph, needs, self._in_forward_mode(tensors))

    def collect(self, args: tuple, kwargs: dict) -> tuple:
        """A call's inputs (positional or by name) in variable order, with fresh seeds for the hidden
        ones: what ``memory_trace`` and the inspection methods bind.

        Example:
            >>> import rtxdsl as rx
            >>> rx.compile(rx.var("x") + rx.var("y")).collect((), {"y": 2.0, "x": 1.0})
            (1.0, 2.0)
        """
        tensors = self._collect_given(args, kwargs)
        return (*tensors, *[draw_seed() for _ in range(self._seeds)]) if self._seeds else tensors

    def _collect_given(self, args: tuple, kwargs: dict) -> tuple:
        n = len(self.inputs)
        if not kwargs and len(args) == n:
            return args
        if not args and len(kwargs) == n:
            try:
                return tuple([kwargs[name] for name in self.inputs])
            except KeyError:
                pass
        if len(args) > n:
            raise RtxError(f"kernel takes {n} inputs {self.inputs}, got {len(args)} positional arguments")
        vals: list[Any] = list(args) + [None] * (n - len(args))
        given = [True] * len(args) + [False] * (n - len(args))
        for name, value in kwargs.items():
            i = self._index.get(name)
            if i is None:
                raise UnknownInputError(f"unknown input {name!r}: this kernel's inputs are {self.inputs}")
            if given[i]:
                raise RtxError(f"input {name!r} given twice (positionally and by name)")
            vals[i], given[i] = value, True
        missing = [name for name, g in zip(self.inputs, given) if not g]
        if missing:
            raise MissingInputError(f"missing input {missing[0]!r}: this kernel needs {self.inputs}")
        return tuple(vals)

    def _check_types(self, tensors: tuple) -> None:
        for name, t in zip(self.inputs, tensors):
            if not isinstance(t, (torch.Tensor, bool, int, float)):
                raise RtxError(f"input {name!r} must be a torch.Tensor or a python number, got {type(t).__name__}")
            if isinstance(t, torch.Tensor):
                check_dense(t, f"input {name!r}")

    def _validate(self, tensors: tuple, cfg: FusionConfig) -> torch.device:
        self._check_types(tensors)
        device = None
        first = None
        for v, name, t in zip(self._vars, self.inputs, tensors):
            if not isinstance(t, torch.Tensor):
                if v.attr("dtype") is not None:
                    raise DtypeMismatchError(
                        f"input {name!r} was declared {SHORT_NAME[v.attr('dtype')]} but got a python {type(t).__name__}"
                    )
                continue
            check_supported(t.dtype, f"input {name!r}")
            declared = v.attr("dtype")
            if declared is not None and t.dtype != declared:
                raise DtypeMismatchError(
                    f"input {name!r} was declared {SHORT_NAME[declared]} but got a {SHORT_NAME[t.dtype]} tensor"
                )
            if device is None:
                device, first = t.device, name
            elif t.device != device:
                raise DeviceMismatchError(
                    f"inputs {first!r} ({device}) and {name!r} ({t.device}) are on different devices"
                )
        device = device or torch.device("cpu")
        if cfg.backend != "torch" and cfg.enabled:
            if device.type not in ("cpu", "cuda"):
                raise BackendError(f"backend {cfg.backend!r} cannot run on {device} tensors; use backend='torch'")
            if cfg.backend == "triton" and device.type != "cuda":
                raise BackendError(
                    f"backend 'triton' compiles for CUDA tensors; these are on {device} (use 'auto' or 'interpreter')"
                )
        return device

    # ---- preparing ----------------------------------------------------------------------
    def program(self, *args: Any, **kwargs: Any) -> Program:
        """The lowered program a call with these inputs runs (nothing is launched or compiled)."""
        tensors = self.collect(args, kwargs)
        self._validate(tensors, self.config)
        return self._lower(tensors, self.config)

    def analysis(self, *args: Any, **kwargs: Any) -> Plan:
        """The fusion groups a call with these inputs runs, over its expressions bound and expanded
        at their sizes (what ``explain`` prints, what autograd differentiates).

        Example:
            >>> import torch, rtxdsl as rx
            >>> plan = rx.compile(rx.softmax(rx.var("x")) * 2.0).analysis(x=torch.empty(4, 8))
            >>> [(g.pattern.value, g.shape) for g in plan.groups]
            [('Softmax', (4, 8))]
        """
        tensors = self.collect(args, kwargs)
        self._validate(tensors, self.config)
        return plan_for(self._outputs, self._vars, _metas(tensors), self.config)

    def lower_for(self, target: Target, *args: Any, **kwargs: Any) -> Program:
        """The program for these inputs with launch configurations shaped for ``target`` (e.g. the
        GPU's, to trace or count a GPU-shaped launch on a CPU machine)."""
        tensors = self.collect(args, kwargs)
        self._validate(tensors, self.config)
        return self._lower(tensors, self.config, target)

    def _lower(self, tensors: tuple, cfg: FusionConfig, target: Target | None = None) -> Program:
        return self._planned(tensors, cfg, target)[1]

    def _planned(self, tensors: tuple, cfg: FusionConfig, target: Target | None = None) -> tuple[Plan, Program]:
        """The analysis and the program for these inputs (``target``: the device's unless given)."""
        metas = _metas(tensors)
        if target is None:
            target = target_for(device_of(tensors), backend_for(cfg, device_of(tensors))[0] != "triton")
        GLOBAL_CACHE.count_plan()
        plan = plan_for(self._outputs, self._vars, metas, cfg)
        return plan, program_of(plan, metas, target, self._into, tf32_of(cfg))

    def _prepare(self, tensors: tuple, cfg: FusionConfig) -> PreparedCall | DistributedCall:
        """Lower and fetch kernels for these inputs (DTensors: the kernel's op, run by DTensor)."""
        self._validate(tensors, cfg)
        plan, program = self._planned(tensors, cfg)
        if any(is_dtensor(t) for t in tensors):
            return DistributedCall(self, plan, program, tensors)
        return PreparedCall(self, plan, program, cfg, tensors)

    def reference(self, tensors: tuple) -> Any:
        """Evaluate with torch ops, op by op (backend 'torch', or fusion disabled), on the inputs in
        variable order (hidden seeds included).

        Example:
            >>> import torch, rtxdsl as rx
            >>> rx.compile(rx.var("x") * 2.0).reference((torch.ones(2),)).tolist()
            [2.0, 2.0]
        """
        vals: dict[Expr, Any] = {v: t for v, t in zip(self._vars, tensors)}
        for n in walk([e for _, e in self._outputs]):
            if n in vals:
                continue
            if n.is_const:
                vals[n] = n.attr("value")
                continue
            vals[n] = apply_ref(REGISTRY[n.op], [vals[s] for s in n.srcs], n.attr_dict)
        device = device_of(tensors)
        res = {}
        for k, e in self._outputs:
            r = vals[e]
            if not isinstance(r, torch.Tensor):
                r = torch.tensor(r, device=device)
            elif e.is_var:
                r = r.clone()
            res[k] = r
        return res["out"] if self._single else tuple(res.values()) if self._tuple else res

    # ---- inspection ---------------------------------------------------------------------
    def _launch_for(self, args: tuple, kwargs: dict) -> PreparedCall:
        cfg = self.config
        tensors = self.collect(args, kwargs)
        self._validate(tensors, cfg)
        return PreparedCall(self, *self._planned(tensors, cfg), cfg, tensors)

    def explain(self, *args: Any, **kwargs: Any) -> str:
        """The plan for these inputs: groups, pattern, launches, passes and bytes, against eager torch."""
        return explain_text(self, self._launch_for(args, kwargs))

    def sources(self, *args: Any, **kwargs: Any) -> list[str]:
        """Generated Triton source, one string per kernel the call launches."""
        cfg = self.config
        program = self.program(*args, **kwargs)
        return [compiled_kernel(k.spec, k.summary, cfg).source for k in program.kernels]

    def launches(self, *args: Any, **kwargs: Any) -> int:
        """How many kernels a call with these inputs launches."""
        return self.summary(*args, **kwargs).kernels

    def summary(self, *args: Any, **kwargs: Any) -> PlanSummary:
        """Counts of the plan for these inputs (nothing is launched), against eager torch.

        Example:
            >>> import torch, rtxdsl as rx
            >>> s = rx.compile(rx.softmax(rx.var("x"))).summary(x=torch.empty(8, 100))
            >>> (s.kernels, s.eager_launches, s.bytes_moved == s.bytes_minimum)
            (1, 1, True)
        """
        cfg = self.config
        tensors = self.collect(args, kwargs)
        device = self._validate(tensors, cfg)
        plan, p = self._planned(tensors, cfg)
        backend, _ = backend_for(cfg, device)
        torch_run = backend == "torch"
        return PlanSummary(
            p.eager_launches if torch_run else p.kernels_launched,
            0 if torch_run else p.fused,
            p.eager_launches,
            p.eager_bytes if torch_run else p.bytes_moved,
            p.eager_bytes,
            p.minimum_bytes,
            tuple(g.pattern for g in plan.groups),
            backend,
        )


def _metas(tensors: tuple) -> tuple[InputMeta, ...]:
    """What lowering reads of a call's inputs: each tensor's layout, each python number itself."""
    return tuple(
        Layout(tuple(t.shape), tuple(t.stride()), t.dtype) if isinstance(t, torch.Tensor) else t for t in tensors
    )


def _warn_if_grad_in_forward_ignored(kernel: KernelHandle) -> None:
    """``grad_in_forward=True`` anywhere but as the one output over an input's logits has no
    effect (the ordinary fused backward runs): say so, and why."""
    outputs = kernel.expressions
    asked = [n for n in walk([e for _, e in outputs]) if n.attr("grad_in_forward")]
    if not asked or kernel._in_forward is not None:
        return
    root = outputs[0][1]
    one = len(outputs) == 1 and len(asked) == 1 and root is asked[0]
    why = "the kernel has other outputs" if not one else "its logits are computed in the kernel (e.g. softcapped)"
    warnings.warn(
        f"{asked[0].op}(..., grad_in_forward=True) has no effect here: {why}; the fused backward runs as usual",
        stacklevel=3,
    )


def _key_function(n: int) -> Any:
    """``key(t0, t1, ...)``: dtype, shape, strides, device, requires_grad and type (a DTensor is not a
    tensor of its global shape) of each input, as one flat tuple."""
    names = ", ".join(f"t{i}" for i in range(n))
    fields = "".join(
        f"t{i}.dtype, t{i}.shape, t{i}.stride(), t{i}.device, t{i}.requires_grad, type(t{i}), " for i in range(n)
    )
    scope: dict[str, Any] = {}
    exec(f"def key({names}):\n    return ({fields})\n", scope)  # noqa: S102 - fixed template, no user text
    return scope["key"]


def _mixed_key(tensors: tuple[Any, ...]) -> tuple:
    """The launch key when some inputs are python numbers: those count by type only (anything
    else by type too: it never gets a launch, :meth:`Kernel._validate` or a lazy segment takes it)."""
    return tuple(
        (t.dtype, t.shape, t.stride(), t.device, t.requires_grad, type(t)) if isinstance(t, torch.Tensor) else type(t)
        for t in tensors
    )


def compile(outputs: Expr | Mapping[str, Any] | tuple | list, config: FusionConfig | None = None) -> Kernel:  # noqa: A001
    """Compile an expression, or a dict of them, into a :class:`Kernel`; a tuple (or list) of them
    returns a tuple (``rx.attention(..., return_lse=True)``).

    Example:
        >>> import torch, rtxdsl as rx
        >>> x = rx.var("x")
        >>> ks = rx.compile({"y": rx.exp(x), "s": rx.sum(rx.exp(x), axis=-1)})
        >>> sorted(ks(x=torch.zeros(2, 3)))
        ['s', 'y']
    """
    kernel = Kernel(outputs, config)
    _warn_if_grad_in_forward_ignored(kernel)
    return kernel


__all__ = ["GradPlan", "Kernel", "PreparedCall", "PlanSummary", "compile", "interpreter_active"]
