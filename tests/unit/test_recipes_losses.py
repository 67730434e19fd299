"""GSPO's sequence-level ratio, the rollout/training mismatch metrics and their corrections
(TIS, MIS), against numbers computed by hand."""

import math

import pytest
import torch

from hybridflow.algorithms import (RolloutCorrectionConfig, policy_loss, rollout_correction,
                                   rollout_mismatch)
from hybridflow.config import RLConfig, make_config
from hybridflow.config.rl import ActorConfig
from hybridflow.errors import ConfigError

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_gspo_sequence_ratio_hand_computed():
    old = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, -1.0]])
    # Log-ratios: row 0 [0.3, 0.1] (mean 0.2, the padded 7.0 ignored), row 1 [-0.1, 0, 0.1].
    logprobs = (old + torch.tensor([[0.3, 0.1, 7.0], [-0.1, 0.0, 0.1]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, 0.0], [-0.5, -0.5, -0.5]])
    # Row 0: s = e^0.2 = 1.2214 > 1.2, A = 1: clipped, L = -1.2.
    # Row 1: s = e^0 = 1, A = -0.5: L = 0.5.
    loss, m = policy_loss(logprobs, old, adv, MASK, agg="seq-mean-token-mean",
                          ratio_level="sequence")
    torch.testing.assert_close(loss, torch.tensor((-1.2 + 0.5) / 2))
    assert m["clip_frac"].item() == pytest.approx(0.5)  # one of two sequences
    # token-mean weighs each L_i by its length: (2 * -1.2 + 3 * 0.5) / 5.
    tok_mean, _ = policy_loss(logprobs, old, adv, MASK, ratio_level="sequence")
    torch.testing.assert_close(tok_mean, torch.tensor(-0.18))
    # The gradient reaches every token of the unclipped row through the mean:
    # dL/dlogp_t = -A * s / |y| / (2 sequences) = 0.5 / 3 / 2; none through the clipped row.
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, 0.0], [1 / 12] * 3]))

    # Token level on the same numbers: row 0 tokens -1.2 (e^0.3 clipped), -e^0.1; row 1
    # tokens 0.5 * e^-0.1, 0.5, 0.5 * e^0.1 (inside the clip range).
    token, tm = policy_loss(logprobs, old, adv, MASK, ratio_level="token")
    by_hand = (-1.2 - math.exp(0.1) + 0.5 * (math.exp(-0.1) + 1 + math.exp(0.1))) / 5
    torch.testing.assert_close(token, torch.tensor(by_hand))
    assert tm["clip_frac"].item() == pytest.approx(1 / 5)  # one of five tokens
    assert not torch.isclose(token, tok_mean)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_sequence_and_token_ratios_agree_when_every_token_has_the_same_log_ratio(agg):
    old = torch.randn(3, 3)
    delta = torch.tensor([0.5, -0.5, 0.05])[:, None]
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0, 2.0])[:, None].expand(3, 3)
    args = (old + delta, old, adv, mask, 0.2, 0.2, 3.0, agg)
    token, tm = policy_loss(*args, ratio_level="token")
    seq, sm = policy_loss(*args, ratio_level="sequence")
    torch.testing.assert_close(seq, token)
    # e^0.5 > 1.2 with A > 0 and e^-0.5 < 0.8 with A < 0 clip; e^0.05 does not: 2 of 3
    # sequences, 2 + 3 of 6 tokens.
    assert sm["clip_frac"].item() == pytest.approx(2 / 3)
    assert tm["clip_frac"].item() == pytest.approx(5 / 6)


def test_rollout_mismatch_hand_computed():
    rollout = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -3.0, -1.0]])
    train = torch.tensor([[-1.5, -2.0, float("-inf")], [-0.5, -1.0, -0.5]])
    # train - rollout over response tokens: -0.5, 0 | 0, 2, 0.5.
    m = {k: v.item() for k, v in rollout_mismatch(rollout, train, MASK).items()}
    assert m["mismatch/abs_diff_mean"] == pytest.approx(3.0 / 5)
    assert m["mismatch/abs_diff_max"] == pytest.approx(2.0)
    # k3 = e^d - 1 - d per token.
    k3 = sum(math.exp(d) - 1 - d for d in (-0.5, 0.0, 0.0, 2.0, 0.5)) / 5
    assert m["mismatch/kl"] == pytest.approx(k3, rel=1e-5)
    # Ratios e^-0.5, 1, 1, e^2, e^0.5: only e^2 is outside [0.5, 2].
    assert m["mismatch/ratio_outside_frac"] == pytest.approx(1 / 5)


# old - rollout over response tokens: 0.5, -1 | ln 3, 0, 0.2.
OLD = torch.tensor([[-0.5, -2.0, 0.0], [math.log(3.0) - 1.0, -1.0, -0.8]])
ROLLOUT = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0]])


def test_tis_token_and_sequence_weights_hand_computed():
    w, mask, m = rollout_correction(OLD, ROLLOUT, MASK, "tis", "token", cap=2.0)
    expected = [[math.exp(0.5), math.exp(-1.0)], [2.0, 1.0, math.exp(0.2)]]  # 3 capped at 2
    torch.testing.assert_close(w[0, :2], torch.tensor(expected[0]))
    torch.testing.assert_close(w[1], torch.tensor(expected[1]))
    assert mask is MASK
    assert m["tis_weight_mean"].item() == pytest.approx(sum(expected[0] + expected[1]) / 5)
    # Sequence level: row 0 sums -0.5 -> e^-0.5; row 1 sums ln 3 + 0.2 -> 3.66, capped at 2.
    w, _, m = rollout_correction(OLD, ROLLOUT, MASK, "tis", "sequence", cap=2.0)
    torch.testing.assert_close(w[0, :2], torch.full((2,), math.exp(-0.5)))
    torch.testing.assert_close(w[1], torch.full((3,), 2.0))
    assert m["tis_weight_mean"].item() == pytest.approx((math.exp(-0.5) + 2.0) / 2)


def test_tis_weights_scale_the_policy_loss():
    # Ratio 1 and A = 1 on every token: the loss per token is -1, so the loss is -mean(w).
    w, mask, m = rollout_correction(OLD, ROLLOUT, MASK, "tis", "token", cap=2.0)
    adv = torch.ones(2, 3)
    plain, _ = policy_loss(OLD, OLD, adv, mask)
    weighted, _ = policy_loss(OLD, OLD, adv, mask, weights=w)
    assert plain.item() == pytest.approx(-1.0)
    assert weighted.item() == pytest.approx(-m["tis_weight_mean"].item())


def test_mis_token_and_sequence_masks_hand_computed():
    # cap 2: kept where |old - rollout| <= ln 2 = 0.693.
    w, mask, m = rollout_correction(OLD, ROLLOUT, MASK, "mis", "token", cap=2.0)
    assert w is None
    assert mask.tolist() == [[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]]  # -1 and ln 3 rejected
    assert m["mis_masked_frac"].item() == pytest.approx(2 / 5)
    # Sequence level: row 0 sums -0.5 (kept), row 1 ln 3 + 0.2 = 1.30 (rejected, whole).
    _, mask, m = rollout_correction(OLD, ROLLOUT, MASK, "mis", "sequence", cap=2.0)
    assert mask.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    assert m["mis_masked_frac"].item() == pytest.approx(1 / 2)
    # A rejected sequence leaves the loss and the token-mean's denominator: row 0's two
    # tokens, ratios e^0.1 and 1 under A = 1, are all that is left.
    adv = torch.ones(2, 3)
    loss, _ = policy_loss(OLD + torch.tensor([[0.1, 0.0, 0.0], [5.0, 5.0, 5.0]]), OLD, adv,
                          mask)
    assert loss.item() == pytest.approx(-(math.exp(0.1) + 1.0) / 2)


def test_correction_and_ratio_level_config_checks():
    with pytest.raises(ConfigError) as e:
        ActorConfig(ratio_level="seq")
    assert e.value.field == "ratio_level"
    for bad in ({"mode": "is"}, {"level": "tok"}, {"cap": 1.0}):
        with pytest.raises(ConfigError) as e:
            RolloutCorrectionConfig(**bad)
        assert e.value.field == next(iter(bad))
    base = {"model": "tiny-llama", "rollout": {"backend": "hf"}}
    for key, value in (("cap", 3.0), ("level", "sequence")):
        with pytest.raises(ConfigError, match="mode=tis or mis") as e:
            make_config(RLConfig, base, {f"actor.rollout_correction.{key}": value})
        assert e.value.field == f"actor.rollout_correction.{key}"
    cfg = make_config(RLConfig, base, {"actor.rollout_correction.mode": "mis",
                                       "actor.rollout_correction.cap": 3.0,
                                       "actor.ratio_level": "sequence"})
    assert cfg.actor.rollout_correction.cap == 3.0 and cfg.actor.ratio_level == "sequence"
