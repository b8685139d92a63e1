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
from .lower import Program
from .lower.bind import Info
from .lower.expand import expand
from .lower.shard import PARTIAL, Sharding, sharding
from .lru import LRU
from .torchop import kinds_of, make_op

_SHARDED: set[str] = set()  # op names whose sharding rule is registered
_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()  # kernels that warned about a gathered axis


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


class DistributedLaunch:
    """A prepared call for DTensor inputs of one layout: the kernel's op, run by DTensor."""

    __slots__ = ("program", "any_grad", "run")

    def __init__(self, kernel: Any, program: Program, tensors: tuple[Any, ...]) -> None:
        arity = len(kernel.inputs)
        check_inputs(kernel.inputs, tensors[:arity])
        self.program = program
        self.any_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
        op = make_op(kernel, kinds_of(tensors[:arity]))
        _register_sharding(kernel, op)
        outputs, single = kernel.outputs, kernel.returns_tensor
        shards = sharding(program.plan.graph)

        def run(ts: tuple[Any, ...]) -> Any:
            if kernel not in _WARNED:
                _warn_gathers(kernel, shards, ts[:arity])
            result = op(*ts[:arity])  # hidden seeds are drawn by the kernel on each rank
            return result if single else dict(zip(outputs, result))

        self.run = run


def _warn_gathers(kernel: Any, shards: Sharding, values: tuple[Any, ...]) -> None:
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


def offer_sharding(kernel: Any, op: Any) -> None:
    """Register ``op``'s sharding rule now if DTensor is loaded (a DTensor call registers it anyway)."""
    if "torch.distributed.tensor" in sys.modules:
        _register_sharding(kernel, op)


def _register_sharding(kernel: Any, op: Any) -> None:
    """Tell DTensor how ``op`` may be sharded (once per op)."""
    name = op._name
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


def _strategies(kernel: Any, args: tuple[Any, ...]) -> list:
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
