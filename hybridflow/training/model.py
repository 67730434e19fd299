"""The Megatron-Core GPTModel a TrainEngine trains, built from a ModelConfig at a TrainLayout:
its TransformerConfig, its chunks (one per virtual pipeline stage), the names of its parameters,
the value head of critics and reward models, and the inputs it reads (positions, the attention
mask). The Megatron rollout (``rollout/megatron.py``) takes its TransformerConfig and its inputs
from here too."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from hybridflow.errors import ConfigError
from hybridflow.models.config import ModelConfig
from hybridflow.models.params import DTYPES, stage_layer_counts
from hybridflow.parallel.layout import TrainLayout
from hybridflow.training.config import EngineConfig
from megatron_patches import rope, wgrad


def check_model_fits_layout(model: ModelConfig, layout: TrainLayout, engine: EngineConfig) -> None:
    """Everything about a (model, layout) pair that Megatron would only assert on deep inside."""
    t, p = layout.tp, layout.pp
    if model.num_heads % t:
        raise ConfigError("layout.tp", f"tp={t} must divide model.num_heads={model.num_heads}")
    if model.num_kv_heads % t:
        raise ConfigError("layout.tp",
                          f"tp={t} must divide model.num_kv_heads={model.num_kv_heads}")
    if model.ffn_hidden_size % t:
        raise ConfigError("layout.tp",
                          f"tp={t} must divide model.ffn_hidden_size={model.ffn_hidden_size}")
    if model.vocab_size % t:
        raise ConfigError("layout.tp", f"tp={t} must divide model.vocab_size={model.vocab_size}")
    stages = p * (layout.vpp or 1)
    if layout.last_stage_layers is not None:  # TrainLayout refuses it with vpp
        stage_layer_counts(model.num_layers, p, layout.last_stage_layers)
    elif model.num_layers % stages:
        raise ConfigError("layout.pp", f"pp*vpp={stages} must divide model.num_layers="
                          f"{model.num_layers}" + ("" if layout.vpp else
                                                   ", or set layout.last_stage_layers"))
    if engine.sequence_parallel and t == 1:
        raise ConfigError("engine.sequence_parallel", "needs layout.tp > 1; set it to false")


def transformer_config(model: ModelConfig, layout: TrainLayout, engine: EngineConfig):
    """Megatron's TransformerConfig for a Llama-family model; fusions that need CUDA or
    Transformer Engine are off, except those megatron_patches stands in for."""
    from megatron.core.transformer import TransformerConfig  # deferred: Megatron

    dtype = DTYPES[engine.dtype]
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_heads,
        num_query_groups=model.num_kv_heads,
        kv_channels=model.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # On a GPU, SwiGLU and the vocabulary-parallel cross entropy are Megatron's fused
        # versions: torch.compile'd kernels (megatron.core.jit), no Transformer Engine needed.
        # The fused cross entropy returns its gradient in bf16 whatever the logits' dtype.
        bias_activation_fusion=_compiled_fusions(),
        cross_entropy_loss_fusion=_compiled_fusions() and engine.dtype == "bf16",
        cross_entropy_fusion_impl="native",
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=_rope_fusion(),  # megatron_patches/rope.py's stand-in for TE's
        persist_layer_norm=False,
        # On CUDA each weight gradient is added into the fp32 main_grad by its own GEMM
        # (megatron_patches/wgrad.py says why), not written out and added by DDP's hook. The
        # host optimizer has no main_grad: its hooks take each parameter's own gradient.
        gradient_accumulation_fusion=_wgrad_fusion() and not engine.optim.offload,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        # Megatron's split is models.params.stage_layer_counts', which the reshard plan reads.
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        sequence_parallel=engine.sequence_parallel,
        # Full recompute, one layer a unit (Megatron recomputes only in training mode).
        recompute_granularity="full" if engine.recompute else None,
        recompute_method="uniform" if engine.recompute else None,
        recompute_num_layers=1 if engine.recompute else None,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=engine.dtype == "bf16",
        use_cpu_initialization=not torch.cuda.is_available(),
        # Weights always arrive through load_full_weights, but initialisation is what marks params
        # as tensor-parallel (set_tensor_model_parallel_attributes); without it the grad norm
        # counts one TP shard only.
        perform_initialization=True,
        calculate_per_token_loss=True,  # we own the normalisation: engine.py's docstring
        # Budgeted micro-batches differ in width and rows: pipeline stages then send each
        # activation's shape before it (a small p2p per micro-batch), so only then.
        variable_seq_lengths=engine.max_tokens_per_micro_batch is not None,
        # The models are dense; only MoE's default dispatcher refuses variable lengths.
        moe_token_dispatcher_type="alltoall",
        batch_p2p_sync=torch.cuda.is_available(),  # p2p's sync calls torch.cuda.synchronize
        # gloo matches point-to-point messages by (peer, tag) in posting order; a batched
        # isend/irecv with the same peer both ways (pp=2 under interleaving) can swap activations
        # and grads. Separate ops, posted in Megatron's even/odd order, match one to one.
        batch_p2p_comm=torch.cuda.is_available(),
        deallocate_pipeline_outputs=False,
    )


def _compiled_fusions() -> bool:
    """Megatron's torch.compile'd fusions run where Triton compiles them: on CUDA. (On CPU
    inductor would compile C++ for each new shape; not tried.)"""
    return torch.cuda.is_available()


def _rope_fusion() -> bool:
    return rope.apply()


def _wgrad_fusion() -> bool:
    return wgrad.apply()


def block_spec(tf_config, vp_stage: int | None, pp_rank: int, sdpa: bool):
    """The decoder block GPTModel builds on pipeline rank ``pp_rank`` (virtual stage
    ``vp_stage``): Megatron-Core's local layer spec with our RMSNorm (``norm.py``) in every norm
    slot, each layer's two and the final one, and with ``sdpa`` our SDPA core attention
    (``attention.py``; training's full sequences). Megatron's own local norm refuses sequence
    parallelism, and no GPU path may depend on a CPU-only patch of it."""
    # deferred: Megatron
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    from hybridflow.training import attention
    from hybridflow.training.norm import RMSNorm

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm
    if sdpa:
        layer.self_attention.submodules.core_attention = attention.SDPAttention
    layers = get_num_layers_to_build(tf_config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=RMSNorm)


def _build_chunks(model: ModelConfig, layout: TrainLayout, tf_config, pg_collection):
    # deferred: Megatron
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel.utils import (is_pp_first_stage, is_pp_last_stage,
                                                       is_vp_first_stage, is_vp_last_stage)

    from hybridflow.training import attention

    chunks = []
    for vp in range(layout.vpp or 1):
        vp_stage = vp if layout.vpp else None
        chunk = GPTModel(
            config=tf_config,
            # SDPA in place of the local spec's unfused attention (attention.py's docstring)
            transformer_layer_spec=block_spec(tf_config, vp_stage, pg_collection.pp.rank(),
                                              sdpa=attention.ENABLED),
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_position_embeddings,
            pre_process=(is_pp_first_stage(pg_collection.pp)
                         and is_vp_first_stage(vp_stage, layout.vpp)),
            post_process=(is_pp_last_stage(pg_collection.pp)
                          and is_vp_last_stage(vp_stage, layout.vpp)),
            share_embeddings_and_output_weights=model.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=int(model.rope_theta),
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )
        # One dtype on one device keeps the reshard a single flat buffer, whatever device and
        # dtype a module of Megatron's builds its tensors in.
        chunk = chunk.to(device="cuda" if torch.cuda.is_available() else "cpu",
                         dtype=tf_config.params_dtype)
        chunks.append(chunk)
    return chunks


def recompute_from_frozen_embedding(chunks) -> None:
    """Make the output of each first-stage chunk's embedding require grad in training forwards,
    for full recompute (``engine.recompute``) behind a frozen embedding (LoRA). Megatron
    checkpoints a layer with a reentrant autograd Function, whose output requires grad only if
    an input does: behind a frozen table no layer's would, and the adapters inside would get no
    gradient. Later pipeline stages receive activations that require grad already."""
    def require_grad(module, args, output):
        if torch.is_grad_enabled() and not output.requires_grad:
            output.requires_grad_()
        return output

    for chunk in chunks:
        if chunk.pre_process:
            chunk.embedding.register_forward_hook(require_grad)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_name(chunk, local_name: str) -> str:
    """Megatron name with the global layer index (``layer_number`` is 1-based and global)."""
    m = _LAYER.match(local_name)
    if not m:
        return local_name
    layer = chunk.decoder.layers[int(m.group(1))]
    return f"decoder.layers.{layer.layer_number - 1}." + local_name[m.end():]


class ValueHead(torch.nn.Module):
    """A scalar head in place of GPTModel's output layer (critics, reward and cost models):
    [s, b, h] -> [s, b, 1], replicated over TP ranks (each sees the same hidden states)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.sequence_parallel = False  # GPTModel reads this attribute of its output layer

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return hidden @ self.weight.t(), None


ADAPTER_SUFFIXES = ("lora_A", "lora_B")
"""Names of LoRA adapter parameters end so (``training/lora.py``)."""

VALUE_HEAD = "value_head.weight"
"""Name of a value head's weight in full state dicts (its Megatron module is output_layer)."""


def batch_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only real tokens, so left padding does not shift RoPE. [B,S] -> [B,S]."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def batch_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B,S] 1=real token -> Megatron's [B,1,S,S] bool mask, True where attention is blocked:
    future keys and padding keys."""
    s = attention_mask.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal[None] & attention_mask.bool()[:, None, :]
    return ~allowed[:, None]


def shift_right(x: torch.Tensor) -> torch.Tensor:
    """[b, s] -> [b, s]: position i gets ``x[:, i - 1]`` (0 at i = 0), what the model computed
    having read the tokens before token i: its log-prob, the entropy of its prediction, the value
    of the state it was chosen in."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
