"""A worker killed by Ray's memory monitor ends the run with one RunError that names the group and
the node's memory, not Ray's traceback (seen when PPO on SmolLM2 outgrew a 24 GiB machine); the
memory metrics of two groups running the same worker class keep apart."""

import pytest
import ray

from hybridflow.workers.group import WorkerGroup
from hybridflow.errors import RunError

RAY_MESSAGE = ("1 worker(s) were killed due to the node running low on memory. Memory on the "
               "node (IP: 10.0.0.1, ID: 47ea) was 22.39GB used / 23.59GB limit (0.949243)\n"
               "OOM kill reason: Memory usage 24107769856B exceeded threshold")


def test_out_of_memory_is_a_run_error(monkeypatch):
    group = object.__new__(WorkerGroup)  # no processes: only _wait's handling is under test
    group.name, group.actors, group.pids = "critic", [], [None, None]
    killed = []
    monkeypatch.setattr(group, "_kill", lambda: killed.append(True))
    monkeypatch.setattr(ray, "wait", lambda pending, **kw: ([pending[0]], pending[1:]))

    def get(ref):
        if ref == "rank1":
            raise ray.exceptions.OutOfMemoryError(RAY_MESSAGE)
        return "ok"
    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(RunError) as e:
        group._wait(["rank0", "rank1"], "compute_values", 0, "ray.call_timeout_s")
    message = str(e.value)
    assert message.startswith("worker group 'critic' rank 1: Ray killed a worker because this "
                              "node ran out of memory (22.39GB used / 23.59GB limit)")
    assert "\n" not in message and "micro-batches" in message
    assert killed  # the other ranks may wait in a collective for the killed one


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU's answer")
def test_a_gpu_memory_cap_without_a_gpu_is_refused_naming_the_key():
    from hybridflow.workers.group import cap_gpu_memory
    from hybridflow.errors import ConfigError
    with pytest.raises(ConfigError, match="no GPU") as e:
        cap_gpu_memory(24)
    assert e.value.field == "ray.gpu_memory_gib"


def test_the_cost_critic_names_its_memory_metrics_apart_from_the_critic():
    # Both run CriticWorker's methods: on a GPU each call's memory/<name>_* metrics would
    # otherwise overwrite the other's in the step's row.
    from hybridflow.workers.critic import VALUE_KEYS, CriticWorker
    names = {}
    for role in VALUE_KEYS:
        worker = object.__new__(CriticWorker)  # no process: only the naming is under test
        worker.role, (worker.values_key, worker.returns_key) = role, VALUE_KEYS[role]
        names[role] = [worker.memory_name(m) for m in ("compute_values", "update_critic")]
    assert names == {"critic": ["compute_values", "update_critic"],
                     "cost_critic": ["compute_cost_values", "update_cost_critic"]}


def test_a_cuda_out_of_memory_is_one_line_with_the_estimate_and_the_knob(monkeypatch):
    # torch's error raised in rank 0's update_actor reaches the driver inside Ray's task error;
    # tests/distributed/test_faults.py raises it in a real worker process.
    import torch

    group = object.__new__(WorkerGroup)  # no processes: only _wait's handling is under test
    group.name, group.actors, group.pids = "actor", [], [None, None]
    group.memory_notes = {"update_actor": "the actor update phase, estimated at 74.1 GiB per "
                                          "GPU of ray.gpu_memory_gib=75 (actor's the largest "
                                          "part); actor.engine.micro_batch_size: lower it"}
    killed = []
    monkeypatch.setattr(group, "_kill", lambda: killed.append(True))
    monkeypatch.setattr(group, "_raise_if_died", lambda *a, **kw: None)
    monkeypatch.setattr(ray, "wait", lambda pending, **kw: ([pending[0]], pending[1:]))
    cause = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def get(ref):
        raise ray.exceptions.RayTaskError("update_actor", "Traceback ...", cause)
    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(RunError) as e:
        group._wait(["rank0", "rank1"], "update_actor", 0, "ray.call_timeout_s")
    assert str(e.value) == (
        "worker group 'actor' rank 0: CUDA out of memory in update_actor, the actor update "
        "phase, estimated at 74.1 GiB per GPU of ray.gpu_memory_gib=75 (actor's the largest "
        "part); actor.engine.micro_batch_size: lower it; the run stopped (its last checkpoint, "
        "if any, is intact)")
    assert killed
    # a method of no phase (no note): the group, rank and method alone
    group.memory_notes = {}
    with pytest.raises(RunError, match=r"^worker group 'actor' rank 0: CUDA out of memory in "
                                       r"save_state; the run stopped"):
        group._wait(["rank0"], "save_state", 0, "ray.call_timeout_s")
