"""The error types (bad user input, a run that stops), and the value checks every config
dataclass shares.

A leaf module: every package may import it, it imports nothing of ours.

A config dataclass names its own fields in its errors (``OptimConfig`` raises ``lr``); the loader
that built it from a YAML file prefixes the path it was built at (``actor.engine.optim.lr``), so
the message names the key the user typed.
"""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """Invalid user input. ``field`` is the dotted config key at fault; ``message`` says what is
    wrong with it and how to fix it."""

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):  # pickled across processes (a Ray worker raised it)
        return type(self), (self.field, self.message)

    def under(self, prefix: str) -> "ConfigError":
        """The same error for a config nested at ``prefix`` (``"actor.engine"``)."""
        return ConfigError(f"{prefix}.{self.field}" if prefix else self.field, self.message)


def check_int(field: str, value, *, low: int = 1, none_ok: bool = False) -> None:
    """``value`` is an integer >= ``low`` (or None where ``none_ok``)."""
    if none_ok and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        what = {0: "a non-negative integer", 1: "a positive integer"}.get(
            low, f"an integer >= {low}")
        raise ConfigError(field, f"must be {what}{' or null' if none_ok else ''}, got {value!r}")


def check_float(field: str, value, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False, none_ok: bool = False) -> None:
    """``value`` is a finite number in the interval given (bounds closed unless ``*_open``)."""
    if none_ok and value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        opening = "(" if low_open or low is None else "["
        closing = ")" if high_open or high is None else "]"
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        interval = f"{opening}{lo}, {hi}{closing}"
        raise ConfigError(field, f"must be a finite number in {interval}"
                          f"{' or null' if none_ok else ''}, got {value!r}")


def check_choice(field: str, value, choices) -> None:
    """``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(field, f"unknown value {value!r}; use one of "
                                 f"{', '.join(map(str, choices))}")


def exception_line(e: BaseException) -> str:
    """``ValueError: bad``, as a traceback's last line writes ``e``, its message on one line."""
    message = " ".join(str(e).split())
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


class RunError(RuntimeError):
    """A run stopped for a reason found while it ran, not in its config: a worker process died, a
    collective timed out, the disk filled, a reward function returned NaN. The message says what
    happened, where (group, rank, file, sample) and what to do; the CLI prints it as one line and
    exits 1 (2 is for bad input: ``ConfigError``)."""


class Interrupted(RunError):
    """A signal stopped the run where it was (SIGINT, or a SIGTERM that could not wait for the
    end of the step): its last checkpoint is kept. The CLI prints the message as one line and
    exits 128 + ``signum``, as a shell reports a process that signal ended."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class ArgumentError(ValueError):
    """A wrong argument of a library function (a shape, a value out of range): a programming
    error, never a user's config mistake (those are ConfigErrors, checked before anything runs).
    ``name`` is the argument."""

    def __init__(self, name: str, message: str):
        self.name, self.message = name, message
        super().__init__(f"{name}: {message}")

    def __reduce__(self):
        return type(self), (self.name, self.message)
