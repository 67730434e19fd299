"""Tracking backends: W&B (nested config, name, group, tags, one run across a resume) read back
with wandb's own ``wandb leet inspect``, and TensorBoard (scalars, no step twice after a resume)
read back with tensorboard's EventAccumulator. The JSONL file's safety is test_run_safety.py."""

import importlib.util
import sys
from pathlib import Path

import pytest

from hybridflow.errors import ConfigError
from hybridflow.tracking import Tracker, TrackingConfig, read_metrics

ROOT = Path(__file__).resolve().parents[2]
CONFIG_YAML = "name: nested\nactor:\n  engine:\n    optim:\n      lr: 1.0e-06\n  ppo_epochs: 2\n" \
              "seed: 3\n"


def _compare_runs():
    spec = importlib.util.spec_from_file_location("compare_runs",
                                                  ROOT / "tools" / "compare_runs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["compare_runs"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kwargs, field", [
    ({"wandb_group": ""}, "wandb_group"),
    ({"wandb_group": 3}, "wandb_group"),
    ({"wandb_tags": "a,b"}, "wandb_tags"),
    ({"wandb_tags": ["ok", ""]}, "wandb_tags"),
    ({"wandb_tags": ["x" * 65]}, "wandb_tags"),
    ({"wandb_tags": [1]}, "wandb_tags"),
    ({"tensorboard": "yes"}, "tensorboard"),
    ({"wandb": 1}, "wandb"),
])
def test_bad_tracking_values_are_refused(kwargs, field):
    with pytest.raises(ConfigError) as e:
        TrackingConfig(**kwargs)
    assert e.value.field == field


def test_tensorboard_without_its_package_is_refused(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install tensorboard") as e:
        TrackingConfig(tensorboard=True)
    assert e.value.field == "tensorboard"
    TrackingConfig(tensorboard=False)


def test_the_new_keys_load_from_overrides():
    from hybridflow.config.loader import load_config
    config = load_config(TrackingConfig, None, [
        "wandb=true", "wandb_group=sweep-1", "wandb_tags=[grpo,baseline]", "tensorboard=true"])
    assert (config.wandb_group, config.wandb_tags, config.tensorboard) == \
        ("sweep-1", ["grpo", "baseline"], True)


# ------------------------------------------------------------------------------------------------
# W&B: one offline run started, closed and resumed with the same id (shared: wandb.init is slow)


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    pytest.importorskip("wandb")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.delenv("WANDB_API_KEY", raising=False)
        run_dir = tmp_path_factory.mktemp("wandb") / "nested"
        config = TrackingConfig(out_dir=str(run_dir.parent), wandb=True, wandb_group="sweep-1",
                                wandb_tags=["grpo", "baseline"])
        tracker = Tracker(run_dir, CONFIG_YAML, config, "nested")
        run_id = tracker.wandb_id
        for step in (1, 2, 3):
            tracker.log(step, {"loss": float(step), "timing/step_s": 2.0})
        tracker.close()
        # A crash after step 3, resumed from the checkpoint of step 2: step 3 again, then 4.
        tracker = Tracker(run_dir, CONFIG_YAML, config, "nested", resume_step=2, wandb_id=run_id)
        assert tracker.wandb_id == run_id
        for step in (3, 4):
            tracker.log(step, {"loss": 10.0 * step, "timing/step_s": 3.0})
        tracker.close()
    return run_dir, run_id


@pytest.fixture(scope="module")
def run_records(wandb_run):
    """The "run" record (name, config, group, ...) of each offline-run folder, oldest first, as
    ``wandb leet inspect --json`` reads it."""
    run_dir, _ = wandb_run
    parts = sorted((run_dir / "wandb").glob("offline-run-*"))
    return [next(r["run"] for r in _compare_runs().wandb_records(p) if r["type"] == "run")
            for p in parts]


def test_wandb_records_the_nested_config_name_group_and_tags(run_records):
    run = run_records[0]
    config = run["config"]["update"]
    config.pop("_wandb", None)
    assert config == {"name": "nested", "actor": {"engine": {"optim": {"lr": 1e-6}},
                                                  "ppo_epochs": 2}, "seed": 3}
    assert run["display_name"] == "nested"
    assert run["run_group"] == "sweep-1"
    assert run["tags"] == ["grpo", "baseline"]


def test_a_resumed_wandb_run_is_one_run(wandb_run, run_records):
    run_dir, run_id = wandb_run
    parts = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(parts) == 2  # offline, each start writes a folder; `wandb sync` makes one run
    assert [r["run_id"] for r in run_records] == [run_id, run_id]
    assert run_records[1].get("resume") is True
    # Read as one run: the resumed part's step 3 replaces the first part's.
    merged = _compare_runs().load_run(parts[0])
    assert [(r["step"], r["loss"]) for r in merged.rows] == [(1, 1), (2, 2), (3, 30), (4, 40)]
    assert merged.config["actor.engine.optim.lr"] == 1e-6
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------------------
# TensorBoard


def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def test_tensorboard_writes_scalars_and_purges_the_steps_after_a_resume(tmp_path):
    pytest.importorskip("tensorboard")
    config = TrackingConfig(out_dir=str(tmp_path), tensorboard=True)
    run_dir = tmp_path / "tb"
    tracker = Tracker(run_dir, CONFIG_YAML, config, "tb")
    for step in (1, 2, 3, 4):
        tracker.log(step, {"loss": float(step), "count": step, "note": "text", "hist": [1, 2],
                           "flag": True})
    tracker.close()
    assert _scalars(run_dir / "tensorboard") == {
        "loss": [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)],
        "count": [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]}
    # Resumed from step 2: steps 3 and 4 are logged again and must not appear twice.
    tracker = Tracker(run_dir, CONFIG_YAML, config, "tb", resume_step=2)
    for step in (3, 4, 5):
        tracker.log(step, {"loss": 10.0 * step})
    tracker.close()
    assert _scalars(run_dir / "tensorboard")["loss"] == [(1, 1.0), (2, 2.0), (3, 30.0),
                                                         (4, 40.0), (5, 50.0)]


def test_no_tensorboard_folder_unless_asked(tmp_path):
    tracker = Tracker(tmp_path / "run", CONFIG_YAML, TrackingConfig(out_dir=str(tmp_path)), "r")
    tracker.log(1, {"loss": 1.0})
    tracker.close()
    assert not (tmp_path / "run" / "tensorboard").exists()
