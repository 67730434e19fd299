"""Generation ahead of training (``rollout.mode`` one_step_off and async): the steps of a run
whose generation pool is its own.

With K = ``rollout.staleness`` (one_step_off: 1; async: ``rollout.max_staleness``) the pipeline
holds the K generated batches next in line. Step k (1-based) trains on batch k while the
generation pool generates batch k+K with the weights it holds, those of update k-1; after both,
the trainer pushes the weights of update k to it (``Groups.push``, verified). So batch j is
generated with the weights of update max(0, j-1-K) and trained on after j-1 updates: its
staleness is min(j-1, K), fixed by the schedule, never more than K, so no sample is ever dropped
(``rollout/dropped`` is 0 by construction: no response outlives the weights that started it).
The first step first fills the pipeline with batches 1..K, all from the initial
weights.

With partial rollouts (``rollout.partial``, ``driver/partial.py``) the pool runs one batch ahead
and each round continues the responses the previous one left unfinished, under the weights pushed
since: the staleness of a token is then the trainer's version minus the version it was sampled
with (``token_version``), at most K; groups that would exceed it are dropped and counted.

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
from hybridflow.driver.groups import GEN
from hybridflow.driver.partial import Group, PartialRollouts
from hybridflow.errors import ConfigError
from hybridflow.rollout.base import RolloutOutput
from hybridflow.workers.updates import pack_rollout

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
        r = run.config.rollout
        self.ahead, self.bound = r.ahead, r.staleness
        self.queue: list[InFlight] = []
        self.version = 0
        self.partial = PartialRollouts(run.config.train_batch_size, r.sampling.n, r.chunk_tokens,
                                       r.sampling.max_tokens, r.staleness) if r.partial else None

    def start(self, version: int) -> None:
        """Before the first step of this process: the trainer's weights (``version``: the step
        the run stands at) pushed to the generation pool, which then holds them."""
        self.version = version
        self.run.groups.push(version)

    def _generate(self, trained_at: int) -> tuple[InFlight, dict[str, Any]]:
        """The next batch, generated on the generation pool to be trained on by the weights of
        version ``trained_at``; its timings (and partial rollouts' counts) apart."""
        if self.partial is not None:
            return self._round(trained_at)
        indices = next(self.sampler)
        batch = steps.generate(self.run, [self.items[i] for i in indices])
        meta, batch.meta = {**batch.meta, "rollout/dropped": 0.0}, {}
        return InFlight(indices, batch), meta

    def _round(self, trained_at: int) -> tuple[InFlight, dict[str, Any]]:
        """A round of partial rollouts (``PartialRollouts.round``), its groups packed as a
        generated batch, with every token's ``token_version``."""
        run, meta = self.run, {"timing/generate_s": 0.0}
        replicas = run.groups.rollout.group.data_parallel_size(GEN)

        def extend(prefixes: list[list[int]], budgets: list[int]) -> list:
            pad = -len(prefixes) % replicas  # every replica an equal share: repeat the last
            out = run.groups.rollout.extend(Batch(lists={
                "prompt_ids": prefixes + prefixes[-1:] * pad,
                "max_tokens": budgets + budgets[-1:] * pad}))
            meta["timing/generate_s"] += out.meta["timing/generate_s"]
            rows = zip(out["response_ids"], out["logprobs"], out["stopped"],
                       out["weight_version"].tolist())
            return list(rows)[:len(prefixes)]

        groups, counts = self.partial.round(
            trained_at, lambda i: list(self.items[i].prompt_ids), lambda: next(self.sampler),
            extend)
        meta.update(counts)
        return InFlight([g.prompt for g in groups], self._pack(groups)), meta

    def _pack(self, groups: list[Group]) -> Batch:
        """Finished ``groups`` as the rows a generate call makes (``pack_rollout``), with each
        sample's ``weight_version`` (of its first token) and each token's ``token_version``."""
        cfg = self.run.config
        prompts = steps.prompt_batch([self.items[g.prompt] for g in groups])
        responses = [r for g in groups for r in g.responses]
        outputs = [RolloutOutput(prompt_index=k, sample_index=j,
                                 prompt_token_ids=prompts["prompt_ids"][k],
                                 response_token_ids=r.ids, logprobs=r.logprobs,
                                 finish_reason=r.finish)
                   for k, g in enumerate(groups) for j, r in enumerate(g.responses)]
        batch = pack_rollout(outputs, prompts, cfg.pad_token_id,
                             cfg.data.max_prompt_tokens, cfg.rollout.sampling.max_tokens)
        width = cfg.data.max_prompt_tokens
        versions = torch.zeros_like(batch["input_ids"])
        for b, r in enumerate(responses):
            versions[b, width:width + len(r.versions)] = torch.tensor(r.versions)
        batch.tensors["token_version"] = versions
        batch.tensors["weight_version"] = torch.tensor([r.versions[0] for r in responses])
        return steps.with_text(self.run, batch)

    def iteration(self) -> dict[str, float]:
        """One step: the oldest batch in flight trained on while the next is generated, then the
        weights pushed; its metrics."""
        run, start = self.run, time.perf_counter()
        while len(self.queue) < self.ahead:  # the first step fills the pipeline
            self.queue.append(self._generate(self.version + len(self.queue))[0])
        entry = self.queue.pop(0)
        versions = token_versions(entry.batch)
        entry.batch.tensors["staleness"] = self.version - versions
        metrics: dict[str, float] = {}
        results = at_once([
            Call("train", DRIVER, lambda: steps.train(run, entry.batch, metrics)),
            Call("generate", run.groups.rollout.pool,
                 lambda: self._generate(self.version + self.ahead))])
        batch = results["train"]
        following, meta = results["generate"]
        self.queue.append(following)
        metrics.update(staleness(versions, batch["response_mask"], self.version, self.bound))
        self.version += 1
        metrics.update(run.groups.push(self.version))
        metrics.update({k: v for k, v in meta.items() if k.startswith(("timing/", "rollout/"))})
        return steps.finish(run, batch, metrics, start)

    # ----------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The driver's part (JSON): the trainer's version and the prompts in flight."""
        return {"version": self.version, "prompts": [e.indices for e in self.queue]}

    def save(self, folder: Path) -> None:
        """The batches in flight, into ``folder``'s ``IN_FLIGHT`` (tensors, lists of numbers and
        strings: loaded weights_only). The prompt items are not stored: their indices are."""
        data = {"batches": [{"tensors": e.batch.tensors,
                             "lists": {k: v for k, v in e.batch.lists.items() if k != "item"}}
                            for e in self.queue],
                "partial": self.partial.state_dict() if self.partial is not None else None}
        buffer = io.BytesIO()
        torch.save(data, buffer)
        with writing(folder / IN_FLIGHT):
            (folder / IN_FLIGHT).write_bytes(buffer.getvalue())

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        """Restore what ``save`` and ``state_dict`` wrote."""
        try:
            data = torch.load(folder / IN_FLIGHT, weights_only=True)
            if isinstance(data, list):  # written before partial rollouts (2026-12-06)
                data = {"batches": data, "partial": None}
            if (data["partial"] is None) != (self.partial is None):
                raise ValueError("saved with rollout.partial="
                                 f"{str(data['partial'] is not None).lower()}")
            if self.partial is not None:
                self.partial.load_state_dict(data["partial"])
            prompts = state["in_flight"]["prompts"]
            self.queue = []
            for indices, part in zip(prompts, data["batches"], strict=True):
                lists = dict(part["lists"])
                lists["item"] = [self.items[indices[g]] for g in lists["group"]]
                self.queue.append(InFlight(list(indices), Batch(part["tensors"], lists)))
            self.version = int(state["in_flight"]["version"])
        except Exception as e:  # noqa: BLE001 - whatever the files hold, the answer is the same
            raise ConfigError("resume", f"{folder}: its batches in flight cannot be read "
                              f"({type(e).__name__}: {e}); the checkpoint was saved by a run of "
                              "another rollout.mode, or is damaged") from None


def token_versions(batch: Batch) -> torch.Tensor:
    """[B, T] the weight version each token was sampled with: ``token_version`` where partial
    rollouts made the batch, else each sample's ``weight_version`` on all its positions."""
    if "token_version" in batch:
        return batch["token_version"]
    return batch["weight_version"][:, None].expand_as(batch["input_ids"])


def staleness(versions: torch.Tensor, mask: torch.Tensor, trainer: int, bound: int
              ) -> dict[str, float]:
    """``rollout/staleness_*`` of a batch whose response tokens (``mask``) were sampled with
    weights of ``versions`` [B, T], trained on by weights of version ``trainer``, over its
    tokens: mean, max, the fraction at each staleness 0..``bound``, and the mean version."""
    keep = mask.bool()
    stale = (trainer - versions)[keep]
    out = {"rollout/staleness_mean": stale.float().mean().item(),
           "rollout/staleness_max": float(stale.max()),
           "rollout/weight_version": versions[keep].float().mean().item()}
    out.update({f"rollout/staleness_{k}_frac": (stale == k).float().mean().item()
                for k in range(bound + 1)})
    return out
