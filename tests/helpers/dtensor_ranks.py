"""What two gloo ranks run for ``tests/test_dtensor.py``: DTensor calls and FSDP2 training.

``python tests/helpers/dtensor_ranks.py OUT_DIR`` starts two processes (``torch.multiprocessing``,
a ``DeviceMesh`` of 2 on CPU); each runs every scenario and pickles the results (placements as
text, errors against a single-process torch reference, warnings, losses, or a traceback) to
``OUT_DIR/rank<r>.pkl``. Everything runs in one pair of processes: starting them is most of the cost.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors: Triton's interpreter, set before rtxdsl loads

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import rtxdsl as rx  # noqa: E402

SCENARIOS: dict[str, Callable[[Any], dict[str, Any]]] = {}


def scenario(fn: Callable[[Any], dict[str, Any]]) -> Callable[[Any], dict[str, Any]]:
    SCENARIOS[fn.__name__] = fn
    return fn


def _data(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _err(got: Any, want: torch.Tensor) -> float:
    full = got.full_tensor() if hasattr(got, "full_tensor") else got
    if full.shape != want.shape:
        return float("inf")
    return (full.double() - want.double()).abs().max().item() if want.numel() else 0.0


def _call(kernel: Any, *args: Any) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = kernel(*args)
    return out, [str(w.message) for w in caught if "rtxdsl" in str(w.message)]


def _placed(t: Any) -> str:
    return ",".join(repr(p) for p in t.placements)


@scenario
def pointwise(mesh: Any) -> dict[str, Any]:
    """bias + GELU: rows sharded (bias replicated), columns sharded (bias sharded the same way)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    k = rx.compile(rx.gelu(rx.var("x") + rx.var("b")) * 2.0)
    x, b = _data(5, 7), _data(7, seed=1)
    want = F.gelu(x + b) * 2.0
    out = {}
    ways = [("rows", Shard(0), Replicate()), ("cols", Shard(1), Shard(0)), ("rep", Replicate(), Replicate())]
    for name, px, pb in ways:
        got, warned = _call(k, distribute_tensor(x, mesh, [px]), distribute_tensor(b, mesh, [pb]))
        out[name] = (_placed(got), tuple(got.to_local().shape), _err(got, want), warned)
    return out


@scenario
def rows(mesh: Any) -> dict[str, Any]:
    """softmax over rows sharded by row (no communication) and by column (gathered, one warning)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    k = rx.compile(rx.softmax(rx.var("x")))
    x = _data(6, 9)
    want = torch.softmax(x, -1)
    by_row, w1 = _call(k, distribute_tensor(x, mesh, [Shard(0)]))
    by_col, w2 = _call(k, distribute_tensor(x, mesh, [Shard(1)]))
    again, w3 = _call(k, distribute_tensor(_data(4, 5), mesh, [Shard(1)]))  # another layout, the same kernel
    return {
        "row": (_placed(by_row), _err(by_row, want), w1),
        "col": (_placed(by_col), _err(by_col, want), w2),
        "col_again": (_err(again, torch.softmax(_data(4, 5), -1)), w3),
    }


@scenario
def partial_sums(mesh: Any) -> dict[str, Any]:
    """A column sum over sharded rows is a partial sum per rank; a row max keeps rows sharded."""
    from torch.distributed.tensor import Shard, distribute_tensor

    x = rx.var("x")
    k = rx.compile({"col": rx.sum(x * 3.0, 0), "row": rx.amax(x, 1)})
    t = _data(7, 4)
    got, warned = _call(k, distribute_tensor(t, mesh, [Shard(0)]))
    return {
        "col": (_placed(got["col"]), _err(got["col"], (t * 3.0).sum(0))),
        "row": (_placed(got["row"]), _err(got["row"], t.amax(1))),
        "warned": warned,
    }


@scenario
def grads(mesh: Any) -> dict[str, Any]:
    """layer_norm forward and fused backward: dx stays row-sharded, dw / db are summed across ranks."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    k = rx.compile(rx.layer_norm(rx.var("x"), rx.var("w"), rx.var("b")) * rx.var("a"))
    x, w, b = _data(5, 8), _data(8, seed=1), _data(8, seed=2)
    dx = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    dw = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
    db = distribute_tensor(b, mesh, [Replicate()]).requires_grad_()
    got, warned = _call(k, dx, dw, db, 1.5)
    got.sum().backward()
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    want = F.layer_norm(xr, (8,), wr, br) * 1.5
    want.sum().backward()
    return {
        "out": (_placed(got), _err(got, want.detach())),
        "dx": (_placed(dx.grad), _err(dx.grad, xr.grad)),
        "dw": _err(dw.grad, wr.grad),
        "db": _err(db.grad, br.grad),
        "warned": warned,
    }


@scenario
def llm(mesh: Any) -> dict[str, Any]:
    """RoPE on row-sharded q; cross-entropy (a mean over rows: gathered); seeded dropout (replicated)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    q, cos, sin = _data(3, 5, 8), _data(5, 8, seed=1), _data(5, 8, seed=2)
    rope = rx.compile(rx.rope(rx.var("q"), rx.var("c"), rx.var("s")))
    placed = [(q, Shard(0)), (cos, Replicate()), (sin, Replicate())]
    got_rope, w1 = _call(rope, *(distribute_tensor(t, mesh, [p]) for t, p in placed))
    logits, target = _data(6, 11), torch.randint(0, 11, (6,), generator=torch.Generator().manual_seed(3))
    ce = rx.compile(rx.cross_entropy(rx.var("x"), rx.var("t")))
    got_ce, w2 = _call(ce, distribute_tensor(logits, mesh, [Shard(0)]), distribute_tensor(target, mesh, [Shard(0)]))
    drop = rx.compile(rx.dropout(rx.var("x"), 0.5, seed=7))
    got_drop, _ = _call(drop, distribute_tensor(logits, mesh, [Shard(0)]))
    return {
        "rope": (_placed(got_rope), _err(got_rope, rope(q, cos, sin)), w1),
        "ce": (_placed(got_ce), _err(got_ce, F.cross_entropy(logits, target)), len(w2)),
        "dropout": (_placed(got_drop), _err(got_drop, drop(logits))),
    }


@scenario
def linear_ce(mesh: Any) -> dict[str, Any]:
    """Linear cross-entropy: tokens sharded (the weight replicated) keep per-token losses sharded;
    a vocabulary-sharded weight (and bias, class weights) runs vocabulary-parallel: each rank's
    per-token logsumexp and target logit over its shard, all-gathered and merged; gradients too."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    h, w = _data(6, 8), _data(11, 8, seed=1) / 3
    b, cw = _data(11, seed=2), _data(11, seed=3).abs() + 0.5
    t = torch.randint(0, 11, (6,), generator=torch.Generator().manual_seed(4))
    t[3] = -100
    per_token = rx.compile(rx.linear_cross_entropy(rx.var("h"), rx.var("w"), rx.var("t"), reduction="none"))
    placed = [distribute_tensor(h, mesh, [Shard(0)]), distribute_tensor(w, mesh, [Replicate()])]
    got_rows, w1 = _call(per_token, *placed, distribute_tensor(t, mesh, [Shard(0)]))
    out = {"rows": (_placed(got_rows), _err(got_rows, F.cross_entropy(F.linear(h, w), t, reduction="none")), w1)}
    options = {
        "mean": {},
        "none": {"reduction": "none"},
        "all": {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 2.0, "bias": True, "weight": True},
        "sum": {"reduction": "sum", "weight": True},
    }
    for name, opts in options.items():
        opts = dict(opts)
        extra = {k: opts.pop(k) for k in ("bias", "weight") if k in opts}
        kernel = rx.compile(
            rx.linear_cross_entropy(
                rx.var("h"), rx.var("w"), rx.var("t"), rx.var("b") if "bias" in extra else None,
                rx.var("cw") if "weight" in extra else None, **opts,
            )
        )  # fmt: skip
        leaves = [h, w] + [b] * ("bias" in extra) + [cw] * ("weight" in extra)
        places = [Replicate(), Shard(0), Shard(0), Shard(0)]  # the vocabulary sharded
        dts = [distribute_tensor(x, mesh, [p]).requires_grad_() for x, p in zip(leaves, places)]
        got, warned = _call(kernel, *dts[:2], distribute_tensor(t, mesh, [Replicate()]), *dts[2:])
        got.sum().backward()
        refs = [x.clone().requires_grad_() for x in leaves]
        # the same kernel in one process (checked against float64 torch in test_linear_ce.py)
        want = kernel(*refs[:2], t, *refs[2:])
        if name == "mean":
            assert _err(want, F.cross_entropy(F.linear(h, w), t)) < 1e-12
        want.sum().backward()
        out[name] = {
            "loss": (_placed(got), _err(got, want.detach()), warned),
            "grads": [(_placed(d.grad), _err(d.grad, r.grad)) for d, r in zip(dts, refs)],
        }
    return out


@scenario
def bad_input(mesh: Any) -> dict[str, Any]:
    """A plain tensor next to a DTensor, and DTensors on two different meshes."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    k = rx.compile(rx.var("x") + rx.var("y"))
    x = distribute_tensor(_data(4, 3), mesh, [Shard(0)])
    errors = {}
    other = DeviceMesh("cpu", [1, 0])
    for name, y in [("mixed", _data(4, 3)), ("meshes", distribute_tensor(_data(4, 3), other, [Replicate()]))]:
        try:
            k(x, y)
            errors[name] = None
        except rx.RtxError as exc:
            errors[name] = str(exc)
    return errors


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 16), rx.nn.RMSNorm(16), rx.nn.SwiGLU(16, 24), rx.nn.LayerNorm(16), torch.nn.Linear(16, 5)
    )


def train(model: torch.nn.Module, steps: int = 5) -> tuple[list[float], Any]:
    """``steps`` AdamW steps of rtxdsl's optimizer on one fixed batch; the losses and the optimizer."""
    opt = rx.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = rx.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1)
    x, t = torch.randn(8, 12, generator=gen), torch.randint(0, 5, (8,), generator=gen)
    losses = []
    for _ in range(steps):
        loss = loss_fn(model(x), t)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt


@scenario
def fsdp2(mesh: Any) -> dict[str, Any]:
    """fully_shard an MLP of rx.nn modules; rx.optim.AdamW steps the sharded (DTensor) parameters."""
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses, opt = train(model)
    param = next(iter(model.parameters()))
    sharded = {
        "losses": losses,
        "param": (type(param).__name__, _placed(param)),
        "exp_avg": type(opt.state[param]["exp_avg"]).__name__,
        # the step's kernel (functional for DTensors) ran on DTensors, then on each rank's local pieces
        "step_launches": sorted({type(v).__name__ for v in rx.optim._adamw_kernel(False, False)._launches.values()}),
    }
    return {**sharded, "single_process": train(_mlp())[0]}


def rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank: every scenario, each result (or its traceback) pickled to ``out_dir``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    results: dict[str, Any] = {}
    for name, fn in SCENARIOS.items():
        try:
            results[name] = fn(mesh)
        except Exception:  # noqa: BLE001 - reported to the test, which fails with the traceback
            results[name] = {"error": traceback.format_exc()}
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)


def main(out_dir: str, world: int = 2) -> None:
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(rank_main, args=(world, port, out_dir), nprocs=world)


if __name__ == "__main__":
    main(sys.argv[1])
