"""Expressions from text (rx.parse) and the rtxdsl command."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import rtxdsl as rx


@pytest.mark.parametrize(
    "text, built",
    [
        ("relu(x * w + 1.0)", lambda x, w: rx.relu(x * w + 1.0)),
        ("softmax(x * 0.125 + w, axis=-1)", lambda x, w: rx.softmax(x * 0.125 + w, axis=-1)),
        ("where(x > w, x, -w) ** 2", lambda x, w: rx.where(x > w, x, -w) ** 2),
        ("cast(x, float16) // 2 % 3", lambda x, w: rx.cast(x, torch.float16) // 2 % 3),
        ("sum(x, axis=(0, 1), keepdim=True) - 1 / w", lambda x, w: rx.sum(x, axis=(0, 1), keepdim=True) - 1 / w),
        ("layer_norm(x, w, eps=1e-6)", lambda x, w: rx.layer_norm(x, w, eps=1e-6)),
    ],
)
def test_parse_builds_the_same_interned_expression(text, built):
    assert rx.parse(text) is built(rx.var("x"), rx.var("w"))


def test_shared_subexpressions_print_once_and_parse_back():
    # an iteration that reuses its last value twice (a bisection) unfolds to a tree of 2**20
    # nodes; its text names each shared value once and stays linear in the DAG
    x = rx.var("x")
    lo = rx.amax(x, -1, keepdim=True) - 1.0
    for step in range(20):
        mid = lo + 0.5**step
        lo = rx.where(rx.sum(rx.relu(x - mid), -1, keepdim=True) >= 1.0, mid, lo)
    text = repr(lo)
    assert len(text) < 200 * 20
    assert rx.parse(text) is lo
    e = rx.exp(x - rx.amax(x))
    assert (
        repr(e / rx.sum(e)) == "(_1 := exp(x - amax(x, axis=None, keepdim=False))) / sum(_1, axis=None, keepdim=False)"
    )
    assert repr(rx.var("_1") + e / rx.sum(e)).startswith("_1 + (__1 := exp(")  # names never shadow inputs
    assert repr(x * 2 + x * 2) == "x * 2 + x * 2"  # short shared text stays inline


@pytest.mark.parametrize(
    "text, where",
    [
        ("foo(x)", "unknown op 'foo' at line 1, column 1"),
        ("x + bar(y)", "unknown op 'bar' at line 1, column 5"),
        ("a < b < c", "chained comparisons"),
        ("x.exp()", "only plain function calls"),
        ("x +", "invalid expression"),
        ("[x]", "unsupported syntax List"),
        ("gelu(x, approximate='fast')", "approximate must be"),
        ("(s := x + 1) * (s := x)", "'s' is already an input, a dtype or a bound name"),
        ("x * (x := w + 1)", "'x' is already an input"),
    ],
)
def test_parse_errors_name_the_position(text, where):
    with pytest.raises(rx.ParseError, match=where.replace("(", r"\(").replace(")", r"\)")):
        rx.parse(text)


def test_cli_explain_checks_against_torch():
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rtxdsl",
            "explain",
            "gelu(x + b)",
            "--input",
            "x=float32:3x7",
            "--input",
            "b=float32:7",
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert "@triton.jit" in res.stdout and "max |error| against torch" in res.stdout
    bad = subprocess.run([sys.executable, "-m", "rtxdsl", "explain", "foo(x)"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown op 'foo'" in bad.stderr
