"""What the workers share: the PPO update loop over mini-batches, the views of a Batch an engine
call takes, the reference's pass, and each rank's RNG state in a checkpoint."""

from __future__ import annotations

import io
from pathlib import Path

import torch
import torch.distributed as dist

from hybridflow.batch import Batch
from hybridflow.checkpoint import writing
from hybridflow.errors import ConfigError
from hybridflow.rollout.base import rollout_batch

# Fields each engine call needs from a Batch; everything else stays on the controller.
MODEL_INPUTS = ("input_ids", "attention_mask")


def train_view(layout, rank: int) -> tuple[int, bool]:
    d, p, t = layout.coords(rank)
    return d, t == 0 and p == layout.pp - 1


def engine_batch(batch: Batch, *keys: str) -> dict[str, torch.Tensor]:
    return {k: batch[k] for k in (*MODEL_INPUTS, *keys)}


def logprob_batch(batch: Batch) -> dict[str, torch.Tensor]:
    """What a log-prob pass needs: with the batch's ``response_mask`` (a rollout's always has
    one) the engine computes its output layer over the response only (``TrainEngine``'s
    module docstring), and the prompt positions, which nothing reads, come back 0."""
    return engine_batch(batch, *(["response_mask"] if "response_mask" in batch else []))


def reference_log_probs(engine, batch: Batch) -> Batch:
    """``ref_logprobs`` of the frozen reference ``engine`` (with ``ref.offload`` its weights
    stream from host memory during the pass: ``TrainEngine.stream_weights``)."""
    return Batch({"ref_logprobs": engine.compute_logprobs(logprob_batch(batch))})


def global_count(x: torch.Tensor, group) -> float:
    """Sum of ``x`` over the data-parallel group (the global denominator of a loss)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # NCCL reduces device tensors only
    total = x.detach().sum().reshape(1).to(device, torch.float64)
    dist.all_reduce(total, group=group)
    return max(total.item(), 1.0)


def denominator(mask: torch.Tensor, agg: str, group) -> float:
    counted = mask if agg == "token-mean" else mask.bool().any(-1).float()
    return global_count(counted, group)


def mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]} if rows else {}


def ppo_updates(engine, data: dict[str, torch.Tensor], schedule, agg: str, dp_group,
                 loss_for, prefix: str, loss_key: str | None, with_entropy: bool = False) -> Batch:
    """``schedule.ppo_epochs`` passes of ``schedule.mini_batches`` optimizer steps over this DP
    rank's ``data``. ``loss_for(denominator)`` gives a mini-batch's loss function, the
    denominator being its global count for ``agg``; ``with_entropy`` hands it the policy's
    entropy (see ``TrainEngine.train_step``). Returns the metrics averaged over the optimizer
    steps, each step's those of its whole mini-batch (every micro-batch and DP rank: the same on
    every rank whatever the split)."""
    rows, skipped = [], 0
    for _ in range(schedule.ppo_epochs):
        for part in Batch(data).split(schedule.mini_batches):
            denom = denominator(part["response_mask"], agg, dp_group)
            step = engine.train_step(part.tensors, loss_for(denom), with_entropy=with_entropy)
            if step.pop("nonfinite"):
                skipped += 1  # not applied; its metrics would poison the step's means
                continue
            step[f"{prefix}/grad_norm"] = step.pop("grad_norm")
            loss = step.pop("loss")
            if loss_key is not None:
                step[loss_key] = loss
            rows.append(step)
    return Batch(meta={**mean_metrics(rows), f"{prefix}/nonfinite_skipped": float(skipped)})


def pack_rollout(outputs, batch: Batch, pad_token_id: int, prompt_width: int,
                 response_width: int, with_tools: bool = False) -> Batch:
    """A generate call's ``outputs`` (``RolloutOutput``s of ``batch``'s prompts) as the rows the
    controller concatenates: left-padded prompts and right-padded responses of fixed widths
    (every replica's rows alike), ``rollout_logprobs``, and ``batch``'s lists repeated per sample
    with each sample's ``finish_reason`` (and its ``tools`` record, ``with_tools``)."""
    tensors = rollout_batch(outputs, pad_token_id, prompt_width=prompt_width,
                            response_width=response_width)
    tensors["response_mask"] = tensors["response_mask"].float()
    index = [o.prompt_index for o in outputs]
    lists = {k: [v[j] for j in index] for k, v in batch.lists.items()}
    lists["finish_reason"] = [o.finish_reason for o in outputs]
    if with_tools:
        lists["tools"] = [o.tools for o in outputs]
    return Batch(tensors, lists)


def save_rank_state(path: Path, rollout=None) -> None:
    """This process's RNG states (and its rollout engine's call count): what, beside the
    weights, decides what it draws next. Tensors and ints, so loading needs no pickle. A write
    the file system refuses is a ``CheckpointWriteError`` naming ``path``."""
    from megatron.core import tensor_parallel  # deferred: Megatron
    state = {"torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    if rollout is not None:
        state["rollout"] = rollout.state_dict()
    buffer = io.BytesIO()  # written by Python, whose OSError keeps the errno torch.save's drops
    torch.save(state, buffer)
    with writing(path):
        path.write_bytes(buffer.getvalue())


def load_rank_state(path: Path, rollout=None) -> None:
    from megatron.core import tensor_parallel  # deferred: Megatron

    if not path.is_file():
        raise ConfigError("resume", f"{path} is missing: the checkpoint was saved by a run of "
                                    "another world size; resume it at its own layout")
    try:  # a damaged or crafted file is bad input: one line, not the loader's traceback
        state = torch.load(path, weights_only=True)
        torch.set_rng_state(state["torch"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
        if rollout is not None:
            rollout.load_state_dict(state["rollout"])
    except Exception as e:  # noqa: BLE001 - whatever the file holds, the answer is the same
        raise ConfigError("resume", f"{path}: not a rank state that hybridflow saved "
                                    f"({type(e).__name__}); the checkpoint is damaged: resume "
                                    "from another one") from None
