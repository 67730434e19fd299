"""The models' RMSNorm, built from Megatron's TransformerConfig, with sequence parallelism.

Megatron-Core's local layer spec (``get_gpt_layer_local_spec``, the one we build without
Transformer Engine) builds its norms through ``WrappedTorchNorm``, which asserts that sequence
parallelism is off: only TE's norm marks its weight for the TP all-reduce that sequence
parallelism needs. Under it each TP rank normalises its own part of the sequence, so its weight
gradient is a partial sum; ``finalize_model_grads`` all-reduces over TP the gradients of the
parameters flagged ``sequence_parallel``. ``RMSNorm`` is torch's (its forward and backward,
unchanged) with that flag set from the config, on every device. ``model.block_spec`` puts it in
every norm slot of the spec (each layer's two and the final one).
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` over the last ``hidden_size`` features, its weight in the config's
    ``params_dtype`` on the config's device and flagged ``sequence_parallel`` as the config is.
    Refuses what it does not implement rather than ignoring it."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise NotImplementedError("RMSNorm: normalization='RMSNorm' without a "
                                      f"zero-centred gamma only, not {config.normalization!r}")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(hidden_size, eps=eps, device=device, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel
