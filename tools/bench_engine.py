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
the input embedding table); with LoRA adapters of A parameters 2 (N + A) and 4 N + 6 A (the
frozen base has no weight gradients). Small micro-batches pay Megatron's fixed host-side cost per
micro-batch (Python per layer, kernel launches), so the rate climbs with m until the device is
busy.

``--lora-rank 0 8`` builds the engine once per rank given (0: full fine-tuning; r > 0: LoRA
adapters of rank r on every linear, the base frozen) and reports beside the times what each holds
per rank after its training steps, counted from its tensors: ``weights`` (base and adapters),
``grads`` (Megatron's grad buffers), ``optimizer`` (Adam's moments and fp32 main weights), and on
a GPU the peak allocated bytes. The baseline of a LoRA row is the rank-0 row of the same run.
``--profile N``: one more training step per micro-batch size under ``torch.profiler``, and its
N most expensive operations by self time on the device (on CPU: by self CPU time), each with its
share of the step, and the device's busy time (the sum of its kernels) beside the unprofiled
step's wall time: ``idle`` = 1 - busy / wall is the share of the step the device waits for the
host (Python, launches, syncs). Where the time goes, for the MFU gap.
``--response R`` gives the batch a ``response_mask`` over each sequence's last R columns, as an
RL batch has: the engine then computes the output layer over those (and the column before) only,
and MFU counts the output layer's FLOPs over the R response tokens (the useful work).
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
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
from hybridflow.parallel.host import cpu_rank_settings  # noqa: E402
from hybridflow.profiling import print_profile, profile_step  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_engine", description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("tiny", "smollm2", *MODELS), default="tiny",
                    help="smollm2: SmolLM2-135M's shape (random weights, like the others)")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size (world = tp)")
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences per pass (default 64 on GPU, 16 on CPU)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 256 "
                    "on GPU, 64 on CPU)")
    ap.add_argument("--micro-batch", type=int, nargs="+", default=None,
                    help="micro-batch sizes to time (default 8 32 64 on GPU, 1 4 16 on CPU)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--response", type=int, default=0, metavar="R",
                    help="an RL batch's shape: the last R columns of each sequence are its "
                    "response (a response_mask the engine computes the output layer over, and "
                    "the loss's tokens); 0: no response_mask, every position (default)")
    ap.add_argument("--lora-rank", type=int, nargs="+", default=[0],
                    help="LoRA ranks to compare, 0 = full fine-tuning (default: 0)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile one training step per size and print its N costliest "
                    "operations and the device's idle share")
    args = ap.parse_args(argv)
    if any(r < 0 for r in args.lora_rank):
        ap.error(f"--lora-rank {args.lora_rank}: ranks are >= 0")
    gpu = torch.cuda.is_available()
    args.batch = args.batch or (64 if gpu else 16)
    args.seq = args.seq or (256 if gpu else 64)
    args.micro_batch = args.micro_batch or ([8, 32, 64] if gpu else [1, 4, 16])
    if not 0 <= args.response < args.seq:
        ap.error(f"--response {args.response} must be in [0, --seq {args.seq})")
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
        cpu_rank_settings()  # as the RL workers run
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


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memory(engine) -> dict[str, int]:
    """Bytes this rank's engine holds: weights, grad buffers, optimizer state (Adam's moments and
    any fp32 main weights that are not the model's own parameters)."""
    params = [p for c in engine.chunks for p in c.parameters()]
    own = {id(p) for p in params}
    state = []
    for part in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        inner = part.optimizer
        state += [p for g in inner.param_groups for p in g["params"] if id(p) not in own]
        state += [v for st in inner.state.values() for v in st.values()
                  if torch.is_tensor(v) and v.dim()]  # not the step counters
    return {"weights": _nbytes(params),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "grads": _nbytes(b.grad_data for c in engine.chunks for b in c.buffers),
            "optimizer": _nbytes(state)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    rank, world = _init_world()
    if world != args.tp:
        raise SystemExit(f"bench_engine: world size {world} != --tp {args.tp}")
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.config import EngineConfig, OptimConfig
    from hybridflow.training.engine import TrainEngine
    from hybridflow.training.lora import LoraConfig

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    rate = matmul_rate(device, 8192 if gpu else 1024, 50 if gpu else 5)
    if args.model == "smollm2":
        from hybridflow.models.hf import load_hf_config
        from hybridflow.models.smollm2 import prepare_smollm2
        from hybridflow.models.source import cache_dir
        cfg = load_hf_config(prepare_smollm2(cache_dir()))
    else:
        cfg = model_config(args.model)
    dtype = "bf16" if gpu else "fp32"
    engine_cfg = EngineConfig(dtype=dtype, micro_batch_size=args.micro_batch[0],
                              optim=OptimConfig(name="adam", lr=1e-6))
    full = init_full_weights(llama_param_metas(cfg), seed=0,
                             dtype=torch.bfloat16 if gpu else torch.float32)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g),
             "attention_mask": torch.ones(args.batch, args.seq, dtype=torch.long),
             "advantages": torch.randn(args.batch, args.seq, generator=g)}
    tokens = args.batch * args.seq
    if args.response:
        batch["response_mask"] = torch.zeros(args.batch, args.seq)
        batch["response_mask"][:, -args.response:] = 1
        batch["advantages"] *= batch["response_mask"]

    def loss_fn(logprobs, mb):  # a policy-gradient-shaped loss over every (response) token
        return -(logprobs * mb["advantages"]).sum() / tokens, {}

    n = matmul_params(cfg)
    peak = rate * world
    result = dict(bench="engine", model=args.model, tp=args.tp, dtype=dtype, batch=args.batch,
                  response=args.response,
                  seq=args.seq, repeats=args.repeats, torch=torch.__version__,
                  device=torch.cuda.get_device_name(0) if gpu else "cpu",
                  matmul_tflops=round(rate / 1e12, 4), matmul_params=n, engines=[])
    for lora_rank in args.lora_rank:
        engine = None
        gc.collect()  # Megatron's modules hold reference cycles: free the last engine first
        if gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        engine = TrainEngine(cfg, TrainLayout(tp=args.tp), engine_cfg,
                             lora=LoraConfig(rank=lora_rank))
        engine.load_full_weights(full)
        run = dict(lora_rank=lora_rank, sizes=[])
        # FLOPs per token: the forward 2 N, the backward 2 N for the inputs' gradients and 2 N
        # for the weights' -- with LoRA the frozen base has none, the adapters A add 6 A.
        a = sum(p.numel() for _, p in engine.adapters.named_parameters()) if lora_rank else 0
        fwd_flops, train_flops = 2 * (n + a) * tokens, (6 * (n + a) - 2 * n * bool(a)) * tokens
        if args.response:  # the output layer's useful work: over the response tokens only
            unused = cfg.hidden_size * cfg.vocab_size * args.batch * (args.seq - args.response)
            fwd_flops -= 2 * unused
            train_flops -= (4 if a else 6) * unused
        what = f"LoRA rank {lora_rank}" if lora_rank else "full fine-tuning"
        for m in args.micro_batch:
            engine.config.micro_batch_size = engine.config.forward_micro_batch_size = m
            fwd = _timed(lambda: engine.compute_logprobs(batch), args.repeats)
            train = _timed(lambda: engine.train_step(batch, loss_fn), args.repeats)
            row = dict(micro_batch=m, forward_s=round(fwd, 4), train_s=round(train, 4),
                       forward_mfu=round(fwd_flops / fwd / peak, 4),
                       train_mfu=round(train_flops / train / peak, 4))
            run["sizes"].append(row)
            if rank == 0:
                print(f"{what}, micro-batch {m:4d}: forward {fwd:.4f} s "
                      f"({row['forward_mfu']:.1%} MFU), train step {train:.4f} s "
                      f"({row['train_mfu']:.1%} MFU)", flush=True)
            if args.profile:
                row["profile"] = prof = profile_step(lambda: engine.train_step(batch, loss_fn),
                                                     train, args.profile)
                if rank == 0:
                    print_profile("that train step", prof)
        run["optimizer_s"] = round(_timed(engine.optimizer.step, args.repeats), 4)
        run["memory"] = memory(engine)
        if gpu:
            run["memory"]["peak_allocated"] = torch.cuda.max_memory_allocated()
        result["engines"].append(run)
        if rank == 0:
            mem = run["memory"]
            print(f"{what}: optimizer.step alone {run['optimizer_s']:.4f} s; per rank: "
                  f"{mem['trainable'] / 1e6:.2f}M trainable parameters, "
                  + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in mem.items()
                              if k != "trainable"), flush=True)
    if rank == 0:
        print(f"{args.model} TP={args.tp} on {result['device']}: {args.batch} x {args.seq} "
              f"tokens per pass; bound: matmul {result['matmul_tflops']} TFLOP/s per rank x "
              f"{world}", flush=True)
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
