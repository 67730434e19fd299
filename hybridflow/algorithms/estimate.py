"""One entry point from a scored batch to advantages, for every algorithm of the RL loop."""

from __future__ import annotations

import torch

from hybridflow.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, Targets
from hybridflow.algorithms.kl import apply_kl_reward_penalty, kl_penalty
from hybridflow.algorithms.safe_rlhf import safe_rlhf_token_rewards
from hybridflow.algorithms.specs import algorithm_spec
from hybridflow.errors import ArgumentError


def estimate_advantages(algorithm: str, *, scores: torch.Tensor, mask: torch.Tensor,
                        logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None,
                        kl_coef: float = 0.0,
                        kl_type: str = "k1", values: torch.Tensor | None = None,
                        cost_values: torch.Tensor | None = None,
                        group_ids=None, baseline_scores: torch.Tensor | None = None,
                        costs: torch.Tensor | None = None, lagrange: float | None = None,
                        gamma: float = 1.0, lam: float = 1.0,
                        norm_by_std: bool = True) -> tuple[torch.Tensor, Targets]:
    """Advantages [B, T] and the value models' regression targets (``ADVANTAGE_ESTIMATORS``:
    ``returns``, ``cost_returns``; {} without a critic) for ``algorithm`` (grpo, ppo, remax,
    rloo, reinforce_plus_plus, safe_rlhf).

    ``kl_coef`` > 0 is the KL-in-reward penalty (Ziegler et al. 2019): the token-level
    algorithms (ppo, reinforce_plus_plus, safe_rlhf) pay ``kl_coef * kl_t`` on every token t
    (safe_rlhf: in its reward stream, and the opposite in its cost stream:
    ``safe_rlhf_token_rewards``); the sequence-level estimators (grpo, rloo, remax) pay
    ``kl_coef * sum_t kl_t`` off the sequence's score. ReMax's ``baseline_scores`` (the greedy
    response's reward), Safe-RLHF's ``costs`` and its Lagrange multiplier ``lagrange`` are taken
    as given. ``logprobs`` and ``ref_logprobs`` are read only for that penalty (None without it).
    Shapes: scores, costs, baseline_scores [B]; mask, logprobs, ref_logprobs, values,
    cost_values [B, T]; group_ids [B].
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
    if spec.cost:
        if costs is None:
            raise ArgumentError("costs", f"{algorithm} reads a cost per sample; pass it")
        inputs.token_rewards, inputs.token_costs = safe_rlhf_token_rewards(
            scores, costs, logprobs, ref_logprobs, mask, kl_coef, kl_type)
        inputs.cost_values, inputs.lagrange = cost_values, lagrange
    elif spec.token_level:
        inputs.scores = scores
        inputs.token_rewards = apply_kl_reward_penalty(scores, logprobs, ref_logprobs, mask,
                                                       kl_coef, kl_type)
    return ADVANTAGE_ESTIMATORS[spec.estimator](inputs)
