"""Prompts to token ids, and the resumable sampler that batches them epoch after epoch."""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Sequence

from hybridflow.errors import ConfigError
from hybridflow.data.prompts import PromptItem


def tokenize_prompts(items: Sequence[PromptItem], tokenizer: Any,
                     max_prompt_tokens: int) -> tuple[list[PromptItem], int]:
    """Apply ``tokenizer``'s chat template (with the generation prompt, so the model answers next)
    to each item: the items of at most ``max_prompt_tokens`` tokens, with ``prompt_ids`` set, and
    how many longer ones were dropped. Items that come with ``prompt_ids`` (synthetic prompts) are
    kept as they are, under the same limit; ``tokenizer`` may be None if all do."""
    if not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be a positive integer, got {max_prompt_tokens!r}")
    needs_template = any(item.prompt_ids is None for item in items)
    if needs_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("model", "its tokenizer has no chat template; use an instruct/chat "
                                   "model (or add a chat_template to its tokenizer_config.json)")
    kept, dropped = [], 0
    for item in items:
        if item.prompt_ids is not None:
            ids = item.prompt_ids
        else:
            text = tokenizer.apply_chat_template(item.messages, add_generation_prompt=True,
                                                 tokenize=False)
            # The template writes the special tokens itself; adding them again would double the
            # BOS.
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_tokens:
            dropped += 1
        else:
            kept.append(dataclasses.replace(item, prompt_ids=list(ids)))
    return kept, dropped


class PromptSampler:
    """Batches of prompt indices, forever: each epoch is a permutation of ``range(n_items)`` (drawn
    from ``seed`` and the epoch number, or the identity without ``shuffle``) cut into
    ``n_items // batch_size`` full batches; the tail that does not fill a batch is skipped that
    epoch. ``state_dict()`` / ``load_state_dict()`` resume exactly: the batches after a resume are
    those an uninterrupted run would have drawn."""

    def __init__(self, n_items: int, batch_size: int, seed: int = 0, shuffle: bool = True):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not isinstance(n_items, int) or n_items < batch_size:
            raise ConfigError("train_batch_size", f"is {batch_size} but only {n_items} prompts are "
                                                  f"left (after dropping long ones); lower it or "
                                                  f"add prompts")
        self.n_items, self.batch_size, self.seed, self.shuffle = n_items, batch_size, seed, shuffle
        self.epoch = 0  # the epoch the next batch comes from
        self.position = 0  # the next batch's index within its epoch
        self._order: list[int] | None = None  # the current epoch's permutation, made on demand

    @property
    def batches_per_epoch(self) -> int:
        return self.n_items // self.batch_size

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.n_items))
        if self.shuffle:
            # A str seed is hashed with SHA-512, the same in every process and Python run.
            random.Random(f"hybridflow.PromptSampler:{self.seed}:{epoch}").shuffle(order)
        return order

    def __iter__(self) -> PromptSampler:
        return self

    def __next__(self) -> list[int]:
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = self._epoch_order(self.epoch)
        start = self.position * self.batch_size
        self.position += 1
        return self._order[start:start + self.batch_size]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "n_items": self.n_items,
                "batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("n_items", "batch_size", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"the sampler state has {key}={state[key]!r}, this sampler "
                                 f"{getattr(self, key)!r}; resume with the same data and batch "
                                 f"size")
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None
