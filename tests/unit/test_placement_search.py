"""The placement search (HybridFlow's Algorithm 1, hybridflow/planner/placements.py) on cases
checked by hand: the partitions and device counts it enumerates, the max-over-pools and
sum-within-a-pool composition of the calls, and collectives priced by the nodes they span."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.config import RLConfig, load_config
from hybridflow.errors import ConfigError
from hybridflow.models.config import ModelConfig
from hybridflow.planner.cost import Fabric, collective_rate, model_terms, staged_step
from hybridflow.planner.placements import Search, allocations, partitions
from hybridflow.planner.rates import Calibration

SHAPE = ModelConfig(vocab_size=64, hidden_size=16, ffn_hidden_size=32, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=8)
CALIB = Calibration(device="test", devices=4, matmul_flops={"fp32": 1e9},
                    memory_bandwidth=1e9, all_gather={2: 1e8, 4: 5e7}, broadcast={2: 1e8},
                    host_to_device=None, torch="test", measured_at="2026-12-01T00:00:00+00:00")


def config(tmp_path, *overrides):
    """GRPO (actor and reference: two models) on one node of 4 devices, placement: auto."""
    calib = tmp_path / "c.json"
    CALIB.to_json(calib)
    return load_config(RLConfig, None, [
        "algorithm.name=grpo", "train_batch_size=12", "rollout.sampling.n=2",
        "data.max_prompt_tokens=8", "rollout.sampling.max_tokens=4", "rollout.backend=megatron",
        "actor.engine.micro_batch_size=1", "cluster.nodes=1", "cluster.gpus_per_node=4",
        "ray.gpus_per_worker=1", "placement=auto", f"cluster.calibration={calib}",
        f"tracking.out_dir={tmp_path}", *overrides])


def test_partitions_by_hand():
    assert sorted(partitions(("actor", "reference"))) == sorted([
        (("actor", "reference"),), (("actor",), ("reference",))])
    four = partitions(("actor", "reference", "critic", "reward_model"))
    assert len(four) == 15 == len(set(four))  # Bell(4)
    for p in four:  # each a partition: every model once
        assert sorted(m for s in p for m in s) == sorted(("actor", "reference", "critic",
                                                          "reward_model"))
    assert len(partitions(tuple("abcdef"))) == 203  # Safe-RLHF's six models: Bell(6)


def test_device_counts_by_hand():
    # One node of 4: a set takes 1-3 devices of it, or the node.
    assert allocations(1, 1, 4) == [(4,)]
    assert allocations(2, 1, 4) == [(1, 3), (2, 2), (3, 1)]
    # Two nodes of 4: whole nodes, or parts that pack into them (3 + 1 share a node).
    assert sorted(allocations(2, 2, 4)) == [(4, 4)]
    assert (3, 1, 4) in allocations(3, 2, 4) and (3, 3, 2) not in allocations(3, 2, 4)


def test_two_models_on_four_devices_every_placement(tmp_path):
    cfg = config(tmp_path)
    plans, priced = Search(cfg, {"model": SHAPE}, CALIB).run(top=10)
    # colocated on 4; apart: 1 + 3, 2 + 2, 3 + 1 (the actor's count first)
    assert priced == 4
    assert sorted((p.kind, tuple(s.ranks for s in p.sets)) for p in plans) == sorted([
        ("colocate", (4,)), ("standalone", (1, 3)), ("standalone", (2, 2)),
        ("standalone", (3, 1))])
    steps = [p.step for p in plans]
    assert steps == sorted(steps)


def test_sets_take_the_max_of_a_stage_and_add_their_own_calls(tmp_path, monkeypatch):
    # A fake price per call: the actor's generation, old log-probs and update shrink with its
    # devices n; the reference's pass does not.
    def fake(self, model, lay, tg, per_node):
        n = lay.world_size
        if model == "actor":
            return {"generate": 4 / n, "old_logprobs": 6 / n, "update_actor": 4 / n}
        return {"ref_logprobs": 6.0}
    monkeypatch.setattr(Search, "price", fake)
    plans, _ = Search(config(tmp_path, "actor.mini_batches=2"), {"model": SHAPE}, CALIB).run(10)
    by = {tuple(s.ranks for s in p.sets): p.step for p in plans}
    # apart, the reference's 6 s run beside the actor's old log-probs: max per stage
    assert by[(3, 1)] == pytest.approx(4 / 3 + max(2, 6) + 4 / 3)
    assert by[(2, 2)] == pytest.approx(2 + max(3, 6) + 2)
    assert by[(1, 3)] == pytest.approx(4 + max(6, 6) + 4)
    # colocated, every call one after another: 1 + 1.5 + 6 + 1
    assert by[(4,)] == pytest.approx(9.5)
    assert plans[0].kind == "standalone" and [s.ranks for s in plans[0].sets] == [3, 1]
    # (summed, the 3 + 1 placement would cost 4/3 + 2 + 6 + 4/3 = 10.67 and lose to 9.5)
    assert staged_step({"one": {"generate": 1, "ref_logprobs": 6, "update_actor": 1}}) == 8
    assert staged_step({"a": {"generate": 1, "update_actor": 1},
                        "b": {"ref_logprobs": 6}}) == 8
    assert staged_step({"a": {"generate": 1, "old_logprobs": 2},
                        "b": {"ref_logprobs": 6, "update_critic": 3}}) == 1 + 6 + 3


def test_a_collective_across_nodes_takes_the_inter_node_rate():
    calib = Calibration(device="test", devices=8, matmul_flops={"bf16": 1e12},
                        memory_bandwidth=1e12, all_gather={2: 300e9, 8: 200e9}, broadcast={},
                        host_to_device=None, torch="test",
                        measured_at="2026-12-01T00:00:00+00:00")
    fabric = Fabric(per_node=8, inter_node=25e9)
    assert collective_rate(calib, fabric, [[0, 1]], "x") == 300e9  # inside a node
    assert collective_rate(calib, fabric, [[7, 8]], "x") == 25e9  # two nodes, one group
    # tp=8, dp=2 over two nodes: the 8 DP groups cross the same two links at once
    assert collective_rate(calib, fabric, [[i, i + 8] for i in range(8)], "x") == 25e9 / 8
    with pytest.raises(ConfigError) as e:
        collective_rate(calib, Fabric(per_node=8, inter_node=None), [[7, 8]], "x")
    assert e.value.field == "cluster.inter_node_gb_s"


def test_the_data_parallel_all_reduce_priced_by_its_span(tmp_path):
    cfg = load_config(RLConfig, None, [
        "algorithm.name=grpo", "train_batch_size=2", "rollout.sampling.n=2",
        "data.max_prompt_tokens=8", "rollout.sampling.max_tokens=4", "rollout.backend=megatron",
        "actor.engine.micro_batch_size=2", "actor.layout.dp=2"])
    shapes = {"model": SHAPE}
    inside = model_terms(cfg, shapes, CALIB, "actor", Fabric(per_node=2, inter_node=None))
    across = model_terms(cfg, shapes, CALIB, "actor", Fabric(per_node=1, inter_node=1e7))
    # the group of 2 on one node at the all-gather rate of 2 (1e8); on two nodes at 1e7
    assert across["update_actor"]["dp_allreduce"] == pytest.approx(
        10 * inside["update_actor"]["dp_allreduce"])
    assert across["update_actor"]["compute"] == inside["update_actor"]["compute"]


def test_inter_node_rate_refused_on_one_node():
    for nodes in ("cluster.nodes=1", None):
        with pytest.raises(ConfigError) as e:
            load_config(RLConfig, None, ["algorithm.name=grpo", "cluster.inter_node_gb_s=25",
                                         "ray.gpus_per_worker=1", "actor.layout.dp=8"]
                        + ([nodes] if nodes else []))
        assert e.value.field == "cluster.inter_node_gb_s" and "inert on one node" in \
            e.value.message


def test_placement_auto_resolves_to_the_fastest_and_plan_prints_the_table(tmp_path, capsys):
    from hybridflow.planner.placements import choose_placement, ranked
    from tests.unit.test_planner import AUTO_CALIB as calib  # CALIB with micro-batch costs
    cfg = config(tmp_path)
    assert cfg.placement.preset == "auto"
    lines = []
    chosen = choose_placement(cfg, {"model": SHAPE}, calib, log=lines.append)
    best, _, _ = ranked(cfg, {"model": SHAPE}, calib, top=1)
    assert chosen.placement.preset is None and chosen.placement.pools
    assert chosen == best[0].config and "planner (placement: auto)" in lines[0]
    with pytest.raises(ConfigError) as e:  # layouts are the search's
        config(tmp_path, "layout=auto")
    assert e.value.field == "placement"
    assert main(["plan", "model=tiny-llama", *[o for o in _overrides(tmp_path)]]) == 0
    out = capsys.readouterr().out
    assert "\n1. " in out and "the fastest: placement.preset=null" in out


def _overrides(tmp_path):
    calib = tmp_path / "c.json"
    CALIB.to_json(calib)
    return ["algorithm.name=grpo", "train_batch_size=12", "rollout.sampling.n=2",
            "data.max_prompt_tokens=8", "rollout.sampling.max_tokens=4",
            "rollout.backend=megatron", "actor.engine.micro_batch_size=1", "cluster.nodes=1",
            "cluster.gpus_per_node=4", "ray.gpus_per_worker=1", "placement=auto",
            f"cluster.calibration={calib}", f"tracking.out_dir={tmp_path}"]


EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
PAPER = sorted((EXPERIMENTS / "paper").glob("*/llama2_*.yaml")) + sorted(
    (EXPERIMENTS / "paper" / "placement").glob("*.yaml"))


@pytest.mark.parametrize("path", PAPER, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_plan_ranks_every_paper_config(path, tmp_path, capsys):
    # The paper's stated A100 rates: no micro-batch costs, so the table says it is floors alone.
    rates = EXPERIMENTS / "paper" / "a100_calibration.json"
    assert main(["plan", str(path), f"cluster.calibration={rates}",
                 f"tracking.out_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "\n1. " in out and "the fastest: " in out and "FLOORS ALONE" in out
