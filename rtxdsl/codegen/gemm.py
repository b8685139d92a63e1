"""Triton source for a contraction kernel: Triton tutorial 03's tiled GEMM with the group's epilogue.

The K loop reads A and B tiles through their strides into an fp32 accumulator (``tl.dot``); the
epilogue is the :class:`~rtxdsl.codegen.source.Writer`'s own code for pointwise nodes, at the
tile's ``rows`` x ``cols`` coordinates, with ``acc`` as the contraction's value.
"""

from __future__ import annotations

import torch

from ..dtypes import TRITON_TYPE, compute_dtype
from ..lower.gemm import epilogue_loads
from ..lower.spec import STRIDED, UNIT
from ..ops import REGISTRY, OpKind
from ..ops.elementwise import to_storage
from .source import Writer, _Scope
from .template import render

GEMM = """\
@triton.jit
def ${name}(
    ${params}
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    batch = tl.program_id(1)
    # grouped order: GROUP_M row blocks side by side reuse the same columns of B from L2
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    ${body}
"""

#: one batch's K loop: A [BLOCK_M, BLOCK_K] and B [BLOCK_K, BLOCK_N] tiles, masked at the edges
K_LOOP = """\
for k_start in range(0, K, BLOCK_K):
    ks = k_start + offs_k
    a_mask = (offs_m[:, None] < M) & (ks[None, :] < K)
    a = tl.load(${a_ptr} + ${a_offset}, mask=a_mask, other=0)
    b_mask = (ks[:, None] < K) & (offs_n[None, :] < N)
    b = tl.load(${b_ptr} + ${b_offset}, mask=b_mask, other=0)
    acc = tl.dot(a, b, acc${precision})"""


def _matrix_offset(op: str, idx: tuple[str, str], dims: str, classes: tuple[str, str]) -> str:
    """An operand tile's offset: a unit stride is the index itself (vectorized loads along it)."""
    return " + ".join(i if c == UNIT else f"{i} * {op}_stride_{d}" for i, d, c in zip(idx, dims, classes))


class GemmWriter(Writer):
    """Parameters: the inputs' and outputs' pointers, ``M, N, K``, the batch sizes, A's and B's
    strides (batch dims, then ``m, k`` / ``k, n``), each epilogue load's and output's strides over
    the product's dims, the scalars (the order :func:`rtxdsl.lower.gemm.gemm_spec` passes them)."""

    def build_params(self) -> None:
        s, g = self.spec, self.spec.gemm
        assert g is not None
        self.nb = g.batch
        self.out_dims = (0 if g.sum_batch else g.batch) + 2
        self.params += [f"in{j}_ptr" for j in range(len(s.in_dtypes))]
        self.params += [f"out{k}_ptr" for k in range(len(s.outputs))]
        self.params += ["M", "N", "K", *(f"bsize{d}" for d in range(self.nb))]
        for op, dims, classes in (("a", "mk", g.a_classes), ("b", "kn", g.b_classes)):
            self.params += [f"{op}_stride_b{d}" for d in range(self.nb)]
            self.params += [f"{op}_stride_{dim}" for dim, c in zip(dims, classes) if c == STRIDED]
        nb = self.out_dims - 2
        for k in epilogue_loads(s.nodes):
            ld, name = s.loads[k], self.load_names[k]
            self.params += [f"{name}_stride{d}" for d in range(nb)]
            self.params += [f"{name}_stride{nb + i}" for i, c in enumerate((*ld.rows, *ld.cols)) if c == STRIDED]
        for k in range(len(s.outputs)):
            self.params += [f"out{k}_stride{d}" for d in range(nb + 1)]  # columns: stride 1
        self.params += [f"s{k}" for k in range(len(s.scalars))]

    def gemm(self, name: str) -> str:
        g = self.spec.gemm
        assert g is not None
        self.build_params()
        self.top = _Scope()
        self._scalar_prelude()
        top = self.top
        if self.spec.big:
            top.add_all(["offs_m = offs_m.to(tl.int64)", "offs_n = offs_n.to(tl.int64)"])
        acc_dtype = torch.float64 if self.spec.in_dtypes[g.a] == torch.float64 else torch.float32
        top.add(f"acc = tl.zeros((BLOCK_M, BLOCK_N), dtype={TRITON_TYPE[acc_dtype]})")
        loop = top
        if g.sum_batch and self.nb:  # every batch's product into one accumulator
            top.add(f"for batch in range(0, {' * '.join(f'bsize{d}' for d in range(self.nb))}):")
            loop = _Scope(indent="    ")
        idx = self._decompose(loop, "batch", "b", "bsize", self.nb)  # the batch's coordinates
        bases = {
            "a": "".join(f"{i} * a_stride_b{d} + " for d, i in enumerate(idx)),
            "b": "".join(f"{i} * b_stride_b{d} + " for d, i in enumerate(idx)),
        }
        precision = f', input_precision="{g.precision}"' if self.spec.in_dtypes[g.a] == torch.float32 else ""
        k_loop = render(
            K_LOOP,
            a_ptr=f"in{g.a}_ptr",
            b_ptr=f"in{g.b}_ptr",
            a_offset=bases["a"] + _matrix_offset("a", ("offs_m[:, None]", "ks[None, :]"), "mk", g.a_classes),
            b_offset=bases["b"] + _matrix_offset("b", ("ks[:, None]", "offs_n[None, :]"), "kn", g.b_classes),
            precision=precision,
        )
        loop.add_all(k_loop.rstrip("\n").splitlines())
        if loop is not top:
            top.lines.extend(loop.lines)
        self.out_idx = [] if g.sum_batch else idx
        top.add_all(["rows = offs_m[:, None]", "cols = offs_n[None, :]", "mask = (rows < M) & (cols < N)"])
        contraction = next(i for i, nd in enumerate(self.spec.nodes) if REGISTRY[nd.op].kind is OpKind.CONTRACTION)
        top.memo[("n", contraction)] = "acc"
        self.types["acc"] = acc_dtype
        top.add_all(self.stores(range(len(self.spec.outputs)), top))
        return render(GEMM, name=name, params="\n".join(f"{p}," for p in self.params), body="\n".join(self.top.lines))

    def _tile_offset(self, prefix: str, classes: tuple[str, str]) -> str:
        """An epilogue tensor's offset at the tile: its batch strides, then rows and columns."""
        nb = len(self.out_idx)
        terms = [f"{b} * {prefix}_stride{d}" for d, b in enumerate(self.out_idx)]
        for i, (idx, c) in enumerate(zip(("rows", "cols"), classes)):
            if c == UNIT:
                terms.append(idx)
            elif c == STRIDED:
                terms.append(f"{idx} * {prefix}_stride{nb + i}")
        return " + ".join(terms) or "(rows * 0 + cols * 0)"

    def _emit_load(self, k: int, scope: _Scope) -> str:
        ld = self.spec.loads[k]
        dtype = self.spec.in_dtypes[ld.input]
        offset = self._tile_offset(self.load_names[k], (*ld.rows, *ld.cols))
        text = f"tl.load(in{ld.input}_ptr + {offset}, mask=mask, other=0)"
        cdt = compute_dtype(dtype)
        if cdt != dtype:
            text += f".to({TRITON_TYPE[cdt]})"
        name = f"x{k}"
        scope.add(f"{name} = {text}")
        self.types[name] = cdt
        return name

    def _store(self, k: int, loop: _Scope) -> str:
        o = self.spec.outputs[k]
        v = self.value(("n", o.node), loop)
        val = to_storage(v, self.types[v], o.dtype)
        offset = self._tile_offset(f"out{k}", (STRIDED, UNIT))
        return f"tl.store(out{k}_ptr + {offset}, {val}, mask=mask)"
