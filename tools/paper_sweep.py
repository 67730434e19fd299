#!/usr/bin/env python
"""The GPU-count sweep of the HybridFlow paper's section 8 over experiments/paper/: each run file
at each GPU count, through the checks of ``hybridflow check`` (memory per GPU included).

    python tools/paper_sweep.py                       # every llama2_*.yaml, 8 to 128 GPUs
    python tools/paper_sweep.py experiments/paper/ppo/llama2_13b.yaml --gpus 16 32 64
    python tools/paper_sweep.py FILE --set actor.layout.pp=2   # a change, at every count

The paper runs each model size "from the smallest number of GPUs to run RLHF without OOM to 128
GPUs", on nodes of 8 (its section 8.2 names 8 GPUs, 8.3 96). At a count the file keeps its
layouts' tp and pp and its rollout.tp and scales the rest: cluster.nodes, every pool by the same
factor (a written-out pool's nodes) and every model's dp so that tp * pp * dp is its pool's ranks.
Where the file's tp * pp cannot tile the scaled pool, the row says so. Each file gets a table:
the GPUs, the peak of the per-GPU memory estimate (GiB, phase), and either the exact
``hybridflow train FILE key=value ...`` command at that count (add the checkpoints, ``model=...
reward_model=...``, in place of the shape presets) or why it does not run there (the
ConfigError's key and message). A file's own count should be the smallest that fits.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridflow.config import RLConfig, load_config  # noqa: E402
from hybridflow.config.placement import resolve_placement  # noqa: E402
from hybridflow.config.sources import model_sources  # noqa: E402
from hybridflow.errors import ConfigError  # noqa: E402
from hybridflow.planner.memory import GIB, estimate_memory  # noqa: E402
from hybridflow.preflight import check_run  # noqa: E402

COUNTS = (8, 16, 32, 64, 96, 128)
"""GPU counts the paper's section 8 runs: 8 to 128 on nodes of 8 (96 in its Figures 12-13)."""
PAPER = ROOT / "experiments" / "paper"


@dataclass(frozen=True)
class Row:
    """One file at one GPU count."""

    gpus: int
    overrides: tuple[str, ...]
    """What puts the file on ``gpus`` GPUs (only the keys whose value changes)."""
    error: ConfigError | None
    """Why it does not run there; None where it passes every check."""
    peak: tuple[str, float] | None
    """(phase, GiB) of the fullest GPU's estimate, where the config resolves."""

    @property
    def fits(self) -> bool:
        return self.error is None


def paper_files() -> list[Path]:
    """Every run of experiments/paper/<algorithm>/ (its llama2_*.yaml)."""
    return sorted(PAPER.glob("*/llama2_*.yaml"))


def scaled(cfg: RLConfig, gpus: int) -> dict[str, int]:
    """The keys that put ``cfg`` on ``gpus`` GPUs, with their values: cluster.nodes, the nodes of
    every written-out pool and the dp of every model's layout, each pool scaled by ``gpus`` / the
    file's GPUs with its models' tp and pp kept. A ConfigError where they do not tile it."""
    c = cfg.cluster
    if c.nodes is None:
        raise ConfigError("cluster.nodes", "is not set: the sweep scales the file's cluster")
    if gpus % c.gpus_per_node:
        raise ConfigError("cluster.nodes", f"{gpus} GPUs are not whole nodes of "
                                           f"cluster.gpus_per_node={c.gpus_per_node}")
    values = {"cluster.nodes": gpus // c.gpus_per_node}
    factor = Fraction(gpus, c.gpus)
    placement = resolve_placement(cfg)
    for pool in placement.pools:
        ranks = pool.ranks * factor
        if cfg.placement.pools:
            nodes = pool.nodes * factor
            if nodes.denominator != 1:
                raise ConfigError(f"placement.pools.{pool.name}.nodes",
                                  f"{pool.nodes} of the file's {c.nodes} nodes do not scale to "
                                  f"whole nodes at {gpus} GPUs")
            values[f"placement.pools.{pool.name}.nodes"] = int(nodes)
        for name in pool.models:
            model = placement.models[name]
            lay = model.layout
            dp = ranks / (lay.tp * lay.pp)
            if dp.denominator != 1 or dp < 1:
                raise ConfigError(f"{model.layout_key}.tp", f"the {name}'s tp * pp = "
                                  f"{lay.tp} * {lay.pp} does not tile its pool's {ranks} "
                                  f"ranks at {gpus} GPUs")
            key = f"{model.layout_key}.dp"
            if values.setdefault(key, int(dp)) != dp:  # two models of one layout key, apart
                raise ConfigError(key, f"the models at {model.layout_key} would need dp "
                                       f"{values[key]} and {dp} at {gpus} GPUs")
    return values


def sweep(path: Path, counts=COUNTS, extra: tuple[str, ...] = ()) -> list[Row]:
    """``path`` (with the ``extra`` overrides) at each of ``counts`` GPUs: a Row each."""
    own = load_config(RLConfig, path)
    base = load_config(RLConfig, path, list(extra))
    given = dict(item.split("=", 1) for item in extra)
    rows = []
    with tempfile.TemporaryDirectory() as out:  # check_run looks for the run's folder there
        for gpus in counts:
            overrides, memory, error = (), None, None
            try:
                values = {key: (value, str(value)) for key, value in scaled(base, gpus).items()}
                values.update({key: (yaml.safe_load(text), text) for key, text in given.items()
                               if key not in values})
                overrides = tuple(f"{key}={text}" for key, (value, text) in values.items()
                                  if value != _value(own, key))
                cfg = load_config(RLConfig, path, [*overrides, f"tracking.out_dir={out}"])
                try:
                    memory = check_run(cfg).memory
                except ConfigError as e:
                    error = e
                    memory = estimate_memory(cfg, model_sources(cfg)[1])
            except ConfigError as e:
                error = error or e
            peak = (memory.peak[1], memory.peak[2] / GIB) if memory else None
            rows.append(Row(gpus, overrides, error, peak))
    return rows


def smallest_fit(rows: list[Row]) -> int | None:
    """The fewest GPUs that pass, None if no count does."""
    return next((r.gpus for r in rows if r.fits), None)


def command(path: Path, row: Row) -> str:
    """The command that trains ``path`` at ``row``'s GPU count."""
    return " ".join(["hybridflow train", _relative(path), *row.overrides])


def table(path: Path, rows: list[Row]) -> str:
    """The sweep of one file, a line per count."""
    own = load_config(RLConfig, path).cluster.gpus
    lines = [f"{_relative(path)}: the file runs {own} GPUs; the smallest count that fits: "
             f"{smallest_fit(rows) or 'none'}",
             f"  {'GPUs':>4}  {'peak GiB':>8}  {'phase':<14}  command, or why not"]
    for r in rows:
        phase, gib = r.peak if r.peak else ("-", None)
        what = (command(path, r) if r.fits else
                f"does not fit: {r.error.field}: {r.error.message}")
        lines.append(f"  {r.gpus:>4}  {'-' if gib is None else f'{gib:.1f}':>8}  {phase:<14}  "
                     f"{what}")
    return "\n".join(lines)


def _value(cfg: RLConfig, key: str):
    """The value of a dotted config key (placement.pools.<name>.nodes included); None where the
    config has no such entry (a pool the file does not write out)."""
    node = cfg
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
        if node is None:
            return None
    return node


def _relative(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="paper_sweep", description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", type=Path,
                    help="run files (default: experiments/paper/*/llama2_*.yaml)")
    ap.add_argument("--gpus", nargs="+", type=int, default=list(COUNTS),
                    help=f"GPU counts (default: {' '.join(map(str, COUNTS))})")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="overrides applied to every file before it is scaled")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    for path in args.files or paper_files():
        try:
            rows = sweep(path, args.gpus, tuple(args.set))
        except ConfigError as e:  # the file itself (with --set) does not load
            print(f"{_relative(path)}: {e.field}: {e.message}\n")
            continue
        print(table(path, rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
