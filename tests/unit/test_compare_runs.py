"""tools/compare_runs.py on small runs written by the real Tracker (metrics.jsonl + config.yaml,
and one W&B offline run): the table's numbers against hand-computed ones, seed grouping, the
plot, and bad input ending in one line and exit status 2."""

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridflow.tracking import Tracker, TrackingConfig

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "compare_runs.py"
NAN = float("nan")


def _load_tool():
    spec = importlib.util.spec_from_file_location("compare_runs", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["compare_runs"] = module
    spec.loader.exec_module(module)
    return module


cr = _load_tool()


def write_run(out: Path, name: str, *, seed: int, lr: float, rows: dict[int, dict],
              wandb: bool = False) -> Path:
    config = {"name": name, "seed": seed, "actor": {"lr": lr, "ppo_epochs": 1},
              "data": {"seed": seed, "source": "toy"},
              "tracking": {"out_dir": str(out), "wandb": wandb}}
    tracker = Tracker(out / name, yaml.safe_dump(config, sort_keys=False),
                      TrackingConfig(out_dir=str(out), wandb=wandb), name)
    for step, metrics in rows.items():
        tracker.log(step, metrics)
    tracker.close()
    return out / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    a0 = write_run(out, "a-s0", seed=0, lr=1e-5, rows={
        1: {"reward/mean": 0.25, "actor/pg_loss": 0.5, "timing/step_s": 2.0,
            "timing/generate_s": 1.0},
        2: {"reward/mean": 0.5, "actor/pg_loss": NAN, "timing/step_s": 4.0,
            "timing/generate_s": 1.0, "val/reward": 0.4},
        3: {"reward/mean": 0.75, "actor/pg_loss": 0.25, "timing/step_s": 6.0,
            "timing/generate_s": 1.0},
        4: {"reward/mean": 1.0, "actor/pg_loss": 0.125, "timing/step_s": 8.0,
            "timing/generate_s": 1.0, "val/reward": 0.6}})
    a1 = write_run(out, "a-s1", seed=1, lr=1e-5, rows={
        s: {"reward/mean": r, "actor/pg_loss": 0.0, "timing/step_s": 3.0}
        for s, r in zip((1, 2, 3, 4), (0.0, 0.25, 0.5, 0.75))})
    b0 = write_run(out, "b-s0", seed=0, lr=2e-5, rows={
        s: {"reward/mean": 1.0, "timing/step_s": 1.0} for s in (1, 2, 3)})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.delenv("WANDB_API_KEY", raising=False)
        w = write_run(out, "w-s0", seed=0, lr=3e-5, wandb=True, rows={
            1: {"reward/mean": 0.5, "note": "text"}, 2: {"reward/mean": 0.25}})
    wandb_dir = next((w / "wandb").glob("offline-run-*"))
    return {"a0": a0, "a1": a1, "b0": b0, "w": wandb_dir}


def run_main(capsys, *argv):
    code = cr.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cells(out: str, row: str) -> list[str]:
    """The cells of the table row named ``row`` (cells are 2+ spaces apart)."""
    line = next(x for x in out.splitlines() if x.strip().split("  ")[0] == row)
    return re.split(r"\s{2,}", line.strip())[1:]


def section(out: str, header_start: str) -> list[str]:
    """The indented row names under the header line that starts with ``header_start``."""
    lines = out.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith(header_start))
    names = []
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        names.append(line.split()[0])
    return names


def test_the_table_holds_the_hand_computed_numbers(runs, capsys):
    code, out, _ = run_main(capsys, runs["a0"], runs["a1"], runs["b0"])
    assert code == 0, out
    assert cells(out, "run") == ["a-s0", "a-s1", "b-s0"]
    assert section(out, "config differences") == ["actor.lr", "data.seed", "seed"]
    assert cells(out, "actor.lr") == ["1e-05", "1e-05", "2e-05"]
    assert cells(out, "steps (last logged)") == ["4", "4", "3"]
    # final / mean: (0.25+0.5+0.75+1)/4, (0+0.25+0.5+0.75)/4; the NaN of step 2 is left out of
    # the mean: (0.5+0.25+0.125)/3.
    assert cells(out, "reward/mean") == ["1 / 0.625", "0.75 / 0.375", "1 / 1"]
    assert cells(out, "actor/pg_loss") == ["0.125 / 0.2917", "0 / 0", "-"]
    assert cells(out, "val/reward") == ["0.6 / 0.5", "-", "-"]
    # Default metrics: those of DEFAULT_METRICS present, in its order; no timing among them.
    assert section(out, "metrics:") == ["reward/mean", "val/reward", "actor/pg_loss"]
    # Mean seconds per step, the total first.
    assert section(out, "time per step") == ["timing/step_s", "timing/generate_s"]
    assert cells(out, "timing/step_s") == ["5", "3", "1"]
    assert cells(out, "timing/generate_s") == ["1", "-", "-"]
    assert cells(out, "seed group") == ["a-s* (2 seeds)", "a-s* (2 seeds)", "b-s0"]


def test_metrics_flag_picks_the_rows(runs, capsys):
    code, out, _ = run_main(capsys, runs["a0"], runs["b0"], "--metrics", "timing/step_s")
    assert code == 0
    assert section(out, "metrics:") == ["timing/step_s"]
    assert cells(out, "timing/step_s")[0] == "8 / 5"
    assert "seed group" not in out  # no group of more than one run


def test_runs_that_differ_only_by_seed_are_one_group(runs):
    a0, a1, b0 = (cr.load_run(runs[k]) for k in ("a0", "a1", "b0"))
    groups = cr.seed_groups([a0, b0, a1])
    assert [[r.name for r in g] for g in groups] == [["a-s0", "a-s1"], ["b-s0"]]
    assert cr.group_label(groups[0]) == "a-s* (2 seeds)"
    steps, mean, low, high = cr.band(groups[0], "reward/mean")
    assert steps == [1, 2, 3, 4]
    assert mean == pytest.approx([0.125, 0.375, 0.625, 0.875])
    assert low == [0.0, 0.25, 0.5, 0.75] and high == [0.25, 0.5, 0.75, 1.0]
    # A NaN leaves that run out of the step's band, not the band as a whole.
    steps, mean, low, high = cr.band(groups[0], "actor/pg_loss")
    assert mean == pytest.approx([0.25, 0.0, 0.125, 0.0625]) and high[1] == 0.0


def test_a_wandb_offline_run_reads_like_a_run_directory(runs, capsys):
    w = cr.load_run(runs["w"])
    assert w.name == "w-s0"
    assert [(r["step"], r["reward/mean"]) for r in w.rows] == [(1, 0.5), (2, 0.25)]
    assert w.config["actor.lr"] == 3e-5 and w.config["data.source"] == "toy"  # nested config
    assert "note" not in cr.numeric_keys([w])
    code, out, _ = run_main(capsys, runs["a0"], runs["w"], "--metrics", "reward/mean")
    assert code == 0
    assert cells(out, "reward/mean") == ["1 / 0.625", "0.25 / 0.375"]
    assert section(out, "config differences") == ["actor.lr", "tracking.wandb"]


def test_plot_writes_a_png(runs, capsys, tmp_path):
    png = tmp_path / "cmp.png"
    code, out, _ = run_main(capsys, runs["a0"], runs["a1"], runs["b0"], "--plot", png)
    assert code == 0 and f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread
    height, width = imread(png).shape[:2]
    assert width > 1000 and height > 600  # 2 x 2 subplots of three metrics


def test_default_metrics_fall_back_to_what_was_logged():
    run = cr.Run("r", Path("."), {}, [{"step": 1, "loss": 1.0, "timing/step_s": 2.0,
                                       "text": "x"}])
    assert cr.default_metrics([run]) == ["loss"]


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing", "not a run directory"),
    (lambda p: p, "not a run directory"),  # an empty folder
    (lambda p: (p / "metrics.jsonl").write_text('{"step": 1}\n') and p, "no config.yaml"),
    (lambda p: (p / "run-x.wandb").write_text("garbage") and p, "wandb leet inspect"),
])
def test_a_path_that_is_no_run_exits_2(tmp_path, capsys, make, message):
    code, out, err = run_main(capsys, make(tmp_path))
    assert code == 2 and not out
    assert err.startswith("compare_runs: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_an_unknown_metric_exits_2_naming_it(runs, capsys):
    code, _, err = run_main(capsys, runs["a0"], "--metrics", "reward/mean,rewrd/mean")
    assert code == 2
    assert "--metrics: rewrd/mean: not logged by these runs; they logged " in err
    assert "reward/mean" in err.split("they logged")[1]


def test_the_command_line_exits_2_without_a_traceback(runs, tmp_path):
    done = subprocess.run([sys.executable, str(TOOL), str(runs["a0"]), str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == f"compare_runs: error: {tmp_path / 'nope'}: not a run " \
                                  "directory (metrics.jsonl and config.yaml) nor a W&B run " \
                                  "directory (wandb/offline-run-*, holding run-<id>.wandb)"


def test_nan_final_value_shows_as_nan(tmp_path, capsys):
    path = write_run(tmp_path, "n", seed=0, lr=1e-5, rows={1: {"loss": 1.0}, 2: {"loss": NAN}})
    code, out, _ = run_main(capsys, path, "--metrics", "loss")
    assert code == 0
    assert cells(out, "loss") == ["nan / 1"]
    assert math.isnan(cr.final_and_mean(cr.load_run(path), "loss")[0])
