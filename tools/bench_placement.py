#!/usr/bin/env python
"""PPO with the actor side and the critic side on pools of their own (``placement.preset:
split``) against every model on the same devices (``colocate``), the same work on the same
number of ranks, side by side in one run.

    python tools/bench_placement.py                       # SmolLM2-135M, CPU, 2 ranks
    python tools/bench_placement.py --model llama-0.9b --device cuda --ranks 2   # 2 GPUs

With R ranks: ``colocate`` puts the actor, reference and critic at dp=R on all R ranks, their
calls taking turns; ``split`` gives the actor and reference R/2 ranks and the critic the other
R/2, each at dp=R/2, so the critic's values run beside the log-probs and its update beside the
actor's (on a CPU, a rank is a process with one thread: R ranks use R cores either way). Each
placement runs in a process of its own (``tools/bench_rl_step.py``, its warm-up and timed
iterations); the table gives the step and its phases, the time both pools were busy at once
(``overlap``) and each pool's idle time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("generate_call", "score_call", "update_call", "old_logprobs", "ref_logprobs", "values",
          "update_critic", "update_actor", "step")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_placement", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="bench_rl_step's --model")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--ranks", type=int, default=2, help="ranks (devices) of both placements")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--json-out", default=None, help="write both results here")
    ap.add_argument("rest", nargs=argparse.REMAINDER,
                    help="after --: more bench_rl_step arguments for both runs")
    args = ap.parse_args(argv)
    if args.ranks < 2 or args.ranks % 2:
        ap.error("--ranks must be even and >= 2 (split halves them)")
    return args


def run(args, placement: str, dp: int, out: Path) -> dict:
    """bench_rl_step on ``placement`` at dp ``dp`` for every model, in a process of its own."""
    cmd = [sys.executable, str(ROOT / "tools/bench_rl_step.py"), "--model", args.model,
           "--device", args.device, "--algorithm", "ppo", "--tp", "1", "--pp", "1",
           "--dp", str(dp), "--placement", placement, "--warmup", str(args.warmup),
           "--iters", str(args.iters), "--json-out", str(out),
           *[a for a in args.rest if a != "--"]]
    print(f"== {placement}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def main(argv=None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = {"colocate": run(args, "colocate", args.ranks, Path(tmp) / "colocate.json"),
                   "split": run(args, "split", args.ranks // 2, Path(tmp) / "split.json")}
    c, s = (results[k]["phases_s"] for k in ("colocate", "split"))
    print(f"\nPPO on {args.model} ({args.device}), {args.ranks} ranks; colocate: every model at "
          f"dp={args.ranks} on all; split: actor + reference at dp={args.ranks // 2}, critic at "
          f"dp={args.ranks // 2}, apart. Seconds, mean of {args.iters} timed iterations:")
    print("| phase | colocate | split | split / colocate |\n| --- | --- | --- | --- |")
    for phase in PHASES:
        if phase in c or phase in s:
            cv, sv = c.get(phase), s.get(phase)
            ratio = f"{sv / cv:.2f}" if cv and sv else "-"
            print(f"| {phase} | {cv if cv is not None else '-'} | "
                  f"{sv if sv is not None else '-'} | {ratio} |")
    split = results["split"]
    print(f"split: both pools busy at once {split['overlap_s']:.3f} s of the step; idle "
          + ", ".join(f"{pool} {v:.3f} s" for pool, v in split["idle_s"].items()))
    print(f"step: split {s['step']:.3f} s against colocate {c['step']:.3f} s (the baseline): "
          f"{s['step'] / c['step']:.2f}x", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results) + "\n")
    return results


if __name__ == "__main__":
    main()
