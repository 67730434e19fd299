"""The built-in tools a multi-turn rollout can offer the model: ``calculator`` and ``python``.

A tool is a plain ``def`` taking keyword arguments (the model's call) and returning a str (what
the model reads next). Both run inside the sandbox (``hybridflow.agent.sandbox.run_tool``), which
turns what they raise into an ``"error: ..."`` message; they are named in a config as
``hybridflow.agent.tools:calculator`` and ``hybridflow.agent.tools:python``.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import math
import operator

from hybridflow.errors import exception_line

MAX_EXPRESSION_CHARS = 1000
"""The longest expression ``calculator`` parses."""

MAX_INT_BITS = 4096
"""The largest integer ``calculator`` computes or returns (about 1233 decimal digits): a bound
checked before each power and after each operation, so ``9**9**9`` is refused, not computed."""

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """The value of an arithmetic ``expression``: numbers, ``+ - * / // % **``, unary minus and
    parentheses, with Python's precedence (``2+3*4`` is 14, ``-2**2`` is -4). Integers stay exact;
    a float is written with 15 significant digits (``0.1+0.2`` is ``0.3``). Names, calls,
    attributes and anything else are refused with a ValueError, as are a division by zero and a
    result beyond ``MAX_INT_BITS`` or a float's range. The text is parsed with ``ast``, never
    evaluated."""
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError) as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    value = _value(tree.body)
    return str(value) if isinstance(value, int) else f"{value:.15g}"


def _value(node: ast.AST) -> int | float:
    """The number ``node`` computes; see ``calculator``."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not "
                     f"{ast.unparse(node)!r}")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse ``base ** exponent`` when its integer result would exceed ``MAX_INT_BITS`` or it
    would be complex; checked before computing it."""
    if isinstance(exponent, int) and isinstance(base, int) and abs(base) > 1 and \
            exponent * (abs(base).bit_length() - 1) > MAX_INT_BITS:
        raise ValueError("the result is too large")
    if base < 0 and isinstance(exponent, float) and not exponent.is_integer():
        raise ValueError("a negative number to a fractional power is not a real number")


def _bounded(value: int | float | complex) -> int | float:
    """``value`` if it is a real number within bounds (an int of at most ``MAX_INT_BITS``, a
    finite float), else a ValueError."""
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS or \
            isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is too large")
    return value


MAX_CAPTURE_CHARS = 1_000_000
"""The most of its printed output ``python`` keeps (the sandbox cuts it shorter still)."""


def python(code: str) -> str:
    """Run ``code`` as a Python script and return what it printed (stdout and stderr, as written
    through ``sys.stdout`` / ``sys.stderr``: ``print``, tracebacks), followed, if it raised, by
    the error's last line (``ZeroDivisionError: division by zero``). ``sys.exit`` ends it
    quietly. Output of the processes it starts is not captured.

    It runs in the calling process, so only ever through the sandbox (``run_tool``), which gives
    it a process of its own with its limits."""
    out = _Capture()
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            exec(compile(code, "<code>", "exec"), namespace)  # noqa: S102 - the tool's purpose
        except SystemExit:
            pass
        except BaseException as e:  # noqa: BLE001 - the code's fault goes back to the model
            if isinstance(e, MemoryError):
                raise  # the sandbox reports it as the "memory" outcome
            out.write(("" if out.ends_line() else "\n") + exception_line(e) + "\n")
    return out.text()


class _Capture:
    """A text stream keeping the first ``MAX_CAPTURE_CHARS`` written to it and counting the
    rest, so code that prints without end cannot fill the memory."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._kept = 0
        self._dropped = 0
        self._last = "\n"  # the last character written

    def write(self, text: str) -> int:
        room = MAX_CAPTURE_CHARS - self._kept
        self._parts.append(text[:room])
        self._kept += min(len(text), room)
        self._dropped += max(0, len(text) - room)
        self._last = text[-1:] or self._last
        return len(text)

    def flush(self) -> None:
        pass

    def ends_line(self) -> bool:
        return self._last == "\n"

    def text(self) -> str:
        kept = "".join(self._parts)
        return kept + (f"\n[{self._dropped} more characters of output not kept]"
                       if self._dropped else "")
