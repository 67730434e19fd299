"""Advantage estimators: GAE, GRPO, ReMax, RLOO, REINFORCE++ and Safe RLHF's PPO-Lagrangian, plus
masked statistics.

Every function is a pure tensor function over a batch of B responses padded to T tokens. ``mask``
is the [B, T] response mask (bool or 0/1 float): 1 on tokens the policy generated, 0 on padding
and on tokens it did not generate (e.g. tool output spliced into a multi-turn response). Masked
positions never influence a result and come out as 0, whatever garbage (even inf or NaN) they hold.

``ADVANTAGE_ESTIMATORS`` is the plug point a trainer calls through: ``fn(AdvantageInputs) ->
(advantages, targets)``, ``targets`` the regression targets of the value models it trains.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hybridflow.errors import ArgumentError

# ---------------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------------


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is set.

    Args:
        x: any shape, e.g. [B, T].
        mask: same shape as ``x`` (bool or 0/1 float).
        dim: reduce over this dim only; None reduces over everything.

    Returns:
        A scalar for ``dim=None``, else ``x`` with ``dim`` removed. An all-masked slice gives 0.
    """
    keep = mask.bool()
    # where, not x * mask: padding often holds -inf log-probs, and -inf * 0 is NaN.
    total = torch.where(keep, x, 0.0).sum(dim=dim)
    # clamp: an empty slice gives 0 rather than NaN; exact for 0/1 masks.
    count = keep.sum(dim=dim).clamp_min(1).to(total.dtype)
    return total / count


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all entries where ``mask`` is set.

    Args:
        x: any shape, e.g. [B, T].
        mask: same shape as ``x``.
        unbiased: divide by n - 1 (Bessel) instead of n.

    Returns:
        Scalar. Fewer than two valid entries give 0 (no spread can be measured).
    """
    keep = mask.bool()
    centered = torch.where(keep, x - masked_mean(x, mask), 0.0)
    n = keep.sum()
    denom = (n - 1 if unbiased else n).clamp_min(1).to(x.dtype)
    return centered.square().sum() / denom


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``x`` to unit variance (and zero mean) using only its valid entries.

    Args:
        x: any shape, e.g. [B, T].
        mask: same shape as ``x``.
        shift_mean: subtract the mean; False keeps it (scale only, as PPO's reward whitening).
        eps: added to the variance before the square root.

    Returns:
        Same shape as ``x``; 0 where ``mask`` is 0.
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, 0.0)


# ---------------------------------------------------------------------------------------------
# Argument checks and group bookkeeping
# ---------------------------------------------------------------------------------------------


def _check_unit_interval(field: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ArgumentError(field, f"must be in [0, 1], got {value!r}")


def _check_mask_2d(mask: torch.Tensor) -> None:
    if mask.dim() != 2:
        raise ArgumentError("mask", f"must be [B, T], got shape {tuple(mask.shape)}")


def _check_token_shape(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    if x.shape != mask.shape:
        raise ArgumentError(name, f"shape {tuple(x.shape)} does not match mask {tuple(mask.shape)}")


def _check_seq_shape(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    _check_mask_2d(mask)
    if x.shape != mask.shape[:1]:
        raise ArgumentError(name, f"must be [B] = [{mask.shape[0]}], got shape {tuple(x.shape)}")


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T]: the sequence's value on each valid token, 0 elsewhere."""
    return per_seq.unsqueeze(-1) * mask.to(per_seq.dtype)


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor | Sequence) -> tuple[torch.Tensor, ...]:
    """Per-sample statistics of the sample's group.

    Args:
        scores: [B] outcome scores.
        group_ids: [B] int tensor, or a length-B sequence of hashables (e.g. prompt uids).

    Returns:
        (count, total, sq_dev_total), each [B]: the group's size, its score sum, and its sum of
        squared deviations from the group mean.
    """
    if isinstance(group_ids, torch.Tensor):
        ids = group_ids.to(scores.device)
    else:
        # torch.unique needs numbers; number any hashable uid (str, int) by first appearance.
        index = {}
        ids = torch.tensor([index.setdefault(g, len(index)) for g in group_ids], device=scores.device)
    if ids.shape != scores.shape:
        raise ArgumentError("group_ids", f"must have one id per sample ({scores.shape[0]}), "
                                         f"got shape {tuple(ids.shape)}")
    unique_ids, inverse = torch.unique(ids, return_inverse=True)
    n_groups = unique_ids.numel()

    def per_group_sum(v: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n_groups, dtype=v.dtype, device=v.device).index_add_(0, inverse, v)[inverse]

    count = per_group_sum(torch.ones_like(scores))
    total = per_group_sum(scores)
    sq_dev_total = per_group_sum((scores - total / count).square())
    return count, total, sq_dev_total


# ---------------------------------------------------------------------------------------------
# Estimators
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def compute_gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2015, arXiv 1506.02438, eq. 16).

    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1}, where t+1
    is the next *valid* token: masked tokens are skipped, not treated as steps, and the value
    after the last valid token is 0 (the episode ends there). Not whitened; the caller decides.

    Args:
        token_rewards: [B, T] per-token rewards (typically -kl_coef * kl, plus the score on the
            last valid token).
        values: [B, T] critic values V(s_t).
        mask: [B, T] response mask.
        gamma: discount, in [0, 1].
        lam: GAE lambda, in [0, 1].

    Returns:
        (advantages, returns), each [B, T] and 0 on masked tokens; returns = advantages + values.
    """
    _check_unit_interval("gamma", gamma)
    _check_unit_interval("lam", lam)
    _check_mask_2d(mask)
    _check_token_shape("token_rewards", token_rewards, mask)
    _check_token_shape("values", values, mask)

    keep = mask.bool()
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(mask.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        # A masked token passes the later state through unchanged, so it is invisible.
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        next_adv = torch.where(keep[:, t], adv, next_adv)
        advantages[:, t] = next_adv
    advantages = torch.where(keep, advantages, 0.0)
    returns = torch.where(keep, advantages + values, 0.0)
    return advantages, returns


@torch.no_grad()
def compute_grpo_advantage(scores: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor | Sequence,
                           eps: float = 1e-6, norm_by_std: bool = True) -> torch.Tensor:
    """GRPO outcome advantage (Shao et al. 2024, arXiv 2402.03300, sec. 4.1.2).

    A_i = (s_i - mean(group)) / (std(group) + eps) on every valid token of response i, std
    unbiased. ``norm_by_std=False`` gives Dr. GRPO (arXiv 2503.20783): s_i - mean(group), which
    does not up-weight groups whose scores barely differ. A group of one has no baseline: A = 0.

    Args:
        scores: [B] outcome score of each response.
        mask: [B, T] response mask.
        group_ids: [B] int tensor or length-B sequence; responses to one prompt share an id.
        eps: added to the std so all-equal groups give 0, not NaN.
        norm_by_std: divide by the group std (GRPO) or not (Dr. GRPO).

    Returns:
        [B, T] advantages, 0 on masked tokens.
    """
    if not eps > 0:
        raise ArgumentError("eps", f"must be > 0 (a group of one has std 0), got {eps!r}")
    _check_seq_shape("scores", scores, mask)
    count, total, sq_dev_total = _group_stats(scores, group_ids)
    adv = scores - total / count  # exactly 0 for a group of one
    if norm_by_std:
        std = (sq_dev_total / (count - 1).clamp_min(1)).sqrt()
        adv = adv / (std + eps)
    return _broadcast(adv, mask)


@torch.no_grad()
def compute_remax_advantage(scores: torch.Tensor, baseline_scores: torch.Tensor,
                            mask: torch.Tensor) -> torch.Tensor:
    """ReMax advantage (Li et al. 2023, arXiv 2310.10505, Alg. 1): the sampled response's score
    minus the score of the greedy response to the same prompt.

    Args:
        scores: [B] score of each sampled response.
        baseline_scores: [B] score of the greedy response to the same prompt.
        mask: [B, T] response mask of the sampled responses.

    Returns:
        [B, T] advantages, 0 on masked tokens.
    """
    _check_seq_shape("scores", scores, mask)
    _check_seq_shape("baseline_scores", baseline_scores, mask)
    return _broadcast(scores - baseline_scores, mask)


@torch.no_grad()
def compute_rloo_advantage(scores: torch.Tensor, mask: torch.Tensor,
                           group_ids: torch.Tensor | Sequence) -> torch.Tensor:
    """RLOO advantage (Ahmadian et al. 2024, arXiv 2402.14740): each response's score
    minus the mean score of the *other* responses to its prompt. A group of one has no others:
    A = 0.

    Args:
        scores: [B] outcome score of each response.
        mask: [B, T] response mask.
        group_ids: [B] int tensor or length-B sequence; responses to one prompt share an id.

    Returns:
        [B, T] advantages, 0 on masked tokens.
    """
    _check_seq_shape("scores", scores, mask)
    count, total, _ = _group_stats(scores, group_ids)
    others_mean = (total - scores) / (count - 1).clamp_min(1)
    adv = torch.where(count > 1, scores - others_mean, torch.zeros_like(scores))
    return _broadcast(adv, mask)


@torch.no_grad()
def compute_reinforce_pp_advantage(token_rewards: torch.Tensor, mask: torch.Tensor,
                                   gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++ advantage (Hu 2025, arXiv 2501.03262): the discounted return-to-go
    G_t = r_t + gamma * G_{t+1} over valid tokens, whitened over all valid tokens of the batch.

    Args:
        token_rewards: [B, T] per-token rewards (KL penalty on every token, score on the last).
        mask: [B, T] response mask.
        gamma: discount, in [0, 1].

    Returns:
        [B, T] advantages, 0 on masked tokens.
    """
    # GAE with V = 0 and lam = 1 is exactly the discounted return-to-go, masked skipping included.
    returns_to_go, _ = compute_gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma, 1.0)
    return masked_whiten(returns_to_go, mask)


@torch.no_grad()
def compute_safe_rlhf_advantage(token_rewards: torch.Tensor, token_costs: torch.Tensor,
                                values: torch.Tensor, cost_values: torch.Tensor,
                                mask: torch.Tensor, gamma: float, lam: float,
                                lagrange: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Safe RLHF's PPO-Lagrangian advantage (Dai et al. 2023, arXiv 2310.12773; the
    ``ppo_lag`` trainer of PKU-Alignment's safe-rlhf): GAE of the reward stream with the critic's
    values and of the cost stream with the cost critic's, combined as
    (A_r - lambda * A_c) / (1 + lambda). Dividing by 1 + lambda keeps the advantage's scale, and
    so the policy's step, from growing with lambda.

    Args:
        token_rewards: [B, T] per-token rewards (``safe_rlhf_token_rewards``).
        token_costs: [B, T] per-token costs (higher = less safe), likewise.
        values: [B, T] the critic's values of the reward stream.
        cost_values: [B, T] the cost critic's values of the cost stream.
        mask: [B, T] response mask.
        gamma: discount, in [0, 1], of both streams.
        lam: GAE lambda, in [0, 1], of both streams.
        lagrange: the Lagrange multiplier lambda, >= 0 (``LagrangeMultiplier.value``).

    Returns:
        (advantages, returns, cost_returns), each [B, T] and 0 on masked tokens: the combined
        advantage and each critic's regression target.
    """
    if not lagrange >= 0:
        raise ArgumentError("lagrange", f"must be >= 0, got {lagrange!r}")
    reward_adv, returns = compute_gae(token_rewards, values, mask, gamma, lam)
    cost_adv, cost_returns = compute_gae(token_costs, cost_values, mask, gamma, lam)
    return (reward_adv - lagrange * cost_adv) / (1.0 + lagrange), returns, cost_returns


# ---------------------------------------------------------------------------------------------
# Uniform entry point for the trainer
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class AdvantageInputs:
    """Everything an advantage estimator may read; each estimator uses a subset."""

    mask: torch.Tensor
    """[B, T] response mask."""
    scores: torch.Tensor | None = None
    """[B] outcome score per response (grpo, remax, rloo)."""
    token_rewards: torch.Tensor | None = None
    """[B, T] per-token rewards (gae, reinforce_plus_plus, safe_rlhf)."""
    values: torch.Tensor | None = None
    """[B, T] critic values (gae, safe_rlhf)."""
    token_costs: torch.Tensor | None = None
    """[B, T] per-token costs (safe_rlhf)."""
    cost_values: torch.Tensor | None = None
    """[B, T] cost critic values (safe_rlhf)."""
    lagrange: float | None = None
    """The Lagrange multiplier lambda (safe_rlhf)."""
    group_ids: torch.Tensor | Sequence | None = None
    """[B] prompt id per response; responses to one prompt share it (grpo, rloo)."""
    baseline_scores: torch.Tensor | None = None
    """[B] score of the greedy response to the same prompt (remax)."""
    gamma: float = 1.0
    """Discount (gae, reinforce_plus_plus, safe_rlhf)."""
    lam: float = 1.0
    """GAE lambda (gae, safe_rlhf)."""
    norm_by_std: bool = True
    """grpo: divide by the group std; False is Dr. GRPO."""

    def __post_init__(self) -> None:
        _check_unit_interval("gamma", self.gamma)
        _check_unit_interval("lam", self.lam)

    def require(self, name: str, estimator: str):
        """The field ``name``, or an ArgumentError saying ``estimator`` needs it."""
        value = getattr(self, name)
        if value is None:
            raise ArgumentError(f"AdvantageInputs.{name}", f"the {estimator!r} estimator needs it; pass it")
        return value


Targets = dict[str, torch.Tensor]
AdvantageFn = Callable[[AdvantageInputs], tuple[torch.Tensor, Targets]]


def _gae(x: AdvantageInputs) -> tuple[torch.Tensor, Targets]:
    adv, returns = compute_gae(x.require("token_rewards", "gae"), x.require("values", "gae"),
                               x.mask, x.gamma, x.lam)
    return adv, {"returns": returns}


def _grpo(x: AdvantageInputs) -> tuple[torch.Tensor, Targets]:
    return compute_grpo_advantage(x.require("scores", "grpo"), x.mask, x.require("group_ids", "grpo"),
                                  norm_by_std=x.norm_by_std), {}


def _remax(x: AdvantageInputs) -> tuple[torch.Tensor, Targets]:
    return compute_remax_advantage(x.require("scores", "remax"), x.require("baseline_scores", "remax"),
                                   x.mask), {}


def _rloo(x: AdvantageInputs) -> tuple[torch.Tensor, Targets]:
    return compute_rloo_advantage(x.require("scores", "rloo"), x.mask, x.require("group_ids", "rloo")), {}


def _reinforce_pp(x: AdvantageInputs) -> tuple[torch.Tensor, Targets]:
    return compute_reinforce_pp_advantage(x.require("token_rewards", "reinforce_plus_plus"), x.mask,
                                          x.gamma), {}


def _safe_rlhf(x: AdvantageInputs) -> tuple[torch.Tensor, Targets]:
    need = "safe_rlhf"
    adv, returns, cost_returns = compute_safe_rlhf_advantage(
        x.require("token_rewards", need), x.require("token_costs", need),
        x.require("values", need), x.require("cost_values", need), x.mask, x.gamma, x.lam,
        x.require("lagrange", need))
    return adv, {"returns": returns, "cost_returns": cost_returns}


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "gae": _gae,
    "grpo": _grpo,
    "remax": _remax,
    "rloo": _rloo,
    "reinforce_plus_plus": _reinforce_pp,
    "safe_rlhf": _safe_rlhf,
}
"""Name -> ``fn(AdvantageInputs) -> (advantages [B, T], targets)``. ``targets``: the regression
target [B, T] of each value model the algorithm trains, by the batch key its worker reads:
``returns`` (the critic: gae, safe_rlhf) and ``cost_returns`` (safe_rlhf's cost critic); {} for
the critic-free estimators."""
