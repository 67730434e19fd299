"""Micro-batches of a training engine's passes: the split of a rank's batch, each field's share
of a micro-batch, and per-sample outputs put back in the batch's order.

``micro_batch_size`` (``forward_micro_batch_size``) consecutive sequences, each micro-batch the
same columns of the rank's batch: those from the first to the last that any of its rows uses
(``used_columns``; RL batches come padded to ``data.max_prompt_tokens + max_tokens``, most of
whose prompt columns a batch of short prompts leaves empty); or, with
``max_tokens_per_micro_batch``, a token budget: the rank's sequences sorted by length and packed
greedily (``token_budget_split``), each micro-batch keeping only the columns its rows need, every
row's span of real tokens moved to start at column 0. Either way
``plan_micro_batches`` is the split, every per-token field of the micro-batch ``mb`` a loss
function sees is cut the same way as the log-probs it gets (``_take``), and per-sample outputs
come back in the batch's order at width S (``to_batch_order``). With a response mask an LM head's
output layer starts at each micro-batch's ``first_logit_column`` (training/engine.py's
docstring)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.errors import ArgumentError, ConfigError
from hybridflow.training.config import EngineConfig


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def token_budget_split(lengths: list[int], budget: int, multiple: int = 1) -> list[list[int]]:
    """Indices of ``lengths`` (each sequence's span of real tokens) in micro-batches of at most
    ``budget`` computed tokens: sorted by length (stable), packed greedily while the rows x the
    longest span, rounded up to ``multiple`` (sequence parallelism's tp), fit the budget. An empty
    sequence counts one token. Raises ConfigError when one sequence alone exceeds the budget."""
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        width = _round_up(max(lengths[i], 1), multiple)  # the longest so far: sorted
        if width > budget:
            raise ConfigError("engine.max_tokens_per_micro_batch",
                              f"{budget} is below a sequence of {lengths[i]} tokens"
                              + (f" ({width} padded to a multiple of tp)" if width > lengths[i]
                                 else "") + f"; raise it to at least {width}")
        if out and (len(out[-1]) + 1) * width <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


@dataclass(frozen=True)
class MicroBatchPlan:
    """Where one micro-batch comes from: row ``rows[j]`` of the batch, its columns from
    ``starts[j]`` on, ``width`` of them (columns past the batch's end are padding)."""

    rows: torch.Tensor
    """[b] int64: indices into the batch."""
    starts: torch.Tensor
    """[b] int64: the batch column that is the micro-batch's column 0, per row."""
    width: int
    """Columns the micro-batch keeps."""
    padded_width: int
    """Columns the model computes: ``width`` padded to a multiple of tp under sequence
    parallelism."""

    @property
    def tokens(self) -> int:
        """Positions the model computes for this micro-batch (real and padding)."""
        return len(self.rows) * self.padded_width


def plan_micro_batches(attention_mask: torch.Tensor, engine: EngineConfig, tp: int,
                       forward_only: bool) -> list[MicroBatchPlan]:
    """The split of a rank's batch ([B, S] attention mask) into micro-batches, the same on every
    pipeline stage and TP rank (they see the same data): fixed-size consecutive rows, all at the
    batch's ``used_columns`` (one width: pipeline stages send activations of one shape), or with
    ``engine.max_tokens_per_micro_batch`` the token budget's groups, each row's span of real
    tokens (first to last real token) starting at column 0."""
    n, s = attention_mask.shape
    multiple = tp if engine.sequence_parallel else 1
    budget = engine.max_tokens_per_micro_batch
    if budget is None:
        field, mbs = "engine.micro_batch_size", engine.micro_batch_size
        if forward_only and engine.forward_micro_batch_size is not None:
            field, mbs = "engine.forward_micro_batch_size", engine.forward_micro_batch_size
        if n % mbs:
            raise ConfigError(field, f"{mbs} does not divide this rank's batch of {n} sequences")
        first, width = used_columns(attention_mask)
        starts = torch.full((mbs,), first, dtype=torch.long)
        return [MicroBatchPlan(torch.arange(i, i + mbs), starts, width, _round_up(width, multiple))
                for i in range(0, n, mbs)]
    real = attention_mask.detach().cpu().bool()
    has = real.any(-1)
    first = torch.where(has, real.int().argmax(-1), 0)
    last = torch.where(has, s - 1 - real.flip(-1).int().argmax(-1), 0)
    lengths = (last - first + 1).clamp(min=1)
    plans = []
    for group in token_budget_split(lengths.tolist(), budget, multiple):
        rows = torch.tensor(group, dtype=torch.long)
        width = int(lengths[rows].max())
        plans.append(MicroBatchPlan(rows, first[rows], width, _round_up(width, multiple)))
    return plans


def used_columns(attention_mask: torch.Tensor) -> tuple[int, int]:
    """(first column, width) of the span of a [B, S] attention mask's columns from the first to
    the last that holds a real token in any row; the whole width when none does. The columns
    outside it are padding in every row: nothing a pass computes there is read (its
    log-probs and values are 0, and no position attends to them)."""
    used = attention_mask.detach().cpu().bool().any(0)
    if not used.any():
        return 0, attention_mask.shape[1]
    first = int(used.int().argmax())
    last = len(used) - 1 - int(used.flip(0).int().argmax())
    return first, last - first + 1


def _columns(starts: torch.Tensor, width: int, device) -> torch.Tensor:
    """[b, width]: the batch column of each micro-batch column."""
    return starts.to(device)[:, None] + torch.arange(width, device=device)


def _take(x: torch.Tensor, plan: MicroBatchPlan) -> torch.Tensor:
    """A batch field's share of one micro-batch: its rows, and for a per-token field ([B, S,
    ...]) the plan's columns of each row, 0 past the batch's last column."""
    rows = plan.rows.to(x.device)
    s = x.shape[1] if x.dim() >= 2 else None
    if s is None:
        return x[rows]
    start = int(plan.starts[0])
    if start + plan.width <= s and bool((plan.starts == start).all()):  # one span of columns
        return x[rows, start:start + plan.width]
    cols = _columns(plan.starts, plan.width, x.device)
    out = x[rows[:, None], cols.clamp(max=s - 1)]
    out[cols >= s] = 0
    return out


def response_starts(response_mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """[B, S] response mask -> [B] int64: each row's first response column (S for a row
    without one), on the host. ``shape``: the batch's [B, S] (``input_ids``'), checked."""
    if response_mask.shape != shape:
        raise ArgumentError("response_mask", f"shape {tuple(response_mask.shape)} does not match "
                            f"input_ids' {tuple(shape)}")
    resp = response_mask.detach().cpu() != 0
    s = resp.shape[1]
    return torch.where(resp.any(-1), resp.int().argmax(-1), s).long()


def first_logit_column(starts: torch.Tensor, plan: MicroBatchPlan) -> int:
    """The micro-batch column the output layer starts at: the first column whose label is a
    response token (the micro-batch's first response column minus one, at least 0), from the
    batch's ``response_starts``; the last computed column when no row has a response (its
    output is then never read). Columns before it are prompt: nothing reads their log-probs."""
    first = int((starts[plan.rows] - plan.starts).min()) - 1
    return max(0, min(first, plan.padded_width - 1))


def to_batch_order(pieces: list[tuple[torch.Tensor, dict]]) -> torch.Tensor:
    """Per-token results of micro-batches -- (result [b, w, ...], the micro-batch ``mb`` it was
    computed from), covering a whole batch -- as one [B, S, ...] tensor in the batch's row order
    and columns; 0 at the columns no micro-batch kept."""
    first = pieces[0][0]
    n = sum(len(mb["_rows"]) for _, mb in pieces)
    out = first.new_zeros((n, pieces[0][1]["_width"], *first.shape[2:]))
    for x, mb in pieces:
        cols = _columns(mb["_starts"], x.shape[1], x.device)
        rows = mb["_rows"].to(x.device)[:, None].expand_as(cols)
        keep = cols < out.shape[1]
        out[rows[keep], cols[keep]] = x[keep]
    return out
