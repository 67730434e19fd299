"""Partial rollouts (``driver/partial.py``, issue 41): which groups a round finishes, what it
carries into the next under new weights, the version of every token, the groups dropped as too
stale, the checkpointed state; and the config's refusals. The pool is a fake whose responses have
lengths fixed per prompt, so every figure below is counted by hand."""

import pytest
import torch

from hybridflow.config import RLConfig, load_config
from hybridflow.driver.partial import PartialRollouts
from hybridflow.driver.pipeline import staleness
from hybridflow.errors import ConfigError
from tests.unit.test_async_config import TWO_POOLS

# Prompt i's responses stop after LENGTH[i] tokens (a stop token), or run to max_tokens (8).
LENGTH = {0: 2, 1: 6, 2: 2, 3: 20, 4: 4, 5: 2, 6: 2, 7: 2, 8: 2, 9: 2}


class Pool:
    """A fake generation pool at weight ``version``: request i continues its prefix (the prompt
    id, then the tokens so far) with tokens ``10 + position``, log-prob ``-position``."""

    def __init__(self):
        self.version, self.calls = 0, []

    def extend(self, prefixes, budgets):
        self.calls.append(budgets)
        out = []
        for prefix, budget in zip(prefixes, budgets):
            have, length = len(prefix) - 1, LENGTH[prefix[0]]
            k = min(budget, length - have)
            out.append(([10 + have + t for t in range(k)], [-float(have + t) for t in range(k)],
                        have + k == length, self.version))
        return out


def draws():
    prompts = iter(range(10))
    return lambda: [next(prompts), next(prompts)]  # the sampler: two prompts at a time


def test_a_round_ends_with_a_batch_done_and_carries_the_rest_under_new_weights():
    pool, draw = Pool(), draws()
    partial = PartialRollouts(groups=2, n=2, chunk=2, max_tokens=8, bound=3)
    batch, counts = partial.round(0, lambda i: [i], draw, pool.extend)
    # chunk 1: prompts 0 and 1 (2 samples each); 0 is done. chunk 2: 1 and 2 (drawn); 2 done.
    assert [g.prompt for g in batch] == [0, 2]
    assert pool.calls == [[2] * 4, [2] * 4]
    assert counts == {"rollout/dropped": 0.0, "rollout/chunks": 2.0, "rollout/carried": 2.0}
    r = batch[0].responses[1]
    assert (r.ids, r.logprobs, r.versions, r.finish) == ([10, 11], [-0.0, -1.0], [0, 0], "stop")
    assert [g.prompt for g in partial.active] == [1] and partial.pending == [3]
    # New weights: prompt 1 continues from its 4 tokens; 3 starts and runs to max_tokens.
    pool.version = 1
    batch, counts = partial.round(1, lambda i: [i], draw, pool.extend)
    # chunk 1: 1 (tokens 5-6, done) and 3; chunk 2: 3 and 4 (drawn); chunk 3: 3, 4 (done).
    assert [g.prompt for g in batch] == [1, 4]
    one = batch[0].responses[0]
    assert one.ids == [10, 11, 12, 13, 14, 15] and one.versions == [0, 0, 0, 0, 1, 1]
    assert one.logprobs == [-float(t) for t in range(6)] and one.finish == "stop"
    assert counts["rollout/chunks"] == 3.0 and counts["rollout/carried"] == 2.0
    three = partial.active[0].responses[0]
    assert three.versions == [1] * 6 and three.finish is None
    pool.version = 2
    batch, _ = partial.round(2, lambda i: [i], draw, pool.extend)
    # prompt 3 reaches max_tokens (8) in the first chunk: "length", its tokens of 2 versions
    assert batch[0].prompt == 3 and batch[0].responses[0].finish == "length"
    assert batch[0].responses[0].versions == [1] * 6 + [2] * 2


def test_groups_that_would_train_more_than_max_staleness_behind_are_dropped_and_counted():
    pool, draw = Pool(), draws()
    partial = PartialRollouts(groups=2, n=2, chunk=2, max_tokens=8, bound=1)
    partial.round(5, lambda i: [i], draw, pool.extend)  # prompt 1 carried with version-0 tokens
    # trained at 1: prompt 1's oldest tokens 1 behind (kept); at 2, 2 behind: dropped
    assert partial._drop_stale(1) == 0 and [g.prompt for g in partial.active] == [1]
    batch, counts = partial.round(2, lambda i: [i], draw, pool.extend)
    # prompt 1 dropped (one group of n = 2 samples); then 3 and 4, 4 done; 3 and 5, 5 done
    assert counts == {"rollout/dropped": 2.0, "rollout/chunks": 3.0, "rollout/carried": 2.0}
    assert [g.prompt for g in batch] == [4, 5] and [g.prompt for g in partial.active] == [3]


def test_the_state_continues_exactly_after_a_checkpoint():
    def run(resume_after):
        pool, draw = Pool(), draws()
        partial = PartialRollouts(groups=2, n=2, chunk=2, max_tokens=8, bound=3)
        out = []
        for version in range(4):
            if version == resume_after:  # a fresh object from the saved state
                state = partial.state_dict()
                partial = PartialRollouts(groups=2, n=2, chunk=2, max_tokens=8, bound=3)
                partial.load_state_dict(state)
            pool.version = version
            batch, counts = partial.round(version, lambda i: [i], draw, pool.extend)
            out.append(([(g.prompt, [(r.ids, r.versions, r.finish) for r in g.responses])
                         for g in batch], counts))
        return out
    assert run(resume_after=2) == run(resume_after=None)


def test_staleness_counts_tokens():
    versions = torch.tensor([[0, 0, 0, 1], [0, 1, 1, 9]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])
    out = staleness(versions, mask, trainer=2, bound=2)
    assert out["rollout/staleness_max"] == 2.0
    assert out["rollout/staleness_mean"] == pytest.approx(7 / 5)
    assert out["rollout/staleness_2_frac"] == pytest.approx(2 / 5)
    assert out["rollout/staleness_1_frac"] == pytest.approx(3 / 5)
    assert out["rollout/staleness_0_frac"] == 0.0
    assert out["rollout/weight_version"] == pytest.approx(3 / 5)


def config(*overrides):
    return load_config(RLConfig, None, ["model=tiny-llama", "rollout.sampling.max_tokens=8",
                                        *TWO_POOLS, *overrides])


ASYNC = ["rollout.mode=async", "rollout.max_staleness=2"]


@pytest.mark.parametrize("overrides,key,message", [
    (["rollout.mode=one_step_off", "rollout.partial=true"], "rollout.partial", "max_staleness >= 2"),
    (["rollout.mode=async", "rollout.max_staleness=1", "rollout.partial=true"],
     "rollout.partial", "max_staleness >= 2"),
    ([*ASYNC, "rollout.partial=true", "rollout.partial_tokens=8"], "rollout.partial_tokens",
     "make it smaller"),
    ([*ASYNC, "rollout.partial_tokens=2"], "rollout.partial_tokens", "rollout.partial=true"),
])
def test_partial_rollouts_refused_where_they_cannot_act(overrides, key, message):
    with pytest.raises(ConfigError) as e:
        config(*overrides)
    assert e.value.field == key and message in str(e.value)


def test_partial_rollouts_run_one_batch_ahead_in_chunks():
    r = config("rollout.mode=async", "rollout.max_staleness=3", "rollout.partial=true").rollout
    assert (r.ahead, r.staleness, r.chunk_tokens) == (1, 3, 2)
    assert config("rollout.mode=async", "rollout.max_staleness=3").rollout.ahead == 3
