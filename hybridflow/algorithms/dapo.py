"""DAPO's reward-side pieces (Yu et al. 2025, arXiv 2503.14476): overlong reward shaping and the
group test of dynamic sampling. Clip-higher and token-level loss aggregation live in ``losses``
(``actor.clip_ratio_high``, ``actor.loss_agg_mode``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridflow.errors import ArgumentError


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int,
                     penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13), added to each response's score.

    With Lmax = ``max_tokens`` and L = ``buffer``: 0 for |y| <= Lmax - L, then linear down to
    ``-penalty`` at |y| = Lmax: ``((Lmax - L) - |y|) / L * penalty``; -penalty beyond Lmax.

    Args:
        lengths: [B] response lengths in tokens (any numeric dtype).
        max_tokens: Lmax, the generation limit.
        buffer: L, the width of the punished band, 0 < L < Lmax.
        penalty: the penalty at Lmax (>= 0).

    Returns:
        [B] float32, in [-penalty, 0].
    """
    if not 0 < buffer < max_tokens:
        raise ArgumentError("buffer", f"must be in (0, max_tokens={max_tokens}), got {buffer}")
    over = (lengths.float() - (max_tokens - buffer)) / buffer
    return -over.clamp(min=0.0, max=1.0) * penalty


def group_rewards_differ(scores: torch.Tensor, group_ids: Sequence[int]
                         ) -> tuple[list[int], torch.Tensor]:
    """Which groups have rewards that are not all equal: DAPO's dynamic-sampling filter (eq. 11,
    0 < |correct| < G). A group of equal rewards has zero GRPO / RLOO advantage everywhere, so it
    adds no gradient.

    Args:
        scores: [B] per-sample rewards.
        group_ids: [B] the group (prompt) of each sample.

    Returns:
        (the G distinct group ids in order of first appearance, [G] bool: True where the group's
        scores differ).
    """
    if len(group_ids) != scores.shape[0]:
        raise ArgumentError("group_ids", f"has {len(group_ids)} entries for {scores.shape[0]} "
                                         "scores")
    ids = list(dict.fromkeys(int(g) for g in group_ids))
    index = {g: k for k, g in enumerate(ids)}
    which = torch.tensor([index[int(g)] for g in group_ids], dtype=torch.long)
    low = torch.full((len(ids),), float("inf")).scatter_reduce(0, which, scores.float(), "amin")
    high = torch.full((len(ids),), float("-inf")).scatter_reduce(0, which, scores.float(), "amax")
    return ids, high > low
