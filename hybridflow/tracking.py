"""Run tracking: JSONL always; W&B (offline unless WANDB_API_KEY is set) and TensorBoard when
asked. docs/tracking.md describes the backends; tools/compare_runs.py reads what they write."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hybridflow.errors import ConfigError, RunError


CLOCK_KEYS = ("timing/", "throughput/", "weight_sync/verify_s", "weight_sync/s")
"""Prefixes of the metrics that read the clock: two runs of the same work differ in them only."""


@dataclass(kw_only=True)
class TrackingConfig:
    """Where a run's config and metrics go."""

    out_dir: str = "runs"
    """Parent folder of run folders; each run writes out_dir/<name>/."""
    wandb: bool = False
    """Also log to Weights & Biases (offline mode unless WANDB_API_KEY is set)."""
    wandb_project: str = "hybridflow"
    """W&B project name."""
    wandb_group: str | None = None
    """W&B run group (e.g. the seeds of one experiment); null: none."""
    wandb_tags: list[str] = field(default_factory=list)
    """W&B run tags, each 1-64 characters."""
    tensorboard: bool = False
    """Also write TensorBoard event files (numeric metrics) to <out_dir>/<name>/tensorboard/."""

    def __post_init__(self) -> None:
        if not isinstance(self.out_dir, str) or not self.out_dir:
            raise ConfigError("out_dir", "must be a folder path, e.g. runs")
        if not isinstance(self.wandb, bool):
            raise ConfigError("wandb", f"must be true or false, got {self.wandb!r}")
        if not isinstance(self.tensorboard, bool):
            raise ConfigError("tensorboard", f"must be true or false, got {self.tensorboard!r}")
        if not isinstance(self.wandb_project, str) or not self.wandb_project:
            raise ConfigError("wandb_project", "must be a W&B project name")
        if self.wandb_group is not None and (not isinstance(self.wandb_group, str)
                                             or not self.wandb_group):
            raise ConfigError("wandb_group", f"must be a W&B group name or null, got "
                                             f"{self.wandb_group!r}")
        tags = self.wandb_tags
        if not isinstance(tags, (list, tuple)) or not all(
                isinstance(t, str) and 1 <= len(t) <= 64 for t in tags):
            # W&B's own limit; wandb.init would refuse it only once the workers are up.
            raise ConfigError("wandb_tags", f"must be a list of tags of 1-64 characters, e.g. "
                                            f"[grpo, baseline], got {tags!r}")
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("tensorboard", "needs the tensorboard package: pip install "
                                             "tensorboard, or set tracking.tensorboard=false")


class Tracker:
    """Writes ``<run_dir>/config.yaml`` and one JSON object per step to ``metrics.jsonl``.

    Every row is strict JSON (a non-finite value is ``null`` and named in the row's
    ``"nonfinite"`` list) written with one write, flushed and fsynced: the file holds whole rows,
    and at most a partial last one after a crash, which ``read_metrics`` skips. A new run
    (``resume_step=None``) refuses a folder whose metrics.jsonl already has rows; a resumed one
    keeps the rows of steps <= ``resume_step`` and appends after them. ``wandb_id`` continues
    that W&B run (offline, each start writes one more ``wandb/offline-run-*`` folder with that
    id, which ``wandb sync`` puts in one run). TensorBoard hides its events of steps after
    ``resume_step`` (``purge_step``). A failed write (full disk, unwritable folder) is a
    RunError."""

    def __init__(self, run_dir: str | os.PathLike, config_yaml: str, config: TrackingConfig,
                 name: str, *, resume_step: int | None = None, wandb_id: str | None = None):
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        with _writing(self.run_dir):
            self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            if self.metrics_path.exists() and self.metrics_path.stat().st_size > 0:
                raise ConfigError("tracking.out_dir", f"{self.metrics_path} already holds the "
                                                      "metrics of a run; choose another name or "
                                                      "tracking.out_dir, or resume that run")
        else:
            _keep_steps_up_to(self.metrics_path, resume_step)
        _write_atomically(self.run_dir / "config.yaml", config_yaml.encode())
        with _writing(self.metrics_path):
            self._file = open(self.metrics_path, "a", encoding="utf-8")
        self._wandb = None
        self.wandb_id: str | None = None
        """The W&B run id (None without W&B); pass it back as ``wandb_id`` to resume."""
        if config.wandb:
            import wandb  # deferred: W&B
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            parsed = yaml.safe_load(config_yaml)
            self._wandb = wandb.init(
                project=config.wandb_project, name=name, dir=str(self.run_dir), mode=mode,
                group=config.wandb_group, tags=list(config.wandb_tags) or None,
                config=parsed if isinstance(parsed, dict) else {"yaml": config_yaml},
                id=wandb_id, resume="allow" if wandb_id is not None else None)
            self.wandb_id = self._wandb.id
        self._tensorboard = None
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # deferred: torch, tensorboard
            with _writing(self.run_dir / "tensorboard"):
                self._tensorboard = SummaryWriter(
                    str(self.run_dir / "tensorboard"),
                    purge_step=None if resume_step is None else resume_step + 1)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append the row of ``step``; it is on disk when this returns."""
        plain = {k: _plain(v) for k, v in metrics.items()}
        row: dict[str, Any] = {"step": step}
        nonfinite = []
        for key, value in plain.items():
            row[key], bad = _finite(value)
            if bad:
                nonfinite.append(key)
        if nonfinite:
            row["nonfinite"] = nonfinite
        line = json.dumps(row, allow_nan=False) + "\n"
        with _writing(self.metrics_path):
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())
        if self._wandb is not None:
            self._wandb.log(plain, step=step)
        if self._tensorboard is not None:
            with _writing(self.run_dir / "tensorboard"):
                for key, value in plain.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        self._tensorboard.add_scalar(key, value, step)
                self._tensorboard.flush()

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:  # what the failed write left in the buffer; log() has raised already
            pass
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):  # tensors and numpy values, 0-d ones to Python scalars
        return value.tolist()
    return value


def _finite(value: Any) -> tuple[Any, bool]:
    """``value`` with non-finite floats (nested too) as None, and whether there were any."""
    if isinstance(value, float) and not math.isfinite(value):
        return None, True
    if isinstance(value, (list, tuple)):
        pairs = [_finite(v) for v in value]
        return [v for v, _ in pairs], any(bad for _, bad in pairs)
    if isinstance(value, dict):
        pairs = {k: _finite(v) for k, v in value.items()}
        return {k: v for k, (v, _) in pairs.items()}, any(bad for _, bad in pairs.values())
    return value, False


_FIXES = {
    errno.ENOSPC: "free disk space there or choose another tracking.out_dir",
    errno.EDQUOT: "free space under your disk quota or choose another tracking.out_dir",
    errno.EACCES: "choose a writable tracking.out_dir",
    errno.EPERM: "choose a writable tracking.out_dir",
    errno.EROFS: "the file system is read-only; choose a writable tracking.out_dir",
    errno.ENOENT: "its folder is gone; choose an existing, writable tracking.out_dir",
}


@contextlib.contextmanager
def _writing(path: Path):
    """An OSError inside becomes a RunError naming ``path``, the OS error and the fix."""
    try:
        yield
    except OSError as e:
        fix = _FIXES.get(e.errno, "check the disk and tracking.out_dir")
        raise RunError(f"cannot write {path}: {e.strerror or e}; {fix}") from None


def _write_atomically(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` or what it held before, never a part: a temporary file in the same
    folder, fsynced, then renamed over it."""
    with _writing(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def _keep_steps_up_to(path: Path, step: int) -> None:
    """Drop the rows of steps after ``step`` (and a partial last line) from ``path``."""
    if not path.exists():
        return
    kept = b"".join(raw + b"\n" for row, raw in _parse(path) if row.get("step", 0) <= step)
    _write_atomically(path, kept)


def _parse(path: str | os.PathLike) -> list[tuple[dict[str, Any], bytes]]:
    """(row, its line) for each row of a metrics.jsonl file. The last line is skipped when it
    has no newline or is not JSON (a write cut short); any other bad line is a ConfigError."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    complete = len(lines) - 1  # the text after the last newline is partial (b"" if none)
    out = []
    for n, raw in enumerate(lines[:complete], 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except ValueError as e:
            if n == complete:
                break
            raise ConfigError(str(path), f"line {n} is not JSON ({e}); the file is damaged: "
                                         "remove that line") from None
        if not isinstance(row, dict):
            raise ConfigError(str(path), f"line {n} is {type(row).__name__}, not a JSON object; "
                                         "the file is damaged: remove that line")
        out.append((row, raw))
    return out


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file (a partial last line, from a write cut short, skipped)."""
    return [row for row, _ in _parse(path)]


def plot_metric(metrics_path: str | os.PathLike, key: str, out_png: str | os.PathLike,
                title: str = "") -> None:
    """A PNG of ``key`` against ``step`` from a metrics.jsonl file."""
    import matplotlib  # deferred: matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: matplotlib

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
