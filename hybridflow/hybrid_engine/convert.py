"""Generation weights (Megatron names, one generation TP rank's shards) -> the rollout's names.

Two views of the parameter table (``models/params.py``), both lazy iterators of
``(name, tensor)`` so a backend can load one tensor at a time:

* ``to_vllm_shards(tensors, cfg, gen_tp)``: vLLM's *parameter* names of that generation TP rank,
  with vLLM's fused layouts: ``self_attn.qkv_proj`` = [q of the rank's heads; k; v of its query
  groups] (``to_vllm_layout``), ``mlp.gate_up_proj`` = [gate_r; up_r] (Megatron's
  ``linear_fc1`` shard as is), ``o_proj``/``down_proj`` (the row-parallel shards as is), the norms,
  ``model.embed_tokens.weight`` and ``lm_head.weight`` (vocab shards). These are what the rank's
  vLLM parameters hold, for a backend that copies them in directly (``param.data.copy_``), which
  is the path for tg > 1.
* ``to_hf(tensors, cfg)``: full HF checkpoint names (``q_proj``/``k_proj``/``v_proj``,
  ``gate_proj``/``up_proj``, ...), what vLLM's ``load_weights`` / ``reload_weights`` consume; only
  for tg == 1, where the generation shard is the full tensor.

Why no per-rank HF shards for tg > 1: vLLM's weight loaders (vllm 0.32,
``model_executor/layers/linear.py`` ``ColumnParallelLinear`` / ``MergedColumnParallelLinear`` /
``QKVParallelLinear`` / ``RowParallelLinear.weight_loader``) take the *full* HF tensor and
``narrow`` it to their own TP rank's slice (unless a parameter is flagged ``is_sharded_weight``,
which only vLLM's sharded-state loader sets), and ``VocabParallelEmbedding.weight_loader`` asserts
the full vocabulary. A shard under an HF name would be sliced a second time. With tg > 1 the
backend therefore takes ``to_vllm_shards`` and copies them into its parameters.

vLLM pads the vocabulary to a multiple of 64 and splits the *padded* vocabulary over its TP ranks,
so its vocab shards are ours only when ``vocab_size % 64 == 0`` (true of Llama, Qwen2, SmolLM2);
``to_vllm_shards`` refuses other vocabularies for tg > 1. With tg == 1 the backend copies the
``vocab_size`` rows and leaves the padding rows alone.

Tied embeddings: ``output_layer.weight`` (present on the last of several generation stages, see
``switch.py``) becomes ``model.embed_tokens.weight``: vLLM's last stage of a tied model has an
``embed_tokens`` that its ``lm_head`` is tied to.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch

from hybridflow.errors import ArgumentError
from hybridflow.models.config import ModelConfig
from hybridflow.models.hf import split_megatron_to_hf
from hybridflow.models.params import to_vllm_layout

VLLM_VOCAB_PADDING = 64
"""vLLM's DEFAULT_VOCAB_PADDING_SIZE (model_executor/layers/vocab_parallel_embedding.py)."""


def to_vllm_shards(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, gen_tp: int
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(vLLM parameter name, this generation TP rank's tensor) for each generation tensor, in the
    order given. Views where the layouts agree; ``qkv_proj`` is a new tensor (per-group
    interleave -> [q; k; v])."""
    if gen_tp > 1 and cfg.vocab_size % VLLM_VOCAB_PADDING:
        raise ArgumentError("gen_tp",
                            f"vLLM splits the vocabulary padded to a multiple of "
                            f"{VLLM_VOCAB_PADDING}; vocab_size={cfg.vocab_size} is not one, so its "
                            f"vocab shards at tp={gen_tp} differ from Megatron's; use tp=1")
    # checked now, converted as the backend asks
    return (to_vllm_layout(name, tensor, cfg, gen_tp) for name, tensor in tensors.items())


def to_hf(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, gen_tp: int = 1
          ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for each generation tensor, for vLLM's ``load_weights`` (which
    stacks q/k/v and gate/up itself and slices by its own TP rank). Needs ``gen_tp == 1``."""
    if gen_tp != 1:
        raise ArgumentError("gen_tp",
                            f"HF names need full tensors, the generation shards at tp={gen_tp} are "
                            f"not (vLLM's weight loaders slice full tensors themselves); use "
                            f"to_vllm_shards and copy them into the rank's parameters")
    return (pair for name, tensor in tensors.items()
            for pair in split_megatron_to_hf(name, tensor, cfg).items())
