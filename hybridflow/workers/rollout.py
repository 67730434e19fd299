"""The generation pool's worker (``rollout.mode`` one_step_off and async): one Ray actor per
rank, each a generation replica with its own copy of the weights, which the trainer pushes to it
after every update (``hybrid_engine.push``, verified as ``weight_sync.verify`` says)."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from hybridflow.batch import Batch
from hybridflow.hybrid_engine import push
from hybridflow.models.hf import load_hf_config
from hybridflow.models.params import DTYPES, llama_param_metas
from hybridflow.rollout.base import RolloutSetup, call_seed
from hybridflow.workers.group import Rendezvous, Worker
from hybridflow.workers.updates import load_rank_state, pack_rollout, save_rank_state


class RolloutWorker(Worker):
    """One generation replica (rollout.tp = 1): the run's rollout backend on the checkpoint's
    weights (version 0) until the first push. It receives the ``rollout`` section, the actor's
    engine ``dtype`` (the pushed tensors'), and the run-wide ``seed``, ``pad_token_id`` and
    ``max_prompt_tokens``. Its replica's sampling seed is the one the actor's replica of the same
    index has in sync mode."""

    def __init__(self, rank: int, world_size: int, rendezvous: Rendezvous, *, rollout,
                 dtype: str, model_dir: str, seed: int, pad_token_id: int,
                 max_prompt_tokens: int):
        super().__init__(rank, world_size, rendezvous)
        self.rollout_cfg, self.pad_token_id = rollout, pad_token_id
        self.max_prompt_tokens = max_prompt_tokens
        self.model_config = load_hf_config(model_dir)
        backend = rollout.backend_class
        self.rollout = backend.build(RolloutSetup(
            model_dir=model_dir, shape=self.model_config, dtype=dtype,
            max_model_len=max_prompt_tokens + rollout.sampling.max_tokens,
            seed=call_seed(seed, rank), load_weights=True, kv_cache_mb=rollout.kv_cache_mb,
            keep_cache=rollout.keep_cache, cpu_core=rank % (os.cpu_count() or 1)))
        self.plan = push.PushPlan.build(llama_param_metas(self.model_config), DTYPES[dtype], 1,
                                        rollout.bucket_mb)
        self._push = None  # the push group, made at the first push
        self.version = 0
        """The number of updates the weights it generates with have had."""

    def dispatch_info(self, view: str) -> tuple[int, bool]:
        return self.rank, True  # every rank a replica, whatever the view

    def generate(self, batch: Batch, sampling=None) -> Batch:
        """``sampling.n`` responses (default: the run's sampling) to each of this replica's
        prompts, packed as the actor's ``generate`` packs them, with ``weight_version``: the
        version of the weights each sample was drawn with."""
        sampling = sampling or self.rollout_cfg.sampling
        start = time.perf_counter()
        outputs = self.rollout.generate(batch["prompt_ids"], sampling)
        out = pack_rollout(outputs, batch, self.pad_token_id, self.max_prompt_tokens,
                           sampling.max_tokens)
        out.tensors["weight_version"] = torch.full((len(outputs),), self.version,
                                                   dtype=torch.int64)
        out.meta["timing/generate_s"] = time.perf_counter() - start
        return out

    def extend(self, batch: Batch) -> Batch:
        """One sample (of the run's sampling) continuing each of ``batch``'s ``prompt_ids`` (a
        prompt and the tokens of its response so far) by at most its ``max_tokens``
        (``driver.partial``): lists ``response_ids``, ``logprobs`` and ``stopped`` (it ended with
        a stop token), and ``weight_version``. One backend call per distinct ``max_tokens``, in
        the order of their first request."""
        sampling = replace(self.rollout_cfg.sampling, n=1)
        start = time.perf_counter()
        rows: list = [None] * len(batch)
        for budget in dict.fromkeys(batch["max_tokens"]):
            index = [i for i, m in enumerate(batch["max_tokens"]) if m == budget]
            outputs = self.rollout.generate([batch["prompt_ids"][i] for i in index],
                                            replace(sampling, max_tokens=budget))
            for i, o in zip(index, outputs):
                rows[i] = o
        out = Batch({"weight_version": torch.full((len(rows),), self.version,
                                                  dtype=torch.int64)},
                    {"response_ids": [o.response_token_ids for o in rows],
                     "logprobs": [o.logprobs for o in rows],
                     "stopped": [o.finish_reason == "stop" for o in rows]})
        out.meta["timing/generate_s"] = time.perf_counter() - start
        return out

    def receive_weights(self, address: str, size: int, version: int) -> Batch:
        """Take the trainer's push of ``version`` (``push.receive``; this rank is push rank
        ``rank + 1`` of ``size``), check it (``push.check``: fingerprints where the sender
        verified this push, the version always) and load it into the engine. Meta: the check's
        and the load's seconds."""
        if self._push is None:
            self._push = push.push_group(address, self.rank + 1, size, self.collective_timeout_s)
        received = push.receive(self._push, self.plan, 0)
        start = time.perf_counter()
        push.check(self.plan, received, 0, version)
        checked = time.perf_counter()
        self.rollout.load_from_switch(received.shards)
        self.version = version
        return Batch(meta={"weight_sync/verify_s": checked - start,
                           "timing/weight_load_s": time.perf_counter() - checked})

    def save_state(self, ckpt_dir: str) -> None:
        """This rank's RNG states and rollout call count (what decides its next draws)."""
        save_rank_state(Path(ckpt_dir) / f"rollout-rank{self.rank:04d}.pt", self.rollout)

    def load_state(self, ckpt_dir: str) -> None:
        load_rank_state(Path(ckpt_dir) / f"rollout-rank{self.rank:04d}.pt", self.rollout)
