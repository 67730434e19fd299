"""Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

Megatron-Core's local layer spec (``get_gpt_layer_local_spec``, the one we build without
Transformer Engine) computes attention unfused: a ``baddbmm`` of the scores into a [b*np, s, s]
buffer, a masked softmax in fp32, a cast, a ``bmm`` and a permuted copy of the context, each its
own kernel forward and backward, with the scores written out in between. SDPA does the same in
one kernel each way (flash / memory-efficient on CUDA, the flash CPU kernel on CPU), keeping the
scores on chip. Issue 15 named this path. ``TrainEngine`` puts ``SDPAttention`` in the local
spec's ``core_attention`` slot; ``ENABLED = False`` keeps Megatron's module (the tests compare
the two).

The mask is Megatron's [B, 1, S, S] bool, True where attention is blocked
(``model.batch_attention_mask``: future and padding keys). SDPA takes the allowed set. A query
at a left-padding position may have no allowed key at all; Megatron's softmax then spreads it
evenly, and SDPA's backends differ (0 on CPU, NaN in some CUDA kernels: a NaN value row would
reach real queries as 0 * NaN). So every query is allowed its own key: padding positions stay finite, and a real query's set is unchanged
(it always sees itself). What padding positions compute is read by nothing (their log-probs and
losses are masked, and no real query attends to them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

ENABLED = True
"""False: Megatron's unfused ``DotProductAttention`` (the tests compare the two)."""


class SDPAttention(DotProductAttention):
    """Megatron's ``DotProductAttention`` (its constructor: heads per partition, softmax scale),
    its forward through SDPA. Refuses what it does not implement rather than ignoring it."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if self.config.softmax_type != "vanilla" or self.config.window_size is not None:
            raise NotImplementedError("SDPAttention: vanilla softmax without a window only")
        if self.attention_dropout.p != 0.0:
            raise NotImplementedError("SDPAttention: attention dropout is not implemented")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        """[sq, b, np, hn] queries, [sk, b, ng, hn] keys and values, the blocked-key mask
        [b, 1, sq, sk] -> the context [sq, b, np * hn]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention: no packed sequences or attention bias")
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        context = sdpa_context(query, key, value, attention_mask, self.softmax_scale)
        return context.reshape(*context.shape[:2], self.hidden_size_per_partition)


def sdpa_context(query, key, value, blocked, scale: float):
    """[sq, b, n, hn] queries, keys and values (heads already repeated), the blocked-key mask
    [b, 1, sq, sk] -> the context [sq, b, n, hn]; each query also sees its own key."""
    sq, sk = query.shape[0], key.shape[0]
    allowed = ~blocked | torch.eye(sq, sk, dtype=torch.bool, device=query.device)
    # [s, b, n, h] -> [b, n, s, h]: SDPA's layout, as strided views
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    return context.permute(2, 0, 1, 3)
