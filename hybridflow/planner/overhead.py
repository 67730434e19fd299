"""What a micro-batch costs beyond its arithmetic, and what a pipeline stage adds to it:
``hybridflow calibrate`` measures them on a probe model (``rates.MicroBatchCosts``), so that the
cost model prices every model, profiled or not, by more than its floors.

The probe is a Llama of hidden 64 (4 heads of 16, 2 KV heads, FFN 128, vocabulary 256) on
sequences of 32 tokens, the response's 16 last columns marked as in an RL batch: a micro-batch
of it is a few MFLOP, so what it costs beyond its floor (its FLOPs at the calibrated matmul rate)
is the host's work: Python, kernel launches, Megatron's schedule. Measured in local processes
(``hybridflow.parallel.spawn``: two ranks on CPU, one thread each, gloo; on GPU one rank per
device, NCCL, two at most), each time the median of ``repeats`` after a warm-up, the slowest
rank's:

* host work per micro-batch: the probe with 2 and with 6 layers at pp = 1 (dp = the ranks), a
  forward-only pass (``compute_logprobs``, as the old and reference log-prob passes run it) and
  a training step (``train_step`` with the actor's loss function as its update builds it,
  ``actor_loss_fn``: the default objective, on-policy, over random advantages) over one
  micro-batch of one sequence and over two; the difference is one micro-batch's seconds, less
  its floor the host's. Its growth from 2 to 6 layers over 4 is the per-layer part
  (``*_layer_s``), the rest the base (``*_base_s``);
* a pipeline stage: the probe with 4 layers at pp = 2 (two devices or ranks), one micro-batch
  and two: under 1F1B the second adds one steady-state micro-batch of the busiest stage; less
  that stage's host work as priced above (the base and 2 layers) and its floor, it is what a
  stage boundary adds per micro-batch (``*_stage_s``: the schedule's send and receive calls and
  their latency; the probe's activations are 4 KiB);
* the point-to-point rate (``p2p``): a send of ``message`` bytes from rank 0 to rank 1.

With one device the pipeline terms are not measured (None).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from hybridflow.models.config import ModelConfig
from hybridflow.planner.rates import MicroBatchCosts

PROBE = ModelConfig(vocab_size=256, hidden_size=64, ffn_hidden_size=128, num_layers=4,
                    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)
"""The probe model (module docstring); its layer count is set per measurement."""
PROBE_SEQ, PROBE_RESPONSE = 32, 16
LAYERS = (2, 6)
"""The probe's layer counts at pp = 1: the per-layer host work is the difference over 4."""


def micro_batch_costs(on_gpu: bool, devices: int, calib_rate: float, dtype: str, message: int,
                      warmup: int, repeats: int) -> MicroBatchCosts:
    """Measure the micro-batch costs (module docstring) on this machine; ``calib_rate``: the
    matmul FLOP/s of ``dtype`` that ``calibrate`` measured, for the probe's floors."""
    from hybridflow.parallel.spawn import spawn  # deferred: it imports torch
    from hybridflow.planner.cost import forward_flops, train_flops
    from hybridflow.workers.group import quiet_engines_env  # deferred: it imports torch
    ranks = 2 if not on_gpu else min(devices, 2)
    saved = dict(os.environ)
    os.environ.update(quiet_engines_env())  # the children inherit it: torch reads it at import
    try:
        per_rank = spawn(_measure, ranks, dtype, message, warmup, repeats, on_gpu,
                         timeout=1800, backend="nccl" if on_gpu else "gloo")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    times = {k: max(r[k] for r in per_rank) for k in per_rank[0]}

    def floor(kind: str, layers: int, pp: int = 1) -> float:
        flops = train_flops if kind == "train" else forward_flops
        return flops(dataclasses.replace(PROBE, num_layers=layers), "lm", PROBE_SEQ, pp,
                     response=PROBE_RESPONSE) / calib_rate

    out: dict[str, Any] = {}
    for kind in ("forward", "train"):
        lo, hi = (times[f"{kind}_{n}"] - floor(kind, n) for n in LAYERS)
        layer = max(0.0, (hi - lo) / (LAYERS[1] - LAYERS[0]))
        base = max(0.0, lo - LAYERS[0] * layer)
        out[f"{kind}_layer_s"], out[f"{kind}_base_s"] = layer, base
        stage = None
        if ranks > 1:
            host = base + PROBE.num_layers // 2 * layer
            stage = max(0.0, times[f"{kind}_pp"] - host - floor(kind, PROBE.num_layers, pp=2))
        out[f"{kind}_stage_s"] = stage
    out["p2p"] = message / times["p2p"] if ranks > 1 else None
    return MicroBatchCosts(**out)


def probe_batch(n: int) -> dict:
    """``n`` probe sequences as an RL batch: random tokens, the response's last
    ``PROBE_RESPONSE`` columns, a random advantage per sequence on them (GRPO's)."""
    import torch  # deferred: torch
    ids = torch.randint(0, PROBE.vocab_size, (n, PROBE_SEQ))
    response = torch.zeros(n, PROBE_SEQ)
    response[:, PROBE_SEQ - PROBE_RESPONSE:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "response_mask": response, "advantages": torch.randn(n, 1) * response}


def probe_loss_fn(batch: dict):
    """The loss function the actor's update builds (``actor_loss_fn``) for ``batch`` as one
    on-policy mini-batch of one rank: the default objective (``ActorConfig``'s: the PPO clip,
    dual clip, token-mean), its denominator the batch's response tokens."""
    from hybridflow.algorithms.objective import ActorObjective, actor_loss_fn
    from hybridflow.config.rl import ActorConfig
    denominator = max(float(batch["response_mask"].sum()), 1.0)
    return actor_loss_fn(ActorObjective.of(ActorConfig()), denominator, seen=[])


def _measure(rank: int, world_size: int, dtype: str, message: int, warmup: int, repeats: int,
             on_gpu: bool) -> dict[str, float]:
    """One rank's seconds: ``{kind}_{layers}`` one micro-batch of the probe at pp = 1 (the
    difference of two micro-batches and one), ``{kind}_pp`` the same at pp = 2 and ``p2p`` one
    send of ``message`` bytes, where there are two ranks."""
    # deferred: torch
    import torch
    import torch.distributed as dist

    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.planner.timing import timed_median
    from hybridflow.training.config import EngineConfig
    from hybridflow.training.engine import TrainEngine

    torch.manual_seed(0)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    engine_config = EngineConfig(micro_batch_size=1, dtype=dtype)

    def per_micro_batch(engine, kind: str) -> float:
        one, two = probe_batch(1), probe_batch(2)
        run = ((lambda b: engine.compute_logprobs(b)) if kind == "forward"
               else (lambda b: engine.train_step(b, probe_loss_fn(b))))
        seconds = [timed_median(lambda: run(b), sync, warmup=warmup, repeats=repeats, inner=1)
                   for b in (one, two)]
        return max(seconds[1] - seconds[0], 0.0)

    times: dict[str, float] = {}
    for layers in LAYERS:
        engine = TrainEngine(dataclasses.replace(PROBE, num_layers=layers),
                             TrainLayout(dp=world_size), engine_config)
        for kind in ("forward", "train"):
            times[f"{kind}_{layers}"] = per_micro_batch(engine, kind)
        del engine
    if world_size > 1:
        engine = TrainEngine(PROBE, TrainLayout(pp=2, dp=world_size // 2), engine_config)
        for kind in ("forward", "train"):
            times[f"{kind}_pp"] = per_micro_batch(engine, kind)
        del engine
        device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
        buf = torch.ones(message, dtype=torch.uint8, device=device)
        samples = []
        for _ in range(warmup + repeats):
            sync()
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, dst=1)
            elif rank == 1:
                dist.recv(buf, src=0)
            sync()
            samples.append(time.perf_counter() - start)
        times["p2p"] = sorted(samples[warmup:])[len(samples[warmup:]) // 2]
    return times
