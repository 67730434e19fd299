"""Placements end to end on Ray with tiny models (2 CPU cores: single-rank pools stand in for
devices): PPO with the actor side and the critic side on pools of their own, and with every model
standalone, computes what the colocated run computes, row for row, while the pools' calls
overlap; in both, the reference streams its weights (``ref.offload``: in the actor's processes,
then in a group of its own) and gives the resident reference's log-probs."""

import json
from pathlib import Path

import pytest

from hybridflow.config import RLConfig, load_config
from hybridflow.tracking import CLOCK_KEYS, read_metrics
from hybridflow.trainer import RLTrainer
from tests.e2e.test_rl_loop import PROMPTS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cache")]


def ppo(tmp_path, name, *overrides):
    prompts = tmp_path / "prompts.jsonl"  # a file: the GPU machine has no reasoning-gym
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return load_config(RLConfig, None, [
        f"data.source={prompts}", "model=tiny-llama", "algorithm.name=ppo", "reward_model=tiny-qwen2",
        "rollout.backend=hf", "rollout.sampling.max_tokens=8", "rollout.sampling.n=2",
        "train_batch_size=2", "steps=2", "actor.engine.micro_batch_size=1",
        "critic.engine.micro_batch_size=1", "actor.engine.optim.lr=1e-3",
        "data.max_prompt_tokens=32", "ray.num_cpus=2",
        f"tracking.out_dir={tmp_path}", f"name={name}", *overrides])


def train(cfg):
    trainer = RLTrainer(cfg)  # the reward model scores
    try:
        trainer.train(PROMPTS)
    finally:
        trainer.close()
    return read_metrics(Path(cfg.tracking.out_dir) / cfg.name / "metrics.jsonl")


def computed(row):
    """A metrics row without what depends on time or on where the models live."""
    return {k: v for k, v in row.items() if not k.startswith((*CLOCK_KEYS, "memory/"))}


def calls(trace_path):
    """(pool, call name, start, end) of every call in a Chrome trace the run wrote."""
    events = json.loads(trace_path.read_text().rstrip().rstrip(",") + "]")
    rows = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    return [(rows[e["tid"]], e["name"], e["ts"], e["ts"] + e["dur"]) for e in events
            if e["ph"] == "X"]


def test_split_and_standalone_compute_what_colocate_does(tmp_path):
    colocated = train(ppo(tmp_path, "colocate"))
    split = train(ppo(tmp_path, "split", "placement.preset=split", "ref.offload=true"))
    assert [computed(r) for r in split] == [computed(r) for r in colocated]
    # The actor's and the critic's calls ran at the same time: the critic's update inside the
    # actor's, the values beside the log-probs.
    assert all(r["timing/overlap_s"] > 0 for r in split)
    assert "timing/overlap_s" not in colocated[0]  # one pool: nothing to overlap
    trace = calls(tmp_path / "split" / "timeline.json")
    assert {pool for pool, *_ in trace} == {"actor", "critic"}
    actor_updates = [(s, e) for pool, name, s, e in trace if name == "actor.update_actor"]
    critic_updates = [(s, e) for pool, name, s, e in trace if name == "critic.update_critic"]
    assert len(actor_updates) == len(critic_updates) == 2
    for (a0, a1), (c0, c1) in zip(actor_updates, critic_updates):
        assert a0 < c1 and c0 < a1, "the two updates did not overlap"
    # Every model on a pool of its own: the reference in a group of its own (ReferenceWorker)
    # gives the log-probs the actor's processes gave.
    alone = train(ppo(tmp_path, "standalone", "placement.preset=standalone", "ref.offload=true"))
    assert [computed(r) for r in alone] == [computed(r) for r in colocated]
    pools = {pool for pool, *_ in calls(tmp_path / "standalone" / "timeline.json")}
    assert pools == {"actor", "reference", "critic", "reward_model"}
    assert all(f"timing/idle_{p}_s" in alone[0] for p in pools)


@pytest.mark.gpu
def test_split_on_one_gpu_computes_what_colocate_does(tmp_path):
    """The GPU path of the same: each pool takes half of one GPU (ray.gpus_per_worker=0.5), the
    actor side's and the critic side's processes each with its own CUDA context and NCCL world;
    the megatron backend generates."""
    on_gpu = ("ray.gpus_per_worker=0.5", "rollout.backend=megatron", "ray.num_cpus=4")
    colocated = train(ppo(tmp_path, "colocate", *on_gpu))
    split = train(ppo(tmp_path, "split", "placement.preset=split", *on_gpu))
    assert len(split) == len(colocated) == 2
    for s, c in zip(split, colocated):
        assert computed(s).keys() == computed(c).keys()
        for key, value in computed(c).items():
            assert computed(s)[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert all(r["timing/overlap_s"] > 0 for r in split)
