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
    {"errors", "log", "lru", "dtypes", "torchsem", "recursion", "interpret", "fileio"},
    {"config", "stats", "registry"},
    {"expr"},
    {"ops"},
    {"lower"},
    {"codegen"},
    {"cache", "tune"},
    {"torchop", "dtensor", "handle"},
    {"runtime_launch", "runtime_grad", "runtime_explain"},
    {"runtime"},
    {"dsl", "build", "trace", "parse", "lazy", "library", "nn", "optim"},
    {"cli", "commands", "workloads", "liger", "__init__", "__main__"},
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

    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    in_functions = {id(n) for f in ast.walk(tree) if isinstance(f, functions) for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found = resolve(node)
        elif isinstance(node, ast.Import):
            found = [a.name.removeprefix("rtxdsl.") for a in node.names if a.name.startswith("rtxdsl")]
        else:
            continue
        (local.extend if id(node) in in_functions else top.update)(found)
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


def _trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in sorted(ROOT.rglob("*.py"))}


def _defines(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, attributes it assigns, slot names."""
    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            names.add(n.attr)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier():
            names.add(n.value)  # __slots__
    return {x for x in names if x.startswith("_") and not x.startswith("__")}


def test_no_module_reads_another_modules_private_attribute():
    """``x._name`` where ``_name`` belongs to another rtxdsl module (its class's private field or
    method): the modules talk through public names (``Kernel.collect``, ``op_key``, ``attach``)."""
    trees = _trees()
    defined = {path: _defines(tree) for path, tree in trees.items()}
    found = []
    for path, tree in trees.items():
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and n.attr in _defines_any(defined)):
                continue
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls") or n.attr in defined[path]:
                continue
            found.append(f"{path.relative_to(ROOT)}:{n.lineno} {ast.unparse(n)}")
        for n in ast.walk(tree):  # nor imports one
            if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("rtxdsl")):
                private = [a.name for a in n.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    found.append(f"{path.relative_to(ROOT)}:{n.lineno} imports {private} from {n.module}")
    assert not found, found


def _defines_any(defined: dict[Path, set[str]]) -> set[str]:
    return set().union(*defined.values())


def test_no_op_name_string_comparison_outside_ops():
    """Behaviour keyed by an op is declared in its ``OpDef`` (kind, dtype rule, axis rule, reduce
    spec), not by comparing names: ``n.op == "sum"`` outside ``rtxdsl/ops`` is a second place to
    update when an op is added. (``Expr.is_var`` / ``is_const`` name the two leaves.)"""
    found = []
    for path, tree in _trees().items():
        if path.parent.name == "ops" or path.name == "expr.py":
            continue
        for n in ast.walk(tree):
            if not isinstance(n, ast.Compare):
                continue
            sides = [n.left, *n.comparators]
            names_op = any(isinstance(x, ast.Attribute) and x.attr == "op" for x in sides)
            strings = any(
                isinstance(x, ast.Constant)
                and isinstance(x.value, str)
                or isinstance(x, (ast.Tuple, ast.Set, ast.List))
                and any(isinstance(e, ast.Constant) for e in x.elts)
                for x in sides
            )
            if names_op and strings:
                found.append(f"{path.relative_to(ROOT)}:{n.lineno} {ast.unparse(n)}")
    assert not found, found


def test_planner_and_code_generators_key_nodes_by_themselves_not_by_id():
    """Expression nodes are interned (equal structure: one object) and hash by identity, so the
    planner's and code generators' tables are keyed by the nodes (and groups) themselves, as
    tinygrad keys its UOps: no ``id()`` side table, which needs the keys kept alive beside it and
    reads as an int where a node is meant."""
    found = []
    for path, tree in _trees().items():
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(("lower/", "codegen/")):
            continue
        for n in ast.walk(tree):
            called = n.func if isinstance(n, ast.Call) else None
            mapped = isinstance(called, ast.Name) and called.id == "map" and isinstance(n.args[0], ast.Name)
            if isinstance(called, ast.Name) and called.id == "id" or mapped and n.args[0].id == "id":
                found.append(f"{rel}:{n.lineno} {ast.unparse(n)}")
    assert not found, found


def test_kernel_parameter_names_are_spelled_in_one_place():
    """A pointer's or a stride's name (``in0_ptr``, ``x_stride_b0``) is formatted by
    ``lower/params.py`` alone, which orders the parameters too: the scheduler keying launch values
    and the code generators writing loads ask it for the name, so the two cannot drift apart."""
    found = []
    for path, tree in _trees().items():
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(("lower/", "codegen/")) or rel == "lower/params.py":
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.JoinedStr):
                text = "".join(v.value for v in n.values if isinstance(v, ast.Constant))
                if "_ptr" in text or "_stride" in text:
                    found.append(f"{rel}:{n.lineno} {ast.unparse(n)}")
    assert not found, found


def test_no_function_over_80_lines_in_lower_codegen_and_runtime():
    """The planner, the code generators and the runtime read in pieces of one job each."""
    long = []
    for path, tree in _trees().items():
        rel = path.relative_to(ROOT).as_posix()
        if not (rel.startswith(("lower/", "codegen/")) or rel.startswith("runtime")):
            continue
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80:
                long.append(f"{rel}:{n.name} ({n.end_lineno - n.lineno + 1} lines)")
    assert not long, long


def test_modules_below_runtime_hold_kernels_as_a_typed_handle():
    """``torchop`` and ``dtensor`` take kernels as ``handle.KernelHandle`` (the protocol of what
    they may ask), never as ``Any``."""
    found = []
    for name in ("torchop.py", "dtensor.py", "runtime_launch.py", "runtime_grad.py", "runtime_explain.py"):
        tree = ast.parse((ROOT / name).read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.arg) and n.arg in ("kernel", "forward", "backward", "k"):
                if n.annotation is None or ast.unparse(n.annotation) == "Any":
                    found.append(f"{name}:{n.lineno} {n.arg}")
    assert not found, found


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
