"""RL maths against numbers worked out by hand in the comments, never against the same formula."""

import math

import pytest
import torch
from torch.testing import assert_close

from hybridflow.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdaptiveKLController,
    AdvantageInputs,
    FixedKLController,
    LagrangeMultiplier,
    aggregate_loss,
    apply_kl_reward_penalty,
    compute_gae,
    compute_grpo_advantage,
    compute_reinforce_pp_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
    compute_safe_rlhf_advantage,
    entropy_from_logits,
    entropy_loss,
    estimate_advantages,
    kl_penalty,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    safe_rlhf_token_rewards,
    value_loss,
)
from hybridflow.errors import ArgumentError

T = torch.tensor


# ---------------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------------


def test_masked_mean_ignores_masked_entries_even_inf():
    x = T([[1.0, 2.0, float("inf")], [4.0, float("nan"), 0.0]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    # valid: 1, 2, 4 -> 7 / 3
    assert_close(masked_mean(x, mask), T(7 / 3))
    # rows: (1 + 2) / 2 = 1.5 ; 4 / 1 = 4
    assert_close(masked_mean(x, mask, dim=-1), T([1.5, 4.0]))
    # an all-masked slice gives 0, not NaN
    assert_close(masked_mean(x, T([[0, 0, 0], [1, 0, 0]]), dim=-1), T([0.0, 4.0]))


def test_masked_var():
    x = T([[1.0, 2.0, 100.0], [4.0, -7.0, 0.0]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    # valid 1, 2, 4; mean 7/3; deviations -4/3, -1/3, 5/3; squares 16/9 + 1/9 + 25/9 = 42/9
    assert_close(masked_var(x, mask), T(42 / 9 / 2))  # unbiased: / (3 - 1) = 7/3
    assert_close(masked_var(x, mask, unbiased=False), T(42 / 9 / 3))  # biased: / 3 = 14/9
    # a single valid entry has no spread
    assert_close(masked_var(x, T([[1, 0, 0], [0, 0, 0]])), T(0.0))


def test_masked_whiten():
    x = T([[1.0, 3.0, 50.0]])
    mask = T([[1, 1, 0]])
    # valid 1, 3: mean 2, unbiased var ((-1)^2 + 1^2) / 1 = 2, std sqrt(2); masked entry -> 0
    s = 1 / math.sqrt(2)
    assert_close(masked_whiten(x, mask), T([[-s, s, 0.0]]))
    assert_close(masked_whiten(x, mask, shift_mean=False), T([[2 - s, 2 + s, 0.0]]))


# ---------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------

# 1 x 3 episode, gamma = 0.9, lam = 0.8 (so gamma * lam = 0.72), V after the last token = 0:
#   t=2: delta = 1 + 0.9 * 0   - 0.3 =  0.7                        A2 = 0.7
#   t=1: delta = 0 + 0.9 * 0.3 - 0.4 = -0.13   A1 = -0.13 + 0.72 * 0.7   =  0.374
#   t=0: delta = 0 + 0.9 * 0.4 - 0.5 = -0.14   A0 = -0.14 + 0.72 * 0.374 =  0.12928
# returns = A + V = 0.62928, 0.774, 1.0
GAE_REWARDS = [0.0, 0.0, 1.0]
GAE_VALUES = [0.5, 0.4, 0.3]
GAE_ADV = [0.12928, 0.374, 0.7]
GAE_RET = [0.62928, 0.774, 1.0]


def test_gae_hand_computed():
    adv, ret = compute_gae(T([GAE_REWARDS]), T([GAE_VALUES]), torch.ones(1, 3), gamma=0.9, lam=0.8)
    assert_close(adv, T([GAE_ADV]))
    assert_close(ret, T([GAE_RET]))


def test_gae_batch_rows_are_independent():
    # Row 1 has a single valid token: A = r - V = 2 - 1 = 1, return = 2. Its padding holds values
    # that would leak into the bootstrap if padding were treated as the next state.
    rewards = T([GAE_REWARDS, [2.0, 5.0, 5.0]])
    values = T([GAE_VALUES, [1.0, 9.0, 9.0]])
    mask = T([[1, 1, 1], [1, 0, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert_close(adv, T([GAE_ADV, [1.0, 0.0, 0.0]]))
    assert_close(ret, T([GAE_RET, [2.0, 0.0, 0.0]]))


def test_gae_masked_tokens_are_skipped():
    # The same episode with a masked token spliced in at t=1 and right padding at t=4: whatever
    # the masked positions hold (even NaN / inf), the valid tokens get the 1x3 numbers above.
    mask = T([[1, 0, 1, 1, 0]])
    for junk_r, junk_v in ((0.0, 0.0), (7.0, -3.0), (float("nan"), float("inf"))):
        rewards = T([[0.0, junk_r, 0.0, 1.0, junk_r]])
        values = T([[0.5, junk_v, 0.4, 0.3, junk_v]])
        adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
        assert_close(adv, T([[GAE_ADV[0], 0.0, GAE_ADV[1], GAE_ADV[2], 0.0]]))
        assert_close(ret, T([[GAE_RET[0], 0.0, GAE_RET[1], GAE_RET[2], 0.0]]))


def test_gae_rejects_bad_gamma():
    with pytest.raises(ArgumentError, match="gamma"):
        compute_gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), gamma=1.5, lam=0.9)
    with pytest.raises(ArgumentError, match="lam"):
        compute_gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), gamma=1.0, lam=-0.1)


# ---------------------------------------------------------------------------------------------
# Outcome-reward estimators
# ---------------------------------------------------------------------------------------------

# Groups, interleaved on purpose: g0 = samples 0, 2, 5 (scores 1, 0, 2); g1 = samples 1, 4
# (scores 5, 3); g2 = sample 3 alone (score 9).
GROUP_SCORES = [1.0, 5.0, 0.0, 9.0, 3.0, 2.0]
GROUP_IDS = [0, 1, 0, 2, 1, 0]


def test_grpo_hand_computed():
    # g0: mean 1, deviations 0, -1, 1, unbiased var (0 + 1 + 1) / 2 = 1, std 1 -> 0, -1, 1
    # g1: mean 4, deviations 1, -1, unbiased var 2 / 1 = 2, std sqrt 2 -> 1/sqrt2, -1/sqrt2
    # g2: a group of one -> 0
    s = 1 / math.sqrt(2)
    expected = T([0.0, s, -1.0, 0.0, -s, 1.0])
    mask = torch.ones(6, 2)
    adv = compute_grpo_advantage(T(GROUP_SCORES), mask, T(GROUP_IDS))
    assert_close(adv, expected[:, None].expand(6, 2), atol=1e-5, rtol=1e-5)  # eps=1e-6 in the std
    # string uids group the same way
    adv = compute_grpo_advantage(T(GROUP_SCORES), mask, ["a", "b", "a", "c", "b", "a"])
    assert_close(adv, expected[:, None].expand(6, 2), atol=1e-5, rtol=1e-5)


def test_grpo_dr_grpo_only_centers():
    # g0 minus mean 1: 0, -1, 1; g1 minus mean 4: 1, -1; g2 alone: 0
    adv = compute_grpo_advantage(T(GROUP_SCORES), torch.ones(6, 1), GROUP_IDS, norm_by_std=False)
    assert_close(adv, T([[0.0], [1.0], [-1.0], [0.0], [-1.0], [1.0]]))


def test_grpo_group_of_one_is_zero_and_mask_broadcast():
    adv = compute_grpo_advantage(T([3.0, 1.0, 2.0]), T([[1, 1, 0], [1, 0, 0], [1, 1, 1]]), [0, 1, 1])
    # sample 0 alone -> 0; samples 1, 2: mean 1.5, std sqrt(0.5) -> -0.5/sqrt(0.5) = -sqrt(0.5), +sqrt(0.5)
    r = math.sqrt(0.5)
    assert_close(adv, T([[0.0, 0.0, 0.0], [-r, 0.0, 0.0], [r, r, r]]), atol=1e-5, rtol=1e-5)


def test_rloo_hand_computed():
    # g0: 1 - (0 + 2)/2 = 0 ; 0 - (1 + 2)/2 = -1.5 ; 2 - (1 + 0)/2 = 1.5
    # g1: 5 - 3 = 2 ; 3 - 5 = -2 ; g2 alone: 0
    mask = T([[1, 1]] * 5 + [[1, 0]])
    adv = compute_rloo_advantage(T(GROUP_SCORES), mask, T(GROUP_IDS))
    expected = T([0.0, 2.0, -1.5, 0.0, -2.0, 1.5])[:, None] * mask
    assert_close(adv, expected)


def test_remax_hand_computed():
    # 1.0 - 0.5 = 0.5 ; 0.2 - 0.7 = -0.5
    adv = compute_remax_advantage(T([1.0, 0.2]), T([0.5, 0.7]), T([[1, 1, 1], [1, 1, 0]]))
    assert_close(adv, T([[0.5, 0.5, 0.5], [-0.5, -0.5, 0.0]]))


def test_reinforce_pp_gamma_one():
    # returns-to-go: row 0 [0, 0, 1] -> 1, 1, 1 ; row 1 [0, 2 | pad] -> 2, 2
    # valid 1, 1, 1, 2, 2: mean 1.4; deviations -0.4 (x3), 0.6 (x2)
    # unbiased var = (3 * 0.16 + 2 * 0.36) / 4 = 1.2 / 4 = 0.3
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 123.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    lo, hi = -0.4 / math.sqrt(0.3), 0.6 / math.sqrt(0.3)
    assert_close(compute_reinforce_pp_advantage(rewards, mask), T([[lo, lo, lo], [hi, hi, 0.0]]))


def test_reinforce_pp_discount():
    # gamma 0.5 on [0, 0, 1]: G = 1/4, 1/2, 1; mean 7/12; deviations -4/12, -1/12, 5/12
    # unbiased var = (16 + 1 + 25) / 144 / 2 = 7/48; dividing by sqrt(7/48) -> -4, -1, 5 over sqrt(21)
    adv = compute_reinforce_pp_advantage(T([[0.0, 0.0, 1.0]]), torch.ones(1, 3), gamma=0.5)
    assert_close(adv, T([[-4.0, -1.0, 5.0]]) / math.sqrt(21))


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


def test_registry_uniform_call():
    assert set(ADVANTAGE_ESTIMATORS) == {"gae", "grpo", "remax", "rloo", "reinforce_plus_plus",
                                         "safe_rlhf"}
    inputs = AdvantageInputs(mask=torch.ones(1, 3), token_rewards=T([GAE_REWARDS]), values=T([GAE_VALUES]),
                             gamma=0.9, lam=0.8)
    adv, targets = ADVANTAGE_ESTIMATORS["gae"](inputs)
    assert_close(adv, T([GAE_ADV]))
    assert_close(targets["returns"], T([GAE_RET]))
    # safe_rlhf with the same stream for reward and cost and lambda 1: (A - A) / 2 = 0, and GAE's
    # returns as each critic's target
    inputs.token_costs, inputs.cost_values = inputs.token_rewards, inputs.values
    inputs.lagrange = 1.0
    adv, targets = ADVANTAGE_ESTIMATORS["safe_rlhf"](inputs)
    assert_close(adv, torch.zeros(1, 3))
    assert_close(targets["returns"], T([GAE_RET]))
    assert_close(targets["cost_returns"], T([GAE_RET]))

    inputs = AdvantageInputs(mask=torch.ones(6, 1), scores=T(GROUP_SCORES), group_ids=GROUP_IDS,
                             baseline_scores=torch.ones(6), norm_by_std=False)
    adv, targets = ADVANTAGE_ESTIMATORS["grpo"](inputs)
    assert targets == {}
    assert_close(adv[:, 0], T([0.0, 1.0, -1.0, 0.0, -1.0, 1.0]))  # Dr. GRPO numbers above
    adv, _ = ADVANTAGE_ESTIMATORS["rloo"](inputs)
    assert_close(adv[:, 0], T([0.0, 2.0, -1.5, 0.0, -2.0, 1.5]))  # RLOO numbers above
    adv, _ = ADVANTAGE_ESTIMATORS["remax"](inputs)
    assert_close(adv[:, 0], T([0.0, 4.0, -1.0, 8.0, 2.0, 1.0]))  # score - 1

    inputs = AdvantageInputs(mask=torch.ones(1, 3), token_rewards=T([[0.0, 0.0, 1.0]]), gamma=0.5)
    adv, _ = ADVANTAGE_ESTIMATORS["reinforce_plus_plus"](inputs)
    assert_close(adv, T([[-4.0, -1.0, 5.0]]) / math.sqrt(21))  # discount test above


def test_registry_names_missing_input():
    with pytest.raises(ArgumentError, match="values"):
        ADVANTAGE_ESTIMATORS["gae"](AdvantageInputs(mask=torch.ones(1, 3), token_rewards=torch.zeros(1, 3)))
    with pytest.raises(ArgumentError, match="group_ids"):
        ADVANTAGE_ESTIMATORS["rloo"](AdvantageInputs(mask=torch.ones(2, 3), scores=torch.zeros(2)))
    with pytest.raises(ArgumentError, match="cost_values"):
        ADVANTAGE_ESTIMATORS["safe_rlhf"](AdvantageInputs(
            mask=torch.ones(1, 3), token_rewards=torch.zeros(1, 3), token_costs=torch.zeros(1, 3),
            values=torch.zeros(1, 3), lagrange=1.0))
    with pytest.raises(ArgumentError, match="gamma"):
        AdvantageInputs(mask=torch.ones(1, 1), gamma=2.0)


# ---------------------------------------------------------------------------------------------
# Loss aggregation
# ---------------------------------------------------------------------------------------------


def test_aggregate_modes_differ_on_ragged_masks():
    # row 0: 1, 2, 3 all valid; row 1: only 4 valid; row 2: nothing valid (left out entirely)
    loss_mat = T([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0], [7.0, 7.0, 7.0]])
    mask = T([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert_close(aggregate_loss(loss_mat, mask, "token-mean"), T(2.5))  # (1+2+3+4) / 4
    assert_close(aggregate_loss(loss_mat, mask, "seq-mean-token-sum"), T(5.0))  # (6 + 4) / 2
    assert_close(aggregate_loss(loss_mat, mask, "seq-mean-token-mean"), T(3.0))  # (2 + 4) / 2
    with pytest.raises(ArgumentError, match="mode"):
        aggregate_loss(loss_mat, mask, "token-sum")


# ---------------------------------------------------------------------------------------------
# Policy loss
# ---------------------------------------------------------------------------------------------


def _logprobs_for_ratios(ratios):
    """(logprobs with grad, old_logprobs) whose ratio exp(logprobs - old) is ``ratios``."""
    old = torch.full((1, len(ratios)), -1.0)
    new = (old + torch.log(T([ratios]))).requires_grad_(True)
    return new, old


def test_policy_loss_clip_hand_computed():
    # clip 0.2 -> ratio clipped to [0.8, 1.2]; per token max(-A r, -A clip(r)):
    #   A= 1, r=1.5: max(-1.5, -1.2) = -1.2  (clip binds)
    #   A= 1, r=0.5: max(-0.5, -0.8) = -0.5
    #   A=-1, r=1.5: max( 1.5,  1.2) =  1.5
    #   A=-1, r=0.5: max( 0.5,  0.8) =  0.8  (clip binds)
    # token-mean = (-1.2 - 0.5 + 1.5 + 0.8) / 4 = 0.15 ; clip_frac = 2/4
    # approx_kl = mean(old - new) = -(2 ln 1.5 + 2 ln 0.5) / 4 = -0.5 ln 0.75
    new, old = _logprobs_for_ratios([1.5, 0.5, 1.5, 0.5])
    adv = T([[1.0, 1.0, -1.0, -1.0]])
    loss, m = policy_loss(new, old, adv, torch.ones(1, 4))
    assert_close(loss, T(0.15))
    assert_close(m["clip_frac"], T(0.5))
    assert_close(m["approx_kl"], T(-0.5 * math.log(0.75)))
    assert_close(m["dual_clip_frac"], T(0.0))
    # d/dlogp of -A r is -A r where unclipped, 0 where clipped; / 4 tokens:
    loss.backward()
    assert_close(new.grad, T([[0.0, -0.5, 1.5, 0.0]]) / 4)


def test_policy_loss_ratio_inside_clip_range():
    # ratios 1.0, 1.1, 0.9 are all within [0.8, 1.2], so clipping changes nothing:
    # -A r = -1 * 1.0, 2 * 1.1, -0.5 * 0.9 -> (-1 + 2.2 - 0.45) / 3 = 0.25, clip_frac 0
    new, old = _logprobs_for_ratios([1.0, 1.1, 0.9])
    loss, m = policy_loss(new, old, T([[1.0, -2.0, 0.5]]), torch.ones(1, 3), dual_clip_c=3.0)
    assert_close(loss, T(0.25))
    assert_close(m["clip_frac"], T(0.0))
    assert_close(m["dual_clip_frac"], T(0.0))


def test_policy_loss_clip_higher():
    # clip_ratio_high 0.28: A=1, r=1.5 -> max(-1.5, -1.28) = -1.28; A=-1, r=0.5 still clipped at 0.8
    new, old = _logprobs_for_ratios([1.5, 0.5])
    loss, _ = policy_loss(new, old, T([[1.0, -1.0]]), torch.ones(1, 2), clip_ratio_high=0.28)
    assert_close(loss, T((-1.28 + 0.8) / 2))


def test_policy_loss_dual_clip_binds():
    # c = 3, so tokens with A < 0 lose at most -3 A = 3:
    #   A=-1, r=5: max(5, 1.2) = 5 -> min(5, 3) = 3   (dual clip binds)
    #   A=-1, r=2: max(2, 1.2) = 2 -> min(2, 3) = 2
    #   A= 1, r=5: max(-5, -1.2) = -1.2               (ordinary clip binds)
    # with dual clip: (3 + 2 - 1.2) / 3 = 3.8 / 3 ; without: (5 + 2 - 1.2) / 3 = 5.8 / 3
    adv = T([[-1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    new, old = _logprobs_for_ratios([5.0, 2.0, 5.0])
    loss, m = policy_loss(new, old, adv, mask, dual_clip_c=3.0)
    assert_close(loss, T(3.8 / 3))
    assert_close(m["dual_clip_frac"], T(1 / 3))
    assert_close(m["clip_frac"], T(1 / 3))
    # gradient only through the unclipped token: d(-A r)/dlogp = -A r = 2, / 3 tokens
    loss.backward()
    assert_close(new.grad, T([[0.0, 2.0 / 3, 0.0]]))

    loss, m = policy_loss(*_logprobs_for_ratios([5.0, 2.0, 5.0]), adv, mask)
    assert_close(loss, T(5.8 / 3))
    assert_close(m["dual_clip_frac"], T(0.0))


def test_policy_loss_exploded_ratio_stays_finite():
    # log ratio 100 overflows exp in float32. A = -1 with dual clip c = 3: the loss is the bound
    # -c A = 3 and, since the bound does not depend on the policy, the gradient is exactly 0.
    old = torch.zeros(1, 1)
    new = torch.full((1, 1), 100.0, requires_grad=True)
    loss, _ = policy_loss(new, old, T([[-1.0]]), torch.ones(1, 1), dual_clip_c=3.0)
    assert_close(loss, T(3.0))
    loss.backward()
    assert_close(new.grad, T([[0.0]]))


def test_policy_loss_ignores_masked_tokens():
    # The 4-token example above plus a padded 5th token holding garbage: logprobs and old both
    # -inf (their difference is NaN) and a NaN advantage. Loss and gradient are unchanged.
    new, old = _logprobs_for_ratios([1.5, 0.5, 1.5, 0.5, 0.0])  # ratio 0 -> new = -inf
    mask = T([[1, 1, 1, 1, 0]])
    old = old.clone()
    old[0, 4] = float("-inf")
    adv = T([[1.0, 1.0, -1.0, -1.0, float("nan")]])
    loss, m = policy_loss(new, old, adv, mask, dual_clip_c=3.0)
    assert_close(loss, T(0.15))
    assert_close(m["clip_frac"], T(0.5))
    loss.backward()
    assert_close(new.grad, T([[0.0, -0.5, 1.5, 0.0, 0.0]]) / 4)


def test_policy_loss_agg_is_passed_through():
    # per-token losses -1.2, -0.5 (row 0) and 1.5 (row 1, one token):
    # seq-mean-token-mean = ((-1.2 - 0.5) / 2 + 1.5) / 2 = 0.325 ; token-mean = -0.2 / 3
    old = torch.full((2, 2), -1.0)
    new = old + torch.log(T([[1.5, 0.5], [1.5, 1.0]]))
    adv = T([[1.0, 1.0], [-1.0, 0.0]])
    mask = T([[1, 1], [1, 0]])
    assert_close(policy_loss(new, old, adv, mask, agg="seq-mean-token-mean")[0], T(0.325))
    assert_close(policy_loss(new, old, adv, mask)[0], T(-0.2 / 3))


def test_policy_loss_rejects_bad_clip():
    x = torch.zeros(1, 2)
    with pytest.raises(ArgumentError, match="clip_ratio_low"):
        policy_loss(x, x, x, torch.ones(1, 2), clip_ratio_low=1.0)
    with pytest.raises(ArgumentError, match="dual_clip_c"):
        policy_loss(x, x, x, torch.ones(1, 2), dual_clip_c=0.5)


# ---------------------------------------------------------------------------------------------
# Value loss and entropy
# ---------------------------------------------------------------------------------------------


def test_value_loss_hand_computed():
    # old values 0, new values 1, clip 0.2 -> clipped values 0.2
    #   return 0.5: unclipped (1 - 0.5)^2 = 0.25, clipped (0.2 - 0.5)^2 = 0.09 -> 0.25
    #   return 2.0: unclipped (1 - 2)^2   = 1,    clipped (0.2 - 2)^2   = 3.24 -> 3.24 (clip binds)
    # 0.5 * (0.25 + 3.24) / 2 = 0.8725 ; vf_clip_frac 1/2
    # padded 3rd token holds NaN in every input and changes nothing
    nan = float("nan")
    values = T([[1.0, 1.0, 0.0]], requires_grad=True)
    old_values = T([[0.0, 0.0, nan]])
    returns = T([[0.5, 2.0, nan]])
    mask = T([[1, 1, 0]])
    loss, m = value_loss(values, old_values, returns, mask, clip_range=0.2)
    assert_close(loss, T(0.8725))
    assert_close(m["vf_clip_frac"], T(0.5))
    # gradient: 0.5 * 2 (v - R) / 2 tokens = 0.5 * 2 * 0.5 / 2 = 0.25 on token 0; 0 on the
    # clipped token, whose loss does not depend on v
    loss.backward()
    assert_close(values.grad, T([[0.25, 0.0, 0.0]]))
    # unclipped: 0.5 * (0.25 + 1) / 2 = 0.3125
    loss, m = value_loss(values, old_values, returns, mask, clip_range=None)
    assert_close(loss, T(0.3125))


def test_value_loss_inside_clip_range():
    # v - old = 0.1 is within 0.2, so both terms are (0.1 - 1)^2 = 0.81: loss 0.405, nothing clipped
    loss, m = value_loss(T([[0.1]]), T([[0.0]]), T([[1.0]]), torch.ones(1, 1), clip_range=0.2)
    assert_close(loss, T(0.405))
    assert_close(m["vf_clip_frac"], T(0.0))


def test_entropy_from_logits():
    # uniform over 4: ln 4 ; p = (1/4, 3/4) from logits (0, ln 3): -(1/4 ln 1/4 + 3/4 ln 3/4)
    logits = T([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), -1e4, -1e4]]])
    expected = T([[math.log(4), 0.25 * math.log(4) + 0.75 * math.log(4 / 3)]])
    assert_close(entropy_from_logits(logits), expected)
    # a near one-hot distribution: entropy ~0, and finite
    assert entropy_from_logits(T([[[1e4, 0.0, 0.0]]])).abs().item() < 1e-6


def test_entropy_loss_is_negated_masked_mean():
    # valid 1, 2 -> mean 1.5 -> loss -1.5 (minimising it raises entropy)
    assert_close(entropy_loss(T([[1.0, 2.0, 9.0]]), T([[1, 1, 0]])), T(-1.5))


# ---------------------------------------------------------------------------------------------
# KL
# ---------------------------------------------------------------------------------------------


def test_kl_estimators_known_pair():
    # p = 0.5, p_ref = 0.25: x = ln 0.5 - ln 0.25 = ln 2
    #   k1 = ln 2 ; k2 = (ln 2)^2 / 2 ; k3 = e^{-ln 2} - 1 + ln 2 = 0.5 - 1 + ln 2 ; abs = ln 2
    # swapped, x = -ln 2: k1 = -ln 2 ; k2 the same ; k3 = e^{ln 2} - 1 - ln 2 = 1 - ln 2
    lp, ref = T([math.log(0.5), math.log(0.25)]), T([math.log(0.25), math.log(0.5)])
    ln2 = math.log(2)
    assert_close(kl_penalty(lp, ref, "k1"), T([ln2, -ln2]))
    assert_close(kl_penalty(lp, ref, "k2"), T([ln2**2 / 2, ln2**2 / 2]))
    assert_close(kl_penalty(lp, ref, "k3"), T([ln2 - 0.5, 1 - ln2]))
    assert_close(kl_penalty(lp, ref, "abs"), T([ln2, ln2]))
    with pytest.raises(ArgumentError, match="kind"):
        kl_penalty(lp, ref, "k4")


def test_k3_is_clamped():
    # x = -30: e^{30} - 1 - 30 is ~1e13; clamped to 10
    assert_close(kl_penalty(T([-30.0]), T([0.0]), "k3"), T([10.0]))


def test_kl_reward_penalty_places_score_on_last_valid_token():
    # coef 0.5, k1 with ref = 0, so kl = logprobs:
    #   row 0: -0.5 * (0.1, 0.2, 0.3) = -0.05, -0.1, -0.15; + score 1 on t=2 -> 0.85
    #   row 1: -0.5 * (0.4, 0.5)      = -0.2, -0.25;        + score 2 on t=1 -> 1.75; pad -> 0
    #   row 2: no valid token -> all 0
    logprobs = T([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0], [1.0, 1.0, 1.0]])
    mask = T([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    rewards = apply_kl_reward_penalty(T([1.0, 2.0, 3.0]), logprobs, torch.zeros(3, 3), mask,
                                      coef=0.5, kind="k1")
    assert_close(rewards, T([[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0], [0.0, 0.0, 0.0]]))


def test_fixed_kl_controller():
    ctrl = FixedKLController(coef=0.05)
    ctrl.update(current_kl=100.0, n_steps=1000)
    assert ctrl.value == 0.05


def test_adaptive_kl_controller_one_update():
    # target 6, horizon 10000, 256 samples:
    #   KL 9:   e = 9/6 - 1 = 0.5 -> clipped 0.2 ;  coef = 0.2 * (1 + 0.2 * 256/10000) = 0.2 * 1.00512
    #   KL 6.6: e = 0.1 (not clipped)            ;  coef = 0.2 * (1 + 0.1 * 0.0256)   = 0.2 * 1.00256
    #   KL 3:   e = -0.5 -> -0.2                 ;  coef = 0.2 * (1 - 0.00512)        = 0.2 * 0.99488
    for kl, expected in ((9.0, 0.201024), (6.6, 0.200512), (3.0, 0.198976)):
        ctrl = AdaptiveKLController(init_coef=0.2, target=6.0, horizon=10000)
        ctrl.update(current_kl=kl, n_steps=256)
        assert ctrl.value == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ArgumentError, match="target"):
        AdaptiveKLController(init_coef=0.2, target=0.0, horizon=10000)


# ---------------------------------------------------------------------------------------------
# Safe RLHF
# ---------------------------------------------------------------------------------------------


# Two responses of 3 tokens, the second 2 long (its third position is padding holding junk).
# KL (k1: log-probs minus the reference's, which are 0) and the two critics' values per token:
SAFE_KL = [[1.0, -2.0, 0.5], [0.0, 1.0, 9.0]]
SAFE_VALUES = [[0.5, 0.4, 0.3], [0.2, -0.5, 7.0]]
SAFE_COST_VALUES = [[1.0, 1.0, 2.0], [0.0, 0.5, 7.0]]
SAFE_MASK = [[1, 1, 1], [1, 1, 0]]
SAFE_SCORES, SAFE_COSTS = [1.0, -1.0], [2.0, 0.5]


def test_safe_rlhf_token_rewards_split_the_kl_penalty():
    # kl_coef 0.1: the reward stream -0.1 * kl, the cost stream +0.1 * kl; the score and the cost
    # on the last valid token.
    #   row 0: -0.1 * [1, -2, 0.5] = [-0.1, 0.2, -0.05] + score 1 at t=2 -> [-0.1, 0.2, 0.95]
    #          +0.1 * [1, -2, 0.5] = [0.1, -0.2, 0.05]  + cost 2 at t=2  -> [0.1, -0.2, 2.05]
    #   row 1: -0.1 * [0, 1] = [0, -0.1] + score -1 at t=1 -> [0, -1.1], padding 0
    #          +0.1 * [0, 1] = [0, 0.1]  + cost 0.5 at t=1 -> [0, 0.6],  padding 0
    rewards, costs = safe_rlhf_token_rewards(T(SAFE_SCORES), T(SAFE_COSTS), T(SAFE_KL),
                                             torch.zeros(2, 3), T(SAFE_MASK), 0.1)
    assert_close(rewards, T([[-0.1, 0.2, 0.95], [0.0, -1.1, 0.0]]))
    assert_close(costs, T([[0.1, -0.2, 2.05], [0.0, 0.6, 0.0]]))


def test_safe_rlhf_advantage_hand_computed():
    # The streams above, GAE at gamma 1, lam 0.5 (delta_t = r_t + V_{t+1} - V_t,
    # A_t = delta_t + 0.5 * A_{t+1}, V after the last valid token 0):
    #   row 0 reward (V 0.5, 0.4, 0.3): delta 0.95 - 0.3 = 0.65; 0.2 + 0.3 - 0.4 = 0.1;
    #          -0.1 + 0.4 - 0.5 = -0.2 -> A = -0.2 + 0.2125 = 0.0125, 0.1 + 0.325 = 0.425, 0.65
    #          returns A + V = 0.5125, 0.825, 0.95
    #   row 0 cost (V 1, 1, 2): delta 2.05 - 2 = 0.05; -0.2 + 2 - 1 = 0.8; 0.1 + 1 - 1 = 0.1
    #          -> A = 0.1 + 0.4125 = 0.5125, 0.8 + 0.025 = 0.825, 0.05; returns 1.5125, 1.825, 2.05
    #   row 1 reward (V 0.2, -0.5): delta -1.1 + 0.5 = -0.6; 0 - 0.5 - 0.2 = -0.7
    #          -> A = -0.7 - 0.3 = -1.0, -0.6; returns -0.8, -1.1
    #   row 1 cost (V 0, 0.5): delta 0.6 - 0.5 = 0.1; 0 + 0.5 - 0 = 0.5 -> A = 0.55, 0.1;
    #          returns 0.55, 0.6
    # lambda 3: (A_r - 3 A_c) / 4
    #   row 0: (0.0125 - 1.5375) / 4 = -0.38125; (0.425 - 2.475) / 4 = -0.5125;
    #          (0.65 - 0.15) / 4 = 0.125
    #   row 1: (-1.0 - 1.65) / 4 = -0.6625; (-0.6 - 0.3) / 4 = -0.225; padding 0
    adv, targets = estimate_advantages(
        "safe_rlhf", scores=T(SAFE_SCORES), costs=T(SAFE_COSTS), mask=T(SAFE_MASK),
        logprobs=T(SAFE_KL), ref_logprobs=torch.zeros(2, 3), kl_coef=0.1, kl_type="k1",
        values=T(SAFE_VALUES), cost_values=T(SAFE_COST_VALUES), lagrange=3.0, gamma=1.0, lam=0.5)
    assert_close(adv, T([[-0.38125, -0.5125, 0.125], [-0.6625, -0.225, 0.0]]))
    assert set(targets) == {"returns", "cost_returns"}
    assert_close(targets["returns"], T([[0.5125, 0.825, 0.95], [-0.8, -1.1, 0.0]]))
    assert_close(targets["cost_returns"], T([[1.5125, 1.825, 2.05], [0.55, 0.6, 0.0]]))
    # lambda 0: the reward stream's advantage alone
    adv0, _ = estimate_advantages(
        "safe_rlhf", scores=T(SAFE_SCORES), costs=T(SAFE_COSTS), mask=T(SAFE_MASK),
        logprobs=T(SAFE_KL), ref_logprobs=torch.zeros(2, 3), kl_coef=0.1,
        values=T(SAFE_VALUES), cost_values=T(SAFE_COST_VALUES), lagrange=0.0, gamma=1.0, lam=0.5)
    assert_close(adv0, T([[0.0125, 0.425, 0.65], [-1.0, -0.6, 0.0]]))


def test_safe_rlhf_advantage_pays_the_kl_penalty_once_whatever_lambda():
    # No score, no cost, zero values: only the KL penalty moves the advantage. Its reward part
    # -0.1 * kl = [-0.1, 0.2, -0.05] at gamma 1, lam 0.5 gives A = -0.05; 0.2 - 0.025 = 0.175;
    # -0.1 + 0.0875 = -0.0125, the cost part its negative, and (A - lambda (-A)) / (1 + lambda)
    # = A for every lambda.
    for lagrange in (0.0, 1.0, 5.0):
        adv, _, _ = compute_safe_rlhf_advantage(
            T([[-0.1, 0.2, -0.05]]), T([[0.1, -0.2, 0.05]]), torch.zeros(1, 3), torch.zeros(1, 3),
            torch.ones(1, 3), gamma=1.0, lam=0.5, lagrange=lagrange)
        assert_close(adv, T([[-0.0125, 0.175, -0.05]]))
    with pytest.raises(ArgumentError, match="lagrange"):
        compute_safe_rlhf_advantage(*(torch.zeros(1, 2),) * 4, torch.ones(1, 2), 1.0, 1.0, -1.0)


def test_lagrange_multiplier_update_hand_computed():
    # lambda = exp(log lambda) from 2, lr 0.1, limit 0.5; log lambda += 0.1 * (cost - 0.5) * lambda
    #   cost 1.5 (violates): ln 2 + 0.1 * 1.0 * 2 = ln 2 + 0.2 -> 2 e^0.2 = 2.44281, raised
    #   cost 0.0 (slack):    ln 2 + 0.1 * (-0.5) * 2 = ln 2 - 0.1 -> 2 e^-0.1 = 1.80967, lowered
    #   cost 0.5 (at the limit): unchanged
    up = LagrangeMultiplier(init_value=2.0, lr=0.1, cost_limit=0.5)
    assert up.update(1.5) == pytest.approx(2 * math.exp(0.2))
    # a second step from 2.44281: + 0.1 * 1.0 * 2.44281 -> 2.44281 e^0.244281 = 3.11881
    assert up.update(torch.tensor(1.5)) == pytest.approx(2 * math.exp(0.2 + 0.2 * math.exp(0.2)))
    down = LagrangeMultiplier(init_value=2.0, lr=0.1, cost_limit=0.5)
    assert down.update(torch.tensor(0.0)) == pytest.approx(2 * math.exp(-0.1))
    still = LagrangeMultiplier(init_value=2.0, lr=0.1, cost_limit=0.5)
    assert still.update(0.5) == pytest.approx(2.0)
    with pytest.raises(ArgumentError, match="init_value"):
        LagrangeMultiplier(init_value=0.0)


def test_aggregate_with_a_global_denominator_adds_up_over_pieces():
    # Two micro-batches of a 3-sequence batch; the pieces, each divided by the global count,
    # sum to the aggregate of the whole batch.
    loss = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    # token-mean: (1+2+3+4+5+6)/6 = 3.5; seq-mean-token-mean: (1.5 + 3 + 5)/3 = 9.5/3.
    for mode, denom, whole in (("token-mean", 6.0, 3.5), ("seq-mean-token-mean", 3.0, 9.5 / 3),
                               ("seq-mean-token-sum", 3.0, (3 + 3 + 15) / 3)):
        parts = [aggregate_loss(loss[:2], mask[:2], mode, denom),
                 aggregate_loss(loss[2:], mask[2:], mode, denom)]
        assert float(sum(parts)) == pytest.approx(whole)
        assert float(aggregate_loss(loss, mask, mode)) == pytest.approx(whole)
