"""hybridflow: RL post-training of LLMs with a single controller and the 3D-HybridEngine."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import hybridflow` stays light; RLTrainer pulls in torch, Ray and Megatron.
    if name == "RLTrainer":
        from hybridflow.trainer import RLTrainer
        return RLTrainer
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")
