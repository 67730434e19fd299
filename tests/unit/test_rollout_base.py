"""Rollout pieces that need no engine: sampling config checks, the weight grouping that guards
every backend's update, the sampler, the registry."""

import pytest
import torch

from hybridflow.errors import ArgumentError, ConfigError
from hybridflow.models.hf import hf_param_names, hf_param_shapes
from hybridflow.models.tiny import tiny_llama_config, tiny_qwen2_config
from hybridflow.rollout.base import (ROLLOUT_BACKENDS, RolloutBackend, SamplingConfig,
                                     group_hf_weights, left_pad, rollout_backend)
from hybridflow.rollout.megatron import sample_tokens


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"),
    (dict(seed=-3), "seed"),
    (dict(stop_token_ids=[1, -2]), "stop_token_ids"),
])
def test_sampling_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        SamplingConfig(**kwargs)
    assert e.value.field == field


def test_stop_ids():
    s = SamplingConfig(stop_token_ids=[7, 2])
    assert s.stop_token_ids == (7, 2)
    assert s.stop_ids((2, 3)) == [2, 3, 7]
    assert SamplingConfig(stop_token_ids=[7], ignore_eos=True).stop_ids((2,)) == [7]


def _weights(cfg):
    shapes = hf_param_shapes(cfg)
    return [(n, torch.zeros(shapes[n][0])) for n in hf_param_names(cfg)]


def test_group_hf_weights_groups_fused_parts_in_model_order():
    cfg = tiny_qwen2_config()
    weights = _weights(cfg)[::-1] + [("lm_head.weight", torch.zeros(1))]  # tied: dropped
    groups = group_hf_weights(weights, cfg)
    names = list(groups)
    assert names[0] == "embedding.word_embeddings.weight"
    assert names[-1] == "decoder.final_layernorm.weight"
    qkv = groups["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert sorted(qkv) == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "kqv"]


def test_group_hf_weights_errors_name_the_tensor():
    cfg = tiny_llama_config()
    good = dict(_weights(cfg))
    bad_shape = {**good, "model.layers.1.mlp.up_proj.weight": torch.zeros(3, 3)}
    with pytest.raises(ArgumentError, match=r"layers\.1\.mlp\.up_proj\.weight.*shape \[3, 3\]"):
        group_hf_weights(bad_shape.items(), cfg)
    partial = [(n, t) for n, t in good.items() if n != "model.layers.2.self_attn.k_proj.weight"]
    with pytest.raises(ArgumentError, match=r"k_proj\.weight.*missing.*together"):
        group_hf_weights(partial, cfg)
    with pytest.raises(ConfigError, match="model.layers.9"):
        group_hf_weights([("model.layers.9.mlp.down_proj.weight", torch.zeros(1))], cfg)
    with pytest.raises(ArgumentError, match="given twice"):
        group_hf_weights(list(good.items()) + [("model.norm.weight", good["model.norm.weight"])],
                         cfg)
    # A subset is fine as long as every fused group is whole.
    subset = [(n, good[n]) for n in ("model.layers.0.mlp.gate_proj.weight",
                                     "model.layers.0.mlp.up_proj.weight")]
    assert list(group_hf_weights(subset, cfg)) == ["decoder.layers.0.mlp.linear_fc1.weight"]


class _Recorder(RolloutBackend):
    """A backend that keeps what update_weights_hf receives."""

    def __init__(self, cfg, tp: int = 1):
        self.model_config, self.tp, self.loaded = cfg, tp, None

    def generate(self, prompt_token_ids, sampling):
        raise NotImplementedError

    def update_weights_hf(self, weights):
        self.loaded = dict(weights)

    def sleep(self):
        pass

    def wake(self):
        pass

    def close(self):
        pass


def test_load_from_switch_default_converts_to_hf_names():
    from hybridflow.models.hf import hf_to_megatron

    cfg = tiny_llama_config()
    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(t.shape, generator=g) for n, t in _weights(cfg)}
    backend = _Recorder(cfg)
    backend.load_from_switch(hf_to_megatron(hf, cfg))
    assert sorted(backend.loaded) == sorted(hf)
    assert all(torch.equal(backend.loaded[n], t) for n, t in hf.items())
    with pytest.raises(ArgumentError, match="tp=2"):  # HF names need full tensors
        _Recorder(cfg, tp=2).load_from_switch(hf_to_megatron(hf, cfg))


def test_sampler():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g)
    raw = torch.log_softmax(logits, -1)
    greedy, lp = sample_tokens(logits, SamplingConfig(temperature=0), None)
    assert torch.equal(greedy, logits.argmax(-1))
    torch.testing.assert_close(lp, raw.gather(-1, greedy[:, None]).squeeze(-1))
    # top_k=1 and a tiny top_p both leave only the argmax.
    for s in (SamplingConfig(top_k=1), SamplingConfig(top_p=1e-6)):
        tokens, lp = sample_tokens(logits, s, torch.Generator().manual_seed(1))
        assert torch.equal(tokens, greedy)
    # top_k=5: every sample is among the 5 largest; logprobs stay the raw model's.
    s = SamplingConfig(temperature=2.0, top_k=5)
    tokens, lp = sample_tokens(logits, s, torch.Generator().manual_seed(2))
    top5 = logits.topk(5, -1).indices
    assert (tokens[:, None] == top5).any(-1).all()
    torch.testing.assert_close(lp, raw.gather(-1, tokens[:, None]).squeeze(-1))
    # top_p: the kept set is the smallest prefix whose mass reaches top_p.
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(2000, 1)
    tokens, _ = sample_tokens(probs, SamplingConfig(top_p=0.8), torch.Generator().manual_seed(3))
    assert set(tokens.tolist()) == {0, 1}
    # The same seed gives the same samples.
    s = SamplingConfig(temperature=0.7)
    a, _ = sample_tokens(logits, s, torch.Generator().manual_seed(4))
    b, _ = sample_tokens(logits, s, torch.Generator().manual_seed(4))
    assert torch.equal(a, b)
    # The draw is torch.multinomial's, written out (same noise, same tokens), and its log-probs
    # are the raw model's at any temperature.
    want = torch.multinomial((logits / 0.7).softmax(-1), 1,
                             generator=torch.Generator().manual_seed(4)).squeeze(-1)
    assert torch.equal(a, want)
    _, lp = sample_tokens(logits, s, torch.Generator().manual_seed(4))
    torch.testing.assert_close(lp, raw.gather(-1, a[:, None]).squeeze(-1))


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [9]], pad_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_registry():
    assert set(ROLLOUT_BACKENDS) == {"vllm", "megatron", "hf"}
    assert rollout_backend("megatron").__name__ == "MegatronRollout"
    assert rollout_backend("hf").__name__ == "HFRollout"
    with pytest.raises(ConfigError, match="rollout.backend.*'sglang'"):
        rollout_backend("sglang")
