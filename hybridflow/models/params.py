"""The parameter table of a model family, and its Megatron and vLLM views.

Every fact about one parameter is written once, in a row of its family's table (``LLAMA``, which
Llama and Qwen2 share: Qwen2 adds the q/k/v biases): its Megatron-Core name, how tensor
parallelism splits it, which pipeline stage holds it, the HF tensors it is made of (their names,
their shapes in config terms, and how they merge) and its vLLM name. The views are derived:

* Megatron: ``llama_param_metas`` -> one ``ParamMeta`` per parameter (full shape, TP split,
  pipeline position), with ``shard``/``unshard`` and the pipeline helpers, the one definition of a
  training shard that the engine, the checkpoint code and the 3D-HybridEngine use;
* HF: ``models/hf.py`` (names, shapes, HF <-> Megatron tensors), from ``hf_shapes`` and
  ``merge``/``split`` here;
* vLLM: ``vllm_name`` and ``to_vllm_layout`` (one generation TP rank's tensor under vLLM's name
  and fused layout); ``hybrid_engine/convert.py`` streams them to the rollout.

The fused layouts: ``linear_qkv`` is grouped per query group (``[q_0..q_{r-1}, k, v]`` for each
group), so a contiguous TP slice holds whole groups (Megatron requires ``num_kv_heads % tp == 0``,
which the engine checks); ``linear_fc1`` is ``[gate; up]`` for the full tensor, but TP rank r holds
``[gate_r; up_r]`` (each half split on its own: ``tp_chunks=2``), which is also vLLM's
``gate_up_proj`` of rank r. Names use global layer indices and the unpadded vocabulary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

import torch

from hybridflow.errors import ArgumentError, ConfigError
from hybridflow.models.config import ModelConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The parameter dtypes a config may name (``engine.dtype``) -> torch's."""

POSITIONS = ("pre", "layer", "post")
MERGES = ("identity", "qkv", "concat")

# ----------------------------------------------------------------------------------------------
# the table


@dataclass(frozen=True, kw_only=True)
class Param:
    """One row of a family's table: a Megatron-Core parameter, its TP/PP placement, and the HF and
    vLLM tensors that correspond to it. ``{i}`` in a name stands for the global layer index."""

    megatron: str
    """Megatron-Core (local spec) name, e.g. "decoder.layers.{i}.mlp.linear_fc1.weight"."""
    position: str
    """"pre" (embedding: first stage), "layer", or "post" (final norm, output layer: last stage)."""
    tp_dim: int | None
    """Dim split across TP (0 column-parallel, 1 row-parallel); None for replicated."""
    tp_chunks: int = 1
    """Chunks along tp_dim that TP splits each on its own (2 for [gate; up]: rank r holds
    [gate_r; up_r])."""
    hf: dict[str, tuple[str, ...]]
    """HF tensors it is made of, in merge order: name -> shape in the size names of ``_sizes``."""
    merge: str = "identity"
    """How the HF tensors make it, along dim 0: "identity" (the one tensor), "qkv" (q, k, v grouped
    per query group), "concat" (stacked in order, [gate; up])."""
    vllm: str
    """vLLM parameter name (its TP shard is Megatron's, with q/k/v regrouped for merge "qkv")."""
    needs: str | None = None
    """The ModelConfig flag without which the model has no such parameter (e.g. "qkv_bias")."""
    tied_to: str | None = None
    """With ``tie_embeddings``: the parameter whose weight this one is. It is then no parameter of
    its own (only the last pipeline stage holds a copy) and has that one's HF and vLLM names."""

    def __post_init__(self) -> None:
        if self.position not in POSITIONS:
            raise ValueError(f"{self.megatron}: position {self.position!r} not in {POSITIONS}")
        if ("{i}" in self.megatron) != (self.position == "layer"):
            raise ValueError(f"{self.megatron}: has {{i}} exactly when position is 'layer'")
        if self.merge not in MERGES:
            raise ValueError(f"{self.megatron}: merge {self.merge!r} not in {MERGES}")
        if (self.merge == "identity") != (len(self.hf) == 1):
            raise ValueError(f"{self.megatron}: merge 'identity' takes exactly one HF tensor")


_L = "model.layers.{i}."

LLAMA = (
    Param(megatron="embedding.word_embeddings.weight", position="pre", tp_dim=0,
          hf={"model.embed_tokens.weight": ("vocab", "hidden")},
          vllm="model.embed_tokens.weight"),
    Param(megatron="decoder.layers.{i}.input_layernorm.weight", position="layer", tp_dim=None,
          hf={_L + "input_layernorm.weight": ("hidden",)},
          vllm=_L + "input_layernorm.weight"),
    Param(megatron="decoder.layers.{i}.self_attention.linear_qkv.weight", position="layer",
          tp_dim=0, merge="qkv",
          hf={_L + "self_attn.q_proj.weight": ("q", "hidden"),
              _L + "self_attn.k_proj.weight": ("kv", "hidden"),
              _L + "self_attn.v_proj.weight": ("kv", "hidden")},
          vllm=_L + "self_attn.qkv_proj.weight"),
    Param(megatron="decoder.layers.{i}.self_attention.linear_qkv.bias", position="layer",
          tp_dim=0, merge="qkv", needs="qkv_bias",
          hf={_L + "self_attn.q_proj.bias": ("q",),
              _L + "self_attn.k_proj.bias": ("kv",),
              _L + "self_attn.v_proj.bias": ("kv",)},
          vllm=_L + "self_attn.qkv_proj.bias"),
    Param(megatron="decoder.layers.{i}.self_attention.linear_proj.weight", position="layer",
          tp_dim=1,
          hf={_L + "self_attn.o_proj.weight": ("hidden", "q")},
          vllm=_L + "self_attn.o_proj.weight"),
    Param(megatron="decoder.layers.{i}.pre_mlp_layernorm.weight", position="layer", tp_dim=None,
          hf={_L + "post_attention_layernorm.weight": ("hidden",)},
          vllm=_L + "post_attention_layernorm.weight"),
    Param(megatron="decoder.layers.{i}.mlp.linear_fc1.weight", position="layer", tp_dim=0,
          tp_chunks=2, merge="concat",
          hf={_L + "mlp.gate_proj.weight": ("ffn", "hidden"),
              _L + "mlp.up_proj.weight": ("ffn", "hidden")},
          vllm=_L + "mlp.gate_up_proj.weight"),
    Param(megatron="decoder.layers.{i}.mlp.linear_fc2.weight", position="layer", tp_dim=1,
          hf={_L + "mlp.down_proj.weight": ("hidden", "ffn")},
          vllm=_L + "mlp.down_proj.weight"),
    Param(megatron="decoder.final_layernorm.weight", position="post", tp_dim=None,
          hf={"model.norm.weight": ("hidden",)},
          vllm="model.norm.weight"),
    Param(megatron="output_layer.weight", position="post", tp_dim=0,
          tied_to="embedding.word_embeddings.weight",
          hf={"lm_head.weight": ("vocab", "hidden")},
          vllm="lm_head.weight"),
)
"""Llama and Qwen2 (Megatron-Core GPTModel, local spec), in model order within a layer."""

FAMILIES = {"llama": LLAMA, "qwen2": LLAMA}
"""ModelConfig.arch -> its family's table."""


def _sizes(cfg: ModelConfig) -> dict[str, tuple[int, str]]:
    """The size names of the tables' HF shapes -> (size, the HF config fields that give it)."""
    hd = cfg.head_dim
    return {
        "vocab": (cfg.vocab_size, f"vocab_size={cfg.vocab_size}"),
        "hidden": (cfg.hidden_size, f"hidden_size={cfg.hidden_size}"),
        "ffn": (cfg.ffn_hidden_size, f"intermediate_size={cfg.ffn_hidden_size}"),
        "q": (cfg.num_heads * hd, f"num_attention_heads={cfg.num_heads} x head_dim={hd}"),
        "kv": (cfg.num_kv_heads * hd, f"num_key_value_heads={cfg.num_kv_heads} x head_dim={hd}"),
    }


def table(cfg: ModelConfig) -> tuple[Param, ...]:
    """The parameter table of ``cfg``'s model family."""
    return FAMILIES[cfg.arch]  # ModelConfig has checked arch


def _exists(p: Param, cfg: ModelConfig) -> bool:
    """Whether ``cfg``'s model has ``p`` at all (a tied one as a copy of another)."""
    return p.needs is None or bool(getattr(cfg, p.needs))


def tied(p: Param, cfg: ModelConfig) -> bool:
    """Whether ``p`` is tied to another parameter in ``cfg``'s model (see ``Param.tied_to``)."""
    return p.tied_to is not None and cfg.tie_embeddings


def model_params(cfg: ModelConfig) -> Iterator[tuple[Param, int | None, str]]:
    """(row, layer index or None, Megatron name) of every parameter of the full model, in model
    order: the "pre" rows, the layer rows of each layer, the "post" rows."""
    rows = [p for p in table(cfg) if _exists(p, cfg) and not tied(p, cfg)]
    for p in rows:
        if p.position == "pre":
            yield p, None, p.megatron
    for i in range(cfg.num_layers):
        for p in rows:
            if p.position == "layer":
                yield p, i, p.megatron.format(i=i)
    for p in rows:
        if p.position == "post":
            yield p, None, p.megatron


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def resolve(name: str, cfg: ModelConfig, side: str = "megatron") -> tuple[Param, int | None]:
    """The row whose ``side`` ("megatron" or "hf") names ``name``, and the layer index (None
    outside the layers). Tied rows resolve too: the last pipeline stage holds a copy of a tied
    output layer, and HF state dicts hold one as ``lm_head.weight``. Raises ConfigError for names
    that are not part of cfg's model."""
    m = _LAYER_INDEX.search(name)
    layer = None if m is None else int(m.group(1))
    template = name if m is None else f"{name[:m.start()]}.{{i}}.{name[m.end():]}"
    if layer is not None and layer >= cfg.num_layers:
        raise ConfigError(name, f"layer {layer} is out of range for num_layers={cfg.num_layers}")
    for p in table(cfg):
        names = (p.megatron,) if side == "megatron" else p.hf
        if template in names and _exists(p, cfg):
            return p, layer
    kind = {"megatron": "Megatron", "hf": "HF"}[side]
    raise ConfigError(name, f"not a {kind} parameter of a {cfg.arch} model with qkv_bias="
                            f"{cfg.qkv_bias}, tie_embeddings={cfg.tie_embeddings}")


def _named_as(p: Param, cfg: ModelConfig) -> Param:
    """The row whose HF and vLLM names ``p`` goes by: its tied-to row when tied."""
    if not tied(p, cfg):
        return p
    return next(q for q in table(cfg) if q.megatron == p.tied_to)


# ----------------------------------------------------------------------------------------------
# shapes and the merges


def hf_shapes(p: Param, layer: int | None, cfg: ModelConfig
              ) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, which HF config fields give it) of the HF tensors ``p`` is made of."""
    sizes = _sizes(cfg)
    out = {}
    for name, dims in _named_as(p, cfg).hf.items():
        why = ", ".join(sizes[d][1] for d in dict.fromkeys(dims))
        out[name.format(i=layer)] = (tuple(sizes[d][0] for d in dims), why)
    return out


def megatron_shape(p: Param, cfg: ModelConfig) -> tuple[int, ...]:
    """Full shape of ``p``: every merge stacks its HF tensors along dim 0."""
    shapes = [shape for shape, _ in hf_shapes(p, 0, cfg).values()]
    if len({s[1:] for s in shapes}) != 1:
        raise ValueError(f"{p.megatron}: HF tensors {shapes} do not stack along dim 0")
    return (sum(s[0] for s in shapes), *shapes[0][1:])


def qkv_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Separate q [nh*hd, ...], k and v [ng*hd, ...] -> Megatron linear_qkv [(nh+2ng)*hd, ...],
    grouped as [q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...].
    Works for weights ([., h]) and biases ([.])."""
    rest = q.shape[1:]
    groups = [t.reshape(num_kv_heads, -1, *rest) for t in (q, k, v)]
    return torch.cat(groups, dim=1).reshape(-1, *rest)


def qkv_split(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``qkv_merge``: Megatron linear_qkv (or a TP shard of it, given that shard's head
    counts) -> (q [nh*hd, ...], k [ng*hd, ...], v [ng*hd, ...])."""
    rest = qkv.shape[1:]
    q_per_group = num_heads // num_kv_heads * head_dim
    groups = qkv.reshape(num_kv_heads, q_per_group + 2 * head_dim, *rest)
    q, k, v = groups.split([q_per_group, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *rest) for t in (q, k, v))


def merge(p: Param, parts: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """``p``'s tensor from its HF tensors (in the table's order). Also builds TP shard r from
    block r of each HF tensor along tp_dim, given a ``cfg`` with that shard's head counts."""
    if p.merge == "qkv":
        return qkv_merge(*parts, cfg.num_kv_heads)
    if p.merge == "concat":
        return torch.cat(parts, dim=0)
    return parts[0]


def split(p: Param, tensor: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    """Inverse of ``merge``: ``p``'s tensor -> its HF tensors, in the table's order (views)."""
    if p.merge == "qkv":
        return qkv_split(tensor, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    if p.merge == "concat":
        return tensor.chunk(len(p.hf), dim=0)
    return (tensor,)


# ----------------------------------------------------------------------------------------------
# the Megatron view


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


def llama_param_metas(cfg: ModelConfig) -> list[ParamMeta]:
    """Megatron-Core (local spec) parameters of the full model, in model order (``cfg``'s family
    table; Llama and Qwen2 share one)."""
    return [ParamMeta(name=name, shape=megatron_shape(p, cfg), tp_dim=p.tp_dim,
                      tp_chunks=p.tp_chunks, layer=layer, position=p.position)
            for p, layer, name in model_params(cfg)]


def megatron_param_names(cfg: ModelConfig) -> list[str]:
    """All Megatron GPTModel (local spec) parameter names of the full model, in model order."""
    return [name for _, _, name in model_params(cfg)]


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


def stacked_layout(meta: ParamMeta) -> bool:
    """Whether a generation shard built from ``s > 1`` consecutive training shards is held as
    those shards stacked, ``[s, *training shard shape]`` (``plan_reshard(blocks=True)``), rather
    than in the standard layout: row-parallel weights (``tp_dim=1``, whose standard layout puts
    the shards side by side along dim 1) and SwiGLU ``linear_fc1`` (standard [gate; up], the
    shards hold [gate_r; up_r]). For the other dim-0 splits the stack is the standard layout."""
    return meta.tp_dim is not None and (meta.tp_dim != 0 or meta.tp_chunks > 1)


def stack(standard: torch.Tensor, meta: ParamMeta, s: int) -> torch.Tensor:
    """Inverse of ``unstack``: a generation shard in the standard layout -> the ``s`` training
    shards it is made of, stacked (what the switch gathers with ``blocks=True``)."""
    chunks = standard.chunk(meta.tp_chunks, dim=meta.tp_dim)
    pieces = [[c.chunk(s, dim=meta.tp_dim)[j] for c in chunks] for j in range(s)]
    return torch.stack([torch.cat(p, dim=meta.tp_dim) for p in pieces])


def unstack(stacked: torch.Tensor, meta: ParamMeta) -> torch.Tensor:
    """A stacked generation shard ``[s, *training shard shape]`` -> the standard layout (a
    copy)."""
    return unshard(list(stacked.unbind(0)), meta)


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


def stage_layer_counts(num_layers: int, pp: int, last: int | None = None) -> list[int]:
    """Layers held by each of ``pp`` pipeline stages. ``last`` None: an even split; otherwise the
    layout's ``last_stage_layers``: that many on the last stage and the rest split evenly over the
    others, as Megatron-Core places them given ``num_layers_in_last_pipeline_stage``
    (``get_transformer_layer_offset``). The last stage also computes the output layer and the
    loss, so giving it fewer layers balances the stages; it also lets a pp that does not divide
    the layers train (30 at pp=4: 8, 8, 8, 6).

    The one place that says how layers split: the engine (through Megatron), the reshard plan,
    the cost model and the memory estimate all read it. Errors name the layout's field."""
    if last is None:
        if num_layers % pp:
            raise ConfigError("layout.pp", f"pp={pp} does not divide the model's {num_layers} "
                                           f"layers; pick a pp that divides {num_layers}, or set "
                                           "layout.last_stage_layers to split them unevenly")
        return [num_layers // pp] * pp
    field = "layout.last_stage_layers"
    if pp == 1:
        raise ConfigError(field, "needs layout.pp > 1 (one stage holds every layer); set it to "
                                 "null or raise pp")
    if not 1 <= last < num_layers:
        raise ConfigError(field, f"{last} is not between 1 and the model's {num_layers} layers "
                                 f"minus one; pick one of 1..{num_layers - 1}")
    if (num_layers - last) % (pp - 1):
        fits = [k for k in range(1, num_layers) if (num_layers - k) % (pp - 1) == 0]
        raise ConfigError(field, f"the other {pp - 1} stages must split the remaining "
                                 f"{num_layers - last} of {num_layers} layers evenly; pick one of "
                                 f"{fits}")
    return [(num_layers - last) // (pp - 1)] * (pp - 1) + [last]


def stage_layers(num_layers: int, pp: int, pp_rank: int, last: int | None = None) -> range:
    """Global layer indices held by pipeline stage ``pp_rank`` (``last``: see
    ``stage_layer_counts``)."""
    counts = stage_layer_counts(num_layers, pp, last)
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank {pp_rank} outside a pipeline of {pp} stages")
    start = sum(counts[:pp_rank])
    return range(start, start + counts[pp_rank])


def owner_stage(meta: ParamMeta, pp: int, num_layers: int, last: int | None = None) -> int:
    """Training pipeline stage that holds ``meta``: pre -> 0, post -> pp-1, layers by the split
    (``last``: the layout's ``last_stage_layers``, see ``stage_layer_counts``)."""
    if meta.position == "pre":
        return 0
    if meta.position == "post":
        return pp - 1
    counts = stage_layer_counts(num_layers, pp, last)
    if not 0 <= meta.layer < num_layers:
        raise ValueError(f"{meta.name}: layer {meta.layer} outside a model of {num_layers} layers")
    # Every stage but the last holds counts[0] layers.
    return min(meta.layer // counts[0], pp - 1)


def num_layers_of(metas: list[ParamMeta]) -> int:
    """Layers of the model described by ``metas`` (1 + the largest layer index, 0 if none)."""
    return 1 + max((m.layer for m in metas if m.layer is not None), default=-1)


# ----------------------------------------------------------------------------------------------
# the vLLM view


def vllm_name(mg_name: str, cfg: ModelConfig) -> str:
    """vLLM parameter name of a Megatron parameter (global layer index); a tied output layer is
    vLLM's ``model.embed_tokens.weight``, which its last stage's ``lm_head`` is tied to."""
    p, layer = resolve(mg_name, cfg)
    return _named_as(p, cfg).vllm.format(i=layer)


def megatron_qkv_to_vllm(qkv_shard: torch.Tensor, cfg: ModelConfig, tp: int) -> torch.Tensor:
    """One TP rank's Megatron ``linear_qkv`` shard (weight or bias: rows ``[(nh+2ng)/tp * hd]``)
    -> vLLM's ``qkv_proj`` of the same rank: ``[q of its nh/tp heads; k; v of its ng/tp
    groups]``."""
    if cfg.num_kv_heads % tp:
        raise ArgumentError("tp",
                            f"tp={tp} must divide num_kv_heads={cfg.num_kv_heads} (Megatron keeps "
                            "whole query groups per rank)")
    q, k, v = qkv_split(qkv_shard, cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.head_dim)
    return torch.cat([q, k, v], dim=0)


def to_vllm_layout(mg_name: str, tensor: torch.Tensor, cfg: ModelConfig, tp: int
                   ) -> tuple[str, torch.Tensor]:
    """(vLLM name, vLLM's tensor) of one generation TP rank's shard of ``mg_name``. vLLM fuses a
    rank's blocks of the HF tensors in HF order: for merge "concat" ([gate_r; up_r]) that is
    Megatron's shard as is (a view), for "qkv" a regrouped copy."""
    p, _ = resolve(mg_name, cfg)
    if p.merge == "qkv":
        tensor = megatron_qkv_to_vllm(tensor, cfg, tp)
    return vllm_name(mg_name, cfg), tensor
