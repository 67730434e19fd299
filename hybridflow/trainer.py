"""``RLTrainer``: the public face of one RL run (the single controller).

``RLTrainer(config).fit()`` runs it; ``generate``, ``score`` and ``update_actor`` are the steps of
one iteration for notebooks. ``hybridflow train CONFIG [key=value ...]`` is the command-line
front; the config's schema is ``hybridflow.config.RLConfig``. The work is the driver's
(``hybridflow.driver``: the groups, one iteration, the run loop); this class holds the API, the
checked config and the run's state between calls.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from transformers import AutoTokenizer

from hybridflow.batch import Batch
from hybridflow.checkpoint import run_identity
from hybridflow.config import RLConfig, make_config
from hybridflow.data.loader import tokenize_prompts
from hybridflow.data.prompts import PromptItem, prompts_from_records
from hybridflow.driver import loop
from hybridflow.driver import step as steps
from hybridflow.driver.groups import Groups, start_groups
from hybridflow.driver.step import Controllers, Run
from hybridflow.errors import ConfigError, check_int
from hybridflow.planner.memory import estimate_memory
from hybridflow.planner.search import plan_layout, run_prediction
from hybridflow.preflight import check_run, resume_plan
from hybridflow.rollout.base import SamplingConfig
from hybridflow.validation import check_validation

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
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.controllers = Controllers.from_config(cfg.algorithm)
        self.groups: Groups | None = None  # started on first use
        self.step = 0

    # ----------------------------------------------------------------------------- the run
    def start(self) -> Run:
        """Start the worker groups (once); the handle the driver's functions take."""
        if self.groups is None:
            memory = self.checked.memory or estimate_memory(self.config, self.checked.shapes)
            self.groups = start_groups(self.config, str(self.model_dir),
                                       self.checked.model_dirs, memory)
            if self.prediction is not None:
                print(self.prediction.describe(self.config.cluster.calibration), flush=True)
        return Run(self.config, self.groups, self.tokenizer, self.reward_fn, self.cost_fn,
                   self.controllers, self.prediction)

    def prompt_items(self, prompts) -> list[PromptItem]:
        """Tokenized prompts from strings, chat records or PromptItems; those longer than
        data.max_prompt_tokens are dropped (and counted)."""
        if prompts and not isinstance(prompts[0], PromptItem):
            prompts = prompts_from_records([{"prompt": p} if isinstance(p, str) else p
                                            for p in prompts])
        kept, dropped = tokenize_prompts(prompts, self.tokenizer,
                                         self.config.data.max_prompt_tokens)
        if dropped:
            print(f"dropped {dropped} prompts longer than data.max_prompt_tokens="
                  f"{self.config.data.max_prompt_tokens}", flush=True)
        return kept

    def generate(self, prompts, sampling: SamplingConfig | None = None) -> Batch:
        """Sample responses for ``prompts`` (strings, chat records or PromptItems); the actor
        switches to the generation layout and back inside (a generation pool of its own, where
        ``rollout.mode`` asks for one, generates with the weights last pushed to it). Returns
        one row per sample."""
        tokenized = prompts and isinstance(prompts[0], PromptItem) and \
            prompts[0].prompt_ids is not None
        items = prompts if tokenized else self.prompt_items(prompts)
        return steps.generate(self.start(), items, sampling)

    def score(self, batch: Batch) -> Batch:
        """Rewards, old (unless the update computes them: ``old_logprobs_from_update``) and
        reference log-probs, values (where critics are trained) and advantages; where the
        algorithm reads a cost, the Lagrange multiplier's step on the batch's mean cost."""
        run = self.start()
        return steps.advantages(run, steps.prepare(run, batch))

    def update_actor(self, batch: Batch) -> dict[str, float]:
        """The critics' updates (where there are), then the policy's; their metrics. An
        on-policy update's old log-probs (its forward's) are added to ``batch``."""
        return steps.update(self.start(), batch)

    def fit(self, prompts: list[PromptItem] | None = None) -> list[dict[str, float]]:
        """Run the iterations from where the run stands (step 0, or its newest checkpoint: see
        ``resume``) to ``config.steps`` over ``prompts`` (default: ``config.data``); writes
        metrics.jsonl, config.yaml, checkpoints and reward_curve.png under the run folder.
        Returns this call's metric rows. A SIGTERM ends it at the end of the step, after a
        checkpoint, or where it is past ray.stop_timeout_s; a SIGINT where it is
        (``loop.StopOnSignals``)."""
        # Planned again (check_run did at __init__): an earlier fit may have moved the run on.
        cfg, plan = self.config, resume_plan(self.config, self.checked.model)
        if plan.step >= cfg.steps:
            # What reached the steps: this run's folder, or another run's checkpoint (resume=)
            own = plan.checkpoint is None or plan.run_dir in plan.checkpoint.parents
            how = "another name starts a new run" if own else f"into {plan.run_dir}"
            print(f"{plan.run_dir if own else plan.checkpoint} is complete: it reached step "
                  f"{plan.step} of steps={cfg.steps}; nothing to do (steps=N continues it, "
                  f"{how})", flush=True)
            return []
        items = self.prompt_items(prompts if prompts is not None else self.checked.prompts)
        check_validation(cfg, len(items))  # before any process starts
        with loop.StopOnSignals(cfg.ray.stop_timeout_s) as stop:
            history, self.step = loop.fit(self.start(), items, plan, self.checkpoint_identity(),
                                          stop)
        return history

    def train(self, dataset=None) -> list[dict[str, float]]:
        """``fit`` over a ``datasets.Dataset`` or a list of dicts (``prompt`` or ``messages``)."""
        return self.fit(None if dataset is None else prompts_from_records(dataset))

    def checkpoint_identity(self) -> dict[str, Any]:
        """What a checkpoint must match to load into this run (see hybridflow.checkpoint)."""
        return run_identity(self.config, self.checked.model)

    def actor_weights(self) -> dict[str, torch.Tensor]:
        """The actor's current full weights, by Megatron name (e.g. to save or compare them)."""
        return self.start().groups.actor.full_weights()

    def close(self) -> None:
        """Stop the worker groups and Ray."""
        import ray  # deferred: Ray takes seconds to import and a notebook may never start it
        if self.groups is not None:
            self.groups.close()
            self.groups = None
        if ray.is_initialized():
            ray.shutdown()


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
