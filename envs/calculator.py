"""A safe arithmetic evaluator over Python's ``ast``: the Calc-v0 calculator. Never calls ``eval``.

Only these nodes are evaluated: number literals, ``+ - * / // % **``, unary ``+ -``, parentheses, the constants
``pi`` and ``e``, and calls of a few math functions by name. Everything else (names, attributes, subscripts,
strings, lambdas, comprehensions) is rejected before anything runs. Sizes are bounded so no expression can take
long or use much memory: at most ``MAX_CHARS`` characters, ``MAX_NODES`` nodes, integers of ``MAX_INT_BITS`` bits,
``**`` only with exponents that keep results within those bounds, and every function argument checked before the
function runs (``round``'s digits within ±``MAX_ROUND_DIGITS``: ``round(1, -10**9)`` would build 10**(10**9) while
holding the GIL, where no timeout can interrupt it).
"""

from __future__ import annotations

import ast
import math
import operator
import threading
from typing import Callable

MAX_CHARS = 500
MAX_NODES = 200
MAX_INT_BITS = 4096
MAX_ROUND_DIGITS = 100

Number = int | float

_BINARY: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Number]] = {
    "sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max, "floor": math.floor,
    "ceil": math.ceil, "log": math.log, "exp": math.exp,
}
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}
# CPython 3.11's ast.parse counts its tree conversion's depth in interpreter-wide state (python/cpython gh-106905):
# envs stepped in threads (env_isolation="thread") parsing at once failed an episode with "SystemError: AST
# constructor recursion depth mismatch" (seen in tests/integration/test_weight_sync.py). One parse at a time; they
# are at most MAX_CHARS long.
_PARSE_LOCK = threading.Lock()


class ExpressionError(ValueError):
    """The expression is not valid arithmetic, or evaluating it failed (division by zero, too large)."""


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression such as ``"3 * (4 + 5) / 2"``. Raises ``ExpressionError``."""
    if not isinstance(expression, str):
        raise ExpressionError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise ExpressionError(f"expression is {len(expression)} characters; the limit is {MAX_CHARS}")
    try:
        with _PARSE_LOCK:
            tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ExpressionError(f"not a valid expression: {getattr(exc, 'msg', exc)}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ExpressionError(f"expression has more than {MAX_NODES} parts")
    try:
        value = _eval(tree.body)
    except ZeroDivisionError:
        raise ExpressionError("division by zero") from None
    except (OverflowError, ValueError) as exc:
        if isinstance(exc, ExpressionError):
            raise
        raise ExpressionError(f"cannot evaluate: {exc}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ExpressionError("the result is not a finite number")
    return value


def format_number(value: Number) -> str:
    """How the calculator prints results: integers exactly, floats to 12 significant digits (no "-0")."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    if isinstance(value, int):
        return str(value)
    text = f"{value:.12g}"
    return "0" if text == "-0" else text


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ExpressionError(f"only numbers are allowed, not {node.value!r}"[:120])
        return _checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        if isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise ExpressionError("the result is too large")
        return _checked(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        if node.keywords:
            raise ExpressionError(f"{node.func.id}() takes positional arguments only")
        args = [_eval(arg) for arg in node.args]
        _check_arguments(node.func.id, args)
        try:
            return _checked(_FUNCTIONS[node.func.id](*args))
        except TypeError as exc:
            raise ExpressionError(f"{node.func.id}(): {exc}") from None
    what = node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else type(node).__name__
    raise ExpressionError(f"{what!r} is not allowed; use numbers, + - * / // % **, parentheses, "
                          f"pi, e and {', '.join(_FUNCTIONS)}")


def _check_arguments(name: str, args: list[Number]) -> None:
    """Bounds on what a function may be given, checked before it runs (see the module docstring)."""
    for arg in args:
        if isinstance(arg, float) and not math.isfinite(arg):
            raise ExpressionError(f"{name}() needs finite numbers")
    if name == "round" and len(args) == 2:
        digits = args[1]
        if not isinstance(digits, int) or isinstance(digits, bool):
            raise ExpressionError("round()'s second argument must be a whole number of digits")
        if abs(digits) > MAX_ROUND_DIGITS:
            raise ExpressionError(f"round() to {digits} digits: at most {MAX_ROUND_DIGITS} either way")


def _check_power(base: Number, exponent: Number) -> None:
    if isinstance(base, complex) or isinstance(exponent, complex):
        raise ExpressionError("complex numbers are not supported")
    if abs(exponent) > 10_000 or (isinstance(base, int) and isinstance(exponent, int) and exponent > 0
                                  and abs(base) > 1 and abs(base).bit_length() * exponent > MAX_INT_BITS):
        raise ExpressionError("the result is too large")
    if base < 0 and isinstance(exponent, float) and not exponent.is_integer():
        raise ExpressionError("a negative number to a fractional power is not a real number")


def _checked(value: Number) -> Number:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ExpressionError("the result is too large")
    return value
