"""The actor's objective, composed from the pure terms of ``losses``, ``kl`` and ``mismatch``:

    loss = policy_loss + kl_loss_coef * kl_loss + entropy_coef * entropy_loss

each term aggregated by ``loss_agg_mode`` over the mini-batch's global denominator, so that a
micro-batch's loss is its share of the mini-batch's objective. The rollout correction (TIS
weights or the MIS mask) is prepared once per update, before the first micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from hybridflow.algorithms.advantages import masked_mean
from hybridflow.algorithms.kl import kl_penalty
from hybridflow.algorithms.losses import aggregate_loss, entropy_loss, policy_loss, sequence_slots
from hybridflow.algorithms.mismatch import RolloutCorrectionConfig, rollout_correction


@dataclass(frozen=True, kw_only=True)
class ActorObjective:
    """What the actor's loss depends on: ActorConfig's fields of the same names, documented
    there."""

    clip_ratio_low: float
    clip_ratio_high: float
    dual_clip_c: float | None
    loss_agg_mode: str
    ratio_level: str
    kl_loss_coef: float
    kl_loss_type: str
    entropy_coef: float

    @classmethod
    def of(cls, config) -> ActorObjective:
        """The objective of ``config``, anything with these fields (an ActorConfig)."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})


def actor_loss(logprobs: torch.Tensor, mb: dict[str, torch.Tensor], denominator: float,
               objective: ActorObjective) -> tuple[torch.Tensor, dict]:
    """A micro-batch's share of the actor's objective, and its metrics (a ``LossFn`` of
    ``hybridflow.training.engine`` once the denominator and objective are bound).

    Args:
        logprobs: [B, T] log-probs of the taken tokens under the policy being trained.
        mb: the micro-batch, [B, T] each: "response_mask", "advantages"; "old_logprobs" (absent:
            the update is on-policy and ``logprobs``, detached, are the old ones); "tis_weights"
            (optional, see ``prepare_rollout_correction``); "ref_logprobs" when kl_loss_coef > 0;
            "entropy" (the policy's, with grad) when entropy_coef > 0.
        denominator: the mini-batch's global count for loss_agg_mode, see ``aggregate_loss``.
        objective: the loss's options.

    Returns:
        (loss, metrics). loss: scalar. metrics, as ``LossFn`` takes them: "actor/pg_loss" and,
        with the KL term, "actor/kl_loss" (shares of the objective); (mean, count) pairs
        "actor/clip_frac" and "actor/dual_clip_frac" (over response tokens, or at the sequence
        ratio level over sequences with one), "actor/approx_kl" and, with the entropy term,
        "actor/entropy" (over response tokens).
    """
    o = objective
    mask = mb["response_mask"]
    old = mb["old_logprobs"] if "old_logprobs" in mb else logprobs.detach()
    loss, m = policy_loss(logprobs, old, mb["advantages"], mask, o.clip_ratio_low,
                          o.clip_ratio_high, o.dual_clip_c, o.loss_agg_mode, denominator,
                          o.ratio_level, mb.get("tis_weights"))
    # Losses are shares of the mini-batch's objective (its global denominator); the other
    # metrics are means over what policy_loss counts them over: response tokens, or for the
    # clip fractions at the sequence level, sequences.
    tokens = mask.bool().sum()
    slots = tokens if o.ratio_level == "token" else sequence_slots(mask).sum()
    metrics = {"actor/pg_loss": loss, "actor/clip_frac": (m["clip_frac"], slots),
               "actor/approx_kl": (m["approx_kl"], tokens),
               "actor/dual_clip_frac": (m["dual_clip_frac"], slots)}
    if o.kl_loss_coef:
        kl = aggregate_loss(kl_penalty(logprobs, mb["ref_logprobs"], o.kl_loss_type), mask,
                            o.loss_agg_mode, denominator)
        loss = loss + o.kl_loss_coef * kl
        metrics["actor/kl_loss"] = kl
    if o.entropy_coef:
        loss = loss + o.entropy_coef * entropy_loss(mb["entropy"], mask, o.loss_agg_mode,
                                                    denominator)
        metrics["actor/entropy"] = (masked_mean(mb["entropy"], mask), tokens)
    return loss, metrics


def actor_loss_fn(objective: ActorObjective, denominator: float, seen: list | None = None
                  ) -> Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]:
    """The loss function the actor's update hands ``TrainEngine.train_step`` for one
    mini-batch: ``actor_loss`` bound to ``objective`` and the mini-batch's ``denominator``. With
    ``seen`` (an on-policy update, which gives the old log-probs back) each micro-batch's
    log-probs, detached, and the micro-batch are appended to it."""
    def loss_fn(logprobs: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict]:
        if seen is not None:
            seen.append((logprobs.detach(), mb))
        return actor_loss(logprobs, mb, denominator, objective)
    return loss_fn


def prepare_rollout_correction(data: dict[str, torch.Tensor], rollout_logprobs: torch.Tensor,
                               correction: RolloutCorrectionConfig,
                               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An update's data with the rollout correction applied, and its metrics.

    Fixed for the whole update: neither side is the policy being trained. TIS adds
    "tis_weights", which ``actor_loss`` multiplies the policy loss by; MIS narrows
    "response_mask" itself, so rejected tokens leave every loss term and the denominators
    counted from it.

    Args:
        data: the update's [B, T] tensors, "old_logprobs" and "response_mask" among them.
        rollout_logprobs: [B, T] the rollout engine's log-probs of the same tokens.
        correction: its mode ("tis" or "mis"), level and cap.

    Returns:
        (data, metrics): a new dict (the input is left as it is) and detached 0-dim metrics,
        "actor/tis_weight_mean" or "actor/mis_masked_frac".
    """
    weights, mask, m = rollout_correction(data["old_logprobs"], rollout_logprobs,
                                          data["response_mask"], correction.mode,
                                          correction.level, correction.cap)
    data = {**data, "response_mask": mask}
    if weights is not None:
        data["tis_weights"] = weights
    return data, {f"actor/{k}": v for k, v in m.items()}
