"""What the rollout test modules share: a tiny checkpoint, prompts, sampling configs, perturbed
weights, and the training engine's recomputation of rollout log-probs."""

from __future__ import annotations

import torch

from hybridflow.models.tiny import tiny_llama_config
from hybridflow.rollout.base import SamplingConfig, rollout_batch

CFG = tiny_llama_config()
# Different lengths, so the batch is left-padded.
PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 77, 78], [1, 200, 201, 202, 203, 204, 205, 206, 207, 5]]
GREEDY = SamplingConfig(temperature=0.0, max_tokens=12)
SAMPLED = SamplingConfig(temperature=0.8, top_k=40, top_p=0.9, max_tokens=12, n=2, seed=5)
UNSEEDED = SamplingConfig(temperature=1.0, max_tokens=12, n=2)  # the backend's seed decides
MAX_MODEL_LEN = 64


def perturbed(hf_sd: dict[str, torch.Tensor], seed: int = 1, scale: float = 0.03
              ) -> dict[str, torch.Tensor]:
    """hf_sd plus seeded noise (a stand-in for an optimizer step)."""
    g = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in sorted(hf_sd.items())}


def summary(outputs) -> list[tuple]:
    """(prompt, sample, tokens, finish) per output: what must match exactly across backends."""
    return [(o.prompt_index, o.sample_index, o.response_token_ids, o.finish_reason)
            for o in outputs]


def train_engine(hf_sd: dict[str, torch.Tensor], cfg=CFG):
    """A TrainEngine (tp=pp=dp=1, fp32) holding hf_sd; initialises Megatron's groups, which a
    MegatronRollout built afterwards in the same process reuses."""
    from hybridflow.models.hf import hf_to_megatron
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.engine import EngineConfig, TrainEngine

    engine = TrainEngine(cfg, TrainLayout(), EngineConfig(), build_optimizer=False)
    engine.load_full_weights(hf_to_megatron(hf_sd, cfg))
    return engine


def logprob_pairs(engine, outputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(rollout log-probs, the training engine's recomputed ones) at every response token."""
    batch = rollout_batch(outputs)
    recomputed = engine.compute_logprobs(
        {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})
    sel = batch["response_mask"].bool()
    return batch["rollout_logprobs"][sel], recomputed[sel]


def assert_generates_like(rollout, reference, weights: dict[str, torch.Tensor]) -> list[tuple]:
    """``rollout`` (weights already loaded) generates what ``reference`` does after
    update_weights_hf(weights): the same greedy tokens, log-probs within 1e-4. Returns the
    summary."""
    reference.update_weights_hf(weights.items())
    ours, ref = rollout.generate(PROMPTS, GREEDY), reference.generate(PROMPTS, GREEDY)
    assert summary(ours) == summary(ref)
    torch.testing.assert_close(torch.tensor([x for o in ours for x in o.logprobs]),
                               torch.tensor([x for o in ref for x in o.logprobs]),
                               atol=1e-4, rtol=0)
    return summary(ours)
