"""Colocated worker groups (HybridFlow's placement): groups built on one ResourcePool put their
rank r on the same GPU, one GPU per rank. Ray is started with two made-up GPUs (it assigns them
and sets CUDA_VISIBLE_DEVICES whether or not they exist; torch stays on the CPU)."""

import os

import pytest

from hybridflow.errors import ConfigError
from hybridflow.workers.group import RayConfig, ResourcePool, Worker, WorkerGroup


class GpuWorker(Worker):
    def gpu(self):
        import ray
        return [str(g) for g in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture(scope="module")
def ray_with_two_gpus():
    import ray
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level="WARNING", runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def test_colocated_groups_share_each_ranks_gpu(ray_with_two_gpus):
    cfg = RayConfig(gpus_per_worker=1)
    pool = ResourcePool(2, cfg, share=2)
    actor = WorkerGroup(GpuWorker, 2, ray_config=cfg, name="actor", pool=pool)
    critic = WorkerGroup(GpuWorker, 2, ray_config=cfg, name="critic", pool=pool)
    try:
        a, c = actor.run("gpu"), critic.run("gpu")
        assert [ids for ids, _ in a] == [ids for ids, _ in c]  # rank r: the same GPU
        assert {ids[0] for ids, _ in a} == {"0", "1"}  # one GPU per rank
        assert all(len(ids) == 1 and env == ids[0] for ids, env in a + c)
    finally:
        actor.shutdown()
        critic.shutdown()
        pool.close()


def test_groups_that_do_not_fit_say_which_field(ray_with_two_gpus):
    cfg = RayConfig(gpus_per_worker=1)
    with pytest.raises(ConfigError, match=r"ray.gpus_per_worker: 4 ranks x 1 GPU = 4 GPU, but "
                                          r"Ray has \d free of 2"):
        WorkerGroup(GpuWorker, 4, ray_config=cfg, name="too-big")
    # Not colocated: the second group finds the GPUs taken (and says so at once).
    first = WorkerGroup(GpuWorker, 2, ray_config=cfg, name="first")
    try:
        with pytest.raises(ConfigError, match=r"Ray has 0 free of 2.*placement.preset=colocate"):
            WorkerGroup(GpuWorker, 2, ray_config=cfg, name="second")
    finally:
        first.shutdown()
