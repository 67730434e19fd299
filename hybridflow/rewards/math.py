"""Rule-based scoring of math answers: find a response's final answer, compare it with a reference.

The final answer of a response is, in this order of preference:

1. what follows the last ``####`` on its line (GSM8K's format);
2. the content of the last ``\\boxed{...}`` (braces may nest: ``\\boxed{\\frac{3}{4}}``);
3. the last number anywhere in the text.

Two answers are equal when both read as numbers within a relative tolerance (``1,234`` = ``1234``,
``$5.`` = ``5``, ``3/4`` = ``\\frac{3}{4}`` = ``0.75``, ``-0`` = ``0``, ``1e3`` = ``1000``,
``50%`` = ``50``); when either is not a number, their normalised texts must be the same.
"""

from __future__ import annotations

import re
from fractions import Fraction

REL_TOL = 1e-6
"""Relative tolerance of the numeric comparison."""

_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])[-\u2212])?"               # a sign only where it is no binary minus: 10-4
    r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"     # 1,234 or 1234, optional decimals
    r"(?:[eE][-+]?\d+)?"                        # 1e3
    r"(?:\s*/\s*\d+(?:\.\d+)?)?"                # 3/4
    r"|(?:(?<![\w)\]}])[-\u2212])?\.\d+"        # .5
)
_STRICT_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^{}]*)\}")


def boxed_contents(text: str) -> list[str]:
    """The contents of every ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``, braces balanced."""
    found = []
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found.append(text[start:i])
                break
    return found


def extract_final_answer(response: str) -> str | None:
    """The final answer of ``response`` as text (see the module docstring), or None if it has
    neither ``####``, ``\\boxed{}`` nor any number."""
    if "####" in response:
        after = response.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
        if after:
            return after
    boxed = boxed_contents(response)
    if boxed:
        return boxed[-1].strip()
    return last_number(response)


def last_number(text: str) -> str | None:
    """The last number in ``text`` as written (``"-1,234.5"``, ``"3/4"``, ``"1e3"``), or None."""
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def has_answer_format(response: str) -> bool:
    """Whether ``response`` states its answer explicitly, after ``####`` or in ``\\boxed{}``."""
    return "####" in response or bool(boxed_contents(response))


def _normalise(text: str) -> str:
    text = text.strip().replace("\u2212", "-")
    text = _TEXT.sub(r"\1", text)
    text = _FRAC.sub(r"(\1)/(\2)", text)
    for junk in ("\\$", "$", "\\!", "\\,", "\\;", "\\left", "\\right", "^\\circ", "^{\\circ}",
                 "\\%", "%", "{,}"):
        text = text.replace(junk, "")
    text = re.sub(r"(\d),(?=\d{3}(?!\d))", r"\1", text)  # thousands separators only: 1,234 not 1,2
    text = re.sub(r"\s+", "", text)
    text = re.sub(r"\((-?[\d.eE+-]+)\)", r"\1", text)  # (3)/(4) from \frac{3}{4}
    return text.rstrip(".").lstrip("+")


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number (``"1,234"``, ``"$-5."``, ``"3/4"``, ``"\\frac{3}{4}"``,
    ``"1e3"``, ``"50%"``), or None when it is not a plain number or fraction."""
    text = _normalise(text)
    sign = 1
    if text.startswith("-") and "/" in text:  # -3/4, -\frac{3}{4}
        sign, text = -1, text[1:]
    parts = text.split("/")
    if len(parts) > 2 or not all(_STRICT_NUMBER.fullmatch(p) for p in parts):
        return None
    value = Fraction(parts[0])
    if len(parts) == 2:
        denominator = Fraction(parts[1])
        if denominator == 0:
            return None
        value /= denominator
    return sign * value


def answers_match(answer: str, reference: str, rel_tol: float = REL_TOL) -> bool:
    """Whether two final answers are the same: numerically within ``rel_tol`` when both are numbers,
    else as normalised text. An answer that is not a number but contains exactly one number (``"72
    clips"``, ``"x = 5"``) is read as that number."""
    a, b = parse_number(answer), parse_number(reference)
    if a is None and b is not None:
        inner = _NUMBER.findall(answer)
        a = parse_number(inner[0]) if len(inner) == 1 else None
    if a is None or b is None:
        return _normalise(answer) != "" and _normalise(answer) == _normalise(reference)
    return abs(a - b) <= rel_tol * max(abs(a), abs(b))


def reference_answer(reference: str) -> str:
    """The answer inside a reference: a full GSM8K solution (``"... #### 72"``) or a ``\\boxed{}``
    solution gives its final answer; a bare answer is returned as it is."""
    if "####" in reference or boxed_contents(reference):
        return extract_final_answer(reference) or reference
    return reference.strip()


def math_reward(response: str, reference: str, *, format_bonus: float = 0.0) -> float:
    """1.0 when the final answer of ``response`` equals ``reference`` (a bare answer or a GSM8K
    solution ending in ``#### N``); ``format_bonus`` when it is wrong but stated after ``####`` or
    in ``\\boxed{}``; 0.0 otherwise."""
    answer = extract_final_answer(response)
    if answer is not None and answers_match(answer, reference_answer(str(reference))):
        return 1.0
    return format_bonus if has_answer_format(response) else 0.0
