"""How close this machine's passes of one model come to the cost model's floors: the efficiencies
``hybridflow calibrate --config CONFIG`` measures and the cost model divides its floors by.

The floors (``hybridflow.mapping.cost``) assume every matmul at the rate of one large square
product and every decode step at the copy bandwidth. Real passes are slower, by a factor that
depends on the model's shapes (many small matmuls, the attention, the vocabulary's softmax) and
on the host's work per micro-batch (Python, kernel launches, the schedule). Both are measured
here, in one process at tp = pp = dp = 1 (one thread on CPU, as each worker runs), with the
config's model, dtype and sequence length and random tokens:

* a forward-only pass (the engine's ``compute_logprobs``) and a training step (``train_step``)
  over m and 2m sequences in micro-batches of m, and over 2m sequences in one micro-batch of 2m
  (m the configured micro-batch size): with t(sequences, micro-batch) = micro-batches x c +
  sequences x r + u, t(2m, m) - t(2m, 2m) = c, the host cost per micro-batch, and
  t(2m, 2m) - t(m, m) = m r, the time per sequence. The efficiency is the floor's time per
  sequence over r; for the training step u, the optimizer's step, is what remains of t(m, m),
  and its efficiency Adam's floor (28 bytes per parameter at the copy bandwidth) over u;
* one ``generate`` call of the config's rollout backend over one generation replica's share of
  the step's samples, every response the full ``max_tokens`` long (EOS ignored), after one
  warm-up call: the efficiency is the cost model's generation floor for that share over the
  measured seconds (prefill, sampling and host work included);
* the backend's ``load_from_switch`` of the whole model (what the switch hands it at generation
  tp = 1): the weights' bytes at the copy bandwidth over the measured seconds.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from hybridflow.errors import ArgumentError, check_float, check_int
from hybridflow.models.config import ModelConfig


@dataclass(kw_only=True)
class PassProfile:
    """The measured efficiencies of one model's passes on this machine."""

    shape: dict[str, Any]
    """The model's ``ModelConfig`` fields: the cost model uses a profile for this shape only."""
    dtype: str
    """The engines' dtype it was measured in ("fp32", "bf16")."""
    seq: int
    """Tokens per sequence it was measured at (prompt + response)."""
    micro_batch: int
    """m above."""
    backend: str
    """The rollout backend whose ``generate`` was measured."""
    forward: float
    """Floor seconds per sequence of a forward pass / measured (0 < x, usually < 1)."""
    forward_micro_batch_s: float
    """Host seconds per forward micro-batch, c above (>= 0)."""
    train: float
    """The same for a training step's forward + backward."""
    train_micro_batch_s: float
    optimizer: float
    """Adam's floor / the optimizer step measured."""
    generate: float
    """The generation floor / the measured ``generate`` call."""
    weight_load: float
    """The weights' bytes at the copy bandwidth / the measured ``load_from_switch`` of the whole
    model (above 1 where the backend takes the tensors without a copy)."""

    def __post_init__(self):
        if not isinstance(self.shape, dict):
            raise ArgumentError("shape", f"must be a model shape's fields, got {self.shape!r}")
        check_int("seq", self.seq)
        check_int("micro_batch", self.micro_batch)
        for name in ("forward", "train", "optimizer", "generate", "weight_load"):
            check_float(name, getattr(self, name), low=0, low_open=True)
        for name in ("forward_micro_batch_s", "train_micro_batch_s"):
            check_float(name, getattr(self, name), low=0)

    def matches(self, shape: ModelConfig, dtype: str) -> bool:
        return self.shape == dataclasses.asdict(shape) and self.dtype == dtype

    def describe(self) -> str:
        return (f"efficiencies at tp=pp=dp=1, {self.seq} tokens per sequence, micro-batch "
                f"{self.micro_batch}: forward {self.forward:.1%} of the floor + "
                f"{self.forward_micro_batch_s * 1e3:.3g} ms per micro-batch, training "
                f"{self.train:.1%} + {self.train_micro_batch_s * 1e3:.3g} ms per micro-batch, "
                f"optimizer {self.optimizer:.1%}, generate ({self.backend}) {self.generate:.1%}, "
                f"weight load {self.weight_load:.1%}")


def profile_passes(cfg: Any, calib, quick: bool = False) -> PassProfile:
    """Measure the passes of ``cfg``'s actor model (an RLConfig) in one local process; ``calib``
    (this machine's rates, measured first) gives the floors. ``quick``: one repeat each."""
    from hybridflow.config.check import model_sources
    from hybridflow.parallel.spawn import spawn
    from hybridflow.rollout.base import rollout_backend
    checkpoints, shapes = model_sources(cfg)
    if cfg.rollout.backend != "megatron" and checkpoints["model"] is None:
        from hybridflow.errors import ConfigError
        raise ConfigError("model", f"{cfg.model} is a shape preset without weights, which the "
                                   f"{cfg.rollout.backend} backend needs to start; profile it "
                                   "with rollout.backend=megatron or name a checkpoint")
    rollout_backend(cfg.rollout.backend)  # an unknown or missing backend fails before the spawn
    from hybridflow.controller.worker_group import quiet_engines_env
    # The child inherits the environment at its start: torch reads its log level at import.
    saved = dict(os.environ)
    os.environ.update(quiet_engines_env())
    import torch
    try:
        # NCCL on GPU: Megatron's gradient all-reduce (one rank, but still a collective) runs on
        # device tensors, which gloo does not take.
        times = spawn(_measure, 1, cfg, shapes["model"], checkpoints["model"],
                      1 if quick else 3, timeout=3600,
                      backend="nccl" if torch.cuda.is_available() else "gloo")[0]
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return efficiencies(cfg, shapes["model"], calib, times)


def efficiencies(cfg: Any, shape: ModelConfig, calib, times: dict[str, float]) -> PassProfile:
    """A PassProfile from the seconds ``_measure`` took (the fit in the module docstring)."""
    from hybridflow.config.memory import param_count
    from hybridflow.mapping.cost import (ADAM_BYTES, forward_flops, generation_floor,
                                         weights_bytes)
    m = _micro_batch(cfg)
    rate = calib.matmul_flops[cfg.actor.engine.dtype]
    seq = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_tokens
    floor = forward_flops(shape, "lm", seq) / rate  # one sequence's forward
    out = {}
    for kind, flops in (("forward", 1), ("train", 3)):
        per_mb = max(0.0, times[f"{kind}_2m_m"] - times[f"{kind}_2m_2m"])
        per_seq = max(times[f"{kind}_2m_2m"] - times[f"{kind}_m_m"], 1e-9) / m
        out[kind] = min(1.0, flops * floor / per_seq)
        out[f"{kind}_micro_batch_s"] = per_mb
    optimizer = times["train_m_m"] - out["train_micro_batch_s"] - m * 3 * floor / out["train"]
    adam = ADAM_BYTES * param_count(shape) / calib.memory_bandwidth
    gen = sum(generation_floor(shape, cfg.actor.engine.dtype, calib, _share(cfg),
                               cfg.data.max_prompt_tokens, cfg.rollout.sampling.max_tokens,
                               tg=1).values())
    load = weights_bytes(shape, cfg.actor.engine.dtype, tg=1) / calib.memory_bandwidth
    return PassProfile(shape=dataclasses.asdict(shape), dtype=cfg.actor.engine.dtype, seq=seq,
                       micro_batch=m, backend=cfg.rollout.backend,
                       optimizer=min(1.0, adam / max(optimizer, 1e-9)),
                       generate=min(1.0, gen / times["generate"]),
                       weight_load=load / max(times["weight_load"], 1e-9), **out)


def _micro_batch(cfg: Any) -> int:
    return cfg.actor.engine.micro_batch_size


def _share(cfg: Any) -> int:
    """One generation replica's share of the step's samples at the configured layout."""
    import math

    from hybridflow.parallel.layout import GenLayout
    gen = GenLayout(train=cfg.actor.layout, tp=cfg.rollout.tp)
    return math.ceil(cfg.train_batch_size * cfg.rollout.sampling.n / gen.replicas)


def _measure(rank: int, world_size: int, cfg: Any, shape: ModelConfig, model_dir, repeats: int
             ) -> dict[str, float]:
    """Median seconds of each pass (names as ``efficiencies`` reads them), in a one-rank group."""
    import torch

    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.engine import TrainEngine

    torch.manual_seed(0)
    m = _micro_batch(cfg)
    seq = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_tokens
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    def batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, shape.vocab_size, (n, seq))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "mask": torch.ones(n, seq)}

    def loss_fn(logprobs, mb):
        return -(logprobs * mb["mask"]).sum() / mb["mask"].numel(), {}

    def median(fn) -> float:
        fn()  # warm-up
        samples = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    times = {}
    for per_mb, sizes in ((m, (m, 2 * m)), (2 * m, (2 * m,))):
        engine_cfg = dataclasses.replace(cfg.actor.engine, micro_batch_size=per_mb,
                                forward_micro_batch_size=per_mb)
        engine = TrainEngine(shape, TrainLayout(), engine_cfg, head="lm")
        for n in sizes:
            b, key = batch(n), f"{'m' if n == m else '2m'}_{'m' if per_mb == m else '2m'}"
            times[f"forward_{key}"] = median(lambda: engine.compute_logprobs(b))
            times[f"train_{key}"] = median(lambda: engine.train_step(b, loss_fn))
        del engine
        if on_gpu:
            torch.cuda.empty_cache()
    times["generate"], times["weight_load"] = _time_generate(cfg, shape, model_dir, device, sync,
                                                             repeats)
    return times


def _time_generate(cfg, shape, model_dir, device, sync, repeats: int) -> tuple[float, float]:
    """Median seconds of the rollout backend's ``generate`` over one replica's share, and of its
    ``load_from_switch`` of the whole model."""
    import torch

    from hybridflow.rollout.base import SamplingConfig, rollout_backend
    r = cfg.rollout
    backend = rollout_backend(r.backend)
    max_len = cfg.data.max_prompt_tokens + r.sampling.max_tokens
    dtype = cfg.actor.engine.dtype
    if r.backend == "megatron":
        from hybridflow.parallel.groups import single_replica_generation_groups
        rollout = backend(model_dir if model_dir is not None else shape, dtype=dtype,
                          max_model_len=max_len, seed=0,
                          pg_collection=single_replica_generation_groups())
        if model_dir is None:  # a shape preset: random weights time the same
            rollout.load_generation_weights({n: torch.randn_like(p) * 0.02
                                             for n, p in rollout.params.items()})
    else:
        kwargs = dict(dtype=dtype, max_model_len=max_len, seed=0)
        if r.backend == "vllm":
            kwargs["kv_cache_bytes"] = int(r.kv_cache_mb * 2**20)
            if device.type == "cpu":
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        rollout = backend(model_dir, **kwargs)
    share = _share(cfg)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, shape.vocab_size, (share, cfg.data.max_prompt_tokens),
                            generator=g).tolist()
    sampling = SamplingConfig(temperature=1.0, max_tokens=r.sampling.max_tokens, n=1,
                              ignore_eos=True, seed=0)
    rollout.wake()
    samples = []
    for k in range(1 + repeats):
        sync()
        start = time.perf_counter()
        rollout.generate(prompts, sampling)
        sync()
        samples.append(time.perf_counter() - start)
    # What the switch hands the rollout at generation tp = 1: every tensor, whole.
    from hybridflow.hybrid_engine.switch import generation_metas
    from hybridflow.models.params import llama_param_metas
    from hybridflow.parallel.layout import GenLayout, TrainLayout
    from hybridflow.training.engine import DTYPES
    metas = generation_metas(llama_param_metas(shape), shape.tie_embeddings,
                             GenLayout(train=TrainLayout(), tp=1))
    tensors = {m.name: torch.zeros(m.shape, dtype=DTYPES[dtype], device=device) for m in metas}
    loads = []
    for k in range(1 + repeats):
        sync()
        start = time.perf_counter()
        rollout.load_from_switch(tensors)
        sync()
        loads.append(time.perf_counter() - start)
    rollout.close()
    return statistics.median(samples[1:]), statistics.median(loads[1:])
