"""Where each model of a run lives: named pools of devices, and for each model its pool and its
training layout (HybridFlow, arXiv 2409.19256, sections 4 and 6).

The models: the ``actor`` (with its rollout engine), the ``reference``, the ``critic``, the
``reward_model``, the ``cost_model`` and the ``cost_critic``, those the run has; and, where
``rollout.mode`` generates ahead of training (one_step_off, async), the ``rollout``: a pool of
its own, written out, with no other model on it, one generation replica per rank. Models on one
pool share its devices and take turns (their calls run one after another); models on different
pools run their calls at the same time where the dataflow allows (``hybridflow.driver.step``).

``placement.preset`` expands to pools and models:

* ``colocate`` (the default): every model on the same devices, as DeepSpeed-Chat places them and
  as this loop did before pools existed; models of different world sizes get a pool per size.
* ``split``: the actor side (actor, reference) on one pool, the critic side (critic, reward and
  cost models, cost critic) on another.
* ``standalone``: a pool for each model.
* ``auto``: the planner's placement search (``hybridflow.planner.placements``, HybridFlow's
  Algorithm 1) chooses the pools, the models on each and every layout at start-up, from the
  rates of ``cluster.calibration`` over ``cluster.nodes``; ``placement: auto`` is short for it.
  Until then the run's checks see it as ``colocate`` with the configured layouts, less the
  cluster's device count (the search fills the cluster).

Or the pools are written out (``placement.pools``, ``placement.models``). A pool's ranks are
``nodes * devices_per_node``; each rank takes ``ray.gpus_per_worker`` GPUs. A model's world size
(tp * pp * dp of its layout) is its pool's ranks.

Layouts: the actor's is ``actor.layout``, the critic's ``critic.layout``; the reference runs at
the actor's, the reward and cost models and the cost critic at the critic's, unless
``placement.layouts.<model>`` gives one. The reference lives in the actor's worker group (one
process per rank holds both) when it shares the actor's pool and layout; otherwise it is a group
of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.errors import ConfigError, check_choice, check_int
from hybridflow.parallel.layout import TrainLayout

MODELS = ("actor", "reference", "critic", "reward_model", "cost_model", "cost_critic", "rollout")
"""Every model a run can have, in the order the worker groups start. ``rollout`` is the
generation pool of its own that ``rollout.mode`` one_step_off and async generate on (one
replica per rank); in sync mode the actor generates in its own processes."""
PRESETS = ("colocate", "split", "standalone", "auto")
ACTOR_SIDE = ("actor", "reference")
"""``split``'s first pool; the other models make the second."""
ROLLOUT = "rollout"
"""The generation pool's model (``rollout.mode`` one_step_off and async)."""
LAYOUT_KEYS = {"actor": "actor.layout", "critic": "critic.layout", "rollout": "rollout.tp"}
"""Models whose layout is their own section's (placement.layouts may not give it)."""


@dataclass(kw_only=True)
class PoolConfig:
    """A set of devices: ``nodes`` x ``devices_per_node`` ranks."""

    nodes: int = 1
    """Nodes the pool spans."""
    devices_per_node: int = 1
    """Ranks on each node (each takes ray.gpus_per_worker GPUs); a tensor-parallel group stays
    inside one node."""

    def __post_init__(self) -> None:
        check_int("nodes", self.nodes)
        check_int("devices_per_node", self.devices_per_node)

    @property
    def ranks(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass(kw_only=True)
class PlacementConfig:
    """The pools and which model lives on which (see the module docstring)."""

    preset: str | None = None
    """colocate, split, standalone or auto (the planner chooses); null: colocate, or the pools
    written out below. ``placement: NAME`` is short for ``placement: {preset: NAME}``."""
    pools: dict[str, PoolConfig] = field(default_factory=dict)
    """Pool name -> its devices, where the placement is written out."""
    models: dict[str, str] = field(default_factory=dict)
    """Model -> the name of its pool (every model of the run), where the pools are written out."""
    layouts: dict[str, TrainLayout] = field(default_factory=dict)
    """reference, reward_model, cost_model or cost_critic -> its training layout, where it is not
    the default (the actor's for the reference, the critic's for the others)."""

    def __post_init__(self) -> None:
        from hybridflow.config.loader import build_config  # deferred: loader -> rl -> here
        if self.preset is not None:
            check_choice("preset", self.preset, PRESETS)
        self.pools = {name: pool if isinstance(pool, PoolConfig)
                      else build_config(PoolConfig, pool, f"pools.{name}")
                      for name, pool in self.pools.items()}
        self.layouts = {name: layout if isinstance(layout, TrainLayout)
                        else build_config(TrainLayout, layout, f"layouts.{name}")
                        for name, layout in self.layouts.items()}
        for key, names in (("models", self.models), ("layouts", self.layouts)):
            for name in names:
                if name not in MODELS:
                    raise ConfigError(f"{key}.{name}", f"not a model; one of {', '.join(MODELS)}")
        for name in self.layouts:
            if name in LAYOUT_KEYS:
                raise ConfigError(f"layouts.{name}", f"the {name}'s layout is "
                                  f"{LAYOUT_KEYS[name]}; set it there")
        if self.preset is not None and (self.pools or self.models):
            raise ConfigError("preset", "give either a preset or the pools and models written "
                                        "out, not both; remove one")
        if bool(self.pools) != bool(self.models):
            given, missing = ("pools", "models") if self.pools else ("models", "pools")
            raise ConfigError(missing, f"placement.{given} is set, so placement.{missing} must "
                                       "be too (the pools and which model lives on which)")
        for model, pool in self.models.items():
            if pool not in self.pools:
                raise ConfigError(f"models.{model}", f"names pool {pool!r}, which is not in "
                                  f"placement.pools ({', '.join(self.pools)})")


@dataclass(frozen=True)
class ModelPlace:
    """One model of a run: its pool and its layout."""

    name: str
    pool: str
    layout: TrainLayout
    layout_key: str
    """The config key of its layout (what to change when it does not fit)."""


@dataclass(frozen=True)
class Pool:
    """One pool of a run with the models on it, in start order."""

    name: str
    nodes: int
    devices_per_node: int
    models: tuple[str, ...]

    @property
    def ranks(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass(frozen=True)
class Placement:
    """The resolved placement of a run: ``resolve_placement``."""

    pools: tuple[Pool, ...]
    models: dict[str, ModelPlace]

    @property
    def reference_in_actor(self) -> bool:
        """The reference lives in the actor's processes: same pool, same layout."""
        ref, actor = self.models["reference"], self.models["actor"]
        return ref.pool == actor.pool and ref.layout == actor.layout

    def groups(self) -> list[ModelPlace]:
        """The worker groups to start, in order: every model but a reference that lives in the
        actor's group."""
        return [m for m in self.models.values()
                if not (m.name == "reference" and self.reference_in_actor)]

    def pool_groups(self, pool: Pool) -> list[str]:
        """The worker groups of ``pool`` (the devices' sharers)."""
        names = {m.name for m in self.groups()}
        return [m for m in pool.models if m in names]

    def describe(self) -> list[str]:
        """``hybridflow check``'s lines: each pool with its models and their layouts."""
        lines = []
        for pool in self.pools:
            models = ", ".join(
                f"{m} {_short(self.models[m].layout)}"
                + (" (in the actor's processes)" if m == "reference" and self.reference_in_actor
                   else "") for m in pool.models)
            lines.append(f"pool {pool.name}: {pool.nodes} node(s) x {pool.devices_per_node} = "
                         f"{pool.ranks} ranks: {models}")
        return lines


def run_models(cfg: Any) -> list[str]:
    """The models a run has (``cfg`` an RLConfig), in MODELS' order."""
    spec = cfg.algorithm.spec
    has = {"actor": True, "reference": True, "critic": spec.critic,
           "reward_model": cfg.reward_model is not None, "cost_model": cfg.cost_model is not None,
           "cost_critic": spec.cost_critic, "rollout": cfg.rollout.mode != "sync"}
    return [m for m in MODELS if has[m]]


def model_layout(cfg: Any, model: str) -> tuple[TrainLayout, str]:
    """(layout, its config key) of ``model``: its own section's, placement.layouts', or the
    default (the actor's for the reference, the critic's for the rest). The rollout's is
    ``rollout_layout``'s, which needs its pool."""
    if model in LAYOUT_KEYS:
        return getattr(cfg, model).layout, LAYOUT_KEYS[model]
    if model in cfg.placement.layouts:
        return cfg.placement.layouts[model], f"placement.layouts.{model}"
    default = "actor" if model == "reference" else "critic"
    return getattr(cfg, default).layout, LAYOUT_KEYS[default]


def resolve_placement(cfg: Any) -> Placement:
    """The pools and models of ``cfg`` (an RLConfig), every model's world size checked against
    its pool: a ConfigError naming the key to change."""
    p = cfg.placement
    _check_rollout_pool(cfg)
    models = run_models(cfg)
    for key, named in (("layouts", p.layouts), ("models", p.models)):
        for name in named:
            if name not in models:
                raise ConfigError(f"placement.{key}.{name}", f"this run has no {name} (its "
                                  f"models: {', '.join(models)}); remove it")
    layouts = {m: model_layout(cfg, m) for m in models if m != "rollout"}
    if p.pools:
        missing = [m for m in models if m not in p.models]
        if missing:
            raise ConfigError(f"placement.models.{missing[0]}", "not placed: name the pool of "
                              f"every model of the run ({', '.join(models)})")
        unused = [name for name in p.pools if name not in p.models.values()]
        if unused:
            raise ConfigError(f"placement.pools.{unused[0]}", "no model lives on it; remove it "
                                                              "or place a model there")
        pools = [Pool(name, pc.nodes, pc.devices_per_node,
                      tuple(m for m in models if p.models[m] == name))
                 for name, pc in p.pools.items()]
        for pool in pools:
            if "rollout" in pool.models:
                layouts["rollout"] = rollout_layout(cfg, pool.ranks)
                if pool.models != ("rollout",):
                    raise ConfigError(f"placement.models.{ROLLOUT}", f"its pool {pool.name} also "
                                      f"holds {', '.join(m for m in pool.models if m != 'rollout')}"
                                      ": the generation pool generates while the others train; "
                                      "give it a pool of its own")
    else:
        preset = "colocate" if p.preset in (None, "auto") else p.preset
        pools = _preset_pools(preset, models,
                              {m: lay.world_size for m, (lay, _) in layouts.items()},
                              _ranks_per_node(cfg))
    placed = {}
    for pool in pools:
        for m in pool.models:
            layout, key = layouts[m]
            placed[m] = ModelPlace(m, pool.name, layout, key)
            if layout.world_size != pool.ranks:
                raise ConfigError(f"{key}.dp", f"the {m}'s layout {_short(layout)} has "
                                  f"{layout.world_size} ranks, but its pool {pool.name} has "
                                  f"{pool.ranks} ({pool.nodes} x {pool.devices_per_node}); "
                                  "make tp * pp * dp equal to the pool's ranks, or resize the "
                                  "pool")
    placement = Placement(tuple(pools), {m: placed[m] for m in models})
    if cfg.actor.lora.enabled and not placement.reference_in_actor:
        raise ConfigError("placement", "with actor.lora the reference is the actor's frozen base "
                                       "(adapters off): place it on the actor's pool at the "
                                       "actor's layout")
    return placement


def rollout_layout(cfg: Any, ranks: int) -> tuple[TrainLayout, str]:
    """(layout, its key) of a generation pool of ``ranks`` ranks: one replica per rank."""
    return TrainLayout(tp=cfg.rollout.tp, pp=1, dp=max(ranks // cfg.rollout.tp, 1)), "rollout.tp"


def _check_rollout_pool(cfg: Any) -> None:
    """A generation pool of its own exactly where ``rollout.mode`` generates apart: written-out
    pools with ``placement.models.rollout`` in one_step_off and async, none in sync."""
    p, mode = cfg.placement, cfg.rollout.mode
    if mode == "sync":
        if "rollout" in p.models:
            raise ConfigError(f"placement.models.{ROLLOUT}", "a generation pool of its own is for "
                              "rollout.mode=one_step_off or async (in sync mode the actor "
                              "generates in its own processes); set rollout.mode or remove it")
        return
    if "rollout" not in p.models:
        raise ConfigError(f"placement.models.{ROLLOUT}", f"rollout.mode={mode} generates on a pool "
                          "of its own: write the pools out, e.g. placement: {pools: {train: "
                          "{devices_per_node: 1}, gen: {devices_per_node: 1}}, models: {actor: "
                          "train, reference: train, rollout: gen}}")


def _ranks_per_node(cfg: Any) -> int | None:
    """Ranks on a node of the declared cluster (None: no cluster, or ranks without GPUs)."""
    c, gpus = cfg.cluster, cfg.ray.gpus_per_worker
    if c.nodes is None or not gpus or c.gpus_per_node % gpus:
        return None
    return int(c.gpus_per_node // gpus)


def _preset_pools(preset: str, models: list[str], sizes: dict[str, int],
                  per_node: int | None) -> list[Pool]:
    """A preset's pools: the models of each side (colocate: one side; split: the actor's and
    the critic's; standalone: one per model), a pool for each distinct world size in it, on
    whole nodes of ``per_node`` ranks where it fills them."""
    if preset == "standalone":
        sides = [[m] for m in models]
    elif preset == "split":
        sides = [[m for m in models if m in ACTOR_SIDE], [m for m in models if m not in ACTOR_SIDE]]
    else:
        sides = [models]
    pools = []
    for side in filter(None, sides):
        for size in dict.fromkeys(sizes[m] for m in side):
            members = tuple(m for m in side if sizes[m] == size)
            nodes = size // per_node if per_node and size % per_node == 0 else 1
            pools.append(Pool(members[0] if preset == "standalone" else _pool_name(members),
                              nodes, size // nodes, members))
    return pools


def _pool_name(members: tuple[str, ...]) -> str:
    """A preset pool's name: its first model's side ("actor" or "critic"), or the model."""
    return members[0] if len(members) == 1 else members[0].split("_")[0]


def _short(layout: TrainLayout) -> str:
    return f"tp={layout.tp} pp={layout.pp} dp={layout.dp}"
