#!/usr/bin/env python
"""Generation ahead of training against the sync loop, on tools/bench_vs_trl.py's CPU workload
(SmolLM2-135M, 8 prompts x 4 samples, 64 tokens; ``WORKLOAD``), one run after the other:

* ``sync``: the quickstart's loop at DP=2 (two ranks that train and, switching layouts, generate
  as two vLLM replicas);
* ``one_step_off``: the actor (and reference) on a single-rank pool, vLLM on another single-rank
  pool one batch ahead (docs/async.md);
* ``async2``: the same with ``rollout.mode=async rollout.max_staleness=2``;
* ``async2_partial``: the same with partial rollouts (``rollout.partial=true``, chunks of a
  quarter of ``max_tokens``): the generation pool one batch ahead, its unfinished responses
  continued under the next weights.

``--workload length_spread`` asks for the reasoning before the number (``LENGTH_SPREAD``), 4
prompts x 4 samples of up to 192 tokens: responses from a few tokens to the limit, the case where
a batch's generation waits for its longest responses and partial rollouts cut that tail. On
2 CPU cores training SmolLM2 takes longer than generating for it, so the step is training's
whatever the generation does; ``--workload length_tail`` is generation-bound: a random
tiny-llama (training costs little) whose responses end at any of 16 of its 512 tokens, so their
lengths are geometric (mean about 32, a long tail up to the 256 tokens allowed).

    flock /tmp/hf-heavy.lock python tools/bench_async.py [--steps 6] [--modes sync,one_step_off]
    flock /tmp/hf-heavy.lock python tools/bench_async.py --workload length_spread --modes async2,async2_partial

Per mode: the median ``timing/step_s`` over the steps after the first (warm-up), the medians of
``timing/generate_s``, ``timing/overlap_s``, the idle seconds of each pool (``timing/idle_train_s``,
``timing/idle_gen_s``) and ``weight_sync/s`` where the run logs them, the staleness, and
``reward/mean`` and ``response_length/mean`` per step. The last stdout line is one
JSON object: ``{"workload", "steps", "modes": {mode: {"median_step_s", "step_s", "phases_s",
"reward_mean", "staleness_mean"}}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_trl import (BASE_CONFIG, ROOT, WORKLOAD, _read_jsonl, _stream,  # noqa: E402
                          hybridflow_overrides, median_after_warmup)

TWO_POOLS = ["actor.layout.dp=1", "placement.pools.train.devices_per_node=1",
             "placement.pools.gen.devices_per_node=1", "placement.models.actor=train",
             "placement.models.reference=train", "placement.models.rollout=gen"]
MODES = {
    "sync": [],
    "one_step_off": ["rollout.mode=one_step_off", *TWO_POOLS],
    "async2": ["rollout.mode=async", "rollout.max_staleness=2", *TWO_POOLS],
    "async2_partial": ["rollout.mode=async", "rollout.max_staleness=2", "rollout.partial=true",
                       *TWO_POOLS],
}
"""Mode -> its overrides of the workload at DP=2."""
LENGTH_SPREAD = ['data.system_prompt="Explain your reasoning step by step, then give the final '
                 'number."', "rollout.sampling.max_tokens=192", "train_batch_size=4"]
LENGTH_TAIL = ["model=tiny-llama", "rollout.sampling.max_tokens=256", "train_batch_size=4",
               "rollout.sampling.stop_token_ids=[" + ",".join(map(str, range(0, 512, 32))) + "]"]
WORKLOADS = {"arithmetic": [], "length_spread": LENGTH_SPREAD, "length_tail": LENGTH_TAIL}
"""Workload -> its overrides of bench_vs_trl's ``WORKLOAD``."""
SECONDS = ("weight_sync/s", "weight_sync/verify_s")
"""The push's seconds, beside the ``timing/*_s``."""


def run_mode(mode: str, workload: str, steps: int, micro_batch: int, workdir: Path) -> dict:
    """One run of ``mode`` on ``workload``: its medians (see the module docstring)."""
    name = f"bench-async-{mode}"
    cmd = [sys.executable, "-m", "hybridflow.cli", "train", str(BASE_CONFIG),
           *hybridflow_overrides("dp2", steps, micro_batch, str(workdir), name),
           *WORKLOADS[workload], *MODES[mode]]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline",
               PYTHONPATH=str(ROOT))
    _stream(cmd, env, mode)
    rows = [r for r in _read_jsonl(workdir / name / "metrics.jsonl") if "timing/step_s" in r]
    keys = sorted({k for r in rows for k in r if k.startswith("timing/") and k.endswith("_s")
                   or k in SECONDS})
    phases = {k: median_after_warmup([r[k] for r in rows if k in r]) for k in keys}
    return {"median_step_s": phases.pop("timing/step_s", None),
            "step_s": [r["timing/step_s"] for r in rows], "phases_s": phases,
            "reward_mean": [r.get("reward/mean") for r in rows],
            "response_length_mean": [r.get("response_length/mean") for r in rows],
            "staleness_mean": [r.get("rollout/staleness_mean", 0.0) for r in rows],
            "dropped": [r.get("rollout/dropped", 0.0) for r in rows]}


def report(result: dict) -> str:
    shown = ("timing/generate_s", "timing/update_actor_s", "timing/overlap_s",
             "timing/idle_train_s", "timing/idle_gen_s", "weight_sync/s")
    lines = [f"{'mode':<16}{'step s':>8}" + "".join(f"{k.removeprefix('timing/'):>16}" for k in shown)
             + "  reward/mean per step"]
    for mode, r in result["modes"].items():
        cells = "".join(f"{r['phases_s'].get(k) or 0:>16.2f}" for k in shown)
        rewards = " ".join(f"{x:.2f}" for x in r["reward_mean"])
        lines.append(f"{mode:<16}{r['median_step_s'] or 0:>8.2f}{cells}  {rewards}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--modes", default="sync,one_step_off,async2",
                   help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="arithmetic")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"bench_async: --modes: unknown {unknown}; use {', '.join(MODES)}")
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        result = {"workload": WORKLOAD, "overrides": WORKLOADS[args.workload],
                  "steps": args.steps,
                  "modes": {m: run_mode(m, args.workload, args.steps, args.micro_batch, Path(tmp))
                            for m in modes}}
    print(report(result), flush=True)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
