"""A training engine's config: how a model trains (``EngineConfig``) and its optimizer
(``OptimConfig``). A run config composes them: each role's ``engine`` (``config/rl.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.errors import ConfigError, check_choice, check_float, check_int
from hybridflow.models.params import DTYPES


@dataclass(kw_only=True)
class OptimConfig:
    """The optimizer of a training engine (Megatron's, so it shards with the distributed one)."""

    name: str = "adam"
    """"adam" or "sgd"."""
    lr: float = 1e-5
    """Learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    distributed: bool = False
    """Shard optimizer state across data-parallel ranks (ZeRO-1, Megatron's distributed
    optimizer)."""
    offload: bool = False
    """Adam in host memory (``training/host_optimizer.py``): fp32 main weights, gradients and
    moments live on the host, each gradient leaves the GPU as the backward produces it, and the
    step runs on the host's cores; the GPU keeps only the model's weights (no 16 bytes a
    parameter of state: what lets one GPU train every parameter of a 7B model). Adam only; one
    training rank (layout tp = pp = dp = 1)."""

    def __post_init__(self) -> None:
        check_choice("name", self.name, ("adam", "sgd"))
        check_float("lr", self.lr, low=0)
        check_float("weight_decay", self.weight_decay, low=0)
        check_float("clip_grad", self.clip_grad, low=0)
        check_float("adam_beta1", self.adam_beta1, low=0, high=1, high_open=True)
        check_float("adam_beta2", self.adam_beta2, low=0, high=1, high_open=True)
        check_float("adam_eps", self.adam_eps, low=0, low_open=True)
        if self.offload and self.name != "adam":
            raise ConfigError("offload", f"the host optimizer runs Adam only; set name=adam or "
                                         f"offload=false (name={self.name})")
        if self.offload and self.distributed:
            raise ConfigError("offload", "the host optimizer holds one rank's whole state; "
                                         "set distributed=false")


@dataclass(kw_only=True)
class EngineConfig:
    """How a model trains: precision, micro-batching, sequence parallelism, optimizer."""

    micro_batch_size: int = 1
    """Sequences per micro-batch (per data-parallel rank) of a training step."""
    forward_micro_batch_size: int | None = None
    """Sequences per micro-batch of forward-only passes (log-probs, values). They keep no
    activations, so this can be several times ``micro_batch_size``; each micro-batch costs a
    fixed host-side overhead (Megatron's Python, kernel launches), which at small sizes is most of
    the pass. None: ``micro_batch_size``."""
    max_tokens_per_micro_batch: int | None = None
    """Dynamic batch size: micro-batches of training and forward-only passes hold at most this
    many computed tokens (sequences x the longest one's span of real tokens, padded to a multiple
    of tp under sequence parallelism), sequences grouped by length and padding columns cut, in
    place of ``micro_batch_size`` and ``forward_micro_batch_size`` (which are then not read; the
    run config refuses them set beside it). Must be at least the longest sequence. None:
    fixed-size micro-batches, all at the columns from the first that any row of the rank's batch
    uses to the last."""
    dtype: str = "fp32"
    """Parameter dtype: "fp32" or "bf16" (bf16 keeps fp32 main weights in the optimizer)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp > 1)."""
    recompute: bool = False
    """Full activation recompute in training steps: each transformer layer keeps only its input
    for the backward and runs its forward again there (Megatron's ``recompute_granularity=
    "full"``, one layer a unit), so a stage stores one [s, b, h] tensor a layer (and one layer's
    full activations while it recomputes) in place of every layer's; the update computes the
    layers' forward once more. Forward-only passes keep nothing and are unchanged."""
    seed: int = 1234
    """Seed of Megatron's model-parallel RNG trackers."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, tuple(DTYPES))
        check_int("micro_batch_size", self.micro_batch_size)
        check_int("forward_micro_batch_size", self.forward_micro_batch_size, none_ok=True)
        check_int("max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, none_ok=True)
        check_int("seed", self.seed, low=0)
        if not isinstance(self.optim, OptimConfig):
            raise ConfigError("optim", f"must be an OptimConfig, got {type(self.optim).__name__}")
