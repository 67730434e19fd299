"""Generation ahead of training on a pool of its own (issue 41), end to end on CPU: the actor
(Megatron) on one single-rank pool, vLLM on the other, tiny-llama.

In one_step_off and in async with max_staleness 2, each step's batch was generated with the
weights of the update the schedule says (``rollout/weight_version``, the staleness exact), the
weights pushed and verified after every update; and a run killed with SIGKILL after its step-2
checkpoint (during step 3, while the next batch is generated) and started again with the same
command logs the same metrics, row for row (timings aside), as the uninterrupted run: the
checkpoint holds the batches in flight."""

import pytest

from tests.e2e.test_resume import RUN_FILES, Attempt, make_setup, metrics

pytestmark = [pytest.mark.slow]

CONFIG = """\
model: tiny-llama
reward: {tmp}/rewards.py:length
train_batch_size: 2
steps: 5
actor:
  engine: {{micro_batch_size: 1, optim: {{lr: 1.0e-3}}}}
rollout:
  backend: vllm
  sampling: {{n: 2, max_tokens: 6}}
placement:
  pools: {{train: {{devices_per_node: 1}}, gen: {{devices_per_node: 1}}}}
  models: {{actor: train, reference: train, rollout: gen}}
validation: {{every: 2, size: 2}}
""" + RUN_FILES

# Reward calls before step 3's first: 2 validation prompts before step 1, 4 samples a step, 2
# after step 2.
STEP_3 = 2 + 4 + 4 + 2 + 1


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_setup(tmp_path_factory, "async", CONFIG)


@pytest.mark.parametrize("mode,ahead", [("one_step_off", 1), ("async", 2)])
def test_generation_ahead_resumes_exactly(setup, mode, ahead):
    args = [f"rollout.mode={mode}"] + (["rollout.max_staleness=2"] if mode == "async" else [])
    reference = Attempt(setup, mode, *args)
    assert reference.finish() == 0, reference.output()
    expected = metrics(reference.run_dir)
    steps = [r for r in expected if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in expected if "val/reward" in r] == [0, 2, 4, 5]
    for r in steps:
        k = r["step"]
        # batch k: generated with the weights of update max(0, k-1-K), trained after k-1
        assert r["rollout/weight_version"] == max(0, k - 1 - ahead), r
        assert r["rollout/staleness_mean"] == r["rollout/staleness_max"] == min(k - 1, ahead)
        assert r[f"rollout/staleness_{min(k - 1, ahead)}_frac"] == 1.0
        assert r["rollout/dropped"] == 0
        assert r["weight_sync/bytes"] > 0
    # The first batch was generated with the trainer's own weights: the sampler's log-probs are
    # the trainer's. The second with weights one update older than the trainer's.
    assert steps[0]["mismatch/abs_diff_max"] < 1e-4
    assert steps[1]["mismatch/abs_diff_mean"] > 1e-3
    # Killed during step 3, once step 2's checkpoint is complete; the same command again.
    name = f"{mode}_interrupted"
    first = Attempt(setup, name, *args, KILL_AT_CALL=str(STEP_3))
    assert first.finish() == -9, first.output()
    assert sorted(p.name for p in (first.run_dir / "checkpoints").iterdir()) == ["step_000002"]
    last = Attempt(setup, name, *args)
    assert last.finish() == 0, last.output()
    assert "resuming from" in last.output()
    assert metrics(last.run_dir) == expected


# Responses of uneven lengths: a random tiny-llama stops at any of 64 of its 512 tokens.
PARTIAL = ["rollout.mode=async", "rollout.max_staleness=2", "rollout.partial=true",
           "rollout.partial_tokens=2",
           "rollout.sampling.stop_token_ids=[" + ",".join(map(str, range(0, 512, 8))) + "]"]


def test_partial_rollouts_continue_under_new_weights_and_resume_exactly(setup):
    reference = Attempt(setup, "partial", *PARTIAL)
    assert reference.finish() == 0, reference.output()
    expected = metrics(reference.run_dir)
    steps = [r for r in expected if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    for r in steps:
        assert r["rollout/staleness_max"] <= 2 and r["rollout/chunks"] >= 1, r
    # Batch 1 is the initial weights', trained by them: its log-probs, those of responses
    # continued chunk after chunk included, are the trainer's.
    assert steps[0]["rollout/staleness_max"] == 0
    assert steps[0]["mismatch/stale0/abs_diff_max"] < 1e-4
    # Responses carried into the next round, and batches holding tokens of two versions
    assert any(r["rollout/carried"] > 0 for r in steps)
    mixed = [r for r in steps if 0 < r["rollout/staleness_2_frac"] < 1]
    assert mixed and all("mismatch/stale2/abs_diff_mean" in r for r in mixed)
    name = "partial_interrupted"
    first = Attempt(setup, name, *PARTIAL, KILL_AT_CALL=str(STEP_3))
    assert first.finish() == -9, first.output()
    last = Attempt(setup, name, *PARTIAL)
    assert last.finish() == 0, last.output()
    assert "resuming from" in last.output()
    assert metrics(last.run_dir) == expected
