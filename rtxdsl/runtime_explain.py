"""Inspection: what a call launches and moves (``Kernel.explain`` and ``Kernel.summary``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .dtypes import SHORT_NAME
from .expr import Expr
from .handle import KernelHandle
from .lower import intermediate_dtype
from .lower.spec import Split
from .runtime_launch import PreparedCall


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


def _fmt_meta(info: Any) -> str:
    return f"{SHORT_NAME[info.dtype]}[{', '.join(map(str, info.shape))}]"


def _launch_shape(call: Any) -> str:
    """Grid, programs, tile and split choice of one launch, in words."""
    spec, meta = call.spec, dict(call.meta)
    programs = 1
    for d in call.grid:
        programs *= d
    if spec.gemm is not None and spec.kind == "row":
        g = spec.gemm
        mode = (
            f"product tiles of {spec.rows_per_program} row(s) x {spec.block} computed in a loop over the row, "
            f"K in slices of {g.block_k}"
        )
    elif spec.gemm is not None:
        g = spec.gemm
        mode = f"GEMM tiles of {g.block_m} x {g.block_n}, K in slices of {g.block_k}, {g.num_stages} stage(s)"
        mode += ", the batch dims summed in each program" if g.sum_batch else ""
        mode += f", its last {g.summed} batch dim(s) summed in each program" if g.summed else ""
    elif spec.kind != "row":
        mode = f"flat blocks of {meta['BLOCK_SIZE']}"
    elif spec.split is Split.TILE:
        mode = f"2-D tiles of {spec.rows_per_program} x {spec.block} (operands laid out differently)"
    else:
        mode = f"tiles of {spec.rows_per_program} row(s) x {spec.block}" + (", looped" if spec.looped else "")
        mode += {
            Split.PARTIAL: ", split: each program reduces a chunk of a row to partial states",
            Split.FINISH: ", split: merges the partial states, writes its chunk",
            Split.MERGE: f", merges {meta.get('SPLIT_BLOCK')} lanes of partial states per row (its row kernel's)",
        }.get(spec.split, "")
        if spec.columns:
            mode += (
                f"; each program loops over blocks of rows, {len(spec.columns)} column reduction(s) over them "
                "(partial states per program, merged by the column group's kernel)"
            )
    if call.chunk is not None:
        c = call.chunk
        mode += f"; launched once per chunk of {c.size} ({c.chunks} chunk(s) of {c.extent}, loop {c.loop})"
    return f"grid {call.grid} ({programs} programs), {mode}"


def explain_text(kernel: KernelHandle, launch: PreparedCall) -> str:
    p, plan = launch.program, launch.plan
    graph = plan.graph
    lines = [f"{kernel!r}"]
    lines.append(
        "inputs: " + ", ".join(f"{n}: {_fmt_meta(graph.of(v))}" for n, v in zip(kernel.inputs, kernel.variables))
    )
    lines.append(
        f"backend: {launch.backend} ({launch.device.type})"
        + ("  [dry_run]" if launch.config.dry_run else "")
        + (f"  [{launch.note}]" if launch.note else "")
    )
    names = {v: n for n, v in zip(kernel.inputs, kernel.variables)}
    outs = {e: k for k, e in graph.outputs}
    writer = {o: g for g in plan.groups for o in g.outputs}
    position = {n: k for k, n in enumerate(graph.nodes)}  # an intermediate's name: tmp<its place>
    for i, g in enumerate(plan.groups):
        domain = f"rows over axes {list(g.axes)} of" if g.is_row else "pointwise over"
        shape = ", ".join(map(str, g.shape))
        lines.append(f"group {i}: {g.pattern} — {domain} [{shape}], {len(g.nodes)} ops: {', '.join(g.ops)}")
        in_names = [names.get(n, f"tmp{position.get(n, 0)}") for n in g.inputs]

        def stored(n: Expr) -> str:  # as the buffer holds it (per-row statistics in float32)
            info = graph.of(n)
            home = writer.get(n)
            dtype = info.dtype if n in outs or home is None else intermediate_dtype(home, info, n)
            return f"{SHORT_NAME[dtype]}[{', '.join(map(str, info.shape))}]"

        reads = ", ".join(f"{n} {stored(v)}" for n, v in zip(in_names, g.inputs))
        writes = ", ".join(f"{outs.get(n, 'intermediate')} {stored(n)}" for n in g.outputs)
        lines.append(f"  reads {reads or 'nothing'}; writes {writes}")
        lines.extend(f"  {note}" for note in g.notes)
        for call in (c for c in p.kernels if c.group == i or c.tail and c.tail.group == i):
            if call.group != i:  # this group runs inside another group's launch
                lines.append(f"  run by the last program of group {call.group}'s kernel, as its tail (no launch)")
                call = call.tail
            lines.append(f"  kernel {call.summary.split(':')[0]}: {_launch_shape(call)}")
            passes = ", ".join(f"{n} x{r}" for n, r in zip(in_names, call.reads))
            lines.append(
                f"    reads {passes or 'no input'}; {call.bytes} bytes"
                + (f", {call.flops} FLOPs on tensor cores" if call.flops else "")
                + (" (empty: not launched)" if call.empty else "")
            )
    torch_run = launch.backend == "torch"
    kernels = p.eager_launches if torch_run else p.kernels_launched
    moved = p.eager_bytes if torch_run else p.bytes_moved
    lines.append(
        f"total: {kernels} kernel launch(es) (eager torch: {p.eager_launches}), "
        f"{moved} bytes moved (eager: {p.eager_bytes}, minimum: {p.minimum_bytes})"
        + (f", {p.flops} FLOPs on tensor cores (minimum: {p.minimum_flops})" if p.minimum_flops else "")
    )
    return "\n".join(lines)
