"""Parameter metadata: the contract between the model code and the 3D-HybridEngine.

A ``ParamMeta`` says, for one Megatron-Core parameter, its full shape, how tensor parallelism
splits it and which pipeline stage owns it. ``shard`` and ``unshard`` are the one definition of a
training shard that every part of hybridflow (model building, checkpoint conversion, reshard,
tests) uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.models.config import ModelConfig

POSITIONS = ("pre", "layer", "post")


@dataclass(frozen=True, kw_only=True)
class ParamMeta:
    """One parameter of the full (unsharded) model."""

    name: str
    """Megatron name with the global layer index, e.g. "decoder.layers.3.mlp.linear_fc1.weight"."""
    shape: tuple[int, ...]
    """Full (unsharded) shape."""
    tp_dim: int | None
    """Dim split across TP (0 column-parallel, 1 row-parallel); None for replicated."""
    tp_chunks: int = 1
    """Independently split chunks along tp_dim: 2 for SwiGLU linear_fc1 = [gate; up], whose TP
    rank r holds [gate_r; up_r]."""
    layer: int | None
    """Global layer index; None for parameters outside the decoder layers."""
    position: str
    """"pre" (embedding: first stage), "layer", or "post" (final norm, output layer: last stage)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        if self.position not in POSITIONS:
            raise ValueError(f"{self.name}: position {self.position!r} is not one of {POSITIONS}")
        if (self.layer is None) != (self.position != "layer"):
            raise ValueError(f"{self.name}: layer must be set exactly when position is 'layer'")
        if self.tp_dim is not None and not 0 <= self.tp_dim < len(self.shape):
            raise ValueError(f"{self.name}: tp_dim {self.tp_dim} outside shape {self.shape}")
        if self.tp_chunks < 1 or (self.tp_chunks > 1 and self.tp_dim is None):
            raise ValueError(f"{self.name}: tp_chunks={self.tp_chunks} needs a tp_dim")

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def shard_shape(self, tp: int) -> tuple[int, ...]:
        """Shape of one TP shard at TP size ``tp`` (checks that it divides)."""
        if self.tp_dim is None or tp == 1:
            return self.shape
        size = self.shape[self.tp_dim]
        if size % (tp * self.tp_chunks):
            what = f"{self.tp_chunks} chunks x " if self.tp_chunks > 1 else ""
            raise ValueError(f"{self.name}: dim {self.tp_dim} of size {size} does not split into "
                             f"{what}tp={tp} equal shards; change layout.tp (or generation.tp)")
        shape = list(self.shape)
        shape[self.tp_dim] = size // tp
        return tuple(shape)


def shard(full: torch.Tensor, meta: ParamMeta, tp: int, tp_rank: int) -> torch.Tensor:
    """The TP shard that rank ``tp_rank`` of a TP group of size ``tp`` holds (contiguous).

    With ``tp_chunks=2`` (linear_fc1 = [gate; up]) each chunk is split on its own, so the shard is
    [gate_r; up_r], as Megatron-Core's ColumnParallelLinear holds a fused SwiGLU weight.
    """
    if tuple(full.shape) != meta.shape:
        raise ValueError(f"{meta.name}: tensor of shape {tuple(full.shape)}, meta says "
                         f"{meta.shape}")
    if not 0 <= tp_rank < tp:
        raise ValueError(f"{meta.name}: tp_rank {tp_rank} outside a TP group of {tp}")
    if meta.tp_dim is None or tp == 1:
        return full.contiguous()
    meta.shard_shape(tp)  # checks divisibility
    chunks = full.chunk(meta.tp_chunks, dim=meta.tp_dim)
    pieces = [c.chunk(tp, dim=meta.tp_dim)[tp_rank] for c in chunks]
    return torch.cat(pieces, dim=meta.tp_dim) if len(pieces) > 1 else pieces[0].contiguous()


def unshard(shards: list[torch.Tensor], meta: ParamMeta) -> torch.Tensor:
    """Inverse of ``shard``: the shards of ranks 0..k-1 in order -> the tensor they make up.

    With all ``tp`` shards this is the full parameter; with the consecutive shards
    ``g*s .. g*s+s-1`` it is the shard of rank g at TP size ``tp/s`` (used by the tests).
    """
    if meta.tp_dim is None or len(shards) == 1:
        return shards[0]
    per_shard = [s.chunk(meta.tp_chunks, dim=meta.tp_dim) for s in shards]
    parts = [torch.cat([p[c] for p in per_shard], dim=meta.tp_dim) for c in range(meta.tp_chunks)]
    return torch.cat(parts, dim=meta.tp_dim) if len(parts) > 1 else parts[0]


def init_full_weights(metas: list[ParamMeta], seed: int = 0, std: float = 0.02,
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Deterministic full weights {name: tensor} for tests and tiny demos: norm weights (1-D,
    replicated) are ones, everything else is normal(0, std); the same seed gives the same weights
    in every process."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in metas:
        if len(m.shape) == 1 and m.tp_dim is None:
            out[m.name] = torch.ones(m.shape, dtype=dtype)
        else:
            out[m.name] = (torch.randn(m.shape, generator=g) * std).to(dtype)
    return out


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """Global layer indices held by pipeline stage ``pp_rank`` (an even split)."""
    if num_layers % pp:
        raise ValueError(f"layout.pp={pp} does not divide the model's {num_layers} layers; pick a "
                         f"pp that divides {num_layers}")
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank {pp_rank} outside a pipeline of {pp} stages")
    per = num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def owner_stage(meta: ParamMeta, pp: int, num_layers: int) -> int:
    """Training pipeline stage that holds ``meta``: pre -> 0, post -> pp-1, layers by the split."""
    if meta.position == "pre":
        return 0
    if meta.position == "post":
        return pp - 1
    if num_layers % pp:
        stage_layers(num_layers, pp, 0)  # raises the message naming layout.pp
    if not 0 <= meta.layer < num_layers:
        raise ValueError(f"{meta.name}: layer {meta.layer} outside a model of {num_layers} layers")
    return meta.layer // (num_layers // pp)


def num_layers_of(metas: list[ParamMeta]) -> int:
    """Layers of the model described by ``metas`` (1 + the largest layer index, 0 if none)."""
    return 1 + max((m.layer for m in metas if m.layer is not None), default=-1)


def llama_param_metas(cfg: ModelConfig) -> list[ParamMeta]:
    """Megatron-Core (local spec) parameters of a Llama / Qwen2 model, in model order.

    ``linear_qkv`` rows are grouped per query group, [q_0 .. q_{nh/ng-1}, k, v] for each group,
    so a TP shard of ``ng/tp`` whole groups is a contiguous row block: Megatron requires
    ``num_kv_heads % tp == 0``, which the training engine checks.
    """
    h, hd, nh, ng, ffn = (cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                          cfg.ffn_hidden_size)
    qkv_rows = (nh + 2 * ng) * hd
    metas = [ParamMeta(name="embedding.word_embeddings.weight", shape=(cfg.vocab_size, h),
                       tp_dim=0, layer=None, position="pre")]
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        layer = [
            (p + "input_layernorm.weight", (h,), None, 1),
            (p + "self_attention.linear_qkv.weight", (qkv_rows, h), 0, 1),
        ]
        if cfg.qkv_bias:
            layer.append((p + "self_attention.linear_qkv.bias", (qkv_rows,), 0, 1))
        layer += [
            (p + "self_attention.linear_proj.weight", (h, nh * hd), 1, 1),
            (p + "pre_mlp_layernorm.weight", (h,), None, 1),
            (p + "mlp.linear_fc1.weight", (2 * ffn, h), 0, 2),
            (p + "mlp.linear_fc2.weight", (h, ffn), 1, 1),
        ]
        metas += [ParamMeta(name=n, shape=s, tp_dim=d, tp_chunks=c, layer=i, position="layer")
                  for n, s, d, c in layer]
    metas.append(ParamMeta(name="decoder.final_layernorm.weight", shape=(h,), tp_dim=None,
                           layer=None, position="post"))
    if not cfg.tie_embeddings:
        metas.append(ParamMeta(name="output_layer.weight", shape=(cfg.vocab_size, h), tp_dim=0,
                               layer=None, position="post"))
    return metas
