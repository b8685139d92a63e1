"""DTensor inputs: a kernel called with DTensors returns DTensors, through torch's own machinery.

The call becomes the kernel's ``torch.library`` op (python numbers typed as such), whose sharding
rule is registered with DTensor (``register_sharding``): every way to shard that
``lower.shard`` proves exact (the axes no node needs whole: rows of a softmax, any axis of a
pointwise kernel, with broadcast operands replicated), plus everything replicated. DTensor's
propagation picks the cheapest against the inputs' placements and redistributes what does not
fit, so a kernel reducing over a sharded axis gathers that axis first (one warning per kernel)
and never returns a wrong local result. Each rank then runs the kernel on its local pieces.

Kernels that draw random numbers keep every axis whole (values depend on positions), and a
``seed=None`` draw happens on each rank from torch's default generator: seed the ranks alike.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any

import torch

from .errors import RtxError
from .handle import KernelHandle
from .lower import Plan, Program
from .lower.bind import Info
from .lower.expand import Graph, expand
from .lower.pieces import Pieces, pieces
from .lower.schedule import contiguous_strides
from .lower.shard import PARTIAL, Sharding, sharding
from .lru import LRU
from .torchop import kinds_of, make_op, own_op_name

_SHARDED: set[str] = set()  # op names whose sharding rule is registered
_WARNED: weakref.WeakSet[KernelHandle] = weakref.WeakSet()  # kernels that warned about a gathered axis


def is_dtensor(value: Any) -> bool:
    """Is ``value`` a DTensor? (Without importing torch.distributed: nobody made one if it is not loaded.)"""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def _describe(t: Any) -> str:
    mesh = t.device_mesh
    return f"placements {tuple(t.placements)} on a {mesh.device_type} mesh of ranks {mesh.mesh.tolist()}"


def check_inputs(names: tuple[str, ...], values: tuple[Any, ...]) -> None:
    """Every tensor a DTensor on one mesh, with placements DTensor can redistribute."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    first = next((n, v) for n, v in zip(names, values) if is_dtensor(v))
    for name, v in zip(names, values):
        if isinstance(v, torch.Tensor) and not is_dtensor(v):
            raise RtxError(
                f"input {name!r} is a plain torch.Tensor but input {first[0]!r} is a DTensor "
                f"({_describe(first[1])}): pass DTensors for every tensor input "
                "(distribute_tensor / DTensor.from_local)"
            )
        if not is_dtensor(v):
            continue
        if v.device_mesh != first[1].device_mesh:
            raise RtxError(
                f"inputs {first[0]!r} ({_describe(first[1])}) and {name!r} ({_describe(v)}) are on different meshes"
            )
        for p in v.placements:
            if type(p) not in (Shard, Replicate, Partial):
                raise RtxError(
                    f"input {name!r} has {_describe(v)}: rtxdsl takes Shard, Replicate and Partial placements"
                )


class DistributedCall:
    """A prepared call for DTensor inputs of one layout: the kernel's op, run by DTensor; or, where
    an input is sharded along an axis the kernel reduces and the graph runs in pieces along it
    (``lower.pieces``), a piece kernel per rank, an all-gather of its reductions' values, and a
    merge kernel (vocabulary-parallel cross-entropy)."""

    __slots__ = ("plan", "program", "any_grad", "run", "arity", "in_pieces", "kernel", "graph", "shards")

    def __init__(self, kernel: KernelHandle, plan: Plan, program: Program, tensors: tuple[Any, ...]) -> None:
        arity = len(kernel.inputs)
        check_inputs(kernel.inputs, tensors[:arity])
        self.program, self.kernel, self.arity = program, kernel, arity
        self.any_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
        kinds = kinds_of(tensors[:arity])
        op = make_op(kernel, kinds)
        _register_sharding(kernel, kinds)
        outputs, single = kernel.outputs, kernel.returns_tensor
        self.plan = plan  # the bound graph's fusion groups (autograd differentiates its graph)
        self.graph = plan.graph
        self.shards = shards = sharding(self.graph)
        self.in_pieces: dict[tuple, PiecesCall | None] = {}  # per placements of the inputs

        def run(ts: tuple[Any, ...]) -> Any:
            values = ts[:arity]
            launch = self.pieces_for(values)
            if launch is not None:
                result = launch.run(values)
                return result[outputs[0]] if single else {n: result[n] for n in outputs}
            if kernel not in _WARNED:
                _warn_gathers(kernel, shards, values)
            result = op(*values)  # hidden seeds are drawn by the kernel on each rank
            return result if single else dict(zip(outputs, result))

        self.run = run

    def pieces_for(self, values: tuple[Any, ...]) -> PiecesCall | None:
        """The call in pieces for inputs of these placements, if it runs in pieces."""
        values = values[: self.arity]
        key = tuple(tuple(getattr(v, "placements", ())) for v in values)
        if key not in self.in_pieces:
            self.in_pieces[key] = _in_pieces(self.kernel, self.graph, self.shards, values)
        return self.in_pieces[key]

    def differentiates(self, tensors: tuple[Any, ...]) -> bool:
        """Does ``run`` record its own autograd graph for these inputs (a call in pieces: torch
        differentiates its kernels and collectives), so the kernel's gradient plan is not used?"""
        return self.pieces_for(tensors) is not None


def _in_pieces(kernel: KernelHandle, graph: Graph, shards: Sharding, values: tuple[Any, ...]) -> PiecesCall | None:
    """Run in pieces when an input is sharded (on a 1-d mesh) along an axis the kernel reduces and
    the graph runs in pieces along it; None: DTensor's sharding propagation, as for any other op."""
    from torch.distributed.tensor import Shard

    if kernel.draws_seeds:
        return None
    for k, (v, whole) in enumerate(zip(values, shards.whole)):
        mesh = getattr(v, "device_mesh", None)
        if mesh is None or mesh.ndim != 1 or not isinstance(v.placements[0], Shard):
            continue
        dim = v.placements[0].dim
        if whole[dim]:
            found = pieces(graph, k, dim)
            return PiecesCall(kernel, found, mesh, values) if isinstance(found, Pieces) else None
    return None


class PiecesCall:
    """A call run in pieces across the ranks of a 1-d mesh: each rank's piece kernel on its shard
    (positions offset by where the shard starts), the values of the reductions over the sharded
    axis all-gathered, and the merge kernel on the stacks (the same on every rank).

    Gradients: the merge kernel's are the same on every rank, so the all-gather's backward keeps
    this rank's slice; a replicated input read by the piece kernel gets each rank's part of its
    gradient (``Partial``), summed by DTensor where it is used."""

    def __init__(self, kernel: KernelHandle, found: Pieces, mesh: Any, values: tuple[Any, ...]) -> None:
        held = next(k for k, d in enumerate(found.dims) if d is not None)
        full = values[held].shape[found.dims[held]]
        self.rank, self.world = mesh.get_local_rank(), mesh.size()
        chunk = -(-full // self.world)  # DTensor's Shard: torch.chunk's pieces
        self.offset = min(full, self.rank * chunk)
        size = max(0, min(full, self.offset + chunk) - self.offset)
        self.found, self.mesh, self.names = found, mesh, kernel.inputs
        self.piece = kernel.derived(found.piece(size))
        self.merge = kernel.derived(found.merge()) if found.merged else None

    def run(self, values: tuple[Any, ...]) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        found, mesh = self.found, self.mesh
        piece_in: dict[str, Any] = {found.offset: self.offset}
        merge_in: dict[str, Any] = {}
        for name, v, d in zip(self.names, values, found.dims):
            if not is_dtensor(v):
                piece_in[name] = merge_in[name] = v
            elif d is not None:
                piece_in[name] = v.redistribute(mesh, [Shard(d)]).to_local()
            else:
                whole = v.redistribute(mesh, [Replicate()])
                piece_in[name] = whole.to_local(grad_placements=[Partial()])
                merge_in[name] = whole.to_local()
        local = self.piece(**{n: piece_in[n] for n in self.piece.inputs})
        group = mesh.get_group()
        for s in found.stacks:
            merge_in[s.name] = _Stack.apply(local[s.name], group, self.rank, self.world)
        device = next(t.device for t in merge_in.values() if isinstance(t, torch.Tensor))
        for s in found.stand_ins:
            merge_in[s.name] = torch.empty((), dtype=s.dtype, device=device).expand(s.shape)
        out: dict[str, Any] = {}
        if self.merge is not None:
            merged = self.merge(**{n: merge_in[n] for n in self.merge.inputs})
            out |= {n: DTensor.from_local(merged[n], mesh, [Replicate()], run_check=False) for n in found.merged}
        roots = dict(found.graph.outputs)
        for name, d in found.local:
            shape = found.graph.of(roots[name]).shape
            stride = contiguous_strides(shape)
            out[name] = DTensor.from_local(local[name], mesh, [Shard(d)], run_check=False, shape=shape, stride=stride)
        return out


class _Stack(torch.autograd.Function):
    """Every rank's tensor stacked along a new first axis (an all-gather). Used by a computation
    replicated on every rank, whose gradient is the same on each: the backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, group: Any, rank: int, world: int) -> torch.Tensor:
        import torch.distributed as dist

        parts = [torch.empty_like(value) for _ in range(world)]
        dist.all_gather(parts, value.contiguous(), group=group)
        ctx.rank = rank
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad[ctx.rank], None, None, None


def _warn_gathers(kernel: KernelHandle, shards: Sharding, values: tuple[Any, ...]) -> None:
    """Warn (once per kernel) when an input is sharded along an axis the kernel needs whole."""
    from torch.distributed.tensor import Shard

    for name, v, whole in zip(kernel.inputs, values, shards.whole):
        for mesh_dim, p in enumerate(getattr(v, "placements", ())):
            if isinstance(p, Shard) and whole[p.dim]:
                _WARNED.add(kernel)
                warnings.warn(
                    f"rtxdsl: input {name!r} is sharded along dim {p.dim} (Shard({p.dim}) on mesh dim "
                    f"{mesh_dim}), which the kernel needs whole ({whole[p.dim]}): DTensor redistributes it "
                    f"before the launch; shard another axis to avoid the communication",
                    stacklevel=4,
                )
                return


def offer_sharding(kernel: KernelHandle) -> None:
    """Register the kernel's op's sharding rule now if DTensor is loaded (a DTensor call registers
    it anyway)."""
    if "torch.distributed.tensor" in sys.modules:
        _register_sharding(kernel)


def _register_sharding(kernel: KernelHandle, kinds: tuple[str, ...] | None = None) -> None:
    """Tell DTensor how the kernel's op (for inputs of ``kinds``) may be sharded (once per op)."""
    name = own_op_name(kernel, kinds)
    if name in _SHARDED:
        return
    from torch.distributed.tensor.experimental import register_sharding

    rules: LRU[tuple, list] = LRU(64)

    def placements(*args: Any) -> list:
        key = tuple((tuple(a.shape), a.tensor_meta.dtype) if hasattr(a, "placements") else type(a) for a in args)
        found = rules.get(key)
        if found is None:
            found = _strategies(kernel, args)
            rules.put(key, found)
        return found

    overload = getattr(torch.ops.rtxdsl, name).default
    register_sharding(overload)(placements)
    _SHARDED.add(name)


def _strategies(kernel: KernelHandle, args: tuple[Any, ...]) -> list:
    """(output placements, input placements) for one mesh dimension: replicate, then each exact way."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    specs = [hasattr(a, "placements") for a in args]
    infos = tuple(
        Info.tensor(tuple(a.shape), a.tensor_meta.dtype) if s else Info.scalar_input(a) for a, s in zip(args, specs)
    )
    infos += (Info.scalar_input(0),) * (len(kernel.variables) - len(infos))  # hidden seeds
    found = sharding(expand(list(kernel.expressions), kernel.variables, infos))
    n_out = len(kernel.outputs)

    def place(dim: int | str | None, is_tensor: bool) -> Any:
        if not is_tensor:
            return None
        if dim == PARTIAL:
            return Partial()
        return Replicate() if dim is None else Shard(dim)

    ways = [([None] * n_out, [None] * len(args))] + [(list(o), list(i)) for o, i in found.ways]
    return [([place(d, True) for d in o], [place(d, s) for d, s in zip(i, specs)]) for o, i in ways]
