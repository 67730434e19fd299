"""One entry point from a scored batch to advantages, for every algorithm of the RL loop."""

from __future__ import annotations

import torch

from hybridflow.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs
from hybridflow.algorithms.kl import apply_kl_reward_penalty, kl_penalty
from hybridflow.algorithms.safe_rlhf import safe_rlhf_combined_advantage
from hybridflow.algorithms.specs import algorithm_spec
from hybridflow.errors import ArgumentError


def estimate_advantages(algorithm: str, *, scores: torch.Tensor, mask: torch.Tensor,
                        logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None,
                        kl_coef: float = 0.0,
                        kl_type: str = "k1", values: torch.Tensor | None = None,
                        group_ids=None, baseline_scores: torch.Tensor | None = None,
                        costs: torch.Tensor | None = None, lagrange: float | None = None,
                        gamma: float = 1.0, lam: float = 1.0,
                        norm_by_std: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Advantages [B, T] (and GAE's returns [B, T], else None) for ``algorithm`` (grpo, ppo,
    remax, rloo, reinforce_plus_plus, safe_rlhf).

    ``kl_coef`` > 0 is the KL-in-reward penalty (Ziegler et al. 2019): ppo and
    reinforce_plus_plus pay ``kl_coef * kl_t`` on every token t; the sequence-level estimators
    (grpo, rloo, remax, safe_rlhf's reward) pay ``kl_coef * sum_t kl_t`` off the sequence's score.
    ReMax's ``baseline_scores`` (the greedy response's reward) and Safe-RLHF's ``costs`` are taken
    as given. ``logprobs`` and ``ref_logprobs`` are read only for that penalty (None without it).
    Shapes: scores, costs, baseline_scores [B]; mask, logprobs, ref_logprobs, values [B, T];
    group_ids [B].
    """
    spec = algorithm_spec(algorithm)
    if kl_coef and (logprobs is None or ref_logprobs is None):
        raise ArgumentError("logprobs", "the KL-in-reward penalty (kl_coef > 0) needs the "
                                        "policy's and the reference's log-probs")
    if kl_coef:
        kl = torch.where(mask.bool(), kl_penalty(logprobs, ref_logprobs, kl_type), 0.0)
        seq_scores = scores - kl_coef * kl.sum(-1)
    else:
        seq_scores = scores
    inputs = AdvantageInputs(mask=mask, scores=seq_scores, values=values, group_ids=group_ids,
                             baseline_scores=baseline_scores, gamma=gamma, lam=lam,
                             norm_by_std=norm_by_std)
    if spec.token_level:
        inputs.scores = scores
        inputs.token_rewards = apply_kl_reward_penalty(scores, logprobs, ref_logprobs, mask,
                                                       kl_coef, kl_type)
    estimate = ADVANTAGE_ESTIMATORS[spec.estimator]
    if not spec.cost:
        return estimate(inputs)
    reward_adv, _ = estimate(inputs)
    inputs.scores = costs
    cost_adv, _ = estimate(inputs)
    return safe_rlhf_combined_advantage(reward_adv, cost_adv, lagrange), None
