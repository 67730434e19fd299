"""Rule-based reward functions and the registry a trainer picks one from.

Every reward function has one form, ``fn(prompt_item, response) -> float``: ``prompt_item`` is a
``hybridflow.data.prompts.PromptItem`` or a dict with its fields (``messages``, ``reference``,
``extra``), ``response`` the decoded response text. ``as_reward_fn`` turns a registered name, a
``"module:function"`` / ``"path/file.py:function"`` string, or a Python callable taking
``(response)`` or ``(prompt_item, response)`` into that form; ``score_samples`` runs it over a
batch within a time limit and checks every value it returns.

A config that names a function runs it on the model's text, so a name resolves only to a plain
Python function (a ``def``, never a builtin, a callable object, a partial or any other wrapper,
which can hide ``os.system``) defined in the user's reward file (``file.py:function``), in
``hybridflow.rewards``, or in an installed module the config trusts by listing it (or a package
above it) in ``reward_trust``: ``yaml:unsafe_load`` and ``sympy:sympify`` run code embedded in
the text they are given. A Python callable handed to the Python API is the caller's own code.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import signal
import sys
import threading
import types
from math import isfinite  # not `import math`: the package's submodule rewards.math shadows it
from typing import Any, Callable, Sequence

import torch

from hybridflow.errors import ConfigError, RunError
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


def get_reward_fn(name: str, key: str = "reward") -> RewardFn:
    """The reward function registered as ``name``; errors name the config ``key``."""
    if name not in REWARD_FUNCTIONS:
        raise ConfigError(key, f"unknown reward function {name!r}; one of "
                               f"{sorted(REWARD_FUNCTIONS)}, or 'module:function' / "
                               f"'path/to/file.py:function' for your own")
    return REWARD_FUNCTIONS[name]


def as_reward_fn(fn: str | Callable[..., Any], key: str = "reward",
                 trust: Sequence[str] = ()) -> RewardFn:
    """``fn`` as ``fn(prompt_item, response) -> float``: a registered name, a
    ``"file.py:function"`` or ``"module:function"`` (see ``resolve_function``; ``trust``: the
    config's reward_trust), or a Python callable of ``(response)`` or ``(prompt_item,
    response)`` (told apart by how many positional arguments it requires). ``key`` is the
    config key that named it ("reward", "cost"), for errors. The result raises RunError when
    ``fn`` returns anything but a finite real number (see ``score_samples``)."""
    if isinstance(fn, str):
        fn = resolve_function(fn, key, trust) if ":" in fn else get_reward_fn(fn, key)
        if fn in REWARD_FUNCTIONS.values():
            return fn
    if not callable(fn):
        raise ConfigError(key, f"must be a reward function name or a callable, got "
                               f"{type(fn).__name__}")
    name = getattr(fn, "__qualname__", repr(fn))
    takes_prompt = _arity(fn, name, key) == 2

    def reward_fn(prompt_item: Any, response: str) -> float:
        value = fn(prompt_item, response) if takes_prompt else fn(response)
        score = _as_score(value)
        if score is None:
            raise _BadScore(value, f"{key} function {_origin(fn)[0]} returned {value!r}; "
                                   f"{_MUST_RETURN}")
        return score

    reward_fn.__name__ = getattr(fn, "__name__", type(fn).__name__)
    reward_fn.__qualname__ = name
    reward_fn.__doc__ = fn.__doc__
    reward_fn.__wrapped__ = fn  # what describe_reward_fn and error messages name
    return reward_fn


_MUST_RETURN = ("a reward function must return a number (int, float, a numpy scalar or a "
                "one-element tensor), finite, not a bool, a string or None")


class _BadScore(RunError):
    """A reward function's return value that is not a finite real number (``value``)."""

    def __init__(self, value: Any, message: str):
        super().__init__(message)
        self.value = value


def _as_score(value: Any) -> float | None:
    """``value`` as a float if it is a finite real number, else None. A bool, a numeric string,
    a tensor of several elements are not: float() would take the first two, and they are more
    likely a bug in the function than a score."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            return None
        value = value.item()
    numpy = sys.modules.get("numpy")  # a numpy scalar can only come from a loaded numpy
    if numpy is not None and isinstance(value, numpy.generic):
        if not isinstance(value, (numpy.integer, numpy.floating)):
            return None
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:  # an int beyond float's range
        return None
    return value if isfinite(value) else None


def score_samples(fn: Callable[[Any, str], Any], items: Sequence[Any], texts: Sequence[str],
                  key: str = "reward", timeout_s: float = 0.0) -> torch.Tensor:
    """``fn(item, text)`` for each sample, as a float32 tensor [len(items)]. ``fn`` is a reward
    function as ``as_reward_fn`` returns it (``key`` is the config key that named it). An
    exception raised by ``fn``, or a value that is not a finite real number (NaN, inf, a bool,
    "1.0", None, a list, a tensor of several elements), is a RunError naming the sample, the
    function, its file and what it raised or returned. So is a batch that takes longer than
    ``timeout_s`` (0: no limit; the run's ``reward_timeout_s``): the function is stopped where it
    is (``_within``)."""
    if len(items) != len(texts):
        raise ValueError(f"{len(items)} items but {len(texts)} texts")
    scores: list[float] = []
    try:
        _within(timeout_s, lambda: _score_each(fn, items, texts, key, scores))
    except _Overtime:
        i = len(scores)  # the sample it was on
        if i == len(items):  # the alarm struck as the last one returned
            return torch.tensor(scores, dtype=torch.float32)
        raise RunError(f"{key} function {_named(fn)} did not return within {timeout_s:g}s "
                       f"(reward_timeout_s, for a batch of {len(items)} samples) on sample {i} "
                       f"(response {_clip(texts[i])}); make it return sooner, or raise "
                       "reward_timeout_s") from None
    return torch.tensor(scores, dtype=torch.float32)


def _score_each(fn: Callable[[Any, str], Any], items: Sequence[Any], texts: Sequence[str],
                key: str, scores: list[float]) -> None:
    """Append ``fn(item, text)`` of each sample to ``scores``; see ``score_samples``."""
    for i, (item, text) in enumerate(zip(items, texts)):
        try:
            value = fn(item, text)
        except _BadScore as e:  # the wrapper's check; reported below with the sample
            value = e.value
        except Exception as e:  # noqa: BLE001 - user code: anything it raises stops the run
            what = " ".join(str(e).split())
            raise RunError(f"{key} function {_named(fn)} raised {type(e).__name__}: "
                           f"{what[:300]} on sample {i} (response {_clip(text)}); fix the "
                           "function, or have it return 0.0 for a response it cannot score"
                           ) from None
        score = _as_score(value)
        if score is None:
            raise RunError(f"{key} function {_named(fn)} returned {_clip_repr(value)} on sample "
                           f"{i} (response {_clip(text)}); {_MUST_RETURN}")
        scores.append(score)


class _Overtime(BaseException):
    """Raised into a reward function whose batch ran out of time. Not an Exception: a function's
    own ``except Exception`` must not swallow it."""


def _within(seconds: float, work: Callable[[], None]) -> None:
    """``work()``, stopped with ``_Overtime`` once it has run ``seconds`` (0: no limit).

    In the main thread (the driver's) SIGALRM raises it into the work wherever it is: a loop, a
    sleep, a blocking read, a regular expression (CPython's checks for signals), and again every
    second should the work catch it. Elsewhere (signals reach the main thread only) the work
    runs in a thread of its own, left behind if its time runs out."""
    if not seconds:
        work()
        return
    if threading.current_thread() is threading.main_thread():
        running = [True]

        def strike(signum, frame) -> None:
            if running[0]:  # not once the work is done: the alarm is being put away
                raise _Overtime
        previous = signal.signal(signal.SIGALRM, strike)
        try:
            signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
            work()
            running[0] = False
        finally:  # the next strike is a second away
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        return
    failed: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            failed.append(e)
        done.set()
    threading.Thread(target=run, name="reward", daemon=True).start()
    if not done.wait(seconds):
        raise _Overtime
    if failed:
        raise failed[0]


def describe_reward_fn(fn: Callable[..., Any], key: str = "reward") -> str:
    """One line naming the function ``fn`` runs and its file, for the start of a run:
    ``reward: my_rewards.py:score (/abs/path/my_rewards.py)``."""
    return f"{key}: {_named(fn)}"


def _clip(text: str, n: int = 60) -> str:
    return repr(text[:n]) + (f" truncated to {n} chars" if len(text) > n else "")


def _clip_repr(value: Any, n: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n] + "..."


def _named(fn: Callable[..., Any]) -> str:
    """``my_rewards.py:score (/abs/path/my_rewards.py)``."""
    name, path = _origin(fn)
    return f"{name} ({path})" if path else name


_USER_MODULE = "hybridflow_user_reward_"  # the module name a "file.py:function" is loaded as


def _origin(fn: Callable[..., Any]) -> tuple[str, str | None]:
    """``("my_rewards.py:score", "/abs/path/my_rewards.py")`` for the user function behind
    ``fn`` (through as_reward_fn's wrapper); the file is None for a builtin."""
    target = inspect.unwrap(fn)
    if not (inspect.isroutine(target) or inspect.isclass(target)):
        target = type(target)  # a callable object: its class
    qualname = getattr(target, "__qualname__", None) or repr(target)
    try:
        path = inspect.getsourcefile(target) or inspect.getfile(target)
    except TypeError:  # builtins have no file
        path = None
    module = getattr(target, "__module__", None) or ""
    if path and module.startswith(_USER_MODULE):
        module = os.path.basename(path)
    return (f"{module}:{qualname}" if module else qualname,
            os.path.abspath(path) if path else None)


def _arity(fn: Callable[..., Any], name: str, key: str = "reward") -> int:
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
    raise ConfigError(key, f"{name} must take (response) or (prompt_item, response); its "
                           f"signature is {inspect.signature(fn)}")


def installed_module(spec: str) -> str | None:
    """The module a ``"module:function"`` spec names; None for a registered name or a
    ``"file.py:function"``."""
    target, colon, _ = spec.rpartition(":")
    return target if colon and not target.endswith(".py") else None


def check_trust(trust: Any, key: str = "reward_trust") -> None:
    """``trust`` (the config's reward_trust) is a list of dotted module names, none of the
    standard library's (whose functions include os.system and eval)."""
    if not isinstance(trust, (list, tuple)) or not all(
            isinstance(m, str) and re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", m)
            for m in trust):
        raise ConfigError(key, f"must be a list of module names, e.g. [mypkg.rewards]; got "
                               f"{trust!r}")
    stdlib = [m for m in trust if m.split(".")[0] in (*sys.stdlib_module_names, "builtins")]
    if stdlib:
        raise ConfigError(key, f"{stdlib[0]} is the standard library's, which runs text as code "
                               "(os.system, eval); list the module of your reward functions")


OWN = "hybridflow.rewards"
"""Our rewards' package: trusted without being listed."""


def resolve_function(spec: str, key: str = "reward", trust: Sequence[str] = (), *,
                     own: str = OWN, trust_key: str = "reward_trust") -> types.FunctionType:
    """``"path/to/file.py:function"`` or ``"package.module:function"`` -> that function, only
    where it is a plain Python function (``def`` or lambda: ``types.FunctionType``) defined in
    that file, or in ``own`` (our package of such functions: ``hybridflow.rewards``, or
    ``hybridflow.agent.tools`` for tools) or a module of ``trust`` (a listed module or one below
    it), judged by where the function was defined (its module and code file), not where it was
    found. Anything else is a ConfigError on ``key`` (``trust_key``: the config key of the trust
    list, for its messages); a module name that is not trusted is refused before it is
    imported."""
    target, _, attr = spec.rpartition(":")
    user_file = installed_module(spec) is None
    if not user_file and not _trusted(target, (own, *trust)):
        raise ConfigError(key, f"{spec!r}: {target} is not a module {trust_key} lists; a "
                               "function from it would run on the model's text (yaml:unsafe_load "
                               "and sympy:sympify run code written in it). Name a def of your "
                               f"{_own_file(trust_key)}, or list the module if you "
                               f"trust it: {trust_key}: [{target}]")
    module = _import_module(target, spec, key)
    if not hasattr(module, attr):
        raise ConfigError(key, f"{target!r} has no {attr!r} (from {spec!r})")
    fn = getattr(module, attr)
    if not isinstance(fn, types.FunctionType):
        raise ConfigError(key, f"{spec!r} is {_kind(fn)}, not a function defined with def: "
                               "builtins and wrappers (callable objects, partials, "
                               "numpy.vectorize) are refused, since they can hide what runs on "
                               "the model's text. Name a def of your "
                               f"{_own_file(trust_key)}")
    origin, source = fn.__module__ or "", fn.__code__.co_filename
    defined_here = user_file and origin == module.__name__ and _same_file(source, target)
    if not defined_here and not _trusted(origin, (own, *trust)):
        raise ConfigError(key, f"{spec!r} is {fn.__qualname__} of {source}, which {target} does "
                               f"not define and {trust_key} does not list; name a def of your "
                               f"{_own_file(trust_key)}, or list its module if you trust it: "
                               f"{trust_key}: [{origin}]")
    return fn


def _own_file(trust_key: str) -> str:
    """The user's file in a refusal: a reward file, or (another trust list's) a file of one's
    own."""
    return ("reward file (my_rewards.py:score)" if trust_key == "reward_trust"
            else "own file (my_file.py:function)")


def _trusted(module: str, trust: Sequence[str]) -> bool:
    """Whether ``module`` is a module of ``trust`` or one below it."""
    return any(module == t or module.startswith(f"{t}.") for t in trust)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _kind(obj: Any) -> str:
    """What ``obj`` is, in words: ``the builtin posix.system``, ``a numpy.vectorize object``."""
    if inspect.isbuiltin(obj):
        owner = getattr(obj, "__self__", None)
        where = owner.__name__ if inspect.ismodule(owner) else getattr(obj, "__module__", None)
        return f"the builtin {where}.{obj.__name__}" if where else f"the builtin {obj.__name__}"
    if inspect.isclass(obj):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    cls = type(obj)
    return f"a {cls.__module__}.{cls.__qualname__} object"


def _import_module(target: str, spec: str, key: str = "reward") -> types.ModuleType:
    """The module ``target`` names: a user's ``path/to/file.py`` (executed) or an importable
    module; any way that fails is a ConfigError on ``key`` naming ``spec``."""
    try:
        if target.endswith(".py"):
            if not os.path.isfile(target):
                raise ConfigError(key, f"file {target!r} not found")
            module_spec = importlib.util.spec_from_file_location(
                f"{_USER_MODULE}{abs(hash(os.path.abspath(target)))}", target)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            return module
        return importlib.import_module(target)
    except ConfigError:
        raise
    # User code: a syntax error, anything it raises on import, or a sys.exit (SystemExit is no
    # Exception: it would end the command silently).
    except (Exception, SystemExit) as e:
        raise ConfigError(key, f"cannot import {target!r} from {spec!r}: "
                               f"{type(e).__name__}: {e}") from None


__all__ = [
    "REWARD_FUNCTIONS",
    "RewardFn",
    "as_reward_fn",
    "check_trust",
    "describe_reward_fn",
    "extract_final_answer",
    "extract_gym_answer",
    "get_reward_fn",
    "gym_reward",
    "installed_module",
    "math_reward",
    "math_reward_fn",
    "reasoning_gym_reward_fn",
    "resolve_function",
    "score_samples",
]
