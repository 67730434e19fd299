"""The generation phase's rollout terms of the memory estimate (``MegatronRollout.memory``): the
fast decoder's KV cache and its decode transient, the larger of the prefill's activations
(``prefill_bytes``) and the sampling's [rows, V] buffers (``sampling_bytes``).

On CPU the terms are pinned against hand computations and against what the code holds: a
dispatch mode (``LiveBytes``) follows every storage the ops create until it is freed, over
``FastDecoder.begin``'s Triton prefill (its three Triton kernels replaced by what they allocate)
and over ``sample_tokens``; the prefill's peak is the formula's to the byte, plus the small
tensors it leaves out. On a GPU (``-m gpu``) one spawned process builds ``MegatronRollout`` from
a bare shape with random bf16 weights, runs a warm-up call (Triton's compilations, cuBLAS's
workspaces: held before every call of an RL run), frees the cache, then measures the allocator's
peak of one ``generate`` call above what was allocated before it (the weights) against the
estimate's generation terms: within 10%. Cases: llama-0.9b's shape at the GRPO run of
docs/planner.md (32 prompts x 4 samples, 480-token prompts, 256 new tokens: the prefill
dominates the transient), and a small model with a 131072-token vocabulary, 256 rows of short
prompts (the sampling's logits and noise dominate).
"""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hybridflow.config.rl import RolloutConfig
from hybridflow.models.config import ModelConfig
from hybridflow.models.params import llama_param_metas
from hybridflow.parallel.spawn import spawn
from hybridflow.rollout import fast_decode
from hybridflow.rollout.base import SamplingConfig, left_pad
from hybridflow.rollout.fast_decode import FastDecoder, prefill_bytes
from hybridflow.rollout.megatron import MegatronRollout, sample_tokens, sampling_bytes

SMALL = dict(vocab_size=1000, hidden_size=64, ffn_hidden_size=176, num_layers=2, num_heads=8,
             num_kv_heads=2, head_dim=16, max_position_embeddings=4096)
LLAMA_09B = dict(vocab_size=32000, hidden_size=2048, ffn_hidden_size=5632, num_layers=16,
                 num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=4096)
WIDE_VOCAB = dict(vocab_size=131072, hidden_size=256, ffn_hidden_size=704, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=4096)


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
    assert sampling_bytes(SamplingConfig(top_p=0.9), 1000, 2) == 2 + 4 + 33
    assert sampling_bytes(SamplingConfig(top_p=0.9), 1000, 4) == 4 + 33
    assert sampling_bytes(SamplingConfig(top_k=50), 1000, 2) == 2 + 4 + 16
    assert sampling_bytes(SamplingConfig(top_k=1000), 1000, 2) == 6  # all of them: plain


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that ops create while it is active: ``live`` now, ``peak`` the
    most at once. A storage counts from the op that returns it (not a view or an in-place op's
    output: those share an input's) until it is freed. What a kernel allocates inside itself
    (CUDA's workspaces, a sort's temporaries) is not seen."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in inputs and key not in self._alive:
                    self._alive.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self._alive.discard(key)
        self.live -= nbytes


def allocate_as_triton(monkeypatch):
    """The Triton prefill's kernels replaced by what each allocates (``add_rms_norm``: the sum,
    unless there is no delta, and the norm's output; ``rope_kv_write``: the rotated queries;
    ``silu_mul``: its output), uninitialised, so that the CPU runs ``_prefill_triton`` with the
    tensors it holds on a GPU."""

    def add_rms_norm(x, delta, weight, eps):
        return (x if delta is None else torch.empty_like(x)), torch.empty_like(x)

    def rope_kv_write(qkv, cos, sin, slot, keys, values, heads_per_group):
        w = qkv.shape[1] if qkv.dim() == 3 else 1
        return torch.empty(qkv.shape[0], keys.shape[1], w * heads_per_group, keys.shape[3],
                           dtype=qkv.dtype)

    def silu_mul(gate_up):
        return torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)

    for name, fn in [("add_rms_norm", add_rms_norm), ("rope_kv_write", rope_kv_write),
                     ("silu_mul", silu_mul)]:
        monkeypatch.setattr(fast_decode, name, fn)


@pytest.mark.parametrize("prompts, width, budget", [(6, 96, 32768), (6, 96, 200), (3, 160, 32768)])
def test_prefill_bytes_are_what_the_triton_prefill_holds(monkeypatch, prompts, width, budget):
    shape = ModelConfig(**{**SMALL, "num_layers": 3})
    gen = torch.Generator().manual_seed(0)
    params = {m.name: torch.nn.Parameter(torch.randn(m.shape, generator=gen).to(torch.bfloat16),
                                         requires_grad=False)
              for m in llama_param_metas(shape)}
    fast = FastDecoder(shape, params, dtype=torch.bfloat16, device=torch.device("cpu"),
                       inv_freq=torch.ones(shape.head_dim // 2), kernels="torch",
                       prefill_tokens=budget)
    fast._kernels = "triton"  # begin() takes _prefill_triton, its kernels replaced below
    ids, mask = left_pad([[1] * width] * prompts, 0, torch.device("cpu"))
    fast._ensure_cache(prompts * 2, width + 8)  # the cache, counted apart
    allocate_as_triton(monkeypatch)
    with LiveBytes() as live:
        logits = fast.begin(ids, mask, steps=8, repeat=2)
    assert logits.shape == (prompts * 2, shape.vocab_size)
    want = prefill_bytes(shape, prompts, width, 1, 2, prefill_tokens=budget)
    # Beside the formula's tensors, small ones it leaves out: the causal and diagonal [W, W]
    # bool blocks of the mask, the slot indices (int64), the prompts' bool mask [prompts, W],
    # and in the last chunk the bf16 logits of the chunks before it.
    chunk = min(prompts, budget // width)
    earlier = (-(-prompts // chunk) - 1) * chunk * shape.vocab_size * 2
    assert live.peak == want + 2 * width**2 + 8 * width + prompts * width + earlier


@pytest.mark.parametrize("sampling", [
    SamplingConfig(temperature=0.0), SamplingConfig(top_k=50), SamplingConfig(top_p=0.9),
    SamplingConfig(top_k=50, top_p=0.9)], ids=["greedy", "top-k", "top-p", "top-k top-p"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sampling_bytes_are_what_sampling_holds(sampling, dtype):
    rows, vocab = 8, 4096
    logits = torch.randn(rows, vocab).to(dtype)  # the step's logits, held by the caller
    with LiveBytes() as live:
        sample_tokens(logits, sampling, torch.Generator().manual_seed(0))
    b = logits.element_size()
    # Greedy's fullest moment is inside logsumexp, whose exp(x - max) (fp32, 4 bytes an entry)
    # its kernel allocates unseen by the dispatch mode; the others' is before it.
    inside = 4 if sampling.greedy else 0
    held = live.peak / (rows * vocab) + b + inside
    assert abs(held - sampling_bytes(sampling, vocab, b)) < 0.1, held  # top-k's k values


def test_generation_terms_of_the_megatron_backend():
    shape = ModelConfig(**SMALL)
    sampling = SamplingConfig(n=4, max_tokens=24)
    resident, generation = generation_terms(shape, sampling, prompts=5, width=40)
    kv = 20 * 64 * (2 * 2 * 2 * 16 * 2)  # 20 rows of 64 tokens, 2 layers of K and V, 2 heads
    prefill = prefill_bytes(shape, 5, 40, 1, 2)  # each prompt prefilled once for its 4 rows
    assert prefill > 20 * 1000 * 6  # the sampling's [20, V] logits and noise
    assert resident == {}
    assert generation == {"kv cache": kv, "decode transient": prefill}
    # Top-p over [20, 1000]: 39 bytes an entry, more than the prefill.
    top_p = SamplingConfig(n=4, max_tokens=24, top_p=0.9)
    assert generation_terms(shape, top_p, 5, 40)[1]["decode transient"] == 20 * 1000 * 39
    # keep_cache: the cache through every phase, the transient in generation only.
    assert generation_terms(shape, sampling, 5, 40, keep_cache=True) == (
        {"kv cache": kv}, {"decode transient": prefill})
    # 300 rows decode 256 at a time (max_batch_size), not whole groups of 3: every row of the
    # first 256 prefills its prompt.
    assert generation_terms(shape, SamplingConfig(n=3, max_tokens=24), 100, 40)[1] == {
        "kv cache": 256 * 64 * (2 * 2 * 2 * 16 * 2),
        "decode transient": prefill_bytes(shape, 256, 40, 1, 2)}
    # The fast decoder's cache has slots for 40 + 30 tokens rounded up to its block of 64.
    longer = SamplingConfig(n=4, max_tokens=30)
    assert generation_terms(shape, longer, 5, 40)[1]["kv cache"] == 20 * 128 * (2 * 2 * 2 * 16 * 2)
    # tp = 2: Megatron's own forward, whose cache is the tokens' and whose transient is not
    # modelled.
    assert generation_terms(shape, sampling, 5, 40, tp=2)[1] == {"kv cache": kv // 2}
    assert generation_terms(shape, longer, 5, 40, tp=2)[1] == {
        "kv cache": 20 * 70 * (2 * 2 * 16 * 2)}


# ------------------------------------------------------------------------------ on a GPU
def measure(rank, world, shape_kw, prompts, width, sampling_kw):
    """(peak of one generate call above what was allocated before it, the estimate's generation
    terms) in bytes, after a warm-up call and ``sleep``."""
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
    "wide vocab": (WIDE_VOCAB, 64, 64, dict(n=4, max_tokens=64, temperature=1.0)),
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
