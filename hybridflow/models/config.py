"""The architecture of a decoder-only model, independent of any framework's config class."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.errors import ConfigError, check_choice, check_float, check_int


@dataclass(kw_only=True)
class ModelConfig:
    """A Llama-family decoder (Llama, Qwen2): RMSNorm, RoPE, SwiGLU MLP, grouped-query attention."""

    arch: str = "llama"
    """Architecture name: "llama" or "qwen2" (Qwen2 adds biases to q, k and v)."""
    vocab_size: int = 256
    """Rows of the embedding table."""
    hidden_size: int = 128
    """Width of the residual stream."""
    ffn_hidden_size: int = 256
    """Width of the MLP (each of gate and up)."""
    num_layers: int = 2
    """Transformer layers."""
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads (query groups); must divide num_heads."""
    head_dim: int = 32
    """Channels per head (hidden_size / num_heads for the usual models)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Output layer shares the embedding weight."""
    qkv_bias: bool = False
    """Biases on q, k and v (Qwen2)."""
    max_position_embeddings: int = 2048
    """Longest sequence RoPE is prepared for."""

    def __post_init__(self) -> None:
        check_choice("arch", self.arch, ("llama", "qwen2"))
        for name in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            check_int(name, getattr(self, name))
        check_float("rope_theta", self.rope_theta, low=0, low_open=True)
        check_float("rms_norm_eps", self.rms_norm_eps, low=0, low_open=True)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_kv_heads",
                              f"{self.num_kv_heads} does not divide num_heads={self.num_heads}")

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads
