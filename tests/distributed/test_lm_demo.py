"""The training demo end to end through the CLI: 4 gloo processes at TP=2 x DP=2, metrics.jsonl
with one row per step, and a loss that falls."""

from hybridflow.cli import main
from hybridflow.tracking import read_metrics


def test_lm_demo_trains_and_writes_metrics(tmp_path):
    rc = main(["lm-demo", "name=t", "steps=20", "layout.tp=2", "layout.pp=1", "layout.dp=2",
               "engine.micro_batch_size=2", f"tracking.out_dir={tmp_path}"])
    assert rc == 0
    rows = read_metrics(tmp_path / "t" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert "copy_accuracy" in rows[-1] and (tmp_path / "t" / "config.yaml").exists()
