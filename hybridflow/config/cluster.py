"""The cluster a run is meant for, and the checks that need only the config: the worker groups'
GPUs against the cluster's, and tensor-parallel groups inside one node.

Worker groups and their GPUs, as ``driver.groups.start_groups`` places them: the actor group
(actor, rollout and reference on each rank) has ``actor.layout.world_size`` ranks; the critic,
the cost critic and the reward and cost models have ``critic.layout.world_size`` ranks each. With
``ray.colocate`` the groups of equal world size share one ``ResourcePool`` of that many bundles
(HybridFlow's colocated placement: they take turns on the same GPUs); without it every group has
a pool of its own. Each bundle holds ``ray.gpus_per_worker`` GPUs. The memory on those GPUs is
estimated in ``hybridflow.planner.memory``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.errors import ConfigError, check_float, check_int

GROUP_KEYS = {"actor": "actor.layout", "critic": "critic.layout", "cost_critic": "critic.layout",
              "reward_model": "critic.layout", "cost_model": "critic.layout"}
"""Worker group -> the config key of its layout (the cost critic, reward and cost models run at
the critic's)."""


@dataclass(kw_only=True)
class ClusterConfig:
    """The GPUs the run is meant for; ``hybridflow check`` checks the layouts against them.
    Unset (``nodes: null``) nothing is checked."""

    nodes: int | None = None
    """Nodes of the cluster; null: not declared (no GPU-count or memory check)."""
    gpus_per_node: int = 8
    """GPUs per node; a tensor-parallel group must fit in one node."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU in GiB (A100-80GB: 80); the per-GPU memory estimate must fit in it."""
    calibration: str | None = None
    """The rates ``hybridflow calibrate --out FILE`` measured on a node of this cluster: with it
    ``hybridflow plan`` ranks mappings, and the trainer logs the cost model's time per phase
    beside the measured one (``predicted/<phase>_s``)."""

    def __post_init__(self) -> None:
        check_int("nodes", self.nodes, none_ok=True)
        check_int("gpus_per_node", self.gpus_per_node)
        check_float("gpu_memory_gb", self.gpu_memory_gb, low=0, low_open=True)
        if self.nodes is None:
            for key, default in (("gpus_per_node", 8), ("gpu_memory_gb", 80.0)):
                if getattr(self, key) != default:
                    raise ConfigError(key, "has no effect while nodes is null (nothing is "
                                           "checked); set nodes or remove it")

    @property
    def gpus(self) -> int:
        return (self.nodes or 0) * self.gpus_per_node


def worker_groups(cfg: Any) -> list[tuple[str, int]]:
    """(group, world size) of every worker group the run starts, ``cfg`` an RLConfig."""
    groups = [("actor", cfg.actor.layout.world_size)]
    if cfg.algorithm.spec.critic:
        groups.append(("critic", cfg.critic.layout.world_size))
    if cfg.algorithm.spec.cost_critic:
        groups.append(("cost_critic", cfg.critic.layout.world_size))
    for key in ("reward_model", "cost_model"):
        if getattr(cfg, key) is not None:
            groups.append((key, cfg.critic.layout.world_size))
    return groups


def gpu_pools(cfg: Any) -> list[tuple[tuple[str, ...], int]]:
    """(groups sharing the pool, its bundles) of every resource pool: with ``ray.colocate`` one
    per distinct world size, else one per group."""
    groups = worker_groups(cfg)
    if not cfg.ray.colocate:
        return [((name,), size) for name, size in groups]
    sizes = list(dict.fromkeys(size for _, size in groups))
    return [(tuple(n for n, s in groups if s == size), size) for size in sizes]


def check_cluster(cfg: Any) -> None:
    """With ``cluster.nodes`` set: the pools' GPUs are the cluster's, and every TP group of a
    training layout sits inside one node. ``cfg`` an RLConfig; raises a ConfigError naming the key
    to change."""
    c, ray = cfg.cluster, cfg.ray
    if c.nodes is None:
        return
    if ray.gpus_per_worker == 0:
        raise ConfigError("ray.gpus_per_worker", f"is 0: no rank claims a GPU, so the "
                                                  f"{c.gpus} GPUs of cluster.nodes * "
                                                  "cluster.gpus_per_node go unused; set it to 1")
    pools = gpu_pools(cfg)
    used = sum(size for _, size in pools) * ray.gpus_per_worker
    if used != c.gpus:
        described = "; ".join(f"{' + '.join(names)}: {size} ranks" for names, size in pools)
        what = (f"the worker groups take {used:g} GPUs ({described}; x ray.gpus_per_worker="
                f"{ray.gpus_per_worker:g}) but cluster.nodes * cluster.gpus_per_node = "
                f"{c.nodes} * {c.gpus_per_node} = {c.gpus}")
        actor_size = cfg.actor.layout.world_size
        if len(pools) > 1:
            # The groups outside the actor's pool: of another world size, or all of them
            # without colocation.
            other = [n for names, _ in pools if "actor" not in names for n in names]
            resize = ("" if cfg.critic.layout.world_size == actor_size else
                      f"give critic.layout the actor's world size ({actor_size}) and ")
            raise ConfigError("critic.layout.dp" if ray.colocate else "ray.colocate",
                              f"{what}: {' and '.join(other)} run on GPUs of their own; "
                              f"{resize}set ray.colocate=true so that all models share the "
                              "same GPUs")
        lay = cfg.actor.layout
        per_dp = lay.tp * lay.pp * ray.gpus_per_worker
        fix = (f"set actor.layout.dp={c.gpus / per_dp:g}" if c.gpus % per_dp == 0 else
               f"choose tp * pp * dp = {c.gpus / ray.gpus_per_worker:g}")
        raise ConfigError("actor.layout.dp", f"{what}; {fix} (and critic.layout the same world "
                                             "size) or change cluster.nodes")
    for name, _ in worker_groups(cfg):
        key = GROUP_KEYS[name]
        tp = (cfg.actor if key == "actor.layout" else cfg.critic).layout.tp
        gpus = tp * ray.gpus_per_worker
        if gpus > c.gpus_per_node or c.gpus_per_node % gpus:
            raise ConfigError(f"{key}.tp", f"a tensor-parallel group of {tp} ranks takes {gpus:g} "
                              f"GPUs, which do not tile the nodes of cluster.gpus_per_node="
                              f"{c.gpus_per_node} (TP all-reduces every layer: it must stay in "
                              f"one node); use a divisor of {c.gpus_per_node} and more pp")
