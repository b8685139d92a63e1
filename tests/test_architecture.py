"""The module graph runs one way, and one declaration adds an op to every front end."""

from __future__ import annotations

import ast
import graphlib
import importlib.util
import textwrap
from pathlib import Path

import pytest
import torch

import rtxdsl as rx
from rtxdsl.lazy import Fusion
from rtxdsl.registry import REGISTRY

ROOT = Path(rx.__file__).parent
#: lower layers first; a module may import only from its own layer or below
LAYERS = [
    {"errors", "log", "lru", "dtypes", "torchsem", "recursion", "interpret"},
    {"config", "stats", "registry"},
    {"expr"},
    {"ops"},
    {"lower"},
    {"codegen"},
    {"cache", "tune"},
    {"torchop", "dtensor"},
    {"runtime"},
    {"dsl", "build", "trace", "parse", "lazy", "library", "nn", "optim"},
    {"cli", "commands", "workloads", "__init__", "__main__"},
]


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" and len(rel.parts) > 1 else rel.parts
    return ".".join(parts) or "__init__"


def _imports(path: Path) -> tuple[set[str], list[str]]:
    """rtxdsl modules imported at the top of ``path``, and any imported inside a function."""
    tree = ast.parse(path.read_text())
    package = _module(path).split(".")[:-1] if path.name != "__init__.py" else _module(path).split(".")
    if _module(path) == "__init__":
        package = []
    top, local = set(), []

    def resolve(node: ast.ImportFrom) -> list[str]:
        if node.level == 0:
            base = (node.module or "").split(".")
            if base[0] != "rtxdsl":
                return []
            base = base[1:]
        else:
            base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
        names = [".".join([*base, a.name]) for a in node.names] if not base or node.module is None else [".".join(base)]
        return [n for n in names if n]

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found = resolve(node)
        elif isinstance(node, ast.Import):
            found = [a.name.removeprefix("rtxdsl.") for a in node.names if a.name.startswith("rtxdsl")]
        else:
            continue
        in_function = any(
            isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef))
            for p in ast.walk(tree)
            if any(child is node for child in ast.walk(p)) and p is not node
        )
        (local.extend if in_function else top.update)(found)
    return top, local


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        top, local = _imports(path)
        assert not local, f"{path.relative_to(ROOT)} imports {local} inside a function"
        mod = _module(path)
        graph[mod] = {m for m in top if m != mod and not mod.startswith(m + ".")} - {"", "rtxdsl"}
    return graph


def _layer(mod: str) -> int:
    head = mod.split(".")[0]
    return next(i for i, layer in enumerate(LAYERS) if head in layer)


def test_module_graph_has_no_cycles_and_runs_one_way():
    graph = _graph()
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError on a cycle
    for mod, deps in graph.items():
        for d in deps:
            assert _layer(d) <= _layer(mod), f"{mod} (layer {_layer(mod)}) imports {d} (layer {_layer(d)})"


NEW_OP = textwrap.dedent('''
    """A plugin: one declaration of an op."""
    import torch
    from rtxdsl.expr import node
    from rtxdsl.ops.helpers import torch_fns, unary_fn
    from rtxdsl.registry import ANY, Front, OpDef, OpKind, register

    register(
        OpDef(
            name="square",
            kind=OpKind.ELEMENTWISE,
            arity=1,
            ref=torch.square,
            emit=lambda ctx, a: f"{a} * {a}",
            derivative=lambda d: (node("mul", d.g, node("mul", 2.0, d.a)),),
            eager_launches=1,
            accepts=ANY,
            front=Front(
                fn=unary_fn("square", "x * x"),
                methods={"square": None},
                torch={f: (lambda a: node("square", a)) for f in torch_fns("square")},
            ),
        )
    )
''')


@pytest.fixture
def square_op(tmp_path):
    path = tmp_path / "square_plugin.py"
    path.write_text(NEW_OP)
    spec = importlib.util.spec_from_file_location("square_plugin", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield
    REGISTRY.unregister("square")


def test_a_new_op_is_one_declaration_found_by_every_front_end(square_op, gen):
    x = rx.var("x")
    t = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    e = rx.square(x) + 1.0  # the DSL function
    assert x.square() is rx.square(x)  # the method
    assert rx.parse("square(x) + 1.0") is e  # the parser
    assert repr(e) == "square(x) + 1.0"  # the printer
    assert "square" in dir(rx)
    torch.testing.assert_close(rx.compile(e)(x=t), t.square() + 1.0)  # its generated kernel
    f = Fusion()
    lazy = torch.square(f.lazy(t)) * 2  # the lazy stream records it
    assert f.pending == 2
    torch.testing.assert_close(lazy.torch(), t.square() * 2)
    leaf = t.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda a: rx.compile(rx.square(x) * x)(x=a), (leaf,))  # autograd
