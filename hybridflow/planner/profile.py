"""How close this machine's passes of one model come to the cost model's floors: the efficiencies
``hybridflow calibrate --config CONFIG`` measures and the cost model divides its floors by.

The floors (``hybridflow.planner.cost``) assume every matmul at the rate of one large square
product and every decode step at the copy bandwidth. Real passes are slower, by a factor that
depends on the model's shapes (many small matmuls, the attention, the vocabulary's softmax), on
the micro-batch size (a GPU's matmuls of a few thousand tokens run far below its peak) and on the
host's work per micro-batch (Python, kernel launches, the schedule). They are measured here, at
the config's actor tp (spawned ranks, one thread each on CPU, as each worker runs; tp = 1 on a
GPU node with fewer devices) and pp = dp = 1, with the config's model, dtype and sequence length
and random tokens, the output layer over the response's columns as in an RL batch (a
``response_mask`` on the last ``max_tokens`` columns). At tp > 1 the times include what a TP rank
adds per micro-batch (the all-reduces of every layer, the waits for its peers), which a
one-process profile never sees; the cost model uses such a profile for that tp only, in place of
its TP communication term:

* for each micro-batch size b the planner may choose (``MICRO_BATCHES`` up to the step's samples,
  and the configured sizes), a forward-only pass (the engine's ``compute_logprobs``) and a
  training step (``train_step``) over one micro-batch of b sequences and over two: the
  difference is one micro-batch's seconds T(b), host work included, and the efficiency at b is
  the floor's seconds for b sequences (1/tp of their FLOPs on each rank) over T(b) (a training
  micro-batch's floor being three forwards, and the layers' forward once more with
  ``actor.engine.recompute``: ``cost.train_flops``);
* what remains of a pass of one micro-batch, t(b) - T(b), is what a pass costs however many
  micro-batches it has: the call's setup, the batch's copy to the device, the schedule's start,
  the outputs put back in order and off the device, the metrics' reduction. For a forward-only
  pass it is ``forward_fixed_s``; for a training step the optimizer's step is timed on its own
  (``TrainEngine._step_if_finite`` on the gradients a step left: grad norm, clipping, Adam) and
  is taken out: the optimizer's efficiency is Adam's floor (28 bytes per parameter at the copy
  bandwidth) over it, the rest is ``train_fixed_s``. Each is the median over the sizes: the
  part does not depend on b (per-row work is in T(b)), and a difference of two timings is
  noisy where the pass is short;
* one ``generate`` call of the config's rollout backend over one generation replica's share of
  the step's samples, every response the full ``max_tokens`` long (EOS ignored), after one
  warm-up call: the efficiency is the cost model's generation floor for that share over the
  measured seconds (prefill, sampling and host work included);
* the backend's ``load_from_switch`` of the whole model (what the switch hands it at generation
  tp = 1): the weights' bytes at the copy bandwidth over the measured seconds.

With ``actor.lora`` on, the engine is the actor's: the base frozen, the adapters on every targeted
linear. The floors are then LoRA's (``cost.forward_flops`` and ``cost.train_flops`` with the
adapters; Adam over the adapters alone), and the profile is kept under the adapters' rank and
targets (``lora``): a LoRA micro-batch does less arithmetic per token than full fine-tuning's
(no weight gradient of the base) but as much host work, so its efficiency is lower where the host
bounds it, which the full fine-tuning profile does not show.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from typing import Any

from hybridflow.errors import ConfigError
from hybridflow.models.config import ModelConfig
from hybridflow.parallel.layout import GenLayout, TrainLayout
from hybridflow.planner.timing import timed_median
from hybridflow.planner.rates import PassProfile, lora_key


def profile_passes(cfg: Any, calib, quick: bool = False, configured_only: bool = False
                   ) -> PassProfile:
    """Measure the passes of ``cfg``'s actor model (an RLConfig) in local processes, at its actor
    tp (see the module docstring); ``calib`` (this machine's rates, measured first) gives the
    floors. ``quick``: one repeat each.
    ``configured_only``: only the config's micro-batch sizes (``micro_batch_sizes``), not the
    search's whole ladder: minutes for a real model on a CPU instead of a quarter of an hour; the
    cost model then reads the nearest measured size's efficiency for the others."""
    # deferred: these import torch
    from hybridflow.config.sources import model_sources
    from hybridflow.parallel.spawn import spawn
    checkpoints, shapes = model_sources(cfg)
    # An unknown or missing backend fails here, before the spawn.
    if not cfg.rollout.backend_class.builds_from_shape and checkpoints["model"] is None:
        raise ConfigError("model", f"{cfg.model} is a shape preset without weights, which the "
                                   f"{cfg.rollout.backend} backend needs to start; profile it "
                                   "with rollout.backend=megatron or name a checkpoint")
    from hybridflow.workers.group import quiet_engines_env  # deferred: it imports torch
    # The child inherits the environment at its start: torch reads its log level at import.
    saved = dict(os.environ)
    os.environ.update(quiet_engines_env())
    import torch  # deferred: torch
    on_gpu = torch.cuda.is_available()
    tp = cfg.actor.layout.tp
    if on_gpu and tp > torch.cuda.device_count():
        tp = 1  # one rank per GPU: the cost model reads this profile with its TP term
    repeats = 1 if quick else 3
    try:
        # NCCL on GPU: Megatron's gradient all-reduce (one rank, but still a collective) runs on
        # device tensors, which gloo does not take.
        backend = "nccl" if on_gpu else "gloo"
        times = spawn(_measure_passes, tp, cfg, shapes["model"],
                      micro_batch_sizes(cfg, configured_only), repeats, timeout=3600,
                      backend=backend)[0]
        times["generate"], times["weight_load"] = spawn(
            _measure_generate, 1, cfg, shapes["model"], checkpoints["model"], repeats,
            timeout=3600, backend=backend)[0]
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return efficiencies(cfg, shapes["model"], calib, times, tp)


def efficiencies(cfg: Any, shape: ModelConfig, calib, times: dict, tp: int = 1) -> PassProfile:
    """A PassProfile from the seconds measured at ``tp``: ``times[kind][b]`` = (one micro-batch
    of b sequences, two), ``times["optimizer"]`` (the optimizer's step alone),
    ``times["generate"]``, ``times["weight_load"]`` (module docstring)."""
    # deferred: these import torch
    from hybridflow.planner.memory import param_count
    from hybridflow.planner.cost import (ADAM_BYTES, forward_flops, generation_floor,
                                         train_flops, weights_bytes)
    from hybridflow.training.lora import lora_param_counts
    rate = calib.matmul_flops[cfg.actor.engine.dtype]
    response = cfg.rollout.sampling.max_tokens
    seq = cfg.data.max_prompt_tokens + response
    adapters = lora_param_counts(shape, cfg.actor.lora)[1] if cfg.actor.lora.enabled else None
    # one sequence's passes, per TP rank; the output layer over the response, and the layers'
    # forward again where the engine measured recomputes them, as measured
    floors = {"forward": forward_flops(shape, "lm", seq, adapters=adapters, response=response),
              "train": train_flops(shape, "lm", seq, adapters=adapters, response=response,
                                   recompute=cfg.actor.engine.recompute)}
    floors = {kind: flops / (tp * rate) for kind, flops in floors.items()}
    sizes = sorted(times["forward"])
    out, fixed = {}, {}
    for kind, other in (("forward", 0.0), ("train", times["optimizer"])):
        out[kind], rest = [], []
        for b in sizes:
            one, two = times[kind][b]
            per_micro_batch = max(two - one, 1e-9)
            out[kind].append(min(1.0, floors[kind] * b / per_micro_batch))
            rest.append(one - per_micro_batch - other)
        fixed[f"{kind}_fixed_s"] = max(0.0, statistics.median(rest))
    trained = param_count(shape) if adapters is None else adapters
    adam = ADAM_BYTES * trained / (tp * calib.memory_bandwidth)
    gen = sum(generation_floor(shape, cfg.actor.engine.dtype, calib, _share(cfg),
                               cfg.data.max_prompt_tokens, cfg.rollout.sampling.max_tokens,
                               tg=1).values())
    load = weights_bytes(shape, cfg.actor.engine.dtype, tg=1) / calib.memory_bandwidth
    return PassProfile(shape=dataclasses.asdict(shape), dtype=cfg.actor.engine.dtype, seq=seq,
                       micro_batches=sizes, backend=cfg.rollout.backend,
                       optimizer=min(1.0, adam / max(times["optimizer"], 1e-9)),
                       generate=min(1.0, gen / times["generate"]),
                       weight_load=load / max(times["weight_load"], 1e-9), tp=tp,
                       lora=lora_key(cfg.actor.lora), **out, **fixed)


def micro_batch_sizes(cfg: Any, configured_only: bool = False) -> list[int]:
    """The sizes to measure: the search's candidates (unless ``configured_only``) and the
    configured ones (a token budget's as the cost model counts it), up to the step's samples."""
    # deferred: these import torch
    from hybridflow.planner.search import MICRO_BATCHES
    from hybridflow.planner.cost import micro_batch_rows
    samples = cfg.train_batch_size * cfg.rollout.sampling.n
    e = cfg.actor.engine
    seq = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_tokens
    search = () if configured_only else MICRO_BATCHES
    configured = {micro_batch_rows(e, seq, forward) for forward in (False, True)}
    return sorted({b for b in (*search, *configured) if b <= samples})


def _share(cfg: Any) -> int:
    """One generation replica's share of the step's samples at the configured layout."""
    gen = GenLayout(train=cfg.actor.layout, tp=cfg.rollout.tp)
    return math.ceil(cfg.train_batch_size * cfg.rollout.sampling.n / gen.replicas)


def _measure_passes(rank: int, world_size: int, cfg: Any, shape: ModelConfig, sizes: list[int],
                    repeats: int) -> dict:
    """Median seconds of each pass (as ``efficiencies`` reads them) at each micro-batch size of
    ``sizes``, and of the optimizer's step alone, at tp = the world size (every rank the same
    tokens)."""
    # deferred: torch
    import torch

    from hybridflow.training.engine import TrainEngine

    torch.manual_seed(0)
    seq = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_tokens
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def batch(n: int) -> dict[str, torch.Tensor]:
        # An RL batch's shape: the response's last max_tokens columns, where the output layer
        # runs (the cost model's floor counts it there too).
        ids = torch.randint(0, shape.vocab_size, (n, seq))
        response = torch.zeros(n, seq)
        response[:, cfg.data.max_prompt_tokens:] = 1
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "response_mask": response, "mask": response}

    def loss_fn(logprobs, mb):
        return -(logprobs * mb["mask"]).sum() / mb["mask"].numel(), {}

    def median(fn) -> float:  # warmed up once, below
        return timed_median(fn, sync, warmup=0, repeats=repeats, inner=1)

    engine = TrainEngine(shape, TrainLayout(tp=world_size), cfg.actor.engine, head="lm",
                         lora=cfg.actor.lora)  # rank 0: full fine-tuning

    def optimizer_step():
        # The step train_step ends with, on the gradients the last one left (kept until the next
        # train_step zeroes them); on non-finite ones it would be skipped, not timed.
        if not engine._step_if_finite()[1]:
            raise RuntimeError("the optimizer step found non-finite gradients and was skipped")

    times: dict = {"forward": {}, "train": {}}
    for k, b in enumerate(sizes):
        # Both kinds of pass split by micro_batch_size here, forward_micro_batch_size and a
        # token budget unset (all sequences are full-length: a budget would pack b of them).
        engine.config = dataclasses.replace(cfg.actor.engine, micro_batch_size=b,
                                            forward_micro_batch_size=None,
                                            max_tokens_per_micro_batch=None)
        if k == 0:  # the first calls allocate and compile
            engine.compute_logprobs(batch(b))
            engine.train_step(batch(b), loss_fn)
            engine._step_if_finite()
            times["optimizer"] = median(optimizer_step)
        one, two = batch(b), batch(2 * b)
        times["forward"][b] = (median(lambda: engine.compute_logprobs(one)),
                               median(lambda: engine.compute_logprobs(two)))
        times["train"][b] = (median(lambda: engine.train_step(one, loss_fn)),
                             median(lambda: engine.train_step(two, loss_fn)))
    return times


def _measure_generate(rank: int, world_size: int, cfg: Any, shape: ModelConfig, model_dir,
                      repeats: int) -> tuple[float, float]:
    """Median seconds of the rollout backend's ``generate`` over one replica's share, and of its
    ``load_from_switch`` of the whole model, in a one-rank group."""
    # deferred: torch
    import torch

    from hybridflow.rollout.base import RolloutSetup, SamplingConfig
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    r = cfg.rollout
    backend = r.backend_class
    rollout = backend.build(RolloutSetup(
        model_dir=model_dir, shape=shape, dtype=cfg.actor.engine.dtype,
        max_model_len=cfg.data.max_prompt_tokens + r.sampling.max_tokens, seed=0,
        kv_cache_mb=r.kv_cache_mb))
    if model_dir is None:  # a shape preset: random weights time the same
        rollout.load_generation_weights({n: torch.randn_like(p) * 0.02
                                         for n, p in rollout.params.items()})
    share = _share(cfg)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, shape.vocab_size, (share, cfg.data.max_prompt_tokens),
                            generator=g).tolist()
    sampling = SamplingConfig(temperature=1.0, max_tokens=r.sampling.max_tokens, n=1,
                              ignore_eos=True, seed=0)
    rollout.wake()
    generate = timed_median(lambda: rollout.generate(prompts, sampling), sync, warmup=1,
                            repeats=repeats, inner=1)
    # What the switch hands the rollout at generation tp = 1: every tensor, whole.
    from hybridflow.hybrid_engine.switch import generation_metas
    from hybridflow.models.params import DTYPES, llama_param_metas
    metas = generation_metas(llama_param_metas(shape), shape.tie_embeddings,
                             GenLayout(train=TrainLayout(), tp=1))
    tensors = {m.name: torch.zeros(m.shape, dtype=DTYPES[cfg.actor.engine.dtype],
                                      device=device) for m in metas}
    load = timed_median(lambda: rollout.load_from_switch(tensors), sync, warmup=1,
                        repeats=repeats, inner=1)
    rollout.close()
    return generate, load
