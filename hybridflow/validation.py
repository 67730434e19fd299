"""Validation: greedy generations on held-out prompts, scored like the training samples.

``validation: {every: N, size: M}`` takes M prompts out of the run's data before training starts
(a fixed choice drawn from ``data.seed``: the same prompts at every start and resume, and the
training sampler never sees them), and logs ``val/reward`` (their mean score) and
``val/response_length`` before the first step, every N steps, and at the last step.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence, TypeVar

from hybridflow.errors import ConfigError, check_int
from hybridflow.parallel.layout import GenLayout

T = TypeVar("T")


@dataclass(kw_only=True)
class ValidationConfig:
    """Held-out prompts scored with greedy generation (``val/reward``)."""

    every: int = 0
    """Validate before the first step, every this many steps and at the last step; 0: never."""
    size: int = 0
    """Prompts held out of the data for it (training never sees them)."""

    def __post_init__(self) -> None:
        check_int("every", self.every, low=0)
        check_int("size", self.size, low=0)
        if bool(self.every) != bool(self.size):
            unset = "size" if self.every else "every"
            raise ConfigError(unset, "validation needs both every and size > 0 (or both 0 to "
                                     f"turn it off); set {unset}")

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def due(self, step: int, last: int) -> bool:
        """Whether to validate after ``step`` (0: before the first) of a run of ``last`` steps."""
        return self.enabled and (step % self.every == 0 or step == last)


def split_held_out(items: Sequence[T], size: int, seed: int) -> tuple[list[T], list[T]]:
    """(training items, ``size`` held-out items): the held-out ones are a fixed random choice from
    ``seed``, in their data order; the training items keep theirs."""
    if size == 0:
        return list(items), []
    chosen = set(random.Random(f"hybridflow.validation:{seed}").sample(range(len(items)), size))
    return ([x for i, x in enumerate(items) if i not in chosen],
            [x for i, x in enumerate(items) if i in chosen])


def check_validation(cfg, n_prompts: int) -> None:
    """The held-out split against the data and the layouts (a ConfigError naming the key)."""
    v = cfg.validation
    if not v.enabled:
        return
    if n_prompts - v.size < cfg.train_batch_size:
        raise ConfigError("validation.size", f"holding out {v.size} of the {n_prompts} prompts "
                                             f"leaves {n_prompts - v.size}, fewer than "
                                             f"train_batch_size={cfg.train_batch_size}; lower it "
                                             "or add prompts")
    replicas = GenLayout(train=cfg.actor.layout, tp=cfg.rollout.tp).replicas
    scorers = cfg.reward_model is not None or (cfg.algorithm.spec.cost
                                               and cfg.cost_model is not None)
    split = replicas
    if scorers:  # the reward (and cost) model scores them at critic.layout
        c = cfg.critic
        # A token budget takes any number of sequences per micro-batch.
        forward = (1 if c.engine.max_tokens_per_micro_batch is not None
                   else c.engine.forward_micro_batch_size or c.engine.micro_batch_size)
        split = math.lcm(split, c.layout.dp * forward)
    if v.size % split:
        raise ConfigError("validation.size", f"{v.size} prompts do not split over the "
                                             f"{replicas} generation replicas"
                          + (" and the reward model's data-parallel micro-batches" if scorers
                             else "") + f"; use a multiple of {split}")
