#!/usr/bin/env python
"""What the RL worker's passes cost per micro-batch beyond the bare engine's, in one process
(world size 1, gloo on CPU, no Ray):

    python tools/bench_mb_cost.py                          # SmolLM2-135M's shape, 8 x 88, mb 1 4
    python tools/bench_mb_cost.py --kl-coef 0.04 --profile 15

One actor engine and one reference engine (no optimizer, frozen) of the model's shape with random
weights, and one RL batch as a DP=2 rank of the CPU quickstart holds it: ``--batch`` sequences of
a left-padded prompt of ``--prompt`` columns and a right-padded response of ``--response``
(seeded random lengths and tokens), random advantages. For each micro-batch size m, timed
interleaved, the median of ``--repeats`` after one warm-up:

* ``bare_s``: ``train_step`` with a trivial loss (minus the response's log-probs over the
  entries): the bare engine, as the calibration probe ran it before it trained with the actor's
  loss;
* ``actor_loss_s``: ``train_step`` with the actor's loss function (``actor_loss`` of the
  objective ``--kl-coef`` etc. give, bound as ``update_actor`` binds it);
* ``loss_only_s``: the same with the loss's metrics dropped (what handling them costs);
* ``update_s``: the worker's whole ``update_actor`` (``ActorRolloutRefWorker.update_actor`` on
  these engines: the denominator's all-reduce, the mini-batch split, the on-policy log-probs
  put back in the batch's order);
* ``loss_fn_s``: the seconds spent inside the actor's loss function (its forward) during one
  ``actor_loss_s`` step, summed over the micro-batches;
* ``ref_s``: the reference's ``compute_logprobs`` as ``compute_ref_log_prob`` runs it
  (``forward_micro_batch_size`` = m).

The per-micro-batch figure of each is (s(m=1) - s(m=M)) / (B/1 - B/M) for the largest M given.
``--profile N``: under torch.profiler, three ``bare`` steps at the largest m and at the smallest
(what the extra micro-batches add), then three ``bare`` and three ``actor_loss`` steps at the
smallest (what the actor's loss adds); for each pair the N operations whose self CPU time grew
most (noisy on a loaded machine; the added calls are exact). ``--passes`` times some of the
passes only. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


PASSES = ("bare_s", "loss_only_s", "actor_loss_s", "update_s", "ref_s")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_mb_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                    help="smollm2: SmolLM2-135M's shape (random weights); tiny: a smoke test")
    ap.add_argument("--batch", type=int, default=8, help="sequences (default 8)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt columns (default 64)")
    ap.add_argument("--response", type=int, default=24, help="response columns (default 24)")
    ap.add_argument("--micro-batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kl-coef", type=float, default=0.0,
                    help="actor.kl_loss_coef (k3): the update then reads ref_logprobs")
    ap.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES),
                    help="the passes to time (default: all)")
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    args = ap.parse_args(argv)
    bad = [m for m in args.micro_batch if m < 1 or args.batch % m]
    if bad:
        ap.error(f"--micro-batch {bad} must divide --batch {args.batch}")
    return args


def rl_batch(args, vocab: int) -> dict[str, torch.Tensor]:
    """A rollout's tensors (``rollout_batch``'s layout) with random lengths and tokens, and the
    advantages and reference log-probs the update reads."""
    g = torch.Generator().manual_seed(0)
    b, p, r = args.batch, args.prompt, args.response
    ids = torch.randint(0, vocab, (b, p + r), generator=g)
    mask, response = torch.zeros(b, p + r, dtype=torch.long), torch.zeros(b, p + r)
    for i in range(b):
        lp = int(torch.randint(p // 2, p + 1, (1,), generator=g))
        lr = int(torch.randint(1, r + 1, (1,), generator=g))
        mask[i, p - lp:p + lr] = 1
        response[i, p:p + lr] = 1
    adv = torch.randn(b, 1, generator=g).expand(b, p + r) * response  # GRPO: one per sequence
    ref = -torch.rand(b, p + r, generator=g) * 3 * response
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response,
            "advantages": adv.contiguous(), "ref_logprobs": ref}


def main(argv=None) -> dict:
    args = parse_args(argv)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from hybridflow.algorithms import ActorObjective, actor_loss, actor_loss_fn
    from hybridflow.batch import Batch
    from hybridflow.config.rl import ActorConfig
    from hybridflow.parallel.host import cpu_rank_settings
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.config import EngineConfig, OptimConfig
    from hybridflow.training.engine import TrainEngine
    from hybridflow.workers.actor import ActorRolloutRefWorker
    from hybridflow.workers.updates import denominator, logprob_batch

    cpu_rank_settings()  # as the RL workers run
    if args.model == "smollm2":
        from hybridflow.models.hf import load_hf_config
        from hybridflow.models.smollm2 import prepare_smollm2
        from hybridflow.models.source import cache_dir
        cfg = load_hf_config(prepare_smollm2(cache_dir()))
    else:
        from hybridflow.models.tiny import tiny_llama_config
        cfg = tiny_llama_config()
    engine_cfg = EngineConfig(micro_batch_size=args.micro_batch[0],
                              optim=OptimConfig(name="adam", lr=2e-5, clip_grad=1.0))
    actor_cfg = ActorConfig(engine=engine_cfg, kl_loss_coef=args.kl_coef)
    layout = TrainLayout()
    actor = TrainEngine(cfg, layout, engine_cfg)
    ref = TrainEngine(cfg, layout, engine_cfg, build_optimizer=False)
    data = rl_batch(args, cfg.vocab_size)
    keys = ("input_ids", "attention_mask", "response_mask", "advantages") + (
        ("ref_logprobs",) if args.kl_coef else ())
    batch = Batch({k: data[k] for k in keys})
    worker = SimpleNamespace(actor_cfg=actor_cfg, actor=actor, dp_group=actor.pg.dp)
    objective = ActorObjective.of(actor_cfg)
    denom = denominator(data["response_mask"], actor_cfg.loss_agg_mode, actor.pg.dp)
    inside = [0.0]

    kept: list = []
    update_loss = actor_loss_fn(objective, denom, kept)  # update_actor's, on-policy

    def timed_actor_loss(logprobs, mb):
        start = time.perf_counter()
        out = update_loss(logprobs, mb)
        inside[0] += time.perf_counter() - start
        return out

    def bare_loss(logprobs, mb):  # the bare engine's: no RL loss
        return -(logprobs * mb["response_mask"]).sum() / mb["response_mask"].numel(), {}

    def loss_only_fn(logprobs, mb):  # the same loss, its metrics dropped
        return actor_loss(logprobs, mb, denom, objective)[0], {}

    passes = {
        "bare_s": lambda: actor.train_step(batch.tensors, bare_loss),
        "loss_only_s": lambda: actor.train_step(batch.tensors, loss_only_fn),
        "actor_loss_s": lambda: actor.train_step(batch.tensors, timed_actor_loss),
        "update_s": lambda: ActorRolloutRefWorker.update_actor(worker, batch),
        "ref_s": lambda: ref.compute_logprobs(logprob_batch(batch)),
    }
    passes = {k: v for k, v in passes.items() if k in args.passes}
    rows = []
    for m in args.micro_batch:
        for engine in (actor, ref):
            engine.config.micro_batch_size = engine.config.forward_micro_batch_size = m
        samples: dict[str, list[float]] = {k: [] for k in passes}
        if "actor_loss_s" in passes:
            samples["loss_fn_s"] = []
        for fn in passes.values():
            fn()  # warm-up
        for _ in range(args.repeats):
            for name, fn in passes.items():
                kept.clear()
                inside[0] = 0.0
                start = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - start)
                if name == "actor_loss_s":
                    samples["loss_fn_s"].append(inside[0])
        row = {"micro_batch": m, **{k: round(statistics.median(v), 4)
                                    for k, v in samples.items()}}
        rows.append(row)
        print(f"micro-batch {m}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()
                                                if k != "micro_batch"), flush=True)
    lo, hi = rows[0], rows[-1]
    extra = args.batch // lo["micro_batch"] - args.batch // hi["micro_batch"]
    per_mb = {k: round((lo[k] - hi[k]) / extra, 5) for k in lo if k != "micro_batch"} \
        if extra else {}
    if per_mb:
        print(f"per micro-batch ({lo['micro_batch']} vs {hi['micro_batch']}, {extra} more): "
              + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in per_mb.items()), flush=True)
    result = {"bench": "mb_cost", "model": args.model, "batch": args.batch,
              "prompt": args.prompt, "response": args.response, "kl_coef": args.kl_coef,
              "repeats": args.repeats, "torch": torch.__version__, "sizes": rows,
              "per_micro_batch_s": per_mb}
    if args.profile:
        lo_m, hi_m = args.micro_batch[0], args.micro_batch[-1]
        result["profile_micro_batches"] = profile_growth(
            f"bare at micro-batch {hi_m} -> {lo_m}", actor, batch.tensors,
            [(hi_m, bare_loss), (lo_m, bare_loss)], args.profile)
        result["profile_loss"] = profile_growth(
            f"bare -> actor loss at micro-batch {lo_m}", actor, batch.tensors,
            [(lo_m, bare_loss), (lo_m, timed_actor_loss)], args.profile)
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    return result


def profile_growth(what: str, engine, batch, runs, top: int, steps: int = 3) -> list[dict]:
    """The ``top`` operations whose self CPU time (and calls) grew most from the first to the
    second of ``runs`` ((micro-batch size, loss function) each: ``steps`` profiled training
    steps), per step; printed under ``what``."""
    from torch.profiler import ProfilerActivity, profile
    ops = []
    for m, loss in runs:
        engine.config.micro_batch_size = m
        engine.train_step(batch, loss)  # warm
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                engine.train_step(batch, loss)
        ops.append({e.key: (e.self_cpu_time_total / 1e6 / steps, e.count // steps)
                    for e in prof.key_averages()})
    keys = set(ops[0]) | set(ops[1])
    growth = sorted(((ops[1].get(k, (0, 0))[0] - ops[0].get(k, (0, 0))[0],
                      ops[1].get(k, (0, 0))[1] - ops[0].get(k, (0, 0))[1], k) for k in keys),
                    reverse=True)
    total = [sum(s for s, _ in o.values()) for o in ops]
    print(f"profile, {what}: self CPU {total[0]:.4f} -> {total[1]:.4f} s a step; the "
          "operations that grew most:", flush=True)
    out = []
    for ds, dn, k in growth[:top]:
        print(f"  {ds * 1e3:8.2f} ms  {dn:+5d} calls  {k[:80]}", flush=True)
        out.append({"name": k[:90], "extra_s": round(ds, 5), "extra_calls": dn})
    return out


if __name__ == "__main__":
    main()
