"""The inter-node rate of a Ray cluster: what one node's link carries while each of its GPUs
exchanges data with its peer on another node, all at once (``hybridflow calibrate`` with a
cluster's ``ray.address``; the planner's ``Calibration.inter_node``).

Two nodes, the driver's and another, each run k ranks pinned to it (k the GPUs per node the two
have in common, one GPU a rank; on CPU k = 1), one torch.distributed world of 2k ranks; rank i of
the first node and rank i of the second form a group of two, and the k groups all-gather at once
(NCCL on GPU; on gloo one broadcast per member, as ``calibrate`` times gloo's gather). One rank
receives half the message from across; the node's k ranks k times that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow.hybrid_engine.execute import broadcast_gather
from hybridflow.planner.timing import collective_times, slowest_median
from hybridflow.workers.group import RayConfig, Worker, WorkerGroup, init_ray


@dataclass(frozen=True)
class InterNode:
    """The rate measured between two nodes, and where."""

    rate: float
    """Bytes/s one node sends to the other: k x what one rank receives per second."""
    nodes: tuple[str, str]
    """The Ray node ids the two sides' ranks ran on, as the ranks themselves report them."""
    ips: tuple[str, str]
    """Their IP addresses."""
    pairs: int
    """k: the groups of two that ran at once, one per GPU a node (1 on CPU)."""
    message: int
    """Bytes of one all-gather's output (half of it crosses to each rank)."""
    backend: str
    """"nccl" or "gloo"."""


def measure_inter_node(cfg: RayConfig, message: int, warmup: int,
                       repeats: int) -> InterNode | None:
    """The inter-node rate of the Ray cluster at ``cfg.address`` (an all-gather of ``message``
    bytes per group, the median of ``repeats`` iterations after ``warmup``); None where the
    cluster has fewer than two alive nodes. The driver joins the cluster for it and leaves again
    if it was not connected before; the ranks and their process groups end with it."""
    import ray  # deferred: Ray
    connected = ray.is_initialized()
    init_ray(cfg)
    try:
        alive = [n for n in ray.nodes() if n["Alive"]]
        if len(alive) < 2:
            return None
        here = ray.get_runtime_context().get_node_id()
        first = next((n for n in alive if n["NodeID"] == here), alive[0])
        second = max((n for n in alive if n is not first),
                     key=lambda n: n["Resources"].get("GPU", 0))
        gpus = int(min(n["Resources"].get("GPU", 0) for n in (first, second)))
        k = max(gpus, 1)
        group = WorkerGroup(_PairRank, 2 * k, ray_config=cfg, name="inter-node",
                            pool=_Pinned([first["NodeID"]] * k + [second["NodeID"]] * k,
                                         gpu=gpus > 0))
        try:
            where = group.run("node")
            per_rank = group.run("time_pairs", message, warmup, repeats)
            group.run("close")
        finally:
            group.shutdown()
    finally:
        if not connected:
            ray.shutdown()
    rate = k * (message // 2) / slowest_median(per_rank)
    return InterNode(rate=rate, nodes=(where[0][0], where[k][0]), ips=(where[0][1], where[k][1]),
                     pairs=k, message=message, backend="nccl" if gpus else "gloo")


class _Pinned:
    """What a WorkerGroup reads of its pool (``ResourcePool``), for ranks pinned to nodes: rank
    r on node ``node_ids[r]``, with one GPU where ``gpu`` (else one CPU)."""

    def __init__(self, node_ids: list[str], gpu: bool):
        self.node_ids, self.gpu, self.world_size = node_ids, gpu, len(node_ids)

    def options(self, rank: int) -> dict:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # deferred: Ray
        return dict(num_gpus=1 if self.gpu else 0, num_cpus=0 if self.gpu else 1,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_ids[rank],
                                                                       soft=False))


class _PairRank(Worker):
    """A rank of the measurement: ranks 0..k-1 on the first node, k..2k-1 on the second."""

    def node(self) -> tuple[str, str]:
        """The Ray node id and IP address this rank runs on."""
        import ray  # deferred: Ray
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def time_pairs(self, message: int, warmup: int, repeats: int) -> list[float]:
        """Seconds of each timed all-gather of this rank's group of two (rank i with rank
        k + i), every group at once."""
        k = self.world_size // 2
        # every rank makes every group, in the same order
        groups = [dist.new_group([i, k + i]) for i in range(k)]
        mine = groups[self.rank % k]
        on_gpu = torch.cuda.is_available()
        device = torch.device("cuda" if on_gpu else "cpu")
        out = torch.empty(message, dtype=torch.uint8, device=device)
        shard = torch.ones(message // 2, dtype=torch.uint8, device=device)
        gather = dist.all_gather_into_tensor if on_gpu else broadcast_gather
        return collective_times(lambda: gather(out, shard, group=mine),
                                torch.cuda.synchronize if on_gpu else (lambda: None),
                                dist.barrier, warmup=warmup, repeats=repeats)

    def close(self) -> None:
        dist.destroy_process_group()
