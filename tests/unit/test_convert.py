"""Generation weights (Megatron names, generation TP shards) -> vLLM per-rank names and HF names,
checked against tensors sliced by hand from an HF state dict."""

from __future__ import annotations

import pytest
import torch

from hybridflow.errors import ArgumentError, ConfigError
from hybridflow.hybrid_engine.convert import to_hf, to_vllm_shards
from hybridflow.models import hf
from hybridflow.models.params import llama_param_metas, shard, vllm_name
from hybridflow.models.tiny import tiny_tp4_config

CONFIGS = {"llama": tiny_tp4_config("llama", num_layers=2),
           "qwen2-tied": tiny_tp4_config("qwen2", num_layers=2)}


def _hf_state_dict(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g)
            for name, (shape, _) in hf.hf_param_shapes(cfg).items()}


def _gen_shards(cfg, hf_sd, tg, r):
    """What the HybridEngine hands over at generation TP rank r: Megatron names, TP shards."""
    full = hf.hf_to_megatron(hf_sd, cfg)
    return {m.name: shard(full[m.name], m, tg, r) for m in llama_param_metas(cfg)}


def _rows(t, tg, r):
    n = t.shape[0] // tg
    return t[r * n:(r + 1) * n]


def _cols(t, tg, r):
    n = t.shape[1] // tg
    return t[:, r * n:(r + 1) * n]


def _expected_vllm(cfg, hf_sd, tg, r):
    """vLLM's parameters of TP rank r, sliced by hand from the HF tensors."""
    out = {"model.embed_tokens.weight": _rows(hf_sd["model.embed_tokens.weight"], tg, r)}
    for i in range(cfg.num_layers):
        p, v = f"model.layers.{i}.", f"model.layers.{i}."
        attn = p + "self_attn."
        out[v + "input_layernorm.weight"] = hf_sd[p + "input_layernorm.weight"]
        out[v + "self_attn.qkv_proj.weight"] = torch.cat(
            [_rows(hf_sd[attn + f"{x}_proj.weight"], tg, r) for x in "qkv"])
        if cfg.qkv_bias:
            out[v + "self_attn.qkv_proj.bias"] = torch.cat(
                [_rows(hf_sd[attn + f"{x}_proj.bias"], tg, r) for x in "qkv"])
        out[v + "self_attn.o_proj.weight"] = _cols(hf_sd[attn + "o_proj.weight"], tg, r)
        out[v + "post_attention_layernorm.weight"] = hf_sd[p + "post_attention_layernorm.weight"]
        out[v + "mlp.gate_up_proj.weight"] = torch.cat(
            [_rows(hf_sd[p + "mlp.gate_proj.weight"], tg, r),
             _rows(hf_sd[p + "mlp.up_proj.weight"], tg, r)])
        out[v + "mlp.down_proj.weight"] = _cols(hf_sd[p + "mlp.down_proj.weight"], tg, r)
    out["model.norm.weight"] = hf_sd["model.norm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = _rows(hf_sd["lm_head.weight"], tg, r)
    return out


@pytest.mark.parametrize("tg", [1, 2, 4])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_vllm_shards_match_hand_slices(arch, tg):
    cfg = CONFIGS[arch]
    hf_sd = _hf_state_dict(cfg)
    for r in range(tg):
        got = dict(to_vllm_shards(_gen_shards(cfg, hf_sd, tg, r), cfg, tg))
        want = _expected_vllm(cfg, hf_sd, tg, r)
        assert list(got) == list(want), f"rank {r}: names or order"
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), f"rank {r}: {name}"


def test_vllm_shards_are_views_except_qkv():
    cfg = CONFIGS["llama"]
    gen = _gen_shards(cfg, _hf_state_dict(cfg), 2, 1)
    for (mg, src), (name, out) in zip(gen.items(), to_vllm_shards(gen, cfg, 2)):
        if "qkv_proj" in name:
            continue
        assert out.data_ptr() == src.data_ptr(), name


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_hf_names_at_tg1_give_back_the_state_dict(arch):
    cfg = CONFIGS[arch]
    hf_sd = _hf_state_dict(cfg)
    got = dict(to_hf(_gen_shards(cfg, hf_sd, 1, 0), cfg))
    assert list(got) == hf.hf_param_names(cfg)
    for name, tensor in hf_sd.items():
        assert torch.equal(got[name], tensor), name


def test_tied_output_layer_of_the_last_stage_is_the_embedding():
    # With several generation stages the last one holds the tied output layer (switch.py).
    cfg = CONFIGS["qwen2-tied"]
    emb = torch.randn(cfg.vocab_size, cfg.hidden_size)
    last_stage = {"decoder.final_layernorm.weight": torch.ones(cfg.hidden_size),
                  "output_layer.weight": emb}
    assert dict(to_hf(last_stage, cfg))["model.embed_tokens.weight"] is emb
    got = dict(to_vllm_shards({"output_layer.weight": _rows(emb, 2, 1)}, cfg, 2))
    assert list(got) == ["model.embed_tokens.weight"]
    assert torch.equal(got["model.embed_tokens.weight"], _rows(emb, 2, 1))
    assert vllm_name("output_layer.weight", CONFIGS["llama"]) == "lm_head.weight"


def test_streams_one_tensor_at_a_time():
    cfg = CONFIGS["llama"]
    gen = _gen_shards(cfg, _hf_state_dict(cfg), 2, 0)
    it = to_vllm_shards(gen, cfg, 2)
    assert iter(it) is it
    name, _ = next(it)
    assert name == "model.embed_tokens.weight"
    it = to_hf(_gen_shards(cfg, _hf_state_dict(cfg), 1, 0), cfg)
    assert iter(it) is it


def test_refusals_name_the_field():
    cfg = CONFIGS["llama"]
    gen = _gen_shards(cfg, _hf_state_dict(cfg), 2, 0)
    with pytest.raises(ArgumentError, match="gen_tp.*to_vllm_shards"):
        to_hf(gen, cfg, gen_tp=2)  # raised at the call, not at the first tensor
    odd = tiny_tp4_config("llama", num_layers=2, vocab_size=520)
    with pytest.raises(ArgumentError, match="multiple of 64"):
        to_vllm_shards({}, odd, 2)
    assert list(to_vllm_shards({}, odd, 1)) == []
    with pytest.raises(ConfigError, match="decoder.layers.0.bogus"):
        vllm_name("decoder.layers.0.bogus", cfg)


def _refuse(rank, world):
    from hybridflow.errors import ConfigError
    raise ConfigError("--tp", "refused in a conversion worker")


def test_a_conversion_worker_config_error_arrives_as_one():
    """A conversion worker's ConfigError is raised in the caller as a ConfigError (one line for
    the tool), not as the worker's traceback."""
    import pytest

    from hybridflow.errors import ConfigError
    from hybridflow.training.megatron_ckpt import _spawn
    with pytest.raises(ConfigError, match="^--tp: refused in a conversion worker$"):
        _spawn(_refuse, 1)
