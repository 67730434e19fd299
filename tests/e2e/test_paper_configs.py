"""A paper config trains: experiments/paper/remax/llama2_13b.yaml (its workload keys: synthetic
prompts, ignore_eos, bf16, the reward model, the megatron rollout) with tiny models and a tiny
batch in place of Llama-2 and the cluster, one step of ``hybridflow train``."""

import json
import math
from pathlib import Path

import pytest

from hybridflow.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cache")]

CONFIG = Path(__file__).resolve().parents[2] / "experiments" / "paper" / "remax" / "llama2_13b.yaml"
TINY = ["model=tiny-llama", "reward_model=tiny-llama", "cluster.nodes=null",
        "actor.layout={tp: 2, pp: 1, dp: 1}", "critic.layout={tp: 1, pp: 1, dp: 1}",
        "rollout.tp=1", "ray.gpus_per_worker=0", "ray.num_cpus=2", "data.size=8",
        "data.max_prompt_tokens=12", "rollout.sampling.max_tokens=6", "train_batch_size=4",
        "actor.mini_batches=2", "actor.engine.optim.lr=1e-4", "steps=1"]


def test_remax_paper_config_trains_on_synthetic_prompts(tmp_path, capsys):
    assert main(["train", str(CONFIG), *TINY, f"tracking.out_dir={tmp_path}"]) == 0, \
        capsys.readouterr().err
    run = tmp_path / "paper-remax-llama2-13b"
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # ignore_eos: every response runs to max_tokens, whatever the random model samples.
    assert row["response_length/mean"] == 6 and row["response_length/clip_frac"] == 1
    assert row["reward/std"] > 0  # the reward model's scores, not a constant
    for key in ("actor/grad_norm", "actor/pg_loss", "kl"):
        assert math.isfinite(row[key]), key
    saved = (run / "config.yaml").read_text()
    assert "source: synthetic" in saved and "defaults" not in saved
