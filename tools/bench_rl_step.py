#!/usr/bin/env python
"""Time whole RL iterations of ``RLTrainer`` (generate -> reward -> old/ref log-probs ->
advantages -> actor update), phase by phase.

    python tools/bench_rl_step.py --model tiny --device cpu          # smoke test, gloo, Ray
    python3 tools/bench_rl_step.py --model llama-0.9b --device cuda  # 2 x H200 (one GPU per rank)

A random Llama-shaped HF checkpoint is written into a temporary directory (``llama-0.9b``: 16
layers, hidden 2048, 16 heads of 128, 8 KV groups, FFN 5632, vocab 32000, untied, bf16, with the
tiny byte-level BPE tokenizer; ``llama-7b``: Llama-2-7B's shapes, 32 layers, hidden 4096, 32
heads, FFN 11008; ``tiny``: hybridflow's tiny Llama; ``smollm2``: not random, SmolLM2-135M-Instruct
with its own tokenizer, the checkpoint ``model: smollm2`` trains). The trainer runs with the actor
at ``--tp``/``--pp``/``--dp`` (one Ray actor per rank, ``ray.gpus_per_worker=1`` on GPU), the
Megatron rollout backend (``--backend``) at ``--gen-tp`` (tp x pp / gen_tp micro-DP replicas per
data-parallel rank; the fast decode path on GPU), the given ``--algorithm`` and a length-based
reward; prompts are made up here (random words, chat template
applied, ``--prompt-min``..``--prompt-max`` tokens). The steps are driven one by one
(``trainer.generate``, ``trainer.score``, ``trainer.update_actor``; no tqdm or matplotlib
needed): ``--warmup`` iterations, then ``--iters`` timed ones; each phase is the mean over the
timed iterations.

Phases (seconds): ``generate_call`` is the controller's wall time of ``trainer.generate``; inside
it, as replica 0's worker measured them, ``reshard`` (the 3D-HybridEngine's all-gather into the
generation layout), ``weight_load`` (handing those tensors to the rollout model), ``generate``
(sampling, CUDA-graph capture after the previous ``sleep`` included; ``graph_capture`` is that
capture's share), ``rollout_sleep`` (the rollout engine freeing its KV cache and graphs),
``back_to_train``; ``reward``, ``old_logprobs``, ``ref_logprobs``, ``values``
(PPO), ``advantages`` (from ``trainer.score``), ``update_critic`` (PPO), ``update_actor`` and
``step`` (the whole iteration, controller wall time). With ``--algorithm ppo`` the critic's worker
group shares the actor's GPUs (``--placement colocate``; ``split`` gives it GPUs of its own, its
calls then running beside the actor's).

Generation: ``gen_tokens_per_s`` = response tokens of all replicas / replica 0's ``generate``
time (the replicas decode at once, one per GPU). The HBM roofline of the decode steps is, per
replica, (decode steps x weight bytes a step reads + KV bytes all steps read) / the device copy
bandwidth measured in this run (the same accounting as ``tools/bench_rollout.py``: every weight
but the input embedding table each step; the KV cache of the left-padded prompt + the tokens so
far), with decode steps = the replica's longest response - 1; ``gen_roofline_fraction`` = replica
0's roofline time / its ``generate`` time (prefill, sampling, graph capture and the host-side
unpacking are in the denominator, so this is below ``bench_rollout``'s decode-only fraction).

Training MFU: achieved FLOPs / (ranks x the bf16 matmul rate measured here with one large
``torch.matmul`` per GPU). FLOPs = 6 x N x tokens for ``update_actor`` (forward + backward, per
PPO epoch; 4 x N with ``--lora-rank``: the frozen base computes no weight gradients, and the
adapters' FLOPs are left out; with ``--recompute`` the layers' forward run again is not counted:
model FLOPs, not the device's), 2 x N x tokens for each forward-only pass (old and ref log-probs);
N = the parameters that take part in matmuls (all but the input embedding table), of which the
actor's output layer (h V) counts the response tokens only: the model FLOPs of useful work (the
engine computes the output layer from the column before the first response token, and no
consumer reads a prompt position's log-prob). The critic's passes (``values``,
``update_critic``) count N less the output layer plus the value head over every token;
attention's score/value FLOPs are not counted. ``tokens`` are the real (unpadded) prompt +
response tokens (``mfu_*``); ``tokens_padded`` the positions the engine computes in a forward
pass over the batch (the engine's own split, ``plan_micro_batches``, of each DP rank's share:
with fixed-size micro-batches every position of the [B, max_prompt_tokens + max_tokens] batch
from the first column any of the rank's rows uses to the last, far fewer with
``--max-tokens-per-micro-batch``), which ``mfu_padded_*`` counts, with the output
layer over the positions the engine computes it at (``logits_padded``: from each micro-batch's
first response column minus one); ``padded_fraction`` = (tokens_padded - tokens_real) /
tokens_padded, the share of computed positions that are padding. On CPU the "matmul rate" is one
thread's (the workers run one thread each), and there is no roofline. A CPU's rate drifts between
and within runs (0.082-0.100 TFLOP/s on one 2-core machine in one hour), so on CPU the driver
measures it again after each timed iteration, while the workers wait: ``matmul_tflops`` is the
mean of those samples and the one at the start (``matmul_tflops_samples``).

Floors (``floor_s``), at the rates measured in this run: each training and forward-only pass
its FLOPs above over the matmul rate (what its MFU divides); generation replica 0's prefill and
decode FLOPs (2 N per prompt position and per response token) at its devices' matmul rate, or
the decode steps' HBM roofline where that is longer; the switch the bytes it received over the
all-gather rate of ``--calibration``'s file for its micro-DP group (0 where nothing moves; left
out without a file). ``floor_ratio`` = the measured step / the sum of the floors (the controller's
own work between phases included); ``floor_ratio_phases`` the same for the floored phases alone.

Memory (GPU): every worker call reports its process's allocator peak and what stays allocated
(``memory/<call>_peak_gib``, ``_resident_gib``; the trainer logs them every step), and the
generate call its peak between the switch's release of the training state and the switch back
(``memory/generation_peak_gib``);
``memory_gib`` sets, per phase of ``hybridflow.planner.memory``'s estimate, the GPU's measured
peak (the phase's fullest call, plus the other colocated worker's resident bytes) beside the
estimate, by worker process and in total; ``peak_memory_gib`` is the fullest phase's pair.

``--calibration FILE`` (from ``hybridflow calibrate``): the cost model's seconds for the same
phases (``predicted_s``; docs/planner.md), printed beside the measured ones: floors and the
file's micro-batch costs (floors alone in a file written before calibrate measured them), unless
the file has a profile of this model's passes, which ``--profile-passes`` measures first (what
``hybridflow calibrate --config`` does for a run config) and adds to the file.

Allocator (GPU): ``allocator`` has, per worker call, the mean over the timed iterations of the
blocks the CUDA caching allocator took from the device during it (``_device_allocs``: a warm
cache takes none) and of its retries (``_alloc_retries``: no room, its whole cache freed, the
allocation tried again), the largest over ranks.

``--profile N``: one more iteration after the timed ones, rank 0's actor calls of the generation
(the switch and its way back included), the update and the log-prob passes under torch.profiler
(``Worker.arm_profile``): each one's N costliest kernels and the device's idle share of that
phase's timed mean.

The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled
sys.path.insert(0, str(ROOT / "tools"))

import torch  # noqa: E402

from hybridflow.models.config import ModelConfig  # noqa: E402

from bench_reshard import PRESETS  # noqa: E402
from bench_rollout import LLAMA_09B, copy_bandwidth, decode_bytes  # noqa: E402
from hybridflow.planner.cost import matmul_params  # noqa: E402,F401 (bench_engine's too)
from hybridflow.models.params import DTYPES  # noqa: E402
from hybridflow.hybrid_engine.switch import LORA_MERGES  # noqa: E402

# Llama-2-7B shapes (bench_reshard's), with the 0.9B model's rope and norm settings.
LLAMA_7B = dict(LLAMA_09B, **PRESETS["llama-7b"])
MODELS = {"llama-0.9b": LLAMA_09B, "llama-7b": LLAMA_7B}
_WORDS = ("the quick brown fox jumps over lazy dog answer question step think compute count "
          "clips friends sold half many april may sun sleeps helpful assistant reward policy "
          "model feedback human learning train hello fine today thank you final number").split()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_rl_step", description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("tiny", "smollm2", *MODELS), default="tiny",
                    help="smollm2: SmolLM2-135M-Instruct's real weights (model: smollm2's "
                    "checkpoint); the others random weights of their shape")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--algorithm", default="grpo", help="grpo, ppo, rloo, ...")
    ap.add_argument("--backend", choices=("megatron", "vllm", "hf"), default="megatron",
                    help="rollout backend")
    ap.add_argument("--tp", type=int, default=2, help="actor (and critic) training TP")
    ap.add_argument("--pp", type=int, default=1, help="actor (and critic) pipeline stages")
    ap.add_argument("--dp", type=int, default=1, help="actor (and critic) data-parallel ranks")
    ap.add_argument("--gen-tp", type=int, default=1, help="generation TP")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="engine and checkpoint dtype (default: bf16 on GPU, fp32 on CPU)")
    ap.add_argument("--batch", type=int, default=None, help="train_batch_size (prompts per step; "
                    "default 32 on GPU, 4 on CPU)")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="new tokens per sample (default 128 on GPU, 16 on CPU)")
    ap.add_argument("--prompt-min", type=int, default=None, help="default 64 (GPU), 24 (CPU)")
    ap.add_argument("--prompt-max", type=int, default=None, help="default 128 (GPU), 40 (CPU)")
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="training micro-batch (sequences); default 32 (GPU), 2 (CPU)")
    ap.add_argument("--forward-micro-batch", type=int, default=None,
                    help="micro-batch of the forward-only passes (log-probs, values); default "
                    "64 (GPU), 4 (CPU); 0: the training micro-batch")
    ap.add_argument("--max-tokens-per-micro-batch", type=int, default=None, metavar="N",
                    help="engine.max_tokens_per_micro_batch of the actor and critic: micro-batches "
                    "by a token budget, sequences grouped by length, padding cut")
    ap.add_argument("--recompute", action="store_true",
                    help="engine.recompute of the actor and critic: full activation recompute, "
                    "each layer's forward run again in the backward (one large micro-batch fits)")
    ap.add_argument("--keep-cache", action="store_true",
                    help="rollout.keep_cache (megatron backend, GPU): the fast decoder's KV cache "
                    "and CUDA graphs kept across the switch back, no capture after each wake")
    ap.add_argument("--ref-offload", action="store_true",
                    help="ref.offload: the reference's weights in host memory, streamed "
                         "to the GPU unit by unit during its pass")
    ap.add_argument("--offload-optimizer", action="store_true",
                    help="hybrid_engine.offload_optimizer: Adam state in host memory while "
                    "generating")
    ap.add_argument("--host-optimizer", action="store_true",
                    help="actor.engine.optim.offload: Adam, its fp32 main weights and gradients "
                    "in host memory, the gradients streamed there during the backward (one rank)")
    ap.add_argument("--lora-rank", type=int, default=0, metavar="R",
                    help="actor.lora.rank: LoRA adapters of rank R on every linear, the base "
                    "frozen (the reference is the base)")
    ap.add_argument("--lora-merge", choices=LORA_MERGES, default=None,
                    help="hybrid_engine.lora_merge (with --lora-rank): merged copies beside "
                    "the base, or the base overwritten and restored from host memory")
    ap.add_argument("--gpu-memory-gib", type=float, default=None, metavar="G",
                    help="ray.gpu_memory_gib: cap each worker's CUDA allocator at G GiB, as on "
                    "a GPU of that size")
    ap.add_argument("--placement", choices=("colocate", "split", "standalone"),
                    default="colocate", help="placement.preset: where the models live")
    ap.add_argument("--gpus-per-worker", type=float, default=None,
                    help="Ray GPUs per rank (default 1 on GPU, 0 on CPU)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json-out", default=None, help="also write the JSON object to this file")
    ap.add_argument("--calibration", default=None, metavar="FILE",
                    help="rates from `hybridflow calibrate`: report the cost model's seconds per "
                         "phase beside the measured ones (predicted_s)")
    ap.add_argument("--profile-passes", action="store_true",
                    help="first measure this run's model passes (`hybridflow calibrate "
                         "--config`'s profile) and add them to --calibration's file")
    ap.add_argument("--configured-sizes", action="store_true",
                    help="with --profile-passes: only this run's micro-batch sizes, not the "
                         "planner's whole ladder (`hybridflow calibrate --configured-sizes`)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timed iterations, one more with rank 0's actor calls "
                         f"({', '.join(PROFILED_CALLS)}) under torch.profiler: print each "
                         "one's N costliest kernels and its device idle time")
    args = ap.parse_args(argv)
    if args.profile_passes and args.calibration is None:
        ap.error("--profile-passes adds to a calibration file: give --calibration FILE")
    gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if gpu and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available")
    args.device = "cuda" if gpu else "cpu"
    defaults = dict(dtype="bf16" if gpu else "fp32", batch=32 if gpu else 4,
                    max_tokens=128 if gpu else 16, prompt_min=64 if gpu else 24,
                    prompt_max=128 if gpu else 40, micro_batch=32 if gpu else 2,
                    forward_micro_batch=64 if gpu else 4,
                    gpus_per_worker=1.0 if gpu else 0.0)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.forward_micro_batch == 0:
        args.forward_micro_batch = args.micro_batch
    if args.max_tokens_per_micro_batch is not None:  # the budget forms every micro-batch
        args.micro_batch = args.forward_micro_batch = None
    if not 0 < args.prompt_min <= args.prompt_max:
        ap.error("need 0 < --prompt-min <= --prompt-max")
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters >= 1, --warmup >= 0")
    return args


# ------------------------------------------------------------------------------ model and data
def model_config(name: str) -> ModelConfig:
    from hybridflow.models.tiny import tiny_llama_config
    return tiny_llama_config() if name == "tiny" else ModelConfig(**MODELS[name])


def write_checkpoint(name: str, dtype: str, workdir: Path, device: str, seed: int) -> Path:
    """A random HF checkpoint (weights drawn on ``device``, which is fast on a GPU) with the tiny
    BPE tokenizer (its ids all fall below the model's vocabulary); for ``smollm2`` the checkpoint
    ``model: smollm2`` trains (prepared once, in hybridflow's cache)."""
    from hybridflow.models.params import llama_param_metas
    from hybridflow.models.hf import megatron_to_hf, save_hf_checkpoint
    from hybridflow.models.tiny import make_tiny_tokenizer

    if name == "smollm2":
        from hybridflow.models.source import resolve_model
        return resolve_model("smollm2")
    cfg = model_config(name)
    dt = DTYPES[dtype]
    gen = torch.Generator(device=device).manual_seed(seed)
    full = {}
    for m in llama_param_metas(cfg):
        if len(m.shape) == 1 and m.tp_dim is None:  # norm weights
            full[m.name] = torch.ones(m.shape, dtype=dt)
        else:
            full[m.name] = (torch.randn(m.shape, generator=gen, device=device) * 0.02
                            ).to(dt).cpu()
    tokenizer = make_tiny_tokenizer(min(cfg.vocab_size, 512))
    return save_hf_checkpoint(workdir / name, megatron_to_hf(full, cfg), cfg, tokenizer=tokenizer)


def make_records(tokenizer, count: int, lo: int, hi: int, seed: int) -> list[dict]:
    """``count`` prompt records of random words whose chat-templated length is in [lo, hi]."""
    rng = random.Random(seed)

    def length(text: str) -> int:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
        return len(tokenizer(chat, add_special_tokens=False)["input_ids"])

    records = []
    for i in range(count):
        target = rng.randint(lo, hi)
        words = [f"Question {i}:"]
        while length(" ".join(words)) < target:
            words.append(rng.choice(_WORDS))
        while len(words) > 1 and length(" ".join(words)) > target:
            words.pop()
        records.append({"prompt": " ".join(words)})
    return records


def length_reward(response: str) -> float:
    """Longer answers score higher (the benchmark needs some spread, not a meaning)."""
    return len(response) / 100.0


# ------------------------------------------------------------------------------ device rates
def matmul_rate(device: str, size: int, iters: int) -> float:
    """FLOP/s of one large bf16 (GPU) / fp32 (CPU, one thread) ``torch.matmul``: calibrate's
    measurement, ``iters`` calls a sample (the median of 5)."""
    from hybridflow.planner.calibrate import matmul_rate as measure
    dev = torch.device(device)
    return measure(dev, "bf16" if dev.type == "cuda" else "fp32", size, warmup=1, repeats=5,
                   inner=max(1, iters // 5))


def device_rates(device: str, ranks: int) -> dict:
    """Matmul rate of each GPU the ranks use (mean reported) and GPU 0's copy bandwidth; measured
    in this process before Ray starts."""
    out = {}
    if device == "cuda":
        n = min(ranks, torch.cuda.device_count())
        rates = [matmul_rate(f"cuda:{i}", 8192, 50) for i in range(n)]
        with torch.cuda.device(0):
            out["copy_bandwidth_gb_s"] = round(copy_bandwidth() / 1e9, 1)
        out["matmul_tflops_per_gpu"] = [round(r / 1e12, 1) for r in rates]
        out["matmul_tflops"] = round(statistics.mean(rates) / 1e12, 1)
        out["device"] = torch.cuda.get_device_name(0)
        out["gpus"] = torch.cuda.device_count()
        for i in range(n):
            with torch.cuda.device(i):
                torch.cuda.empty_cache()
    else:
        out["matmul_tflops"] = round(matmul_rate("cpu", 1024, 5) / 1e12, 4)
        out["copy_bandwidth_gb_s"] = None
        out["device"] = "cpu"
    return out


# ------------------------------------------------------------------------------ accounting
def generation_roofline(batch, replicas: int, cfg: ModelConfig, dtype_bytes: int,
                        bandwidth: float) -> list[dict]:
    """Per replica (rows in dispatch order): rows, padded prompt width, decode steps, bytes and
    the roofline seconds of its decode steps."""
    response = batch["response_mask"].bool()
    prompt = batch["attention_mask"].bool() & ~response
    rows = response.shape[0] // replicas
    out = []
    for r in range(replicas):
        sl = slice(r * rows, (r + 1) * rows)
        width = int(prompt[sl].sum(-1).max())
        longest = int(response[sl].sum(-1).max())
        weights, kv = decode_bytes(cfg, dtype_bytes, rows, width, longest)
        steps = max(longest - 1, 0)
        out.append(dict(rows=rows, prompt_width=width, decode_steps=steps,
                        weight_bytes_per_step=weights, kv_bytes_all_steps=kv,
                        response_tokens=int(response[sl].sum()),
                        roofline_s=(steps * weights + kv) / bandwidth if bandwidth else None))
    return out


def computed_tokens(attention_mask, response_mask, actor) -> tuple[int, int]:
    """(positions the actor's engine computes in a forward pass over the batch, positions its
    output layer computes): its own split (``plan_micro_batches``) of each data-parallel rank's
    share, padding included, the output layer from each micro-batch's ``first_logit_column``."""
    from hybridflow.training.micro_batches import (first_logit_column, plan_micro_batches,
                                                   response_starts)
    positions = logits = 0
    # the controller's dispatch: equal shares, in order
    for mask, response in zip(attention_mask.chunk(actor.layout.dp),
                              response_mask.chunk(actor.layout.dp)):
        starts = response_starts(response, mask.shape)
        for plan in plan_micro_batches(mask, actor.engine, actor.layout.tp, True):
            positions += plan.tokens
            logits += len(plan.rows) * (plan.padded_width - first_logit_column(starts, plan))
    return positions, logits


def run_iteration(trainer, items) -> tuple[dict, object]:
    """One RL iteration, phase by phase; (metrics, the scored batch)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    batch = trainer.generate(items)
    t1 = time.perf_counter()
    batch = trainer.score(batch)
    t2 = time.perf_counter()
    update = trainer.update_actor(batch)
    t3 = time.perf_counter()
    m = {"generate_call_s": t1 - t0, "score_call_s": t2 - t1, "update_call_s": t3 - t2,
         "step_s": t3 - t0}
    for k, v in {**batch.meta, **update}.items():
        if k.startswith("timing/"):
            m[k[len("timing/"):]] = v
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            m[k] = v
    m["reward_mean"] = float(batch["scores"].mean())
    m["response_length_mean"] = float(batch["response_mask"].sum(-1).float().mean())
    groups = trainer.start().groups
    pools = [pool.name for pool in groups.placement.pools]
    if len(pools) > 1:  # the time two pools were busy at once, each one's idle time
        m.update({k[len("timing/"):]: v
                  for k, v in groups.timeline.step_metrics(t0, t3, pools).items()})
    return m, batch


# the actor's worker calls --profile runs under torch.profiler, by the phase each one times
PROFILED_CALLS = {"generate": "generate_call_s", "update_actor": "update_actor_s",
                  "compute_log_prob": "old_logprobs_s", "compute_ref_log_prob": "ref_logprobs_s"}


def profile_iteration(trainer, items, tmp: Path, rows: list[dict], top: int) -> dict:
    """One more iteration, rank 0's ``PROFILED_CALLS`` under torch.profiler (``arm_profile``);
    each profile's idle time is against the timed iterations' mean of its phase (the profiler
    slows the host, so its own call is longer)."""
    from hybridflow.profiling import print_profile
    paths = {call: str(tmp / f"profile-{call}.json") for call in PROFILED_CALLS}
    trainer.start().groups.actor.arm_profile(paths, top)
    run_iteration(trainer, items)
    out = {}
    for call, path in paths.items():
        if not Path(path).is_file():
            continue  # the step made no such call (on-policy: no old log-probs)
        prof = json.loads(Path(path).read_text())
        wall = mean_of(rows, PROFILED_CALLS[call])
        if wall is not None and prof["idle"] is not None:
            prof["profiled_wall_s"], prof["wall_s"] = prof["wall_s"], round(wall, 4)
            prof["idle"] = round(max(0.0, 1 - prof["busy_s"] / wall), 3)
            for op in prof["top"]:
                op["share"] = round(op["s"] / wall, 3)
        print_profile(f"{call} ({PROFILED_CALLS[call][:-2]}, rank 0)", prof)
        out[call] = prof
    return out


def run_config(args, path: Path, prompts: Path):
    """The run's RLConfig; ``prompts`` is the jsonl file of the made-up prompts (a file, not the
    default reasoning-gym source: the GPU machine lacks reasoning-gym)."""
    from hybridflow.config import RLConfig, make_config

    values = {"name": f"bench-{args.algorithm}", "model": str(path),
              "algorithm.name": args.algorithm, "ref.offload": args.ref_offload,
              "hybrid_engine.offload_optimizer": args.offload_optimizer,
              "actor.engine.optim.offload": args.host_optimizer,
              "actor.lora.rank": args.lora_rank, "ray.gpu_memory_gib": args.gpu_memory_gib,
              **({"hybrid_engine.lora_merge": args.lora_merge} if args.lora_merge else {}),
              "rollout.backend": args.backend, "rollout.tp": args.gen_tp,
              **({"rollout.keep_cache": True} if args.keep_cache else {}),
              "rollout.sampling": {"temperature": 1.0, "max_tokens": args.max_tokens,
                                   "n": args.n},
              "data.source": str(prompts), "data.max_prompt_tokens": args.prompt_max,
              "train_batch_size": args.batch, "steps": args.warmup + args.iters,
              "seed": args.seed, "ray.num_cpus": None if args.device == "cuda" else 2,
              "ray.gpus_per_worker": args.gpus_per_worker, "placement.preset": args.placement,
              "cluster.calibration": args.calibration}
    roles = ("actor", "critic") if args.algorithm == "ppo" else ("actor",)
    for role in roles:
        values.update({f"{role}.layout.tp": args.tp, f"{role}.layout.pp": args.pp,
                       f"{role}.layout.dp": args.dp, f"{role}.engine.dtype": args.dtype,
                       f"{role}.engine.recompute": args.recompute,
                       f"{role}.engine.max_tokens_per_micro_batch":
                           args.max_tokens_per_micro_batch})
        if args.max_tokens_per_micro_batch is None:  # else the budget forms the micro-batches
            values.update({f"{role}.engine.micro_batch_size": args.micro_batch,
                           f"{role}.engine.forward_micro_batch_size": args.forward_micro_batch})
    return make_config(RLConfig, None, values)


# ------------------------------------------------------------------------------ main
def main(argv=None) -> dict:
    args = parse_args(argv)
    from hybridflow.trainer import RLTrainer

    from hybridflow.parallel.layout import GenLayout, TrainLayout
    gen = GenLayout(train=TrainLayout(tp=args.tp, pp=args.pp, dp=args.dp), tp=args.gen_tp)
    replicas, ranks = gen.replicas, gen.train.world_size
    result = dict(bench="rl_step", model=args.model, algorithm=args.algorithm,
                  backend=args.backend, dtype=args.dtype, actor_tp=args.tp, actor_pp=args.pp,
                  actor_dp=args.dp, gen_tp=args.gen_tp,
                  gen_replicas=replicas, gen_micro_dp=gen.micro_dp,
                  train_batch_size=args.batch, n=args.n,
                  max_tokens=args.max_tokens, prompt_tokens=[args.prompt_min, args.prompt_max],
                  micro_batch_size=args.micro_batch,
                  forward_micro_batch_size=args.forward_micro_batch,
                  max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
                  keep_cache=args.keep_cache,
                  ref_offload=args.ref_offload, offload_optimizer=args.offload_optimizer,
                  host_optimizer=args.host_optimizer,
                  lora_rank=args.lora_rank, lora_merge=args.lora_merge,
                  gpu_memory_gib=args.gpu_memory_gib,
                  placement=args.placement, warmup=args.warmup, iters=args.iters,
                  torch=torch.__version__)
    start = time.perf_counter()
    result.update(device_rates(args.device, ranks))
    result["rates_s"] = round(time.perf_counter() - start, 2)
    print(f"device {result['device']}: matmul {result['matmul_tflops']} TFLOP/s per device, "
          f"copy {result['copy_bandwidth_gb_s']} GB/s", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-rl-", dir=args.workdir) as tmp:
        t = time.perf_counter()
        path = write_checkpoint(args.model, args.dtype, Path(tmp), args.device, args.seed)
        from hybridflow.models.hf import load_hf_config
        cfg_model = load_hf_config(path)
        result["checkpoint_s"] = round(time.perf_counter() - t, 2)
        from transformers import AutoTokenizer
        records = make_records(AutoTokenizer.from_pretrained(str(path)), args.batch,
                               args.prompt_min, args.prompt_max, args.seed)
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
        cfg = run_config(args, path, prompts)
        if args.profile_passes:
            from hybridflow.planner.rates import Calibration
            from hybridflow.planner.profile import profile_passes
            t = time.perf_counter()
            calib = Calibration.from_json(args.calibration)
            calib.passes.append(profile_passes(cfg, calib,
                                               configured_only=args.configured_sizes))
            calib.to_json(args.calibration)
            result["profile"] = dataclasses.asdict(calib.passes[-1]) | {
                "seconds": round(time.perf_counter() - t, 1)}
            print(calib.passes[-1].describe(), flush=True)
        trainer = RLTrainer(cfg, reward_fn=length_reward)
        try:
            items = trainer.prompt_items(records)
            if len(items) != args.batch:
                raise RuntimeError(f"{args.batch - len(items)} prompts were dropped")
            lengths = [len(i.prompt_ids) for i in items]
            result["prompt_tokens_seen"] = [min(lengths), round(statistics.mean(lengths), 1),
                                            max(lengths)]
            t = time.perf_counter()
            trainer.start()
            result["workers_start_s"] = round(time.perf_counter() - t, 2)
            rows = []
            rates = [result["matmul_tflops"] * 1e12]
            for it in range(args.warmup + args.iters):
                m, batch = run_iteration(trainer, items)
                timed = it >= args.warmup
                if timed:
                    roof = generation_roofline(batch, replicas, cfg_model,
                                               DTYPES[args.dtype].itemsize,
                                               result["copy_bandwidth_gb_s"] * 1e9
                                               if result["copy_bandwidth_gb_s"] else None)
                    m["gen_replicas"] = roof
                    m["tokens_real"] = int(batch["attention_mask"].sum())
                    m["tokens_padded"], m["logits_padded"] = computed_tokens(
                        batch["attention_mask"], batch["response_mask"], cfg.actor)
                    m["response_tokens"] = int(batch["response_mask"].sum())
                    rows.append(m)
                    if args.device == "cpu":  # this machine's rate drifts: sample it again
                        rates.append(matmul_rate("cpu", 1024, 5))
                print(("timed" if timed else "warm-up") + f" iteration {it + 1}: step "
                      f"{m['step_s']:.3f}s, generate {m['generate_call_s']:.3f}s, score "
                      f"{m['score_call_s']:.3f}s, update {m['update_call_s']:.3f}s, reward "
                      f"{m['reward_mean']:.3f}", flush=True)
            if args.profile:
                result["call_profiles"] = profile_iteration(trainer, items, Path(tmp), rows,
                                                            args.profile)
        finally:
            trainer.close()
    if len(rates) > 1:
        result["matmul_tflops_samples"] = [round(r / 1e12, 4) for r in rates]
        result["matmul_tflops"] = round(statistics.mean(rates) / 1e12, 4)
        print(f"matmul rate: {result['matmul_tflops']} TFLOP/s per rank, the mean of "
              f"{result['matmul_tflops_samples']} (at the start and after each timed "
              "iteration)", flush=True)

    summarize(result, rows, cfg_model, args)
    memory_pairs(result, rows, cfg, cfg_model)
    print_table(result)
    busy = {k: v for k, v in result["allocator"].items() if v}
    if busy:
        print("allocator, per call (device allocations, retries): " + ", ".join(
            f"{k} {v:g}" for k, v in busy.items()), flush=True)
    if trainer.prediction is not None:  # the cost model's floors for the same phases
        result["predicted_s"] = {k: round(v, 4) for k, v in trainer.prediction.phases.items()}
        result["predicted_s"]["step"] = round(trainer.prediction.step, 4)
        print("measured / predicted s: " + ", ".join(
            f"{k} {result['phases_s'].get(k, float('nan')):.3g} / {v:.3g}"
            for k, v in result["predicted_s"].items()), flush=True)
    line = json.dumps(result)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    print(line, flush=True)
    return result


def mean_of(rows: list[dict], key: str) -> float | None:
    """The mean of ``key`` over the timed iterations that have it (None if none has)."""
    vals = [r[key] for r in rows if key in r]
    return statistics.mean(vals) if vals else None


def summarize(result: dict, rows: list[dict], cfg: ModelConfig, args) -> None:
    def mean(key):
        return mean_of(rows, key)

    phases = ["reshard_s", "weight_load_s", "generate_s", "graph_capture_s", "rollout_sleep_s",
              "back_to_train_s", "generate_call_s", "reward_s", "old_logprobs_s",
              "ref_logprobs_s", "values_s", "advantages_s", "update_critic_s", "update_actor_s",
              "step_s"]
    result["phases_s"] = {k[:-2]: round(mean(k), 4) for k in phases if mean(k) is not None}
    if mean("overlap_s") is not None:  # more than one pool
        result["overlap_s"] = round(mean("overlap_s"), 4)
        result["idle_s"] = {k[len("idle_"):-2]: round(mean(k), 4) for k in rows[0]
                            if k.startswith("idle_")}
    result["per_iteration"] = [{k: (round(v, 4) if isinstance(v, float) else v)
                                for k, v in r.items() if k != "gen_replicas"} for r in rows]
    # generation
    gen_s = mean("generate_s")
    resp = mean("response_tokens")
    result["response_tokens"] = resp
    result["gen_tokens_per_s"] = round(resp / gen_s, 1)
    result["gen_tokens_per_s_per_replica"] = round(resp / gen_s / len(rows[0]["gen_replicas"]), 1)
    result["gen_replica_detail"] = rows[-1]["gen_replicas"]
    if rows[0]["gen_replicas"][0]["roofline_s"] is not None:
        roof = statistics.mean(r["gen_replicas"][0]["roofline_s"] for r in rows)
        result["gen_roofline_s"] = round(roof, 5)
        result["gen_roofline_fraction"] = round(roof / gen_s, 4)
    # training: (phase, FLOPs per position, FLOPs per output-layer position) of the passes that
    # ran. The actor's output layer (h V of N) runs over the response (and the column before it)
    # only, so its FLOPs count response tokens; the critic's value head replaces it and runs
    # over every position.
    n_params = matmul_params(cfg)
    head = cfg.vocab_size * cfg.hidden_size
    n_critic = n_params - head + cfg.hidden_size
    # a LoRA update's frozen base computes no weight gradients: forward + the input gradients
    k_update = 4 if args.lora_rank else 6
    passes = [p for p in (("update_actor", k_update * (n_params - head), k_update * head),
                          ("old_logprobs", 2 * (n_params - head), 2 * head),
                          ("ref_logprobs", 2 * (n_params - head), 2 * head),
                          ("values", 2 * n_critic, 0), ("update_critic", 6 * n_critic, 0))
              if mean(f"{p[0]}_s") is not None]
    peak = args.tp * args.pp * args.dp * result["matmul_tflops"] * 1e12
    result["matmul_params"] = n_params
    result["peak_flops_all_ranks"] = peak
    flops = {}
    for tag, key, logits in (("", "tokens_real", "response_tokens"),
                             ("padded_", "tokens_padded", "logits_padded")):
        tokens = mean(key)
        result[f"tokens_{tag or 'real_'}per_step".replace("__", "_")] = tokens
        flops[tag] = {k: body * tokens + out * mean(logits) for k, body, out in passes}
        for k, f in flops[tag].items():
            result[f"mfu_{tag}{k}"] = round(f / mean(f"{k}_s") / peak, 4)
        result[f"mfu_{tag}training"] = round(
            sum(flops[tag].values()) / sum(mean(f"{k}_s") for k in flops[tag]) / peak, 4)
        result[f"tflops_{tag}update_actor"] = round(
            flops[tag]["update_actor"] / mean("update_actor_s") / 1e12, 2)
    result["allocator"] = {k[len("memory/"):]: round(mean(k), 1) for k in rows[0]
                           if k.startswith("memory/")
                           and k.endswith(("_device_allocs", "_alloc_retries"))}
    result["padded_fraction"] = round(1 - mean("tokens_real") / mean("tokens_padded"), 4)
    result["reward_mean"] = round(mean("reward_mean"), 4)
    floors(result, rows, flops[""], n_params, peak, args)


def floors(result: dict, rows: list[dict], flops: dict[str, float], n_params: int, peak: float,
           args) -> None:
    """Each phase's floor at the rates measured in this run, their sum, and ``floor_ratio`` =
    the measured step / that sum (the module docstring defines them); ``flops``: each training
    and forward-only pass's FLOPs over the real tokens."""
    def mean(key):
        return mean_of(rows, key)

    out = {k: f / peak for k, f in flops.items()}
    # generation: replica 0's prefill and decode FLOPs at its devices' matmul rate, or the
    # decode steps' HBM roofline where that is longer
    replica = rows[-1]["gen_replicas"][0]
    gen_flops = 2 * n_params * (replica["rows"] * replica["prompt_width"]
                                + replica["response_tokens"])
    out["generate"] = max(gen_flops / (args.gen_tp * result["matmul_tflops"] * 1e12),
                          result.get("gen_roofline_s") or 0.0)
    # the switch: the bytes it received at the all-gather rate of the calibration, if given
    received = mean("reshard/bytes_received")
    if not received:  # nothing moved (or no switch: the hf backend)
        out["reshard"] = 0.0
    elif args.calibration is not None:
        from hybridflow.planner.rates import Calibration
        from hybridflow.planner.cost import gather_rate
        out["reshard"] = received / gather_rate(Calibration.from_json(args.calibration),
                                                result["gen_micro_dp"])
    result["floor_s"] = {k: round(v, 5) for k, v in out.items()}
    result["floor_s"]["step"] = round(sum(out.values()), 5)
    measured = sum(result["phases_s"][k] for k in out)
    result["floor_ratio"] = round(result["phases_s"]["step"] / sum(out.values()), 3)
    result["floor_ratio_phases"] = round(measured / sum(out.values()), 3)


# the estimate's phases (hybridflow.planner.memory) -> the worker calls that run in them
MEMORY_PHASES = {"generation": ("generation",),  # generate's, from the switch's release on
                 "inference": ("compute_log_prob", "compute_ref_log_prob", "compute_values"),
                 "actor update": ("update_actor",), "critic update": ("update_critic",)}
ACTOR_CALLS = ("generation", "compute_log_prob", "compute_ref_log_prob", "update_actor")
WORKER_ROLES = {"actor": ("actor", "rollout", "ref"), "critic": ("critic",)}


def memory_pairs(result: dict, rows: list[dict], cfg, shape: ModelConfig) -> None:
    """GPU only: per pool of GPUs and phase of the memory estimate, a GPU's measured peak beside
    the predicted bytes (``memory_gib``; keys "<phase>", or "<groups>: <phase>" where the worker
    groups have GPUs of their own). Measured: the largest ``memory/<call>_peak_gib`` of the pool's
    calls in the phase (the worker's allocator peak during the call, the fullest rank, any timed
    iteration), plus what the pool's other worker process holds between its calls (its
    ``_resident_gib``: PPO's critic, colocated). Predicted: ``estimate_memory``'s total of the
    GPU for the phase; ``workers`` splits both by worker process (the actor's holds the actor,
    rollout and reference roles). Neither side counts the CUDA context or the allocator's cached
    free blocks."""
    from hybridflow.planner.memory import GIB, estimate_memory
    if not any(k.startswith("memory/") for k in rows[0]):
        return
    pools = estimate_memory(cfg, {"model": shape}).pools

    def worst(key):
        vals = [r[key] for r in rows if key in r]
        return max(vals) if vals else None

    resident = {"actor": worst("memory/compute_ref_log_prob_resident_gib"),
                "critic": worst("memory/update_critic_resident_gib")}
    out = {}
    for pool in pools:
        for phase, calls in MEMORY_PHASES.items():
            measured = [(c, worst(f"memory/{c}_peak_gib")) for c in calls
                        if ("actor" if c in ACTOR_CALLS else "critic") in pool.groups]
            measured = [(c, v) for c, v in measured if v is not None]
            if phase not in pool.phases or not measured:
                continue
            call, peak = max(measured, key=lambda cv: cv[1])
            active = "actor" if call in ACTOR_CALLS else "critic"
            workers = {active: peak}
            for other in pool.groups:
                if other in WORKER_ROLES and other != active and resident[other] is not None:
                    workers[other] = resident[other]
            predicted = {w: sum(pool.role_bytes(phase, r) for r in WORKER_ROLES[w]
                                if r in pool.phases[phase]) / GIB for w in workers}
            total, want = sum(workers.values()), pool.total(phase) / GIB
            key = phase if len(pools) == 1 else f"{' + '.join(pool.groups)}: {phase}"
            out[key] = {"measured": round(total, 3), "predicted": round(want, 3),
                        "error": round(want / total - 1, 4), "call": call,
                        "workers": {w: {"measured": round(v, 3),
                                        "predicted": round(predicted[w], 3)}
                                    for w, v in workers.items()},
                        "parts": {r: {k: round(v / GIB, 3) for k, v in parts.items()}
                                  for r, parts in pool.phases[phase].items() if parts}}
    result["memory_gib"] = out
    if out:
        peak_phase = max(out, key=lambda k: out[k]["measured"])
        result["peak_memory_gib"] = {"phase": peak_phase, **{
            k: out[peak_phase][k] for k in ("measured", "predicted", "error")}}


def print_table(r: dict) -> None:
    p = r["phases_s"]
    print(f"\n{r['algorithm']} on {r['model']} ({r['dtype']}, {r['device']}), actor TP={r['actor_tp']}"
          f" PP={r['actor_pp']} DP={r['actor_dp']}"
          f", generation TP={r['gen_tp']} x {r['gen_replicas']} replicas, {r['train_batch_size']} "
          f"prompts x {r['n']}, {r['max_tokens']} new tokens; mean of {r['iters']} timed "
          "iterations")
    print("| phase | seconds |\n| --- | --- |")
    for k, v in p.items():
        print(f"| {k} | {v:.4f} |")
    print(f"generation: {r['response_tokens']:.0f} response tokens, {r['gen_tokens_per_s']:.0f} "
          f"tokens/s ({r['gen_tokens_per_s_per_replica']:.0f} per replica)"
          + (f"; decode-step HBM roofline {r['gen_roofline_s']:.4f} s at "
             f"{r['copy_bandwidth_gb_s']} GB/s = {r['gen_roofline_fraction']:.1%} of generate"
             if "gen_roofline_fraction" in r else ""))
    mfu = ", ".join(f"{k[4:].replace('_', ' ')} {v:.1%}" for k, v in r.items()
                    if k.startswith("mfu_") and not k.startswith(("mfu_padded", "mfu_training")))
    print(f"training: matmul {r['matmul_tflops']} TFLOP/s per device x "
          f"{r['actor_tp'] * r['actor_pp'] * r['actor_dp']} ranks; "
          f"MFU {mfu}; together {r['mfu_training']:.1%} "
          f"(padded tokens: {r['mfu_padded_training']:.1%}); padded tokens "
          f"{r['padded_fraction']:.1%} of {r['tokens_padded_per_step']:.0f} computed "
          "((computed - real) / computed)", flush=True)
    f = r["floor_s"]
    print("measured / floor s: " + ", ".join(f"{k} {p[k]:.3g} / {v:.3g}" for k, v in f.items())
          + f"; the step is {r['floor_ratio']:.2f}x the sum of its phases' floors "
          f"({r['floor_ratio_phases']:.2f}x for the phases alone)"
          + ("" if "reshard" in f else "; the switch's floor needs --calibration (its "
             "all-gather rate)"), flush=True)
    if r.get("memory_gib"):
        print("memory per GPU, measured / predicted GiB (allocator peak; estimate_memory): "
              + ", ".join(f"{k} {v['measured']:.2f} / {v['predicted']:.2f} ({v['error']:+.0%})"
                          for k, v in r["memory_gib"].items()), flush=True)


if __name__ == "__main__":
    from hybridflow.errors import ConfigError
    try:
        main()
    except ConfigError as e:  # a setting the run's checks refuse: one line, as hybridflow's CLI
        print(f"bench_rl_step: error: {e}", file=sys.stderr)
        sys.exit(2)
