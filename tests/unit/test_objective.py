"""The actor's objective (``hybridflow.algorithms.objective``) against numbers computed by hand:
the clipped and dual-clipped policy term at the token and the sequence ratio level, the KL and
entropy terms, the aggregation over a global denominator, TIS weights and MIS masking, and the
metrics with their counts.

Two sequences of three tokens, the last token of the first one padding (with garbage there):

    token ratios r = exp(logprobs - old_logprobs)   row 0: 1.6, 1.0      row 1: 4.0, 1.1, 0.5
    advantages A                                    row 0: +1, +1        row 1: -1, -1, -1

The micro-batch holds 5 response tokens of a mini-batch of 8 (2 sequences of 4): the global
denominators are 8 for token-mean and 4 for the sequence modes.
"""

import math

import pytest
import torch
from torch.testing import assert_close

from hybridflow.algorithms import (ActorObjective, RolloutCorrectionConfig, actor_loss,
                                   actor_loss_fn, prepare_rollout_correction)
from hybridflow.config.rl import ActorConfig

T = torch.tensor
MASK = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
LOGPROBS = T([[-1.0, -2.0, -5.0], [-0.5, -1.0, -1.5]])
# log r; 25 at the padding, where r would saturate every clip if it were counted.
LOG_RATIO = T([[math.log(1.6), 0.0, 25.0], [math.log(4.0), math.log(1.1), math.log(0.5)]])
OLD = LOGPROBS - LOG_RATIO
ADVANTAGES = T([[1.0, 1.0, 100.0], [-1.0, -1.0, -1.0]])
# logprobs - ref_logprobs, the k1 estimate per token.
KL_D = T([[0.2, -0.1, 9.0], [0.3, 0.1, -0.2]])
REF = LOGPROBS - KL_D
ENTROPY = T([[1.0, 2.0, 50.0], [0.5, 1.5, 3.0]])
# Rollout importance weights w = exp(old - rollout).
W = T([[0.4, 3.0, 1.0], [1.0, 1.5, 2.5]])
ROLLOUT = OLD - W.log()
TOKENS, SEQUENCES = 8.0, 4.0  # the global denominators

# The per-token PPO loss L = max(-A r, -A clip(r, 0.8, 1.2)), then with A < 0 min(L, -3 A):
#   (0,0) r=1.6, A=+1: max(-1.6, -1.2) = -1.2   the ratio clip binds
#   (0,1) r=1.0, A=+1: max(-1.0, -1.0) = -1.0
#   (1,0) r=4.0, A=-1: max( 4.0,  1.2) =  4.0 -> min(4.0, 3.0) = 3.0   the dual clip binds
#   (1,1) r=1.1, A=-1: max( 1.1,  1.1) =  1.1
#   (1,2) r=0.5, A=-1: max( 0.5,  0.8) =  0.8   the ratio clip binds
L = [[-1.2, -1.0], [3.0, 1.1, 0.8]]
PG_TOKEN_MEAN = (-1.2 - 1.0 + 3.0 + 1.1 + 0.8) / TOKENS  # 2.7 / 8 = 0.3375
# approx_kl: the mean of -log r over the 5 tokens; 1.6 * 1.0 * 4.0 * 1.1 * 0.5 = 3.52.
APPROX_KL = -math.log(3.52) / 5


def objective(**changes) -> ActorObjective:
    options = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, dual_clip_c=3.0,
                   loss_agg_mode="token-mean", ratio_level="token", kl_loss_coef=0.0,
                   kl_loss_type="k3", entropy_coef=0.0)
    return ActorObjective(**{**options, **changes})


def micro_batch(**extra) -> dict[str, torch.Tensor]:
    return {"response_mask": MASK, "advantages": ADVANTAGES, "old_logprobs": OLD, **extra}


def check_metrics(metrics: dict, expected: dict) -> None:
    """``expected``: a float for a share of the objective, a (mean, count) pair otherwise."""
    assert list(metrics) == list(expected)
    for key, want in expected.items():
        got = metrics[key]
        if isinstance(want, tuple):
            assert isinstance(got, tuple), key
            assert_close(got[0].float(), T(want[0]), msg=key)
            assert got[1].item() == want[1], key
        else:
            assert_close(got.detach(), T(want), msg=key)


def test_clipped_and_dual_clipped_policy_term():
    logprobs = LOGPROBS.clone().requires_grad_()
    loss, metrics = actor_loss(logprobs, micro_batch(), TOKENS, objective())
    assert_close(loss, T(PG_TOKEN_MEAN))
    # clip binds on 2 of the 5 tokens, the dual clip on 1.
    check_metrics(metrics, {"actor/pg_loss": PG_TOKEN_MEAN, "actor/clip_frac": (2 / 5, 5),
                            "actor/approx_kl": (APPROX_KL, 5),
                            "actor/dual_clip_frac": (1 / 5, 5)})
    # Where a clip binds L is constant in r; elsewhere dL/dlogp = -A r / 8.
    loss.backward()
    assert_close(logprobs.grad, T([[0.0, -1.0 / 8, 0.0], [0.0, 1.1 / 8, 0.0]]))

    # Without the dual clip token (1,0) keeps its 4.0: (2.7 - 3.0 + 4.0) / 8.
    loss, metrics = actor_loss(LOGPROBS, micro_batch(), TOKENS, objective(dual_clip_c=None))
    assert_close(loss, T(3.7 / 8))
    assert metrics["actor/dual_clip_frac"][0].item() == 0.0


def test_sequence_ratio_level():
    # Sequence ratios s_i = exp(mean_t log r), the mean advantage, one L_i per sequence:
    #   row 0: s = (1.6 * 1.0)^(1/2) = 1.2649, A=+1: max(-1.2649, -1.2) = -1.2   the clip binds
    #   row 1: s = (4.0 * 1.1 * 0.5)^(1/3) = 2.2^(1/3) = 1.3006, A=-1:
    #          max(1.3006, 1.2) = 1.3006 -> min(1.3006, -1.25 * A = 1.25) = 1.25   dual binds
    # seq-mean-token-mean over 4 sequences: (-1.2 + 1.25) / 4.
    loss, metrics = actor_loss(LOGPROBS, micro_batch(), SEQUENCES,
                               objective(ratio_level="sequence", dual_clip_c=1.25,
                                         loss_agg_mode="seq-mean-token-mean"))
    assert_close(loss, T(0.05 / 4))
    # The clip fractions count sequences, approx_kl still tokens.
    check_metrics(metrics, {"actor/pg_loss": 0.05 / 4, "actor/clip_frac": (1 / 2, 2),
                            "actor/approx_kl": (APPROX_KL, 5),
                            "actor/dual_clip_frac": (1 / 2, 2)})


@pytest.mark.parametrize("mode, denominator, by_hand", [
    ("token-mean", TOKENS, 2.7 / 8),
    # each sequence's token sum: row 0 -1.2 - 1.0 = -2.2, row 1 3.0 + 1.1 + 0.8 = 4.9
    ("seq-mean-token-sum", SEQUENCES, (-2.2 + 4.9) / 4),
    # each sequence's token mean: row 0 -2.2 / 2 = -1.1, row 1 4.9 / 3
    ("seq-mean-token-mean", SEQUENCES, (-1.1 + 4.9 / 3) / 4),
])
def test_aggregation_over_the_global_denominator(mode, denominator, by_hand):
    loss, _ = actor_loss(LOGPROBS, micro_batch(), denominator, objective(loss_agg_mode=mode))
    assert_close(loss, T(by_hand))


@pytest.mark.parametrize("kind, per_token", [
    ("k1", [0.2, -0.1, 0.3, 0.1, -0.2]),  # d = logprobs - ref
    # k3 = exp(-d) + d - 1
    ("k3", [math.exp(-d) + d - 1 for d in (0.2, -0.1, 0.3, 0.1, -0.2)]),
])
def test_kl_loss_term(kind, per_token):
    kl = sum(per_token) / TOKENS  # k1: 0.3 / 8 = 0.0375
    loss, metrics = actor_loss(LOGPROBS, micro_batch(ref_logprobs=REF), TOKENS,
                               objective(kl_loss_coef=0.5, kl_loss_type=kind))
    assert_close(loss, T(PG_TOKEN_MEAN + 0.5 * kl))
    check_metrics(metrics, {"actor/pg_loss": PG_TOKEN_MEAN, "actor/clip_frac": (2 / 5, 5),
                            "actor/approx_kl": (APPROX_KL, 5),
                            "actor/dual_clip_frac": (1 / 5, 5), "actor/kl_loss": kl})


def test_entropy_term():
    # Entropy over the 5 tokens: 1.0 + 2.0 + 0.5 + 1.5 + 3.0 = 8.0; the bonus is subtracted.
    loss, metrics = actor_loss(LOGPROBS, micro_batch(entropy=ENTROPY), TOKENS,
                               objective(entropy_coef=0.01))
    assert_close(loss, T(PG_TOKEN_MEAN - 0.01 * 8.0 / 8))
    check_metrics(metrics, {"actor/pg_loss": PG_TOKEN_MEAN, "actor/clip_frac": (2 / 5, 5),
                            "actor/approx_kl": (APPROX_KL, 5),
                            "actor/dual_clip_frac": (1 / 5, 5), "actor/entropy": (8.0 / 5, 5)})


def test_total_with_every_term():
    # seq-mean-token-sum over 4 sequences, term by term (per-sequence sums, row 0 + row 1):
    #   policy:  (-2.2 + 4.9) / 4 = 0.675
    #   k1 KL:   ((0.2 - 0.1) + (0.3 + 0.1 - 0.2)) / 4 = 0.3 / 4 = 0.075
    #   entropy: ((1.0 + 2.0) + (0.5 + 1.5 + 3.0)) / 4 = 8.0 / 4 = 2.0
    # total = 0.675 + 0.5 * 0.075 - 0.01 * 2.0 = 0.6925
    entropy = ENTROPY.clone().requires_grad_()
    loss, metrics = actor_loss(LOGPROBS, micro_batch(ref_logprobs=REF, entropy=entropy),
                               SEQUENCES, objective(loss_agg_mode="seq-mean-token-sum",
                                                    kl_loss_coef=0.5, kl_loss_type="k1",
                                                    entropy_coef=0.01))
    assert_close(loss, T(0.6925))
    check_metrics(metrics, {"actor/pg_loss": 0.675, "actor/clip_frac": (2 / 5, 5),
                            "actor/approx_kl": (APPROX_KL, 5),
                            "actor/dual_clip_frac": (1 / 5, 5), "actor/kl_loss": 0.075,
                            "actor/entropy": (8.0 / 5, 5)})
    # The bonus pushes every response token's entropy up: d loss / d H = -0.01 / 4.
    loss.backward()
    assert_close(entropy.grad, T([[-0.0025, -0.0025, 0.0], [-0.0025, -0.0025, -0.0025]]))


def test_on_policy_old_logprobs_are_the_detached_logprobs():
    # Without old_logprobs r = 1 on every token, L = -A: (-1 - 1 + 1 + 1 + 1) / 8, and the
    # gradient is that of -A r / 8 (it would vanish if the old side were not detached).
    logprobs = LOGPROBS.clone().requires_grad_()
    mb = {"response_mask": MASK, "advantages": ADVANTAGES}
    loss, metrics = actor_loss(logprobs, mb, TOKENS, objective())
    assert_close(loss, T(1.0 / 8))
    assert metrics["actor/approx_kl"][0].item() == 0.0
    loss.backward()
    assert_close(logprobs.grad, T([[-1 / 8, -1 / 8, 0.0], [1 / 8, 1 / 8, 1 / 8]]))


def test_tis_weights_scale_the_policy_term():
    data = micro_batch()
    corrected, metrics = prepare_rollout_correction(
        data, ROLLOUT, RolloutCorrectionConfig(mode="tis", level="token", cap=2.0))
    # min(w, 2) per token; 1 at the padding, whose log-ratio is zeroed.
    assert_close(corrected["tis_weights"], T([[0.4, 2.0, 1.0], [1.0, 1.5, 2.0]]))
    assert_close(metrics["actor/tis_weight_mean"], T((0.4 + 2.0 + 1.0 + 1.5 + 2.0) / 5))
    assert "tis_weights" not in data and corrected["response_mask"] is MASK
    # L * weight: -1.2 * 0.4 - 1.0 * 2.0 + 3.0 * 1.0 + 1.1 * 1.5 + 0.8 * 2.0 = 3.77, over 8.
    loss, _ = actor_loss(LOGPROBS, corrected, TOKENS, objective())
    assert_close(loss, T(3.77 / 8))


def test_mis_masks_tokens_out_of_every_term():
    corrected, metrics = prepare_rollout_correction(
        micro_batch(), ROLLOUT, RolloutCorrectionConfig(mode="mis", level="token", cap=2.0))
    # Kept where 1/2 <= w <= 2: w = 0.4, 3.0 and 2.5 are rejected, 3 of 5 tokens.
    assert_close(corrected["response_mask"], T([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert_close(metrics["actor/mis_masked_frac"], T(3 / 5))
    assert "tis_weights" not in corrected
    # Two tokens left, the mini-batch's denominator counted from the narrowed mask: (1,0)'s
    # dual-clipped 3.0 and (1,1)'s 1.1, over 2; neither is ratio-clipped; the KL term counts
    # only them too: (0.3 + 0.1) / 2.
    loss, metrics = actor_loss(LOGPROBS, {**corrected, "ref_logprobs": REF}, 2.0,
                               objective(kl_loss_coef=0.5, kl_loss_type="k1"))
    assert_close(loss, T((3.0 + 1.1) / 2 + 0.5 * 0.4 / 2))
    check_metrics(metrics, {"actor/pg_loss": 4.1 / 2, "actor/clip_frac": (0.0, 2),
                            "actor/approx_kl": (-math.log(4.0 * 1.1) / 2, 2),
                            "actor/dual_clip_frac": (1 / 2, 2), "actor/kl_loss": 0.4 / 2})

    # At the sequence level w_i is the product: row 0 0.4 * 3.0 = 1.2 (kept), row 1
    # 1.0 * 1.5 * 2.5 = 3.75 (rejected), one of two sequences.
    corrected, metrics = prepare_rollout_correction(
        micro_batch(), ROLLOUT, RolloutCorrectionConfig(mode="mis", level="sequence", cap=2.0))
    assert_close(corrected["response_mask"], T([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert_close(metrics["actor/mis_masked_frac"], T(1 / 2))


def test_the_objective_of_an_actor_config():
    config = ActorConfig(clip_ratio_high=0.28, dual_clip_c=None, loss_agg_mode="seq-mean-token-sum",
                         kl_loss_coef=0.1, kl_loss_type="k1", ratio_level="sequence",
                         entropy_coef=0.01)
    assert ActorObjective.of(config) == objective(
        clip_ratio_high=0.28, dual_clip_c=None, loss_agg_mode="seq-mean-token-sum",
        kl_loss_coef=0.1, kl_loss_type="k1", ratio_level="sequence", entropy_coef=0.01)


def test_the_update_loss_function_is_the_bound_objective_and_keeps_on_policy_log_probs():
    # What update_actor hands the engine (and the calibration probe runs): actor_loss bound to
    # the objective and the mini-batch's denominator; on-policy, each micro-batch's log-probs,
    # detached, and the micro-batch kept in ``seen``.
    mb = {"response_mask": MASK, "advantages": ADVANTAGES}
    seen: list = []
    loss, metrics = actor_loss_fn(objective(), TOKENS, seen)(LOGPROBS.clone().requires_grad_(),
                                                             mb)
    assert_close(loss.detach(), T(1.0 / 8))  # as test_on_policy_old_logprobs_...
    assert list(metrics) == list(actor_loss(LOGPROBS, mb, TOKENS, objective())[1])
    assert len(seen) == 1 and seen[0][1] is mb and not seen[0][0].requires_grad
    assert_close(seen[0][0], LOGPROBS)
    # off-policy: nothing kept
    loss, _ = actor_loss_fn(objective(), TOKENS)(LOGPROBS, micro_batch())
    assert_close(loss, T(PG_TOKEN_MEAN))
