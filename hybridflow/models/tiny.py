"""Tiny random Llama/Qwen2 models and a tiny tokenizer, built offline, for tests and the demo.

Head dims are 32 because vLLM's CPU attention rejects smaller ones; head counts are divisible by
the TP sizes the tests use.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hybridflow.models.config import ModelConfig
from hybridflow.models.hf import hf_config_from_model_config, save_hf_checkpoint

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML, as SmolLM2 and Qwen2 use it."""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Ids 0, 1, 2 of the tiny tokenizer: pad, bos, eos."""

# A few lines in the style of the prompts the demo trains on, to learn BPE merges from.
_CORPUS = [
    "You are a helpful assistant. Answer the question and put the final answer after ####.",
    "What is 12 + 35? Let's think step by step. 12 + 35 = 47. #### 47",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
    "How many clips did Natalia sell altogether in April and May? 48 / 2 = 24. 48 + 24 = 72.",
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "system user assistant: hello, how are you today? I am fine, thank you.",
    "Compute 7 * 8 - 6 = 50. The answer is 50. Count: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "Reinforcement learning from human feedback trains a policy with a reward model and PPO.",
]


def tiny_llama_config(**overrides: Any) -> ModelConfig:
    """Llama, untied: hidden 128, 4 heads of 32, 2 KV heads, 4 layers, vocab 512."""
    base = dict(arch="llama", vocab_size=512, hidden_size=128, ffn_hidden_size=256, num_layers=4,
                num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-6,
                tie_embeddings=False, qkv_bias=False, max_position_embeddings=512)
    return ModelConfig(**{**base, **overrides})


def tiny_qwen2_config(**overrides: Any) -> ModelConfig:
    """Qwen2, tied embeddings and q/k/v biases: hidden 128, 4 heads of 32, 2 KV heads, 4 layers."""
    base = dataclasses.asdict(tiny_llama_config())
    base.update(arch="qwen2", tie_embeddings=True, qkv_bias=True, rope_theta=1000000.0)
    return ModelConfig(**{**base, **overrides})


def tiny_tp4_config(arch: str = "llama", **overrides: Any) -> ModelConfig:
    """8 heads of 32 and 4 KV heads (hidden 256), so tensor parallelism up to 4 works."""
    make = tiny_llama_config if arch == "llama" else tiny_qwen2_config
    return make(**{"hidden_size": 256, "ffn_hidden_size": 512, "num_heads": 8, "num_kv_heads": 4,
                   **overrides})


def make_tiny_hf_model(cfg: ModelConfig, seed: int = 0) -> Any:
    """A transformers ``LlamaForCausalLM``/``Qwen2ForCausalLM`` in fp32, in eval mode, with every
    parameter (norms and biases too) drawn from a generator seeded with ``seed``, so the weights
    do not depend on transformers' init order or on the global RNG."""
    import transformers  # deferred: transformers

    hf_cfg = hf_config_from_model_config(cfg, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cls = getattr(transformers, hf_cfg.architectures[0])
    with torch.random.fork_rng(devices=[]):  # transformers' own init draws from the global RNG
        model = cls(hf_cfg).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise)
    return model.eval()


def make_tiny_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained offline on a few built-in lines, with
    at most ``vocab_size`` tokens; pad/bos/eos are <|endoftext|>/<|im_start|>/<|im_end|> (ids 0,
    1, 2) and its chat template is ChatML."""
    from transformers import PreTrainedTokenizerFast  # deferred: transformers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=SPECIAL_TOKENS[0], bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2], chat_template=CHATML_TEMPLATE, model_max_length=512)


def save_tiny_checkpoint(ckpt_dir: str | os.PathLike, cfg: ModelConfig, seed: int = 0) -> Path:
    """Write ``make_tiny_hf_model(cfg, seed)`` with the tiny tokenizer as an HF checkpoint."""
    model = make_tiny_hf_model(cfg, seed)
    return save_hf_checkpoint(ckpt_dir, model.state_dict(), cfg,
                              tokenizer=make_tiny_tokenizer(cfg.vocab_size))
