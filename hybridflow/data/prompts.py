"""Prompt datasets: reasoning-gym tasks, JSONL/Parquet files, records in memory or synthetic token
ids -> ``PromptItem``.

A file row holds its prompt in one column, either a string (one user turn) or a chat list of
``{"role", "content"}``; its reference answer comes from the answer column, else from a trailing
assistant turn of the chat (which is taken off the prompt either way). Loading is all or nothing:
the first bad row ends it in one ``ConfigError`` naming the file, the row and the column.

Synthetic prompts (``data.source: synthetic``) are random token ids of a fixed length, for
throughput runs (the HybridFlow paper's 1024-token prompts): no text, no chat template; only a
reward model can score what is generated from them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np
import pyarrow.parquet as pq

from hybridflow.errors import ConfigError

FILE_SUFFIXES = (".jsonl", ".parquet")
SOURCE_OPTIONS = {"reasoning_gym": ("tasks", "task_kwargs", "size"), "synthetic": ("size",),
                  "file": ("prompt_key", "answer_key")}
"""The kinds of ``data.source`` (``file``: a .jsonl or .parquet path) -> the options that only
some kinds read; the others leave them unread."""
SYNTHETIC_FIRST_ID = 3
"""Synthetic prompts draw token ids from [SYNTHETIC_FIRST_ID, vocab_size): ids 0-2 are the special
tokens of Llama-family vocabularies (unk/pad, bos, eos); specials elsewhere (Qwen2's, at the end
of its vocabulary) may be drawn."""


@dataclass
class PromptItem:
    """One prompt: the chat to generate from, its reference answer, and what scoring may need."""

    messages: list[dict[str, str]]
    """The chat, ``[{"role": ..., "content": ...}, ...]``, ending before the assistant's turn;
    empty for a synthetic prompt (token ids only)."""
    reference: str | None = None
    """The reference answer, or None when the data has none."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Everything else the row carried; for reasoning-gym, the entry itself (question, answer,
    metadata with source_dataset), which its scorer needs."""
    prompt_ids: list[int] | None = None
    """The chat template applied and tokenized (``data.loader.tokenize_prompts`` fills it); set
    from the start for synthetic prompts, which tokenizing passes through."""


@dataclass(kw_only=True)
class PromptDataConfig:
    """Where the prompts come from and how they are turned into chats."""

    source: str = "reasoning_gym"
    """``reasoning_gym`` (procedurally generated tasks), the path of a .jsonl or .parquet file, or
    ``synthetic``: random token ids of exactly max_prompt_tokens each, for throughput runs (needs
    a reward_model: no reward function can score them)."""
    tasks: list[str] = field(default_factory=lambda: ["basic_arithmetic"])
    """reasoning_gym: the reasoning-gym dataset names, e.g. [basic_arithmetic, gsm_symbolic]."""
    task_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """reasoning_gym: per-task dataset options, e.g. {basic_arithmetic: {min_terms: 2}}."""
    size: int = 1000
    """reasoning_gym: the number of prompts, split evenly over the tasks; synthetic: the number of
    prompts."""
    prompt_key: str | None = None
    """Files: the column holding the prompt (a string or a chat list); None takes ``prompt``, else
    ``messages``, whichever a row has."""
    answer_key: str | None = None
    """Files: the column holding the reference answer; None takes ``answer`` where a row has it,
    else the chat's trailing assistant turn, else no reference."""
    system_prompt: str | None = None
    """A system turn put before every chat that has none of its own; None adds nothing."""
    few_shot: list[dict[str, str]] = field(default_factory=list)
    """Turns put before every chat's own (after its system turn): worked examples, e.g. of a
    tool call (``{role: user, ...}``, ``{role: assistant, ...}``, ``{role: tool, ...}``, ...)."""
    max_prompt_tokens: int = 512
    """Prompts longer than this many tokens (chat template applied) are dropped and counted;
    synthetic prompts are exactly this long."""
    shuffle: bool = True
    """Reshuffle the prompts every epoch; False walks them in order."""
    seed: int = 0
    """Seed of the reasoning-gym generation, of the synthetic prompts' token ids and of the epoch
    shuffles."""

    def __post_init__(self) -> None:
        self.tasks = list(self.tasks)
        bad = [k for k, v in self.task_kwargs.items() if not isinstance(v, Mapping)]
        if bad:
            raise ConfigError(f"task_kwargs.{bad[0]}", "must be a mapping of dataset options, "
                                                           "e.g. {min_terms: 2}")
        self.task_kwargs = {k: dict(v) for k, v in self.task_kwargs.items()}
        if self.source not in ("reasoning_gym", "synthetic") and \
                not self.source.endswith(FILE_SUFFIXES):
            raise ConfigError("source", f"must be reasoning_gym, synthetic or a path ending in "
                                             f"{' or '.join(FILE_SUFFIXES)}, got {self.source!r}")
        if not isinstance(self.max_prompt_tokens, int) or self.max_prompt_tokens < 1:
            raise ConfigError("max_prompt_tokens", f"must be a positive integer, got "
                                                        f"{self.max_prompt_tokens!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError("seed", f"must be a non-negative integer, got {self.seed!r}")
        for name in ("prompt_key", "answer_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(name, f"must be a column name or null, got {value!r}")
        if self.source == "reasoning_gym":
            self._check_tasks()
        if self.source == "synthetic":
            if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
                raise ConfigError("size", f"must be a positive integer, got {self.size!r}")
            for name in ("system_prompt", "few_shot"):
                if getattr(self, name):
                    raise ConfigError(name, "has no effect with source=synthetic (token ids, no "
                                            "chat); remove it")
        self.few_shot = [dict(t) for t in _few_shot(self.few_shot)]

    def _check_tasks(self) -> None:
        if not self.tasks:
            raise ConfigError("tasks", "needs at least one reasoning-gym dataset name, e.g. "
                                            "[basic_arithmetic]")
        if len(set(self.tasks)) != len(self.tasks):
            raise ConfigError("tasks", f"lists a task twice: {self.tasks}")
        # The names themselves are checked where the prompts are made (reasoning_gym_prompts,
        # which hybridflow check runs): a machine without reasoning-gym can still build this
        # config's defaults and run from a prompt file.
        stray = sorted(set(self.task_kwargs) - set(self.tasks))
        if stray:
            try:  # a misspelt task is what is wrong then, not its options
                _check_task_names(self.tasks, "tasks")
            except ImportError:
                pass
            raise ConfigError("task_kwargs", f"has options for {stray}, which are not in "
                                             f"data.tasks {self.tasks}; add the tasks there or "
                                             f"remove their options (~data.task_kwargs.{stray[0]} "
                                             "on the command line)")
        if not isinstance(self.size, int) or self.size < len(self.tasks):
            raise ConfigError("size", f"must be an integer >= the number of tasks "
                                           f"({len(self.tasks)}), got {self.size!r}")

    @staticmethod
    def left_unread(section: Mapping[str, Any], key: str, value: Any) -> list[str]:
        """The options a config file's data ``section`` sets that an override ``key=value``
        (of this config's keys) leaves unread, which the loader drops: a new ``source`` leaves
        the options only other kinds of source read (a file, the reasoning-gym tasks, size and
        task_kwargs), new ``tasks`` the task_kwargs of the tasks they no longer list."""
        if key == "source":
            return [o for o in unread_options(value) if o in section]
        kwargs = section.get("task_kwargs")
        if key == "tasks" and isinstance(value, list) and isinstance(kwargs, Mapping):
            return [f"task_kwargs.{t}" for t in kwargs if t not in value]
        return []


def source_kind(source: Any) -> str:
    """The kind of ``source`` among SOURCE_OPTIONS': ``file`` for a .jsonl or .parquet path."""
    return "file" if isinstance(source, str) and source.endswith(FILE_SUFFIXES) else source


def unread_options(source: Any) -> list[str]:
    """The options of SOURCE_OPTIONS that ``source`` does not read."""
    read = SOURCE_OPTIONS.get(source_kind(source), ())
    return list(dict.fromkeys(o for options in SOURCE_OPTIONS.values() for o in options
                              if o not in read))


def source_readers(option: str) -> str:
    """The values of data.source that read ``option``, as a fix to name:
    ``data.source=reasoning_gym or synthetic``."""
    kinds = [k for k, options in SOURCE_OPTIONS.items() if option in options]
    return "data.source=" + " or ".join("a .jsonl or .parquet file" if k == "file" else k
                                        for k in kinds)


def load_prompts(cfg: PromptDataConfig, vocab_size: int | None = None) -> list[PromptItem]:
    """All prompts ``cfg`` names, in a deterministic order (the sampler shuffles);
    ``vocab_size``: the model's, which synthetic prompts draw their token ids below."""
    if cfg.source == "synthetic":
        if vocab_size is None:
            raise ValueError("synthetic prompts need the model's vocab_size")
        return synthetic_prompts(cfg.size, cfg.max_prompt_tokens, vocab_size, cfg.seed)
    if cfg.source == "reasoning_gym":
        items = reasoning_gym_prompts(cfg.tasks, size=cfg.size, seed=cfg.seed,
                                      task_kwargs=cfg.task_kwargs, system_prompt=cfg.system_prompt)
    else:
        items = prompts_from_file(cfg.source, prompt_key=cfg.prompt_key,
                                  answer_key=cfg.answer_key, system_prompt=cfg.system_prompt)
    for item in items if cfg.few_shot else ():
        system = int(item.messages[0]["role"] == "system")
        item.messages[system:system] = [dict(t) for t in cfg.few_shot]
    return items


def _few_shot(turns: Any) -> list[dict[str, str]]:
    """``data.few_shot`` checked: a list of {role, content} turns, none of them a system turn."""
    if not isinstance(turns, (list, tuple)):
        raise ConfigError("few_shot", f"must be a list of {{role, content}} turns, got "
                                      f"{_short(turns)}")
    for i, turn in enumerate(turns):
        if (not isinstance(turn, Mapping) or set(turn) != {"role", "content"}
                or not all(isinstance(v, str) for v in turn.values())):
            raise ConfigError("few_shot", f"turn {i} must be {{role: str, content: str}}, got "
                                          f"{_short(turn)}")
        if turn["role"] == "system":
            raise ConfigError("few_shot", f"turn {i} is a system turn; put it in "
                                          "data.system_prompt")
    return list(turns)


def synthetic_prompts(size: int, length: int, vocab_size: int, seed: int) -> list[PromptItem]:
    """``size`` prompts of ``length`` token ids each, drawn uniformly from [SYNTHETIC_FIRST_ID,
    vocab_size) by a generator seeded with ``seed``: set as ``prompt_ids``, no chat."""
    if vocab_size <= SYNTHETIC_FIRST_ID:
        raise ValueError(f"vocab_size {vocab_size} leaves no ids from {SYNTHETIC_FIRST_ID}")
    ids = np.random.default_rng(seed).integers(SYNTHETIC_FIRST_ID, vocab_size,
                                               size=(size, length))
    return [PromptItem(messages=[], prompt_ids=row) for row in ids.tolist()]


def reasoning_gym_prompts(tasks: list[str], *, size: int, seed: int,
                          task_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
                          system_prompt: str | None = None) -> list[PromptItem]:
    """``size`` entries split evenly over ``tasks`` (the first tasks take the remainder), task i
    generated with seed ``seed + i``: the question is the user turn, the answer the reference, and
    the entry itself ``extra``."""
    try:
        # deferred: reasoning_gym
        import reasoning_gym
    except ImportError:
        raise ConfigError("data.source", "reasoning_gym needs the package reasoning-gym "
                                         "(pip install reasoning-gym==0.1.25), or give a .jsonl "
                                         "or .parquet prompt file") from None
    _check_task_names(tasks, "data.tasks")
    task_kwargs = task_kwargs or {}
    items = []
    for i, task in enumerate(tasks):
        n = size // len(tasks) + (i < size % len(tasks))
        kwargs = dict(task_kwargs.get(task, {}))
        try:
            dataset = reasoning_gym.create_dataset(task, **{**kwargs, "size": n, "seed": seed + i})
        except (TypeError, ValueError, AssertionError) as e:
            raise ConfigError(f"data.task_kwargs.{task}", f"reasoning-gym rejects {kwargs}: "
                                                          f"{e or type(e).__name__}") from None
        for entry in dataset:
            items.append(PromptItem(messages=_with_system([{"role": "user",
                                                            "content": entry["question"]}],
                                                          system_prompt),
                                    reference=str(entry["answer"]), extra=entry))
    return items


def _check_task_names(tasks: list[str], key: str) -> None:
    """A ConfigError under ``key`` naming the names of ``tasks`` that are no reasoning-gym
    dataset; ImportError where reasoning-gym is not installed."""
    from reasoning_gym.factory import DATASETS  # deferred: reasoning_gym

    unknown = [t for t in tasks if t not in DATASETS]
    if unknown:
        raise ConfigError(key, f"unknown reasoning-gym datasets {unknown}; known: "
                               f"{sorted(DATASETS)}")


def prompts_from_file(path: str | os.PathLike, *, prompt_key: str | None = None,
                      answer_key: str | None = None,
                      system_prompt: str | None = None) -> list[PromptItem]:
    """The prompts of a .jsonl or .parquet file (see the module docstring for the row format)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ConfigError("data.source", f"{path} is a folder; give the .jsonl or .parquet file "
                                         "in it")
    if not os.path.isfile(path):
        raise ConfigError("data.source", f"prompt file {path!r} not found")
    if path.endswith(".parquet"):
        try:
            rows = enumerate(pq.read_table(path).to_pylist(), start=1)
        except Exception as e:  # pyarrow raises several types for a damaged file
            reason = (str(e).splitlines() or [type(e).__name__])[0]
            raise ConfigError("data.source", f"{path}: not a readable parquet file: "
                                             f"{reason}") from None
    elif path.endswith(".jsonl"):
        rows = _jsonl_rows(path)
    else:
        raise ConfigError("data.source", f"{path!r}: the prompt file must end in "
                                         f"{' or '.join(FILE_SUFFIXES)}")
    return _items_from_rows(rows, "data.source", path, prompt_key, answer_key, system_prompt)


def prompts_from_records(records: Iterable[Mapping[str, Any]], *, prompt_key: str | None = None,
                         answer_key: str | None = None, system_prompt: str | None = None,
                         name: str = "records") -> list[PromptItem]:
    """The prompts of rows in memory: a list of dicts or a ``datasets.Dataset``, rows as in a file;
    ``name`` stands for the file in error messages."""
    return _items_from_rows(enumerate(records, start=1), "prompts", name, prompt_key, answer_key,
                            system_prompt)


# ------------------------------------------------------------------------------------------------
# rows -> items


class _BadRow(Exception):
    def __init__(self, column: str, message: str):
        self.column, self.message = column, message


def _jsonl_rows(path: str) -> Iterable[tuple[int, Any]]:
    """(line number, parsed row) of each non-blank line."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError("data.source", f"{path}: row {number} is not UTF-8 text (byte "
                                  f"{e.start + 1} of the line); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError("data.source", f"{path}: row {number}: not valid JSON ({e.msg} "
                                  f"at column {e.colno}); each line must be one JSON "
                                  "object") from None


def _items_from_rows(rows: Iterable[tuple[int, Any]], field: str, where: str,
                     prompt_key: str | None,
                     answer_key: str | None, system_prompt: str | None) -> list[PromptItem]:
    items, bad = [], []
    for number, row in rows:
        try:
            items.append(_item_from_row(row, prompt_key, answer_key, system_prompt))
        except _BadRow as e:
            bad.append((number, e))
    if bad:
        number, e = bad[0]
        more = f" ({len(bad) - 1} more bad rows follow)" if len(bad) > 1 else ""
        raise ConfigError(field, f"{where}: row {number}, column {e.column!r}: {e.message}{more}")
    if not items:
        raise ConfigError(field, f"{where} holds no prompts")
    return items


def _item_from_row(row: Any, prompt_key: str | None, answer_key: str | None,
                   system_prompt: str | None) -> PromptItem:
    if not isinstance(row, Mapping):
        raise _BadRow(prompt_key or "prompt", f"the row must be an object with named columns, got "
                                              f"{type(row).__name__}")
    if prompt_key is None:
        prompt_key = next((k for k in ("prompt", "messages") if k in row), None)
        if prompt_key is None:
            raise _BadRow("prompt", f"the row has neither a 'prompt' nor a 'messages' column "
                                    f"(it has {sorted(row)}); set data.prompt_key to the prompt's "
                                    f"column")
    if prompt_key not in row:
        raise _BadRow(prompt_key, f"missing (the row has {sorted(row)}); set data.prompt_key to "
                                  f"the prompt's column")
    messages = _chat(row[prompt_key], prompt_key)
    trailing = None
    if messages[-1]["role"] == "assistant":
        trailing = messages.pop()["content"]
        if not messages:
            raise _BadRow(prompt_key, "the chat holds only an assistant turn; it needs a user turn")
    if answer_key is not None:
        if answer_key not in row:
            raise _BadRow(answer_key, f"missing (the row has {sorted(row)}); set "
                                      f"data.answer_key to the answer's column, or null to take "
                                      f"the chat's last assistant turn")
        reference = _answer(row[answer_key], answer_key)
    elif row.get("answer") is not None:
        answer_key, reference = "answer", _answer(row["answer"], "answer")
    else:
        reference = trailing
    extra = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
    return PromptItem(messages=_with_system(messages, system_prompt), reference=reference,
                      extra=extra)


def _chat(value: Any, column: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        if not value.strip():
            raise _BadRow(column, "the prompt is empty")
        return [{"role": "user", "content": value}]
    if not isinstance(value, (list, tuple)) or not value:
        raise _BadRow(column, f"expected a prompt string or a non-empty list of {{role, content}} "
                              f"turns, got {type(value).__name__}: {_short(value)}")
    chat = []
    for i, turn in enumerate(value):
        if (not isinstance(turn, Mapping) or not isinstance(turn.get("role"), str)
                or not isinstance(turn.get("content"), str)):
            raise _BadRow(column, f"turn {i} must be {{role: str, content: str}}, got "
                                  f"{_short(turn)}")
        chat.append({"role": turn["role"], "content": turn["content"]})
    return chat


def _answer(value: Any, column: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _BadRow(column, f"the answer must be a string or a number, got "
                              f"{type(value).__name__}: {_short(value)}")
    return str(value)


def _with_system(messages: list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    if system_prompt is None or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."

