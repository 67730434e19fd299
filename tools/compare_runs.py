#!/usr/bin/env python
"""Compare runs side by side: the config keys that differ, key metrics (final value and mean over
the run), steps, and time per phase; --plot draws each metric against step.

    python tools/compare_runs.py runs/grpo-s0 runs/grpo-s1 runs/ppo-s0 [--metrics reward/mean,kl]
                                 [--plot compare.png]

RUN is a run directory (metrics.jsonl and config.yaml, what every run writes) or a W&B run
directory (``<run>/wandb/offline-run-*``, holding a ``run-<id>.wandb`` log), read with wandb's own
``wandb leet inspect --json``; the folders next to it with the same run id (the parts of a resumed
run) are read as one run. In the plot, runs whose configs differ only in seeds (``seed``,
``data.seed``, any ``*.seed``; also ``name`` and ``tracking.*``) are one curve: the mean over
them, with their min-max as a band. Exit status 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from hybridflow.errors import ConfigError  # noqa: E402
from hybridflow.tracking import read_metrics  # noqa: E402

# The first of these that the runs logged are the key metrics when --metrics is not given.
DEFAULT_METRICS = ("reward/mean", "val/reward", "actor/pg_loss", "kl", "actor/kl_loss",
                   "critic/vf_loss")
# W&B's strings for the floats that JSON has no literal for.
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class BadInput(Exception):
    """A message for the user (one line); exit status 2."""


@dataclass(eq=False)
class Run:
    """One run as read from disk: ``config`` flattened to dotted keys, ``rows`` sorted by step;
    ``label`` is ``name`` or, where two runs share it, ``name (path)``."""

    name: str
    path: Path
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    label: str = field(init=False)

    def __post_init__(self) -> None:
        self.label = self.name


# ------------------------------------------------------------------------------------------------
# reading


def load_run(path: str | os.PathLike) -> Run:
    """A run directory (metrics.jsonl + config.yaml) or a W&B run directory."""
    path = Path(path)
    if (path / "metrics.jsonl").is_file() and (path / "config.yaml").is_file():
        return _load_run_dir(path)
    if path.is_dir() and next(path.glob("run-*.wandb"), None) is not None:
        return _load_wandb_run(path)
    if (path / "metrics.jsonl").is_file():
        raise BadInput(f"{path}: has metrics.jsonl but no config.yaml; a run directory holds "
                       "both")
    raise BadInput(f"{path}: not a run directory (metrics.jsonl and config.yaml) nor a W&B run "
                   "directory (wandb/offline-run-*, holding run-<id>.wandb)")


def _load_run_dir(path: Path) -> Run:
    import yaml
    try:
        rows = read_metrics(path / "metrics.jsonl")
        config = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8")) or {}
    except ConfigError as e:
        raise BadInput(str(e)) from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise BadInput(f"{path}: cannot be read: {str(e).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise BadInput(f"{path / 'config.yaml'}: not a mapping of config keys")
    rows = [{k: v for k, v in r.items() if k != "nonfinite"} for r in rows if "step" in r]
    return Run(str(config.get("name") or path.name), path, flatten(config),
               sorted(rows, key=lambda r: r["step"]))


def _load_wandb_run(path: Path) -> Run:
    """All the folders next to ``path`` that hold the same ``run-<id>.wandb`` (one per start of a
    resumed run), oldest first; a later part replaces the rows from its first step on."""
    log_name = next(path.glob("run-*.wandb")).name
    parts = sorted((_read_wandb_dir(d) for d in path.parent.iterdir()
                    if d.is_dir() and (d / log_name).is_file()), key=lambda p: p["start"])
    rows: dict[int, dict[str, Any]] = {}
    for part in parts:
        if part["rows"]:
            first = min(r["step"] for r in part["rows"])
            rows = {s: r for s, r in rows.items() if s < first}
        rows.update((r["step"], r) for r in part["rows"])
    last = parts[-1]
    return Run(last["name"] or path.name, path, flatten(last["config"]),
               [rows[s] for s in sorted(rows)])


def wandb_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of the W&B run folder ``path`` as ``wandb leet inspect --json`` prints them,
    one JSON object a line: ``{"type": "run", "run": {"config": {"update": {...}}, ...}}``,
    ``{"type": "history", "history": {"item": {...}, "step": {"num": N}}}``, ..."""
    # Without these, wandb-core may try to send its own telemetry and wait minutes offline.
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false"}
    try:
        done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                               str(path)], capture_output=True, text=True, timeout=300, env=env)
    except subprocess.TimeoutExpired:
        raise BadInput(f"{path}: `wandb leet inspect` did not finish in 300 s") from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise BadInput(f"{path}: `wandb leet inspect` cannot read it: {why}")
    records = []
    for line in done.stdout.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def _read_wandb_dir(path: Path) -> dict[str, Any]:
    """Name, start time, nested config and history rows of one W&B run folder."""
    out: dict[str, Any] = {"name": None, "start": ("", path.name), "config": {}, "rows": []}
    for record in wandb_records(path):
        kind = record.get("type")
        body = record.get(kind) or {}
        if kind == "run":
            out["name"] = body.get("display_name")
            out["start"] = (body.get("start_time", ""), path.name)
            out["config"] = _merged(out["config"], (body.get("config") or {}).get("update") or {})
        elif kind == "config":  # a later wandb.config.update
            out["config"] = _merged(out["config"], body.get("update") or {})
        elif kind == "history":
            item = body.get("item") or {}
            step = (body.get("step") or {}).get("num", item.get("_step"))
            row = {k: _NONFINITE.get(v, v) if isinstance(v, str) else v
                   for k, v in item.items() if not k.startswith("_")}
            out["rows"].append({"step": int(step or 0), **row})
    out["config"].pop("_wandb", None)
    return out


def _merged(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            value = _merged(out[key], value)
        out[key] = value
    return out


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# ------------------------------------------------------------------------------------------------
# numbers


def _number(value: Any) -> float | None:
    """A metric value as a float (null, a non-finite value in metrics.jsonl, is NaN), or None
    where it is no number."""
    if value is None:
        return math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def series(run: Run, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over ``run``'s rows that logged a number for it."""
    pairs = [(r["step"], _number(r[key])) for r in run.rows if key in r]
    pairs = [(s, v) for s, v in pairs if v is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def final_and_mean(run: Run, key: str) -> tuple[float, float] | None:
    """The last value of ``key`` and the mean of its finite values, or None if never logged."""
    _, values = series(run, key)
    if not values:
        return None
    finite = [v for v in values if math.isfinite(v)]
    return values[-1], (sum(finite) / len(finite) if finite else math.nan)


def numeric_keys(runs: list[Run]) -> list[str]:
    keys = {k for run in runs for r in run.rows for k, v in r.items()
            if k != "step" and _number(v) is not None}
    return sorted(keys)


def default_metrics(runs: list[Run]) -> list[str]:
    """The DEFAULT_METRICS that the runs logged; else their first few non-timing metrics."""
    have = numeric_keys(runs)
    chosen = [m for m in DEFAULT_METRICS if m in have]
    return chosen or [k for k in have if not k.startswith("timing/")][:4]


def config_differences(runs: list[Run]) -> list[str]:
    """The dotted config keys whose values are not the same in every run (``name`` left out:
    it labels the columns)."""
    def value(run: Run, key: str) -> str:
        return _canonical(run.config[key]) if key in run.config else "<none>"

    keys = sorted({k for run in runs for k in run.config} - {"name"})
    return [k for k in keys if len({value(run, k) for run in runs}) > 1]


def _canonical(value: Any) -> str:
    """``value`` as text that is the same for equal values: W&B writes the float 3.0 as 3."""
    def plain(v):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return json.dumps(plain(value), sort_keys=True, default=str)


def _is_seed_key(key: str) -> bool:
    return key == "name" or key.startswith("tracking.") or key.rsplit(".", 1)[-1] == "seed"


def seed_groups(runs: list[Run]) -> list[list[Run]]:
    """The runs grouped by their config without seeds, ``name`` and ``tracking.*``, in order."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        rest = {k: v for k, v in run.config.items() if not _is_seed_key(k)}
        groups.setdefault(_canonical(rest), []).append(run)
    return list(groups.values())


def group_label(group: list[Run]) -> str:
    """The run's label; for several, their names' common start, ``*``, and how many seeds."""
    if len(group) == 1:
        return group[0].label
    names = [r.name for r in group]
    prefix = os.path.commonprefix(names)
    star = "" if len(set(names)) == 1 else "*"
    return f"{prefix or names[0]}{star} ({len(group)} seeds)"


def band(group: list[Run], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, mean, min, max) of ``key`` over the runs of ``group``, at each step that any of
    them logged (non-finite values left out)."""
    at: dict[int, list[float]] = {}
    for run in group:
        for step, value in zip(*series(run, key)):
            if math.isfinite(value):
                at.setdefault(step, []).append(value)
    steps = sorted(at)
    return (steps, [sum(at[s]) / len(at[s]) for s in steps], [min(at[s]) for s in steps],
            [max(at[s]) for s in steps])


# ------------------------------------------------------------------------------------------------
# output


def _cell(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        text = json.dumps(value)
    elif isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, (list, dict)):
        text = json.dumps(value)
    else:
        text = str(value)
    return text if len(text) <= 32 else text[:31] + "~"


def table(runs: list[Run], metrics: list[str]) -> str:
    """The side-by-side comparison as text, one column per run."""
    rows: list[tuple[str, list[str]]] = [("run", [r.label for r in runs])]
    groups = seed_groups(runs)
    if any(len(g) > 1 for g in groups):
        rows.append(("seed group", [group_label(g) for r in runs for g in groups
                                    if any(x is r for x in g)]))
    differ = config_differences(runs)
    rows.append(("config differences:" if differ else "config differences: none", []))
    rows += [(f"  {k}", [_cell(r.config.get(k, "-")) for r in runs]) for k in differ]
    rows.append(("steps (last logged)", [_cell(max((x["step"] for x in r.rows), default="-"))
                                         for r in runs]))
    rows.append(("metrics: final / mean", []))
    for key in metrics:
        stats = [final_and_mean(r, key) for r in runs]
        rows.append((f"  {key}", [f"{_cell(s[0])} / {_cell(s[1])}" if s else "-"
                                  for s in stats]))
    timing = [k for k in numeric_keys(runs) if k.startswith("timing/")]
    if timing:
        means = {k: [final_and_mean(r, k) for r in runs] for k in timing}
        # The step total first, then the phases, slowest (largest mean in any run) first.
        order = sorted(timing, key=lambda k: (k != "timing/step_s", -max(
            (s[1] for s in means[k] if s and math.isfinite(s[1])), default=0)))
        rows.append(("time per step: mean seconds", []))
        rows += [(f"  {k}", [_cell(s[1]) if s else "-" for s in means[k]]) for k in order]
    width = [max(len(r[0]) for r in rows)] + [
        max(len(r[1][i]) for r in rows if r[1]) for i in range(len(runs))]
    lines = []
    for name, cells in rows:
        if not cells:
            lines.append(name)
            continue
        lines.append("  ".join([name.ljust(width[0])] +
                               [c.ljust(w) for c, w in zip(cells, width[1:])]).rstrip())
    return "\n".join(lines)


def plot(runs: list[Run], metrics: list[str], out_png: str | os.PathLike) -> None:
    """One subplot per metric against step; one curve per seed group (mean, min-max band)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    groups = seed_groups(runs)
    cols = 1 if len(metrics) == 1 else 2
    rows = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.4 * rows + 0.6), squeeze=False,
                             sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, key in zip(axes.flat, metrics):
        for n, group in enumerate(groups):
            steps, mean, low, high = band(group, key)
            if not steps:
                continue
            color = colors[n % len(colors)]
            label = group_label(group) + (": mean, min-max band" if len(group) > 1 else "")
            ax.plot(steps, mean, color=color, marker="o" if len(steps) <= 30 else None,
                    markersize=3, label=label)
            if len(group) > 1:
                ax.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.xaxis.set_tick_params(labelbottom=True)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics):]:
        ax.set_visible(False)
    handles, labels = {}, []
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles:
                handles[label] = h
                labels.append(label)
    per_row = 1 if cols == 1 else 3  # legend entries side by side that fit the figure's width
    if labels:
        fig.legend([handles[x] for x in labels], labels, loc="lower center",
                   ncol=min(len(labels), per_row), frameon=False)
    legend_rows = math.ceil(len(labels) / per_row)
    fig.tight_layout(rect=(0, 0.3 * legend_rows / fig.get_figheight(), 1, 1))
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="compare_runs", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="a run directory (metrics.jsonl, config.yaml) or a W&B run "
                             "directory (<run>/wandb/offline-run-*)")
    parser.add_argument("--metrics", help="comma-separated metric names (default: those of "
                                          f"{', '.join(DEFAULT_METRICS)} the runs logged)")
    parser.add_argument("--plot", metavar="FILE.png", help="write the metrics against step")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        runs = [load_run(p) for p in args.runs]
        labels = [r.label for r in runs]
        for run in runs:  # the same name twice (a run dir and its W&B folder): tell them apart
            if labels.count(run.label) > 1:
                run.label = f"{run.label} ({run.path})"
        have = numeric_keys(runs)
        if args.metrics is not None:
            metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
            unknown = [m for m in metrics if m not in have]
            if not metrics or unknown:
                raise BadInput(f"--metrics: {', '.join(unknown) or 'no name given'}: not logged "
                               f"by these runs; they logged {', '.join(have) or 'nothing'}")
        else:
            metrics = default_metrics(runs)
        print(table(runs, metrics))
        if args.plot:
            if not metrics:
                raise BadInput("--plot: these runs logged no metrics")
            try:
                plot(runs, metrics, args.plot)
            except OSError as e:
                raise BadInput(f"--plot: cannot write {args.plot}: {e.strerror or e}") from None
            print(f"wrote {args.plot}")
    except BadInput as e:
        print(f"compare_runs: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
