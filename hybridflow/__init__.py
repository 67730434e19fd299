"""hybridflow: RL post-training of LLMs with a single controller and the 3D-HybridEngine."""

__version__ = "0.1.0"
