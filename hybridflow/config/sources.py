"""The models a run config names (``model``, ``critic.model``, ``reward_model``, ``cost_model``):
where each one's checkpoint is and its shape, read from the files' headers (what the pre-flight
checks and the planner both start from)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridflow.errors import ConfigError
from hybridflow.models.config import ModelConfig
from hybridflow.models.presets import shape_preset
from hybridflow.models.source import resolve_model
from hybridflow.training.loading import check_hf_checkpoint

SCORERS = {"scores": "reward_model", "costs": "cost_model"}
"""The scores a model group gives -> the config key that names that model."""


CRITIC = "critic.model"


def model_names(cfg: Any) -> dict[str, str]:
    """Config key -> the name (a checkpoint or a preset) of every model the run names: model,
    critic.model (where the run trains a critic from a checkpoint of its own), reward_model,
    cost_model."""
    names = {"model": cfg.model,
             CRITIC: cfg.critic.model if cfg.algorithm.spec.critic else None,
             **{field: getattr(cfg, field) for field in SCORERS.values()}}
    return {key: name for key, name in names.items() if name is not None}


def model_sources(cfg: Any) -> tuple[dict[str, Path | None], dict[str, ModelConfig]]:
    """({key: checkpoint directory, None for a shape preset}, {key: shape}) of every model of
    ``model_names``."""
    checkpoints, shapes = {}, {}
    for key, name in model_names(cfg).items():
        checkpoints[key], shapes[key] = _resolve(name, key)
    return checkpoints, shapes


def critic_shape(shapes: dict[str, ModelConfig]) -> ModelConfig:
    """The critic's shape: its own checkpoint's, else the actor's."""
    return shapes.get(CRITIC, shapes["model"])


def _resolve(name: str, field: str) -> tuple[Path | None, ModelConfig]:
    """(checkpoint directory, shape) of the model ``field`` names: a shape preset has no
    directory (None) and its shape is the preset's; otherwise the checkpoint's headers give it."""
    shape = shape_preset(name)
    if shape is not None:
        return None, shape
    path = resolve_model(name, field)
    return path, _model_config(path, field)


def _model_config(model_dir: Path, field: str) -> ModelConfig:
    """The checkpoint's shape, with every tensor's name and shape checked from the file headers
    (no tensor data is read): a bad checkpoint fails here, not in a worker."""
    try:
        return check_hf_checkpoint(model_dir)
    except ConfigError as e:
        raise ConfigError(field, e.message) from None
