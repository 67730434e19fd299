"""The actor's worker, one Ray actor per rank: ``ActorRolloutRefWorker`` colocates the actor
(Megatron training engine), its rollout engine and the reference model in the same processes; the
3D-HybridEngine moves the actor's weights from the training layout into the rollout engine for
each generation and gives the memory back after."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from hybridflow.algorithms import ActorObjective, actor_loss_fn, prepare_rollout_correction
from hybridflow.batch import Batch
from hybridflow.hybrid_engine import push
from hybridflow.hybrid_engine.verify import verified
from hybridflow.hybrid_engine.switch import HybridEngine
from hybridflow.models.hf import load_hf_config
from hybridflow.models.params import DTYPES, llama_param_metas
from hybridflow.parallel.groups import generation_process_groups
from hybridflow.parallel.layout import GenLayout
from hybridflow.rollout.base import RolloutSetup, call_seed
from hybridflow.rollout.multi_turn import Tools
from hybridflow.training.engine import TrainEngine
from hybridflow.training.loading import load_hf_into_engine
from hybridflow.training.megatron_ckpt import load_train_state, save_train_state
from hybridflow.training.micro_batches import to_batch_order
from hybridflow.workers.group import Rendezvous, Worker, node_address
from hybridflow.workers.updates import (engine_batch, load_rank_state, logprob_batch,
                                       pack_rollout, ppo_updates, reference_log_probs,
                                       save_rank_state, train_view)


class ActorRolloutRefWorker(Worker):
    """Actor + rollout + reference on one rank. It receives its roles' configs only (the
    ``actor``, ``rollout``, ``ref``, ``hybrid_engine`` and ``weight_sync`` sections of the run
    config) and the
    run-wide values it needs: the sampling ``seed``, ``pad_token_id`` and the prompt width
    ``max_prompt_tokens``. ``with_ref=False``: the reference lives in a group of its own
    (``ReferenceWorker``), and this one holds none. ``generates=False``: a generation pool of
    its own generates (``rollout.mode`` one_step_off, async): this one holds no rollout engine
    and no switch, and pushes its weights there instead (``push_weights``)."""

    def __init__(self, rank: int, world_size: int, rendezvous: Rendezvous, *, actor, rollout, ref,
                 hybrid_engine, weight_sync, model_dir: str, seed: int, pad_token_id: int,
                 max_prompt_tokens: int, with_ref: bool = True, generates: bool = True):
        super().__init__(rank, world_size, rendezvous)
        self.actor_cfg, self.rollout_cfg = actor, rollout
        self.model_dir, self.seed, self.pad_token_id = model_dir, seed, pad_token_id
        self.max_prompt_tokens = max_prompt_tokens
        self.model_config = load_hf_config(model_dir)
        # The reference is always somewhere: its KL to the actor is logged every step. With LoRA
        # it is the actor's frozen base with the adapters off. Built first: a streamed one has
        # left the device before the actor arrives (the two whole never share it).
        self.ref = None
        if not actor.lora.enabled and with_ref:
            self.ref = TrainEngine(self.model_config, actor.layout, actor.engine,
                                   build_optimizer=False)
            load_hf_into_engine(self.ref, model_dir)
            if ref.offload:
                self.ref.stream_weights()
        self.actor = TrainEngine(self.model_config, actor.layout, actor.engine, lora=actor.lora)
        load_hf_into_engine(self.actor, model_dir)
        self.dp_group = self.actor.pg.dp
        self.weight_sync = weight_sync
        self._push, self._pushes = None, 0  # the push group (made at the first push), pushes
        self.rollout = self.hybrid = None
        if not generates:
            return
        self.gen = GenLayout(train=actor.layout, tp=rollout.tp)
        self.rollout = self._make_rollout()
        self.tools = Tools.build(rollout.multi_turn, model_dir)
        self.hybrid = HybridEngine(self.actor, gen_tp=rollout.tp, bucket_mb=rollout.bucket_mb,
                                   mode=hybrid_engine.mode,
                                   offload_optimizer=hybrid_engine.offload_optimizer,
                                   resident=hybrid_engine.resident_for(actor, rollout),
                                   blocks=self.rollout.takes_stacked,
                                   lora_merge=hybrid_engine.lora_merge,
                                   verify=weight_sync.verify)

    def _make_rollout(self):
        r = self.rollout_cfg
        backend = r.backend_class
        # One seed per generation replica (the ranks of its TP group must sample alike), mixed
        # with the run's seed so that runs and replicas never share a stream.
        seed = call_seed(self.seed, self.gen.coords(self.rank)[0])
        # A backend with generation TP gets its groups; its weights arrive from the switch, so
        # one that builds from the shape need not load the checkpoint's.
        tp_groups = backend.max_tp != 1
        return backend.build(RolloutSetup(
            model_dir=self.model_dir, shape=self.model_config,
            dtype=self.actor_cfg.engine.dtype,
            max_model_len=self.max_prompt_tokens + r.sampling.max_tokens, seed=seed,
            load_weights=not backend.builds_from_shape, kv_cache_mb=r.kv_cache_mb,
            keep_cache=r.keep_cache,
            pg_collection=generation_process_groups(self.gen) if tp_groups else None,
            cpu_core=self.rank % (os.cpu_count() or 1)))

    def dispatch_info(self, view: str) -> tuple[int, bool]:
        if view == "gen":
            gen = self.hybrid.gen
            return self.hybrid.replica, (self.hybrid.gen_tp_rank == 0
                                         and self.hybrid.gen_pp_rank == gen.pp - 1)
        return train_view(self.actor_cfg.layout, self.rank)

    def describe(self) -> str:
        if self.hybrid is None:
            return ("actor: generation on a pool of its own (rollout.mode="
                    f"{self.rollout_cfg.mode}); the weights pushed to it after every update")
        return self.hybrid.summary

    # ----------------------------------------------------------------------------- generation
    def generate(self, batch: Batch, sampling=None) -> Batch:
        """Switch to the generation layout, sample ``sampling.n`` responses per prompt of this
        replica's share, switch back. Returns left-padded prompts + right-padded responses."""
        sampling = sampling or self.rollout_cfg.sampling
        start = time.perf_counter()
        weights = self.hybrid.to_generation()
        try:
            self.rollout.load_from_switch(weights.tensors)
            self.rollout.wake()
            loaded = time.perf_counter()
            captured = self.rollout.capture_seconds
            outputs = (self.tools.generate(self.rollout, batch["prompt_ids"], sampling)
                       if self.tools else self.rollout.generate(batch["prompt_ids"], sampling))
            captured = self.rollout.capture_seconds - captured
            generated = time.perf_counter()
            # the allocator's peak since the switch released the training state (to_generation)
            memory = ({"memory/generation_peak_gib": torch.cuda.max_memory_allocated() / 2**30}
                      if torch.cuda.is_available() else {})
            self.rollout.sleep()
            slept = time.perf_counter()
        finally:
            # Whatever happened, back to a training engine: a LoRA base merged in place is
            # written back, so a checkpoint saved after a failed generation holds the base.
            self.hybrid.to_training()
        out = pack_rollout(outputs, batch, self.pad_token_id, self.max_prompt_tokens,
                           sampling.max_tokens, with_tools=bool(self.tools))
        out.meta.update({
            "timing/reshard_s": weights.seconds, "timing/weight_load_s": loaded - start
            - weights.seconds - weights.verify_seconds, "timing/generate_s": generated - loaded,
            # its check (0 where weight_sync.verify skipped it); the bytes: reshard/bytes_received
            "weight_sync/verify_s": weights.verify_seconds,
            "timing/graph_capture_s": captured,  # inside generate_s
            "timing/rollout_sleep_s": slept - generated,
            "timing/back_to_train_s": time.perf_counter() - slept,
            "reshard/bytes_received": weights.bytes_received,
            "reshard/naive_bytes": weights.naive_bytes,
            # own training shards the generation weights hold a second copy of (0: resident)
            "reshard/redundant_bytes": weights.redundant_bytes, **memory})
        return out

    # ----------------------------------------------------------------------------- scoring
    def compute_log_prob(self, batch: Batch) -> Batch:
        return Batch({"old_logprobs": self.actor.compute_logprobs(logprob_batch(batch))})

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        if self.ref is None:
            with self.actor.adapters.disabled():
                return Batch({"ref_logprobs": self.actor.compute_logprobs(logprob_batch(batch))})
        return reference_log_probs(self.ref, batch)

    # ----------------------------------------------------------------------------- update
    def update_actor(self, batch: Batch) -> Batch:
        """PPO epochs over mini-batches of this DP rank's share; metrics averaged."""
        a, rc = self.actor_cfg, self.actor_cfg.rollout_correction
        # Without old log-probs the update is on-policy (RLConfig.old_logprobs_from_update): the
        # training forward's own, detached, are the old ones, and come back with the metrics.
        on_policy = "old_logprobs" not in batch
        if on_policy and (a.ppo_epochs * a.mini_batches != 1 or rc.mode != "none"):
            raise ValueError("update_actor needs old_logprobs unless it makes one on-policy "
                             "update (ppo_epochs = mini_batches = 1, no rollout correction)")
        keys = ["advantages", "response_mask"] + ([] if on_policy else ["old_logprobs"])
        if a.kl_loss_coef:
            keys.append("ref_logprobs")
        data, correction = engine_batch(batch, *keys), {}
        if rc.mode != "none":
            data, correction = prepare_rollout_correction(data, batch["rollout_logprobs"], rc)
        objective = ActorObjective.of(a)
        seen = [] if on_policy else None  # each micro-batch's log-probs and the micro-batch
        out = ppo_updates(self.actor, data, a, a.loss_agg_mode, self.dp_group,
                          lambda denom: actor_loss_fn(objective, denom, seen),
                          "actor", loss_key="actor/loss", with_entropy=a.entropy_coef > 0)
        out.meta.update({k: v.item() for k, v in correction.items()})
        if seen:  # the last pipeline stage; micro-batches may be reordered and cut (a token budget)
            out.tensors["old_logprobs"] = to_batch_order(seen).cpu()
        return out

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The actor's full (unsharded) weights by Megatron name, on every rank (LoRA adapters
        merged in)."""
        return self.actor.full_weights(merged=True)

    def push_address(self) -> tuple[str, int]:
        """This node's address and a free port on it: the push group's store, on a cluster."""
        return node_address()

    def push_weights(self, address: str, size: int, version: int) -> Batch:
        """Push the full weights (LoRA merged) as ``version`` to the generation pool's ranks
        (``hybrid_engine.push``: this rank 0 sends, ``size - 1`` receive; collective over the
        actor's ranks, which gather them). Meta: ``weight_sync/bytes`` (what each generation rank
        receives) and the sender's ``weight_sync/verify_s``."""
        full = self.actor.full_weights(merged=True)
        if self.rank != 0:
            return Batch()
        if self._push is None:
            self._push = push.push_group(address, 0, size, self.collective_timeout_s)
            self._plan = push.PushPlan.build(llama_param_metas(self.model_config),
                                             DTYPES[self.actor_cfg.engine.dtype], 1,
                                             self.rollout_cfg.bucket_mb)
        self._pushes += 1
        verify_s = push.send(self._push, self._plan, full, version,
                             verified(self.weight_sync.verify, self._pushes))
        return Batch(meta={"weight_sync/bytes": float(self._plan.nbytes),
                           "weight_sync/verify_s": verify_s})

    # ----------------------------------------------------------------------------- checkpoints
    def save_state(self, ckpt_dir: str) -> None:
        """Write the actor's weights and optimizer state and this rank's RNG and rollout state
        into ``ckpt_dir`` (collective). The reference is the unchanged initial model."""
        save_train_state(self.actor, Path(ckpt_dir) / "actor")
        save_rank_state(Path(ckpt_dir) / f"actor-rank{self.rank:04d}.pt", self.rollout)

    def load_state(self, ckpt_dir: str) -> None:
        load_train_state(self.actor, Path(ckpt_dir) / "actor")
        if self.hybrid is not None:
            self.hybrid.drop_base_copy()  # the LoRA base may differ from the one copied
        load_rank_state(Path(ckpt_dir) / f"actor-rank{self.rank:04d}.pt", self.rollout)
