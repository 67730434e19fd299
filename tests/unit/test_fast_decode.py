"""FastDecoder against transformers, without Megatron-Core or processes: Megatron-named weights
from a transformers model, greedy decoding through the shared sampling loop, and every generated
token checked against transformers' teacher-forced logits (argmax and log-prob).

On a CUDA machine each test also runs on the GPU with CUDA graphs, and graphs are compared with
the same steps run eagerly.
"""

import copy
import functools

import pytest
import torch

from hybridflow.models.hf import hf_to_megatron
from hybridflow.models.tiny import make_tiny_hf_model, tiny_llama_config, tiny_qwen2_config
from hybridflow.rollout.base import SamplingConfig, left_pad
from hybridflow.rollout.fast_decode import FastDecoder
from hybridflow.rollout.megatron import decode
from hybridflow.training.model import batch_position_ids

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CONFIGS = {"llama": tiny_llama_config(), "qwen2": tiny_qwen2_config()}  # qwen2: tied, qkv bias
# Different lengths (left padding); 13 new tokens cross several 4-slot attention buckets.
PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 77, 78], [1, 200, 201, 202, 203, 204, 205, 206, 207, 5]]
GREEDY = SamplingConfig(temperature=0.0, max_tokens=13)


def inv_freq(cfg):
    """RoPE inverse frequencies as Megatron's RotaryEmbedding builds them."""
    d = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


@functools.lru_cache(maxsize=None)
def hf_model(arch):
    return make_tiny_hf_model(CONFIGS[arch], seed=0)  # slow to build; copied by every test


def setup(arch, device, dtype=torch.float32, **kwargs):
    cfg = CONFIGS[arch]
    hf = copy.deepcopy(hf_model(arch)).to(device=device, dtype=dtype)
    params = {n: torch.nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)
              for n, t in hf_to_megatron(hf_model(arch).state_dict(), cfg).items()}
    fast = FastDecoder(cfg, params, dtype=dtype, device=torch.device(device),
                       inv_freq=inv_freq(cfg), block=4, **kwargs)
    return cfg, hf, params, fast


def run(fast, prompts=PROMPTS, sampling=GREEDY, seed=None):
    ids, mask = left_pad(prompts, 0, fast.device)
    gen = None
    if seed is not None:
        gen = torch.Generator(device=fast.device).manual_seed(seed)
    tokens, logprobs, lengths, _ = decode(fast, ids, mask, sampling, gen, [], 0)
    return ids, mask, tokens, logprobs


@torch.no_grad()
def teacher_forced(hf, ids, mask, tokens):
    """transformers' log-softmax at every generated position [B, T, V]."""
    full = torch.cat([ids, tokens], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(tokens)], dim=1)
    logits = hf(input_ids=full, attention_mask=full_mask,
                position_ids=batch_position_ids(full_mask)).logits.float()
    return torch.log_softmax(logits[:, ids.shape[1] - 1:-1], dim=-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_greedy_tokens_and_logprobs_match_transformers(arch, device):
    cfg, hf, params, fast = setup(arch, device)
    ids, mask, tokens, logprobs = run(fast)
    ref = teacher_forced(hf, ids, mask, tokens)
    assert torch.equal(tokens, ref.argmax(-1))
    torch.testing.assert_close(logprobs, ref.gather(-1, tokens[..., None]).squeeze(-1),
                               atol=1e-4, rtol=0)
    assert len(set(map(tuple, tokens.tolist()))) == len(PROMPTS)  # not degenerate


@pytest.mark.parametrize("device", DEVICES)
def test_cache_is_reused_and_reallocated_when_too_small(device):
    cfg, hf, params, fast = setup("llama", device)
    _, _, tokens, logprobs = run(fast)
    cache = fast._cache
    short = SamplingConfig(temperature=0.0, max_tokens=5)
    _, _, again, _ = run(fast, PROMPTS[:2][::-1] + PROMPTS[2:], short)  # same rows, fewer steps
    assert fast._cache is cache
    assert torch.equal(again[2], tokens[2, :5])
    run(fast, PROMPTS + PROMPTS[:1], short)  # more rows: a new cache
    assert fast._cache is not cache
    _, _, tokens2, logprobs2 = run(fast)
    assert torch.equal(tokens2, tokens)
    torch.testing.assert_close(logprobs2, logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_new_weights_are_seen(device):
    cfg, hf, params, fast = setup("llama", device)
    _, _, before, _ = run(fast)
    g = torch.Generator().manual_seed(3)
    new = {n: (p.detach().cpu() + 0.05 * torch.randn(p.shape, generator=g)).to(device)
           for n, p in params.items()}
    for n, p in params.items():  # the hybrid engine's load: the parameter takes new storage
        p.data = new[n]
    _, _, after, _ = run(fast)
    fresh = FastDecoder(cfg, new, dtype=torch.float32, device=torch.device(device),
                        inv_freq=inv_freq(cfg), block=4)
    _, _, expected, _ = run(fresh)
    assert not torch.equal(after, before)
    assert torch.equal(after, expected)


def stacked(params, cfg, s):
    """The weights as the switch gathers a TP merge of ``s`` training shards uncopied
    (``plan_reshard(blocks=True)``): row-parallel weights and fc1 as their shards stacked."""
    from hybridflow.models.params import llama_param_metas, stack, stacked_layout

    metas = {m.name: m for m in llama_param_metas(cfg)}
    return {n: stack(p.detach(), metas[n], s)
            if stacked_layout(metas[n]) else p for n, p in params.items()}


@pytest.mark.parametrize("rows", [5, 300])  # a batched GEMM and a sum; addmm per block
def test_row_linear_of_stacked_weights(rows):
    from hybridflow.models.params import llama_param_metas, stack
    from hybridflow.rollout.fast_decode import row_linear

    cfg = CONFIGS["llama"]
    m = next(m for m in llama_param_metas(cfg) if m.name.endswith("linear_fc2.weight"))
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(m.shape, generator=g), torch.randn(2, rows, m.shape[1], generator=g)
    for s in (2, 4):
        torch.testing.assert_close(row_linear(x, stack(w, m, s)), torch.nn.functional.linear(x, w),
                                   atol=1e-4, rtol=1e-5)  # the sums differ in order only


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("s", [2, 4])
def test_stacked_weights_decode_as_the_standard_ones(device, s):
    cfg, hf, params, fast = setup("llama", device)
    _, _, tokens, logprobs = run(fast)
    blocks = FastDecoder(cfg, stacked(params, cfg, s), dtype=torch.float32,
                         device=torch.device(device), inv_freq=inv_freq(cfg), block=4)
    assert blocks.params["decoder.layers.0.mlp.linear_fc2.weight"].dim() == 3
    _, _, got, got_logprobs = run(blocks)
    assert torch.equal(got, tokens)
    torch.testing.assert_close(got_logprobs, logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_release_frees_and_decoding_starts_again(device):
    cfg, hf, params, fast = setup("llama", device)
    _, _, tokens, _ = run(fast)
    fast.release()
    assert fast._cache is None and not fast._graphs
    assert torch.equal(run(fast)[2], tokens)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=1.0, max_tokens=13)])
def test_repeated_prompts_are_prefilled_once(device, sampling):
    """``repeat``: each prompt prefilled once for its group of rows gives what prefilling every
    row gives (tokens, log-probs, the cache), with a third of the prefill's rows."""
    cfg, hf, params, fast = setup("llama", device)
    repeat = 3
    rows = [p for p in PROMPTS for _ in range(repeat)]
    ids, mask = left_pad(rows, 0, fast.device)
    want = decode(fast, ids, mask, sampling, torch.Generator(device).manual_seed(0), [], 0)
    cache = fast._cache.clone()
    fast.release()  # a new cache: the rows' K/V must come from the group's one prefill
    prefilled = []
    for name in ("_forward", "_prefill_triton"):  # the torch and the Triton kernels' prefill
        forward = getattr(fast, name)
        setattr(fast, name,
                lambda ids, *a, f=forward: prefilled.append(ids.shape[0]) or f(ids, *a))
    ids, mask = left_pad(PROMPTS, 0, fast.device)
    got = decode(fast, ids, mask, sampling, torch.Generator(device).manual_seed(0), [], 0,
                 repeat=repeat)
    assert prefilled[0] == len(PROMPTS)  # then one row per decode step
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(fast._cache, cache, atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_is_seeded(device):
    cfg, hf, params, fast = setup("qwen2", device)
    sampled = SamplingConfig(temperature=0.8, top_k=40, top_p=0.9, max_tokens=13)
    a, b = run(fast, sampling=sampled, seed=5)[2], run(fast, sampling=sampled, seed=5)[2]
    assert torch.equal(a, b)
    assert not torch.equal(a, run(fast, sampling=sampled, seed=6)[2])


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_equal_eager_steps(dtype, kernels):
    cfg, hf, params, graphs = setup("qwen2", "cuda", dtype, kernels=kernels)
    eager = FastDecoder(cfg, params, dtype=dtype, device=torch.device("cuda"),
                        inv_freq=inv_freq(cfg), block=4, cuda_graphs=False, kernels=kernels)
    _, _, t_graph, lp_graph = run(graphs)
    _, _, t_eager, lp_eager = run(eager)
    assert len(graphs._graphs) == (1 if kernels == "triton" else 4)  # one per bucket crossed
    assert torch.equal(t_graph, t_eager)
    torch.testing.assert_close(lp_graph, lp_eager, atol=1e-5, rtol=0)


def triton_checks(device: str) -> dict:
    """The Triton kernels against torch, and FastDecoder with them against FastDecoder with
    torch ops. On CPU this runs under TRITON_INTERPRET=1 (set before Triton is imported: a
    subprocess), whose tl.dot is wrong for bf16, so bf16 only on GPU."""
    import torch.nn.functional as F

    from hybridflow.rollout.fast_decode import check_triton_kernels, decode_attention

    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])
    out = {"check": {str(dt): check_triton_kernels(torch.device(device), dt) for dt in dtypes},
           "attention": []}
    gen = torch.Generator().manual_seed(0)
    # (rows, groups, heads per group, head dim, slots): 3 and 24 exercise the padding.
    for b, g, h, d, s in [(3, 2, 2, 32, 40), (2, 2, 3, 24, 70), (4, 1, 8, 128, 150)]:
        for dtype in dtypes:
            cache = torch.randn(2, b, g, s + 5, d, generator=gen).to(device, dtype)
            keys, values = cache[0, :, :, :s], cache[1, :, :, :s]  # strided views, as in use
            q = torch.randn(b, g, h, d, generator=gen).to(device, dtype)
            start = torch.tensor([min(7 * i, s - 3) for i in range(b)], dtype=torch.int32,
                                 device=device)
            slot = torch.tensor([s - 2], device=device)
            got = decode_attention(q, keys, values, start, slot, block_n=16)
            pos = torch.arange(s, device=device)
            mask = (pos >= start[:, None]) & (pos <= slot)
            ref = F.scaled_dot_product_attention(q.float(), keys.float(), values.float(),
                                                 attn_mask=mask[:, None, None, :])
            out["attention"].append((str(dtype), (got.float() - ref).abs().max().item()))
    # The one-kernel sampler against sample_tokens' torch ops on the same noise; a vocabulary
    # of two blocks and a bit (4096 each), with row strides as the decode's logits have.
    from hybridflow.rollout.fast_decode import sample_triton
    from hybridflow.rollout.megatron import sample_tokens
    out["sample"] = []
    for dtype in dtypes:
        logits = (3 * torch.randn(6, 8300, generator=gen)).to(device, dtype)
        for temperature in (1.0, 0.6):
            s = SamplingConfig(temperature=temperature, max_tokens=1)
            want = sample_tokens(logits, s, torch.Generator(device).manual_seed(1))
            noise = torch.empty(logits.shape, dtype=torch.float32, device=device)
            got = sample_triton(logits, noise.exponential_(
                generator=torch.Generator(device).manual_seed(1)), temperature)
            out["sample"].append((str(dtype), got[0].tolist() == want[0].tolist(),
                                  (got[1] - want[1]).abs().max().item()))
    for dtype in [torch.float32] + ([torch.bfloat16] if device == "cuda" else []):
        cfg, hf, params, plain = setup("qwen2", device, dtype, kernels="torch")
        fused = FastDecoder(cfg, params, dtype=dtype, device=torch.device(device),
                            inv_freq=inv_freq(cfg), block=4, kernels="triton")
        stacked_fused = FastDecoder(cfg, stacked(params, cfg, 2), dtype=dtype,
                                    device=torch.device(device), inv_freq=inv_freq(cfg), block=4,
                                    kernels="triton")
        _, _, t_plain, lp_plain = run(plain)
        _, _, t_fused, lp_fused = run(fused)
        _, _, t_stacked, lp_stacked = run(stacked_fused)
        common = (t_stacked != t_fused).long().cumsum(dim=1) == 0
        out[f"{dtype} stacked"] = (t_stacked.tolist() == t_fused.tolist(),
                                   (lp_stacked - lp_fused)[common].abs().max().item())
        # Log-probs compared up to each row's first differing token (bf16 near-ties may part).
        common = (t_plain != t_fused).long().cumsum(dim=1) == 0
        out[str(dtype)] = (t_plain.tolist() == t_fused.tolist(),
                           (lp_plain - lp_fused)[common].abs().max().item(), len(fused._graphs))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_triton_kernels(device):
    pytest.importorskip("triton")
    if device == "cuda":
        out = triton_checks("cuda")
    else:
        import json
        import os
        import subprocess
        import sys
        from pathlib import Path
        root = Path(__file__).resolve().parents[2]
        code = ("import json, tests.unit.test_fast_decode as t; "
                "print(json.dumps(t.triton_checks('cpu')))")
        proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                              text=True, env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(why is None for why in out["check"].values()), out["check"]
    for dtype, err in out["attention"]:
        assert err < (1e-5 if dtype == "torch.float32" else 2e-2), (dtype, err)
    for dtype, same, lp_err in out["sample"]:
        assert same and lp_err < 1e-4, (dtype, lp_err)
    same, lp_err, graphs = out["torch.float32"]
    assert same and lp_err < 1e-5
    same, lp_err = out["torch.float32 stacked"]  # fc1 rows as s rows of [gate_j | up_j]
    assert same and lp_err < 1e-5
    if device == "cuda":
        assert graphs == 1
        same, lp_err, graphs = out["torch.bfloat16"]
        assert lp_err < 0.1  # bf16: the two attentions round differently
