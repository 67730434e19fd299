"""The worker groups of one run, with typed calls.

``start_groups`` starts the groups the run's placement lists (``config.cluster.worker_groups``:
the actor; the critic where the algorithm trains one; a reward and a cost model where the config
names them) in the pools ``config.cluster.gpu_pools`` gives them. Each group is wrapped in a class
whose methods are the calls the driver makes, each dispatching its batch by the data-parallel
view its worker declares: ``train`` (the training layout's DP groups) or ``gen`` (the generation
replicas). Only this module names the workers' methods.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from hybridflow.batch import Batch
from hybridflow.config.cluster import gpu_pools, worker_groups
from hybridflow.config.sources import SCORERS
from hybridflow.workers.actor import ActorRolloutRefWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.group import ResourcePool, WorkerGroup

TRAIN, GEN = "train", "gen"
"""The dispatch views: a batch split over the training layout's DP groups, or over the generation
replicas."""


class ActorGroup:
    """The actor's ranks: the policy's training engine, its rollout engine and the reference
    (``ActorRolloutRefWorker``)."""

    def __init__(self, group: WorkerGroup):
        self.group = group

    def generate(self, batch: Batch, sampling=None) -> Batch:
        """``sampling.n`` responses (default: the run's sampling) to each of ``batch``'s
        ``prompt_ids``, one row per sample; the actor switches to the generation layout and
        back inside."""
        return self.group.run_by_dp("generate", batch, view=GEN, sampling=sampling)

    def log_probs(self, batch: Batch) -> Batch:
        """``old_logprobs``: the policy's per-token log-probs of the responses."""
        return self.group.run_by_dp("compute_log_prob", batch, view=TRAIN)

    def ref_log_probs(self, batch: Batch) -> Batch:
        """``ref_logprobs``: the reference's."""
        return self.group.run_by_dp("compute_ref_log_prob", batch, view=TRAIN)

    def update(self, batch: Batch) -> Batch:
        """The policy update over the step's samples: its metrics (meta), and ``old_logprobs``
        where the update computed them (on-policy)."""
        return self.group.run_by_dp("update_actor", batch, view=TRAIN)

    def describe(self) -> str:
        """The 3D-HybridEngine's summary of the switch between the two layouts."""
        return self.group.run("describe")[0]

    def full_weights(self) -> dict[str, Any]:
        """The actor's full weights by Megatron name (LoRA adapters merged in)."""
        return self.group.run("full_weights")[0]

    def save(self, ckpt_dir: str) -> None:
        self.group.run("save_state", ckpt_dir)

    def load(self, ckpt_dir: str) -> None:
        self.group.run("load_state", ckpt_dir)

    def arm_profile(self, calls: dict[str, str], top: int) -> None:
        """Profile the next call of each worker method in ``calls`` (``Worker.arm_profile``)."""
        self.group.run("arm_profile", calls, top)


class CriticGroup:
    """A trained value model's ranks (``CriticWorker``): the critic, or the cost critic."""

    def __init__(self, group: WorkerGroup):
        self.group = group

    def values(self, batch: Batch) -> Batch:
        """The value of the state before each token: ``values`` (the critic) or ``cost_values``
        (the cost critic)."""
        return self.group.run_by_dp("compute_values", batch, view=TRAIN)

    def update(self, batch: Batch) -> Batch:
        """The value update on the batch's ``returns`` (``cost_returns``) (metrics in meta)."""
        return self.group.run_by_dp("update_critic", batch, view=TRAIN)

    def save(self, ckpt_dir: str) -> None:
        self.group.run("save_state", ckpt_dir)

    def load(self, ckpt_dir: str) -> None:
        self.group.run("load_state", ckpt_dir)


class ScorerGroup:
    """A reward or cost model's ranks (``CriticWorker``, untrained)."""

    def __init__(self, group: WorkerGroup):
        self.group = group

    def scores(self, batch: Batch) -> Any:
        """One score per sample (a float tensor [B])."""
        return self.group.run_by_dp("compute_scores", batch, view=TRAIN)["scores"].float()


@dataclass
class Groups:
    """The groups of one run. ``scorers``: by the scores they give, "scores" (the reward model)
    and "costs" (the cost model)."""

    actor: ActorGroup
    critic: CriticGroup | None = None
    cost_critic: CriticGroup | None = None
    scorers: dict[str, ScorerGroup] = field(default_factory=dict)
    pools: list[ResourcePool] = field(default_factory=list)

    def trained(self) -> list[ActorGroup | CriticGroup]:
        """The groups whose state a checkpoint holds."""
        return [self.actor] + [g for g in (self.critic, self.cost_critic) if g is not None]

    def close(self) -> None:
        """Stop every group and free its pool."""
        for wrapper in (self.actor, self.critic, self.cost_critic, *self.scorers.values()):
            if wrapper is not None:
                wrapper.group.shutdown()
        for pool in self.pools:
            pool.close()
        self.pools = []


def start_groups(cfg, model_dir: str, scorer_dirs: dict[str, Any]) -> Groups:
    """Start the run's groups (``cfg`` an RLConfig; ``model_dir`` the actor's checkpoint, from
    which the critics start too; ``scorer_dirs``: "scores"/"costs" -> the reward/cost model's).
    Each worker gets its own role's config only."""
    start = time.perf_counter()
    scores_of = {field: key for key, field in SCORERS.items()}  # reward_model -> "scores"
    specs = []  # (name, world size, worker class, its keyword arguments)
    for name, size in worker_groups(cfg):
        if name == "actor":
            specs.append((name, size, ActorRolloutRefWorker, dict(
                actor=cfg.actor, rollout=cfg.rollout, ref=cfg.ref,
                hybrid_engine=cfg.hybrid_engine, model_dir=model_dir, seed=cfg.seed,
                pad_token_id=cfg.pad_token_id, max_prompt_tokens=cfg.data.max_prompt_tokens)))
        elif name in ("critic", "cost_critic"):
            specs.append((name, size, CriticWorker, dict(critic=cfg.critic,
                                                         model_dir=model_dir, role=name)))
        else:  # a reward or cost model, named by the scores it gives
            specs.append((scores_of[name], size, CriticWorker, dict(
                critic=cfg.critic, model_dir=str(scorer_dirs[scores_of[name]]),
                trainable=False, model_key=name)))
    pools: dict[int, ResourcePool] = {}  # world size -> the pool its colocated groups share
    if cfg.ray.colocate:
        for names, size in gpu_pools(cfg):
            pools[size] = ResourcePool(size, cfg.ray, share=len(names))
    built = {name: WorkerGroup(cls, size, ray_config=cfg.ray, name=name, pool=pools.get(size),
                               **kwargs)
             for name, size, cls, kwargs in specs}
    critic, cost_critic = built.pop("critic", None), built.pop("cost_critic", None)
    groups = Groups(actor=ActorGroup(built.pop("actor")),
                    critic=CriticGroup(critic) if critic is not None else None,
                    cost_critic=CriticGroup(cost_critic) if cost_critic is not None else None,
                    scorers={k: ScorerGroup(g) for k, g in built.items()},
                    pools=list(pools.values()))
    print(groups.actor.describe(), flush=True)
    print(f"workers ready in {time.perf_counter() - start:.1f}s", flush=True)
    return groups
