"""The RL driver: one controller, worker groups on Ray, and an iteration that reads top to bottom.

    generate -> reward -> old/ref log-probs (and values) -> advantages -> critic update
             -> actor update -> (the actor switches layouts inside the next generate)

``RLTrainer(config).fit()`` runs it; ``generate``, ``score`` and ``update_actor`` are the same
steps for notebooks. ``hybridflow train CONFIG [key=value ...]`` is the command-line front. The
config's schema is ``hybridflow.config.RLConfig``.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from hybridflow.batch import Batch
from hybridflow.config import RLConfig, make_config
from hybridflow.config.sources import SCORERS
from hybridflow.preflight import check_run
from hybridflow.planner.search import plan_layout, run_prediction
from hybridflow.data.prompts import PromptItem
from hybridflow.errors import ConfigError, RunError, check_int
from hybridflow.rollout.base import SamplingConfig
from hybridflow.tracking import Tracker

log = logging.getLogger("hybridflow")

# RLTrainer's keywords of Python RL trainers -> the config keys they set.
_KEYWORDS = {"model": "model", "algorithm": "algorithm.name", "max_steps": "steps",
             "per_device_train_batch_size": "actor.engine.micro_batch_size",
             "learning_rate": "actor.engine.optim.lr", "num_generations": "rollout.sampling.n",
             "max_new_tokens": "rollout.sampling.max_tokens",
             "use_3d_hybrid": "hybrid_engine.mode"}


# --------------------------------------------------------------------------------- the trainer
class RLTrainer:
    """The single controller of one RL run.

    From a config: ``RLTrainer(config).fit()``, where ``config`` is an ``RLConfig``, a dict of
    the same keys, or None (the defaults); further ``key=value`` overrides come as keywords with
    dots spelled out: ``RLTrainer(cfg, **{"actor.engine.optim.lr": 1e-5})``. The usual keywords of
    Python RL trainers also work: ``RLTrainer(model=PATH, reward_fn=fn, algorithm="grpo",
    max_steps=20, per_device_train_batch_size=2, gradient_accumulation_steps=2,
    learning_rate=1e-6, use_3d_hybrid=True).train(dataset)``.

    Everything that can be checked before a process starts is checked here (``check_run``).
    """

    def __init__(self, config: RLConfig | Mapping[str, Any] | None = None, *,
                 model: str | None = None, reward_fn: Callable | str | None = None,
                 cost_fn: Callable | str | None = None, algorithm: str | None = None,
                 max_steps: int | None = None, per_device_train_batch_size: int | None = None,
                 gradient_accumulation_steps: int | None = None,
                 learning_rate: float | None = None, use_3d_hybrid: bool | None = None,
                 num_generations: int | None = None, max_new_tokens: int | None = None,
                 **overrides: Any):
        typed = {"model": model, "algorithm": algorithm, "max_steps": max_steps,
                 "per_device_train_batch_size": per_device_train_batch_size,
                 "learning_rate": learning_rate, "num_generations": num_generations,
                 "max_new_tokens": max_new_tokens,
                 "use_3d_hybrid": None if use_3d_hybrid is None
                 else ("3d" if use_3d_hybrid else "naive")}
        given = {_KEYWORDS[k]: v for k, v in typed.items() if v is not None}
        # A callable is recorded in config.yaml by name (module:function, a form the config takes).
        for key, fn in (("reward", reward_fn), ("cost", cost_fn)):
            if fn is not None:
                given[key] = fn if isinstance(fn, str) else _callable_name(fn)
        try:
            cfg = make_config(RLConfig, config, {**overrides, **given})
            if gradient_accumulation_steps is not None:
                cfg = _with_accumulation(cfg, gradient_accumulation_steps)
        except ConfigError as e:  # name the keyword the caller typed
            keyword = {key: k for k, key in _KEYWORDS.items()}.get(e.field)
            if keyword is not None and e.field in given:
                raise ConfigError(keyword, e.message) from None
            raise
        cfg = plan_layout(cfg)  # layout: auto
        self.config = cfg
        self.checked = check_run(cfg, *(fn if callable(fn) else None
                                        for fn in (reward_fn, cost_fn)))
        self.reward_fn, self.cost_fn = self.checked.reward_fn, self.checked.cost_fn
        self.prediction = run_prediction(cfg, self.checked.shapes)
        self.model_dir = self.checked.model_dir  # refuses a shape preset (check only, no weights)
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self._workers_started = False
        self.step = 0

    # ----------------------------------------------------------------------------- set-up
    def _start_workers(self) -> None:
        if self._workers_started:
            return
        from hybridflow.algorithms import AdaptiveKLController, FixedKLController
        from hybridflow.algorithms.safe_rlhf import LagrangeMultiplier
        from hybridflow.config.cluster import gpu_pools
        from hybridflow.workers.group import ResourcePool, WorkerGroup
        from hybridflow.workers.actor import ActorRolloutRefWorker
        from hybridflow.workers.critic import CriticWorker

        cfg = self.config
        start = time.perf_counter()
        # (name, world size, worker class, its keyword arguments): each worker gets its own
        # role's config only. "scores" / "costs" are the reward and cost models.
        actor_args = dict(actor=cfg.actor, rollout=cfg.rollout, ref=cfg.ref,
                          hybrid_engine=cfg.hybrid_engine, model_dir=str(self.model_dir),
                          seed=cfg.seed, pad_token_id=cfg.pad_token_id,
                          max_prompt_tokens=cfg.data.max_prompt_tokens)
        groups = [("actor", cfg.actor.layout.world_size, ActorRolloutRefWorker, actor_args)]
        if cfg.algorithm.name == "ppo":
            groups.append(("critic", cfg.critic.layout.world_size, CriticWorker,
                           dict(critic=cfg.critic, model_dir=str(self.model_dir))))
        for key, path in self.checked.scorer_dirs.items():
            groups.append((key, cfg.critic.layout.world_size, CriticWorker,
                           dict(critic=cfg.critic, model_dir=str(path), trainable=False,
                                model_key=SCORERS[key])))
        self._pools = {}  # world size -> the ResourcePool its colocated groups share
        if cfg.ray.colocate:
            for names, size in gpu_pools(cfg):
                self._pools[size] = ResourcePool(size, cfg.ray, share=len(names))
        built = {name: WorkerGroup(cls, size, ray_config=cfg.ray, name=name,
                                   pool=self._pools.get(size), **kwargs)
                 for name, size, cls, kwargs in groups}
        self.actor, self.critic = built.pop("actor"), built.pop("critic", None)
        self.scorers = built
        a = cfg.algorithm
        self.kl_ctrl = (AdaptiveKLController(init_coef=a.kl_coef, target=a.kl_target,
                                             horizon=a.kl_horizon)
                        if a.kl_target is not None else FixedKLController(coef=a.kl_coef))
        self.lagrange = (LagrangeMultiplier(init_value=a.lagrange_init, lr=a.lagrange_lr,
                                            cost_limit=a.cost_limit)
                         if a.name == "safe_rlhf" else None)
        self.hybrid_summary = self.actor.run("describe")[0]
        print(self.hybrid_summary, flush=True)
        if self.prediction is not None:
            print(self.prediction.describe(cfg.cluster.calibration), flush=True)
        print(f"workers ready in {time.perf_counter() - start:.1f}s", flush=True)
        self._workers_started = True

    def _prompts(self, prompts) -> list[PromptItem]:
        from hybridflow.data.loader import tokenize_prompts
        from hybridflow.data.prompts import prompts_from_records
        if prompts and not isinstance(prompts[0], PromptItem):
            records = [{"prompt": p} if isinstance(p, str) else p for p in prompts]
            prompts = prompts_from_records(records)
        kept, dropped = tokenize_prompts(prompts, self.tokenizer,
                                         self.config.data.max_prompt_tokens)
        if dropped:
            print(f"dropped {dropped} prompts longer than data.max_prompt_tokens="
                  f"{self.config.data.max_prompt_tokens}", flush=True)
        return kept

    # ----------------------------------------------------------------------------- the steps
    def generate(self, prompts, sampling: SamplingConfig | None = None) -> Batch:
        """Sample responses for ``prompts`` (strings, chat records or PromptItems); the actor
        switches to the generation layout and back inside. Returns one row per sample."""
        self._start_workers()
        items = prompts if prompts and isinstance(prompts[0], PromptItem) and \
            prompts[0].prompt_ids is not None else self._prompts(prompts)
        batch = Batch(lists={"prompt_ids": [list(i.prompt_ids) for i in items],
                             "item": items, "group": list(range(len(items)))})
        out = self.actor.run_by_dp("generate", batch, view="gen", sampling=sampling)
        response = out["response_mask"].bool()
        texts = []
        for ids, mask in zip(out["input_ids"], response):
            texts.append(self.tokenizer.decode(ids[mask].tolist(), skip_special_tokens=True))
        out.lists["response_text"] = texts
        return out

    def score(self, batch: Batch) -> Batch:
        """Rewards, old (unless the update computes them: ``old_logprobs_from_update``) and
        reference log-probs, values (PPO) and advantages."""
        return self._advantages(self._reward(batch))

    def _reward(self, batch: Batch) -> Batch:
        """Per-sample ``scores`` (and Safe-RLHF's ``costs``), with DAPO's overlong penalty
        added to the scores (also kept as ``overlong_penalty``) where algorithm.overlong_buffer
        is set. Cheap: dynamic sampling filters on it before any log-prob is computed."""
        from hybridflow.algorithms import overlong_penalty
        a = self.config.algorithm
        timing: dict[str, float] = {}
        with _timer(timing, "timing/reward_s"):
            batch.tensors["scores"] = self._scores(batch, "scores", self.reward_fn)
            if a.name == "safe_rlhf":
                batch.tensors["costs"] = self._scores(batch, "costs", self.cost_fn)
            if a.overlong_buffer:
                penalty = overlong_penalty(batch["response_mask"].sum(-1),
                                           self.config.sampling.max_tokens, a.overlong_buffer,
                                           a.overlong_penalty)
                batch.tensors["overlong_penalty"] = penalty
                batch.tensors["scores"] = batch["scores"] + penalty
        batch.meta.update(timing)
        return batch

    def _advantages(self, batch: Batch) -> Batch:
        """Old and reference log-probs, values (PPO) and advantages of a rewarded batch. An
        on-policy update computes the old log-probs in its own forward instead
        (``RLConfig.old_logprobs_from_update``): nothing before it reads them."""
        from hybridflow.algorithms import estimate_advantages
        a = self.config.algorithm
        timing: dict[str, float] = {}
        if not self.config.old_logprobs_from_update:
            with _timer(timing, "timing/old_logprobs_s"):
                batch = batch.update(self.actor.run_by_dp("compute_log_prob", batch))
        with _timer(timing, "timing/ref_logprobs_s"):
            batch = batch.update(self.actor.run_by_dp("compute_ref_log_prob", batch))
        if self.critic is not None:
            with _timer(timing, "timing/values_s"):
                batch = batch.update(self.critic.run_by_dp("compute_values", batch))
        baseline = self._remax_baseline(batch) if a.name == "remax" else None
        mask = batch["response_mask"]
        with _timer(timing, "timing/advantages_s"):
            advantages, returns = estimate_advantages(
                a.name, scores=batch["scores"], mask=mask,
                logprobs=batch.tensors.get("old_logprobs"),
                ref_logprobs=batch["ref_logprobs"],
                kl_coef=self.kl_ctrl.value if a.kl_in_reward else 0.0, kl_type=a.kl_type,
                values=batch.tensors.get("values"), group_ids=batch["group"],
                baseline_scores=baseline, costs=batch.tensors.get("costs"),
                lagrange=self.lagrange.value if self.lagrange is not None else None,
                gamma=a.gamma, lam=a.lam, norm_by_std=a.norm_by_std)
        batch.tensors["advantages"] = advantages
        if returns is not None:
            batch.tensors["returns"] = returns
        batch.meta.update(timing)
        return batch

    def _scores(self, batch: Batch, key: str, fn) -> torch.Tensor:
        """Per-sample scores from the model group for ``key`` if there is one, else ``fn``."""
        from hybridflow.rewards import score_samples
        if key in self.scorers:
            return self.scorers[key].run_by_dp("compute_scores", batch)["scores"].float()
        return score_samples(fn, batch["item"], batch["response_text"],
                             key="reward" if key == "scores" else "cost")

    def _remax_baseline(self, batch: Batch) -> torch.Tensor:
        """ReMax: each prompt's greedy response, scored as the samples are (the reward model
        where the run has one), broadcast to the prompt's samples."""
        first: dict[int, PromptItem] = {}
        for group, item in zip(batch["group"], batch["item"]):
            first.setdefault(group, item)
        order = sorted(first)
        greedy = self.generate([first[g] for g in order],
                               sampling=replace(self.config.sampling, temperature=0.0, n=1))
        scores = self._scores(greedy, "scores", self.reward_fn)
        reward_of = {order[k]: float(v) for k, v in zip(greedy["group"], scores)}
        return torch.tensor([reward_of[g] for g in batch["group"]], dtype=torch.float32)

    def update_actor(self, batch: Batch) -> dict[str, float]:
        """Critic update (PPO), then the policy update; returns their metrics. An on-policy
        update's old log-probs (its forward's) are added to ``batch``."""
        metrics: dict[str, float] = {}
        if self.critic is not None:
            with _timer(metrics, "timing/update_critic_s"):
                metrics.update(self.critic.run_by_dp("update_critic", batch).meta)
        with _timer(metrics, "timing/update_actor_s"):
            out = self.actor.run_by_dp("update_actor", batch)
        metrics.update(out.meta)
        batch.tensors.update(out.tensors)
        return metrics

    # ----------------------------------------------------------------------------- the loop
    def fit(self, prompts: list[PromptItem] | None = None) -> list[dict[str, float]]:
        """Run the iterations from where the run stands (step 0, or its newest checkpoint: see
        ``resume``) to ``config.steps`` over ``prompts`` (default: ``config.data``); writes
        metrics.jsonl, config.yaml, checkpoints and reward_curve.png under the run folder.
        Returns this call's metric rows. A SIGTERM ends it cleanly at the next step's end."""
        from hybridflow.checkpoint import remove_partial_checkpoints
        from hybridflow.config import to_yaml
        from hybridflow.preflight import resume_plan
        from hybridflow.data.loader import PromptSampler
        from hybridflow.rewards import describe_reward_fn
        from hybridflow.validation import check_validation, split_held_out

        # Planned again (check_run did at __init__): an earlier fit may have moved the run on.
        cfg, plan = self.config, resume_plan(self.config, self.checked.model)
        if plan.step >= cfg.steps:
            print(f"{plan.run_dir} is complete: it reached step {plan.step} of steps={cfg.steps}; "
                  "nothing to do (steps=N continues it, another name starts a new run)",
                  flush=True)
            return []
        items = self._prompts(prompts if prompts is not None else self.checked.prompts)
        check_validation(cfg, len(items))
        items, held_out = split_held_out(items, cfg.validation.size, cfg.data.seed)
        sampler = PromptSampler(len(items), cfg.train_batch_size, seed=cfg.data.seed,
                                shuffle=cfg.data.shuffle)
        self._start_workers()
        # After Ray's start: its core installs a SIGTERM handler of its own (exit 15).
        with _StopOnSigterm() as stop:
            for fn, key in ((self.reward_fn, "reward"), (self.cost_fn, "cost")):
                if fn is not None:
                    print(describe_reward_fn(fn, key), flush=True)
            if plan.checkpoint is not None:
                self._load_checkpoint(plan.checkpoint, plan.state, sampler)
            if plan.checkpoint is not None or plan.continues:
                print(plan.describe(), flush=True)
            # Only now, with the workers up and the state loaded, is anything of the run written.
            remove_partial_checkpoints(plan.run_dir)
            # A run that continues from step 0 drops its step-0 row (validation before step 1),
            # which it writes again.
            kept = plan.step if plan.step else -1
            tracker = Tracker(plan.run_dir, to_yaml(cfg), cfg.tracking, cfg.name,
                              resume_step=kept if plan.checkpoint or plan.continues else None,
                              wandb_id=plan.state.get("wandb_id"))
            try:
                history = self._loop(items, held_out, sampler, tracker, plan.step, stop)
            finally:
                tracker.close()
        if self.step == cfg.steps:
            self._summarize(tracker.metrics_path, plan.run_dir)
        return history

    def _loop(self, items, held_out, sampler, tracker, first: int, stop
              ) -> list[dict[str, float]]:
        from tqdm import tqdm
        cfg = self.config
        history: list[dict[str, float]] = []
        bar = tqdm(total=cfg.steps, initial=first, desc=f"{cfg.algorithm.name} {cfg.name}",
                   unit="step")
        self.step = first
        try:
            if first == 0 and cfg.validation.due(0, cfg.steps):
                tracker.log(0, self._validate(held_out, bar))
            for step in range(first + 1, cfg.steps + 1):
                if stop.requested:  # before any step of this process: nothing new to save
                    break
                self.step = step
                metrics = self._step(lambda: [items[i] for i in next(sampler)])
                if cfg.validation.due(step, cfg.steps):
                    metrics.update(self._validate(held_out, bar))
                tracker.log(step, metrics)
                history.append(metrics)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}",
                                kl=f"{metrics['kl']:.4f}")
                nonfinite = [k for k in metrics if k.endswith("/nonfinite_skipped") and metrics[k]]
                halt = bool(nonfinite) and cfg.on_nonfinite == "stop"
                every = cfg.checkpoint.every
                if halt or stop.requested or every and (step % every == 0 or step == cfg.steps):
                    saved = self._save_checkpoint(sampler, tracker)
                    bar.write(f"step {step}: checkpoint {saved}")
                if halt:
                    raise RunError(f"non-finite gradients at step {step} ("
                                   + ", ".join(f"{k}={metrics[k]:g}" for k in nonfinite)
                                   + " optimizer steps not applied); the last good state is "
                                   f"saved in {saved}: look for the cause (rewards, learning "
                                   "rate, dtype), or set on_nonfinite=skip to skip such steps")
                if stop.requested:
                    bar.write(f"SIGTERM: stopped after step {step}; run the same command to "
                              "resume")
                    break
        finally:
            bar.close()
        return history

    def _step(self, draw: Callable[[], list[PromptItem]]) -> dict[str, float]:
        """One iteration: generate and reward the prompts ``draw()`` gives (more rounds with
        dynamic sampling), score, update; its metrics."""
        start = time.perf_counter()
        batch, collected = self._collect_groups(draw)
        batch = self._advantages(batch)
        metrics = self.update_actor(batch)
        metrics.update(self._step_metrics(batch))
        metrics.update(collected)
        metrics["timing/step_s"] = time.perf_counter() - start
        if self.prediction is not None:  # beside each measured phase, the cost model's
            metrics.update({f"predicted/{k}_s": v for k, v in self.prediction.phases.items()})
            metrics["predicted/step_s"] = self.prediction.step
        self._after_step(batch, metrics)
        return metrics

    def _collect_groups(self, draw: Callable[[], list[PromptItem]]
                        ) -> tuple[Batch, dict[str, float]]:
        """The step's rewarded batch of train_batch_size groups (a prompt's n samples), and its
        DAPO metrics.

        Without dynamic sampling: one ``draw()``, generated and rewarded. With it (DAPO): the
        groups whose rewards (before overlong shaping) are all equal are set aside and further
        batches drawn, for at most algorithm.max_sampling_rounds rounds, until train_batch_size
        groups with differing rewards are in hand. Surplus groups are cut and a shortfall is filled
        with set-aside groups: the update's batch has a fixed size. Every draw comes from the
        run's prompt sampler, so a resumed run draws what the uninterrupted one would have."""
        from hybridflow.algorithms import group_rewards_differ
        a, size = self.config.algorithm, self.config.train_batch_size
        rounds = [self._reward(self.generate(draw()))]
        if not a.dynamic_sampling:
            return rounds[0], self._overlong_metrics(rounds[0])
        varied: list[tuple[int, int]] = []  # (round, group) in the order drawn
        equal: list[tuple[int, int]] = []
        while True:
            last = rounds[-1]
            # On the task's reward (DAPO filters on accuracy), not the length-shaped score: a
            # group of equally right answers of different lengths still teaches nothing.
            raw = last["scores"] - last["overlong_penalty"] if "overlong_penalty" in last \
                else last["scores"]
            ids, differ = group_rewards_differ(raw, last["group"])
            for group, d in zip(ids, differ.tolist()):
                (varied if d else equal).append((len(rounds) - 1, group))
            if len(varied) >= size or len(rounds) == a.max_sampling_rounds:
                break
            rounds.append(self._reward(self.generate(draw())))
        fill = equal[:max(0, size - len(varied))]
        batch = _take_groups(rounds, varied[:size] + fill)
        return batch, {"dapo/rounds": len(rounds), "dapo/prompts_drawn": len(rounds) * size,
                       "dapo/groups_dropped": len(equal) - len(fill),
                       "dapo/filled_with_equal": len(fill), **self._overlong_metrics(batch)}

    def _validate(self, held_out: list[PromptItem], bar) -> dict[str, float]:
        """Greedy responses to the held-out prompts, scored as training samples are (the reward
        model where the run has one): ``val/reward`` and ``val/response_length`` means."""
        start = time.perf_counter()
        batch = self.generate(held_out, sampling=replace(self.config.sampling, temperature=0.0,
                                                         n=1))
        out = {"val/reward": self._scores(batch, "scores", self.reward_fn).mean().item(),
               "val/response_length": batch["response_mask"].sum(-1).float().mean().item()}
        if self.config.algorithm.name == "safe_rlhf":
            out["val/cost"] = self._scores(batch, "costs", self.cost_fn).mean().item()
        out["timing/validation_s"] = time.perf_counter() - start
        when = f"after step {self.step}" if self.step else "before step 1"
        bar.write(f"validation {when}: val/reward {out['val/reward']:.3f} over "
                  f"{len(held_out)} held-out prompts (greedy)")
        return out

    def _overlong_metrics(self, batch: Batch) -> dict[str, float]:
        if "overlong_penalty" not in batch:
            return {}
        return {"reward/overlong_penalty_mean": batch["overlong_penalty"].mean().item()}

    def _summarize(self, metrics_path: Path, run_dir: Path) -> None:
        from hybridflow.tracking import plot_metric, read_metrics
        all_rows = read_metrics(metrics_path)
        rows = [r for r in all_rows if "reward/mean" in r]  # a step-0 row holds validation only
        plot = run_dir / "reward_curve.png"
        plot_metric(metrics_path, "reward/mean", plot, title=self.config.name)
        k = max(1, len(rows) // 3)
        first = sum(r["reward/mean"] for r in rows[:k]) / k
        last = sum(r["reward/mean"] for r in rows[-k:]) / k
        print(f"reward/mean: {first:.3f} over the first {k} steps -> {last:.3f} over the last {k}",
              flush=True)
        val = [r for r in all_rows if "val/reward" in r]
        if val:
            print(f"val/reward (greedy, {self.config.validation.size} held-out prompts): "
                  f"{val[0]['val/reward']:.3f} at step {val[0]['step']} -> "
                  f"{val[-1]['val/reward']:.3f} at step {val[-1]['step']}", flush=True)
        timed = [r for r in rows if "predicted/step_s" in r][1:]  # the first step warms up
        if timed:
            names = [k.removeprefix("predicted/") for k in timed[0]
                     if k.startswith("predicted/") and "timing/" + k[10:] in timed[0]]
            print("measured / predicted seconds (mean over steps 2 on): " + ", ".join(
                f"{n.removesuffix('_s')} {_mean(timed, 'timing/' + n):.3g} / "
                f"{timed[0]['predicted/' + n]:.3g}" for n in names), flush=True)
        print(f"wrote {metrics_path} and {plot}", flush=True)

    # ----------------------------------------------------------------------------- checkpoints
    def _trained_groups(self) -> dict[str, Any]:
        return {"actor": self.actor, **({"critic": self.critic} if self.critic else {})}

    def checkpoint_identity(self) -> dict[str, Any]:
        """What a checkpoint must match to load into this run (see hybridflow.checkpoint)."""
        from hybridflow.checkpoint import run_identity
        return run_identity(self.config, self.checked.model)

    def _save_checkpoint(self, sampler, tracker) -> Path:
        from hybridflow.checkpoint import save_checkpoint
        state = {**self.checkpoint_identity(), "sampler": sampler.state_dict(),
                 "kl_coef": self.kl_ctrl.value,
                 "lagrange_log": self.lagrange.log_value if self.lagrange else None,
                 "wandb_id": tracker.wandb_id}

        def write_parts(tmp: Path) -> None:
            for group in self._trained_groups().values():
                group.run("save_state", str(tmp))
        return save_checkpoint(tracker.run_dir, self.step, state, write_parts,
                               self.config.checkpoint.keep)

    def _load_checkpoint(self, path: Path, state: dict[str, Any], sampler) -> None:
        from hybridflow.algorithms import AdaptiveKLController
        try:
            sampler.load_state_dict(state["sampler"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError("resume", f"{path}: its prompt sampler does not fit this run's data "
                                        f"({e})") from None
        for group in self._trained_groups().values():
            group.run("load_state", str(path))
        if isinstance(self.kl_ctrl, AdaptiveKLController):
            self.kl_ctrl.value = float(state["kl_coef"])
        if self.lagrange is not None:
            self.lagrange.log_value = float(state["lagrange_log"])
        self.step = int(state["step"])

    def train(self, dataset=None) -> list[dict[str, float]]:
        """``fit`` over a ``datasets.Dataset`` or a list of dicts (``prompt`` or ``messages``)."""
        if dataset is None:
            return self.fit()
        from hybridflow.data.prompts import prompts_from_records
        return self.fit(prompts_from_records(dataset))

    def _step_metrics(self, batch: Batch) -> dict[str, float]:
        from hybridflow.algorithms import kl_penalty, rollout_mismatch
        mask = batch["response_mask"]
        kl = kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], "k1")
        lengths = mask.sum(-1)
        scores = batch["scores"]
        out = {"reward/mean": scores.mean().item(), "reward/std": scores.std().item()
               if len(scores) > 1 else 0.0,
               "response_length/mean": lengths.mean().item(),
               "response_length/clip_frac": sum(r == "length" for r in batch["finish_reason"])
               / len(lengths),
               # -log p of the sampled tokens under the raw model (temperature 1, no top-k/top-p):
               # the policy's entropy only where sampling is at temperature 1 without truncation.
               "rollout/neg_logprob": (-(batch["rollout_logprobs"] * mask).sum()
                                       / mask.sum().clamp(min=1)).item(),
               "kl": float((kl * mask).sum() / mask.sum().clamp(min=1)),
               "kl_coef": self.kl_ctrl.value}
        out.update({k: v for k, v in batch.meta.items()
                    if k.startswith(("timing/", "reshard/", "memory/"))})
        if "costs" in batch:
            out["cost/mean"] = batch["costs"].mean().item()
        mismatch = rollout_mismatch(batch["rollout_logprobs"], batch["old_logprobs"], mask)
        s = self.config.sampling
        if not (s.temperature == 1 and s.top_k == 0 and s.top_p == 1):
            # Both sides are still the raw model's log-probs, but the tokens were not drawn from
            # it: k3 then estimates no KL of either engine.
            del mismatch["mismatch/kl"]
        out.update({k: v.item() for k, v in mismatch.items()})
        return out

    def _after_step(self, batch: Batch, metrics: dict[str, float]) -> None:
        self.kl_ctrl.update(metrics["kl"], len(batch))
        if self.lagrange is not None:
            metrics["lagrange"] = self.lagrange.update(metrics["cost/mean"])

    def actor_weights(self) -> dict[str, torch.Tensor]:
        """The actor's current full weights, by Megatron name (e.g. to save or compare them)."""
        self._start_workers()
        return self.actor.run("full_weights")[0]

    def close(self) -> None:
        import ray
        groups = [getattr(self, "actor", None), getattr(self, "critic", None),
                  *getattr(self, "scorers", {}).values()]
        for group in groups:
            if group is not None:
                group.shutdown()
        for pool in getattr(self, "_pools", {}).values():
            pool.close()
        self._pools = {}
        self._workers_started = False
        if ray.is_initialized():
            ray.shutdown()


class _StopOnSigterm:
    """SIGTERM (Slurm's preemption notice) asks the loop to stop at the end of the current step,
    after a checkpoint; a second SIGTERM ends the process at once. Only the main thread can
    handle signals: elsewhere this does nothing."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        print("SIGTERM: stopping after this step with a checkpoint (send it again to stop now)",
              flush=True)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


class _timer:
    def __init__(self, out: dict, key: str):
        self.out, self.key = out, key

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.out[self.key] = time.perf_counter() - self.start


def _take_groups(rounds: list[Batch], chosen: list[tuple[int, int]]) -> Batch:
    """The samples of the ``chosen`` (round, group) pairs, in that order, as one batch whose
    groups are renumbered 0, 1, ... (each round's generate numbers its own from 0); the rounds'
    numeric meta (timings, resharded bytes) summed, their device memory the largest."""
    from hybridflow.workers.group import MEMORY, max_memory_meta
    parts = []
    for k, (r, group) in enumerate(chosen):
        rows = [i for i, g in enumerate(rounds[r]["group"]) if g == group]
        part = rounds[r].index(rows)
        part.lists["group"] = [k] * len(rows)
        parts.append(part)
    batch = Batch.concat(parts)
    for key in batch.meta:
        if not key.startswith(MEMORY) and all(isinstance(b.meta.get(key), (int, float))
                                              for b in rounds):
            batch.meta[key] = sum(b.meta[key] for b in rounds)
    batch.meta.update(max_memory_meta([b.meta for b in rounds]))
    return batch


def _callable_name(fn: Callable) -> str:
    """``module:qualname`` of a Python reward function, as config.yaml records it."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def _with_accumulation(cfg: RLConfig, accumulation: int) -> RLConfig:
    """``gradient_accumulation_steps`` as actor.mini_batches: one optimizer step takes
    per-device batch x accumulation x data-parallel ranks samples."""
    check_int("gradient_accumulation_steps", accumulation)
    actor = cfg.actor
    per_step = actor.engine.micro_batch_size * accumulation * actor.layout.dp
    samples = cfg.train_batch_size * cfg.rollout.sampling.n
    if samples % per_step:
        raise ConfigError("gradient_accumulation_steps",
                          f"{samples} samples per step do not split into optimizer steps of "
                          f"{per_step} (per_device_train_batch_size x "
                          f"gradient_accumulation_steps x actor.layout.dp)")
    return make_config(RLConfig, cfg, {"actor.mini_batches": samples // per_step})


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)
