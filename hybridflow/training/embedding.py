"""The input embedding's gradient added into Megatron's fp32 ``main_grad`` row by row.

Megatron's ``VocabParallelEmbedding`` looks tokens up with ``F.embedding``. Its backward writes a
dense gradient of the whole table: [V/tp, h] of zeros with the micro-batch's rows added in. DDP's
hook then adds that table into ``main_grad``. Where the table is tied to the output layer, it is
worse: the output layer's dummy gradient must be zeros (``zero_out_wgrad``, so the hook still
adds the lookup's part), and autograd sums the two tables first. A micro-batch touches a few
hundred rows; this pays two fills and two adds over all 49152 rows of SmolLM2-135M's table
(113 MB in fp32). On the 2-core CPU machine the two fills alone took 2.4 s of a 15-20 s
training step (``bench_engine --profile``): each was a pass over memory that had gone cold.

``MainGradEmbedding`` is Megatron's module with another forward. Its lookup adds the rows'
gradients into ``main_grad`` with one indexed add and gives autograd no gradient for the table.
The add is the deterministic one of each device: ``index_put_(accumulate=True)`` on CUDA (it sums
through sorted indices), ``index_add_`` on CPU (in index order). The hook then has nothing to
add for the lookup. The output layer's dummy can stay uninitialised, as it is for every other
weight. Without ``main_grad`` (no DDP wrapper), the lookup returns the dense gradient, as
``F.embedding`` does.

``ENABLED = False`` keeps Megatron's forward; the tests compare the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import (reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)

ENABLED = True
"""False: Megatron's ``F.embedding`` lookup, its dense gradient added by DDP's hook."""


class _LookupIntoMainGrad(torch.autograd.Function):
    """rows = table[ids] (zero where ``outside``); backward adds the rows' gradients into
    ``table.main_grad`` and returns none for the table."""

    @staticmethod
    def forward(ctx, ids, table, outside):
        rows = F.embedding(ids, table)
        if outside is not None:
            rows = rows.masked_fill(outside[..., None], 0.0)
        ctx.save_for_backward(ids, outside)
        ctx.table = table
        return rows

    @staticmethod
    def backward(ctx, grad):
        ids, outside = ctx.saved_tensors
        table = ctx.table
        if outside is not None:  # tokens of another rank's vocabulary shard
            grad = grad.masked_fill(outside[..., None], 0.0)
        into = getattr(table, "main_grad", None)
        dense = into is None
        if dense:
            into = torch.zeros_like(table)
        index, rows = ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(into.dtype)
        if into.is_cuda:  # through sorted indices: deterministic (index_add_ uses atomics there)
            into.index_put_((index,), rows, accumulate=True)
        else:  # in index order: deterministic (index_put_'s accumulate may split over threads)
            into.index_add_(0, index, rows)
        return None, into if dense else None, None


class MainGradEmbedding(VocabParallelEmbedding):
    """``VocabParallelEmbedding`` whose lookup's gradient goes into ``main_grad`` (module
    docstring). Made from Megatron's module by ``use_main_grad_lookup``."""

    def forward(self, input_):
        if not (self.weight.requires_grad and torch.is_grad_enabled()):
            return super().forward(input_)
        outside, ids = None, input_
        if self.tp_group.size() > 1:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        rows = _LookupIntoMainGrad.apply(ids, self.weight, outside)
        if self.reduce_scatter_embeddings:  # [b, s, h] -> [s, b, h], as Megatron's forward
            return reduce_scatter_to_sequence_parallel_region(rows.transpose(0, 1).contiguous(),
                                                              group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(rows, group=self.tp_group)


def use_main_grad_lookup(embedding: VocabParallelEmbedding) -> bool:
    """Give Megatron's embedding module ``MainGradEmbedding``'s forward (its class is switched:
    its parameter, state and other methods stay as they are). Returns whether it did
    (``ENABLED``)."""
    if not ENABLED:
        return False
    if type(embedding) is not VocabParallelEmbedding:
        raise TypeError(f"use_main_grad_lookup: expected Megatron's VocabParallelEmbedding, got "
                        f"{type(embedding).__name__}")
    embedding.__class__ = MainGradEmbedding
    return True
