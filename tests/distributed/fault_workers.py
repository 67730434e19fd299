"""Workers for tests/distributed/test_faults.py, in a module of their own so that Ray's worker
processes (and the driver scripts those tests start) can import them."""

import os
import signal
import time

import torch
import torch.distributed as dist

from hybridflow.workers.group import Worker
from hybridflow.errors import ConfigError


class FaultWorker(Worker):
    """A trivial rank that can die, hang in a collective, or reject its input."""

    def __init__(self, rank, world_size, rendezvous, bad_field=None):
        super().__init__(rank, world_size, rendezvous)
        if bad_field is not None:
            raise ConfigError(bad_field, "rejected by the worker's constructor")

    def world_sum(self) -> float:
        x = torch.tensor([self.rank + 1.0])
        dist.all_reduce(x)
        return x.item()

    def die_in_collective(self, dying_rank: int, how: str) -> float:
        """``dying_rank`` dies (``how``: "sigkill" or "exit3") while the others enter an
        all_reduce that waits for it."""
        if self.rank == dying_rank:
            time.sleep(0.5)  # the others are inside the all_reduce by now
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)
        return self.world_sum()

    def reject(self, field: str) -> None:
        if self.rank == 1:
            raise ConfigError(field, "rejected by the worker")

    def fail(self) -> None:
        if self.rank == 1:
            raise KeyError("a bug")

    def update_actor(self) -> float:
        """Rank 1's allocator finds no room (torch's CUDA out-of-memory error, raised as the
        allocator raises it) while rank 0 waits for it in an all_reduce."""
        if self.rank == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.world_sum()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def wait_for_late_rank(self, late_rank: int, seconds: float) -> float:
        """``late_rank`` sleeps ``seconds`` before it joins the others' all_reduce."""
        if self.rank == late_rank:
            time.sleep(seconds)
        return self.world_sum()


def main() -> None:
    """A driver for the driver-kill test: starts a group of 2, prints the pids of its workers and
    of the Ray servers it started as one JSON line, and sleeps until killed."""
    import json

    import ray

    from hybridflow.workers.group import RayConfig, WorkerGroup

    group = WorkerGroup(FaultWorker, 2, ray_config=RayConfig(num_cpus=1), name="orphans")
    node = ray._private.worker._global_node  # Ray's own servers, for the test to check
    servers = [p.process.pid for procs in node.all_processes.values() for p in procs]
    # Both ranks busy, as in a run: rank 0 inside an all_reduce that waits for rank 1.
    group.actors[1].sleep.remote(600)
    group.actors[0].world_sum.remote()
    # Every process of this run as the reaper knows it (Ray's agents included), and the reaper.
    from hybridflow.workers.reaper import RUN_MARK, marked, run_processes, started
    me = {os.getpid(): started(os.getpid())}
    everything = sorted(set(run_processes(os.environ[RUN_MARK], me))
                        | set(marked(os.environ[RUN_MARK])))
    print(json.dumps({"workers": group.pids, "servers": servers, "all": everything}), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
