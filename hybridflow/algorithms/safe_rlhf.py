"""Safe RLHF (Dai et al. 2023, arXiv 2310.12773) as its reference trainer, the PPO-Lagrangian
(``ppo_lag``) of PKU-Alignment's safe-rlhf, does it: maximise the reward subject to the mean
episode cost <= a limit d, a min-max over the policy and a Lagrange multiplier lambda >= 0.

* two per-token streams, the reward's and the cost's (``safe_rlhf_token_rewards``);
* each stream's GAE with its own critic (the critic and the cost critic), the policy's advantage
  (A_r - lambda * A_c) / (1 + lambda): ``advantages.compute_safe_rlhf_advantage``;
* lambda ascends the constraint's violation J_c - d, J_c the mean episode cost
  (``LagrangeMultiplier``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hybridflow.algorithms.advantages import _check_seq_shape
from hybridflow.algorithms.kl import apply_kl_reward_penalty
from hybridflow.errors import ArgumentError


@torch.no_grad()
def safe_rlhf_token_rewards(scores: torch.Tensor, costs: torch.Tensor, logprobs: torch.Tensor,
                            ref_logprobs: torch.Tensor, mask: torch.Tensor, coef: float,
                            kind: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """The reward and cost streams: r_t = -coef * kl_t and c_t = +coef * kl_t on every valid
    token, the score added to r and the cost to c on the last valid token.

    The whole KL penalty goes into each stream, with opposite signs, as the reference's
    ``add_kl_divergence_regularization`` does: GAE is linear in the rewards, so in
    (A_r - lambda * A_c) / (1 + lambda) the two parts add up to the penalty once, -coef * kl_t,
    whatever lambda (PPO's penalty).

    Args:
        scores: [B] reward per response.
        costs: [B] cost per response (higher = less safe).
        logprobs: [B, T] policy log-probs of the sampled tokens (may be None where coef is 0).
        ref_logprobs: [B, T] reference log-probs of the same tokens (likewise).
        mask: [B, T] response mask.
        coef: KL coefficient, >= 0.
        kind: KL estimator (``kl.kl_penalty``).

    Returns:
        (token_rewards, token_costs), each [B, T] and 0 on masked tokens.
    """
    _check_seq_shape("costs", costs, mask)
    rewards = apply_kl_reward_penalty(scores, logprobs, ref_logprobs, mask, coef, kind)
    # The cost stream is the reward stream of -cost, negated: +coef * kl_t on each token.
    token_costs = -apply_kl_reward_penalty(-costs, logprobs, ref_logprobs, mask, coef, kind)
    return rewards, token_costs


@dataclass(kw_only=True)
class LagrangeMultiplier:
    """lambda = exp(log_lambda): the log keeps lambda positive without a projection. One update
    is one gradient-ascent step on the Lagrangian's lambda * (J_c - d) with respect to
    log_lambda (the reference's SGD step on the loss -(J_c - d) * exp(log_lambda)):

        log_lambda += lr * (J_c - d) * lambda

    J_c the mean episode cost, d = ``cost_limit``: a cost above the limit raises lambda, one
    below lowers it, by a step that scales with lambda.
    """

    init_value: float = 1.0
    """Starting lambda, > 0 (log space cannot represent 0)."""
    lr: float = 0.1
    """Step size on log_lambda, > 0."""
    cost_limit: float = 0.0
    """Largest acceptable mean episode cost d (the constraint's threshold)."""
    log_value: float = field(init=False)
    """log lambda, the variable being updated."""

    def __post_init__(self) -> None:
        if not self.init_value > 0:
            raise ArgumentError("init_value",
                                f"must be > 0 (lambda = exp(log_lambda) cannot be 0), got "
                                f"{self.init_value!r}; use a small value such as 1e-3 to start "
                                "nearly unconstrained")
        if not self.lr > 0:
            raise ArgumentError("lr", f"must be > 0, got {self.lr!r}")
        self.log_value = math.log(self.init_value)

    @property
    def value(self) -> float:
        """Current lambda."""
        return math.exp(self.log_value)

    def update(self, mean_episode_cost: float | torch.Tensor) -> float:
        """One ascent step on the episode cost ``mean_episode_cost`` (J_c); the new lambda."""
        self.log_value += self.lr * (float(mean_episode_cost) - self.cost_limit) * self.value
        return self.value
