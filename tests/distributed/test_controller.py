"""The single controller on Ray: a worker group forms a gloo world, and run_by_dp gives each data
group its shard and collects from the output ranks only."""

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.workers.group import RayConfig, Worker, WorkerGroup
from hybridflow.parallel.layout import TrainLayout
from tests.unit.test_host import large_block_probe


class EchoWorker(Worker):
    """A 2-way 'tensor parallel' x 2-way 'data parallel' worker: TP ranks of a DP group must get
    the same shard; only TP rank 0 answers."""

    def __init__(self, rank, world_size, rendezvous, layout):
        super().__init__(rank, world_size, rendezvous)
        self.layout = layout

    def dispatch_info(self, view):
        d, p, t = self.layout.coords(self.rank)
        return d, t == 0 and p == self.layout.pp - 1

    def world_sum(self):
        x = torch.tensor([self.rank + 1.0])
        torch.distributed.all_reduce(x)
        return x.item()

    def large_block_probe(self):
        return large_block_probe()["in_heap"]

    def double(self, batch):
        d, _, t = self.layout.coords(self.rank)
        return Batch({"x": batch["x"] * 2, "dp": torch.full_like(batch["x"], d)},
                     {"who": [f"d{d}t{t}"] * len(batch)})


@pytest.fixture(scope="module")
def group():
    import ray
    wg = WorkerGroup(EchoWorker, 4, TrainLayout(tp=2, dp=2), ray_config=RayConfig(num_cpus=2),
                     name="echo")
    yield wg
    wg.shutdown()
    ray.shutdown()


def test_ranks_form_one_gloo_world(group):
    assert group.run("world_sum") == [10.0] * 4


def test_cpu_workers_keep_freed_memory(group):
    """Worker.__init__ calls cpu_rank_settings: a large block comes from the heap, not a mapping
    of its own (tests/unit/test_host.py shows the default's)."""
    assert group.run("large_block_probe") == [True] * 4


def test_run_by_dp_splits_by_data_group_and_collects_output_ranks(group):
    batch = Batch({"x": torch.arange(6.0)}, {"id": list("abcdef")})
    out = group.run_by_dp("double", batch)
    torch.testing.assert_close(out["x"], torch.arange(6.0) * 2)
    torch.testing.assert_close(out["dp"], torch.tensor([0., 0, 0, 1, 1, 1]))
    assert out["who"] == ["d0t0"] * 3 + ["d1t0"] * 3


def test_batch_that_does_not_split_says_how_to_fix(group):
    with pytest.raises(ValueError, match="multiple of 2"):
        group.run_by_dp("double", Batch({"x": torch.arange(5.0)}))
