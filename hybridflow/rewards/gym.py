"""Scoring with reasoning-gym: each entry is scored by its own dataset's ``score_answer``.

A reasoning-gym entry is ``{"question", "answer", "metadata": {"source_dataset", ...}}``;
``reasoning_gym.get_score_answer_fn(metadata["source_dataset"])`` is that dataset's scorer,
``score(answer, entry) -> float in [0, 1]`` (some datasets give partial credit, e.g. gsm_symbolic
gives 0.01 for a wrong number). Scorers expect the bare answer, so it is extracted from the response
first: the last ``<answer>...</answer>``, else the last ``\\boxed{...}``, else the last number when
the reference answer is a number, else the last non-empty line.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

from hybridflow.errors import ConfigError
from hybridflow.rewards.math import boxed_contents, last_number, parse_number


def extract_gym_answer(response: str, reference: str | None = None) -> str | None:
    """The bare answer of ``response`` (see the module docstring); None when it is empty."""
    from reasoning_gym.utils import extract_answer  # deferred: reasoning_gym

    tagged = extract_answer(response)
    if tagged is not None:
        return tagged
    boxed = boxed_contents(response)
    if boxed:
        return boxed[-1].strip()
    if reference is not None and parse_number(reference) is not None:
        number = last_number(response)
        if number is not None:
            return number
    lines = [line.strip() for line in response.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


@functools.cache  # building a dataset's scorer can load files; one per dataset name is enough
def _score_fn(dataset_name: str) -> Callable[[str | None, dict[str, Any]], float]:
    import reasoning_gym  # deferred: reasoning_gym

    try:
        return reasoning_gym.get_score_answer_fn(dataset_name)
    except ValueError:
        raise ConfigError("reward", f"{dataset_name!r} is not a reasoning-gym dataset of the "
                                    f"installed version {reasoning_gym.__version__}") from None


def gym_reward(entry: Mapping[str, Any], response: str) -> float:
    """``response`` scored by the reasoning-gym dataset that made ``entry``
    (``entry["metadata"]["source_dataset"]``), in [0, 1]."""
    source = (entry.get("metadata") or {}).get("source_dataset")
    if not source:
        raise ConfigError("reward", "the prompt's reasoning-gym entry has no "
                                    "metadata.source_dataset; load prompts with "
                                    "data.source=reasoning_gym, or keep the entry's metadata "
                                    "column in the data file")
    if "answer" not in entry:
        raise ConfigError("reward", f"the reasoning-gym entry of {source!r} has no answer to score "
                                    f"against")
    answer = extract_gym_answer(response, str(entry["answer"]))
    return float(_score_fn(source)(answer, dict(entry)))
