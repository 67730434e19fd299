"""A run that goes wrong stops, says where, and leaves nothing behind: a dead worker process stops
the driver within seconds naming its group and rank, a ConfigError raised in a worker stays a
ConfigError, calls and collectives time out, `ray.address: local` never joins a stale cluster,
and a killed driver leaves no worker processes."""

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hybridflow.workers.group import RayConfig, WorkerGroup, check_ray_address, init_ray
from hybridflow.errors import ConfigError, RunError
from hybridflow.parallel.spawn import free_port
from tests.distributed.fault_workers import FaultWorker

ROOT = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; its parent (or init) has yet to reap it


def wait_gone(pids, timeout_s: float) -> list[int]:
    """The pids still alive after up to ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_local_address_starts_its_own_ray_despite_a_stale_cluster(monkeypatch):
    import ray
    if ray.is_initialized():
        ray.shutdown()
    dead = f"127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
    # Ray's current-cluster file as a failed job leaves it, in a temp dir of our own so that
    # other Ray users on this machine are not disturbed (short: Ray's socket paths live in it).
    ray_tmp = tempfile.mkdtemp(prefix="hf-ray-")
    os.makedirs(f"{ray_tmp}/ray")
    Path(f"{ray_tmp}/ray/ray_current_cluster").write_text(dead)
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    monkeypatch.setenv("RAY_ADDRESS", dead)
    start = time.monotonic()
    try:
        init_ray(RayConfig(address="local", num_cpus=1))
        assert ray.get(ray.remote(lambda: 42).remote(), timeout=60) == 42
        assert time.monotonic() - start < 60
        assert ray.get_runtime_context().gcs_address != dead
    finally:
        ray.shutdown()
        import shutil
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def local_ray():
    import ray
    if ray.is_initialized():
        ray.shutdown()
    init_ray(RayConfig(num_cpus=1))
    yield
    ray.shutdown()


def test_a_live_ray_passes_the_address_probe(local_ray):
    """The probe that refuses an address where nothing (or no Ray) listens lets Ray's GCS by."""
    import ray
    check_ray_address(ray.get_runtime_context().gcs_address)


@pytest.mark.parametrize("how", ["sigkill", "exit3"])
def test_a_rank_that_dies_in_a_collective_stops_the_run_naming_it(local_ray, how):
    group = WorkerGroup(FaultWorker, 2, ray_config=RayConfig(num_cpus=1), name="actor")
    pids = list(group.pids)
    start = time.monotonic()
    try:
        with pytest.raises(RunError) as e:
            group.run("die_in_collective", 1, how)  # rank 0 blocks in all_reduce meanwhile
        assert time.monotonic() - start < 30
        message = str(e.value)
        assert f"worker group 'actor' rank 1 (pid {pids[1]}) died: SYSTEM_ERROR: " in message
        assert "\n" not in message and "checkpoint" in message
    finally:
        group.shutdown()
    group.shutdown()  # twice, and after a death: no error
    assert wait_gone(pids, 15) == []


def test_config_error_in_a_worker_arrives_as_config_error(local_ray):
    cfg = RayConfig(num_cpus=1)
    group = WorkerGroup(FaultWorker, 2, ray_config=cfg, name="critic")
    try:
        with pytest.raises(ConfigError) as e:
            group.run("reject", "critic.model")
        assert (e.value.field, e.value.message) == ("critic.model", "rejected by the worker")
        with pytest.raises(KeyError, match="a bug"):  # a bug keeps Ray's error and traceback
            group.run("fail")
    finally:
        group.shutdown()
    with pytest.raises(ConfigError) as e:  # in a constructor too
        WorkerGroup(FaultWorker, 2, "reward_model", ray_config=cfg, name="scores")
    assert e.value.field == "reward_model"


def test_a_cuda_out_of_memory_stops_the_run_in_one_line_with_the_estimate(local_ray):
    """Rank 1 of the actor runs out of CUDA memory in its update, rank 0 waiting for it in a
    collective: one RunError names the group, rank, method and phase, the estimate for the phase
    against the GPU's memory and the key to turn (the notes the driver gives each group), and
    the group's processes are gone."""
    from hybridflow.config.loader import load_config
    from hybridflow.config.rl import RLConfig
    from hybridflow.config.sources import model_sources
    from hybridflow.planner.memory import estimate_memory, out_of_memory_notes
    from tests.unit.test_memory_fits import RUN

    cfg = load_config(RLConfig, None, [*RUN, "actor.engine.micro_batch_size=8",
                                       "ray.gpu_memory_gib=75"])
    notes = out_of_memory_notes(cfg, estimate_memory(cfg, model_sources(cfg)[1]))
    group = WorkerGroup(FaultWorker, 2, ray_config=RayConfig(num_cpus=1), name="actor")
    group.memory_notes = notes["actor"]
    pids = list(group.pids)
    try:
        with pytest.raises(RunError) as e:
            group.run("update_actor")
    finally:
        group.shutdown()
    assert str(e.value) == (
        "worker group 'actor' rank 1: CUDA out of memory in update_actor, the actor update "
        "phase, estimated at 63.3 GiB per GPU of ray.gpu_memory_gib=75 (actor's the largest "
        "part); actor.engine.micro_batch_size: lower it: the stored activations grow with it; "
        "the run stopped (its last checkpoint, if any, is intact)")
    assert wait_gone(pids, 15) == []


def test_calls_and_collectives_time_out(local_ray):
    cfg = RayConfig(num_cpus=1, call_timeout_s=2, collective_timeout_s=2)
    group = WorkerGroup(FaultWorker, 2, ray_config=cfg, name="actor")
    pids = list(group.pids)
    try:
        # A collective that waits too long for a rank fails in the worker...
        import ray
        start = time.monotonic()
        with pytest.raises(ray.exceptions.RayTaskError, match="(?i)timed out|timeout"):
            group._wait([a.wait_for_late_rank.remote(1, 4) for a in group.actors],
                        "wait_for_late_rank", 0, "ray.call_timeout_s")
        assert time.monotonic() - start < 15
        # ... and a call that takes too long stops the run.
        start = time.monotonic()
        with pytest.raises(RunError, match=r"worker group 'actor': sleep did not finish within "
                                           r"2s on rank\(s\) \[0, 1\].*ray.call_timeout_s"):
            group.run("sleep", 60)
        assert time.monotonic() - start < 10
    finally:
        group.shutdown()
    assert wait_gone(pids, 15) == []


def test_killing_the_driver_leaves_no_processes():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    driver = subprocess.Popen([sys.executable, "-m", "tests.distributed.fault_workers"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([driver.stdout], [], [], 90)
        assert ready, "the driver did not start its workers within 90 s"
        pids = json.loads(driver.stdout.readline())
        processes = pids["workers"] + pids["servers"]
        assert len(pids["workers"]) == 2 and all(alive(p) for p in processes)
        # The reaper knows every one of them, and Ray's agents besides (whose retitling may wipe
        # the run's mark from what /proc shows of their environment).
        assert set(processes) < set(pids["all"])
        titles = {Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].strip()
                  for p in pids["all"] if alive(p)}
        assert {b"ray::RuntimeEnvAgent", b"ray::DashboardAgent"} <= titles, titles
        processes = pids["all"]
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    assert wait_gone(processes, 30) == []
