"""Expressions from text (config files, the command line): ``rx.parse("relu(x * w + 1)")``.

Python's own parser reads the text; only names, numbers, the DSL's operators and calls of
the DSL's public functions are accepted. Anything else is a :class:`ParseError` naming the
line and column.
"""

from __future__ import annotations

import ast
from typing import Any

from . import dsl
from .dtypes import TRITON_TYPE
from .errors import ParseError, RtxError
from .expr import Expr

FUNCTIONS = {
    name: getattr(dsl, name)
    for name in (
        *dsl.UNARY,
        *("gelu", "leaky_relu", "elu", "softplus", "maximum", "minimum", "where", "clamp", "pow", "cast", "const"),
        *("sum", "mean", "max", "min", "amax", "amin", "variance", "std", "logsumexp"),
        *("softmax", "log_softmax", "layer_norm", "rms_norm", "swiglu"),
    )
}
DTYPES = {str(dt).removeprefix("torch."): dt for dt in TRITON_TYPE}
_BINOPS = {
    ast.Add: "__add__",
    ast.Sub: "__sub__",
    ast.Mult: "__mul__",
    ast.Div: "__truediv__",
    ast.FloorDiv: "__floordiv__",
    ast.Mod: "__mod__",
    ast.Pow: "__pow__",
    ast.BitAnd: "__and__",
    ast.BitOr: "__or__",
    ast.BitXor: "__xor__",
}
_CMPOPS = {
    ast.Lt: "__lt__",
    ast.LtE: "__le__",
    ast.Gt: "__gt__",
    ast.GtE: "__ge__",
    ast.Eq: "__eq__",
    ast.NotEq: "__ne__",
}


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
    out = _Reader(text).visit(tree.body)
    if not isinstance(out, Expr):
        out = dsl.const(out)
    return out


class _Reader(ast.NodeVisitor):
    def __init__(self, text: str) -> None:
        self.text = text

    def fail(self, node: ast.AST, msg: str) -> ParseError:
        return ParseError(f"{msg} at line {node.lineno}, column {node.col_offset + 1} of {self.text!r}")

    def visit_Name(self, node: ast.Name) -> Any:
        if node.id in DTYPES:
            return DTYPES[node.id]
        if node.id in ("True", "False"):
            return node.id == "True"
        return dsl.var(node.id)

    def visit_Constant(self, node: ast.Constant) -> Any:
        if isinstance(node.value, (bool, int, float, str)):
            return node.value
        raise self.fail(node, f"unsupported constant {node.value!r}")

    def visit_UnaryOp(self, node: ast.UnaryOp) -> Any:
        v = self.visit(node.operand)
        if isinstance(node.op, ast.USub):
            return -v
        if isinstance(node.op, ast.UAdd):
            return v
        if isinstance(node.op, ast.Invert):
            return ~v
        raise self.fail(node, "'not' is not an expression operator (use ~ on bool)")

    def visit_BinOp(self, node: ast.BinOp) -> Any:
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise self.fail(node, f"unsupported operator {type(node.op).__name__}")
        left, right = self.visit(node.left), self.visit(node.right)
        if not isinstance(left, Expr) and not isinstance(right, Expr):
            left = dsl.const(left)
        return getattr(left, op)(right) if isinstance(left, Expr) else getattr(right, op.replace("__", "__r", 1))(left)

    def visit_Compare(self, node: ast.Compare) -> Any:
        if len(node.ops) != 1:
            raise self.fail(node, "chained comparisons are not supported (write (a < b) & (b < c))")
        op = _CMPOPS.get(type(node.ops[0]))
        if op is None:
            raise self.fail(node, f"unsupported comparison {type(node.ops[0]).__name__}")
        left = self.visit(node.left)
        left = left if isinstance(left, Expr) else dsl.const(left)
        return getattr(left, op)(self.visit(node.comparators[0]))

    def visit_Tuple(self, node: ast.Tuple) -> Any:
        return tuple(self.visit(e) for e in node.elts)

    def visit_Call(self, node: ast.Call) -> Any:
        if not isinstance(node.func, ast.Name):
            raise self.fail(node, "only plain function calls are supported")
        fn = FUNCTIONS.get(node.func.id)
        if fn is None:
            raise self.fail(node, f"unknown op {node.func.id!r}")
        args = [self.visit(a) for a in node.args]
        kwargs = {k.arg: self.visit(k.value) for k in node.keywords if k.arg is not None}
        try:
            return fn(*args, **kwargs)
        except TypeError as exc:
            raise self.fail(node, f"bad arguments for {node.func.id}: {exc}") from None
        except RtxError as exc:
            raise self.fail(node, str(exc)) from None

    def generic_visit(self, node: ast.AST) -> Any:
        raise self.fail(node, f"unsupported syntax {type(node).__name__}")


__all__ = ["DTYPES", "FUNCTIONS", "parse"]
