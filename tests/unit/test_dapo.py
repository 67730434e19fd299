"""DAPO's reward-side pieces against hand-computed numbers, and their config keys."""

import pytest
import torch

from hybridflow.algorithms import group_rewards_differ, overlong_penalty
from hybridflow.config import RLConfig, make_config
from hybridflow.errors import ArgumentError, ConfigError


def test_overlong_penalty_by_hand():
    # Lmax 24, buffer 8: free up to 16 tokens, then (16 - |y|) / 8 * penalty down to -penalty.
    lengths = torch.tensor([3, 16, 17, 20, 24])
    torch.testing.assert_close(overlong_penalty(lengths, 24, 8),
                               torch.tensor([0.0, 0.0, -0.125, -0.5, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths.float(), 24, 8, penalty=0.5),
                               torch.tensor([0.0, 0.0, -0.0625, -0.25, -0.5]))
    with pytest.raises(ArgumentError, match="buffer"):
        overlong_penalty(lengths, 24, 24)


def test_groups_with_equal_rewards_are_found():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0])
    ids, differ = group_rewards_differ(scores, [3, 3, 0, 0, 7, 7, 1, 1])
    assert ids == [3, 0, 7, 1]
    assert differ.tolist() == [False, True, False, False]
    # Interleaved samples of a group count together.
    assert group_rewards_differ(torch.tensor([1.0, 2.0, 1.0, 1.0]), [0, 1, 1, 0])[1].tolist() \
        == [False, True]


def _config(**overrides):
    return make_config(RLConfig, None, overrides)


@pytest.mark.parametrize("overrides, field, message", [
    ({"algorithm.overlong_buffer": 64}, "algorithm.overlong_buffer", "below"),
    ({"algorithm.overlong_buffer": -1}, "algorithm.overlong_buffer", "non-negative"),
    ({"algorithm.overlong_buffer": 8, "algorithm.overlong_penalty": 0.0},
     "algorithm.overlong_penalty", "finite number"),
    ({"algorithm.overlong_penalty": 0.5}, "algorithm.overlong_penalty", "overlong_buffer > 0"),
    ({"algorithm.dynamic_sampling": True, "algorithm.name": "ppo"},
     "algorithm.dynamic_sampling", "grpo and rloo"),
    ({"algorithm.dynamic_sampling": True, "algorithm.max_sampling_rounds": 0},
     "algorithm.max_sampling_rounds", "positive"),
    ({"algorithm.max_sampling_rounds": 5}, "algorithm.max_sampling_rounds",
     "dynamic_sampling=true"),
    ({"algorithm.dynamic_sampling": True, "rollout.sampling.n": 1}, "rollout.sampling.n",
     "n >= 2"),
])
def test_dapo_options_are_checked(overrides, field, message):
    with pytest.raises(ConfigError, match=message) as e:
        _config(**overrides)
    assert e.value.field == field


def test_dapo_options_off_by_default_and_accepted_on():
    a = _config().algorithm
    assert (a.overlong_buffer, a.dynamic_sampling) == (0, False)
    a = _config(**{"algorithm.overlong_buffer": 8, "algorithm.overlong_penalty": 0.5,
                   "algorithm.dynamic_sampling": True, "algorithm.name": "rloo",
                   "algorithm.max_sampling_rounds": 5}).algorithm
    assert (a.overlong_buffer, a.overlong_penalty, a.max_sampling_rounds) == (8, 0.5, 5)
