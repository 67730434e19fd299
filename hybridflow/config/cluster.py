"""The cluster a run is meant for, and the checks that need only the config: the pools' GPUs
(``hybridflow.config.placement``) against the cluster's, and tensor-parallel groups inside one
node. Each rank of a pool holds ``ray.gpus_per_worker`` GPUs; the memory on them is estimated in
``hybridflow.planner.memory``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.config.placement import resolve_placement
from hybridflow.errors import ConfigError, check_float, check_int


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
    inter_node_gb_s: float | None = None
    """GB/s (10^9 bytes) one node sends to the others (its network link; 200 Gb/s is 25): the
    planner's rate for a collective whose group spans more than one node, shared by the groups
    of that collective crossing the same node at once. Null: the calibration file's
    ``inter_node`` (``hybridflow calibrate`` measures it when given a Ray cluster of two nodes
    or more). Refused on one node, where nothing crosses."""

    def __post_init__(self) -> None:
        check_int("nodes", self.nodes, none_ok=True)
        check_int("gpus_per_node", self.gpus_per_node)
        check_float("gpu_memory_gb", self.gpu_memory_gb, low=0, low_open=True)
        if self.nodes is None:
            for key, default in (("gpus_per_node", 8), ("gpu_memory_gb", 80.0)):
                if getattr(self, key) != default:
                    raise ConfigError(key, "has no effect while nodes is null (nothing is "
                                           "checked); set nodes or remove it")
        check_float("inter_node_gb_s", self.inter_node_gb_s, low=0, low_open=True, none_ok=True)
        if self.inter_node_gb_s is not None and (self.nodes or 0) <= 1:
            raise ConfigError("inter_node_gb_s", f"is inert on one node (nodes={self.nodes}): no "
                                                 "collective crosses nodes; remove it or set nodes")

    @property
    def gpus(self) -> int:
        return (self.nodes or 0) * self.gpus_per_node


def check_cluster(cfg: Any) -> None:
    """With ``cluster.nodes`` set: the pools' GPUs are the cluster's, and every TP group of a
    layout sits inside one node. ``cfg`` an RLConfig; raises a ConfigError naming the key to
    change."""
    c, ray = cfg.cluster, cfg.ray
    if c.nodes is None:
        return
    if ray.gpus_per_worker == 0:
        raise ConfigError("ray.gpus_per_worker", f"is 0: no rank claims a GPU, so the "
                                                  f"{c.gpus} GPUs of cluster.nodes * "
                                                  "cluster.gpus_per_node go unused; set it to 1")
    placement = resolve_placement(cfg)
    pools = placement.pools
    used = sum(pool.ranks for pool in pools) * ray.gpus_per_worker
    if used != c.gpus and cfg.placement.preset != "auto":  # auto: the search fills the cluster
        described = "; ".join(f"{pool.name} ({' + '.join(pool.models)}): {pool.ranks} ranks"
                              for pool in pools)
        what = (f"the pools take {used:g} GPUs ({described}; x ray.gpus_per_worker="
                f"{ray.gpus_per_worker:g}) but cluster.nodes * cluster.gpus_per_node = "
                f"{c.nodes} * {c.gpus_per_node} = {c.gpus}")
        if len(pools) > 1:
            raise ConfigError("placement", f"{what}: give the pools {c.gpus} GPUs in all (their "
                                           "layouts' world sizes), or change cluster.nodes")
        lay = cfg.actor.layout
        per_dp = lay.tp * lay.pp * ray.gpus_per_worker
        fix = (f"set actor.layout.dp={c.gpus / per_dp:g}" if c.gpus % per_dp == 0 else
               f"choose tp * pp * dp = {c.gpus / ray.gpus_per_worker:g}")
        raise ConfigError("actor.layout.dp", f"{what}; {fix} (and the other models' layouts the "
                                             "same world size) or change cluster.nodes")
    for pool in pools:
        node = c.gpus_per_node  # a preset's pool spans whole nodes
        if cfg.placement.pools:
            node = pool.devices_per_node * ray.gpus_per_worker
            if node > c.gpus_per_node:
                raise ConfigError(f"placement.pools.{pool.name}.devices_per_node",
                                  f"{pool.devices_per_node} ranks x {ray.gpus_per_worker:g} GPUs "
                                  f"is more than cluster.gpus_per_node={c.gpus_per_node}")
        for m in pool.models:
            model = placement.models[m]
            gpus = model.layout.tp * ray.gpus_per_worker
            if gpus > node or node % gpus:
                raise ConfigError(f"{model.layout_key}.tp", f"a tensor-parallel group of "
                                  f"{model.layout.tp} ranks takes {gpus:g} GPUs, which do not "
                                  f"tile the nodes of {node} GPUs (TP all-reduces every layer: "
                                  f"it must stay in one node); use a divisor of {node} and more "
                                  "pp")


def device_memory(cfg: Any) -> tuple[float, str] | None:
    """(GiB, the key that says it) of one GPU where the RLConfig ``cfg`` knows its size:
    ``ray.gpu_memory_gib`` (each worker's allocator cap) or, with ``cluster.nodes`` declared,
    ``cluster.gpu_memory_gb``; the smaller where both are set; None where neither is."""
    known = [(cfg.ray.gpu_memory_gib, "ray.gpu_memory_gib")] if cfg.ray.gpu_memory_gib else []
    if cfg.cluster.nodes is not None:
        known.append((cfg.cluster.gpu_memory_gb, "cluster.gpu_memory_gb"))
    return min(known) if known else None
