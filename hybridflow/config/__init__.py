"""Load a run config: a dataclass (each component owns its part), a YAML file, key=value overrides.

Every way a config can be wrong ends in ``ConfigError(field, message)``: an unknown key, a value of
the wrong type, a missing file, a check in some dataclass's ``__post_init__``.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

from hybridflow.errors import ConfigError

T = TypeVar("T")


def load_config(cls: type[T], path: str | os.PathLike | None = None,
                overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Build ``cls`` from its defaults, then the YAML file at ``path``, then ``overrides``
    (``["engine.optim.lr=1e-4", ...]``), and run every ``__post_init__`` check."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        merged = OmegaConf.structured(cls)
        if path is not None:
            if not os.path.isfile(path):
                raise ConfigError(str(path), "config file not found")
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
        for item in overrides:
            if "=" not in item:
                raise ConfigError(item, "an override must look like key=value, e.g. steps=10")
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        message = str(e).split("\n")[0]
        if type(e).__name__ == "ConfigKeyError":
            message += "; `hybridflow defaults JOB` prints every key with its default"
        raise ConfigError(key, message) from None
    except TypeError as e:  # a dataclass constructor rejecting the shape of a section
        raise ConfigError("config", str(e)) from None


def to_yaml(config: Any) -> str:
    """The resolved config as YAML (what runs/<name>/config.yaml holds)."""
    from omegaconf import OmegaConf
    return OmegaConf.to_yaml(OmegaConf.structured(config))
