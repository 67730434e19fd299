#!/usr/bin/env python
"""Time the training engine's passes at several micro-batch sizes: forward-only log-probs (what
the old/ref log-prob phases of an RL step run) and a training step.

    python tools/bench_engine.py --model tiny --micro-batch 1 4 16              # CPU smoke test
    python3 tools/bench_engine.py --model llama-0.9b --micro-batch 8 32 64       # one GPU
    torchrun --nproc-per-node 2 tools/bench_engine.py --model llama-0.9b --tp 2  # TP=2

One engine (random weights, bf16 on GPU, fp32 on CPU) and one batch of ``--batch`` sequences of
``--seq`` random tokens per data-parallel rank. For each micro-batch size m (it must divide
``--batch``): ``forward_s`` = ``compute_logprobs`` with ``forward_micro_batch_size`` = m;
``train_s`` = ``train_step`` (forward, backward, optimizer step) with ``micro_batch_size`` = m;
``optimizer_s`` = one ``optimizer.step()`` alone (the same for every m). Each is the median of
``--repeats`` timed calls after a warm-up, slowest rank.

The bound, measured in the same run: the matmul rate of one large ``torch.matmul`` (bf16 8192^3
per GPU; fp32 1024^3 on one CPU thread). MFU = FLOPs / (seconds x ranks x rate), FLOPs = 2 N
tokens for the forward, 6 N tokens for the training step, N = the parameters in matmuls (all but
the input embedding table). Small micro-batches pay Megatron's fixed host-side cost per
micro-batch (Python per layer, kernel launches), so the rate climbs with m until the device is
busy. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled
sys.path.insert(0, str(ROOT / "tools"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench_rl_step import MODELS, matmul_params, matmul_rate, model_config  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_engine", description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("tiny", *MODELS), default="tiny")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size (world = tp)")
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences per pass (default 64 on GPU, 16 on CPU)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 256 "
                    "on GPU, 64 on CPU)")
    ap.add_argument("--micro-batch", type=int, nargs="+", default=None,
                    help="micro-batch sizes to time (default 8 32 64 on GPU, 1 4 16 on CPU)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    args.batch = args.batch or (64 if gpu else 16)
    args.seq = args.seq or (256 if gpu else 64)
    args.micro_batch = args.micro_batch or ([8, 32, 64] if gpu else [1, 4, 16])
    bad = [m for m in args.micro_batch if m < 1 or args.batch % m]
    if bad:
        ap.error(f"--micro-batch {bad} must divide --batch {args.batch}")
    return args


def _init_world() -> tuple[int, int]:
    gpu = torch.cuda.is_available()
    if "RANK" in os.environ:  # torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl" if gpu else "gloo")
    else:
        rank, world = 0, 1
        if gpu:
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if gpu else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    if not gpu:
        torch.set_num_threads(1)  # as the RL workers run
    return rank, world


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up, slowest rank."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64,
                     device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main(argv=None) -> dict:
    args = parse_args(argv)
    rank, world = _init_world()
    if world != args.tp:
        raise SystemExit(f"bench_engine: world size {world} != --tp {args.tp}")
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.engine import EngineConfig, OptimConfig, TrainEngine

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    rate = matmul_rate(device, 8192 if gpu else 1024, 50 if gpu else 5)
    cfg = model_config(args.model)
    dtype = "bf16" if gpu else "fp32"
    engine_cfg = EngineConfig(dtype=dtype, micro_batch_size=args.micro_batch[0],
                              optim=OptimConfig(name="adam", lr=1e-6))
    engine = TrainEngine(cfg, TrainLayout(tp=args.tp), engine_cfg)
    engine.load_full_weights(init_full_weights(llama_param_metas(cfg), seed=0,
                                               dtype=torch.bfloat16 if gpu else torch.float32))
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g),
             "attention_mask": torch.ones(args.batch, args.seq, dtype=torch.long),
             "advantages": torch.randn(args.batch, args.seq, generator=g)}
    tokens = args.batch * args.seq

    def loss_fn(logprobs, mb):  # a policy-gradient-shaped loss over every token
        return -(logprobs * mb["advantages"]).sum() / tokens, {}

    n = matmul_params(cfg)
    peak = rate * world
    result = dict(bench="engine", model=args.model, tp=args.tp, dtype=dtype, batch=args.batch,
                  seq=args.seq, repeats=args.repeats, torch=torch.__version__,
                  device=torch.cuda.get_device_name(0) if gpu else "cpu",
                  matmul_tflops=round(rate / 1e12, 4), matmul_params=n, sizes=[])
    for m in args.micro_batch:
        engine.config.micro_batch_size = engine.config.forward_micro_batch_size = m
        fwd = _timed(lambda: engine.compute_logprobs(batch), args.repeats)
        train = _timed(lambda: engine.train_step(batch, loss_fn), args.repeats)
        row = dict(micro_batch=m, forward_s=round(fwd, 4), train_s=round(train, 4),
                   forward_mfu=round(2 * n * tokens / fwd / peak, 4),
                   train_mfu=round(6 * n * tokens / train / peak, 4))
        result["sizes"].append(row)
        if rank == 0:
            print(f"micro-batch {m:4d}: forward {fwd:.4f} s ({row['forward_mfu']:.1%} MFU), "
                  f"train step {train:.4f} s ({row['train_mfu']:.1%} MFU)", flush=True)
    result["optimizer_s"] = round(_timed(engine.optimizer.step, args.repeats), 4)
    if rank == 0:
        print(f"{args.model} TP={args.tp} on {result['device']}: {args.batch} x {args.seq} "
              f"tokens per pass; bound: matmul {result['matmul_tflops']} TFLOP/s per rank x "
              f"{world}; optimizer.step alone {result['optimizer_s']:.4f} s", flush=True)
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
