"""KL to the reference policy: per-token estimators, the KL-shaped reward, and coefficient control.

The estimators are Schulman's (http://joschu.net/blog/kl-approx.html) for KL(pi || pi_ref) from
tokens sampled by pi, with log-ratio x = logprobs - ref_logprobs:
    k1 = x                         unbiased, high variance, can be negative
    k2 = x^2 / 2                   biased, low variance, >= 0
    k3 = exp(-x) - 1 + x           unbiased, low variance, >= 0
    abs = |x|
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridflow.algorithms.advantages import _check_seq_shape, _check_token_shape
from hybridflow.errors import ArgumentError

KL_KINDS = ("k1", "k2", "k3", "abs")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref).

    Args:
        logprobs: [B, T] log-probs of the sampled tokens under the policy.
        ref_logprobs: [B, T] the same under the reference policy.
        kind: "k1", "k2", "k3" or "abs" (see the module docstring).

    Returns:
        [B, T]. Not masked; reduce it with a mask.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ArgumentError("ref_logprobs", f"shape {tuple(ref_logprobs.shape)} does not match "
                                            f"logprobs {tuple(logprobs.shape)}")
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "abs":
        return log_ratio.abs()
    if kind == "k3":
        # exp(-x) = p_ref / p explodes on a sampled token the policy now finds far less likely than
        # the reference does; the clamps keep one such token from dominating the batch and its
        # gradient from overflowing.
        neg = (-log_ratio).clamp(-20.0, 20.0)
        return (torch.exp(neg) - neg - 1.0).clamp(-10.0, 10.0)
    raise ArgumentError("kind", f"unknown kind {kind!r}; use one of {', '.join(KL_KINDS)}")


@torch.no_grad()
def apply_kl_reward_penalty(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                            mask: torch.Tensor, coef: float, kind: str = "k1") -> torch.Tensor:
    """Token rewards for PPO-style KL-in-reward (Ziegler et al. 2019, arXiv 1909.08593):
    r_t = -coef * kl_t on every valid token, plus the outcome score on the last valid token.

    Args:
        scores: [B] outcome score per response.
        logprobs: [B, T] policy log-probs of the sampled tokens (may be None where coef is 0).
        ref_logprobs: [B, T] reference log-probs of the same tokens (likewise).
        mask: [B, T] response mask.
        coef: KL coefficient, >= 0 (e.g. a controller's ``.value``).
        kind: KL estimator, see ``kl_penalty``.

    Returns:
        [B, T] token rewards, 0 on masked tokens. A response with no valid token gets nothing.
    """
    if coef < 0:
        raise ArgumentError("coef", f"must be >= 0, got {coef!r}")
    _check_seq_shape("scores", scores, mask)
    keep = mask.bool()
    if coef:
        _check_token_shape("logprobs", logprobs, mask)
        rewards = torch.where(keep, -coef * kl_penalty(logprobs, ref_logprobs, kind), 0.0)
    else:  # no penalty, so no log-probs needed (an on-policy update computes them later)
        rewards = torch.zeros(mask.shape, device=mask.device)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(keep)
    # Largest valid position per row; a row with no valid token gets index 0 and a zero score.
    last = torch.where(keep, positions, 0).amax(dim=-1)
    score = torch.where(keep.any(dim=-1), scores.to(rewards.dtype), 0.0)
    return rewards.scatter_add(1, last.unsqueeze(-1), score.unsqueeze(-1))


@dataclass(kw_only=True)
class FixedKLController:
    """A constant KL coefficient; the same interface as ``AdaptiveKLController``."""

    coef: float
    """The KL coefficient, >= 0."""

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise ArgumentError("coef", f"must be >= 0, got {self.coef!r}")

    @property
    def value(self) -> float:
        return self.coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Does nothing; here so the trainer need not know which controller it holds."""


@dataclass(kw_only=True)
class AdaptiveKLController:
    """Proportional controller that steers the observed KL towards ``target`` (Ziegler et al.
    2019, arXiv 1909.08593): e = clip(KL / target - 1, -0.2, 0.2) and
    coef <- coef * (1 + e * n_steps / horizon).
    """

    init_coef: float
    """Starting coefficient, > 0 (a multiplicative update cannot leave 0)."""
    target: float
    """KL the controller aims for, > 0."""
    horizon: float
    """In the units of n_steps (samples): a steady error e scales the coefficient by about exp(e)
    per horizon; > 0."""
    value: float = field(init=False)
    """Current coefficient."""

    def __post_init__(self) -> None:
        for name in ("init_coef", "target", "horizon"):
            if not getattr(self, name) > 0:
                raise ArgumentError(name, f"must be > 0, got {getattr(self, name)!r}")
        self.value = float(self.init_coef)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Adjust the coefficient after ``n_steps`` samples whose mean KL was ``current_kl``."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
