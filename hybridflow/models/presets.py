"""Shape presets: the architectures of models that have no weights here, by name.

``model: llama2-7b`` (or ``reward_model:``, ``cost_model:``) gives ``hybridflow check`` a model's
shape without a checkpoint, so that a config for a cluster (the HybridFlow paper's, in
experiments/paper/) can be checked anywhere: sizes against layouts, world sizes against GPUs,
memory per GPU. Training needs the weights: ``hybridflow train`` refuses a preset and asks for
the checkpoint directory instead.

The Llama-2 shapes are those of Meta's HF checkpoints (Touvron et al. 2023, Table 1 and the
config.json files): vocab 32000, untied embeddings, RoPE base 10000, 4096 positions, RMSNorm eps
1e-5, head dim 128. 70B uses grouped-query attention with 8 KV heads.

Meta released no Llama-2 34B. The HybridFlow paper's 34B is a Llama-2-architecture 34B; the
one public model of that architecture and size is CodeLlama-34B, whose shape ``llama2-34b``
takes (hidden 8192, 48 layers, 64 heads, 8 KV heads, ffn 22016). CodeLlama itself was trained
with RoPE base 1e6 and 16k positions; the preset keeps Llama-2's 10000 and 4096, which change
no tensor's shape and nothing the checks compute.
"""

from __future__ import annotations

from hybridflow.models.config import ModelConfig


def _llama2(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=32000, hidden_size=hidden, ffn_hidden_size=ffn,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=hidden // heads, rope_theta=10000.0, rms_norm_eps=1e-5,
                       tie_embeddings=False, qkv_bias=False, max_position_embeddings=4096)


SHAPES: dict[str, ModelConfig] = {
    "llama2-7b": _llama2(4096, 32, 32, 32, 11008),
    "llama2-13b": _llama2(5120, 40, 40, 40, 13824),
    "llama2-34b": _llama2(8192, 48, 64, 8, 22016),  # CodeLlama-34B's shape: see above
    "llama2-70b": _llama2(8192, 80, 64, 8, 28672),
}
"""Shape preset name -> the model's architecture (no weights, no tokenizer)."""


HF_NAMES = {"llama2-7b": "Llama-2-7b-hf", "llama2-13b": "Llama-2-13b-hf",
            "llama2-34b": "CodeLlama-34b-hf", "llama2-70b": "Llama-2-70b-hf"}
"""Shape preset -> the name of the HF checkpoint of that shape (what a user gives instead)."""


def shape_preset(name: str) -> ModelConfig | None:
    """The shape of preset ``name``, or None if ``name`` is no shape preset."""
    return SHAPES.get(name)
