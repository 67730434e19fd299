"""The smallest changes megatron-core needs to train on CPU with gloo, and one that keeps its
fallback gradient scale (no apex/TE) from copying every gradient there.

Target: megatron-core 0.16.1. Applied only when CUDA is absent; each patch is a literal text
replacement inside one function (see _source.py), so a patch that stops matching the installed
source raises instead of silently doing nothing, and tests/unit/test_megatron_patches.py checks that
every patch still applies (and therefore is still needed: the CUDA-only text is still there).
Since a GPU runs none of them, a patch of a model module's method may only move tensors off the
CUDA device; tests/distributed/test_module_origin.py checks that the built models run no other
(our own modules take the place of Megatron's where more must change: hybridflow/training/norm.py).
"""

from __future__ import annotations

from megatron_patches._source import PatchError, SourcePatch

TARGET_VERSION = "0.16.1"

# The CUDA-only spellings we replace, by what they mean on CPU.
CUDA_DEVICE = ("torch.cuda.current_device()", "'cpu'")
CUDA_LITERAL = ("device='cuda'", "device='cpu'")
CUDA_LITERAL_DQ = ('device="cuda"', 'device="cpu"')
CUDA_FLOAT_TYPE = ("'torch.cuda.FloatTensor'", "'torch.FloatTensor'")
CUDA_HALF_TYPES = ("['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']",
                   "['torch.HalfTensor', 'torch.BFloat16Tensor']")


def _patch(target: str, reason: str, *replacements: tuple[str, str]) -> SourcePatch:
    return SourcePatch(f"megatron.core.{target}", tuple(replacements), reason)


PATCHES: tuple[SourcePatch, ...] = (
    _patch("models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.__init__",
           "RoPE builds inv_freq on the current CUDA device unless use_cpu_initialization.",
           ("else torch.cuda.current_device()", "else 'cpu'")),
    _patch("models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.get_emb",
           "Every RoPE forward moves a CPU inv_freq to the current CUDA device.",
           ("self.inv_freq.to(device=torch.cuda.current_device())", "self.inv_freq")),
    *(_patch(f"pipeline_parallel.schedules:{fn}",
             "total_num_tokens is allocated on the literal device 'cuda'.", CUDA_LITERAL_DQ)
      for fn in ("forward_backward_no_pipelining",
                 "forward_backward_pipelining_without_interleaving",
                 "forward_backward_pipelining_with_interleaving")),
    _patch("distributed.param_and_grad_buffer:_ParamAndGradBuffer.__init__",
           "DDP's flat param and grad buffers are allocated on the current CUDA device.",
           CUDA_DEVICE),
    _patch("optimizer.optimizer:MixedPrecisionOptimizer.__init__",
           "found_inf and loss-scale scalars are allocated on the literal device 'cuda'.",
           CUDA_LITERAL),
    _patch("optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
           "bf16/fp16 and fp32 params are recognised by 'torch.cuda.*Tensor' type strings.",
           CUDA_HALF_TYPES, CUDA_FLOAT_TYPE),
    _patch("optimizer.optimizer:FP32Optimizer.__init__",
           "the unit loss scale is allocated on the literal device 'cuda'.", CUDA_LITERAL),
    _patch("optimizer.optimizer:ChainedOptimizer.get_loss_scale",
           "the unit loss scale is allocated on the current CUDA device.", CUDA_DEVICE),
    _patch("optimizer.clip_grads:get_grad_norm_fp32",
           "the grad norm is reduced through tensors on the literal device 'cuda'.", CUDA_LITERAL),
    _patch("optimizer.clip_grads:clip_grad_by_total_norm_fp32",
           "asserts grads are 'torch.cuda.FloatTensor' and scales through a 'cuda' buffer.",
           CUDA_FLOAT_TYPE, CUDA_LITERAL),
    _patch("optimizer.clip_grads:count_zeros_fp32",
           "the zero count is reduced through a tensor on the literal device 'cuda'.", CUDA_LITERAL),
    _patch("optimizer.distrib_optimizer:DistributedOptimizer.__init__",
           "bf16/fp16 params are recognised by 'torch.cuda.*Tensor' type strings.",
           CUDA_HALF_TYPES),
    _patch("optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups",
           "bf16/fp16 and fp32 params are recognised by 'torch.cuda.*Tensor' type strings.",
           CUDA_HALF_TYPES, CUDA_FLOAT_TYPE),
    _patch("utils:GlobalMemoryBuffer.get_tensor",
           "the attention score buffer is allocated on the current CUDA device.", CUDA_DEVICE),
    _patch("utils:local_multi_tensor_l2_norm",
           "the fallback (no apex/TE) l2 norm returns a tensor on the literal device 'cuda'.",
           CUDA_LITERAL_DQ),
    _patch("utils:local_multi_tensor_scale",
           "the fallback (no apex/TE) scale writes a scaled copy of every tensor and copies it "
           "back, also where source and destination are one tensor (the clip by the total norm, "
           "every gradient each step): a pass over memory that has gone cold for every "
           "gradient, ~0.3 s for SmolLM2's 113 MB table on a 2-core machine. In place there.",
           ("dst.copy_(src * scale)", "dst.mul_(scale) if src is dst else dst.copy_(src * scale)")),
    _patch("pipeline_parallel.p2p_communication:P2PCommunicator._communicate",
           "receive buffers between pipeline stages are allocated on the current CUDA device.",
           CUDA_DEVICE),
    _patch("pipeline_parallel.p2p_communication:P2PCommunicator._communicate_shapes",
           "with variable_seq_lengths (a token budget per micro-batch) the shapes sent between "
           "pipeline stages are tensors on the current CUDA device, and it synchronises CUDA.",
           CUDA_DEVICE, ("torch.cuda.synchronize()", "pass")),
    *(_patch(f"tensor_parallel.mappings:{fn}",
             "TP gathers/scatters (sequence parallel, vocab logits) allocate on the current CUDA "
             "device.", CUDA_DEVICE)
      for fn in ("_gather_along_first_dim", "_reduce_scatter_along_first_dim",
                 "_gather_along_last_dim")),
    _patch("tensor_parallel.layers:LinearWithGradAccumulationAndAsyncCommunication.backward",
           "the sequence-parallel reduce-scatter of input grads allocates on the current CUDA "
           "device.", CUDA_DEVICE),
    _patch("models.common.language_module.language_module:LanguageModule."
           "setup_embeddings_and_output_layer",
           "with tied embeddings under PP, the last stage's copy is moved with .cuda() before the "
           "all-reduce that makes it equal to the first stage's.",
           ("weight.data = weight.data.cuda()", "weight.data = weight.data")),
    _patch("dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync.preload_tensors",
           "a checkpoint save waits for the device-to-host copies with torch.cuda.synchronize(); "
           "on CPU, tensor.to('cpu') has nothing to wait for.",
           ("torch.cuda.synchronize()", "pass")),
    _patch("dist_checkpointing.strategies.state_dict_saver:save_state_dict_async_finalize",
           "a checkpoint save broadcasts its write-failure flag in a tensor on the current CUDA "
           "device.", CUDA_DEVICE),
    _patch("tensor_parallel.random:_get_all_rng_states",
           "full activation recompute (engine.recompute) saves the current CUDA generator's state "
           "with every layer's input; on CPU there is none (the CPU generator's and the "
           "tracker's states are saved beside it).",
           ("_get_cuda_rng_state(\n        graph_safe=is_graph_safe_cuda_rng_tracker("
            "get_cuda_rng_tracker())\n    )", "None")),
    _patch("tensor_parallel.random:_set_all_rng_states",
           "full activation recompute (engine.recompute) restores the CUDA generator's state "
           "around every layer's recompute; on CPU there is none.",
           ("_set_cuda_rng_state(\n        cuda_rng_state, graph_safe=is_graph_safe_cuda_rng_"
            "tracker(get_cuda_rng_tracker())\n    )", "pass")),
    _patch("transformer.attention:Attention._allocate_memory",
           "inference (rollout/megatron.py's StaticInferenceContext) allocates the KV cache on "
           "the current CUDA device.", CUDA_DEVICE),
)

def apply() -> None:
    """Apply every patch when there is no CUDA; a no-op on GPU machines and on a second call."""
    import torch
    if torch.cuda.is_available():
        return
    from importlib.metadata import version
    installed = version("megatron-core")
    if installed != TARGET_VERSION:
        raise PatchError(f"megatron_patches target megatron-core {TARGET_VERSION}, found "
                         f"{installed}: pip install megatron-core=={TARGET_VERSION}")
    for patch in PATCHES:
        patch.apply()
