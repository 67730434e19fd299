"""What the rollout test modules share: a tiny checkpoint, prompts, sampling configs, perturbed
weights, the training engine's recomputation of rollout log-probs, and the rollout/training
mismatch metrics."""

from __future__ import annotations

import torch

from hybridflow.algorithms import rollout_mismatch
from hybridflow.models.tiny import tiny_llama_config
from hybridflow.rollout.base import SamplingConfig, rollout_batch

CFG = tiny_llama_config()
# Different lengths, so the batch is left-padded.
PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 77, 78], [1, 200, 201, 202, 203, 204, 205, 206, 207, 5]]
GREEDY = SamplingConfig(temperature=0.0, max_tokens=12)
SAMPLED = SamplingConfig(temperature=0.8, top_k=40, top_p=0.9, max_tokens=12, n=2, seed=5)
UNSEEDED = SamplingConfig(temperature=1.0, max_tokens=12, n=2)  # the backend's seed decides
# Temperature 1, no top-k/top-p: drawn from the raw distribution, as the k3 KL estimate assumes.
RAW = SamplingConfig(temperature=1.0, max_tokens=12, n=4, seed=11)
# Noise on the rollout's weights only (0: exactly the training engine's), increasing.
MISMATCH_SCALES = (0.0, 1e-3, 1e-2)
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
    from hybridflow.training.config import EngineConfig
    from hybridflow.training.engine import TrainEngine

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


def samples_off_policy(rollout, hf_sd: dict[str, torch.Tensor]) -> dict[float, list]:
    """RAW samples of ``rollout`` holding hf_sd perturbed by each of MISMATCH_SCALES, loaded with
    update_weights_hf; the rollout holds hf_sd again afterwards."""
    out = {}
    for scale in MISMATCH_SCALES:
        weights = perturbed(hf_sd, seed=4, scale=scale) if scale else hf_sd
        rollout.update_weights_hf(weights.items())
        out[scale] = rollout.generate(PROMPTS, RAW)
    rollout.update_weights_hf(hf_sd.items())
    return out


def mismatch_metrics(engine, outputs) -> dict[str, float]:
    """rollout_mismatch of the outputs' log-probs against the training engine's recomputation,
    over response tokens, as the trainer logs it."""
    batch = rollout_batch(outputs)
    train = engine.compute_logprobs(
        {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})
    metrics = rollout_mismatch(batch["rollout_logprobs"], train, batch["response_mask"])
    return {k: v.item() for k, v in metrics.items()}


def assert_mismatch_moves(by_scale: dict[float, dict[str, float]], identical_bound: float) -> None:
    """Mismatch metrics by MISMATCH_SCALES: ~0 with identical weights (|diff| <= identical_bound),
    far above that with the smallest perturbation, and further up with each larger one."""
    same, first, last = (by_scale[s] for s in (0.0, MISMATCH_SCALES[1], MISMATCH_SCALES[-1]))
    assert same["mismatch/abs_diff_max"] <= identical_bound, by_scale
    assert same["mismatch/kl"] <= identical_bound ** 2, by_scale  # k3 ~ diff^2 / 2
    assert same["mismatch/ratio_outside_frac"] == 0, by_scale
    assert first["mismatch/abs_diff_mean"] > 100 * identical_bound, by_scale
    assert first["mismatch/kl"] > 100 * identical_bound ** 2, by_scale
    for low, high in zip(MISMATCH_SCALES[1:], MISMATCH_SCALES[2:]):
        for key in ("mismatch/abs_diff_mean", "mismatch/abs_diff_max", "mismatch/kl"):
            assert by_scale[high][key] > 3 * by_scale[low][key], (key, by_scale)
    assert last["mismatch/ratio_outside_frac"] > 0, by_scale


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
