"""Run configs: the RL run's schema (``RLConfig``), composed of the components' own config
dataclasses; loading from YAML and ``key=value`` overrides; the cluster and its pools
(``cluster``); the models a config names (``sources``). The checks that need the model's shape
are ``hybridflow.preflight``'s."""

from hybridflow.config.loader import build_config, load_config, make_config, to_yaml
from hybridflow.config.rl import (ActorConfig, AlgorithmConfig, CriticConfig, HybridEngineConfig,
                                  RefConfig, RLConfig, RolloutConfig, UpdateConfig)

__all__ = ["ActorConfig", "AlgorithmConfig", "CriticConfig", "HybridEngineConfig",
           "RLConfig", "RefConfig", "RolloutConfig", "UpdateConfig", "build_config",
           "load_config", "make_config", "to_yaml"]
