"""Run tracking: JSONL always, W&B when asked (offline unless WANDB_API_KEY is set)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.errors import ConfigError


@dataclass(kw_only=True)
class TrackingConfig:
    """Where a run's config and metrics go."""

    out_dir: str = "runs"
    """Parent folder of run folders; each run writes out_dir/<name>/."""
    wandb: bool = False
    """Also log to Weights & Biases (offline mode unless WANDB_API_KEY is set)."""
    wandb_project: str = "hybridflow"
    """W&B project name."""

    def __post_init__(self) -> None:
        if not isinstance(self.out_dir, str) or not self.out_dir:
            raise ConfigError("out_dir", "must be a folder path, e.g. runs")
        if not isinstance(self.wandb_project, str) or not self.wandb_project:
            raise ConfigError("wandb_project", "must be a W&B project name")


class Tracker:
    """Writes ``<run_dir>/config.yaml`` once and one JSON object per step to ``metrics.jsonl``."""

    def __init__(self, run_dir: str | os.PathLike, config_yaml: str, config: TrackingConfig,
                 name: str):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(config_yaml)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._file = open(self.metrics_path, "w", buffering=1)
        self._wandb = None
        if config.wandb:
            import wandb
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self._wandb = wandb.init(project=config.wandb_project, name=name, dir=str(self.run_dir),
                                     mode=mode, config={"yaml": config_yaml})

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log(row, step=step)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metric(metrics_path: str | os.PathLike, key: str, out_png: str | os.PathLike,
                title: str = "") -> None:
    """A PNG of ``key`` against ``step`` from a metrics.jsonl file."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics_path) if key in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
