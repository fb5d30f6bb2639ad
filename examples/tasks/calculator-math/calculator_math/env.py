"""The calculator environment: one tool, `calculator(expression)`, evaluated safely.

TRL's protocol as it is (docs/tasks.md): the constructor takes the run's
`spec.harness.environment.args`, `reset(**row)` gets every column of the data row before
each rollout, and every public method is a tool whose type hints and Google docstring are
its schema. There is no `get_reward` here: the final answer is in the completion, which only
a reward function sees (`calculator_math.reward`).

The tool's result is a pure function of its argument (no timings, no ids, no state in the
text), so the G rollouts of a group that make the same call get the same message and keep
sharing their prefix (tree packing forwards it once).
"""

from __future__ import annotations

import ast
import math
import operator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
#: Bounds that keep one call cheap whatever the model writes ("9**9**9" would not end).
MAX_EXPRESSION = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e15


class CalculatorError(ValueError):
    """An expression the calculator refuses; its text is the tool result."""


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression: numbers, + - * / // % **, parentheses."""
    if len(expression) > MAX_EXPRESSION:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError("not an arithmetic expression") from None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise CalculatorError(f"exponent above {MAX_EXPONENT}")
            try:
                out = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            if isinstance(out, complex) or abs(out) > MAX_MAGNITUDE:
                raise CalculatorError("result out of range")
            return out
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise CalculatorError(f"unsupported element {type(node).__name__}: use numbers, "
                              "+ - * / // % ** and parentheses")

    return value(tree.body)


def format_number(x: float, precision: int) -> str:
    """`7` for 7.0, `0.333333` for 1/3 at precision 6: the same text for the same value."""
    if isinstance(x, int) or (math.isfinite(x) and float(x).is_integer()):
        return str(int(x))
    return f"{x:.{precision}f}".rstrip("0").rstrip(".")


class Calculator:
    """Arithmetic for the model; one instance serves many rollouts (TRL reuses them)."""

    def __init__(self, precision: int = 6):
        self.precision = precision
        self.calls = 0

    def reset(self, **row) -> None:
        """A new rollout: `row` is the data row (prompt, answer, ...). Nothing to keep."""
        self.calls = 0

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Numbers with + - * / // % ** and parentheses, e.g. "(12 + 30) * 2".

        Returns:
            The value, or an error message starting with "error:".
        """
        self.calls += 1
        try:
            return format_number(evaluate(expression), self.precision)
        except CalculatorError as e:
            return f"error: {e}"
