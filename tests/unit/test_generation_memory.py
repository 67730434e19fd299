"""The generation phase's rollout terms of the memory estimate (``MegatronRollout.memory``): the
KV cache and the fast decoder's decode transient, the larger of the prefill's activations
(``prefill_bytes``) and the sampling's [rows, V] buffers (``sampling_bytes``).

On CPU the terms are pinned against hand computations. On a GPU (``-m gpu``) one spawned process
builds ``MegatronRollout`` from a bare shape with random bf16 weights, runs a warm-up call
(Triton's compilations, cuBLAS's workspaces: held before every call of an RL run), frees the
cache, then measures the allocator's peak of one ``generate`` call above what was allocated
before it (the weights) against the estimate's generation terms: within 10%. Cases: llama-0.9b's
shape at the GRPO run of docs/planner.md (32 prompts x 4 samples, 480-token prompts, 256 new
tokens: the prefill dominates), and a small model with a large vocabulary and top-p sampling
(the sampling dominates).
"""

import pytest
import torch

from hybridflow.config.rl import RolloutConfig
from hybridflow.models.config import ModelConfig
from hybridflow.parallel.spawn import spawn
from hybridflow.rollout.base import SamplingConfig
from hybridflow.rollout.fast_decode import prefill_bytes
from hybridflow.rollout.megatron import MegatronRollout, sampling_bytes

SMALL = dict(vocab_size=1000, hidden_size=64, ffn_hidden_size=176, num_layers=2, num_heads=8,
             num_kv_heads=2, head_dim=16, max_position_embeddings=4096)
LLAMA_09B = dict(vocab_size=32000, hidden_size=2048, ffn_hidden_size=5632, num_layers=16,
                 num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=4096)
WIDE_VOCAB = dict(vocab_size=65536, hidden_size=512, ffn_hidden_size=1408, num_layers=2,
                  num_heads=8, num_kv_heads=4, head_dim=64, max_position_embeddings=4096)


def generation_terms(shape: ModelConfig, sampling: SamplingConfig, prompts: int, width: int,
                     tp: int = 1, dtype_bytes: int = 2, keep_cache: bool = False):
    """``MegatronRollout.memory`` for ``prompts`` prompts of ``width`` tokens, as the planner
    asks it (``planner.memory._engine``)."""
    kv = 2 * shape.num_layers * max(1, shape.num_kv_heads // tp) * shape.head_dim * dtype_bytes
    rollout = RolloutConfig(backend="megatron", sampling=sampling, keep_cache=keep_cache)
    return MegatronRollout.memory(
        rollout, shape=shape, tp=tp, dtype_bytes=dtype_bytes, prompt=width, weight_bytes=0,
        share=prompts * sampling.n, seq=width + sampling.max_tokens, kv_per_token=kv,
        logit_bytes=shape.vocab_size * (dtype_bytes + 4))


def test_prefill_bytes_by_hand():
    shape = ModelConfig(**SMALL)  # h 64, q 128, kv 32 (k or v), f 176, 4 query heads a group
    per_token = 8 * 64 + 3 * 128 + 2 * 32 + 3 * 176  # 1488 entries
    # 5 prompts of 40 tokens, all prefilled at once: 200 tokens, bf16, and the bool mask.
    assert prefill_bytes(shape, 5, 40, tp=1, dtype_bytes=2) == 200 * 2 * per_token + 5 * 4 * 1600
    # A budget of 100 tokens prefills 2 prompts of 40 at a time.
    assert prefill_bytes(shape, 5, 40, 1, 2, prefill_tokens=100) == 80 * 2 * 1488 + 2 * 4 * 1600
    # A prompt wider than the budget goes alone.
    assert prefill_bytes(shape, 5, 40, 1, 4, prefill_tokens=10) == 40 * 4 * 1488 + 4 * 1600
    # tp = 2 halves q, kv and f, not the hidden size.
    assert prefill_bytes(shape, 1, 40, tp=2, dtype_bytes=2) == (
        40 * 2 * (8 * 64 + 3 * 64 + 2 * 16 + 3 * 88) + 4 * 1600)


def test_sampling_bytes_by_hand():
    plain = SamplingConfig(temperature=1.0)
    assert sampling_bytes(plain, 1000, 2) == 6  # bf16 logits + fp32 noise
    assert sampling_bytes(plain, 1000, 4) == 8
    assert sampling_bytes(SamplingConfig(temperature=0.0), 1000, 2) == 10
    assert sampling_bytes(SamplingConfig(temperature=0.0), 1000, 4) == 8
    assert sampling_bytes(SamplingConfig(top_p=0.9), 1000, 2) == 2 + 4 + 37
    assert sampling_bytes(SamplingConfig(top_p=0.9), 1000, 4) == 4 + 37
    assert sampling_bytes(SamplingConfig(top_k=50), 1000, 2) == 2 + 4 + 16
    assert sampling_bytes(SamplingConfig(top_k=1000), 1000, 2) == 6  # all of them: plain


def test_generation_terms_of_the_megatron_backend():
    shape = ModelConfig(**SMALL)
    sampling = SamplingConfig(n=4, max_tokens=24)
    resident, generation = generation_terms(shape, sampling, prompts=5, width=40)
    kv = 20 * 64 * (2 * 2 * 2 * 16 * 2)  # 20 rows of 64 tokens, 2 layers of K and V
    prefill = prefill_bytes(shape, 5, 40, 1, 2)  # each prompt prefilled once for its 4 rows
    assert prefill > 20 * 1000 * 6  # the sampling's [20, V] logits and noise
    assert resident == {}
    assert generation == {"kv cache": kv, "decode transient": prefill}
    # Top-p over [20, 1000]: 43 bytes an entry, more than the prefill.
    top_p = SamplingConfig(n=4, max_tokens=24, top_p=0.9)
    assert generation_terms(shape, top_p, 5, 40)[1]["decode transient"] == 20 * 1000 * 43
    # keep_cache: the cache through every phase, the transient in generation only.
    assert generation_terms(shape, sampling, 5, 40, keep_cache=True) == (
        {"kv cache": kv}, {"decode transient": prefill})
    # 300 rows decode 256 at a time (max_batch_size), not whole groups of 3: every row of the
    # first 256 prefills its prompt.
    assert generation_terms(shape, SamplingConfig(n=3, max_tokens=24), 100, 40)[1] == {
        "kv cache": 256 * 64 * (2 * 2 * 2 * 16 * 2),
        "decode transient": prefill_bytes(shape, 256, 40, 1, 2)}
    # tp = 2: Megatron's own forward, whose transient is not modelled.
    assert generation_terms(shape, sampling, 5, 40, tp=2)[1] == {"kv cache": kv // 2}


# ------------------------------------------------------------------------------ on a GPU
def measure(rank, world, shape_kw, prompts, width, sampling_kw):
    """(peak of one generate call above what was allocated before it, the estimate's generation
    terms) in bytes, after a warm-up call and ``sleep``."""
    from hybridflow.models.params import llama_param_metas

    shape = ModelConfig(**shape_kw)
    sampling = SamplingConfig(**sampling_kw)
    rollout = MegatronRollout(shape, dtype="bf16", max_model_len=width + sampling.max_tokens)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rollout.load_generation_weights({
        m.name: torch.randn(m.shape, generator=gen, device="cuda").to(torch.bfloat16) * 0.02
        for m in llama_param_metas(shape)})
    ids = torch.randint(1, shape.vocab_size, (prompts, width), generator=gen, device="cuda")
    ids = ids.tolist()
    rollout.generate(ids, sampling)  # compiles, captures, allocates cuBLAS's workspaces
    rollout.sleep()  # frees the cache and the graphs
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    rollout.generate(ids, sampling)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before
    return measured, generation_terms(shape, sampling, prompts, width)[1]


GPU_CASES = {  # name: (shape, prompts, width, sampling)
    "llama-0.9b grpo": (LLAMA_09B, 32, 480, dict(n=4, max_tokens=256, temperature=1.0)),
    "wide vocab top-p": (WIDE_VOCAB, 64, 64, dict(n=4, max_tokens=64, top_p=0.9)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_generate_peak_matches_the_estimate(case):
    shape_kw, prompts, width, sampling_kw = GPU_CASES[case]
    measured, terms = spawn(measure, 1, shape_kw, prompts, width, sampling_kw,
                            backend="nccl")[0]
    predicted = sum(terms.values())
    gib = 2**30
    print(f"{case}: generate's peak above the weights, measured {measured / gib:.3f} GiB, "
          f"predicted {predicted / gib:.3f} GiB ("
          + ", ".join(f"{k} {v / gib:.3f}" for k, v in terms.items())
          + f"), error {predicted / measured - 1:+.1%}")
    assert abs(predicted / measured - 1) < 0.10, (case, measured, terms)
