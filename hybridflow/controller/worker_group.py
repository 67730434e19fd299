"""The single controller's view of a distributed worker: one Ray actor per rank.

A WorkerGroup starts ``world_size`` Ray actors of one worker class; the actors form a
torch.distributed group (gloo on CPU, NCCL on GPU) among themselves. The controller calls a method
on every rank at once, or dispatches a Batch by data-parallel rank: each DP group's ranks get the
same shard, and only the ranks that hold the output (e.g. TP rank 0 of the last pipeline stage)
send results back.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from hybridflow.batch import Batch


@dataclass(kw_only=True)
class RayConfig:
    """How the controller reaches Ray."""

    address: str = "local"
    """"local" starts Ray on this machine bound to loopback; "auto" or host:port joins a cluster
    (what launch/slurm does)."""
    num_cpus: int | None = None
    """CPUs Ray may schedule locally (None: all)."""
    gpus_per_worker: float = 0.0
    """GPUs each rank's actor claims (1 on GPU machines; 0 on CPU)."""
    cpus_per_worker: float = 0.0
    """CPUs each rank's actor claims; 0 lets more ranks than cores share them (CPU demos)."""


def init_ray(cfg: RayConfig) -> None:
    import ray
    if ray.is_initialized():
        return
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                        "PYTHONWARNINGS": "ignore::FutureWarning,ignore::UserWarning",
                        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
                        "RAY_DEDUP_LOGS": "1"}}
    if cfg.address == "local":
        ray.init(num_cpus=cfg.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                 runtime_env=env, logging_level="WARNING", log_to_driver=True)
    else:
        ray.init(address=cfg.address, runtime_env=env, logging_level="WARNING")


class Worker:
    """Base of every worker: joins the group's torch.distributed world in its constructor."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int):
        import torch
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                          RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        self.rank, self.world_size = rank, world_size
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray gives each actor its own GPU, visible as device 0
        else:
            torch.set_num_threads(1)
        dist.init_process_group(backend, rank=rank, world_size=world_size)

    def dispatch_info(self, view: str) -> tuple[int, bool]:
        """(data group index, whether this rank returns the group's output) for ``view``."""
        raise NotImplementedError

    def ping(self) -> int:
        return self.rank


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _node_address() -> tuple[str, int]:
    """This node's address and a free port on it (runs where rank 0 will run)."""
    import ray
    ip = ray.util.get_node_ip_address()
    return ip, _free_port("")


class WorkerGroup:
    """``world_size`` Ray actors of ``worker_cls``; construct with the worker's own arguments."""

    def __init__(self, worker_cls: type[Worker], world_size: int, *args: Any,
                 ray_config: RayConfig | None = None, name: str = "worker", **kwargs: Any):
        import ray
        cfg = ray_config or RayConfig()
        init_ray(cfg)
        actor_cls = ray.remote(num_cpus=cfg.cpus_per_worker, num_gpus=cfg.gpus_per_worker)(
            worker_cls)
        self.name, self.world_size = name, world_size
        placement = [{} for _ in range(world_size)]
        if cfg.address == "local":
            addr, port = "127.0.0.1", _free_port()
        else:
            # On a cluster rank 0 may land on any node: reserve one bundle per rank, ask the node
            # of bundle 0 for its address and a free port, then pin each rank to its bundle.
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
            bundle = {"CPU": max(cfg.cpus_per_worker, 0.01), "GPU": cfg.gpus_per_worker}
            pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
            ray.get(pg.ready())
            placement = [{"scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=r)} for r in range(world_size)]
            probe = ray.remote(num_cpus=0.01)(_node_address).options(**placement[0])
            addr, port = ray.get(probe.remote())
        self.actors = [actor_cls.options(name=f"{name}-{r}-{port}", **placement[r]).remote(
            r, world_size, addr, port, *args, **kwargs) for r in range(world_size)]
        ray.get([a.ping.remote() for a in self.actors])  # surfaces constructor errors here
        self._dispatch: dict[str, list[tuple[int, bool]]] = {}

    def run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every rank with the same arguments; results in rank order."""
        import ray
        return ray.get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def _info(self, view: str) -> list[tuple[int, bool]]:
        if view not in self._dispatch:
            self._dispatch[view] = self.run("dispatch_info", view)
        return self._dispatch[view]

    def data_parallel_size(self, view: str) -> int:
        return 1 + max(group for group, _ in self._info(view))

    def run_by_dp(self, method: str, batch: Batch, view: str = "train", **kwargs: Any) -> Batch:
        """Split ``batch`` over the data groups of ``view``, give every rank its group's shard,
        and concatenate the outputs of the groups' output ranks in group order."""
        import ray
        info = self._info(view)
        shards = batch.split(self.data_parallel_size(view))
        refs = [ray.put(s) for s in shards]
        futures = [getattr(a, method).remote(refs[group], **kwargs)
                   for a, (group, _) in zip(self.actors, info)]
        results = ray.get(futures)
        outputs = {group: r for r, (group, out) in zip(results, info) if out}
        return Batch.concat([outputs[g] for g in sorted(outputs)])

    def shutdown(self) -> None:
        import ray
        for a in self.actors:
            ray.kill(a)
        self.actors = []
