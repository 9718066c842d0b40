"""The calculate tool: safe arithmetic over ast."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builtin_tools import default_registry
from builtin_tools.calculate import MAX_EXPRESSION_CHARS, evaluate
from dispatcher._exceptions import ToolError
from dispatcher._types import ToolContext


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("2 ** 3 ** 2", 512),
        ("-2 ** 2", -4),
        ("7 // 2", 3),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("7 / 2", 3.5),
        ("+5 - -5", 10),
        ("1_000 * 1e3", 1_000_000.0),
        ("2 ** -1", 0.5),
        ("2 ** 1000 // 2 ** 999", 2),
    ],
)
def test_arithmetic_follows_python(expression: str, value: float) -> None:
    """Operators and precedence are Python's."""
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("sqrt(16)", 4.0),
        ("abs(-3)", 3),
        ("round(2.675, 2)", round(2.675, 2)),
        ("round(7.5)", 8),
        ("min(3, 1, 2)", 1),
        ("max(4)", 4),
        ("floor(-1.5)", -2),
        ("ceil(1.2)", 2),
        ("log(e)", 1.0),
        ("log(8, 2)", 3.0),
        ("exp(0)", 1.0),
        ("sin(0) + cos(0) + tan(0)", 1.0),
        ("2 * pi", 2 * math.pi),
    ],
)
def test_functions_and_constants(expression: str, value: float) -> None:
    """The math functions and pi/e give Python's values."""
    assert evaluate(expression) == pytest.approx(value)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os')", "unsupported: the function '__import__' at column 1"),
        ("x + 1", "unsupported: the name 'x' at column 1"),
        ("1 + sqrt", "the name 'sqrt' (a function needs parentheses) at column 5"),
        ("(1).real", "unsupported: attribute access at column 1: '(1).real'"),
        ("2 ^ 3", "the operator ^ (use ** for powers) at column 1: '2 ^ 3'"),
        ("1 << 3", "the operator <<"),
        ("'a' * 3", "a value that is not a number at column 1: \"'a'\""),
        ("True + 1", "a value that is not a number at column 1: 'True'"),
        ("1 < 2", "a comparison"),
        ("[1, 2]", "a list"),
        ("sqrt(x=4)", "a keyword argument in sqrt()"),
        ("math.sqrt(4)", "the function 'math.sqrt'"),
        ("lambda: 1", "a lambda"),
    ],
)
def test_anything_else_is_refused_by_name(expression: str, message: str) -> None:
    """Names, attributes, other operators and non-numbers are refused, naming the text."""
    with pytest.raises(ToolError) as info:
        evaluate(expression)
    assert message in info.value.message
    assert info.value.retryable is False


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1 / 0", "division by zero in '1 / 0'"),
        ("5 % 0", "division by zero"),
        ("sqrt(-1)", "sqrt() failed: math domain error"),
        ("log(0)", "log() failed"),
        ("log(2, 1)", "log() failed"),
        ("exp(1000)", "exp() failed"),
        ("1e308 * 10", "not a finite number"),
        ("sqrt(1, 2)", "sqrt() takes 1 argument(s), got 2"),
        ("round(1, 2, 3)", "round() takes 1 to 2 argument(s), got 3"),
        ("round(5, -10 ** 9)", "round() takes at most 400 digits"),
        ("2 +", "not an arithmetic expression at the end: invalid syntax"),
        ("2 +* 3", "not an arithmetic expression at column 4 ('*')"),
    ],
)
def test_math_errors_are_reported(expression: str, message: str) -> None:
    """Failures say what went wrong and where."""
    with pytest.raises(ToolError) as info:
        evaluate(expression)
    assert message in info.value.message


@pytest.mark.parametrize(
    "expression",
    ["9 ** 9 ** 9", "2 ** 100000", "(2 ** 9000) * (2 ** 9000)", "10 ** 5000", "2.0 ** 1e10"],
)
def test_huge_computations_are_refused_quickly(expression: str) -> None:
    """Powers and products that would take long or print huge numbers are refused at once."""
    start = time.perf_counter()
    with pytest.raises(ToolError, match=r"too large|not a finite|failed"):
        evaluate(expression)
    assert time.perf_counter() - start < 0.5


def test_long_expressions_are_refused() -> None:
    """An expression over the length limit is refused before parsing."""
    with pytest.raises(ToolError, match=f"at most {MAX_EXPRESSION_CHARS}"):
        evaluate("1+" * 600 + "1")


def test_deep_nesting_is_refused() -> None:
    """Nesting deeper than the parser allows is an error, not a crash."""
    with pytest.raises(ToolError, match="not an arithmetic expression"):
        evaluate("(" * 300 + "1" + ")" * 300)


@settings(max_examples=200, deadline=None)
@given(st.integers(-(10**12), 10**12), st.integers(-(10**12), 10**12), st.integers(1, 10**6))
def test_integer_arithmetic_is_exact(a: int, b: int, c: int) -> None:
    """Integer expressions give exactly Python's result."""
    assert evaluate(f"({a}) * ({b}) - ({a}) // {c} + ({b}) % {c}") == a * b - a // c + b % c


def test_calculate_tool_renders_and_is_concurrent(tmp_path: Path) -> None:
    """The tool returns `expression = value`, runs concurrently and declares no writes."""
    tool = default_registry(tmp_path, include=["calculate"]).get("calculate")
    assert tool.concurrent is True and tool.writes is None and tool.confirm is False
    ctx = ToolContext(call_id="c1", tool_name="calculate", run_id=1, round=1)
    assert tool.handler({"expression": " 0.1 + 0.2 "}, ctx) == "0.1 + 0.2 = 0.30000000000000004"
