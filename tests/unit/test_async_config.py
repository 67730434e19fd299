"""rollout.mode and its generation pool (issue 41): what one_step_off and async accept, and each
mistake refused with the key to change and the fix."""

import pytest

from hybridflow.config import RLConfig, load_config
from hybridflow.config.placement import resolve_placement
from hybridflow.errors import ConfigError

TWO_POOLS = ["placement.pools.train.devices_per_node=1", "placement.pools.gen.devices_per_node=1",
             "placement.models.actor=train", "placement.models.reference=train",
             "placement.models.rollout=gen"]


def config(*overrides):
    return load_config(RLConfig, None, ["model=tiny-llama", *overrides])


def test_modes_and_their_staleness():
    assert config().rollout.mode == "sync" and config().rollout.staleness == 0
    assert "rollout" not in resolve_placement(config()).models
    cfg = config("rollout.mode=one_step_off", *TWO_POOLS)
    assert cfg.rollout.staleness == 1
    p = resolve_placement(cfg)
    assert {pool.name: pool.models for pool in p.pools} == {"train": ("actor", "reference"),
                                                            "gen": ("rollout",)}
    assert p.models["rollout"].layout.world_size == 1
    assert [m.name for m in p.groups()] == ["actor", "rollout"]
    assert config("rollout.mode=async", "rollout.max_staleness=3", *TWO_POOLS
                  ).rollout.staleness == 3


@pytest.mark.parametrize("overrides,key,message", [
    (["rollout.mode=later"], "rollout.mode", "sync"),
    (["rollout.mode=async", *TWO_POOLS], "rollout.max_staleness", "set it"),
    (["rollout.mode=async", "rollout.max_staleness=0", *TWO_POOLS], "rollout.max_staleness",
     ""),
    (["rollout.max_staleness=2"], "rollout.max_staleness", "rollout.mode=async"),
    (["rollout.mode=one_step_off", "rollout.max_staleness=1", *TWO_POOLS],
     "rollout.max_staleness", "remove it"),
    # a generation pool exactly where the mode generates apart
    (["rollout.mode=one_step_off"], "placement.models.rollout", "rollout: gen"),
    (["rollout.mode=async", "rollout.max_staleness=2", "placement.preset=split"],
     "placement.models.rollout", "write the pools out"),
    (TWO_POOLS, "placement.models.rollout", "set rollout.mode or remove it"),
    (["rollout.mode=one_step_off", "placement.pools.train.devices_per_node=1",
      "placement.models.actor=train", "placement.models.reference=train",
      "placement.models.rollout=train"], "placement.models.rollout", "a pool of its own"),
    (["rollout.mode=one_step_off", *TWO_POOLS, "placement.layouts.rollout.tp=1"],
     "placement.layouts.rollout", "rollout.tp"),
    # what generates inside the step is refused
    (["rollout.mode=one_step_off", *TWO_POOLS, "algorithm.name=grpo",
      "algorithm.dynamic_sampling=true"], "algorithm.dynamic_sampling", "rollout.mode=sync"),
    (["rollout.mode=one_step_off", *TWO_POOLS, "algorithm.name=remax"], "algorithm.name",
     "greedy baseline"),
    (["rollout.mode=one_step_off", *TWO_POOLS, "rollout.multi_turn.tools=[calculator]"],
     "rollout.multi_turn.tools", "rollout.mode=sync"),
    # the actor never switches layouts: the switch's options would do nothing
    (["rollout.mode=one_step_off", *TWO_POOLS, "hybrid_engine.mode=naive"],
     "hybrid_engine.mode", "rollout.mode=sync"),
])
def test_mistakes_name_the_key_and_the_fix(overrides, key, message):
    with pytest.raises(ConfigError) as e:
        config(*overrides)
    assert e.value.field == key, str(e.value)
    assert message in str(e.value)


def test_the_cost_model_is_not_asked_for_what_it_does_not_price(tmp_path):
    calibration = tmp_path / "calibration.json"
    calibration.write_text("{}")
    with pytest.raises(ConfigError) as e:
        config("rollout.mode=one_step_off", *TWO_POOLS, f"cluster.calibration={calibration}")
    assert e.value.field == "cluster.calibration" and "rollout.mode=sync" in str(e.value)


@pytest.mark.parametrize("partial", [False, True])
def test_the_batches_in_flight_round_trip(tmp_path, partial):
    from types import SimpleNamespace

    import torch

    from hybridflow.batch import Batch
    from hybridflow.data.prompts import PromptItem
    from hybridflow.driver.partial import Group, Response
    from hybridflow.driver.pipeline import InFlight, Pipeline

    items = [PromptItem(messages=[], prompt_ids=[i + 1]) for i in range(5)]
    run = SimpleNamespace(config=config("rollout.mode=async", "rollout.max_staleness=2",
                                        f"rollout.partial={str(partial).lower()}", *TWO_POOLS))
    saved = Pipeline(run, items, sampler=None)
    if partial:  # a group in progress: one response done, one not
        saved.partial.active = [Group(2, [Response([5, 6], [-0.5, -1.25], [1, 2], "stop"),
                                          Response([7], [-2.0], [2])])]
        saved.partial.pending = [4]
    for indices in ([4, 1], [0, 3]):
        batch = Batch({"weight_version": torch.tensor([1, 1, 1, 1]),
                       "rollout_logprobs": torch.randn(4, 3)},
                      {"group": [0, 0, 1, 1], "item": [items[indices[g]] for g in (0, 0, 1, 1)],
                       "response_text": ["a", "b", "c", "d"], "prompt_ids": [[1], [1], [2], [2]]})
        saved.queue.append(InFlight(indices, batch))
    saved.version = 3
    saved.save(tmp_path)
    loaded = Pipeline(run, items, sampler=None)
    loaded.load(tmp_path, {"in_flight": saved.state_dict()})
    assert loaded.version == 3 and len(loaded.queue) == 2
    if partial:
        assert loaded.partial.state_dict() == saved.partial.state_dict()
        assert loaded.partial.active[0].responses[1].finish is None
    else:  # another mode's checkpoint is refused, naming the key
        other = Pipeline(SimpleNamespace(config=config(
            "rollout.mode=async", "rollout.max_staleness=2", "rollout.partial=true",
            *TWO_POOLS)), items, sampler=None)
        with pytest.raises(ConfigError, match="rollout.partial=false"):
            other.load(tmp_path, {"in_flight": saved.state_dict()})
    for a, b in zip(saved.queue, loaded.queue):
        assert a.indices == b.indices and a.batch.lists == b.batch.lists
        assert all(torch.equal(a.batch[k], b.batch[k]) for k in a.batch.tensors)
    # a checkpoint without them (another mode's) is one line naming resume
    with pytest.raises(ConfigError) as e:
        Pipeline(run, items, sampler=None).load(tmp_path / "elsewhere", {})
    assert e.value.field == "resume"
