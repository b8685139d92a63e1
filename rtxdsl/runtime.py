"""Kernel: binds inputs, plans, generates, caches and launches — with a cheap hot path.

A call first looks up a prepared :class:`Launch` keyed by the inputs' dtypes, shapes,
strides and device (an LRU per kernel). On a hit the call only allocates outputs and
launches the cached kernels with precomputed arguments: no analysis, no hashing of the
expression, no code generation. On a miss it binds (torch's shape/dtype rules on meta
tensors), plans (FusionAnalyzer), and fetches each group's kernel from the signature-keyed
KernelCache, which compiles only structures it has not seen.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .analyzer import FusionAnalyzer, FusionPlan
from .bind import Bound, bind
from .cache import GLOBAL_CACHE, CompiledKernel
from .codegen.spec import KernelSpec, Layout, build, contiguous_strides
from .config import FusionConfig, get_config
from .dtypes import SHORT_NAME, check_supported
from .errors import (
    BackendError,
    DeviceMismatchError,
    DtypeMismatchError,
    MissingInputError,
    RtxError,
    UnknownInputError,
)
from .expr import Expr, as_expr, variables, walk
from .ops import REGISTRY, apply_ref
from .stats import GLOBAL_STATS, FusionStats


@dataclass
class Step:
    """One kernel launch with everything but the tensors precomputed."""

    fn: Any  # the launchable kernel, chosen by backend once planned
    grid: tuple[int, ...]
    bufs: tuple[int, ...]  # buffer slots: inputs then outputs, in parameter order
    rest: tuple[Any, ...]  # sizes, strides, scalars
    meta: dict[str, int]  # constexprs and launch options
    compiled: CompiledKernel
    spec: KernelSpec
    ops: int
    bytes: int
    empty: bool


@dataclass(frozen=True)
class PlanSummary:
    """What a call launches and moves, next to eager torch and the minimum (inputs once, outputs once)."""

    kernels: int
    fused: int
    eager_launches: int
    bytes_moved: int
    bytes_eager: int
    bytes_minimum: int
    patterns: tuple[str, ...]
    backend: str


class Launch:
    """A prepared call for one input layout: allocations, steps and counters."""

    def __init__(self, kernel: Kernel, config: FusionConfig, device: torch.device, n_inputs: int) -> None:
        self.kernel = kernel
        self.config = config
        self.device = device
        self.n_inputs = n_inputs
        self.allocs: list[tuple[int, tuple[int, ...], torch.dtype]] = []
        self.steps: list[Step] = []
        self.out_slots: list[tuple[str, int]] = []
        self.scalar_outputs: dict[str, tuple[Any, torch.dtype]] = {}
        self.plan: FusionPlan | None = None
        self.makers: list[Any] = []
        self.launchers: list[tuple] = []  # (fn[grid], buffer slots, sizes/strides/scalars, constexprs)
        self.dry_run = config.dry_run
        self.finish: Any = None
        self.bound: Bound | None = None
        self.backend = ""
        self.note = ""  # why this backend, when it is not the obvious one
        self.any_grad = False  # some input requires grad: calls go through torch.autograd
        self.stats: FusionStats = GLOBAL_STATS
        self.kernels = self.fused = self.eager_launches = self.bytes_moved = self.bytes_eager = 0

    def run(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        if self.backend == "torch":
            results = self.kernel._reference(tensors, self.config)
            self._count()
            return results
        bufs: list[Any] = [*tensors]
        for make in self.makers:
            bufs.append(make(tensors))
        if not self.dry_run:
            for launcher, slots, rest, meta in self.launchers:
                launcher(*[bufs[i] for i in slots], *rest, **meta)
            self._count()
        return self.finish(bufs)

    def seal(self) -> None:
        """Precompute the allocation and result-packing closures the hot path calls."""
        self.dry_run = self.config.dry_run
        self.launchers = [
            (st.fn[st.grid], st.bufs, st.rest, st.meta) for st in self.steps if not st.empty and st.fn is not None
        ]
        self.makers = [_maker(shape, dtype, self.device, self.bound, self.kernel) for _, shape, dtype in self.allocs]
        kernel, scalars, device = self.kernel, self.scalar_outputs, self.device
        order = {k: s for k, s in self.out_slots}
        slots = [(k, order.get(k)) for k in kernel.outputs]
        if kernel._single and not scalars:
            slot = slots[0][1]
            self.finish = lambda bufs: bufs[slot]
        elif not scalars:
            self.finish = lambda bufs: {k: bufs[s] for k, s in slots}
        else:

            def finish(bufs: list[Any]) -> Any:
                res = {
                    k: bufs[s] if s is not None else torch.tensor(scalars[k][0], dtype=scalars[k][1], device=device)
                    for k, s in slots
                }
                return res["out"] if kernel._single else res

            self.finish = finish

    def _count(self) -> None:
        self.stats.record(self.kernels, self.fused, self.eager_launches, self.bytes_moved, self.bytes_eager)


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
        self, outputs: Expr | Mapping[str, Any], config: FusionConfig | None = None, stats: FusionStats | None = None
    ) -> None:
        self._stats = stats or GLOBAL_STATS
        if config is not None and not isinstance(config, FusionConfig):
            raise RtxError(f"config must be a FusionConfig, got {type(config).__name__}")
        if isinstance(outputs, Mapping):
            if not outputs:
                raise RtxError("compile needs at least one output expression")
            for key in outputs:
                if not isinstance(key, str):
                    raise RtxError(f"output keys must be strings, got {key!r}")
            self._outputs = [(k, as_expr(e, f"output {k!r}")) for k, e in outputs.items()]
            self._single = False
        else:
            self._outputs = [("out", as_expr(outputs, "compile"))]
            self._single = True
        self._vars = variables([e for _, e in self._outputs])
        self.inputs: tuple[str, ...] = tuple(v.attr("name") for v in self._vars)
        self._index = {n: i for i, n in enumerate(self.inputs)}
        self._config = config
        self._seen_config: FusionConfig | None = None
        self._grad_plans: dict[tuple, Any] = {}
        self._launches: OrderedDict[tuple, Launch] = OrderedDict()
        self._key = _key_function(len(self.inputs))

    @property
    def config(self) -> FusionConfig:
        return self._config or get_config()

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self._outputs)

    def __repr__(self) -> str:
        body = self._outputs[0][1] if self._single else dict(self._outputs)
        return f"rx.Kernel({body!r}, inputs={self.inputs})"

    # ---- calling --------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cfg = self._config or get_config()
        if cfg is not self._seen_config:  # launches are prepared for one config
            self._launches.clear()
            self._grad_plans.clear()
            self._seen_config = cfg
        tensors = args if not kwargs and len(args) == len(self.inputs) else self._collect(args, kwargs)
        try:
            key = self._key(*tensors)
        except AttributeError:
            self._check_types(tensors)
            raise
        launch = self._launches.get(key)
        if launch is None:
            launch = self._prepare(tensors, cfg, key)
        if launch.any_grad and torch.is_grad_enabled():
            return self._grad_call(tensors, launch, key)
        return launch.run(tensors)

    def _grad_call(self, tensors: tuple, launch: Launch, key: tuple) -> Any:
        """Through torch.autograd: fused forward (saving row statistics) and fused backward."""
        from . import autograd

        needs = [t.requires_grad for t in tensors]
        gkey = (key, tuple(needs))
        plan = self._grad_plans.get(gkey)
        if plan is None:
            assert launch.bound is not None
            plan = self._grad_plans[gkey] = autograd.build(self, launch.bound, needs)
        return autograd.call(self, plan, tensors)

    def _collect(self, args: tuple, kwargs: dict) -> tuple:
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
            if not isinstance(t, torch.Tensor):
                raise RtxError(f"input {name!r} must be a torch.Tensor, got {type(t).__name__}")

    def _validate(self, tensors: tuple, cfg: FusionConfig) -> torch.device:
        self._check_types(tensors)
        device = None
        first = None
        for v, name, t in zip(self._vars, self.inputs, tensors):
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
    def _prepare(self, tensors: tuple, cfg: FusionConfig, key: tuple | None, lower: bool = False) -> Launch:
        """Bind, plan and fetch kernels for these inputs; ``lower`` plans kernels whatever the backend."""
        device = self._validate(tensors, cfg)
        bound = bind(self._outputs, self._vars, tensors)
        launch = Launch(self, cfg, device, len(tensors))
        launch.stats = self._stats
        launch.any_grad = any(t.requires_grad for t in tensors)
        launch.bound = bound
        launch.eager_launches, launch.bytes_eager = bound.eager_launches, bound.eager_bytes
        launch.backend, launch.note = _backend_for(cfg, device)
        if launch.backend == "torch" and not lower:
            launch.kernels, launch.bytes_moved = bound.eager_launches, bound.eager_bytes
        else:
            self._lower(launch, bound, tensors, cfg)
            if launch.backend != "torch":
                interpret = launch.backend == "interpreter"
                for st in launch.steps:
                    fn = st.compiled.function(interpret)
                    st.fn = _quiet(fn) if interpret else fn
            launch.seal()
        if key is not None:
            self._launches[key] = launch
            while len(self._launches) > cfg.launch_cache_size:
                self._launches.popitem(last=False)
        return launch

    def _lower(self, launch: Launch, bound: Bound, tensors: tuple, cfg: FusionConfig) -> None:
        plan = FusionAnalyzer(cfg).plan(bound)
        launch.plan = plan
        slots: dict[int, int] = {}
        layouts: dict[int, Layout] = {}
        for v, t in zip(self._vars, tensors):
            slots[id(v)] = bound.var_index[v.attr("name")]
            layouts[id(v)] = Layout(tuple(t.shape), tuple(t.stride()), t.dtype)
        next_slot = len(tensors)
        for g in plan.groups:
            for o in g.outputs:
                info = bound.of(o)
                slots[id(o)] = next_slot
                layouts[id(o)] = Layout(info.shape, contiguous_strides(info.shape), info.dtype)
                launch.allocs.append((next_slot, info.shape, info.dtype))
                next_slot += 1
        cache_dir = cfg.resolved_cache_dir
        for g in plan.groups:
            spec, args = build(g, bound, layouts)
            summary = f"{g.pattern}: {', '.join(g.ops)}"
            compiled = GLOBAL_CACHE.get(spec, summary, cfg.cache_size, cache_dir)
            meta = {"BLOCK_SIZE": spec.block, "num_warps": spec.num_warps}
            if spec.kind == "row":
                meta["ROWS"] = spec.rows_per_program
            nbytes = sum(_nbytes(layouts[id(i)]) for i in g.inputs) + sum(_nbytes(layouts[id(o)]) for o in g.outputs)
            launch.steps.append(
                Step(
                    fn=None,
                    grid=args.grid,
                    bufs=tuple(slots[id(i)] for i in g.inputs) + tuple(slots[id(o)] for o in g.outputs),
                    rest=(*args.ints, *args.scalars),
                    meta=meta,
                    compiled=compiled,
                    spec=spec,
                    ops=len(g.nodes),
                    bytes=0 if args.empty else nbytes,
                    empty=args.empty,
                )
            )
        for key, root in bound.outputs:
            if id(root) in slots:
                launch.out_slots.append((key, slots[id(root)]))
            else:  # a scalar-only output: no kernel needed
                info = bound.of(root)
                launch.scalar_outputs[key] = (info.value, info.dtype)
        live = [s for s in launch.steps if not s.empty]
        launch.kernels = len(live)
        launch.fused = sum(1 for s in live if s.ops >= 2)
        launch.bytes_moved = sum(s.bytes for s in live)

    def _reference(self, tensors: tuple, cfg: FusionConfig) -> Any:
        """Evaluate with torch ops, op by op (backend 'torch', or fusion disabled)."""
        vals: dict[int, Any] = {}
        for v, t in zip(self._vars, tensors):
            vals[id(v)] = t
        for n in walk([e for _, e in self._outputs]):
            if id(n) in vals:
                continue
            if n.op == "const":
                vals[id(n)] = n.attr("value")
                continue
            vals[id(n)] = apply_ref(REGISTRY[n.op], [vals[id(s)] for s in n.srcs], n.attr_dict)
        device = tensors[0].device if tensors else torch.device("cpu")
        res = {}
        for k, e in self._outputs:
            r = vals[id(e)]
            if not isinstance(r, torch.Tensor):
                r = torch.tensor(r, device=device)
            elif e.op == "var":
                r = r.clone()
            res[k] = r
        return res["out"] if self._single else res

    # ---- inspection ---------------------------------------------------------------------
    def _launch_for(self, args: tuple, kwargs: dict) -> Launch:
        cfg = self._config or get_config()
        tensors = self._collect(args, kwargs)
        self._check_types(tensors)
        return self._prepare(tensors, cfg, None)

    def explain(self, *args: Any, **kwargs: Any) -> str:
        """The plan for these inputs: groups, pattern, launches and bytes, against eager torch."""
        launch = self._launch_for(args, kwargs)
        return _explain(self, launch)

    def sources(self, *args: Any, **kwargs: Any) -> list[str]:
        """Generated Triton source, one string per kernel the call launches."""
        launch = self._launch_for(args, kwargs)
        return [s.compiled.source for s in launch.steps]

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
        launch = self._launch_for(args, kwargs)
        bound = launch.bound
        assert bound is not None
        minimum = _minimum_bytes(self, bound)
        patterns = tuple(g.pattern for g in launch.plan.groups) if launch.plan else ()
        return PlanSummary(
            launch.kernels,
            launch.fused,
            launch.eager_launches,
            launch.bytes_moved,
            launch.bytes_eager,
            minimum,
            patterns,
            launch.backend,
        )


def interpreter_active() -> bool:
    """Triton's interpreter works only when TRITON_INTERPRET was set before triton was imported."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def _backend_for(cfg: FusionConfig, device: torch.device) -> tuple[str, str]:
    """(backend, note): torch, triton (compiled, CUDA) or interpreter (Triton's, any device)."""
    if cfg.backend == "torch" or not cfg.enabled:
        return "torch", "" if cfg.enabled else "fusion disabled: op by op"
    if cfg.backend == "triton" or (cfg.backend == "auto" and device.type == "cuda" and not interpreter_active()):
        return "triton", ""
    if interpreter_active():
        return "interpreter", ""
    if cfg.backend == "interpreter":
        raise BackendError(
            "backend 'interpreter' needs TRITON_INTERPRET=1 in the environment before triton is "
            "imported (import rtxdsl first on a machine without CUDA, or set it yourself)"
        )
    return "torch", "Triton's interpreter is off (TRITON_INTERPRET unset at import), so CPU tensors run through torch"


class _quiet:
    """An interpreted kernel with numpy's floating-point warnings silenced (masked lanes compute log(0))."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        launcher = self.fn[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            with np.errstate(all="ignore"):
                return launcher(*args, **kwargs)

        return run


def _key_function(n: int) -> Any:
    """``key(t0, t1, ...)``: dtype, shape, strides, device and requires_grad of each input, as one flat tuple."""
    names = ", ".join(f"t{i}" for i in range(n))
    fields = "".join(f"t{i}.dtype, t{i}.shape, t{i}.stride(), t{i}.device, t{i}.requires_grad, " for i in range(n))
    scope: dict[str, Any] = {}
    exec(f"def key({names}):\n    return ({fields})\n", scope)  # noqa: S102 - fixed template, no user text
    return scope["key"]


def _maker(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, bound: Any, kernel: Kernel) -> Any:
    """A closure allocating one contiguous output; empty_like of a matching input is the cheapest."""
    for i, v in enumerate(kernel._vars):
        info = bound.of(v)
        if info.shape == shape and info.dtype == dtype and bound.contiguous[i]:
            return lambda tensors: torch.empty_like(tensors[i])
    return lambda tensors: torch.empty(shape, dtype=dtype, device=device)


def _nbytes(layout: Layout) -> int:
    return math.prod(layout.shape) * layout.dtype.itemsize


def _fmt_meta(info) -> str:
    return f"{SHORT_NAME[info.dtype]}[{', '.join(map(str, info.shape))}]"


def _minimum_bytes(kernel: Kernel, bound: Bound) -> int:
    """Each input read once, each output written once."""
    tensors = [bound.of(v) for v in kernel._vars] + [bound.of(e) for _, e in bound.outputs]
    return sum(i.numel * i.dtype.itemsize for i in tensors if not i.is_scalar)


def _explain(kernel: Kernel, launch: Launch) -> str:
    bound = launch.bound
    assert bound is not None
    lines = [f"{kernel!r}"]
    lines.append("inputs: " + ", ".join(f"{n}: {_fmt_meta(bound.of(v))}" for n, v in zip(kernel.inputs, kernel._vars)))
    lines.append(
        f"backend: {launch.backend} ({launch.device.type})"
        + ("  [dry_run]" if launch.config.dry_run else "")
        + (f"  [{launch.note}]" if launch.note else "")
    )
    minimum = _minimum_bytes(kernel, bound)
    if launch.plan is not None:
        names = {id(v): n for n, v in zip(kernel.inputs, kernel._vars)}
        outs = {id(e): k for k, e in bound.outputs}
        for i, (g, st) in enumerate(zip(launch.plan.groups, launch.steps)):
            domain = f"rows over axes {list(g.axes)} of" if g.is_row else "pointwise over"
            lines.append(
                f"group {i}: {g.pattern} — {domain} [{', '.join(map(str, g.shape))}], "
                f"{len(g.nodes)} ops: {', '.join(g.ops)}"
            )
            reads = ", ".join(f"{names.get(id(n), f'tmp{id(n) % 997}')} {_fmt_meta(bound.of(n))}" for n in g.inputs)
            writes = ", ".join(f"{outs.get(id(n), 'intermediate')} {_fmt_meta(bound.of(n))}" for n in g.outputs)
            lines.append(f"  reads {reads or 'nothing'}; writes {writes}")
            mode = (
                (
                    f"row block {st.spec.block} x {st.spec.rows_per_program} rows"
                    + (", looped" if st.spec.looped else "")
                )
                if g.is_row
                else f"block {st.spec.block}"
            )
            lines.append(
                f"  kernel {st.compiled.name}: grid {st.grid}, {mode}, {st.bytes} bytes"
                + (" (empty: not launched)" if st.empty else "")
            )
    lines.append(
        f"total: {launch.kernels} kernel launch(es) (eager torch: {launch.eager_launches}), "
        f"{launch.bytes_moved} bytes moved (eager: {launch.bytes_eager}, minimum: {minimum})"
    )
    return "\n".join(lines)


def compile(outputs: Expr | Mapping[str, Any], config: FusionConfig | None = None) -> Kernel:  # noqa: A001
    """Compile an expression, or a dict of them, into a :class:`Kernel`.

    Example:
        >>> import torch, rtxdsl as rx
        >>> x = rx.var("x")
        >>> ks = rx.compile({"y": rx.exp(x), "s": rx.sum(rx.exp(x), axis=-1)})
        >>> sorted(ks(x=torch.zeros(2, 3)))
        ['s', 'y']
    """
    return Kernel(outputs, config)


__all__ = ["Kernel", "PlanSummary", "compile"]
