"""Expressions from text (config files, the command line): ``rx.parse("relu(x * w + 1)")``.

Python's own parser reads the text; only names, numbers, the DSL's operators and calls of the
DSL's public functions (from the op registry) are accepted. Anything else is a
:class:`ParseError` naming the line and column. Dtype names (``float16``) are dtypes only as
a call argument; elsewhere a name is an input.
"""

from __future__ import annotations

import ast
from typing import Any

import torch

from . import dsl
from .dtypes import SHORT_NAME
from .errors import ParseError, RtxError
from .expr import Expr
from .ops import REGISTRY

DTYPES = {name: dt for dt, name in SHORT_NAME.items()}
MAX_DEPTH = 200  # nesting deeper than this is a ParseError, not a RecursionError

_BINOPS = {
    ast.Add: "add",
    ast.Sub: "sub",
    ast.Mult: "mul",
    ast.Div: "truediv",
    ast.FloorDiv: "floordiv",
    ast.Mod: "mod",
    ast.Pow: "pow",
    ast.MatMult: "matmul",
    ast.BitAnd: "and",
    ast.BitOr: "or",
    ast.BitXor: "xor",
}
_CMPOPS = {ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge", ast.Eq: "eq", ast.NotEq: "ne"}
_UNARY = {ast.USub: "__neg__", ast.Invert: "__invert__"}


def functions() -> dict[str, Any]:
    """Every function text may call: the registry's parseable ops, plus ``const``."""
    out: dict[str, Any] = {name: op.front.fn for name, op in REGISTRY.named.items() if op.front.parse}
    out["const"] = dsl.const
    return out


def parse(text: str) -> Expr:
    """An expression from text; names are inputs, calls are rtxdsl functions, dtypes by name.

    Example:
        >>> import rtxdsl as rx
        >>> rx.parse("softmax(x * 0.125 + mask, axis=-1)")
        softmax(x * 0.125 + mask, axis=-1)
    """
    if not isinstance(text, str):
        raise ParseError(f"parse takes a string, got {type(text).__name__}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ParseError(f"invalid expression at line {exc.lineno}, column {exc.offset}: {exc.msg}") from None
    except (RecursionError, MemoryError):
        raise ParseError(f"expression nests too deeply for Python's parser (at most {MAX_DEPTH} levels)") from None
    out = _Reader(text).read(tree.body, 0)
    if isinstance(out, torch.dtype):
        raise ParseError(f"{text!r} is a dtype, not an expression")
    return out if isinstance(out, Expr) else dsl.const(out)


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.functions = functions()
        self.bound: dict[str, Any] = {}  # names bound with ``:=`` (shared subexpressions)
        self.inputs: set[str] = set()

    def fail(self, node: ast.AST, msg: str) -> ParseError:
        return ParseError(f"{msg} at line {node.lineno}, column {node.col_offset + 1} of {self.text!r}")

    def read(self, node: ast.AST, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise self.fail(node, f"expression nests deeper than {MAX_DEPTH} levels")
        method = getattr(self, f"read_{type(node).__name__}", None)
        if method is None:
            raise self.fail(node, f"unsupported syntax {type(node).__name__}")
        try:
            return method(node, depth + 1)
        except ParseError:
            raise
        except RtxError as exc:
            raise self.fail(node, str(exc)) from None

    def operand(self, node: ast.AST, depth: int) -> Any:
        """An operand of an operator: an expression or a number, never a dtype name."""
        v = self.read(node, depth)
        if isinstance(v, torch.dtype):
            raise self.fail(node, f"{ast.unparse(node)!r} names a dtype; an input cannot be named after a dtype")
        if isinstance(v, str):
            raise self.fail(node, f"a string {v!r} is not an expression")
        return v

    def read_Name(self, node: ast.Name, depth: int) -> Any:
        if node.id in DTYPES:
            return DTYPES[node.id]
        if node.id in self.bound:
            return self.bound[node.id]
        self.inputs.add(node.id)
        return dsl.var(node.id)

    def read_NamedExpr(self, node: ast.NamedExpr, depth: int) -> Any:
        """``(name := expr)``: a shared subexpression, named at its first use (as ``repr`` prints)."""
        name = node.target.id
        if name in self.bound or name in self.inputs or name in DTYPES:
            raise self.fail(node, f"{name!r} is already an input, a dtype or a bound name; bind a new name")
        self.bound[name] = self.operand(node.value, depth)
        return self.bound[name]

    def read_Constant(self, node: ast.Constant, depth: int) -> Any:
        if isinstance(node.value, (bool, int, float, str)):
            return node.value
        raise self.fail(node, f"unsupported constant {node.value!r}")

    def read_UnaryOp(self, node: ast.UnaryOp, depth: int) -> Any:
        v = self.operand(node.operand, depth)
        if isinstance(node.op, ast.UAdd):
            return v
        dunder = _UNARY.get(type(node.op))
        if dunder is None:
            raise self.fail(node, "'not' is not an expression operator (use ~ on bool)")
        if not isinstance(v, Expr):
            return -v if isinstance(node.op, ast.USub) else ~v
        return getattr(v, dunder)()

    def read_BinOp(self, node: ast.BinOp, depth: int) -> Any:
        name = _BINOPS.get(type(node.op))
        if name is None:
            raise self.fail(node, f"unsupported operator {type(node.op).__name__}")
        left, right = self.operand(node.left, depth), self.operand(node.right, depth)
        if not isinstance(left, Expr) and not isinstance(right, Expr):
            left = dsl.const(left)
        if isinstance(left, Expr):
            return getattr(left, f"__{name}__")(right)
        return getattr(right, f"__r{name}__")(left)

    def read_Compare(self, node: ast.Compare, depth: int) -> Any:
        if len(node.ops) != 1:
            raise self.fail(node, "chained comparisons are not supported (write (a < b) & (b < c))")
        name = _CMPOPS.get(type(node.ops[0]))
        if name is None:
            raise self.fail(node, f"unsupported comparison {type(node.ops[0]).__name__}")
        left = self.operand(node.left, depth)
        left = left if isinstance(left, Expr) else dsl.const(left)
        return getattr(left, f"__{name}__")(self.operand(node.comparators[0], depth))

    def read_Tuple(self, node: ast.Tuple, depth: int) -> Any:
        return tuple(self.read(e, depth) for e in node.elts)

    def argument(self, node: ast.AST, depth: int) -> Any:
        """A call argument: dtype names are dtypes here, and a list of expressions (``cat``) is allowed."""
        if isinstance(node, ast.Name) and node.id in DTYPES:
            return DTYPES[node.id]
        if isinstance(node, ast.List):
            return [self.read(e, depth + 1) for e in node.elts]
        return self.read(node, depth)

    def read_Call(self, node: ast.Call, depth: int) -> Any:
        if not isinstance(node.func, ast.Name):
            raise self.fail(node, "only plain function calls are supported")
        fn = self.functions.get(node.func.id)
        if fn is None:
            raise self.fail(node, f"unknown op {node.func.id!r}")
        for k in node.keywords:
            if k.arg is None:
                raise self.fail(k.value, "**keyword unpacking is not supported")
        args = [self.argument(a, depth) for a in node.args]
        kwargs = {k.arg: self.argument(k.value, depth) for k in node.keywords}
        try:
            return fn(*args, **kwargs)
        except TypeError as exc:
            raise self.fail(node, f"bad arguments for {node.func.id}: {exc}") from None


__all__ = ["DTYPES", "functions", "parse"]
