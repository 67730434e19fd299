"""PPO losses: clipped policy surrogate with dual clip, clipped value loss, entropy bonus.

Each loss builds a [B, T] per-token matrix and reduces it with ``aggregate_loss``, the one place
that decides how tokens and sequences are weighted. Metrics come back as detached 0-dim tensors so
that computing them never forces a device sync; the caller calls ``.item()`` when it logs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridflow.algorithms.advantages import _check_token_shape, masked_mean
from hybridflow.errors import ArgumentError

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
LEVELS = ("token", "sequence")


def sequence_slots(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool, set at position 0 of each sequence with a valid token: where a per-sequence
    value broadcast over its tokens is counted once (e.g. in a fraction of sequences)."""
    first = torch.arange(mask.shape[-1], device=mask.device) == 0
    return mask.bool().any(dim=-1, keepdim=True) & first


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
                   denominator: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    Modes:
        "token-mean": sum over all valid tokens / their count; every token weighs the same, so
            long responses weigh more (DAPO, arXiv 2503.14476, sec. 3.3).
        "seq-mean-token-sum": each sequence's token sum, averaged over sequences (Dr. GRPO,
            arXiv 2503.20783, up to its constant normaliser).
        "seq-mean-token-mean": each sequence's token mean, averaged over sequences (original
            GRPO); every sequence weighs the same.
    Sequences with no valid token are left out of the sequence average.

    Args:
        loss_mat: [B, T] per-token loss.
        mask: [B, T] response mask.
        mode: one of the modes above.
        denominator: the global count (valid tokens for "token-mean", sequences with a valid
            token otherwise) when this batch is one piece of a larger one -- a micro-batch on one
            data-parallel rank. The pieces' results then add up to the global aggregate.

    Returns:
        Scalar loss.
    """
    _check_token_shape("loss_mat", loss_mat, mask)
    if mode == "token-mean":
        if denominator is not None:
            return torch.where(mask.bool(), loss_mat, 0.0).sum() / denominator
        return masked_mean(loss_mat, mask)
    has_tokens = mask.bool().any(dim=-1)
    if mode == "seq-mean-token-sum":
        per_seq = torch.where(mask.bool(), loss_mat, 0.0).sum(dim=-1)
    elif mode == "seq-mean-token-mean":
        per_seq = masked_mean(loss_mat, mask, dim=-1)
    else:
        raise ArgumentError("mode",
                            f"unknown mode {mode!r}; use one of {', '.join(AGG_MODES)}")
    if denominator is not None:
        return torch.where(has_tokens, per_seq, 0.0).sum() / denominator
    return masked_mean(per_seq, has_tokens)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                dual_clip_c: float | None = None, agg: str = "token-mean",
                denominator: float | None = None, ratio_level: str = "token",
                weights: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347, eq. 7), optionally with
    dual clip (Ye et al. 2019, arXiv 1912.09729), per token or per sequence (GSPO).

    Per token, with r = exp(logprobs - old_logprobs):
        L = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
    and with dual clip, where A < 0: L = min(L, -dual_clip_c * A). Without it, a token whose
    ratio has exploded under a negative advantage contributes an unbounded loss.

    At ``ratio_level="sequence"`` (GSPO, Zheng et al. 2025, arXiv 2507.18071) the same
    L is computed once per sequence i, from the length-normalised sequence ratio
    s_i = exp(mean_t (logprobs - old_logprobs)) over its response tokens and its mean advantage
    (GRPO's is the same on every token), and stands on each of its tokens for ``agg``:
    seq-mean-token-mean then averages the L_i as the paper does. The gradient reaches every
    token's log-prob through the mean.

    Args:
        logprobs: [B, T] log-probs of the taken tokens under the current policy (with grad).
        old_logprobs: [B, T] the same under the policy that sampled them.
        advantages: [B, T].
        mask: [B, T] response mask.
        clip_ratio_low: lower clip, in (0, 1).
        clip_ratio_high: upper clip, > 0; above clip_ratio_low is DAPO's clip-higher.
        dual_clip_c: dual-clip constant, > 1 (3.0 in the paper); None disables it.
        agg: aggregation mode, see ``aggregate_loss``.
        denominator: global count for ``agg``, see ``aggregate_loss``.
        ratio_level: "token" (PPO) or "sequence" (GSPO).
        weights: [B, T] loss multipliers, taken as constants (e.g. TIS weights, see
            ``hybridflow.algorithms.mismatch``); None for 1.

    Returns:
        (loss, metrics). loss is a scalar. metrics: "clip_frac" (valid tokens -- sequences with
        a valid token at sequence level -- where the ratio clip binds), "approx_kl" (mean of
        old_logprobs - logprobs over tokens, an estimate of KL(old || new)), "dual_clip_frac"
        (as clip_frac, where the dual clip binds).
    """
    if not 0.0 < clip_ratio_low < 1.0:
        raise ArgumentError("clip_ratio_low", f"must be in (0, 1), got {clip_ratio_low!r}")
    if not clip_ratio_high > 0.0:
        raise ArgumentError("clip_ratio_high", f"must be > 0, got {clip_ratio_high!r}")
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ArgumentError("dual_clip_c",
                            f"must be > 1 (typically 3.0), or None to disable, got {dual_clip_c!r}")
    if ratio_level not in LEVELS:
        raise ArgumentError("ratio_level", f"unknown level {ratio_level!r}; use one of "
                                           f"{', '.join(LEVELS)}")
    for name, x in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages)):
        _check_token_shape(name, x, mask)
    if weights is not None:
        _check_token_shape("weights", weights, mask)

    # Zeroed on padding so garbage there (even -inf - -inf = NaN) gets an exact 0 gradient, not
    # 0 * NaN; clamped because e^20 already saturates every clip.
    log_ratio = torch.where(mask.bool(), logprobs - old_logprobs, 0.0).clamp(-20.0, 20.0)
    with torch.no_grad():
        approx_kl = masked_mean(-log_ratio, mask)
    counted = mask.bool()
    if ratio_level == "sequence":
        log_ratio = masked_mean(log_ratio, mask, dim=-1)[:, None].expand_as(log_ratio)
        advantages = masked_mean(advantages, mask, dim=-1)[:, None].expand_as(advantages)
        counted = sequence_slots(mask)
    loss_mat, clip_frac, dual_clip_frac = _clipped_surrogate(
        log_ratio, advantages, counted, clip_ratio_low, clip_ratio_high, dual_clip_c)
    if weights is not None:
        loss_mat = loss_mat * weights.detach()
    loss = aggregate_loss(loss_mat, mask, agg, denominator)
    return loss, {"clip_frac": clip_frac, "approx_kl": approx_kl, "dual_clip_frac": dual_clip_frac}


def _clipped_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, counted: torch.Tensor,
                       clip_ratio_low: float, clip_ratio_high: float, dual_clip_c: float | None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``policy_loss``'s per-token L from the log-ratio and advantage on each token ([B, T]
    each, at either ratio level), and the fractions of ``counted`` (a [B, T] mask) where the
    ratio clip and the dual clip bind: (loss_mat, clip_frac, dual_clip_frac)."""
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        clip_frac = masked_mean((clipped > unclipped).float(), counted)
    if dual_clip_c is None:
        return loss_mat, clip_frac, torch.zeros((), device=log_ratio.device)
    bound = -dual_clip_c * advantages
    negative = advantages < 0
    with torch.no_grad():
        dual_clip_frac = masked_mean((negative & (loss_mat > bound)).float(), counted)
    loss_mat = torch.where(negative, torch.minimum(loss_mat, bound), loss_mat)
    return loss_mat, clip_frac, dual_clip_frac


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_range: float | None = 0.2, agg: str = "token-mean",
               denominator: float | None = None,
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO as in OpenAI baselines ppo2; discussed in Engstrom et al.
    2020, arXiv 2005.12729):

        V_clip = old_values + clip(values - old_values, -clip_range, clip_range)
        L = 0.5 * max((values - returns)^2, (V_clip - returns)^2)

    Args:
        values: [B, T] current critic output (with grad).
        old_values: [B, T] critic output when the batch was collected.
        returns: [B, T] regression targets (GAE returns).
        mask: [B, T] response mask.
        clip_range: > 0; None gives the plain 0.5 * squared error.
        agg: aggregation mode, see ``aggregate_loss``.

    Returns:
        (loss, metrics). metrics: "vf_clip_frac", the valid tokens where the clipped term is the
        larger one (so it sets the loss and its gradient is 0).
    """
    if clip_range is not None and not clip_range > 0.0:
        raise ArgumentError("clip_range",
                            f"must be > 0, or None to disable, got {clip_range!r}")
    for name, x in (("values", values), ("old_values", old_values), ("returns", returns)):
        _check_token_shape(name, x, mask)

    # Cut the graph at padding: a NaN return there would otherwise send 0 * NaN = NaN into the critic.
    values = torch.where(mask.bool(), values, 0.0)
    unclipped = (values - returns).square()
    if clip_range is None:
        loss_mat = unclipped
        vf_clip_frac = torch.zeros((), device=values.device)
    else:
        values_clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (values_clipped - returns).square()
        loss_mat = torch.maximum(unclipped, clipped)
        with torch.no_grad():
            vf_clip_frac = masked_mean((clipped > unclipped).float(), mask)
    return 0.5 * aggregate_loss(loss_mat, mask, agg, denominator), {"vf_clip_frac": vf_clip_frac}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution at each position.

    H = logsumexp(z) - sum_v softmax(z)_v * z_v, which never takes the log of a probability
    that underflowed to 0.

    Args:
        logits: [B, T, V], finite (a -inf logit gives 0 * -inf = NaN). Computed in fp32.

    Returns:
        [B, T] entropy in nats, in the logits' dtype.
    """
    return vocab_parallel_entropy(logits).to(logits.dtype)


def vocab_parallel_entropy(logits: torch.Tensor, group=None) -> torch.Tensor:
    """``entropy_from_logits`` of the full vocabulary when each tensor-parallel rank holds a slice
    of it; only [B, T] sums cross ranks, never the logits.

    With m the (global) max logit, y = z - m and e = exp(y): H = log sum_v e_v - sum_v e_v y_v /
    sum_v e_v. The two sums go through Megatron's ``reduce_from_tensor_model_parallel_region``
    (all-reduce forward, identity backward): every rank computes the same H and the same loss from
    it, so the gradient of a rank's slice is its local term. m is a constant shift that H does not
    depend on, so it needs no gradient.

    Args:
        logits: [B, T, V / tp], this rank's vocabulary slice, finite. Computed in fp32.
        group: the tensor-parallel group; None when ``logits`` hold the whole vocabulary.

    Returns:
        [B, T] entropy in nats, the same on every rank of ``group``.
    """
    z = logits.float()
    parallel = group is not None and dist.get_world_size(group) > 1
    m = z.detach().max(dim=-1, keepdim=True).values
    if parallel:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    y = z - m
    e = torch.exp(y)
    sums = torch.stack([e.sum(dim=-1), (e * y).sum(dim=-1)])
    if parallel:
        # deferred: Megatron
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
        sums = reduce_from_tensor_model_parallel_region(sums, group)
    return torch.log(sums[0]) - sums[1] / sums[0]


def entropy_loss(entropy: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean",
                 denominator: float | None = None) -> torch.Tensor:
    """Entropy bonus as a loss: the *negated* aggregated entropy, so that
    ``total = pg_loss + entropy_coef * entropy_loss(...)`` raises entropy as it is minimised.

    Args:
        entropy: [B, T], e.g. from ``entropy_from_logits``.
        mask: [B, T] response mask.
        agg: aggregation mode, see ``aggregate_loss``.

    Returns:
        Scalar, <= 0.
    """
    return -aggregate_loss(entropy, mask, agg, denominator)
