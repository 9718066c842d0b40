"""`calculate`: arithmetic over Python's `ast`, with nothing else reachable.

Only numbers, `+ - * / // % **`, unary signs, parentheses, a fixed set of math
functions and the constants `pi` and `e` are evaluated; any other node is refused
with its text and column. Guards keep a small input from becoming a huge
computation: the expression's length, the size of a power, and the size of every
intermediate integer. Pure: no I/O, nothing from the dispatcher's passes.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from dispatcher._exceptions import ToolError
from dispatcher._registry import Tool
from dispatcher._types import ToolContext

__all__ = ["MAX_EXPRESSION_CHARS", "calculate_tools", "evaluate"]

MAX_EXPRESSION_CHARS = 1000
_MAX_INT_BITS = 10_000  # about 3000 decimal digits, under Python's int-to-str limit
_MAX_ROUND_DIGITS = 400  # round(n, -10**9) would build 10**(10**9)

Number = int | float

_BINARY: dict[type[ast.operator], tuple[str, Callable[[Any, Any], Any]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
    ast.FloorDiv: ("//", operator.floordiv),
    ast.Mod: ("%", operator.mod),
    ast.Pow: ("**", operator.pow),
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_OPERATOR_TEXT: dict[type[ast.AST], str] = {
    ast.BitXor: "^ (use ** for powers)",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.MatMult: "@",
    ast.Invert: "~",
    ast.Not: "not",
}
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}


def _round(x: Number, digits: Number = 0) -> Number:
    if not isinstance(digits, int):
        raise ValueError(f"round() takes a whole number of digits, got {digits!r}")
    if abs(digits) > _MAX_ROUND_DIGITS:
        raise ValueError(f"round() takes at most {_MAX_ROUND_DIGITS} digits, got {digits}")
    return round(x) if digits == 0 else round(x, digits)


# name -> (function, fewest arguments, most arguments or None for any)
_FUNCTIONS: dict[str, tuple[Callable[..., Any], int, int | None]] = {
    "sqrt": (math.sqrt, 1, 1),
    "sin": (math.sin, 1, 1),
    "cos": (math.cos, 1, 1),
    "tan": (math.tan, 1, 1),
    "log": (math.log, 1, 2),
    "exp": (math.exp, 1, 1),
    "abs": (abs, 1, 1),
    "round": (_round, 1, 2),
    "min": (lambda *xs: min(xs), 1, None),
    "max": (lambda *xs: max(xs), 1, None),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
}


def calculate_tools() -> list[Tool]:
    """The `calculate` tool."""
    return [
        Tool(
            name="calculate",
            description=(
                "Evaluate an arithmetic expression exactly as Python would: numbers, "
                "+ - * / // % ** and parentheses, functions "
                f"{', '.join(_FUNCTIONS)}, constants pi and e."
            ),
            handler=_calculate,
            parameters={
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "minLength": 1,
                        "maxLength": MAX_EXPRESSION_CHARS,
                        "description": "e.g. '2 * (3 + 4) ** 2' or 'sqrt(2) / 2'",
                    }
                },
                "required": ["expression"],
                "additionalProperties": False,
            },
            concurrent=True,
        )
    ]


def _calculate(args: Mapping[str, Any], ctx: ToolContext) -> str:
    expression: str = args["expression"]
    value = evaluate(expression)
    return f"{expression.strip()} = {value!r}"


def evaluate(expression: str) -> Number:
    """The value of `expression`, or ToolError (not retryable) naming the offending part."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(
            f"the expression is {len(expression)} characters; at most {MAX_EXPRESSION_CHARS}",
            retryable=False,
        )
    source = expression.strip()
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as exc:
        raise ToolError(
            f"not an arithmetic expression{_where(source, exc.lineno, exc.offset)}: {exc.msg}",
            retryable=False,
        ) from exc
    except (ValueError, RecursionError, MemoryError) as exc:  # NUL bytes, absurd nesting
        raise ToolError(f"not an arithmetic expression: {exc}", retryable=False) from exc
    evaluator = _Evaluator(source)
    try:
        value = evaluator.eval(tree.body)
    except RecursionError as exc:
        raise ToolError("the expression is nested too deeply", retryable=False) from exc
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError(f"the result is not a finite number ({value!r})", retryable=False)
    return value


class _Evaluator:
    def __init__(self, source: str) -> None:
        self.source = source

    def eval(self, node: ast.expr) -> Number:
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool) or not isinstance(value, int | float):
                self._refuse(node, "a value that is not a number")
            return value
        if isinstance(node, ast.BinOp):
            return self._binary(node)
        if isinstance(node, ast.UnaryOp):
            op = _UNARY.get(type(node.op))
            if op is None:
                self._refuse(node, f"the operator {_OPERATOR_TEXT.get(type(node.op), '?')}")
            return self._checked(node, op(self.eval(node.operand)))
        if isinstance(node, ast.Name):
            if node.id in _CONSTANTS:
                return _CONSTANTS[node.id]
            hint = " (a function needs parentheses)" if node.id in _FUNCTIONS else ""
            self._refuse(node, f"the name {node.id!r}{hint}")
        if isinstance(node, ast.Call):
            return self._call(node)
        self._refuse(node, _describe(node))

    def _binary(self, node: ast.BinOp) -> Number:
        # a chain the parser leans left (`1 + 2 + ... + 499`, within the length limit) is
        # walked down its left operands in a loop, not one frame each, which would run
        # out of stack on a worker thread's; its operators are applied from the innermost
        chain = [node]
        while isinstance(chain[-1].left, ast.BinOp):
            chain.append(chain[-1].left)
        for step in chain:  # an operator refused before any operand is worked out, as ever
            if type(step.op) not in _BINARY:
                self._refuse(step, f"the operator {_OPERATOR_TEXT.get(type(step.op), '?')}")
        value = self.eval(chain[-1].left)
        for step in reversed(chain):
            value = self._apply(step, value, self.eval(step.right))
        return value

    def _apply(self, node: ast.BinOp, left: Number, right: Number) -> Number:
        symbol, op = _BINARY[type(node.op)]
        if symbol == "**":
            self._check_power(node, left, right)
        try:
            value = op(left, right)
        except ZeroDivisionError:
            self._fail(node, "division by zero")
        except OverflowError:
            self._fail(node, "the result is too large")
        if isinstance(value, complex):
            self._fail(node, "the result is not a real number")
        return self._checked(node, value)

    def _check_power(self, node: ast.BinOp, base: Number, exponent: Number) -> None:
        if isinstance(base, int) and isinstance(exponent, int):
            if exponent < 0 or base in (0, 1, -1):
                return
            # the result's bits are about exponent * log2|base| (bit_length * exponent is up
            # to twice that: 2 ** 6000 has 6001); past the bound either way, at once
            if exponent > _MAX_INT_BITS or exponent * math.log2(abs(base)) > _MAX_INT_BITS:
                self._fail(node, f"the power is too large (over {_MAX_INT_BITS} bits)")
        # A float power is one machine operation; overflow raises and is reported.

    def _call(self, node: ast.Call) -> Number:
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
            self._refuse(node.func, f"the function {self._text(node.func)!r}")
        name = node.func.id
        if node.keywords:
            self._refuse(node.keywords[0], f"a keyword argument in {name}()")
        fn, fewest, most = _FUNCTIONS[name]
        if len(node.args) < fewest or (most is not None and len(node.args) > most):
            expected = f"{fewest}" if fewest == most else f"{fewest} to {most or 'any number of'}"
            self._fail(node, f"{name}() takes {expected} argument(s), got {len(node.args)}")
        values = [self.eval(a) for a in node.args]
        try:
            value = fn(*values)
        except (ValueError, OverflowError, TypeError, ZeroDivisionError) as exc:
            self._fail(node, f"{name}() failed: {exc}")
        return self._checked(node, value)

    def _checked(self, node: ast.AST, value: Any) -> Number:
        if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
            self._fail(node, f"an intermediate result is too large (over {_MAX_INT_BITS} bits)")
        return value  # type: ignore[no-any-return]

    def _text(self, node: ast.AST) -> str:
        return ast.get_source_segment(self.source, node) or type(node).__name__

    def _refuse(self, node: ast.AST, what: str) -> NoReturn:
        column = getattr(node, "col_offset", None)
        where = f" at column {column + 1}" if column is not None else ""
        raise ToolError(f"unsupported: {what}{where}: {self._text(node)!r}", retryable=False)

    def _fail(self, node: ast.AST, why: str) -> NoReturn:
        raise ToolError(f"{why} in {self._text(node)!r}", retryable=False)


def _where(source: str, lineno: int | None, offset: int | None) -> str:
    """Where a syntax error is, naming the character there (the column is of its line)."""
    if offset is None:
        return ""
    lines = source.split("\n")
    line = lines[lineno - 1] if lineno is not None and 1 <= lineno <= len(lines) else source
    if not 1 <= offset <= len(line):
        return " at the end"
    place = f"line {lineno}, column {offset}" if len(lines) > 1 else f"column {offset}"
    return f" at {place} ({line[offset - 1]!r})"


def _describe(node: ast.AST) -> str:
    kinds = {
        ast.Attribute: "attribute access",
        ast.Subscript: "indexing",
        ast.Compare: "a comparison",
        ast.BoolOp: "a boolean operator",
        ast.Lambda: "a lambda",
        ast.IfExp: "a conditional",
        ast.List: "a list",
        ast.Tuple: "a tuple",
        ast.Dict: "a dict",
        ast.Set: "a set",
        ast.JoinedStr: "an f-string",
        ast.NamedExpr: "an assignment",
    }
    return kinds.get(type(node), f"a {type(node).__name__} expression")
