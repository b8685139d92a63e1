"""Generated kernels name what they read and write after the user (``lower/names.py``,
``codegen/names.py``): ``x_ptr``, ``x = tl.load(x_ptr + ...)``, a scalar input by its name."""

from __future__ import annotations

import re

import torch
from conftest import assert_close

import rtxdsl as rx

x, w, b = rx.var("x"), rx.var("w"), rx.var("b")


def _params(src: str) -> list[str]:
    head = src.split("@triton.jit")[-1]
    return re.findall(r"^    (\w+),$", head.split("):")[0], re.M)


def test_a_kernel_reads_like_the_tutorials(gen):
    ins = {
        "x": torch.randn(5, 33, generator=gen),
        "w": torch.randn(33, generator=gen),
        "b": torch.randn(33, generator=gen),
    }
    src = rx.compile(rx.layer_norm(x, w, b)).sources(**ins)[0]
    assert _params(src)[:4] == ["x_ptr", "w_ptr", "b_ptr", "out_ptr"]
    assert "x = tl.load(x_ptr + rows * x_stride0 + cols" in src and "w = tl.load(w_ptr + cols" in src
    assert not re.search(r"\b(?:in|out)\d+_ptr\b|\bx\d+_\d+\b|\bs\d+\b", src)  # no positional name is left
    assert _params(src)[-2:] == ["rcount", "eps"] and "/ rcount" in src and "+ eps" in src  # numbers by origin


def test_names_the_kernel_already_uses_are_not_captured(gen):
    """Inputs called ``mask`` and ``rows`` (the kernel's own names), ``float`` (a python word),
    ``s0`` (a scalar argument's spelling), an output called like an input: each takes a suffix,
    and the kernel still computes what torch does."""
    names = ("mask", "rows", "in1", "t_x", "float", "s0")
    v = {n: rx.var(n) for n in names}
    lr = rx.var("lr")
    k = rx.compile(
        {
            "in0": rx.softmax(v["mask"] * v["rows"] + v["in1"]) * lr,
            "rows": rx.sum(v["t_x"] * v["float"] + v["s0"] * lr, -1),
        }
    )
    ins = {n: torch.randn(33 if n == "in1" else (5, 33), generator=gen) for n in names} | {"lr": 0.5}
    out = k(**ins)
    t = {n: val.double() if isinstance(val, torch.Tensor) else val for n, val in ins.items()}
    assert_close(out["in0"], torch.softmax(t["mask"] * t["rows"] + t["in1"], -1) * 0.5, 1e-5, 1e-5, "in0")
    assert_close(out["rows"], (t["t_x"] * t["float"] + t["s0"] * 0.5).sum(-1), 1e-5, 1e-5, "rows")
    src = k.sources(**ins)[0]
    assert "mask_in = tl.load(mask_ptr" in src and "rows_in = tl.load(rows_ptr" in src
    assert "float_in = tl.load(float_ptr" in src and "rows_out_ptr" in src and "\n    lr,\n" in src


def test_a_backward_spells_out_its_cotangents_statistics_and_gradients(gen):
    ins = {"x": torch.randn(5, 33, generator=gen, requires_grad=True), "w": torch.randn(33, generator=gen)}
    plan = rx.compile(rx.rms_norm(x, w)).grad_plan(**ins)
    feed = {"x": ins["x"].detach(), "w": ins["w"]} | dict(plan.forward(**ins)) | {"_g0": torch.ones(5, 33)}
    params = _params(plan.backward.sources(**{n: feed[n] for n in plan.backward.inputs})[0])
    assert {"dout0_ptr", "stat0_ptr", "x_ptr", "w_ptr", "grad0_ptr"} <= set(params)


def test_names_are_part_of_the_signature(gen):
    """The same structure under other names is another source (and the same numbers)."""
    a = torch.randn(4, 7, generator=gen)
    first, second = rx.compile(rx.relu(x) * 2), rx.compile(rx.relu(rx.var("y")) * 2)
    assert "x_ptr" in first.sources(x=a)[0] and "y_ptr" in second.sources(y=a)[0]
    assert torch.equal(first(x=a), second(y=a))


def test_a_kernel_comments_where_each_composite_starts(gen):
    """A composite's lines (its statistics' temporaries included) under ``# <composite>``, the user's
    own ops after it under ``# (as written)``; a kernel of the user's own ops alone, none."""
    r = rx.var("r")
    ins = {n: torch.randn(5, 33, generator=gen) for n in ("x", "r")} | {"w": torch.randn(33, generator=gen)}
    src = rx.compile(rx.layer_norm(rx.gelu(x) + r, w) * 2.0).sources(**ins)[0]
    body = [ln.strip() for ln in src.split("@triton.jit")[-1].splitlines()]
    assert [ln for ln in body if ln.startswith("# ")] == ["# layer_norm", "# (as written)"]
    start, own = body.index("# layer_norm"), body.index("# (as written)")
    assert body[start - 1] == "v1 = v0 + r"  # the user's gelu and residual add come first
    assert any("tl.sum(" in ln for ln in body[start:own])  # its statistics are under it
    assert body[own + 1].endswith("* s2")  # the user's * 2.0
    plain = {n: ins[n] for n in ("x", "r")}
    own_ops = rx.compile(rx.gelu(x) + r).sources(**plain)[0].split("@triton.jit")[-1]
    assert not [ln for ln in own_ops.splitlines() if ln.strip().startswith("# ")]


def test_a_value_an_output_only_regroups_is_named_after_the_output(gen):
    """The softmax's kernel writes the flattened output's buffer: it was ``softmax_ptr``."""
    k = rx.compile({"probs": rx.reshape(rx.softmax(x), (-1,))})
    t = torch.randn(3, 5, generator=gen)
    (src,) = k.sources(x=t)
    assert _params(src)[:2] == ["x_ptr", "probs_ptr"]
    assert_close(k(x=t)["probs"], torch.softmax(t.double(), -1).reshape(-1), 1e-6, 1e-6)
