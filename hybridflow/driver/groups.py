"""The worker groups of one run, with typed calls.

``start_groups`` starts a group for each model of the run's placement
(``hybridflow.config.placement``: the actor, with the reference in its processes where they share
pool and layout; the reference otherwise; the critic and the cost critic where the algorithm
trains them; a reward and a cost model where the config names them) on the ``ResourcePool`` of its pool, the groups of one
pool sharing its devices. Each group is wrapped in a class whose methods are the calls the driver
makes, each dispatching its batch by the data-parallel view its worker declares: ``train`` (the
training layout's DP groups) or ``gen`` (the generation replicas), and recording its start and end
on the run's ``Timeline``. Only this module names the workers' methods.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from hybridflow.algorithms.specs import TRAINED_CRITICS
from hybridflow.batch import Batch
from hybridflow.config.placement import Placement, resolve_placement
from hybridflow.config.sources import SCORERS
from hybridflow.driver.dataflow import Call, Timeline, at_once
from hybridflow.hybrid_engine.push import store_address as push_store
from hybridflow.planner.memory import MemoryEstimate, out_of_memory_notes
from hybridflow.workers.actor import ActorRolloutRefWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.group import ResourcePool, WorkerGroup
from hybridflow.workers.reference import ReferenceWorker
from hybridflow.workers.rollout import RolloutWorker

TRAIN, GEN = "train", "gen"
"""The dispatch views: a batch split over the training layout's DP groups, or over the generation
replicas."""


class _Group:
    """A worker group on a pool (its name); its dispatched calls go on ``timeline``."""

    def __init__(self, group: WorkerGroup, pool: str, timeline: Timeline):
        self.group, self.pool, self.timeline = group, pool, timeline

    def _by_dp(self, method: str, batch: Batch, view: str, **kwargs: Any) -> Batch:
        return self.timeline.timed(self.pool, f"{self.group.name}.{method}",
                                   lambda: self.group.run_by_dp(method, batch, view=view,
                                                                **kwargs))

    def _on_all(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every rank (``WorkerGroup.run``), recorded on the timeline."""
        return self.timeline.timed(self.pool, f"{self.group.name}.{method}",
                                   lambda: self.group.run(method, *args))


class ActorGroup(_Group):
    """The actor's ranks: the policy's training engine, its rollout engine and, where it lives
    there, the reference (``ActorRolloutRefWorker``)."""

    def generate(self, batch: Batch, sampling=None) -> Batch:
        """``sampling.n`` responses (default: the run's sampling) to each of ``batch``'s
        ``prompt_ids``, one row per sample; the actor switches to the generation layout and
        back inside."""
        return self._by_dp("generate", batch, GEN, sampling=sampling)

    def log_probs(self, batch: Batch) -> Batch:
        """``old_logprobs``: the policy's per-token log-probs of the responses."""
        return self._by_dp("compute_log_prob", batch, TRAIN)

    def ref_log_probs(self, batch: Batch) -> Batch:
        """``ref_logprobs``: the reference's."""
        return self._by_dp("compute_ref_log_prob", batch, TRAIN)

    def update(self, batch: Batch) -> Batch:
        """The policy update over the step's samples: its metrics (meta), and ``old_logprobs``
        where the update computed them (on-policy)."""
        return self._by_dp("update_actor", batch, TRAIN)

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

    def push_weights(self, address: str, size: int, version: int) -> Batch:
        """Send the weights as ``version`` to the generation pool over the push group at
        ``address`` of ``size`` processes (``ActorRolloutRefWorker.push_weights``); rank 0's
        meta."""
        return self._on_all("push_weights", address, size, version)[0]


class RolloutGroup(_Group):
    """A generation pool of its own (``RolloutWorker``, rollout.mode one_step_off or async)."""

    def generate(self, batch: Batch, sampling=None) -> Batch:
        """As ``ActorGroup.generate``, with ``weight_version`` per sample."""
        return self._by_dp("generate", batch, GEN, sampling=sampling)

    def extend(self, batch: Batch) -> Batch:
        """Responses in progress continued (``RolloutWorker.extend``), split over the replicas:
        ``batch``'s size a multiple of their number."""
        return self._by_dp("extend", batch, GEN)

    def receive_weights(self, address: str, size: int, version: int) -> list[Batch]:
        """Take the push of ``version`` (``RolloutWorker.receive_weights``); each rank's meta."""
        return self._on_all("receive_weights", address, size, version)

    def save(self, ckpt_dir: str) -> None:
        self.group.run("save_state", ckpt_dir)

    def load(self, ckpt_dir: str) -> None:
        self.group.run("load_state", ckpt_dir)


class ReferenceGroup(_Group):
    """The reference's ranks where it lives apart from the actor (``ReferenceWorker``)."""

    def ref_log_probs(self, batch: Batch) -> Batch:
        """``ref_logprobs``: the reference's per-token log-probs of the responses."""
        return self._by_dp("compute_ref_log_prob", batch, TRAIN)


class CriticGroup(_Group):
    """A trained value model's ranks (``CriticWorker``): the critic, or the cost critic."""

    def values(self, batch: Batch) -> Batch:
        """The value of the state before each token: ``values`` (the critic) or ``cost_values``
        (the cost critic)."""
        return self._by_dp("compute_values", batch, TRAIN)

    def update(self, batch: Batch) -> Batch:
        """The value update on the batch's ``returns`` (``cost_returns``) (metrics in meta)."""
        return self._by_dp("update_critic", batch, TRAIN)

    def save(self, ckpt_dir: str) -> None:
        self.group.run("save_state", ckpt_dir)

    def load(self, ckpt_dir: str) -> None:
        self.group.run("load_state", ckpt_dir)


class ScorerGroup(_Group):
    """A reward or cost model's ranks (``CriticWorker``, untrained)."""

    def scores(self, batch: Batch) -> Any:
        """One score per sample (a float tensor [B])."""
        return self._by_dp("compute_scores", batch, TRAIN)["scores"].float()


@dataclass
class Groups:
    """The groups of one run. ``reference``: the group that answers the reference's log-probs
    (the actor's where the reference lives in its processes); ``scorers``: by the scores they
    give, "scores" (the reward model) and "costs" (the cost model)."""

    actor: ActorGroup
    reference: ActorGroup | ReferenceGroup
    placement: Placement
    timeline: Timeline
    critic: CriticGroup | None = None
    cost_critic: CriticGroup | None = None
    scorers: dict[str, ScorerGroup] = field(default_factory=dict)
    pools: list[ResourcePool] = field(default_factory=list)
    rollout: RolloutGroup | None = None
    """The generation pool's group, where the run generates on a pool of its own."""
    push_dir: str | None = None
    """The push group's store folder (a local run with a generation pool)."""
    push_address: str | None = None

    @property
    def generator(self) -> ActorGroup | RolloutGroup:
        """The group that generates: the generation pool's, else the actor's."""
        return self.rollout or self.actor

    def push(self, version: int) -> dict[str, float]:
        """Push the actor's weights as ``version`` to the generation pool, both sides at once
        (``hybrid_engine.push``); the push's metrics: ``weight_sync/bytes``, ``weight_sync/s``
        (the whole push: the actor's gather, the broadcasts, the check and the engines' load)
        and ``weight_sync/verify_s`` (the sender's fingerprints and the slowest receiver's
        check)."""
        if self.push_address is None:
            if self.push_dir is not None:
                self.push_address = push_store(self.push_dir)
            else:
                host, port = self.actor.group.run("push_address")[0]
                self.push_address = push_store(None, host, port)
        size = 1 + self.rollout.group.world_size
        start = time.perf_counter()
        sent, received = at_once([
            Call("send", self.actor.pool,
                 lambda: self.actor.push_weights(self.push_address, size, version)),
            Call("receive", self.rollout.pool,
                 lambda: self.rollout.receive_weights(self.push_address, size, version))
        ]).values()
        meta = sent.meta
        return {"weight_sync/bytes": meta["weight_sync/bytes"],
                "weight_sync/s": time.perf_counter() - start,
                "weight_sync/verify_s": meta["weight_sync/verify_s"]
                + max(r.meta["weight_sync/verify_s"] for r in received)}

    def critics(self) -> dict[str, CriticGroup]:
        """The trained value models the run has, by name (``TRAINED_CRITICS``)."""
        return {name: group for name in TRAINED_CRITICS
                if (group := getattr(self, name)) is not None}

    def trained(self) -> list[ActorGroup | CriticGroup | RolloutGroup]:
        """The groups whose state a checkpoint holds: the trained ones, and the generation
        pool's (its call counts)."""
        return [self.actor, *self.critics().values(), *([self.rollout] if self.rollout else [])]

    def close(self) -> None:
        """Stop every group and free its pool."""
        wrappers = {id(w): w for w in (self.actor, self.reference, self.critic,
                                       self.cost_critic, self.rollout, *self.scorers.values())
                    if w is not None}
        for wrapper in wrappers.values():
            wrapper.group.shutdown()
        for pool in self.pools:
            pool.close()
        self.pools = []
        if self.push_dir is not None:
            shutil.rmtree(self.push_dir, ignore_errors=True)
            self.push_dir = None


def start_groups(cfg, model_dir: str, checkpoints: dict[str, Any],
                 memory: MemoryEstimate) -> Groups:
    """Start the run's groups (``cfg`` an RLConfig; ``model_dir`` the actor's and reference's
    checkpoint; ``checkpoints``: config key -> checkpoint directory of the other models the run
    names: ``critic.model`` (absent: the actor's), ``reward_model``, ``cost_model``), each on
    its pool. Each worker gets its own role's config only; each group the notes of ``memory``
    (the run's memory estimate) that a CUDA out-of-memory error of its workers names."""
    start = time.perf_counter()
    placement = resolve_placement(cfg)
    timeline = Timeline()
    pools = {pool.name: ResourcePool(pool.ranks, cfg.ray,
                                     share=len(placement.pool_groups(pool)))
             for pool in placement.pools}
    critic_dir = str(checkpoints.get("critic.model") or model_dir)
    built: dict[str, _Group] = {}
    try:
        for model in placement.groups():
            size, pool = model.layout.world_size, model.pool
            if model.name == "actor":
                group = WorkerGroup(
                    ActorRolloutRefWorker, size, ray_config=cfg.ray, name="actor",
                    pool=pools[pool], actor=cfg.actor, rollout=cfg.rollout, ref=cfg.ref,
                    hybrid_engine=cfg.hybrid_engine, weight_sync=cfg.weight_sync,
                    model_dir=model_dir, seed=cfg.seed,
                    pad_token_id=cfg.pad_token_id, max_prompt_tokens=cfg.data.max_prompt_tokens,
                    with_ref=placement.reference_in_actor, generates=cfg.rollout.mode == "sync")
                built["actor"] = ActorGroup(group, pool, timeline)
            elif model.name == "rollout":
                group = WorkerGroup(RolloutWorker, size, ray_config=cfg.ray, name="rollout",
                                    pool=pools[pool], rollout=cfg.rollout,
                                    dtype=cfg.actor.engine.dtype, model_dir=model_dir,
                                    seed=cfg.seed, pad_token_id=cfg.pad_token_id,
                                    max_prompt_tokens=cfg.data.max_prompt_tokens)
                built["rollout"] = RolloutGroup(group, pool, timeline)
            elif model.name == "reference":
                group = WorkerGroup(ReferenceWorker, size, ray_config=cfg.ray, name="reference",
                                    pool=pools[pool], layout=model.layout,
                                    engine=cfg.actor.engine, ref=cfg.ref, model_dir=model_dir)
                built["reference"] = ReferenceGroup(group, pool, timeline)
            else:  # the critic or cost critic, or a reward or cost model (untrained)
                trainable = model.name in TRAINED_CRITICS
                group = WorkerGroup(
                    CriticWorker, size, ray_config=cfg.ray, name=model.name, pool=pools[pool],
                    critic=cfg.critic, layout=model.layout,
                    model_dir=critic_dir if trainable else str(checkpoints[model.name]),
                    trainable=trainable, model_key=model.name,
                    role=model.name if trainable else "critic")
                wrapper = CriticGroup if trainable else ScorerGroup
                built[model.name] = wrapper(group, pool, timeline)
    except BaseException:
        for wrapper in built.values():
            wrapper.group.shutdown()
        for pool in pools.values():
            pool.close()
        raise
    notes = out_of_memory_notes(cfg, memory)
    for name, wrapper in built.items():
        wrapper.group.memory_notes = notes.get(name, {})
    actor = built.pop("actor")
    groups = Groups(actor=actor, reference=built.pop("reference", actor), placement=placement,
                    timeline=timeline, critic=built.pop("critic", None),
                    cost_critic=built.pop("cost_critic", None),
                    scorers={key: built[field] for key, field in SCORERS.items()
                             if field in built},
                    pools=list(pools.values()), rollout=built.pop("rollout", None))
    if groups.rollout is not None and cfg.ray.address == "local":
        groups.push_dir = tempfile.mkdtemp(prefix="hybridflow-push-")
    print(groups.actor.describe(), flush=True)
    print(f"workers ready in {time.perf_counter() - start:.1f}s", flush=True)
    return groups
