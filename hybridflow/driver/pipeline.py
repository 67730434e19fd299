"""Generation ahead of training (``rollout.mode`` one_step_off and async): the steps of a run
whose generation pool is its own.

With K = ``rollout.staleness`` (one_step_off: 1; async: ``rollout.max_staleness``) the pipeline
holds the K generated batches next in line. Step k (1-based) trains on batch k while the
generation pool generates batch k+K with the weights it holds, those of update k-1; after both,
the trainer pushes the weights of update k to it (``Groups.push``, verified). So batch j is
generated with the weights of update max(0, j-1-K) and trained on after j-1 updates: its
staleness is min(j-1, K), fixed by the schedule, never more than K, so no sample is ever dropped
(``rollout/dropped`` is 0 by construction: there are no partial rollouts that could outlive
their bound). The first step first fills the pipeline with batches 1..K, all from the initial
weights.

The training runs in the driver's thread (a reward function's time limit and the signals need
the main thread), the generation beside it (``dataflow.at_once``); the run's timeline shows the
two pools busy at once (``timing/overlap_s``, ``timing/idle_<pool>_s``).

A checkpoint after step k holds the batches in flight (k+1..k+K: every tensor and list, the
prompts as indices into the training items), the prompt sampler after batch k+K and the
generation ranks' call counts (``RolloutWorker.save_state``): a resumed run trains on the same
batches and draws the same ones after them as the uninterrupted run.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.checkpoint import writing
from hybridflow.data.loader import PromptSampler
from hybridflow.data.prompts import PromptItem
from hybridflow.driver import step as steps
from hybridflow.driver.dataflow import DRIVER, Call, at_once
from hybridflow.errors import ConfigError

IN_FLIGHT = "in_flight.pt"
"""The checkpoint's file of the batches in flight."""


@dataclass
class InFlight:
    """A generated batch not yet trained on: the prompts it was drawn from (indices into the
    training items) and the batch (its generation's timings apart, in ``meta``)."""

    indices: list[int]
    batch: Batch


class Pipeline:
    """The generated batches ahead of training, and the version of the trainer's weights (the
    updates they have had)."""

    def __init__(self, run: steps.Run, items: list[PromptItem], sampler: PromptSampler):
        self.run, self.items, self.sampler = run, items, sampler
        self.ahead = run.config.rollout.staleness
        self.queue: list[InFlight] = []
        self.version = 0

    def start(self, version: int) -> None:
        """Before the first step of this process: the trainer's weights (``version``: the step
        the run stands at) pushed to the generation pool, which then holds them."""
        self.version = version
        self.run.groups.push(version)

    def _generate(self) -> tuple[InFlight, dict[str, Any]]:
        """The next prompts generated on the generation pool; its timings apart."""
        indices = next(self.sampler)
        batch = steps.generate(self.run, [self.items[i] for i in indices])
        meta, batch.meta = batch.meta, {}
        return InFlight(indices, batch), meta

    def iteration(self) -> dict[str, float]:
        """One step: the oldest batch in flight trained on while the next is generated, then the
        weights pushed; its metrics."""
        run, start = self.run, time.perf_counter()
        while len(self.queue) < self.ahead:  # the first step fills the pipeline
            self.queue.append(self._generate()[0])
        entry = self.queue.pop(0)
        metrics: dict[str, float] = {}
        results = at_once([
            Call("train", DRIVER, lambda: steps.train(run, entry.batch, metrics)),
            Call("generate", run.groups.rollout.pool, self._generate)])
        batch = results["train"]
        following, meta = results["generate"]
        self.queue.append(following)
        metrics.update(staleness(batch["weight_version"], self.version, self.ahead))
        self.version += 1
        metrics.update(run.groups.push(self.version))
        metrics.update({k: v for k, v in meta.items() if k.startswith("timing/")})
        return steps.finish(run, batch, metrics, start)

    # ----------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The driver's part (JSON): the trainer's version and the prompts in flight."""
        return {"version": self.version, "prompts": [e.indices for e in self.queue]}

    def save(self, folder: Path) -> None:
        """The batches in flight, into ``folder``'s ``IN_FLIGHT`` (tensors, lists of numbers and
        strings: loaded weights_only). The prompt items are not stored: their indices are."""
        data = [{"tensors": e.batch.tensors,
                 "lists": {k: v for k, v in e.batch.lists.items() if k != "item"}}
                for e in self.queue]
        buffer = io.BytesIO()
        torch.save(data, buffer)
        with writing(folder / IN_FLIGHT):
            (folder / IN_FLIGHT).write_bytes(buffer.getvalue())

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        """Restore what ``save`` and ``state_dict`` wrote."""
        try:
            data = torch.load(folder / IN_FLIGHT, weights_only=True)
            prompts = state["in_flight"]["prompts"]
            self.queue = []
            for indices, part in zip(prompts, data, strict=True):
                lists = dict(part["lists"])
                lists["item"] = [self.items[indices[g]] for g in lists["group"]]
                self.queue.append(InFlight(list(indices), Batch(part["tensors"], lists)))
            self.version = int(state["in_flight"]["version"])
        except Exception as e:  # noqa: BLE001 - whatever the files hold, the answer is the same
            raise ConfigError("resume", f"{folder}: its batches in flight cannot be read "
                              f"({type(e).__name__}: {e}); the checkpoint was saved by a run of "
                              "another rollout.mode, or is damaged") from None


def staleness(versions: torch.Tensor, trainer: int, bound: int) -> dict[str, float]:
    """``rollout/staleness_*`` of a batch whose samples were drawn with weights of
    ``versions`` (per sample), trained on by weights of version ``trainer``: mean, max, the
    fraction at each staleness 0..``bound``, the version itself, and the samples dropped as
    older than ``bound`` (none: the schedule never makes one)."""
    stale = trainer - versions
    out = {"rollout/staleness_mean": stale.float().mean().item(),
           "rollout/staleness_max": float(stale.max()),
           "rollout/weight_version": versions.float().mean().item(),
           "rollout/dropped": float((stale > bound).sum())}
    out.update({f"rollout/staleness_{k}_frac": (stale == k).float().mean().item()
                for k in range(bound + 1)})
    return out
