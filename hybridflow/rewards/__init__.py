"""Rule-based reward functions and the registry a trainer picks one from.

Every reward function has one form, ``fn(prompt_item, response) -> float``: ``prompt_item`` is a
``hybridflow.data.prompts.PromptItem`` or a dict with its fields (``messages``, ``reference``,
``extra``), ``response`` the decoded response text. ``as_reward_fn`` turns a registered name, a
``"module:function"`` / ``"path/file.py:function"`` string, or a Python callable taking
``(response)`` or ``(prompt_item, response)`` into that form.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from typing import Any, Callable

from hybridflow.errors import ConfigError
from hybridflow.rewards.gym import extract_gym_answer, gym_reward
from hybridflow.rewards.math import extract_final_answer, math_reward

RewardFn = Callable[[Any, str], float]
"""``fn(prompt_item, response) -> float``."""


def _field(prompt_item: Any, name: str) -> Any:
    if isinstance(prompt_item, dict):
        return prompt_item.get(name)
    return getattr(prompt_item, name, None)


def math_reward_fn(prompt_item: Any, response: str) -> float:
    """``math_reward`` against the prompt's reference answer: 1.0 right, 0.0 wrong."""
    reference = _field(prompt_item, "reference")
    if reference is None:
        raise ConfigError("reward", "the math reward needs a reference answer and this prompt "
                                       "has none; set data.answer_key to the answer's column")
    return math_reward(response, reference)


def reasoning_gym_reward_fn(prompt_item: Any, response: str) -> float:
    """The score of the reasoning-gym dataset that made the prompt (its entry is ``extra``)."""
    entry = dict(_field(prompt_item, "extra") or {})
    reference = _field(prompt_item, "reference")
    if "answer" not in entry and reference is not None:
        entry["answer"] = reference
    return gym_reward(entry, response)


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "math": math_reward_fn,
    "reasoning_gym": reasoning_gym_reward_fn,
}
"""Name -> ``fn(prompt_item, response) -> float``."""


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered as ``name``."""
    if name not in REWARD_FUNCTIONS:
        raise ConfigError("reward", f"unknown reward function {name!r}; one of "
                                       f"{sorted(REWARD_FUNCTIONS)}, or 'module:function' / "
                                       f"'path/to/file.py:function' for your own")
    return REWARD_FUNCTIONS[name]


def as_reward_fn(fn: str | Callable[..., Any]) -> RewardFn:
    """``fn`` as ``fn(prompt_item, response) -> float``: a registered name, an importable
    ``"module:function"`` or ``"file.py:function"``, or a callable of ``(response)`` or
    ``(prompt_item, response)`` (told apart by how many positional arguments it requires)."""
    if isinstance(fn, str):
        fn = _import_callable(fn) if ":" in fn else get_reward_fn(fn)
        if fn in REWARD_FUNCTIONS.values():
            return fn
    if not callable(fn):
        raise ConfigError("reward", f"must be a reward function name or a callable, got "
                                       f"{type(fn).__name__}")
    name = getattr(fn, "__qualname__", repr(fn))
    takes_prompt = _arity(fn, name) == 2

    def reward_fn(prompt_item: Any, response: str) -> float:
        value = fn(prompt_item, response) if takes_prompt else fn(response)
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError("reward", f"{name} returned {value!r}; a reward function must "
                                           f"return a number") from None

    reward_fn.__name__ = getattr(fn, "__name__", type(fn).__name__)
    reward_fn.__qualname__ = name
    reward_fn.__doc__ = fn.__doc__
    return reward_fn


def _arity(fn: Callable[..., Any], name: str) -> int:
    """1 for ``f(response)``, 2 for ``f(prompt_item, response)``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins have no signature; assume the full form
        return 2
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(required) in (1, 2):
        return len(required)
    if not required and (len(positional) >= 2 or varargs):
        return 2
    if not required and len(positional) == 1:
        return 1
    raise ConfigError("reward", f"{name} must take (response) or (prompt_item, response); its "
                                   f"signature is {inspect.signature(fn)}")


def _import_callable(spec: str) -> Callable[..., Any]:
    """``"pkg.module:attr"`` or ``"path/to/file.py:attr"`` -> that attribute."""
    target, _, attr = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            if not os.path.isfile(target):
                raise ConfigError("reward", f"file {target!r} not found")
            module_spec = importlib.util.spec_from_file_location(
                f"hybridflow_user_reward_{abs(hash(os.path.abspath(target)))}", target)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ConfigError:
        raise
    except Exception as e:  # user code: a syntax error or anything it raises on import
        raise ConfigError("reward", f"cannot import {target!r} from {spec!r}: "
                                    f"{type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        raise ConfigError("reward", f"{target!r} has no {attr!r} (from {spec!r})")
    return getattr(module, attr)


__all__ = [
    "REWARD_FUNCTIONS",
    "RewardFn",
    "as_reward_fn",
    "extract_final_answer",
    "extract_gym_answer",
    "get_reward_fn",
    "gym_reward",
    "math_reward",
    "math_reward_fn",
    "reasoning_gym_reward_fn",
]
