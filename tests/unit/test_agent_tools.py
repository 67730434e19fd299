"""The built-in tools (hybridflow.agent.tools): the calculator computes arithmetic and nothing
else, the python tool gives back what the code printed and its error's last line."""

import re

import pytest

from hybridflow.agent.sandbox import SandboxLimits, run_tool
from hybridflow.agent.tools import calculator, python


@pytest.mark.parametrize("expression, value", [
    ("2+3*4", "14"),
    ("(2+3)*4", "20"),
    ("2**3**2", "512"),          # right-associative
    ("-2**2", "-4"),             # the power binds tighter than unary minus
    ("(-2)**2", "4"),
    ("7//2", "3"),
    ("-7//2", "-4"),
    ("7%3", "1"),
    ("-7%3", "2"),
    ("7/2", "3.5"),
    ("6/3", "2"),
    ("0.1+0.2", "0.3"),
    ("2**-1", "0.5"),
    ("10-4-3", "3"),             # left-associative
    ("1.5e3*2", "3000"),
    (" 12345678901234567890 * 10 ", "123456789012345678900"),
    ("2**100", "1267650600228229401496703205376"),
])
def test_the_calculator_computes(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("1/0", "division by zero"),
    ("5//0", "division by zero"),
    ("5%0", "division by zero"),
    ("9**9**9", "too large"),
    ("2**5000", "too large"),
    ("10.0**400", "too large"),
    ("1e309", "too large"),
    ("(-8)**0.5", "not a real number"),
    ("x+1", "not 'x'"),
    ("abs(-1)", "not 'abs(-1)'"),
    ("(1).real", "not '1 .real'"),
    ("__import__('os').system('true')", "not"),
    ("True+1", "not 'True'"),
    ("[1][0]", "not"),
    ("1 if 1 else 2", "not"),
    ("2;3", "not an arithmetic expression"),
    ("1+", "not an arithmetic expression"),
    ("1" * 1001, "longer than 1000"),
])
def test_the_calculator_refuses(expression, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        calculator(expression)


def test_the_python_tool_gives_what_the_code_printed_and_its_error():
    assert python("print(6*7)\nprint('done')") == "42\ndone\n"
    assert python("print('start')\n1/0") == "start\nZeroDivisionError: division by zero\n"
    assert python("import sys\nprint('bye')\nsys.exit(3)\nprint('never')") == "bye\n"
    assert python("x = (") .startswith("SyntaxError")


def test_the_python_tool_keeps_a_bounded_part_of_endless_output(monkeypatch):
    import hybridflow.agent.tools as tools
    monkeypatch.setattr(tools, "MAX_CAPTURE_CHARS", 10)
    assert python("print('x' * 25)") == "x" * 10 + "\n[16 more characters of output not kept]"


LIMITS = SandboxLimits(timeout_s=5.0, max_output_chars=200)


def test_the_tools_through_the_sandbox():
    result = run_tool("hybridflow.agent.tools:calculator", {"expression": "2+3*4"}, LIMITS)
    assert (result.output, result.status) == ("14", "ok")
    result = run_tool("hybridflow.agent.tools:calculator", {"expression": "1/0"}, LIMITS)
    assert (result.output, result.status) == ("error: ValueError: division by zero", "error")
    result = run_tool("hybridflow.agent.tools:python", {"code": "import os\nprint(sum(range(5)))"},
                      LIMITS)
    assert (result.output, result.status) == ("10\n", "ok")
    result = run_tool("hybridflow.agent.tools:python", {"code": "while True: print('y' * 100)"},
                      SandboxLimits(timeout_s=1.0))
    assert result.status == "timeout"
