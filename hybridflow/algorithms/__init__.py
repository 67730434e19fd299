"""RL maths as pure tensor functions: advantage estimators, PPO losses, KL control, Safe RLHF."""

from hybridflow.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_gae,
    compute_grpo_advantage,
    compute_reinforce_pp_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
    masked_mean,
    masked_var,
    masked_whiten,
)
from hybridflow.algorithms.estimate import estimate_advantages
from hybridflow.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_reward_penalty,
    kl_penalty,
)
from hybridflow.algorithms.losses import (
    aggregate_loss,
    entropy_from_logits,
    entropy_loss,
    policy_loss,
    value_loss,
)
from hybridflow.algorithms.safe_rlhf import LagrangeMultiplier, safe_rlhf_combined_advantage

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdaptiveKLController",
    "AdvantageInputs",
    "FixedKLController",
    "LagrangeMultiplier",
    "aggregate_loss",
    "apply_kl_reward_penalty",
    "compute_gae",
    "compute_grpo_advantage",
    "compute_reinforce_pp_advantage",
    "compute_remax_advantage",
    "compute_rloo_advantage",
    "entropy_from_logits",
    "entropy_loss",
    "estimate_advantages",
    "kl_penalty",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "safe_rlhf_combined_advantage",
    "value_loss",
]
