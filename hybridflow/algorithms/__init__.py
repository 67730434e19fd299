"""RL maths as pure tensor functions: advantage estimators, PPO losses, KL control, Safe RLHF,
rollout/training mismatch, and the actor's objective composed of them."""

from hybridflow.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_gae,
    compute_grpo_advantage,
    compute_reinforce_pp_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
    compute_safe_rlhf_advantage,
    masked_mean,
    masked_var,
    masked_whiten,
)
from hybridflow.algorithms.dapo import group_rewards_differ, overlong_penalty
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
    vocab_parallel_entropy,
)
from hybridflow.algorithms.mismatch import (
    RolloutCorrectionConfig,
    rollout_correction,
    rollout_mismatch,
)
from hybridflow.algorithms.objective import (
    ActorObjective,
    actor_loss,
    actor_loss_fn,
    prepare_rollout_correction,
)
from hybridflow.algorithms.safe_rlhf import LagrangeMultiplier, safe_rlhf_token_rewards

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ActorObjective",
    "AdaptiveKLController",
    "AdvantageInputs",
    "FixedKLController",
    "LagrangeMultiplier",
    "RolloutCorrectionConfig",
    "actor_loss",
    "actor_loss_fn",
    "aggregate_loss",
    "apply_kl_reward_penalty",
    "compute_gae",
    "compute_grpo_advantage",
    "compute_reinforce_pp_advantage",
    "compute_remax_advantage",
    "compute_rloo_advantage",
    "compute_safe_rlhf_advantage",
    "entropy_from_logits",
    "entropy_loss",
    "estimate_advantages",
    "group_rewards_differ",
    "kl_penalty",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "policy_loss",
    "prepare_rollout_correction",
    "rollout_correction",
    "rollout_mismatch",
    "safe_rlhf_token_rewards",
    "value_loss",
    "vocab_parallel_entropy",
]
