"""Multi-turn rollouts with tools, token in, token out, on any rollout backend.

A turn: the backend samples until EOS (or a stop token); the parser finds the tool calls in the
turn's text; the tools run in the sandbox (``hybridflow.agent.sandbox``); their outputs are
appended as tokens in the chat template's tool role, followed by the template's glue that opens
the next assistant turn; the model continues from there. A sample ends at a turn without a call,
at ``max_turns`` or ``max_tool_calls``, or when its response budget (``sampling.max_tokens``,
every turn's tokens and the tools' together) runs out.

The trajectory is exact by construction: the response is the list of ids the backend sampled,
turn after turn, with the ids appended for tool output and template glue between them; nothing is
re-tokenised from text. ``RolloutOutput.sampled`` marks which response tokens were sampled (the
loss covers only those, ``rollout_batch`` makes it the ``response_mask``), and the behaviour
log-probs are the backend's own at those tokens (0 at appended ones), so the mismatch metrics and
TIS/MIS apply unchanged.

The last response token is always sampled: a tool runs only when another turn follows it.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Callable

from hybridflow.agent.sandbox import check_tool
from hybridflow.errors import ConfigError, RunError, check_float, check_int
from hybridflow.rewards import check_trust, resolve_function
from hybridflow.rollout.base import RolloutBackend, RolloutOutput, SamplingConfig

BUILTIN_TOOLS = {"calculator": "hybridflow.agent.tools:calculator",
                 "python": "hybridflow.agent.tools:python"}
"""Short names of the built-in tools (``rollout.multi_turn.tools`` takes them or
``module:function`` / ``file.py:function``)."""


@dataclass(kw_only=True)
class MultiTurnConfig:
    """``rollout.multi_turn``: tool use over several turns; off while ``tools`` is empty."""

    tools: list[str] = field(default_factory=list)
    """The tools the model may call: built-in names (calculator, python) or ``module:function``
    / ``path/file.py:function``; a tool is called by its function's name."""
    parser: str = "hermes"
    """How tool calls are written: hermes (``<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>``, one call per tag, Qwen's and Hermes' format), smollm2 (``<tool_call>[{...},
    ...]</tool_call>``, a list per tag, the SmolLM2 family's), or a function of your own,
    ``file.py:function`` (or ``module:function`` of a module ``trust`` lists): a turn's text ->
    a list of ``{"name": ..., "arguments": {...}}`` (empty: no call; raising ValueError: a
    malformed call, its message what the model reads)."""
    max_turns: int = 4
    """Model turns per sample at most (the first included)."""
    max_tool_calls: int = 4
    """Tool calls per sample at most; a turn that would exceed it ends the sample."""
    tool_timeout_s: float = 5.0
    """Wall-clock seconds a tool call may take; then it is killed and the model reads an error."""
    tool_memory_mb: int = 256
    """Address space of a tool call's process."""
    max_tool_output_chars: int = 1000
    """A tool's output is cut to this many characters (saying so) before it is tokenized."""
    trust: list[str] = field(default_factory=list)
    """Installed modules (or packages above them) whose functions may be tools, as
    ``reward_trust`` is for rewards; a tool from the user's file or a built-in needs none."""

    def __post_init__(self) -> None:
        self.tools, self.trust = list(self.tools or []), list(self.trust or [])
        check_trust(self.trust, "trust")
        if self.parser not in PARSERS and ":" not in self.parser:
            raise ConfigError("parser", f"unknown tool-call format {self.parser!r}; one of "
                                        f"{sorted(PARSERS)}, or file.py:function")
        if self.tools:
            self.parse_fn()  # a parser or tool that cannot be had is refused with the config
            for ref in self.tool_refs().values():
                check_tool(ref, trust=self.trust, key="tools")
        check_int("max_turns", self.max_turns)
        check_int("max_tool_calls", self.max_tool_calls)
        check_float("tool_timeout_s", self.tool_timeout_s, low=0, low_open=True)
        check_int("tool_memory_mb", self.tool_memory_mb, low=16)
        check_int("max_tool_output_chars", self.max_tool_output_chars)
        set_ = [f.name for f in fields(self) if f.name != "tools"
                and getattr(self, f.name) != (f.default_factory() if f.default is MISSING
                                              else f.default)]
        if not self.tools and set_:
            raise ConfigError("tools", f"is empty, so multi-turn is off and {set_} do nothing; "
                                       "list the tools (e.g. [calculator]) or drop those keys")

    @property
    def enabled(self) -> bool:
        return bool(self.tools)

    def describe(self) -> str:
        """One line for ``hybridflow check``."""
        tools = ", ".join(f"{name} ({ref})" for name, ref in self.tool_refs().items())
        return (f"multi-turn: tools {tools}; calls written as {self.parser}; up to "
                f"{self.max_turns} turns and {self.max_tool_calls} calls a sample, each call "
                f"sandboxed within {self.tool_timeout_s:g} s and {self.tool_memory_mb} MB")

    def parse_fn(self) -> Callable[[str], list[ToolCall]]:
        """The parser ``parser`` names."""
        if self.parser in PARSERS:
            return PARSERS[self.parser]
        fn = resolve_function(self.parser, "parser", tuple(self.trust),
                              trust_key="rollout.multi_turn.trust")

        def parse(text: str) -> list[ToolCall]:
            try:
                calls = fn(text)
            except ValueError as e:
                raise MalformedCall(str(e)) from None
            if not isinstance(calls, list):
                raise RunError(f"rollout.multi_turn.parser {self.parser} returned "
                               f"{type(calls).__name__}, not a list of calls")
            return [_call(c) for c in calls]

        return parse

    def tool_refs(self) -> dict[str, str]:
        """Tool name (what the model calls) -> where its function is."""
        refs = {}
        for tool in self.tools:
            ref = BUILTIN_TOOLS.get(tool, tool)
            if ":" not in ref:
                raise ConfigError("tools", f"{tool!r} is neither a built-in tool "
                                           f"({sorted(BUILTIN_TOOLS)}) nor module:function")
            name = ref.rsplit(":", 1)[1]
            if name in refs:
                raise ConfigError("tools", f"two tools are named {name!r}")
            refs[name] = ref
        return refs


# ------------------------------------------------------------------------------- tool calls
@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


class MalformedCall(ValueError):
    """A tool-call tag whose content is not a call: the model reads the message."""


_TAG = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def _call(obj: Any) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise MalformedCall('a call is a JSON object {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # OpenAI's form: the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise MalformedCall(f"arguments are not JSON: {e.msg}") from None
    if not isinstance(args, dict):
        raise MalformedCall("arguments must be a JSON object")
    return ToolCall(obj["name"], args)


def _tags(text: str, one: bool) -> list[ToolCall]:
    calls = []
    for body in _TAG.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            raise MalformedCall(f"not JSON: {e.msg}") from None
        if one:
            calls.append(_call(obj))
        elif isinstance(obj, list):
            calls.extend(_call(o) for o in obj)
        else:
            raise MalformedCall("the smollm2 format puts a JSON list of calls in the tag")
    if not calls and "<tool_call>" in text:
        raise MalformedCall("a <tool_call> tag is not closed by </tool_call>")
    return calls


PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {
    "hermes": lambda text: _tags(text, one=True),
    "smollm2": lambda text: _tags(text, one=False),
}
"""Tool-call format -> parser: a turn's text -> its calls (none: the sample ends); raises
MalformedCall for a call it cannot read."""


# ------------------------------------------------------------------------------- template glue
class ToolGlue:
    """The ids appended after a turn with tool calls: each output in the chat template's tool
    role, then the opening of the next assistant turn, as the tokenizer's template renders them.
    The template's text around the outputs is tokenized with its special tokens; an output is
    tokenized on its own with special-token text split (a tool cannot close its turn)."""

    _SENTINEL = "\x00{}\x00"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._pieces: dict[int, list[str]] = {}

    def pieces(self, k: int) -> list[str]:
        """The template's text between the model's turn and the next, around ``k`` outputs:
        ``k + 1`` pieces to interleave with them."""
        if k not in self._pieces:
            turn = self._SENTINEL.format("turn")
            messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": turn}]
            messages += [{"role": "tool", "content": self._SENTINEL.format(i)} for i in range(k)]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
            if turn not in text:
                raise ConfigError("rollout.multi_turn", "the model's chat template does not "
                                  "render an assistant message's content as given")
            text = text[text.index(turn) + len(turn):]
            pieces = []
            for i in range(k):
                mark = self._SENTINEL.format(i)
                if mark not in text:
                    raise ConfigError("rollout.multi_turn", "the model's chat template has no "
                                      "tool role: it drops tool messages")
                before, text = text.split(mark, 1)
                pieces.append(before)
            self._pieces[k] = pieces + [text]
        return self._pieces[k]

    def ids(self, outputs: list[str], last_token: int) -> list[int]:
        """The ids after a turn that ended with ``last_token`` (sampled: the glue's leading text
        is left out where it is that token's, e.g. the end-of-turn mark the model wrote)."""
        pieces = list(self.pieces(len(outputs)))
        ended = self.tokenizer.decode([last_token])
        if ended and pieces[0].startswith(ended):
            pieces[0] = pieces[0][len(ended):]
        encode = self.tokenizer.encode
        ids = encode(pieces[0], add_special_tokens=False)
        for output, piece in zip(outputs, pieces[1:]):
            ids += encode(output, add_special_tokens=False, split_special_tokens=True)
            ids += encode(piece, add_special_tokens=False)
        return ids


# ------------------------------------------------------------------------------- the loop
@dataclass
class ToolOutcome:
    """What one call gave back: ``output`` (what the model reads), ``status`` (ok, error,
    timeout, ... as the sandbox says; ``malformed`` for a call the parser could not read,
    ``unknown`` for a tool not configured) and its ``seconds``."""

    output: str
    status: str
    seconds: float = 0.0


@dataclass
class _Sample:
    out: RolloutOutput
    sampled: list[bool] = field(default_factory=list)
    turns: int = 0
    calls: int = 0
    outcomes: list[ToolOutcome] = field(default_factory=list)


def generate_multi_turn(backend: RolloutBackend, prompt_token_ids: list[list[int]],
                        sampling: SamplingConfig, config: MultiTurnConfig, glue: ToolGlue,
                        run_call: Callable[[ToolCall], ToolOutcome],
                        decode: Callable[[list[int]], str]) -> list[RolloutOutput]:
    """``sampling.n`` trajectories per prompt, prompt-major, each ``RolloutOutput`` with
    ``sampled`` and ``tools`` set (see the module docstring). ``run_call`` runs a parsed call
    (the sandbox, in a run); ``decode`` gives a turn's text for the parser."""
    parse = config.parse_fn()
    budget = sampling.max_tokens
    samples = [_Sample(o) for o in backend.generate(prompt_token_ids, sampling)]
    new = [(s, s.out.response_token_ids, s.out.logprobs, s.out.finish_reason) for s in samples]
    for s in samples:
        s.out = replace(s.out, response_token_ids=[], logprobs=[])
    while new:
        going = []
        for s, ids, logprobs, finish in new:
            s.turns += 1
            s.out.response_token_ids += ids
            s.out.logprobs += logprobs
            s.sampled += [True] * len(ids)
            s.out.finish_reason = finish
            tail = _next_turn(s, ids, finish, parse, config, glue, run_call, decode, budget)
            if tail is None:
                continue
            s.out.response_token_ids += tail
            s.out.logprobs += [0.0] * len(tail)
            s.sampled += [False] * len(tail)
            going.append(s)
        if not going:
            break
        room = max(budget - len(s.out.response_token_ids) for s in going)
        outs = backend.generate([s.out.prompt_token_ids + s.out.response_token_ids
                                 for s in going], replace(sampling, n=1, max_tokens=room))
        new = []
        for s, o in zip(going, outs):
            left = budget - len(s.out.response_token_ids)
            cut = len(o.response_token_ids) > left
            new.append((s, o.response_token_ids[:left], o.logprobs[:left],
                        "length" if cut else o.finish_reason))
    for s in samples:
        s.out.sampled = s.sampled
        s.out.tools = {"turns": s.turns, "outcomes": s.outcomes}
    return [s.out for s in samples]


def _next_turn(s: _Sample, ids: list[int], finish: str, parse, config: MultiTurnConfig,
               glue: ToolGlue, run_call, decode, budget: int) -> list[int] | None:
    """The ids to append before ``s``'s next turn (its tools' outputs and the template's glue),
    or None where the sample ends here."""
    if finish != "stop" or not ids or s.turns >= config.max_turns:
        return None
    try:
        calls = parse(decode(ids))
    except MalformedCall as e:
        outcomes = [ToolOutcome(f"error: malformed tool call: {e}", "malformed")]
    else:
        if not calls or s.calls + len(calls) > config.max_tool_calls:
            return None
        # The template's text alone (empty outputs) leaving no room for a turn: nothing runs.
        if _no_room(s, glue.ids([""] * len(calls), ids[-1]), budget):
            return None
        outcomes = [run_call(c) for c in calls]
        s.calls += len(calls)
    s.outcomes += outcomes
    tail = glue.ids([o.output for o in outcomes], ids[-1])
    return None if _no_room(s, tail, budget) else tail


def _no_room(s: _Sample, tail: list[int], budget: int) -> bool:
    """Whether ``tail`` appended to ``s`` would leave no token of ``budget`` for a turn."""
    return len(s.out.response_token_ids) + len(tail) >= budget


def sandbox_runner(config: MultiTurnConfig) -> Callable[[ToolCall], ToolOutcome]:
    """``run_call`` for ``generate_multi_turn``: each call in a sandboxed process of its own,
    within the config's limits; an unknown tool is an error the model reads."""
    from hybridflow.agent.sandbox import SandboxLimits, run_tool  # deferred: the tool side

    refs = config.tool_refs()
    limits = SandboxLimits(timeout_s=config.tool_timeout_s, memory_mb=config.tool_memory_mb,
                           max_output_chars=config.max_tool_output_chars)

    def run_call(call: ToolCall) -> ToolOutcome:
        if call.name not in refs:
            return ToolOutcome(f"error: no tool named {call.name!r}; tools: {sorted(refs)}",
                               "unknown")
        start = time.perf_counter()
        result = run_tool(refs[call.name], call.arguments, limits, trust=config.trust)
        return ToolOutcome(result.output, result.status, time.perf_counter() - start)

    return run_call


def tool_metrics(samples: list[dict[str, Any]], sampled_tokens: list[int],
                 response_tokens: list[int]) -> dict[str, float]:
    """A batch's ``multi_turn/*`` metrics from its samples' ``tools`` entries and their sampled
    and whole response lengths: turns and tool calls per sample, the share of samples with a
    call that ran (``ok``), tool errors, timeouts and malformed calls (counts), tool tokens per
    sample (output and template glue), and the seconds the batch's calls took
    (``timing/tools_s``, summed over the generating processes)."""
    outcomes = [o for s in samples for o in s["outcomes"]]
    count = len(samples)
    return {
        "multi_turn/turns_mean": sum(s["turns"] for s in samples) / count,
        "multi_turn/tool_calls_mean": sum(o.status != "malformed" for o in outcomes) / count,
        "multi_turn/ok_call_frac": sum(any(o.status == "ok" for o in s["outcomes"])
                                       for s in samples) / count,
        "multi_turn/tool_errors": sum(o.status not in ("ok", "timeout", "malformed")
                                      for o in outcomes),
        "multi_turn/tool_timeouts": sum(o.status == "timeout" for o in outcomes),
        "multi_turn/malformed_calls": sum(o.status == "malformed" for o in outcomes),
        "timing/tools_s": sum(o.seconds for o in outcomes),
        "multi_turn/tool_tokens_mean": (sum(response_tokens) - sum(sampled_tokens)) / count,
    }


class Tools:
    """A generating worker's multi-turn side: the parser, the template's glue and the sandboxed
    runner of ``rollout.multi_turn``; ``generate`` stands in for the backend's."""

    def __init__(self, config: MultiTurnConfig, tokenizer):
        self.config, self.tokenizer = config, tokenizer
        self.glue = ToolGlue(tokenizer)
        self.run_call = sandbox_runner(config)

    @classmethod
    def build(cls, config: MultiTurnConfig, model_dir) -> "Tools | None":
        """The tools of ``config`` with ``model_dir``'s tokenizer; None while multi-turn is off."""
        if not config.enabled:
            return None
        from transformers import AutoTokenizer  # deferred: transformers
        return cls(config, AutoTokenizer.from_pretrained(model_dir))

    def generate(self, backend: RolloutBackend, prompt_token_ids: list[list[int]],
                 sampling: SamplingConfig) -> list[RolloutOutput]:
        return generate_multi_turn(
            backend, prompt_token_ids, sampling, self.config, self.glue, self.run_call,
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
