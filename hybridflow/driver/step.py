"""One RL iteration, as functions over a ``Run`` (the config, the worker groups, how text is
scored, and the controllers it steers), in stages:

    collect (generate; with dynamic sampling, rewarded and drawn again)
    -> prepare: reward and cost scores, old and reference log-probs, values (and cost values),
       at once
    -> advantages (where a cost is read, the Lagrange multiplier moves first)
    -> update: the critics' and the actor's, at once -> metrics -> KL update

The calls of a stage run at the same time where their models live on different pools, one
after another on a pool (``dataflow.at_once``); with every model on one pool (the default
``colocate`` placement) a stage is the plain sequence of its calls. The actor switches layouts
inside ``generate``. ``iteration`` is the whole of it; the facade (``RLTrainer``) exposes the
pieces for notebooks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from hybridflow.algorithms import (AdaptiveKLController, FixedKLController, LagrangeMultiplier,
                                   estimate_advantages, group_rewards_differ, kl_penalty,
                                   overlong_penalty, rollout_mismatch)
from hybridflow.batch import Batch
from hybridflow.data.prompts import PromptItem
from hybridflow.driver.dataflow import DRIVER, Call, at_once
from hybridflow.driver.groups import Groups
from hybridflow.rewards import score_samples
from hybridflow.rollout.multi_turn import tool_metrics
from hybridflow.workers.group import MEMORY, max_memory_meta


@dataclass
class Controllers:
    """What the iterations steer from step to step, and a checkpoint keeps: the KL coefficient
    (fixed or adaptive) and, where the algorithm reads a cost, the Lagrange multiplier."""

    kl: FixedKLController | AdaptiveKLController
    lagrange: LagrangeMultiplier | None = None

    @classmethod
    def from_config(cls, a) -> "Controllers":
        """From ``a``, an AlgorithmConfig."""
        kl = (AdaptiveKLController(init_coef=a.kl_coef, target=a.kl_target, horizon=a.kl_horizon)
              if a.kl_target is not None else FixedKLController(coef=a.kl_coef))
        lagrange = (LagrangeMultiplier(init_value=a.lagrange_init, lr=a.lagrange_lr,
                                       cost_limit=a.cost_limit) if a.spec.cost else None)
        return cls(kl, lagrange)

    def update(self, metrics: dict[str, float], samples: int) -> None:
        """After a step: the adaptive KL towards its target. (Lambda moves before the step's
        advantages: ``advantages``.)"""
        self.kl.update(metrics["kl"], samples)

    def state_dict(self) -> dict[str, Any]:
        return {"kl_coef": self.kl.value,
                "lagrange_log": self.lagrange.log_value if self.lagrange else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(self.kl, AdaptiveKLController):
            self.kl.value = float(state["kl_coef"])
        if self.lagrange is not None:
            self.lagrange.log_value = float(state["lagrange_log"])


@dataclass
class Run:
    """What an iteration works with. ``reward_fn`` / ``cost_fn`` score text where no reward or
    cost model group does; ``prediction``: the cost model's seconds per phase, logged beside the
    measured ones (None without a calibration)."""

    config: Any
    groups: Groups
    tokenizer: Any
    reward_fn: Callable | None
    cost_fn: Callable | None
    controllers: Controllers
    prediction: Any = None


class timer:
    """``with timer(out, key):`` puts the block's seconds into ``out[key]``."""

    def __init__(self, out: dict, key: str):
        self.out, self.key = out, key

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.out[self.key] = time.perf_counter() - self.start


# --------------------------------------------------------------------------------- the phases
def generate(run: Run, items: list[PromptItem], sampling=None) -> Batch:
    """Responses to tokenized prompts (``items``), one row per sample, with their text; from
    the generation pool where the run has one (``Groups.generator``)."""
    return with_text(run, run.groups.generator.generate(prompt_batch(items), sampling))


def prompt_batch(items: list[PromptItem]) -> Batch:
    """Tokenized prompts as a generate call takes them: one row each, its own group."""
    return Batch(lists={"prompt_ids": [list(i.prompt_ids) for i in items], "item": items,
                        "group": list(range(len(items)))})


def with_text(run: Run, batch: Batch) -> Batch:
    """``batch`` with each sample's ``response_text``."""
    batch.lists["response_text"] = [
        run.tokenizer.decode(ids[span].tolist(), skip_special_tokens=True)
        for ids, span in zip(batch["input_ids"], response_span(batch))]
    return batch


def response_span(batch: Batch) -> torch.Tensor:
    """[B, T] 1 from each row's first response token to its last token: the whole response, a
    multi-turn one's tool outputs included (``response_mask`` marks the sampled tokens only)."""
    return batch["attention_mask"].bool() & (batch["response_mask"].cumsum(-1) > 0)


def scores(run: Run, batch: Batch, key: str) -> torch.Tensor:
    """Per-sample ``key`` ("scores" or "costs"): from the model group for it if there is one,
    else from the run's reward (cost) function (on the timeline's driver row)."""
    if key in run.groups.scorers:
        return run.groups.scorers[key].scores(batch)
    fn = run.reward_fn if key == "scores" else run.cost_fn
    kind = "reward" if key == "scores" else "cost"
    return run.groups.timeline.timed(DRIVER, f"{kind} function", lambda: score_samples(
        fn, batch["item"], batch["response_text"], key=kind,
        timeout_s=run.config.reward_timeout_s))


def scorer_pool(run: Run, key: str) -> str:
    """The pool that computes ``key`` ("scores" or "costs"): its model's, or the driver."""
    return run.groups.scorers[key].pool if key in run.groups.scorers else DRIVER


def reward_calls(run: Run, batch: Batch) -> list[Call]:
    """The calls that score ``batch``: ``scores`` and, where the algorithm reads one, ``costs``
    (``add_rewards`` puts their results in)."""
    keys = ["scores"] + (["costs"] if run.config.algorithm.spec.cost else [])
    return [Call(key, scorer_pool(run, key), lambda key=key: scores(run, batch, key))
            for key in keys]


def add_rewards(run: Run, batch: Batch, results: dict[str, Any]) -> Batch:
    """``batch`` with the ``scores`` (and ``costs``) of ``results``, DAPO's overlong penalty
    added to the scores (also kept as ``overlong_penalty``) where algorithm.overlong_buffer is
    set."""
    a = run.config.algorithm
    batch.tensors.update({k: results[k] for k in ("scores", "costs") if k in results})
    if a.overlong_buffer:
        penalty = overlong_penalty(batch["response_mask"].sum(-1),
                                   run.config.sampling.max_tokens, a.overlong_buffer,
                                   a.overlong_penalty)
        batch.tensors["overlong_penalty"] = penalty
        batch.tensors["scores"] = batch["scores"] + penalty
    return batch


def reward(run: Run, batch: Batch) -> Batch:
    """Per-sample ``scores`` (and ``costs`` where the algorithm reads a cost), shaped as
    ``add_rewards`` says. Cheap: dynamic sampling filters on it before any log-prob is
    computed."""
    timing: dict[str, float] = {}
    with timer(timing, "timing/reward_s"):
        batch = add_rewards(run, batch, at_once(reward_calls(run, batch)))
    batch.meta.update(timing)
    return batch


def prepare(run: Run, batch: Batch) -> Batch:
    """What the advantages read, at once where the models live apart: the scores (and costs)
    where ``collect`` left them out, old log-probs (unless an on-policy update makes them:
    ``RLConfig.old_logprobs_from_update``), reference log-probs, values and cost values (where a
    critic and a cost critic are trained). Each call's seconds go to ``timing/<what>_s`` (scores
    and costs both to ``timing/reward_s``)."""
    cfg, groups = run.config, run.groups
    calls = reward_calls(run, batch) if "scores" not in batch else []
    if not cfg.old_logprobs_from_update:
        calls.append(Call("old_logprobs", groups.actor.pool,
                          lambda: groups.actor.log_probs(batch)))
    calls.append(Call("ref_logprobs", groups.reference.pool,
                      lambda: groups.reference.ref_log_probs(batch)))
    if groups.critic is not None:
        calls.append(Call("values", groups.critic.pool,
                          lambda: groups.critic.values(batch)))
    if groups.cost_critic is not None:
        calls.append(Call("cost_values", groups.cost_critic.pool,
                          lambda: groups.cost_critic.values(batch)))
    results, timing = timed_at_once(calls)
    if "scores" in results:
        batch = add_rewards(run, batch, results)
    for name in ("old_logprobs", "ref_logprobs", "values", "cost_values"):
        if name in results:
            batch = batch.update(results[name])
    batch.meta.update(timing)
    return batch


TIMING_KEYS = {"scores": "reward", "costs": "reward"}
"""Call name -> the phase its seconds count in, where that is not the call's name."""


def timed_at_once(calls: list[Call]) -> tuple[dict[str, Any], dict[str, float]]:
    """``at_once(calls)``'s results, and each phase's seconds (``timing/<phase>_s``: the sum
    of its calls')."""
    seconds: dict[str, float] = {}  # by call: each lane writes its own keys

    def timed(call: Call) -> Call:
        def fn():
            start = time.perf_counter()
            try:
                return call.fn()
            finally:
                seconds[call.name] = time.perf_counter() - start
        return Call(call.name, call.pool, fn)
    results = at_once([timed(call) for call in calls])
    timing: dict[str, float] = {}
    for name, s in seconds.items():
        key = f"timing/{TIMING_KEYS.get(name, name)}_s"
        timing[key] = timing.get(key, 0.0) + s
    return results, timing


def advantages(run: Run, batch: Batch) -> Batch:
    """The advantages of a prepared batch (``prepare``), with the value models' targets. Where
    the algorithm reads a cost, the batch's mean cost first moves the Lagrange multiplier that
    its advantages then read, as Safe RLHF's reference trainer does."""
    a = run.config.algorithm
    timing: dict[str, float] = {}
    baseline = greedy_baseline(run, batch) if a.spec.greedy_baseline else None
    lagrange = run.controllers.lagrange
    if lagrange is not None:
        lagrange.update(batch["costs"].mean())
    with timer(timing, "timing/advantages_s"):
        adv, targets = estimate_advantages(
            a.name, scores=batch["scores"], mask=batch["response_mask"],
            logprobs=batch.tensors.get("old_logprobs"), ref_logprobs=batch["ref_logprobs"],
            kl_coef=run.controllers.kl.value if a.kl_in_reward else 0.0, kl_type=a.kl_type,
            values=batch.tensors.get("values"), cost_values=batch.tensors.get("cost_values"),
            group_ids=batch["group"], baseline_scores=baseline, costs=batch.tensors.get("costs"),
            lagrange=lagrange.value if lagrange is not None else None,
            gamma=a.gamma, lam=a.lam, norm_by_std=a.norm_by_std)
    batch.tensors["advantages"] = adv
    batch.tensors.update(targets)
    batch.meta.update(timing)
    return batch


def greedy_baseline(run: Run, batch: Batch) -> torch.Tensor:
    """ReMax: each prompt's greedy response, scored as the samples are (the reward model where
    the run has one), broadcast to the prompt's samples."""
    first: dict[int, PromptItem] = {}
    for group, item in zip(batch["group"], batch["item"]):
        first.setdefault(group, item)
    order = sorted(first)
    greedy = generate(run, [first[g] for g in order], greedy_sampling(run.config))
    reward_of = {order[k]: float(v) for k, v in zip(greedy["group"], scores(run, greedy,
                                                                           "scores"))}
    return torch.tensor([reward_of[g] for g in batch["group"]], dtype=torch.float32)


def greedy_sampling(cfg):
    """The run's sampling at temperature 0, one response per prompt."""
    return replace(cfg.sampling, temperature=0.0, n=1)


def update(run: Run, batch: Batch) -> dict[str, float]:
    """The critics' updates (where there are) and the policy's, at once where they live apart;
    their metrics. An on-policy update's old log-probs (its forward's) are added to ``batch``."""
    groups = run.groups
    critics = groups.critics()
    calls = [Call(f"update_{name}", critic.pool, lambda critic=critic: critic.update(batch))
             for name, critic in critics.items()]
    calls.append(Call("update_actor", groups.actor.pool,
                      lambda: groups.actor.update(batch)))
    results, metrics = timed_at_once(calls)
    for name in critics:
        metrics.update(results[f"update_{name}"].meta)
    out = results["update_actor"]
    metrics.update(out.meta)
    batch.tensors.update(out.tensors)
    return metrics


# --------------------------------------------------------------------------------- one iteration
def iteration(run: Run, draw: Callable[[], list[PromptItem]]) -> dict[str, float]:
    """One iteration over the prompts ``draw()`` gives (more draws with dynamic sampling): its
    metrics."""
    start = time.perf_counter()
    batch, metrics = collect(run, draw)
    return finish(run, train(run, batch, metrics), metrics, start)


def train(run: Run, batch: Batch, metrics: dict[str, float]) -> Batch:
    """A generated batch prepared, its advantages estimated and the models updated on it; the
    update's metrics go into ``metrics``."""
    batch = advantages(run, prepare(run, batch))
    metrics.update(update(run, batch))
    return batch


def finish(run: Run, batch: Batch, metrics: dict[str, float], start: float
           ) -> dict[str, float]:
    """The step's ``metrics`` completed (``step_metrics`` of the trained ``batch``, the step's
    seconds since ``start``, throughput, the pools' overlap and idle time, the predicted
    phases) and the controllers moved."""
    metrics.update(step_metrics(run, batch))
    end = time.perf_counter()
    metrics["timing/step_s"] = end - start
    # the paper's unit: prompt and response tokens of the step per second and device
    devices = sum(pool.ranks for pool in run.groups.placement.pools)
    metrics["throughput/tokens_per_s_per_gpu"] = (float(batch["attention_mask"].sum())
                                                  / (end - start) / devices)
    pools = [pool.name for pool in run.groups.placement.pools]
    if len(pools) > 1:  # one pool is busy or idle, never overlapping
        metrics.update(run.groups.timeline.step_metrics(start, end, pools))
    if run.prediction is not None:  # beside each measured phase, the cost model's
        metrics.update({f"predicted/{k}_s": v for k, v in run.prediction.phases.items()})
        metrics["predicted/step_s"] = run.prediction.step
    run.controllers.update(metrics, len(batch))
    return metrics


def collect(run: Run, draw: Callable[[], list[PromptItem]]) -> tuple[Batch, dict[str, float]]:
    """The step's batch of train_batch_size groups (a prompt's n samples), and its DAPO metrics.

    Without dynamic sampling: one ``draw()``, generated (``prepare`` rewards it). With it (DAPO):
    each round is rewarded at once, and the
    groups whose rewards (before overlong shaping) are all equal are set aside and further
    batches drawn, for at most algorithm.max_sampling_rounds rounds, until train_batch_size
    groups with differing rewards are in hand. Surplus groups are cut and a shortfall is filled
    with set-aside groups: the update's batch has a fixed size. Every draw comes from the
    run's prompt sampler, so a resumed run draws what the uninterrupted one would have."""
    a, size = run.config.algorithm, run.config.train_batch_size
    if not a.dynamic_sampling:  # rewarded in ``prepare``, beside the log-probs
        return generate(run, draw()), {}
    rounds = [reward(run, generate(run, draw()))]
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
        rounds.append(reward(run, generate(run, draw())))
    fill = equal[:max(0, size - len(varied))]
    batch = take_groups(rounds, varied[:size] + fill)
    return batch, {"dapo/rounds": len(rounds), "dapo/prompts_drawn": len(rounds) * size,
                   "dapo/groups_dropped": len(equal) - len(fill),
                   "dapo/filled_with_equal": len(fill)}


def take_groups(rounds: list[Batch], chosen: list[tuple[int, int]]) -> Batch:
    """The samples of the ``chosen`` (round, group) pairs, in that order, as one batch whose
    groups are renumbered 0, 1, ... (each round's generate numbers its own from 0); the rounds'
    numeric meta (timings, resharded bytes) summed, their device memory the largest."""
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


def step_metrics(run: Run, batch: Batch) -> dict[str, float]:
    """Rewards, lengths, KL to the reference, the rollout/training mismatch, and the batch's
    timings, resharded bytes and device memory."""
    mask = batch["response_mask"]
    kl = kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], "k1")
    lengths = mask.sum(-1)
    rewards = batch["scores"]
    out = {"reward/mean": rewards.mean().item(),
           "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
           "response_length/mean": lengths.mean().item(),
           "response_length/clip_frac": sum(r == "length" for r in batch["finish_reason"])
           / len(lengths),
           # -log p of the sampled tokens under the raw model (temperature 1, no top-k/top-p):
           # the policy's entropy only where sampling is at temperature 1 without truncation.
           "rollout/neg_logprob": (-(batch["rollout_logprobs"] * mask).sum()
                                   / mask.sum().clamp(min=1)).item(),
           "kl": float((kl * mask).sum() / mask.sum().clamp(min=1)),
           "kl_coef": run.controllers.kl.value}
    out.update({k: v for k, v in batch.meta.items()
                if k.startswith(("timing/", "reshard/", "weight_sync/", "memory/"))})
    if "costs" in batch:
        out["cost/mean"] = batch["costs"].mean().item()
    if "overlong_penalty" in batch:
        out["reward/overlong_penalty_mean"] = batch["overlong_penalty"].mean().item()
    if "tools" in batch.lists:
        out.update(tool_metrics(batch["tools"], lengths.tolist(),
                                response_span(batch).sum(-1).tolist()))
    if run.controllers.lagrange is not None:  # as the step's advantages read it
        out["lagrange"] = run.controllers.lagrange.value
    out.update(mismatch_metrics(run, batch, mask))
    if "staleness" in batch:  # generation ahead of training: the same, per staleness
        stale = batch["staleness"]
        for k in torch.unique(stale[mask.bool()]).tolist():
            out.update({key.replace("mismatch/", f"mismatch/stale{k}/"): v for key, v in
                        mismatch_metrics(run, batch, mask * (stale == k)).items()})
    return out


def mismatch_metrics(run: Run, batch: Batch, mask: torch.Tensor) -> dict[str, float]:
    """``rollout_mismatch`` over the tokens of ``mask``; without its k3 KL where the tokens were
    not drawn from the raw model."""
    mismatch = rollout_mismatch(batch["rollout_logprobs"], batch["old_logprobs"], mask)
    s = run.config.sampling
    if not (s.temperature == 1 and s.top_k == 0 and s.top_p == 1):
        # Both sides are still the raw model's log-probs, but the tokens were not drawn from
        # it: k3 then estimates no KL of either engine.
        del mismatch["mismatch/kl"]
    return {k: v.item() for k, v in mismatch.items()}


def validate(run: Run, held_out: list[PromptItem]) -> dict[str, float]:
    """Greedy responses to the held-out prompts, scored as training samples are (the reward
    model where the run has one): ``val/reward`` and ``val/response_length`` means (and
    ``val/cost`` where the algorithm reads a cost)."""
    start = time.perf_counter()
    batch = generate(run, held_out, greedy_sampling(run.config))
    out = {"val/reward": scores(run, batch, "scores").mean().item(),
           "val/response_length": batch["response_mask"].sum(-1).float().mean().item()}
    if run.config.algorithm.spec.cost:
        out["val/cost"] = scores(run, batch, "costs").mean().item()
    out["timing/validation_s"] = time.perf_counter() - start
    return out
