"""The fact tables: an algorithm is one AlgorithmSpec entry (and its estimator), a rollout backend
a class that declares its facts. Config, planner, checkpoint and estimator read the facts, not the
names: an entry added here acts everywhere without another edit."""

import pytest
import torch

from hybridflow.algorithms import ADVANTAGE_ESTIMATORS, estimate_advantages
from hybridflow.algorithms.specs import ALGORITHMS, OPTIONAL_OPTIONS, AlgorithmSpec, readers
from hybridflow.checkpoint import run_identity
from hybridflow.config import RLConfig, make_config
from hybridflow.errors import ArgumentError, ConfigError
from hybridflow.models.presets import shape_preset
from hybridflow.planner.memory import estimate_memory
from hybridflow.rollout.base import ROLLOUT_BACKENDS
from hybridflow.rollout.hf import HFRollout

BASE = {"rollout": {"backend": "hf", "sampling": {"n": 2}}, "train_batch_size": 2,
        "actor": {"engine": {"micro_batch_size": 1}}}


def config(**values):
    return make_config(RLConfig, BASE, values)


def test_the_table_is_whole():
    for name, spec in ALGORITHMS.items():
        assert spec.estimator in ADVANTAGE_ESTIMATORS, name
        assert set(spec.reads) <= set(OPTIONAL_OPTIONS), name
    for option in OPTIONAL_OPTIONS:  # an option nobody reads would always be refused
        assert readers(option), option


def test_an_algorithm_is_one_entry(monkeypatch):
    # Dr. GRPO's cousin: group-relative advantages, without reading norm_by_std.
    monkeypatch.setitem(ALGORITHMS, "group_mean", AlgorithmSpec(estimator="rloo", groups=True))
    cfg = config(**{"algorithm.name": "group_mean"})
    assert cfg.algorithm.spec is ALGORITHMS["group_mean"]
    with pytest.raises(ConfigError, match="algorithm.norm_by_std.*algorithm.name=grpo$"):
        config(**{"algorithm.name": "group_mean", "algorithm.norm_by_std": False})
    with pytest.raises(ConfigError, match="rollout.sampling.n"):  # groups: n >= 2
        config(**{"algorithm.name": "group_mean", "rollout.sampling.n": 1})
    scores, mask = torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.ones(4, 2)
    adv, targets = estimate_advantages("group_mean", scores=scores, mask=mask, logprobs=None,
                                       ref_logprobs=None, group_ids=[0, 0, 1, 1])
    # rloo: each sample's score minus the mean of the others in its group
    assert adv[:, 0].tolist() == [1.0, -1.0, 2.0, -2.0] and targets == {}


def test_facts_act_where_they_are_read(monkeypatch):
    # A critic-trained variant: the checkpoint holds a critic, the critic's options are read.
    monkeypatch.setitem(ALGORITHMS, "ppo_like", AlgorithmSpec(
        estimator="gae", critic=True, token_level=True, reads=("gamma", "lam")))
    cfg = config(**{"algorithm.name": "ppo_like", "critic.value_clip": 0.3,
                    "algorithm.lam": 0.9})
    shape = shape_preset("llama2-7b")
    assert run_identity(cfg, shape)["roles"] == ["actor", "critic"]
    assert "critic" in estimate_memory(cfg, {"model": shape}).pools[0].groups
    with pytest.raises(ConfigError, match="critic.value_clip.*ppo or safe_rlhf or ppo_like"):
        config(**{"critic.value_clip": 0.3})  # grpo trains no critic


def test_a_cost_critic_is_a_fact(monkeypatch):
    # A variant with the cost critic: its group starts beside the critic's (the critic's world
    # size), the checkpoint holds it, the memory estimate counts its state and its update.
    from hybridflow.config.placement import resolve_placement
    monkeypatch.setitem(ALGORITHMS, "lagrangian", AlgorithmSpec(
        estimator="safe_rlhf", critic=True, cost=True, cost_critic=True, token_level=True))
    cfg = config(**{"algorithm.name": "lagrangian", "cost": "math", "rollout.sampling.n": 1,
                    "critic.layout.tp": 2, "actor.layout.tp": 2})
    assert [(m.name, m.layout.world_size) for m in resolve_placement(cfg).groups()] == \
        [("actor", 2), ("critic", 2), ("cost_critic", 2)]
    shape = shape_preset("llama2-7b")
    assert run_identity(cfg, shape)["roles"] == ["actor", "critic", "cost_critic"]
    (pool,) = estimate_memory(cfg, {"model": shape}).pools
    assert pool.groups == ("actor", "critic", "cost_critic")
    critic = pool.phases["critic update"]["critic"]
    assert pool.phases["cost_critic update"]["cost_critic"] == critic  # the critic's twin
    # beside the critic's update the cost critic holds its weights, grads and optimizer state
    assert pool.phases["critic update"]["cost_critic"] == \
        {k: v for k, v in critic.items() if k != "activations"}
    with pytest.raises(ArgumentError, match="cost_critic"):
        AlgorithmSpec(estimator="gae", critic=True, cost_critic=True)  # no cost stream


class StackedBackend(HFRollout):
    """A backend that runs generation TP, computes on the switch's tensors and reads the KV
    cache size."""

    max_tp = None
    copies_weights = False
    reads = ("kv_cache_mb",)

    @classmethod
    def memory(cls, rollout, **_):
        return {"own": 7}, {"cache": 11}


def test_a_backend_declares_its_facts(monkeypatch):
    monkeypatch.setitem(ROLLOUT_BACKENDS, "stacked", StackedBackend)
    with pytest.raises(ConfigError, match="rollout.tp"):  # hf: one replica per process
        config(**{"actor.layout.tp": 2, "rollout.tp": 2})
    with pytest.raises(ConfigError, match="rollout.kv_cache_mb"):  # hf does not read it
        config(**{"rollout.kv_cache_mb": 64.0})
    cfg = config(**{"rollout.backend": "stacked", "actor.layout.tp": 2, "rollout.tp": 2,
                    "rollout.kv_cache_mb": 64.0})
    assert cfg.hybrid_engine.resident_for(cfg.actor, cfg.rollout)  # it copies no weights
    assert not config().hybrid_engine.resident_for(cfg.actor, config().rollout)
    pool = estimate_memory(cfg, {"model": shape_preset("llama2-7b")}).pools[0]
    # resident through every phase, the cache during generation only
    assert pool.phases["generation"]["rollout"] == {"own": 7, "cache": 11}
    assert pool.phases["actor update"]["rollout"] == {"own": 7}
