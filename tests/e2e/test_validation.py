"""Validation on held-out prompts (``validation: {every, size}``), end to end on Ray with a tiny
model: the held-out prompts are never trained on, each validation scores exactly them once with a
greedy response, ``val/reward`` is their mean score, it is logged before step 1, every N steps
and at the last step, and a run resumed from a checkpoint logs what the uninterrupted run did."""

import pytest

from hybridflow.config import RLConfig, load_config
from hybridflow.errors import ConfigError
from hybridflow.tracking import CLOCK_KEYS, read_metrics
from hybridflow.trainer import RLTrainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cache")]

PROMPTS = [{"prompt": f"question {i}: say {w}"} for i, w in
           enumerate(("yes", "no", "red", "blue", "one", "two", "cat", "dog"))]

CALLS: list[tuple[str, str]] = []
"""(prompt text, response) of every reward call, in order: scoring runs in the driver."""


def recording_reward(item, response: str) -> float:
    CALLS.append((item.messages[-1]["content"], response))
    return len(response) / 10.0


def config(tmp_path, *overrides):
    return load_config(RLConfig, None, [
        "model=tiny-llama", "rollout.backend=megatron", "rollout.sampling.max_tokens=6",
        "rollout.sampling.n=2", "train_batch_size=2", "actor.engine.micro_batch_size=1",
        "actor.engine.optim.lr=1e-3", "data.max_prompt_tokens=32", "ray.num_cpus=2",
        "validation.every=2", "validation.size=2", "checkpoint.every=1",
        f"tracking.out_dir={tmp_path}", *overrides])


def fit(cfg):
    trainer = RLTrainer(cfg, reward_fn=recording_reward)
    try:
        return trainer.train(PROMPTS)
    finally:
        trainer.close()


def strip_timing(rows):
    return [{k: v for k, v in r.items() if not k.startswith(CLOCK_KEYS)} for r in rows]


def test_validation_held_out_and_resume(tmp_path):
    CALLS.clear()
    fit(config(tmp_path, "name=whole", "steps=3"))
    rows = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    # Step 0 is validation alone (before any update); steps 2 (every=2) and 3 (the last) have it.
    assert set(rows[0]) == {"step", "val/reward", "val/response_length", "timing/validation_s"}
    assert [("val/reward" in r) for r in rows] == [True, False, True, True]

    # Calls: 2 validation (step 0), then per step 4 training samples (2 prompts x n=2), and 2
    # validation after steps 2 and 3.
    assert len(CALLS) == 2 + 4 + 4 + 2 + 4 + 2
    val_calls = [CALLS[0:2], CALLS[10:12], CALLS[16:18]]
    train_calls = CALLS[2:10] + CALLS[12:16]
    held_out = {p for p, _ in val_calls[0]}
    assert len(held_out) == 2
    for calls, row in zip(val_calls, (rows[0], rows[2], rows[3])):
        assert {p for p, _ in calls} == held_out  # each held-out prompt once: n=1
        expected = sum(len(r) / 10.0 for _, r in calls) / len(calls)
        assert row["val/reward"] == pytest.approx(expected)
    # 3 steps x 2 prompts are one epoch of the 6 training prompts: every prompt but the held-out.
    trained = {p for p, _ in train_calls}
    assert trained == {p["prompt"] for p in PROMPTS} - held_out

    # Resumed: 2 steps, then the same command with steps=3 continues from checkpoint 2.
    fit(config(tmp_path, "name=resumed", "steps=2"))
    fit(config(tmp_path, "name=resumed", "steps=3"))
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert strip_timing(resumed) == strip_timing(rows)


def test_validation_config_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        config(tmp_path, "validation.size=0")
    assert e.value.field == "validation.size"
    trainer = RLTrainer(config(tmp_path, "validation.size=7", "steps=1"),
                        reward_fn=recording_reward)
    try:
        with pytest.raises(ConfigError) as e:
            trainer.train(PROMPTS)
        assert e.value.field == "validation.size" and "fewer than train_batch_size" in e.value.message
    finally:
        trainer.close()
