"""The placement section (config/placement.py) and the driver's dataflow (driver/dataflow.py):
presets expand to the pools they promise, a written-out placement is checked key by key, the
paper's placements can be written down, a stage's calls overlap across pools and not on one, and
the timeline's overlap and idle times are the hand-computed ones."""

import json
import threading
import time

import pytest

from hybridflow.cli import main
from hybridflow.config import RLConfig, load_config
from hybridflow.config.placement import resolve_placement
from hybridflow.driver.dataflow import DRIVER, Call, Timeline, at_once
from hybridflow.errors import ConfigError
from tests.unit.test_experiments import EXPERIMENTS

PPO = ["model=tiny-llama", "algorithm.name=ppo", "reward_model=tiny-qwen2"]


def placed(*overrides):
    cfg = load_config(RLConfig, None, [*PPO, *overrides])
    p = resolve_placement(cfg)
    return {pool.name: (pool.ranks, pool.models) for pool in p.pools}, p


def test_presets():
    pools, p = placed()
    assert pools == {"actor": (1, ("actor", "reference", "critic", "reward_model"))}
    assert p.reference_in_actor and [m.name for m in p.groups()] == ["actor", "critic",
                                                                    "reward_model"]
    pools, _ = placed("placement.preset=split")
    assert pools == {"actor": (1, ("actor", "reference")), "critic": (1, ("critic",
                                                                           "reward_model"))}
    pools, p = placed("placement.preset=standalone")
    assert list(pools) == ["actor", "reference", "critic", "reward_model"]
    assert not p.reference_in_actor and "reference" in [m.name for m in p.groups()]
    # colocate keeps models of different world sizes apart, as before pools existed
    pools, _ = placed("actor.layout.dp=2")
    assert pools == {"actor": (2, ("actor", "reference")), "critic": (1, ("critic",
                                                                           "reward_model"))}
    pools, p = placed("placement.preset=split", "placement.layouts.reference.dp=2")
    assert pools == {"actor": (1, ("actor",)), "reference": (2, ("reference",)),
                     "critic": (1, ("critic", "reward_model"))}


def test_written_out_pools_and_own_layouts():
    pools, p = placed("placement.pools.big.devices_per_node=2", "placement.pools.small.nodes=1",
                      "placement.models.actor=big", "placement.models.reference=big",
                      "placement.models.critic=small", "placement.models.reward_model=big",
                      "actor.layout.tp=2", "placement.layouts.reference.dp=2",
                      "placement.layouts.reward_model.tp=2")
    assert pools == {"big": (2, ("actor", "reference", "reward_model")),
                     "small": (1, ("critic",))}
    # the reference at another layout than the actor's gets a group of its own
    assert not p.reference_in_actor
    assert p.models["reward_model"].layout.tp == 2 and p.models["critic"].layout.tp == 1


@pytest.mark.parametrize("overrides, key, message", [
    (["placement.preset=both"], "placement.preset", "one of colocate, split, standalone"),
    (["placement.preset=split", "placement.pools.a.nodes=1", "placement.models.actor=a"],
     "placement.preset", "not both"),
    (["placement.pools.a.nodes=1"], "placement.models", "must be too"),
    (["placement.pools.a.nodes=1", "placement.models.actor=b"], "placement.models.actor",
     "not in placement.pools"),
    (["placement.pools.a.nodes=1", "placement.models.actor=a"], "placement.models.reference",
     "not placed"),
    (["placement.pools.a.nodes=1", "placement.pools.b.nodes=1", *(
        f"placement.models.{m}=a" for m in ("actor", "reference", "critic", "reward_model"))],
     "placement.pools.b", "no model lives on it"),
    (["placement.models.policy=a", "placement.pools.a.nodes=1"], "placement.models.policy",
     "not a model"),
    (["placement.layouts.actor.tp=2"], "placement.layouts.actor", "set it there"),
    (["placement.layouts.cost_model.tp=2"], "placement.layouts.cost_model", "has no cost_model"),
    (["placement.pools.a.devices_per_node=2", *(
        f"placement.models.{m}=a" for m in ("actor", "reference", "critic", "reward_model"))],
     "actor.layout.dp", "its pool a has 2"),
    (["placement.preset=standalone", "actor.lora.rank=8"], "placement", "frozen base"),
    (["placement.pools.a.nodes=0", "placement.models.actor=a"], "placement.pools.a.nodes",
     "positive integer"),
    (["ray.colocate=false"], "ray.colocate", "placement.preset"),
    (["placement.preset=split", "layout=auto"], "placement", "use placement: auto"),
    (["placement=auto"], "placement", "cluster.nodes"),
])
def test_placement_mistakes_name_the_key(overrides, key, message):
    with pytest.raises(ConfigError) as e:
        placed(*overrides)
    assert e.value.field == key and message in e.value.message, e.value


def test_a_70b_actor_apart_from_a_7b_critic_can_be_written_down(tmp_path, capsys):
    """A 70B actor with a 7B critic and reward model, each side on devices of its own (the
    paper's Figure 13 is the other way round: experiments/paper/placement/): hybridflow check
    accepts it and prints the table and each pool's memory."""
    config = tmp_path / "apart.yaml"
    config.write_text(f"""
defaults: [{EXPERIMENTS / 'paper/ppo/llama2_70b.yaml'}]
reward_model: llama2-7b
actor:
  layout: {{tp: 8, pp: 4, dp: 4}}
critic:
  model: llama2-7b
  layout: {{tp: 2, pp: 1, dp: 8}}
cluster: {{nodes: 18}}
placement:
  pools:
    actor_side: {{nodes: 16, devices_per_node: 8}}
    critic_side: {{nodes: 2, devices_per_node: 8}}
  models: {{actor: actor_side, reference: actor_side, critic: critic_side,
           reward_model: critic_side}}
""")
    assert main(["check", str(config), f"tracking.out_dir={tmp_path}"]) == 0, \
        capsys.readouterr().err
    out = capsys.readouterr().out
    assert "pool actor_side: 16 node(s) x 8 = 128 ranks: actor tp=8 pp=4 dp=4" in out
    assert "pool critic_side: 2 node(s) x 8 = 16 ranks: critic tp=2 pp=1 dp=8, reward_model" in out
    assert "memory per GPU of critic + reward_model (16 GPUs)" in out


def test_a_critic_of_another_vocabulary_is_refused(tmp_path):
    from hybridflow.preflight import check_run
    # SmolLM2's 49152 tokens against Llama-2's 32000
    cfg = load_config(RLConfig, None, ["model=smollm2", "algorithm.name=ppo",
                                       "critic.model=llama2-7b", f"tracking.out_dir={tmp_path}"])
    with pytest.raises(ConfigError) as e:
        check_run(cfg)
    assert e.value.field == "critic.model" and "vocabulary" in e.value.message, e.value


# ------------------------------------------------------------------------------------------------
# the dataflow
def test_calls_on_different_pools_run_at_once_and_on_one_pool_in_turn():
    # a waits for b: only two lanes at once can finish (one lane would wait forever)
    b_started = threading.Event()

    def a():
        assert b_started.wait(timeout=10), "the other pool's call did not run meanwhile"
        return "a"

    def b():
        b_started.set()
        return "b"
    assert at_once([Call("a", "p", a), Call("b", "q", b)]) == {"a": "a", "b": "b"}
    # on one pool the second call starts after the first ended
    order = []

    def slow(name):
        def fn():
            order.append(("start", name))
            time.sleep(0.05)
            order.append(("end", name))
        return fn
    at_once([Call("x", "p", slow("x")), Call("y", "p", slow("y")), Call("z", "q", lambda: 1)])
    assert order == [("start", "x"), ("end", "x"), ("start", "y"), ("end", "y")]


def test_an_error_is_raised_at_once_and_the_driver_lane_runs_in_the_callers_thread():
    where = {}

    def driver_call():
        where["driver"] = threading.current_thread() is threading.main_thread()
        raise ValueError("boom")

    slow_ended = threading.Event()

    def slow():
        where["pool"] = threading.current_thread() is threading.main_thread()
        time.sleep(0.5)
        slow_ended.set()
    with pytest.raises(ValueError, match="boom"):
        at_once([Call("s", "q", slow), Call("f", DRIVER, driver_call)])
    assert where == {"driver": True, "pool": False}
    assert not slow_ended.is_set(), "the error waited for the other lane"
    assert slow_ended.wait(timeout=5)  # the abandoned lane still ends


def test_timeline_overlap_and_idle_by_hand(tmp_path):
    t = Timeline()
    o = t.origin
    # a busy 0-4 and 5-6, b busy 2-7, c busy 3-3.5: two or more pools busy over 2-4 and 5-6
    for pool, s, e in (("a", 0, 4), ("a", 5, 6), ("b", 2, 7), ("c", 3, 3.5)):
        t.record(pool, f"{pool}.call", o + s, o + e)
    m = t.step_metrics(o + 0, o + 8, ["a", "b", "c"])
    assert m["timing/overlap_s"] == pytest.approx(3.0)
    assert m["timing/idle_a_s"] == pytest.approx(3.0)
    assert m["timing/idle_b_s"] == pytest.approx(3.0)
    assert m["timing/idle_c_s"] == pytest.approx(7.5)
    # the window clips the calls: over 3-5 a is busy 3-4, b 3-5, c 3-3.5
    m = t.step_metrics(o + 3, o + 5, ["a", "b", "c"])
    assert m["timing/overlap_s"] == pytest.approx(1.0)
    path = tmp_path / "timeline.json"
    t.write(path, step=1)
    t.record("a", "a.more", o + 9, o + 10)
    t.write(path, step=2)  # appended: the array stays open, as the format allows
    events = json.loads(path.read_text().rstrip().rstrip(",") + "]")
    spans = [(e["name"], e["ts"], e["dur"], e["args"]["step"]) for e in events if e["ph"] == "X"]
    assert spans[0] == ("a.call", 0, 4_000_000, 1) and spans[-1] == ("a.more", 9_000_000,
                                                                     1_000_000, 2)
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert sorted(names.values()) == ["a", "b", "c"]
