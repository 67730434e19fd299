"""Safe RLHF (Dai et al. 2023, arXiv 2310.12773): maximise reward subject to expected cost <= a
limit, solved as a Lagrangian min-max. The policy ascends A_r - lambda * A_c; lambda ascends the
constraint violation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hybridflow.errors import ArgumentError


def safe_rlhf_combined_advantage(reward_adv: torch.Tensor, cost_adv: torch.Tensor,
                                 lagrange_multiplier: float | torch.Tensor) -> torch.Tensor:
    """(A_r - lambda * A_c) / (1 + lambda) (the paper's Lagrangian objective, rescaled as in
    its reference code).

    Dividing by 1 + lambda keeps the advantage's scale, and so the effective step size, from
    growing with lambda.

    Args:
        reward_adv: [B, T] advantages from the reward model.
        cost_adv: [B, T] advantages from the cost model (higher cost = less safe).
        lagrange_multiplier: lambda >= 0, e.g. ``LagrangeMultiplier.value``.

    Returns:
        [B, T].
    """
    if reward_adv.shape != cost_adv.shape:
        raise ArgumentError("cost_adv", f"shape {tuple(cost_adv.shape)} does not match "
                                        f"reward_adv {tuple(reward_adv.shape)}")
    if not isinstance(lagrange_multiplier, torch.Tensor) and lagrange_multiplier < 0:
        raise ArgumentError("lagrange_multiplier", f"must be >= 0, got {lagrange_multiplier!r}")
    return (reward_adv - lagrange_multiplier * cost_adv) / (1.0 + lagrange_multiplier)


@dataclass(kw_only=True)
class LagrangeMultiplier:
    """lambda = exp(log_lambda), moved by gradient ascent on the Lagrangian:
    log_lambda += lr * (mean_episode_cost - cost_limit). Parameterising in log space keeps lambda
    positive without a projection step.
    """

    init_value: float = 1.0
    """Starting lambda, > 0 (log space cannot represent 0)."""
    lr: float = 0.1
    """Step size on log_lambda, > 0."""
    cost_limit: float = 0.0
    """Largest acceptable mean episode cost (the constraint's threshold)."""
    log_value: float = field(init=False)
    """log lambda, the variable being updated."""

    def __post_init__(self) -> None:
        if not self.init_value > 0:
            raise ArgumentError("init_value",
                              f"must be > 0 (lambda = exp(log_lambda) cannot be 0), got {self.init_value!r}; "
                                f"use a small value such as 1e-3 to start nearly unconstrained")
        if not self.lr > 0:
            raise ArgumentError("lr", f"must be > 0, got {self.lr!r}")
        self.log_value = math.log(self.init_value)

    @property
    def value(self) -> float:
        """Current lambda."""
        return math.exp(self.log_value)

    def update(self, mean_episode_cost: float | torch.Tensor) -> float:
        """One ascent step; a cost above the limit raises lambda, one below lowers it.

        Returns:
            The new lambda.
        """
        self.log_value += self.lr * (float(mean_episode_cost) - self.cost_limit)
        return self.value
