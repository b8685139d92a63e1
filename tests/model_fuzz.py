"""A model-shaped differential fuzzer: what transformer code does, run by rtxdsl against torch.

Each program is one drawn model: an input (activations, fp32 activations cast down, or token
embeddings by ``F.embedding`` / ``torch.gather``, plus positions), prologues (an activation, a
cast), one or two blocks (an MLP ``linear -> bias -> activation -> linear``, a gated MLP with
separate or fused ``gate_up``, attention by hand: q/k/v or fused qkv, views to heads, scaled
scores, causal masks by ``masked_fill`` or by adding, softmax in fp32 and back, ``@ v``, the output
projection; or ``F.scaled_dot_product_attention`` / ``rx.attention``, causal or not, grouped-query
with fewer key/value heads) wrapped pre-norm or post-norm with residuals (also in place), and a head (logits with
cross-entropy: ignored and all-ignored targets, label smoothing, every reduction, class weights,
fp32 weights with upcast half logits, softcap; linear cross-entropy; mean pooling and a
classifier). Projections draw their weights plain, stored transposed, strided, sliced, as fp32
master weights cast down, or tied (the embedding matrix as the head). fp32, fp16 and bf16.

The program is Python text written twice from one draw: over torch (``F.linear``, ``@``,
``F.layer_norm``, ``.view``/``.transpose``, ``masked_fill``, ``F.cross_entropy``, in-place ``+=``)
and over rtxdsl expressions (``rx.linear``, ``rx.layer_norm``, ``rx.reshape``, ``rx.where``,
``rx.linear_cross_entropy``). The torch text runs eagerly in the program's dtype and in float64 on
the same inputs upcast (the reference); rtxdsl runs it in two modes:

* ``lazy``: the torch text as-is with the activations (and some weights) wrapped by
  ``f.lazy``; results materialized with ``.torch()``; gradients through them. Inference programs
  run under ``torch.no_grad()`` and write in place (residuals, activations, scores, inputs).
* ``dsl``: the rtxdsl text, compiled with ``rx.compile({outputs})`` and called with the tensors.

A second step (a third of the programs) runs again on the same ``Fusion`` / ``Kernel`` with new
inputs. Every output and gradient (and, in the lazy mode, every input after in-place writes) is
compared with float64 torch; it is accepted when it is no farther from float64 than eager torch
in the program's dtype: per element ``|rx - ref| <= 2 * max|eager - ref| + atol * scale + rtol *
|ref|`` (``TOLERANCE`` of ``tests/fuzzing.py`` for the coarser of the output's and the program's
dtype; ``scale`` the reference's largest magnitude, for a gradient at least a tenth of the
program's largest gradient, and all of it where float64's gradient is exactly 0: eager's may be 0
by luck of its formula), plus ``SENSITIVITY`` times how far float64 itself moves at that element
when every input is rounded once more to the program's dtype (``_spreads``, computed only where
the first bound fails: an ill-conditioned element is determined no better than that in half
precision). NaN where eager is NaN is fine; NaN or inf where eager is finite is wrong; dtypes and
shapes must be eager's.

Each program gets a verdict: ``ok``, ``wrong``, ``crash`` (any exception but a refusal, or an
``RtxError`` where eager succeeds), ``refusal`` (an ``RtxError`` saying an op is not fused or
supported), ``skip`` (eager torch itself raises). Failures are grouped by (mode, verdict, exception
type, innermost rtxdsl frame) so the classes show.

Run::

    python tests/model_fuzz.py --mode both --programs 300 --seed 1     # the report
    python tests/model_fuzz.py --show 100017                           # one program's texts
    python tests/model_fuzz.py --one 100017 --mode lazy                # run it, with the traceback
    python tests/model_fuzz.py --mode dsl --programs 50 --progress     # each id before it runs

Program ids are ``seed * 100_000 + k``. ``--progress`` prints each id before its run (with
``faulthandler`` on, a segfault names the program). ``tests/test_model_fuzz.py`` runs a budget at a
fixed seed and at a seed from the commit (``RTXDSL_MODEL_FUZZ_SEED``).
"""

from __future__ import annotations

import os

# as the test suite runs (tests/conftest.py): every interpreted load and store bounds-checked
os.environ.setdefault("RTXDSL_CHECK_BOUNDS", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import faulthandler  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections import Counter, defaultdict  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fuzzing import TOLERANCE  # noqa: E402

import rtxdsl as rx  # noqa: E402

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
#: float64 runs at inputs rounded once more, and how many times their spread widens the bound
JITTERS, SENSITIVITY = 8, 2.0
MODES = ("dsl", "lazy")
SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}
#: an RtxError saying rtxdsl does not fuse (or support) what it was given: a refusal, not a crash
REFUSAL = re.compile(r"not (yet )?(supported|fused|implemented)|does not (yet )?(support|fuse)|unsupported|cannot fuse")


def _tuple(shape: tuple[int, ...]) -> str:
    return f"({shape[0]},)" if len(shape) == 1 else f"({', '.join(map(str, shape))})"


@dataclass
class Input:
    """One input tensor: the python expression that builds it (reads ``DT``, ``ACC``, ``gen(k)``),
    whether it requires grad, and whether the lazy mode wraps it (else a plain tensor, as a
    module's parameter is)."""

    name: str
    source: str
    grad: bool
    lazy: bool


@dataclass
class Program:
    pid: int
    dtype: torch.dtype
    inputs: list[Input]
    torch_lines: list[str]
    dsl_lines: list[str]
    outputs: list[str]
    no_grad: bool
    steps: int
    tags: list[str] = field(default_factory=list)
    prefixes: list[tuple[int, int, str]] = field(default_factory=list)

    def header(self) -> str:
        mode = "no_grad (inference, in-place writes)" if self.no_grad else "with gradients"
        return f"# program {self.pid}: {SHORT[self.dtype]}, {mode}, {self.steps} step(s); {' '.join(self.tags)}"

    def script(self, mode: str) -> str:
        """A standalone script running this program (step 0) with rtxdsl in ``mode``: for bisecting."""
        lines = [
            self.header(),
            "import math, torch, torch.nn.functional as F, rtxdsl as rx",
            f"DT, ACC = torch.{str(self.dtype).removeprefix('torch.')}, torch.float32",
            f"gen = lambda k: torch.Generator().manual_seed({_seed(self.pid, 0, 0)} + k)",
        ]
        for i in self.inputs:
            lines.append(f"{i.name} = {i.source}" + (".requires_grad_()" if i.grad else ""))
        leaves = [i.name for i in self.inputs if i.grad]
        lines.append(f"leaves = [{', '.join(leaves)}]")
        grad = (
            ""
            if self.no_grad
            else "grads = torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs], allow_unused=True)"
        )
        if mode == "lazy":
            lines.append("f = rx.Fusion()")
            lines += [f"{i.name} = f.lazy({i.name})" for i in self.inputs if i.lazy]
            body = self.torch_lines
            outs = [f"{o}.torch() if isinstance({o}, rx.LazyTensor) else {o}" for o in self.outputs]
        elif mode == "dsl":
            lines.append("T = {n: v for n, v in dict(globals()).items() if isinstance(v, torch.Tensor)}")
            lines += [f"{i.name} = rx.var({i.name!r})" for i in self.inputs]
            body = self.dsl_lines
            outs = []
        else:  # eager torch
            body, outs = self.torch_lines, list(self.outputs)
        if self.no_grad:
            lines.append("torch.set_grad_enabled(False)")
        lines += body
        if mode == "dsl":
            lines.append(f"k = rx.compile({{{', '.join(f'{o!r}: {o}' for o in self.outputs)}}})")
            lines.append("out = k(**{n: T[n] for n in k.inputs})")
            lines.append("outs = [o for o in out.values() if o.requires_grad]")
        else:
            lines.append(f"outs = [{', '.join(outs)}]")
            lines.append("outs = [o for o in outs if o.requires_grad]")
        if grad:
            lines.append(grad)
        lines.append("print([(o.dtype, tuple(o.shape)) for o in outs])")
        return "\n".join(lines)

    def source(self) -> str:
        ins = "\n".join(
            f"{i.name} = {i.source}" + ("  # requires grad" if i.grad else "") + ("  # lazy" if i.lazy else "")
            for i in self.inputs
        )
        return (
            f"{self.header()}\n# inputs\n{ins}\n# torch (eager, float64 reference, lazy)\n"
            + "\n".join(self.torch_lines)
            + "\n# rtxdsl\n"
            + "\n".join(self.dsl_lines)
            + f"\n# outputs: {', '.join(self.outputs)}"
        )


def _seed(pid: int, step: int, k: int) -> int:
    """A generator seed per program, step and input: within int64 for every program id (a commit
    seed's ids reach 2.7e13: unreduced, torch's manual_seed overflowed and eager 'raised' on all)."""
    return ((pid * 1009 + step * 101) * 1000) % 2**62 + k


#: activation -> (torch, rtxdsl, torch in place or None)
ACTS = {
    "relu": ("torch.relu({x})", "rx.relu({x})", "torch.relu_({x})"),
    "relu_fn": ("F.relu({x})", "rx.relu({x})", "F.relu({x}, inplace=True)"),
    "gelu": ("F.gelu({x})", "rx.gelu({x})", None),
    "gelu_tanh": ("F.gelu({x}, approximate='tanh')", "rx.gelu({x}, approximate='tanh')", None),
    "silu": ("F.silu({x})", "rx.silu({x})", "F.silu({x}, inplace=True)"),
    "tanh": ("torch.tanh({x})", "rx.tanh({x})", "{x}.tanh_()"),
    "sigmoid": ("{x}.sigmoid()", "rx.sigmoid({x})", "{x}.sigmoid_()"),
}


class _Gen:
    """Draws one program, writing its torch and rtxdsl texts side by side."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.far = 0.0  # the hidden states' offset from zero (``embed``)
        self.r = r = random.Random(pid)
        self.dtype: torch.dtype = r.choice(FLOATS)
        # inference (a fifth): no gradients, so in-place writes anywhere (residuals, activations, inputs)
        self.no_grad = r.random() < 0.2
        # a second step on the same Fusion / Kernel with new inputs (a training loop's next step)
        self.steps = 2 if r.random() < 0.3 else 1
        # batch dims 0..2 before [tokens, hidden]; few rows in all (interpreted launches cost per element)
        self.batch = tuple(r.randint(1, 3) for _ in range(r.choice([0, 1, 1, 2])))
        self.T = r.randint(1, 13) if len(self.batch) < 2 else r.randint(1, 5)
        self.attention = r.random() < 0.45
        if self.attention:  # hidden = heads x head dim
            self.heads = r.randint(1, 3)
            self.hd = r.randint(max(2, math.ceil(3 / self.heads)), 8)
            self.H = self.heads * self.hd
        # a tenth (drawn apart) has a hidden size and a vocabulary above 128: a loss head's backward
        # then runs the chunk loop over two chunks (lower/chunk.py)
        wide = not self.attention and random.Random(pid * 7919 + 1).random() < 0.1
        if not self.attention:
            self.H = r.randint(129, 140) if wide else r.randint(3, 24)
        # a third of the unbatched ones without attention (drawn apart): tokens == hidden, so
        # products of different roles have one shape (dy @ wd beside dy.T @ h, a tied square weight
        # applied twice): analyze.merge_products must tell which may share a kernel (the programs
        # tests pin, 22750215300000 and 2026140200048, are drawn as before)
        if not self.batch and not self.attention and not wide and random.Random(pid * 41 + 3).random() < 1 / 3:
            self.T = self.H
        self.V = r.randint(129, 160) if wide else r.randint(5, 37)
        self.inputs: list[Input] = []
        self.torch: list[str] = []
        self.dsl: list[str] = []
        self.outputs: list[str] = []
        self.tags: list[str] = []
        self.weights: dict[tuple[int, int], list[str]] = defaultdict(list)  # plain [out, in] weights, to tie
        self.embedding: str | None = None
        self.prefixes: list[tuple[int, int, str]] = []  # (torch lines, rtxdsl lines, the value they end with)
        self.n = 0

    # ---- text ---------------------------------------------------------------------------------
    @property
    def rows(self) -> tuple[int, ...]:
        return (*self.batch, self.T)

    @property
    def dims(self) -> int:  # of the hidden states [*batch, T, H]
        return len(self.rows) + 1

    @property
    def N(self) -> int:  # noqa: N802 (the tokens of all rows)
        return math.prod(self.rows)

    def name(self, stem: str) -> str:
        self.n += 1
        return f"{stem}{self.n}"

    def let(self, stem: str, torch_text: str, dsl_text: str | None = None) -> str:
        """``stem<n> = ...`` in both texts (the same text where the two APIs agree)."""
        name = self.name(stem)
        self.both(f"{name} = {torch_text}", f"{name} = {torch_text if dsl_text is None else dsl_text}")
        return name

    def both(self, torch_line: str, dsl_line: str) -> None:
        """One line in each text; the value the rtxdsl line binds ends a prefix ``--shrink`` tries."""
        self.torch.append(torch_line)
        self.dsl.append(dsl_line)
        self.mark(dsl_line.split("=")[0].split(",")[0].strip())

    def mark(self, name: str) -> None:
        self.prefixes.append((len(self.torch), len(self.dsl), name))

    def input(
        self,
        stem: str,
        shape: tuple[int, ...],
        *,
        source: str | None = None,
        scale: float = 1.0,
        offset: float = 0.0,
        dtype: str = "DT",
        grad: bool | None = None,
        layout: str = "contiguous",
        lazy: bool | None = None,
    ) -> str:
        """A new input; float ones are ``randn * scale + offset`` in ``dtype`` laid out as ``layout``."""
        name = self.name(stem)
        k = len(self.inputs)
        if source is None:
            if layout == "transposed":  # stored as its transpose: the strides swapped
                base, tail = (*shape[:-2], shape[-1], shape[-2]), ".transpose(-1, -2)"
            elif layout == "sliced":  # every other column of a wider tensor: a strided last dim
                base, tail = (*shape[:-1], 2 * shape[-1]), "[..., ::2]"
            else:
                base, tail = shape, ""
            mul = ("" if scale == 1.0 else f" * {scale}") + ("" if offset == 0.0 else f" + {offset}")
            source = f"(torch.randn({_tuple(base)}, generator=gen({k})){mul}).to({dtype}){tail}"
        if grad is None:
            grad = self.r.random() < 0.75  # frozen weights a quarter of the time
        if lazy is None:
            lazy = self.r.random() < 0.5  # a plain tensor (a module's parameter) read by lazy ops, or wrapped
        self.inputs.append(Input(name, source.replace("gen(k)", f"gen({k})"), grad and not self.no_grad, lazy))
        return name

    def layout(self, shape: tuple[int, ...]) -> str:
        """Contiguous mostly; transposed or strided storage a fifth of the time (views a caller made)."""
        x = self.r.random()
        if x < 0.1 and len(shape) >= 2 and shape[-1] > 1 and shape[-2] > 1:
            return "transposed"
        return "sliced" if x < 0.2 else "contiguous"

    # ---- pieces ----------------------------------------------------------------------------------
    def act(self, x: str, fresh: bool) -> str:
        """An activation; in place under no_grad where ``x`` is a fresh value nothing else reads."""
        name = self.r.choice(sorted(ACTS))
        if name.startswith("relu") and self.dtype is not torch.float32 and not self.no_grad:
            # relu's gradient is a mask at 0: a pre-activation that cancels to within a half ulp of
            # 0 takes either side by chance for any result not bit-equal to eager's, and one
            # element's term of a weight gradient goes (program 19704994500047: rtxdsl's RMSNorm
            # one bf16 ulp from eager's, every forward error eager's own); half-precision gradients
            # take a smooth activation (the same draw: every other program stays as it was)
            name = "silu"
        t, d, inplace = ACTS[name]
        self.tags.append(name)
        if self.no_grad and fresh and inplace and self.r.random() < 0.5:
            self.both(inplace.format(x=x), f"{x} = {d.format(x=x)}")
            return x
        return self.let("a", t.format(x=x), d.format(x=x))

    def weight(self, fin: int, fout: int) -> tuple[str, str, str, str]:
        """A ``[fout, fin]`` weight operand: (torch, rtxdsl) texts of it and of its transpose."""
        r = self.r
        tied = self.weights.get((fout, fin))
        if tied and r.random() < 0.15:  # one weight in two places (shared layers)
            self.tags.append("tied")
            w = r.choice(tied)
            return w, w, f"{w}.t()", f"rx.transpose({w}, 0, 1)"
        form = r.choice(["plain", "plain", "plain", "stored_t", "strided", "sliced", "master"])
        scale = round(1 / math.sqrt(fin), 3)
        if form == "stored_t":  # stored [in, out] (w.t() kept), used as .t() / read by x @ wt
            wt = self.input("wt", (fin, fout), scale=scale)
            self.tags.append("w.t()")
            return f"{wt}.t()", f"rx.transpose({wt}, 0, 1)", wt, wt
        if form == "sliced":  # the first rows / columns of a larger weight
            eo, ei = r.randint(0, 3), r.randint(0, 3) or 1
            w = self.input("w", (fout + eo, fin + ei), scale=scale)
            s = f"{w}[:{fout}, :{fin}]"
            self.tags.append("w[:, :k]")
            return s, s, f"{s}.t()", f"rx.transpose({s}, 0, 1)"
        if form == "master":  # fp32 master weights cast down at use (a GEMM prologue)
            w = self.input("w", (fout, fin), scale=scale, dtype="ACC")
            self.tags.append("w.to(DT)")
            return f"{w}.to(DT)", f"rx.cast({w}, DT)", f"{w}.to(DT).t()", f"rx.transpose(rx.cast({w}, DT), 0, 1)"
        layout = "transposed" if form == "strided" else "contiguous"  # strided: w.t() stored, .t() again
        w = self.input("w", (fout, fin), scale=scale, layout=layout)
        if form == "plain":
            self.weights[(fout, fin)].append(w)
        else:
            self.tags.append("strided w")
        return w, w, f"{w}.t()", f"rx.transpose({w}, 0, 1)"

    def bias(self, fout: int, p: float = 0.5) -> str | None:
        return self.input("b", (fout,), scale=0.1) if self.r.random() < p else None

    def linear(self, x: str, dims: int, fin: int, fout: int, *, stem: str = "y") -> str:
        """A projection ``x @ w.T (+ b)`` of a ``dims``-dim ``x``, written as models write it."""
        r = self.r
        tw, dw, twt, dwt = self.weight(fin, fout)
        b = self.bias(fout)
        style = r.choice(["F.linear"] * 4 + ["matmul", "bias after"] + (["addmm"] if dims == 2 and b else []))
        if style == "addmm":
            return self.let(stem, f"torch.addmm({b}, {x}, {twt})", f"rx.linear({x}, {dw}, {b})")
        if style == "matmul":
            plus = f" + {b}" if b else ""
            return self.let(stem, f"{x} @ {twt}{plus}", f"{x} @ {dwt}{plus}")
        if style == "bias after" and b:  # the bias as its own add (an epilogue)
            return self.let(stem, f"F.linear({x}, {tw}) + {b}", f"rx.linear({x}, {dw}) + {b}")
        arg = f", {b}" if b else ""
        return self.let(stem, f"F.linear({x}, {tw}{arg})", f"rx.linear({x}, {dw}{arg})")

    def norm(self, x: str) -> str:
        """LayerNorm or RMSNorm: torch's functions, or in fp32 and back (HF Llama's RMSNorm by hand)."""
        r, H = self.r, self.H
        kind = r.choice(["layer", "layer", "rms", "rms", "rms_by_hand", "rms_fp32"])
        self.tags.append(kind)
        eps = r.choice([1e-5, 1e-6])
        w = (
            self.input("g", (H,), source=f"(torch.rand(({H},), generator=gen(k)) + 0.5).to(DT)")
            if r.random() < 0.8
            else None
        )
        if kind == "layer":
            b = self.bias(H, 0.6) if w else None
            return self.let("n", f"F.layer_norm({x}, ({H},), {w}, {b}, {eps})", f"rx.layer_norm({x}, {w}, {b}, {eps})")
        if kind == "rms":
            return self.let("n", f"F.rms_norm({x}, ({H},), {w}, {eps})", f"rx.rms_norm({x}, {w}, {eps})")
        if kind == "rms_fp32":  # the norm in fp32, the result cast back
            tw, dw = (f"{w}.float()", f"rx.cast({w}, ACC)") if w else ("None", "None")
            return self.let(
                "n",
                f"F.rms_norm({x}.float(), ({H},), {tw}, {eps}).to(DT)",
                f"rx.cast(rx.rms_norm(rx.cast({x}, ACC), {dw}, {eps}), DT)",
            )
        xf = self.let("xf", f"{x}.to(ACC)", f"rx.cast({x}, ACC)")
        var = self.let("var", f"{xf}.pow(2).mean(-1, keepdim=True)", f"rx.mean({xf} * {xf}, -1, keepdim=True)")
        y = self.let("n", f"{xf} * torch.rsqrt({var} + {eps})", f"{xf} * rx.rsqrt({var} + {eps})")
        if w is None:
            return self.let("n", f"{y}.to(DT)", f"rx.cast({y}, DT)")
        return self.let("n", f"{w} * {y}.to(DT)", f"{w} * rx.cast({y}, DT)")

    # ---- blocks ----------------------------------------------------------------------------------
    def mlp(self, x: str) -> str:
        """linear -> bias -> activation -> linear."""
        self.tags.append("mlp")
        inter = self.r.randint(3, 24)
        u = self.linear(x, self.dims, self.H, inter, stem="u")
        return self.linear(self.act(u, fresh=True), self.dims, inter, self.H)

    def gated(self, x: str) -> str:
        """SwiGLU / GeGLU: gate and up separate or one fused gate_up projection, split in two."""
        r, rank, H = self.r, self.dims, self.H
        inter = r.randint(3, 16)
        if r.random() < 0.5:
            self.tags.append("gate_up")
            gu = self.linear(x, rank, H, 2 * inter, stem="gu")
            g, u = self.name("g"), self.name("u")
            if r.random() < 0.5:
                self.both(f"{g}, {u} = {gu}.chunk(2, dim=-1)", f"{g}, {u} = rx.chunk({gu}, 2, -1)")
            else:
                self.both(
                    f"{g}, {u} = {gu}[..., :{inter}], {gu}[..., {inter}:]",
                    f"{g}, {u} = {gu}[..., :{inter}], {gu}[..., {inter}:]",
                )
        else:
            self.tags.append("gate,up")
            g = self.linear(x, rank, H, inter, stem="g")
            u = self.linear(x, rank, H, inter, stem="u")
        if r.random() < 0.7:
            a = self.let("a", f"F.silu({g}) * {u}", f"rx.silu({g}) * {u}")
        else:
            a = self.let("a", f"F.gelu({g}, approximate='tanh') * {u}", f"rx.gelu({g}, approximate='tanh') * {u}")
        return self.linear(a, rank, inter, H, stem="y")

    def attn(self, x: str) -> str:
        """Attention by hand: q/k/v (or fused qkv), heads, scaled scores, a causal mask, softmax, @ v;
        or (a fifth of the blocks of one batch dim, decided by a draw of its own) by SDPA."""
        if len(self.batch) == 1 and random.Random(self.pid * 31 + len(self.torch)).random() < 0.2:
            return self.sdpa(x)  # (rx.attention takes [B, H, T, D], DESIGN section 8)
        r, rank, H, T, nh, hd = self.r, self.dims, self.H, self.T, self.heads, self.hd
        if r.random() < 0.5:
            self.tags.append("qkv")
            qkv = self.linear(x, rank, H, 3 * H, stem="qkv")
            q, k, v = self.name("q"), self.name("k"), self.name("v")
            if r.random() < 0.5:
                self.both(f"{q}, {k}, {v} = {qkv}.chunk(3, -1)", f"{q}, {k}, {v} = rx.chunk({qkv}, 3, -1)")
            else:
                parts = f"{qkv}[..., :{H}], {qkv}[..., {H}:{2 * H}], {qkv}[..., {2 * H}:]"
                self.both(f"{q}, {k}, {v} = {parts}", f"{q}, {k}, {v} = {parts}")
        else:
            self.tags.append("q,k,v")
            q, k, v = (self.linear(x, rank, H, H, stem=s) for s in "qkv")
        split = _tuple((*self.batch, T, nh, hd))

        def heads(t: str) -> str:  # [.., T, H] -> [.., heads, T, head dim]
            return self.let(
                "h", f"{t}.view{split}.transpose(-2, -3)", f"rx.transpose(rx.reshape({t}, {split}), -2, -3)"
            )

        q, k, v = heads(q), heads(k), heads(v)
        scale = round(1 / math.sqrt(hd), 6)
        form = r.choice(["after", "before", "div"])
        if form == "after":
            s = self.let("s", f"{q} @ {k}.transpose(-1, -2) * {scale}", f"{q} @ rx.transpose({k}, -1, -2) * {scale}")
        elif form == "before":
            s = self.let("s", f"({q} * {scale}) @ {k}.mT", f"({q} * {scale}) @ rx.transpose({k}, -1, -2)")
        else:
            root = round(math.sqrt(hd), 6)
            s = self.let(
                "s",
                f"torch.matmul({q}, {k}.transpose(-2, -1)) / {root}",
                f"rx.matmul({q}, rx.transpose({k}, -2, -1)) / {root}",
            )
        mask = r.choice(["none", "fill", "fill", "fill computed", "add", "add"])
        self.tags.append(f"mask:{mask}")
        causal = f"torch.ones({T}, {T}, dtype=torch.bool).triu(1)"
        fill = "float('-inf')"
        # left padding under the causal mask (a third of the masks, by a draw of its own: the programs
        # drawn before it stay as they were): the padded queries see no key, each of their scores the
        # dtype's lowest (as Hugging Face masks), so torch's softmax is uniform there
        pad = random.Random(self.pid * 53 + len(self.torch))
        if mask in ("fill", "add") and T > 1 and pad.random() < 0.35:
            causal = f"({causal} | (torch.arange({T}) < {pad.randint(1, T - 1)}))"
            fill = "torch.finfo(DT).min"
            self.tags.append("padding")
        if mask == "fill":
            m = self.input("m", (T, T), source=causal, grad=False)
            if self.no_grad and r.random() < 0.5:
                self.both(f"{s}.masked_fill_({m}, {fill})", f"{s} = rx.where({m}, {fill}, {s})")
            else:
                s = self.let("s", f"{s}.masked_fill({m}, {fill})", f"rx.where({m}, {fill}, {s})")
        elif mask == "fill computed":  # the mask built in the program (rtxdsl: from positions)
            s = self.let(
                "s",
                f"{s}.masked_fill({causal}, float('-inf'))",
                f"rx.where(rx.arange_like({s}, -1) > rx.arange_like({s}, -2), float('-inf'), {s})",
            )
        elif mask == "add":  # an additive mask: -inf or the dtype's lowest above the diagonal
            low = fill if "finfo" in fill else r.choice(["float('-inf')", "torch.finfo(DT).min"])
            am = self.input(
                "am", (T, T), source=f"torch.zeros({T}, {T}, dtype=DT).masked_fill({causal}, {low})", grad=False
            )
            s = self.let("s", f"{s} + {am}")
        soft = r.choice(["fp32", "fp32", "dtype=", "plain"])
        self.tags.append(f"softmax:{soft}")
        if soft == "fp32":
            p = self.let(
                "p", f"torch.softmax({s}.float(), dim=-1).to(DT)", f"rx.cast(rx.softmax(rx.cast({s}, ACC), -1), DT)"
            )
        elif soft == "dtype=":
            p = self.let(
                "p", f"torch.softmax({s}, -1, dtype=ACC).to(DT)", f"rx.cast(rx.softmax(rx.cast({s}, ACC), -1), DT)"
            )
        else:
            p = self.let("p", f"F.softmax({s}, dim=-1)", f"rx.softmax({s}, -1)")
        o = self.let("o", f"{p} @ {v}", f"{p} @ {v}")
        merge = _tuple(self.rows + (H,))
        if r.random() < 0.5:
            o = self.let(
                "o", f"{o}.transpose(-2, -3).reshape{merge}", f"rx.reshape(rx.transpose({o}, -2, -3), {merge})"
            )
        else:
            o = self.let(
                "o",
                f"{o}.transpose(-2, -3).contiguous().view{merge}",
                f"rx.reshape(rx.transpose({o}, -2, -3), {merge})",
            )
        return self.linear(o, rank, H, H, stem="y")

    def sdpa(self, x: str) -> str:
        """``F.scaled_dot_product_attention`` (rtxdsl: ``rx.attention``) over projected heads: causal
        or not, and grouped-query (``enable_gqa``: fewer key/value heads, their projections narrower)
        where there are several query heads."""
        r, rank, H, T, nh, hd = self.r, self.dims, self.H, self.T, self.heads, self.hd
        kv = r.choice([g for g in range(1, nh + 1) if nh % g == 0])  # key/value heads
        self.tags.append(f"sdpa:{nh}/{kv}")
        q = self.linear(x, rank, H, H, stem="q")
        k, v = (self.linear(x, rank, H, kv * hd, stem=s) for s in "kv")

        def heads(t: str, n: int) -> str:  # [.., T, n * hd] -> [.., n, T, hd]
            split = _tuple((*self.batch, T, n, hd))
            return self.let(
                "h", f"{t}.view{split}.transpose(-2, -3)", f"rx.transpose(rx.reshape({t}, {split}), -2, -3)"
            )

        q, k, v = heads(q, nh), heads(k, kv), heads(v, kv)
        causal, gqa = r.random() < 0.7, kv != nh
        o = self.let(
            "o",
            f"F.scaled_dot_product_attention({q}, {k}, {v}, is_causal={causal}, enable_gqa={gqa})",
            f"rx.attention({q}, {k}, {v}, causal={causal}, enable_gqa={gqa})",
        )
        merge = _tuple(self.rows + (H,))
        o = self.let("o", f"{o}.transpose(-2, -3).reshape{merge}", f"rx.reshape(rx.transpose({o}, -2, -3), {merge})")
        return self.linear(o, rank, H, H, stem="y")

    def block(self, h: str) -> str:
        """One block, pre-norm (``h + f(norm(h))``), post-norm (``norm(h + f(h))``) or bare."""
        r = self.r
        kinds = ["mlp", "gated"] + (["attn", "attn"] if self.attention else [])
        f = {"mlp": self.mlp, "gated": self.gated, "attn": self.attn}[r.choice(kinds)]
        style = r.choice(["pre", "pre", "pre", "post", "bare"])
        if self.far:  # a residual stream far from zero: every block reads it normed (pre-norm LLMs;
            style = "pre"  # projected raw, scores of 1e6 leave a fused backward's rowsum(dO * O) ulps off)
        self.tags.append(f"{style}-norm" if style != "bare" else "bare")
        if style == "bare":
            return f(h)
        y = f(self.norm(h) if style == "pre" else h)
        how = r.choice(["add", "add", "into y", "into h" if self.no_grad else "add"])
        if how == "into y":  # y += h: y is a fresh projection (its GEMM saves its operands, not y)
            self.tags.append("y+=h")
            self.both(f"{y} += {h}", f"{y} = {y} + {h}")
            out = y
        elif how == "into h":  # h += y in place (inference; h may be an input: written through)
            self.tags.append("h+=y")
            self.both(f"{h} += {y}", f"{h} = {h} + {y}")
            out = h
        else:
            out = self.let("r", f"{h} + {y}")
        return self.norm(out) if style == "post" else out

    # ---- ends ------------------------------------------------------------------------------------
    def embed(self) -> str:
        """The first block's input, [*batch, T, H]."""
        r, shape = self.r, (*self.rows, self.H)
        kind = r.choice(["x", "x", "x", "x fp32", "embedding", "gather"])
        self.tags.append(kind)
        # hidden states far from zero a quarter of the time (an LLM's massive activations): norms and
        # residuals at that magnitude, each block pre-norm, and logits over them where no final norm
        # comes first; in half types no farther than a spacing of 1/16 (bf16's at 1000 is 8: a block's
        # update of 1 would vanish, and eager's gradients with it). A draw of its own: the programs
        # drawn before keep their inputs
        far = random.Random(self.pid * 61 + 7)
        offsets = {torch.float32: [-300.0, 1000.0, 3e4], torch.float16: [-30.0, 60.0], torch.bfloat16: [-8.0, 12.0]}
        offset = far.choice(offsets[self.dtype]) if far.random() < 0.25 and kind.startswith("x") else 0.0
        self.far = offset
        if offset:
            self.tags.append(f"x+{offset:g}")
        if kind == "x":
            return self.input("x", shape, offset=offset, layout=self.layout(shape), grad=r.random() < 0.6, lazy=True)
        if kind == "x fp32":  # fp32 activations cast to the compute dtype (a cast prologue)
            x = self.input(
                "x", shape, offset=offset, dtype="ACC", layout=self.layout(shape), grad=r.random() < 0.6, lazy=True
            )
            return self.let("h", f"{x}.to(DT)", f"rx.cast({x}, DT)")
        E = self.input("E", (self.V, self.H), grad=r.random() < 0.7)
        self.embedding = E
        # the token ids, expanded over the hidden axis: torch.gather's index (rtxdsl has no embedding op)
        ids = f"torch.randint(0, {self.V}, ({self.N},), generator=gen({len(self.inputs)}))"
        index = f"{ids}[:, None].expand({self.N}, {self.H}).contiguous()"
        index = self.input("I", (self.N, self.H), source=index, grad=False, lazy=True)
        dsl = f"rx.reshape(rx.gather({E}, {index}, 0), {_tuple(shape)})"
        if kind == "embedding":  # the same token ids (the same generator) as F.embedding reads them
            tok = self.input("ids", self.rows, source=f"{ids}.view{_tuple(self.rows)}", grad=False, lazy=True)
            h = self.let("h", f"F.embedding({tok}, {E})", dsl)
        else:
            h = self.let("h", f"torch.gather({E}, 0, {index}).view{_tuple(shape)}", dsl)
        return h

    def positions(self, h: str) -> str:
        """Learned positions added (in place under no_grad, even into the input)."""
        P = self.input("P", (self.T, self.H), scale=0.1)
        if self.no_grad and self.r.random() < 0.5:
            self.tags.append("x+=P")
            self.both(f"{h} += {P}", f"{h} = {h} + {P}")
            return h
        return self.let("h", f"{h} + {P}")

    def targets(self, shape: tuple[int, ...], classes: int, ignore: int) -> str:
        """Class indices; some ignored, or (a tenth of the time) all of them."""
        r = self.r
        k = len(self.inputs)
        draw = f"torch.randint(0, {classes}, {_tuple(shape) if shape else '()'}, generator=gen({k}))"
        frac = r.choice([0.0, 0.0, 0.3, 0.3, 1.0] if shape else [0.0, 0.0, 0.0, 1.0])
        if frac == 1.0:
            self.tags.append("all ignored")
            src = f"torch.full({_tuple(shape) if shape else '()'}, {ignore})"
        elif frac:
            self.tags.append("some ignored")
            src = f"{draw}.masked_fill(torch.rand({_tuple(shape)}, generator=gen({k + 500})) < {frac}, {ignore})"
        else:
            src = draw
        return self.input("t", shape, source=src, grad=False)

    def ce_options(self, classes: int, upcast: bool) -> tuple[dict[str, Any], int]:
        """cross-entropy's options: reduction, label smoothing, ignore_index, class weights."""
        r = self.r
        ignore = r.choice([-100, -100, -100, -1, classes - 1])
        opts: dict[str, Any] = {
            "ignore_index": ignore,
            "reduction": r.choice(["mean", "mean", "sum", "none"]),
            "label_smoothing": r.choice([0.0, 0.0, 0.1]),
        }
        # class weights in the logits' dtype: fp32 ones beside half hidden states when the logits
        # are upcast first (torch takes no other mix)
        cw = r.choice([None, None, "ACC" if upcast else "DT"])
        if cw:
            self.tags.append(f"class weights {cw}")
            opts["weight"] = self.input(
                "cw", (classes,), source=f"(torch.rand(({classes},), generator=gen(k)) + 0.25).to({cw})", grad=False
            )
        if ignore != -100:
            self.tags.append(f"ignore_index={ignore}")
        self.tags.append(opts["reduction"])
        return opts, ignore

    def logits_head(self, h: str) -> None:
        """logits = h @ W.T (tied to the embedding, or not), cross-entropy over them; rtxdsl writes
        it as linear cross-entropy (the logits never written) two times in five."""
        r, H, V, N = self.r, self.H, self.V, self.N
        rank = self.dims - 1  # of the rows
        if self.batch and r.random() < 0.4:  # flattened before the head: a 2-D GEMM
            h = self.let("hf", f"{h}.reshape({N}, {H})", f"rx.reshape({h}, ({N}, {H}))")
            rank = 1
        upcast = r.random() < 0.5  # HF: logits.float() before the loss
        softcap = 5.0 if r.random() < 0.15 else None  # Gemma 2's final soft cap
        lce = r.random() < 0.4
        opts, ignore = self.ce_options(V, upcast)
        t = self.targets(self.rows if rank > 1 else (N,), V, ignore)
        if self.embedding and r.random() < 0.6:
            self.tags.append("tied head")
            tw = dw = self.embedding
        else:
            tw, dw, _, _ = self.weight(H, V)
        b = self.bias(V, 0.3)
        arg = f", {b}" if b else ""
        logits = self.name("logits")
        self.torch.append(f"{logits} = F.linear({h}, {tw}{arg})")
        if upcast:
            self.torch.append(f"{logits} = {logits}.float()")
        if softcap:
            self.tags.append("softcap")
            self.torch.append(f"{logits} = {softcap} * torch.tanh({logits} / {softcap})")
        kw = ", ".join(f"{k}={v!r}" if k != "weight" else f"weight={v}" for k, v in opts.items())
        loss = self.name("loss")
        flat_l, flat_t = (f"{logits}.view(-1, {V})", f"{t}.view(-1)") if rank > 1 else (logits, t)
        self.torch.append(f"{loss} = F.cross_entropy({flat_l}, {flat_t}, {kw})")
        if lce:
            self.tags.append("linear_cross_entropy")
            hx, wx, bx = h, dw, b
            if upcast:  # the same loss over fp32 operands (rtxdsl's GEMM accumulates in fp32 anyway)
                hx, wx, bx = f"rx.cast({h}, ACC)", f"rx.cast({dw}, ACC)", f"rx.cast({b}, ACC)" if b else None
            cap = f", softcap={softcap}" if softcap else ""
            barg = f", bias={bx}" if bx else ""
            e = f"rx.linear_cross_entropy({hx}, {wx}, {t}{barg}, {kw}{cap})"
            if rank > 1 and opts["reduction"] == "none":
                e = f"rx.reshape({e}, ({N},))"  # per token, as eager's over the flattened rows
            self.dsl.append(f"{loss} = {e}")
        else:
            self.tags.append("cross_entropy")
            d = f"rx.linear({h}, {dw}{arg})"
            if upcast:
                d = f"rx.cast({d}, ACC)"
            if softcap:
                d = f"{softcap} * rx.tanh({d} / {softcap})"
            self.dsl.append(f"{logits} = {d}")
            dl, dt = (f"rx.reshape({logits}, ({N}, {V}))", f"rx.reshape({t}, ({N},))") if rank > 1 else (logits, t)
            self.dsl.append(f"{loss} = rx.cross_entropy({dl}, {dt}, {kw})")
            if r.random() < 0.2:
                self.outputs.append(logits)
        self.mark(loss)
        self.outputs.append(loss)

    def preference_head(self, h: str) -> None:
        """Per-sequence log-probabilities of the targets under the head, the first half of the batch
        against the second (DPO's shape: ``-logsigmoid(beta * (chosen - rejected))``), sometimes
        with a term over the logits' row means beside them: ``rx.sequence_logps`` in the DSL."""
        r, H, V = self.r, self.H, self.V
        avg, beta = r.random() < 0.5, r.choice([0.1, 1.0])
        ignore = r.choice([-100, V - 1])
        t = self.targets(self.rows, V, ignore)
        tw, dw, _, _ = self.weight(H, V)
        b = self.bias(V, 0.3)
        self.tags += ["preference head"] + (["averaged"] if avg else [])
        arg = f", {b}" if b else ""
        logits = self.name("logits")
        self.torch.append(f"{logits} = F.linear({h}, {tw}{arg})")
        lp = self.name("lp")
        self.torch.append(
            f"{lp} = torch.where({t} != {ignore}, torch.log_softmax({logits}.float(), -1)"
            f".gather(-1, {t}.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)"
        )
        count = f" / ({t} != {ignore}).sum(-1)" if avg else ""
        seq = self.let(
            "seq",
            f"{lp}.sum(-1){count}",
            f"rx.sequence_logps({h}, {dw}, {t}, bias={b or None}, ignore_index={ignore}, average={avg})",
        )
        c, rej = self.name("chosen"), self.name("rejected")
        self.torch.append(f"{c}, {rej} = {seq}.chunk(2, 0)")
        self.dsl.append(f"{c}, {rej} = rx.chunk({seq}, 2, 0)")
        loss = self.let(
            "loss",
            f"-F.logsigmoid({beta} * ({c} - {rej})).mean()",
            f"rx.mean(rx.softplus(-{beta} * ({c} - {rej})))",
        )
        if r.random() < 0.3:  # the logits' row means beside the log-probabilities (one row kernel reads both)
            self.tags.append("row means")
            loss = self.let(
                "loss",
                f"{loss} + torch.sigmoid({logits}.float().mean(-1)).mean()",
                f"{loss} + rx.mean(rx.sigmoid(rx.mean(rx.cast(rx.linear({h}, {dw}{arg}), ACC), -1)))",
            )
        self.mark(loss)
        self.outputs.append(loss)

    def distill_head(self, h: str) -> None:
        """A teacher's head (its own hidden states, of another width) beside the student's:
        ``rx.linear_jsd``, or ``rx.distillation_outputs``' JSD or cosine loss with the student's
        cross-entropy; the teacher's inputs take no gradient (its logits are detached)."""
        r, H, V = self.r, self.H, self.V
        kind = r.choice(["fused", "jsd", "cosine"])
        beta, temp = r.choice([0.0, 0.3, 0.5, 1.0]), r.choice([1.0, 2.0, 0.7])
        ignore = r.choice([-100, V - 1])
        Ht = r.choice([H, H + 3, max(2, H // 2)])
        t = self.targets(self.rows, V, ignore)
        tw, dw, _, _ = self.weight(H, V)
        ht = self.input("ht", (*self.rows, Ht), grad=False)
        wt = self.input("wt", (V, Ht), scale=round(1 / math.sqrt(Ht), 3), grad=False)
        b = self.bias(V, 0.3) if kind != "fused" else None
        self.tags += [f"distill {kind}", f"beta={beta}", f"T={temp}", f"Ht={Ht}"]
        arg = f", {b}" if b else ""
        s, te = self.name("s"), self.name("te")
        self.torch.append(f"{s} = F.linear({h}, {tw}{arg}).to(ACC) / {temp}")
        self.torch.append(f"{te} = (F.linear({ht}, {wt}).to(ACC) / {temp}).detach()")
        valid = self.name("valid")
        self.torch.append(f"{valid} = {t} != {ignore}")
        rows = self.name("rows")
        if kind == "cosine":
            self.torch.append(f"{rows} = {beta} * (1 - F.cosine_similarity(F.normalize({s}, dim=-1), "
                              f"F.normalize({te}, dim=-1), dim=-1))")  # fmt: skip
        else:
            lq, lp = self.name("lq"), self.name("lp")
            self.torch.append(f"{lq}, {lp} = torch.log_softmax({s}, -1), torch.log_softmax({te}, -1)")
            p, q = f"{lp}.exp()", f"{lq}.exp()"
            if beta == 0.0:
                terms = f"{p} * ({lp} - {lq})"
            elif beta == 1.0:
                terms = f"{q} * ({lq} - {lp})"
            else:
                m = self.name("m")
                self.torch.append(f"{m} = torch.log({beta} * {p} + {1 - beta} * {q})")
                terms = f"{beta} * {p} * ({lp} - {m}) + {1 - beta} * {q} * ({lq} - {m})"
            self.torch.append(f"{rows} = ({terms}).sum(-1)")
        count = f"{valid}.sum().clamp(min=1)"
        loss = self.name("loss")
        self.torch.append(f"{loss} = torch.where({valid}, {rows}, 0.0).sum() / {count}")
        if kind == "fused":
            self.dsl.append(f"{loss} = rx.linear_jsd({h}, {dw}, {ht}, {wt}, {t}, beta={beta}, ignore_index={ignore}, "
                            f"temperature={temp})")  # fmt: skip
        else:
            wh = r.choice([0.0, 0.5])
            nll = self.name("nll")
            self.torch.append(
                f"{nll} = F.cross_entropy((F.linear({h}, {tw}{arg}).to(ACC)).reshape(-1, {V}), {t}.reshape(-1), "
                f"ignore_index={ignore}, reduction='sum') / {count}"
            )
            self.torch.append(f"{loss} = {wh} * {nll} + {1 - wh} * {loss}")
            bias = f", {b}" if b else ", None"
            self.dsl.append(
                f"{loss} = rx.distillation_outputs({kind!r}, {h}, {dw}, {ht}, {wt}, {t}{bias}, weight_hard_loss={wh}, "
                f"weight_soft_loss={1 - wh}, beta={beta}, ignore_index={ignore}, temperature={temp})['loss']"
            )
        self.mark(loss)
        self.outputs.append(loss)

    def pool_head(self, h: str) -> None:
        """Mean over tokens, a classifier, and its cross-entropy (or the class scores)."""
        r, H = self.r, self.H
        self.tags.append("mean pool")
        if r.random() < 0.7:
            pooled = self.let("pool", f"{h}.mean(-2)", f"rx.mean({h}, -2)")
        else:
            pooled = self.let("pool", f"{h}.sum(dim=-2) / {self.T}", f"rx.sum({h}, -2) / {self.T}")
        C = r.randint(2, 9)
        logits = self.linear(pooled, len(self.batch) + 1, H, C, stem="cls")
        if r.random() < 0.3:
            self.outputs.append(logits)
            return
        opts, ignore = self.ce_options(C, upcast=False)
        kw = ", ".join(f"{k}={v!r}" if k != "weight" else f"weight={v}" for k, v in opts.items())
        if len(self.batch) == 2:  # class axis 1 for torch: flatten the batch
            t = self.targets((math.prod(self.batch),), C, ignore)
            tl, dl = f"{logits}.view(-1, {C})", f"rx.reshape({logits}, ({math.prod(self.batch)}, {C}))"
        else:
            t = self.targets(self.batch, C, ignore)
            tl = dl = logits
        self.outputs.append(self.let("loss", f"F.cross_entropy({tl}, {t}, {kw})", f"rx.cross_entropy({dl}, {t}, {kw})"))

    def program(self) -> Program:
        r = self.r
        self.tags += [SHORT[self.dtype], f"rows{list(self.rows)}", f"H={self.H}"]
        h = self.embed()
        if r.random() < 0.3:
            h = self.positions(h)
        if r.random() < 0.2:  # a prologue: an activation before the first GEMM
            h = self.act(h, fresh=False)
        for _ in range(r.choice([1, 1, 2])):
            h = self.block(h)
        if r.random() < 0.4:  # the final norm before the head
            h = self.norm(h)
        head = r.choice(["logits", "logits", "pool", "none"])
        if head == "logits" and self.batch[:1] == (2,) and r.random() < 0.4:  # pairs: chosen, rejected
            self.preference_head(h)
        elif head == "logits" and r.random() < 0.2:  # a teacher's head beside the student's
            self.distill_head(h)
        elif head == "logits":
            self.logits_head(h)
        elif head == "pool":
            self.pool_head(h)
        if head == "none" or r.random() < 0.25:
            self.outputs.append(h)  # the final hidden states too
        self.outputs = list(dict.fromkeys(self.outputs))
        return Program(
            self.pid,
            self.dtype,
            self.inputs,
            self.torch,
            self.dsl,
            self.outputs,
            self.no_grad,
            self.steps,
            self.tags,
            self.prefixes,
        )


def generate(pid: int) -> Program:
    """The program of id ``pid`` (deterministic)."""
    return _Gen(pid).program()


# ---- running --------------------------------------------------------------------------------------
def _build_inputs(p: Program, step: int, reference: bool, jitter: int | None = None) -> dict[str, torch.Tensor]:
    """Fresh input tensors for one run (the same values for every run of a step); float64 ones
    (upcast from the program's dtype) for the reference. ``jitter`` (a draw number, reference only)
    moves every float input by one rounding of the program's dtype (``eps / 2`` relative, either sign):
    the float64 runs at such inputs say how sensitive each result is to rounding (see ``check``)."""
    env = {
        "torch": torch,
        "DT": p.dtype,
        "ACC": torch.float32,
        "gen": lambda k: torch.Generator().manual_seed(_seed(p.pid, step, k)),
    }
    out = {}
    for i in p.inputs:
        t = eval(i.source, env)  # noqa: S307 - our own generated text
        if reference and t.dtype.is_floating_point:
            t = t.double()
            if jitter is not None:
                g = torch.Generator().manual_seed(_seed(p.pid, step, 700 + 37 * jitter + len(out)))
                sign = torch.randint(0, 2, t.shape, generator=g).to(torch.float64) * 2 - 1
                t = t * (1 + sign * torch.finfo(p.dtype).eps / 2)
        out[i.name] = t.requires_grad_(True) if i.grad else t
    return out


def _env(p: Program, reference: bool) -> dict[str, Any]:
    dt = torch.float64 if reference else p.dtype
    return {
        "torch": torch,
        "F": F,
        "math": math,
        "rx": rx,
        "DT": dt,
        "ACC": torch.float64 if reference else torch.float32,
    }


@dataclass
class Run:
    outputs: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    inputs: dict[str, torch.Tensor]  # after the run (in-place writes)


def _cotangent(p: Program, step: int, k: int, like: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(_seed(p.pid, step, 900 + k))
    return torch.randn(like.shape, generator=g).to(like.dtype)


def _grads(
    p: Program,
    step: int,
    ins: dict[str, torch.Tensor],
    outs: dict[str, torch.Tensor],
    diff: list[str],
    like: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor | None]:
    """Gradients of the ``diff`` outputs (eager's differentiable ones) with random cotangents
    (drawn in eager's output dtypes, so every run gets the same values) w.r.t. every leaf."""
    leaves = [n for n, t in ins.items() if t.requires_grad]
    if p.no_grad or not leaves or not diff:
        return {}
    for o in diff:
        if not outs[o].requires_grad:
            raise _Wrong("requires_grad", f"{o}: does not require grad (eager's does): its gradient is lost")
    cots = [_cotangent(p, step, k, like[o]).to(outs[o].dtype) for k, o in enumerate(diff)]
    gs = torch.autograd.grad([outs[o] for o in diff], [ins[n] for n in leaves], cots, allow_unused=True)
    return dict(zip(leaves, gs))


class _Wrong(Exception):
    """A wrong result found while running (not a crash of rtxdsl)."""

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(detail)
        self.what = what


def _real(v: Any) -> Any:
    return v.torch() if isinstance(v, rx.LazyTensor) else v


def run_torch(
    p: Program,
    step: int,
    reference: bool = False,
    fusion: Any = None,
    eager: Run | None = None,
    jitter: int | None = None,
) -> Run:
    """The torch text: eagerly (in the program's dtype, or float64 at inputs moved by ``jitter``),
    or on ``fusion``'s lazy tensors."""
    ins = _build_inputs(p, step, reference, jitter)
    env = _env(p, reference)
    for i in p.inputs:
        env[i.name] = fusion.lazy(ins[i.name]) if fusion is not None and i.lazy else ins[i.name]
    text = "\n".join(p.torch_lines)
    if reference:  # models write .float(); the float64 reference keeps float64 there
        text = text.replace(".float()", ".to(ACC)")
    # run as a function, as a model's forward: its intermediates die when it returns, so the lazy
    # stream writes only what is returned (or held at a sync point inside)
    names = [i.name for i in p.inputs]
    body = "".join(f"    {line}\n" for line in text.splitlines())
    ret = ", ".join(f"{o!r}: {o}" for o in p.outputs)
    source = f"def program({', '.join(names)}):\n{body}    return {{{ret}}}\n"
    exec(compile(source, f"<model {p.pid} torch>", "exec"), env)  # noqa: S102 - our own generated text
    with torch.no_grad() if p.no_grad else contextlib.nullcontext():
        outs = env["program"](*(env[n] for n in names))
        if fusion is not None:
            fusion.sync()
        outs = {o: _real(v) for o, v in outs.items()}
    want = eager or Run(outs, {}, {})
    diff = [o for o in p.outputs if want.outputs[o].requires_grad]
    grads = _grads(p, step, ins, outs, diff, want.outputs)
    after = {n: t.detach() for n, t in ins.items()} if p.no_grad else {}
    return Run(outs, grads, after)


def run_dsl(p: Program, step: int, kernel: list[Any], eager: Run) -> Run:
    """The rtxdsl text compiled once (``kernel`` holds it across steps) and called with the tensors."""
    ins = _build_inputs(p, step, False)
    if not kernel:
        env = _env(p, False)
        env.update({i.name: rx.var(i.name) for i in p.inputs})
        exec(compile("\n".join(p.dsl_lines), f"<model {p.pid} dsl>", "exec"), env)  # noqa: S102
        kernel.append(rx.compile({o: env[o] for o in p.outputs}))
    k = kernel[0]
    with torch.no_grad() if p.no_grad else contextlib.nullcontext():
        outs = k(**{n: ins[n] for n in k.inputs})
    diff = [o for o in p.outputs if eager.outputs[o].requires_grad]
    return Run(outs, _grads(p, step, ins, outs, diff, eager.outputs), {})


# ---- comparing ------------------------------------------------------------------------------------
def compare(
    got: Any,
    eager: torch.Tensor | None,
    ref: torch.Tensor | None,
    coarse: torch.dtype,
    floor: float = 1e-3,
    zero_scale: float = 1e-3,
    spread: torch.Tensor | None = None,
) -> tuple[str, str] | None:
    """None when ``got`` is as close to the float64 ``ref`` as ``eager`` is (see the module
    docstring), else (what differs, detail)."""
    if eager is None or ref is None:  # eager's gradient is None: the leaf is unused
        if got is not None and isinstance(got, torch.Tensor) and got.double().abs().gt(0).any():
            return "grad", "nonzero where eager's gradient is None"
        return None
    if got is None:
        return None if not eager.double().abs().gt(0).any() else ("grad", "missing (None) where eager's is nonzero")
    if not isinstance(got, torch.Tensor):
        return "type", f"a {type(got).__name__}, eager a tensor"
    if got.dtype != eager.dtype:
        return "dtype", f"dtype {got.dtype} != eager's {eager.dtype}"
    if got.shape != eager.shape:
        return "shape", f"shape {list(got.shape)} != eager's {list(eager.shape)}"
    if not eager.dtype.is_floating_point:
        return None if torch.equal(got, eager) else ("value", "integers differ")
    g, e, r = got.detach().double(), eager.detach().double(), ref.detach().double()
    if (torch.isnan(g) & ~torch.isnan(e)).any():
        n = int((torch.isnan(g) & ~torch.isnan(e)).sum())
        return "nan", f"NaN at {n} of {g.numel()} positions where eager is not NaN"
    bad_inf = torch.isinf(e) & (g != e) & ~(torch.isfinite(g) & torch.isfinite(r))
    cmp = torch.isfinite(e) & torch.isfinite(r)
    bad_inf |= cmp & ~torch.isfinite(g)
    if bad_inf.any():
        return "inf", f"inf at {int(bad_inf.sum())} positions where eager is not (or is another)"
    if not cmp.any():
        return None
    err_e = (e - r)[cmp].abs().max()
    scale = max(r[cmp].abs().max().item(), floor)
    if not r[cmp].abs().gt(0).any():  # exactly 0 in float64 (a cancellation, as through a softmax
        scale = max(scale, zero_scale)  # over one token): its terms have the program's magnitude
    atol, rtol = (max(a, b) for a, b in zip(TOLERANCE[got.dtype], TOLERANCE[coarse]))
    diff = (g - r).abs()
    bound = 2 * err_e + atol * scale + rtol * r.abs()
    if spread is not None:  # how far float64 itself moves when the inputs are rounded again
        bound = bound + SENSITIVITY * spread
    over = cmp & (diff > bound)
    if over.any():
        worst = int(torch.argmax(torch.where(over, diff - bound, torch.zeros_like(diff))))
        idx = list(map(int, torch.unravel_index(torch.tensor(worst), g.shape))) if g.dim() else []
        return "error", (
            f"{int(over.sum())} of {g.numel()} elements too far from float64: at {idx} rtxdsl "
            f"{g.reshape(-1)[worst]:.6g}, eager {e.reshape(-1)[worst]:.6g}, float64 {r.reshape(-1)[worst]:.6g} "
            f"(max error {diff[cmp].max():.3g} vs eager's {err_e:.3g})"
        )
    return None


@dataclass
class Outcome:
    verdict: str  # ok | wrong | crash | refusal | skip
    detail: str = ""
    group: tuple[str, ...] = ()
    trace: str = ""


def _innermost_rtxdsl_frame(e: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/rtxdsl/" in f.filename.replace("\\", "/")]
    if not frames:
        return "(no rtxdsl frame)"
    f = frames[-1]
    return f"{f.filename.replace(chr(92), '/').split('/rtxdsl/')[-1]}:{f.name}"


def _program_line(e: BaseException, p: Program) -> str:
    """The line of the program text an exception came from."""
    for f in reversed(traceback.extract_tb(e.__traceback__)):
        if f.filename.startswith(f"<model {p.pid}") and f.lineno:
            lines = p.dsl_lines if "dsl" in f.filename else [""] + p.torch_lines  # the torch text's def line
            return f" (at: {lines[f.lineno - 1].strip()})" if f.lineno <= len(lines) else ""
    return ""


def check(p: Program, mode: str) -> Outcome:
    """Run ``p`` in ``mode`` for each of its steps against eager and float64 torch."""
    fusion = rx.Fusion() if mode == "lazy" else None
    kernel: list[Any] = []
    for step in range(p.steps):
        try:
            eager = run_torch(p, step)
            ref = run_torch(p, step, reference=True, eager=eager)
        except Exception as e:  # noqa: BLE001 - eager torch rejects the program
            return Outcome("skip", f"eager raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        try:
            got = run_torch(p, step, fusion=fusion, eager=eager) if mode == "lazy" else run_dsl(p, step, kernel, eager)
        except _Wrong as w:
            return Outcome("wrong", f"step {step}: {w}", (mode, "wrong", w.what, ""))
        except Exception as e:  # noqa: BLE001 - classified
            msg = (str(e).splitlines() or [""])[0][:300]
            frame = _innermost_rtxdsl_frame(e)
            trace = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            verdict = "refusal" if isinstance(e, rx.RtxError) and REFUSAL.search(str(e)) else "crash"
            return Outcome(
                verdict,
                f"step {step}: {type(e).__name__}: {msg}{_program_line(e, p)}",
                (mode, verdict, type(e).__name__, frame),
                trace,
            )
        # a gradient's scale: its own magnitude, at least a tenth of the program's largest gradient,
        # all of it where float64's is exactly 0 (a cancellation, say through a softmax over one
        # token, of terms of the program's magnitude: eager's may be exactly 0 by luck of its formula)
        spreads: dict[str, dict[str, torch.Tensor]] = {}
        big = max((float(t.abs().max()) for t in ref.grads.values() if t is not None and t.numel()), default=0.0)
        floors = {"value": (1e-3, 1e-3), "grad": (max(1e-3, 0.1 * big), max(1e-3, big)), "input": (1e-3, 1e-3)}
        for kind, names, g, w, r in (
            ("value", p.outputs, got.outputs, eager.outputs, ref.outputs),
            ("grad", list(eager.grads), got.grads, eager.grads, ref.grads),
            ("input", list(got.inputs), got.inputs, eager.inputs, ref.inputs),
        ):
            for n in names:
                bad = compare(g.get(n), w.get(n), r.get(n), p.dtype, *floors[kind])
                if bad and bad[0] == "error":  # as close as the element's sensitivity to rounding allows?
                    spreads = spreads or _spreads(p, step, eager, ref)
                    bad = compare(g.get(n), w.get(n), r.get(n), p.dtype, *floors[kind], spreads[kind].get(n))
                if bad:
                    role = "d/d" + n if kind == "grad" else n
                    # grouped by the input's stem too (b: biases, w: weights, g: norm weights, x, E, P)
                    stem = role.rstrip("0123456789") + "*" if kind != "value" else ""
                    group = (mode, "wrong", f"{kind} {bad[0]}", stem)
                    return Outcome("wrong", f"step {step}: {kind} {role}: {bad[1]}", group)
    return Outcome("ok")


def _spreads(p: Program, step: int, eager: Run, ref: Run) -> dict[str, dict[str, torch.Tensor]]:
    """Per output, gradient and input: how far float64 moves, element by element, when every input
    is rounded once more to the program's dtype (the largest of ``JITTERS`` draws). An element
    that moves far is ill-conditioned: eager's rounding and rtxdsl's (fp32 inside a kernel, the
    program's dtype between kernels) may land anywhere in that range, so the bound widens by it."""
    out: dict[str, dict[str, torch.Tensor]] = {"value": {}, "grad": {}, "input": {}}
    for j in range(JITTERS):
        moved = run_torch(p, step, reference=True, eager=eager, jitter=j)
        for kind, new, old in (
            ("value", moved.outputs, ref.outputs),
            ("grad", moved.grads, ref.grads),
            ("input", moved.inputs, ref.inputs),
        ):
            for n, t in new.items():
                if t is None or old.get(n) is None or not t.dtype.is_floating_point:
                    continue
                d = (t.detach().double() - old[n].detach().double()).abs().nan_to_num(0.0, 0.0, 0.0)
                out[kind][n] = torch.maximum(out[kind][n], d) if n in out[kind] else d
    return out


def shrink(p: Program, mode: str, group: tuple[str, ...]) -> Program | None:
    """The shortest prefix of ``p`` (ending at one value, its only output) that fails in ``group``."""
    for nt, nd, name in p.prefixes:
        q = Program(p.pid, p.dtype, p.inputs, p.torch_lines[:nt], p.dsl_lines[:nd], [name], p.no_grad, p.steps, p.tags)
        if check(q, mode).group == group:
            return q
    return None


# ---- the report -----------------------------------------------------------------------------------
def program_ids(seed: int, n: int) -> list[int]:
    return [seed * 100_000 + k for k in range(n)]


def report(modes: list[str], ids: list[int], verbose: bool = False, progress: bool = False) -> dict[str, Counter[str]]:
    counts: dict[str, Counter[str]] = {m: Counter() for m in modes}
    groups: dict[tuple[str, ...], list[tuple[int, Outcome]]] = defaultdict(list)
    t0 = time.time()
    for pid in ids:
        p = generate(pid)
        for mode in modes:
            if progress:
                print(f"... {pid} {mode}", flush=True)
            out = check(p, mode)
            counts[mode][out.verdict] += 1
            if out.verdict in ("wrong", "crash", "refusal"):
                groups[out.group].append((pid, out))
                if verbose:
                    print(f"--- {pid} [{mode}] {out.verdict}: {out.detail}\n{p.source()}\n", flush=True)
    took = time.time() - t0
    print(f"\n{len(ids)} programs, {took:.0f} s ({took / max(1, len(ids) * len(modes)):.2f} s per program and mode)")
    for mode in modes:
        c = counts[mode]
        print(f"[{mode}] " + "  ".join(f"{k} {c[k]}" for k in ("ok", "wrong", "crash", "refusal", "skip")))
    print("\nfailure classes (mode, verdict, exception / what differs, innermost rtxdsl frame):")
    for key, items in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        pids = ", ".join(str(pid) for pid, _ in items[:8]) + (" ..." if len(items) > 8 else "")
        print(f"  {len(items):4d}  {' | '.join(k for k in key if k)}\n        ids: {pids}")
        print(f"        first: {items[0][1].detail}")
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--mode", choices=["dsl", "lazy", "both"], default="both")
    ap.add_argument("--programs", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=None, help="print the program of this id (and a script per mode)")
    ap.add_argument("--one", type=int, default=None, help="run the program of this id, with the traceback")
    ap.add_argument("--shrink", type=int, default=None, help="the shortest prefix of this program failing alike")
    ap.add_argument("--progress", action="store_true", help="print each id before it runs (segfaults)")
    ap.add_argument("-v", action="store_true", help="print every failing program")
    a = ap.parse_args(argv)
    faulthandler.enable()
    modes = list(MODES) if a.mode == "both" else [a.mode]
    if a.show is not None:
        p = generate(a.show)
        print(p.source())
        for mode in modes:
            print(f"\n# ---- a standalone script, {mode} mode ----\n{p.script(mode)}")
        return 0
    if a.one is not None:
        p = generate(a.one)
        print(p.source())
        for mode in modes:
            out = check(p, mode)
            print(f"\n[{mode}] {out.verdict}: {out.detail}\n{out.trace}")
        return 0
    if a.shrink is not None:
        p = generate(a.shrink)
        for mode in modes:
            out = check(p, mode)
            q = shrink(p, mode, out.group) if out.verdict in ("wrong", "crash", "refusal") else None
            print(f"[{mode}] {out.verdict}: {out.detail}")
            if q is not None:
                print(f"shortest failing prefix ({check(q, mode).detail}):\n{q.source()}\n\n{q.script(mode)}\n")
        return 0
    counts = report(modes, program_ids(a.seed, a.programs), a.v, a.progress)
    return 0 if all(c["wrong"] + c["crash"] == 0 for c in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
