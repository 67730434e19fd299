"""Rollout/training mismatch: how far the rollout engine's log-probs are from the training
engine's on the same tokens, and the importance corrections for it (TIS, MIS).

Both sides are the raw model's log-probs (temperature 1, before top-k/top-p; see
``hybridflow.rollout.base``) of the same sampled tokens, computed by two engines (vLLM or a
decode kernel vs Megatron-Core, other kernels and precisions). With w = exp(train - rollout) per
token (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"):

    TIS: the policy-gradient loss of a token (or a sequence) is multiplied by min(w, cap);
    MIS: tokens (or whole sequences) with w outside [1/cap, cap] leave the loss.

Sequence level uses the sequence's w, the product of its tokens' (exp of the summed log-ratios).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridflow.algorithms.advantages import _check_token_shape, masked_mean
from hybridflow.algorithms.kl import kl_penalty
from hybridflow.algorithms.losses import LEVELS, sequence_slots
from hybridflow.errors import ArgumentError, check_choice, check_float

CORRECTION_MODES = ("none", "tis", "mis")


@dataclass(kw_only=True)
class RolloutCorrectionConfig:
    """Importance correction of the rollout engine's log-probs vs the training engine's."""

    mode: str = "none"
    """none; tis (truncated IS: the loss is weighted by min(exp(old - rollout), cap)); or mis
    (masked IS: tokens or sequences whose ratio is outside [1/cap, cap] leave the loss, and its
    denominator, as verl's rejection sampling does). The ratio corrects the engines' numerical
    mismatch only: at sampling temperature != 1 or with top-k/top-p both sides are still the
    raw model's log-probs, not the distribution the tokens were drawn from."""
    level: str = "token"
    """token: one ratio per token; sequence: the product of the sequence's token ratios."""
    cap: float = 2.0
    """TIS: the weight's upper bound; MIS: the ratio's bound above (1/cap below). > 1."""

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, CORRECTION_MODES)
        check_choice("level", self.level, LEVELS)
        check_float("cap", self.cap, low=1, low_open=True)


def rollout_mismatch(rollout_logprobs: torch.Tensor, train_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the rollout engine's log-probs are from the training engine's, over response
    tokens.

    Args:
        rollout_logprobs: [B, T] log-probs of the sampled tokens from the rollout engine.
        train_logprobs: [B, T] the same from the training engine (the batch's old_logprobs).
        mask: [B, T] response mask.

    Returns:
        Detached 0-dim tensors (0 where the mask is empty):
        "mismatch/abs_diff_mean", "mismatch/abs_diff_max": of |train - rollout|;
        "mismatch/kl": k3 estimate of KL(rollout || train), mean over tokens -- unbiased only
            where the tokens were drawn from the rollout's raw distribution (temperature 1, no
            top-k/top-p);
        "mismatch/ratio_outside_frac": tokens whose exp(train - rollout) is outside [0.5, 2].
    """
    _check_token_shape("rollout_logprobs", rollout_logprobs, mask)
    _check_token_shape("train_logprobs", train_logprobs, mask)
    with torch.no_grad():
        keep = mask.bool()
        diff = torch.where(keep, train_logprobs - rollout_logprobs, 0.0).float()
        abs_diff = diff.abs()
        return {
            "mismatch/abs_diff_mean": masked_mean(abs_diff, keep),
            "mismatch/abs_diff_max": abs_diff.amax() if abs_diff.numel() else abs_diff.sum(),
            "mismatch/kl": masked_mean(kl_penalty(rollout_logprobs.float(), train_logprobs.float(),
                                                  "k3"), keep),
            "mismatch/ratio_outside_frac": masked_mean((abs_diff > math.log(2.0)).float(), keep),
        }


def rollout_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                       mask: torch.Tensor, mode: str, level: str = "token", cap: float = 2.0
                       ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """TIS weights or the MIS mask, from w = exp(old_logprobs - rollout_logprobs).

    Neither depends on the policy being trained, so they are computed once per update.

    Args:
        old_logprobs: [B, T] the training engine's log-probs of the sampled tokens.
        rollout_logprobs: [B, T] the rollout engine's.
        mask: [B, T] response mask.
        mode: "tis" or "mis".
        level: "token" (w per token) or "sequence" (w_i = exp(sum_t (old - rollout)) over the
            sequence's response tokens, on each of them).
        cap: > 1. TIS: weight = min(w, cap). MIS: kept where 1/cap <= w <= cap.

    Returns:
        (weights, mask, metrics). weights: [B, T] detached loss multipliers (TIS), None for MIS.
        mask: the response mask with the rejected tokens zeroed (MIS), else ``mask`` itself.
        metrics (detached 0-dim): "tis_weight_mean" (mean weight over tokens, or over sequences
        with a response token at sequence level) or "mis_masked_frac" (fraction of tokens, or
        of such sequences, rejected).
    """
    if mode not in ("tis", "mis"):
        raise ArgumentError("mode", f"unknown mode {mode!r}; use tis or mis")
    if level not in LEVELS:
        raise ArgumentError("level", f"unknown level {level!r}; use one of {', '.join(LEVELS)}")
    if not cap > 1.0:
        raise ArgumentError("cap", f"must be > 1, got {cap!r}")
    _check_token_shape("old_logprobs", old_logprobs, mask)
    _check_token_shape("rollout_logprobs", rollout_logprobs, mask)
    with torch.no_grad():
        keep = mask.bool()
        log_w = torch.where(keep, old_logprobs - rollout_logprobs, 0.0).float()
        if level == "sequence":
            log_w = log_w.sum(dim=-1, keepdim=True).expand_as(log_w)
            counted = sequence_slots(mask)
        else:
            counted = keep
        log_cap = math.log(cap)
        if mode == "tis":
            # min in log space: exp of a long sequence's summed log-ratio would overflow.
            weights = torch.exp(log_w.clamp(max=log_cap))
            return weights, mask, {"tis_weight_mean": masked_mean(weights, counted)}
        rejected = log_w.abs() > log_cap
        return None, torch.where(rejected, 0, mask), {
            "mis_masked_frac": masked_mean(rejected.float(), counted)}
