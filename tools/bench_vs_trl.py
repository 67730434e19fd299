#!/usr/bin/env python
"""The same CPU GRPO workload in hybridflow and in TRL's GRPOTrainer, side by side: median
seconds per step of each, phase by phase, and the ratio hybridflow / TRL.

    python3 -m venv /work/trl-venv                  # a scratch venv: TRL is not a dependency
    /work/trl-venv/bin/pip install torch==2.13.0
    /work/trl-venv/bin/pip install "trl==1.16.*" transformers==5.19.0 reasoning-gym==0.1.25
    python tools/bench_vs_trl.py --trl-python /work/trl-venv/bin/python [--layout pp2|dp2] \\
        [--steps 4] [--set actor.layout.last_stage_layers=13 ...]

The work (``WORKLOAD``): SmolLM2-135M-Instruct in fp32 (the checkpoint hybridflow prepares for
``model: smollm2``, loaded by both sides from the same directory), reasoning-gym basic_arithmetic
with two one-digit terms and + - *, the system prompt of experiments/smollm2/base.yaml, 8 prompts
x 4 samples per step, temperature 1, at most 64 new tokens, Adam at lr 5e-6 with gradient clip
1.0, the k3 KL loss with coefficient 0.04, the loss a token-mean over the step's 32 samples, the
reward reasoning-gym's own score (hybridflow's ``reward: reasoning_gym``). Both sides see the same
prompts in the same order: the TRL side builds them with hybridflow's own functions
(``reasoning_gym_prompts``, ``tokenize_prompts``, ``PromptSampler``; none imports Megatron or Ray)
and walks them unshuffled.

* hybridflow: ``hybridflow train experiments/smollm2/base.yaml`` with the overrides of
  ``hybridflow_overrides`` (one thread per rank, as in the quickstart); ``--layout pp2`` is the
  quickstart's actor layout (PP=2), ``dp2`` is DP=2; generation TP=1 either way, so 2 vLLM
  replicas; ``--set KEY=VALUE`` adds an override of the layout or of how passes are batched
  (``SETTABLE``; the work itself stays ``WORKLOAD``). Per step: ``timing/*_s`` of its
  metrics.jsonl (``step`` is the whole iteration; ``generate``, ``reshard``, ``weight_load``,
  ``rollout_sleep``, ``back_to_train`` are replica 0's worker's; ``reward``, ``ref_logprobs``,
  ``advantages``, ``update_actor`` the controller's).
* TRL: ``GRPOTrainer`` in one process with 2 torch threads, transformers ``generate`` (no vLLM),
  the config of ``trl_config_kwargs``: ``loss_type="dapo"`` (TRL's token-mean over the whole
  accumulated batch), constant lr, no gradient checkpointing (``--trl-gradient-checkpointing``
  turns TRL's default back on). Per step: the time from ``on_step_begin`` to ``on_step_end``;
  phases from TRL's own profiling contexts: ``generate`` (``transformers.generate``), ``reward``,
  ``ref_forward`` (the reference log-probs), ``prepare`` (all of ``_prepare_inputs``: the three
  before plus advantages), ``policy_forward`` (``compute_loss``: the policy's forward and the
  loss), ``optimizer`` (clip + ``optimizer.step``), and ``backward`` = step - prepare -
  policy_forward - optimizer (the backward and the trainer's glue).

Every median is over the steps after the first (warm-up); ``--steps`` per side, default 4. The
sides run one after the other, never at once. The last stdout line is one JSON object:
``{"workload", "layout", "hybridflow": {"median_step_s", "steps", "phases_s", "reward_mean"},
"trl": {...the same, "version"}, "ratio"}`` with ``ratio`` = hybridflow / TRL median step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Only the standard library up here: the TRL side runs this file with the TRL venv's Python.
ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = ROOT / "experiments" / "smollm2" / "base.yaml"

WORKLOAD = {
    "model": "smollm2",
    "task": "basic_arithmetic",
    "task_kwargs": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                    "operators": ["+", "-", "*"]},
    "data_size": 400,  # base.yaml's data.size
    "data_seed": 0,
    "system_prompt": "Reply with only the final number.",  # base.yaml's
    "max_prompt_tokens": 64,  # base.yaml's
    "prompts": 8,
    "n": 4,
    "max_tokens": 64,
    "temperature": 1.0,
    "lr": 5e-6,
    "clip_grad": 1.0,
    "kl_coef": 0.04,
    "kl_type": "k3",
    "loss_agg": "token-mean",
}
LAYOUTS = {"pp2": {"pp": 2, "dp": 1}, "dp2": {"pp": 1, "dp": 2}}
TRL_THREADS = 2


def median_after_warmup(values: list[float]) -> float | None:
    """The median of ``values`` without the first (warm-up); None with fewer than two."""
    return statistics.median(values[1:]) if len(values) > 1 else None


def hybridflow_overrides(layout: str, steps: int, micro_batch: int | None, out_dir: str,
                         name: str) -> list[str]:
    """``key=value`` overrides of experiments/smollm2/base.yaml that give ``WORKLOAD``; None as
    ``micro_batch``: no micro-batch size (a token budget forms the micro-batches)."""
    w, lay = WORKLOAD, LAYOUTS[layout]
    return [
        f"name={name}", "algorithm.name=grpo", f"steps={steps}",
        f"data.tasks=[{w['task']}]",
        f"data.task_kwargs={{{w['task']}: {json.dumps(w['task_kwargs'])}}}",
        f"data.size={w['data_size']}", f"data.seed={w['data_seed']}",
        f"data.system_prompt={json.dumps(w['system_prompt'])}",
        f"data.max_prompt_tokens={w['max_prompt_tokens']}",
        f"train_batch_size={w['prompts']}", f"rollout.sampling.n={w['n']}",
        f"rollout.sampling.max_tokens={w['max_tokens']}",
        f"rollout.sampling.temperature={w['temperature']}", "rollout.tp=1",
        "actor.layout.tp=1", f"actor.layout.pp={lay['pp']}", f"actor.layout.dp={lay['dp']}",
        *([] if micro_batch is None else [f"actor.engine.micro_batch_size={micro_batch}"]),
        f"actor.engine.optim.lr={w['lr']}", f"actor.engine.optim.clip_grad={w['clip_grad']}",
        f"actor.kl_loss_coef={w['kl_coef']}", f"actor.kl_loss_type={w['kl_type']}",
        f"actor.loss_agg_mode={w['loss_agg']}",
        "checkpoint.every=0", f"tracking.out_dir={out_dir}",
    ]


def trl_config_kwargs(steps: int, micro_batch: int, output_dir: str,
                      gradient_checkpointing: bool = False) -> dict:
    """GRPOConfig's arguments for ``WORKLOAD``. TRL 1.x counts completions, not prompts, in
    ``per_device_train_batch_size``; one optimizer step takes ``gradient_accumulation_steps`` of
    them, and one generation (``steps_per_generation`` defaults to the accumulation) makes that
    whole step's completions: 8 prompts x 4."""
    w = WORKLOAD
    completions = w["prompts"] * w["n"]
    if micro_batch < 1 or completions % micro_batch:
        raise ValueError(f"--micro-batch {micro_batch} must divide the {completions} completions "
                         f"of a step")
    return dict(
        output_dir=output_dir, max_steps=steps, use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=completions // micro_batch,
        num_generations=w["n"], max_completion_length=w["max_tokens"],
        temperature=w["temperature"], top_p=1.0, top_k=0,
        learning_rate=w["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=w["clip_grad"],
        beta=w["kl_coef"], loss_type="dapo", num_iterations=1, scale_rewards="group",
        use_vllm=False, gradient_checkpointing=gradient_checkpointing,
        shuffle_dataset=False, seed=w["data_seed"], logging_steps=1, report_to="none",
        save_strategy="no", dataloader_num_workers=0, log_completions=False,
    )


def completions_per_step(kwargs: dict, num_processes: int = 1) -> tuple[int, int]:
    """(completions, distinct prompts) of one TRL optimizer step for ``kwargs``, by TRL 1.x's
    rule: per-device batch x processes x accumulation steps, in groups of num_generations."""
    completions = (kwargs["per_device_train_batch_size"] * num_processes
                   * kwargs["gradient_accumulation_steps"])
    return completions, completions // kwargs["num_generations"]


# ------------------------------------------------------------------------------------------------
# the hybridflow side (this venv)


# What ``--set`` may change on the hybridflow side: how the work is laid out and run, not the work.
SETTABLE = ("actor.layout.", "actor.engine.forward_micro_batch_size",
            "actor.engine.max_tokens_per_micro_batch")


def check_settable(items: list[str]) -> list[str]:
    """``--set`` items as given, or a ValueError naming the first that is not ``key=value`` or
    whose key would change the compared work (``WORKLOAD``) rather than its layout."""
    for item in items:
        key, eq, _ = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. "
                             "actor.layout.last_stage_layers=13")
        if not key.startswith(SETTABLE):
            raise ValueError(f"--set {key}: only the layout and how passes are batched may "
                             f"differ from TRL's side (keys starting {', '.join(SETTABLE)})")
    return items


def hybridflow_config(workdir: Path, extra: list[str]) -> tuple[Path, bool]:
    """(the config file the hybridflow side trains, whether it has a micro-batch size):
    experiments/smollm2/base.yaml; with a token budget among the ``--set`` items a copy of it in
    ``workdir`` without ``actor.engine.micro_batch_size``, since the budget forms every
    micro-batch and the run config refuses both."""
    if not any(item.startswith("actor.engine.max_tokens_per_micro_batch=") for item in extra):
        return BASE_CONFIG, True
    import yaml  # deferred: this file also runs in the TRL venv
    cfg = yaml.safe_load(BASE_CONFIG.read_text())
    del cfg["actor"]["engine"]["micro_batch_size"]
    path = workdir / "base_budget.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path, False


def run_hybridflow(layout: str, steps: int, micro_batch: int, workdir: Path,
                   extra: list[str] = ()) -> dict:
    name = f"bench-vs-trl-{layout}"
    config, sized = hybridflow_config(workdir, list(extra))
    cmd = [sys.executable, "-m", "hybridflow.cli", "train", str(config),
           *hybridflow_overrides(layout, steps, micro_batch if sized else None, str(workdir),
                                 name), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline")
    _stream(cmd, env, "hybridflow")
    rows = [r for r in _read_jsonl(workdir / name / "metrics.jsonl") if "timing/step_s" in r]
    keys = sorted({k for r in rows for k in r if k.startswith("timing/") and k.endswith("_s")})
    phases = {k[len("timing/"):-2]: median_after_warmup([r[k] for r in rows if k in r])
              for k in keys}
    return {"median_step_s": phases.pop("step", None), "steps": len(rows),
            "step_s": [r["timing/step_s"] for r in rows], "phases_s": phases,
            "reward_mean": [r.get("reward/mean") for r in rows]}


def _stream(cmd: list[str], env: dict, tag: str) -> None:
    """Run ``cmd``, echoing its output line by line under ``[tag]``; raise if it fails."""
    print(f"[{tag}] $ {' '.join(cmd)}", flush=True)
    with subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace") as proc:
        for line in proc.stdout:
            for part in line.rstrip("\n").split("\r"):  # tqdm redraws with \r
                if part.strip():
                    print(f"[{tag}] {part}", flush=True)
    if proc.returncode:
        raise SystemExit(f"bench_vs_trl: the {tag} side failed (exit {proc.returncode})")


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_trl_side(trl_python: str, model_dir: Path, steps: int, micro_batch: int,
                 workdir: Path, gradient_checkpointing: bool) -> dict:
    out = workdir / "trl_result.json"
    cmd = [trl_python, str(Path(__file__).resolve()), "--side", "trl", "--model-dir",
           str(model_dir), "--steps", str(steps), "--micro-batch", str(micro_batch),
           "--workdir", str(workdir / "trl"), "--result", str(out)]
    if gradient_checkpointing:
        cmd.append("--trl-gradient-checkpointing")
    threads = str(TRL_THREADS)
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
    env.pop("PYTHONPATH", None)  # nothing of this venv's site-packages on the TRL side
    _stream(cmd, env, "trl")
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------------------------
# the TRL side (the TRL venv: torch, transformers, trl, reasoning_gym; hybridflow's data and reward
# modules from this checkout)


def trl_main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(TRL_THREADS)
    sys.path.insert(0, str(ROOT))
    import trl
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from hybridflow.data.loader import PromptSampler, tokenize_prompts
    from hybridflow.data.prompts import reasoning_gym_prompts
    from hybridflow.rewards import reasoning_gym_reward_fn

    w = WORKLOAD
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    items = reasoning_gym_prompts([w["task"]], size=w["data_size"], seed=w["data_seed"],
                                  task_kwargs={w["task"]: w["task_kwargs"]},
                                  system_prompt=w["system_prompt"])
    items, _ = tokenize_prompts(items, tokenizer, w["max_prompt_tokens"])
    # hybridflow's trainer draws its batches so (validation off: no held-out split).
    sampler = PromptSampler(len(items), w["prompts"], seed=w["data_seed"], shuffle=True)
    order = [i for _ in range(args.steps) for i in next(sampler)]
    dataset = Dataset.from_list([{"prompt": items[i].messages, "reference": items[i].reference,
                                  "entry": json.dumps(items[i].extra)} for i in order])

    def reasoning_gym_reward(prompts, completions, reference, entry, **_):
        return [reasoning_gym_reward_fn({"reference": ref, "extra": json.loads(e)},
                                        c[0]["content"] if isinstance(c, list) else c)
                for c, ref, e in zip(completions, reference, entry)]

    timer = _TrlPhases()
    timer.install(profiling.ProfilingContext)
    kwargs = trl_config_kwargs(args.steps, args.micro_batch, args.workdir,
                               args.trl_gradient_checkpointing)
    config = GRPOConfig(**kwargs, model_init_kwargs={"dtype": torch.float32})
    completions, prompts = completions_per_step(kwargs)
    print(f"TRL {trl.__version__}, transformers {transformers.__version__}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; one step = {prompts} prompts "
          f"x {w['n']} = {completions} completions in {kwargs['gradient_accumulation_steps']} "
          f"micro-batches of {args.micro_batch}; generation batch {config.generation_batch_size}",
          flush=True)
    trainer = GRPOTrainer(model=args.model_dir, reward_funcs=reasoning_gym_reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer,
                          callbacks=[timer.callback(transformers.TrainerCallback)])
    trainer.train()
    steps = timer.steps
    phases = {k: median_after_warmup([s[k] for s in steps]) for k in steps[0]} if steps else {}
    result = {"median_step_s": phases.pop("step", None), "steps": len(steps),
              "step_s": [s["step"] for s in steps], "phases_s": phases,
              "reward_mean": timer.rewards, "version": trl.__version__,
              "gradient_checkpointing": args.trl_gradient_checkpointing}
    Path(args.result).write_text(json.dumps(result))


class _TrlPhases:
    """Seconds per optimizer step of TRL, split by TRL's own profiling contexts (which log only to
    W&B/MLflow/Trackio; here their ``__enter__``/``__exit__`` are wrapped to keep the durations)."""

    def __init__(self):
        self.stack: list[tuple[str, float]] = []
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self.rewards: list[float | None] = []

    def install(self, cls) -> None:
        enter, exit_ = cls.__enter__, cls.__exit__
        phases = self

        def __enter__(ctx):
            phases.stack.append((ctx.name, time.perf_counter()))
            return enter(ctx)

        def __exit__(ctx, *exc):
            name, start = phases.stack.pop()
            phases._add(name, time.perf_counter() - start, [n for n, _ in phases.stack])
            return exit_(ctx, *exc)

        cls.__enter__, cls.__exit__ = __enter__, __exit__

    def _add(self, name: str, seconds: float, outer: list[str]) -> None:
        short = name.rsplit(".", 1)[-1] if name.startswith("GRPOTrainer.") else name
        key = {"generate": "generate", "_calculate_rewards": "reward",
               "_prepare_inputs": "prepare", "compute_loss": "policy_forward"}.get(short)
        if short == "_get_per_token_logps_and_entropies":
            inside_loss = any(n.endswith("compute_loss") for n in outer)
            key = None if inside_loss else "ref_forward"
        if key is not None:
            self.current[key] = self.current.get(key, 0.0) + seconds

    def callback(self, base):
        phases = self

        class StepTimer(base):
            def on_step_begin(self, args, state, control, **kw):
                phases.current, phases.start = {}, time.perf_counter()

            def on_pre_optimizer_step(self, args, state, control, **kw):
                phases.optim_start = time.perf_counter()

            def on_optimizer_step(self, args, state, control, **kw):
                phases.current["optimizer"] = time.perf_counter() - phases.optim_start

            def on_step_end(self, args, state, control, **kw):
                c = phases.current
                c["step"] = time.perf_counter() - phases.start
                for k in ("generate", "reward", "ref_forward", "prepare", "policy_forward"):
                    c.setdefault(k, 0.0)
                c["backward"] = c["step"] - c["prepare"] - c["policy_forward"] - c["optimizer"]
                phases.steps.append(dict(c))
                print(f"step {state.global_step}: {c['step']:.1f}s (" + ", ".join(
                    f"{k} {v:.1f}" for k, v in c.items() if k != "step") + ")", flush=True)

            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "reward" in logs:
                    phases.rewards.append(logs["reward"])

        return StepTimer()


# ------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_vs_trl",
                                 description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--trl-python", default=None, metavar="PATH",
                    help="the Python of a venv with trl, transformers, torch and reasoning-gym")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="pp2",
                    help="hybridflow's actor layout: pp2 (the quickstart's) or dp2")
    ap.add_argument("--steps", type=int, default=4, help="steps per side; the first is warm-up")
    ap.add_argument("--micro-batch", type=int, default=4,
                    help="training micro-batch (sequences) of both sides (base.yaml's 4)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="set",
                    help="an override of the hybridflow side's layout or batching (repeatable), "
                         "e.g. actor.layout.last_stage_layers=13")
    ap.add_argument("--sides", default="hybridflow,trl",
                    help="comma-separated: which sides to run (default both)")
    ap.add_argument("--trl-gradient-checkpointing", action="store_true",
                    help="TRL's default gradient checkpointing (off here: hybridflow has none)")
    ap.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir)")
    ap.add_argument("--side", choices=("trl",), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if unknown := set(args.sides) - {"hybridflow", "trl"}:
        ap.error(f"--sides: unknown {sorted(unknown)}; hybridflow, trl")
    if args.steps < 2:
        ap.error("--steps must be >= 2: the first step is warm-up")
    try:
        check_settable(args.set)
    except ValueError as e:
        ap.error(str(e))
    if args.side is None and "trl" in args.sides and not args.trl_python:
        ap.error("--trl-python PATH is needed for the TRL side (or --sides hybridflow)")
    if args.side == "trl" and not (args.model_dir and args.workdir and args.result):
        ap.error("--side trl needs --model-dir, --workdir and --result")
    return args


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def report(result: dict) -> str:
    """The table of both sides, their phases and the ratio."""
    lines = ["| side | median step s | steps |", "| --- | --- | --- |"]
    for side in ("hybridflow", "trl"):
        if side in result:
            label = f"hybridflow ({' '.join([result['layout'], *result.get('set', [])])})" \
                if side == "hybridflow" else \
                f"TRL {result['trl'].get('version', '')}"
            lines.append(f"| {label} | {_fmt(result[side]['median_step_s'])} | "
                         f"{result[side]['steps']} |")
    for side in ("hybridflow", "trl"):
        if side in result:
            lines.append(f"{side} phases (median s): " + ", ".join(
                f"{k} {_fmt(v)}" for k, v in result[side]["phases_s"].items()))
    if result.get("ratio") is not None:
        lines.append(f"hybridflow / TRL: {result['ratio']:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.side == "trl":
        trl_main(args)
        return None
    sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled
    from hybridflow.models.source import resolve_model

    model_dir = resolve_model(WORKLOAD["model"])
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="bench_vs_trl-")
    workdir = Path(args.workdir or tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict = {"workload": WORKLOAD, "layout": args.layout, "micro_batch": args.micro_batch,
                    "set": args.set,
                    "model_dir": str(model_dir), "load_avg_before": os.getloadavg()[0]}
    try:
        if "hybridflow" in args.sides:
            result["hybridflow"] = run_hybridflow(args.layout, args.steps, args.micro_batch,
                                                  workdir, args.set)
        if "trl" in args.sides:
            result["trl"] = run_trl_side(args.trl_python, model_dir, args.steps,
                                         args.micro_batch, workdir,
                                         args.trl_gradient_checkpointing)
    finally:
        if tmp is not None:
            tmp.cleanup()
    h, t = result.get("hybridflow", {}), result.get("trl", {})
    result["ratio"] = (h["median_step_s"] / t["median_step_s"]
                       if h.get("median_step_s") and t.get("median_step_s") else None)
    result["load_avg_after"] = os.getloadavg()[0]
    print(report(result), flush=True)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
