"""`hybridflow calibrate` on a Ray cluster (``ray.address`` a cluster's): the inter-node rate
between two of its nodes, measured by ranks pinned to each, lands in the calibration file, and
`hybridflow plan` prices a collective across nodes with it where it refused without it; on a
cluster of one node, no rate and a line that says why. The cluster is two Ray nodes on this
machine (``ray.cluster_utils.Cluster``, one CPU each): the rate is loopback's, its shape is what
is tested. The tests run in file order: the one-node test before the second node joins."""

import dataclasses
import math
import os
import shutil
import tempfile

import pytest

from hybridflow.config import RLConfig, load_config
from hybridflow.errors import ConfigError
from hybridflow.planner.calibrate import _inter_node, calibrate
from hybridflow.planner.internode import measure_inter_node
from hybridflow.planner.rates import MiB, Calibration
from hybridflow.planner.search import plan_lines
from hybridflow.workers.group import RayConfig


@pytest.fixture(scope="module")
def cluster():
    """A Ray cluster of one node (one CPU) on this machine, its files (and the address file
    Ray writes for ``auto``) in a folder of its own; torn down after the module."""
    import ray
    from ray.cluster_utils import Cluster
    ray_tmp = tempfile.mkdtemp(prefix="hf-ray-")  # short: Ray's socket paths live in it
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = ray_tmp
    nodes = Cluster()
    try:
        nodes.add_node(num_cpus=1)
        yield nodes
    finally:
        if ray.is_initialized():
            ray.shutdown()
        nodes.shutdown()
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def two_nodes(cluster):
    """The cluster with a second node (one CPU) joined."""
    if not cluster.worker_nodes:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
    return cluster


def test_one_node_measures_no_rate_and_says_why(cluster):
    import ray
    lines = []
    assert _inter_node(RayConfig(address=cluster.address), MiB, 0, 1, lines.append) is None
    assert lines == [f"inter-node: not measured: the Ray cluster at {cluster.address} has one "
                     "node; set cluster.inter_node_gb_s for a multi-node plan"]
    assert not ray.is_initialized()  # the driver left the cluster


def test_the_ranks_run_on_two_nodes_at_once(two_nodes):
    import ray
    found = measure_inter_node(RayConfig(address=two_nodes.address), MiB, 1, 3)
    assert not ray.is_initialized()
    node_ids = {two_nodes.head_node.node_id, *(n.node_id for n in two_nodes.worker_nodes)}
    assert len(set(found.nodes)) == 2 and set(found.nodes) == node_ids
    assert found.pairs == 1 and found.backend == "gloo" and found.message == MiB
    assert math.isfinite(found.rate) and found.rate > 0


@pytest.fixture(scope="module")
def measured(two_nodes):
    lines = []
    calib = calibrate(quick=True, log=lines.append,
                      cluster=RayConfig(address=two_nodes.address))
    return calib, lines


def test_calibrate_writes_the_inter_node_rate(measured, tmp_path):
    calib, lines = measured
    assert math.isfinite(calib.inter_node) and calib.inter_node > 0
    line = lines[-1]
    assert line.startswith("inter-node, 2 nodes (") and line.endswith(" a node sends"), line
    assert "1 pair(s) at once, 1 MiB message (gloo): " in line, line
    path = tmp_path / "c.json"
    calib.to_json(path)
    assert Calibration.from_json(path).inter_node == calib.inter_node


def test_plan_prices_a_collective_across_nodes_with_the_measured_rate(measured, tmp_path):
    """The actor's data-parallel all-reduce over two nodes of one GPU each: without an
    inter-node rate the plan is refused naming cluster.inter_node_gb_s; with the measured one
    it is priced, and a slower link makes a slower step."""
    calib, _ = measured

    def plan(inter_node: float | None) -> list[str]:
        path = tmp_path / "c.json"
        dataclasses.replace(calib, inter_node=inter_node).to_json(path)
        cfg = load_config(RLConfig, None, [
            "algorithm.name=grpo", "model=tiny-llama", "rollout.backend=megatron",
            "cluster.nodes=2", "cluster.gpus_per_node=1", "ray.gpus_per_worker=1",
            "actor.layout.dp=2", f"cluster.calibration={path}", f"tracking.out_dir={tmp_path}"])
        return plan_lines(cfg)

    with pytest.raises(ConfigError) as e:
        plan(None)
    assert e.value.field == "cluster.inter_node_gb_s" and "spans nodes" in e.value.message
    lines = plan(calib.inter_node)
    assert lines[2].startswith("1. ") and " step " in lines[2], lines

    def step(lines):  # the configured placement's: the actor on both nodes
        line = next(x for x in lines if x.startswith("configured: step "))
        return float(line.split()[2])
    assert step(plan(calib.inter_node / 1000)) > step(lines)
