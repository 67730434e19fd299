"""The parameter table (models/params.py) against the models it describes: every view derived
from it must agree with Megatron-Core's GPTModel as our engine builds it, with transformers' own
Llama/Qwen2 and with vLLM's, and the conversions between the views must be bit-exact.

Megatron and vLLM need a process group, so each is built in one spawned gloo process (TP=1).
"""

from __future__ import annotations

import pytest
import torch

from hybridflow.hybrid_engine.convert import to_vllm_shards
from hybridflow.models import hf
from hybridflow.models.params import llama_param_metas, resolve, shard, vllm_name
from hybridflow.models.tiny import make_tiny_hf_model, tiny_llama_config, tiny_qwen2_config
from hybridflow.parallel.spawn import spawn

transformers = pytest.importorskip("transformers")

CONFIGS = {
    # untied, 4 heads / 2 KV heads
    "llama": tiny_llama_config(num_layers=2),
    # tied, q/k/v biases
    "qwen2": tiny_qwen2_config(num_layers=2),
    # tied Llama, 3 query heads per group, head_dim (32) != hidden / heads (16)
    "llama-tied-gqa3": tiny_llama_config(num_layers=2, tie_embeddings=True, hidden_size=96,
                                         ffn_hidden_size=192, num_heads=6, num_kv_heads=2),
    # untied Qwen2, one KV head (multi-query); vLLM's Qwen2 takes head_dim = hidden / heads
    "qwen2-untied-mqa": tiny_qwen2_config(num_layers=2, tie_embeddings=False, num_kv_heads=1),
}


def _metas(cfg):
    return {m.name: m for m in llama_param_metas(cfg)}


# ------------------------------------------------------------------------------ Megatron


def _engine_params(rank: int, world: int, configs: dict) -> dict:
    """Per config: {name: (shape, TP split dim, partition stride)} of the GPTModel our engine
    builds at TP=1, from Megatron-Core's own tensor-parallel attributes."""
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.config import EngineConfig
    from hybridflow.training.engine import TrainEngine

    out = {}
    for key, cfg in configs.items():
        engine = TrainEngine(cfg, TrainLayout(), EngineConfig(), build_optimizer=False)
        out[key] = {name: (tuple(p.shape),
                           p.partition_dim if getattr(p, "tensor_model_parallel", False) else None,
                           getattr(p, "partition_stride", 1))
                    for name, p in engine.named_local_params()}
        if key == "llama":  # what an engine that nothing trains holds besides its weights
            out["untrained"] = {
                "grad_buffer_numel": sum(b.grad_data.numel() for c in engine.chunks
                                         for b in c.buffers),
                "trainable": sum(p.numel() for _, p in engine.named_local_params()
                                 if p.requires_grad)}
    return out


@pytest.fixture(scope="module")
def megatron():
    return spawn(_engine_params, 1, CONFIGS)[0]


def test_an_engine_without_optimizer_has_no_grad_buffer(megatron):
    """A reference or reward model (build_optimizer=False) is frozen: Megatron's DDP would
    otherwise give it an fp32 grad buffer as large as the actor's (memory.py counts none)."""
    assert megatron["untrained"] == {"grad_buffer_numel": 0, "trainable": 0}


@pytest.mark.parametrize("key", list(CONFIGS))
def test_megatron_view_is_the_engines_gpt_model(megatron, key):
    """Names, full shapes, TP split dims and chunks (Megatron's partition_stride: linear_fc1 is
    [gate; up], split chunk by chunk) of every parameter."""
    want = {m.name: (m.shape, m.tp_dim, m.tp_chunks) for m in _metas(CONFIGS[key]).values()}
    assert megatron[key] == want


# ------------------------------------------------------------------------------ HF


@pytest.mark.parametrize("key", list(CONFIGS))
def test_hf_view_is_transformers_state_dict(key):
    cfg = CONFIGS[key]
    sd = make_tiny_hf_model(cfg, seed=1).state_dict()
    shapes = hf.hf_param_shapes(cfg)
    # A tied model's state dict also lists lm_head.weight (the embedding, shared): it maps to
    # no parameter of its own.
    assert set(sd) == set(shapes) | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    assert {n: tuple(t.shape) for n, t in sd.items() if n in shapes} == \
        {n: shape for n, (shape, _) in shapes.items()}
    metas = _metas(cfg)
    for name in sd:
        mg = hf.megatron_name_for_hf(name, cfg)
        assert (mg is None) == (name not in shapes), name
        assert mg is None or name in hf.hf_sources(mg, cfg)
    sources = [n for mg in metas for n in hf.hf_sources(mg, cfg)]
    assert sorted(hf.hf_param_names(cfg)) == sorted(sources)


@pytest.mark.parametrize("key", list(CONFIGS))
def test_hf_megatron_hf_round_trip_is_bit_exact(key):
    cfg = CONFIGS[key]
    sd = make_tiny_hf_model(cfg, seed=2).state_dict()
    mg = hf.hf_to_megatron(sd, cfg)
    metas = _metas(cfg)
    assert {n: tuple(t.shape) for n, t in mg.items()} == {n: m.shape for n, m in metas.items()}
    back = hf.megatron_to_hf(mg, cfg)
    assert set(back) == set(hf.hf_param_names(cfg))
    for name, tensor in back.items():
        assert tensor.dtype == sd[name].dtype and torch.equal(tensor, sd[name]), name


@pytest.mark.parametrize("key", [k for k, c in CONFIGS.items() if c.num_kv_heads % 2 == 0])
def test_tp_shard_is_made_of_hf_blocks(key, tp=2):
    """TP rank r's shard of each parameter is its merge of block r (along tp_dim) of each HF
    tensor, with the rank's share of the heads: what the sliced HF loader relies on. (Models
    whose KV heads do not split over tp cannot be sharded so.)"""
    import dataclasses

    cfg = CONFIGS[key]
    sd = make_tiny_hf_model(cfg, seed=3).state_dict()
    full = hf.hf_to_megatron(sd, cfg)
    rank_cfg = dataclasses.replace(cfg, num_heads=cfg.num_heads // tp,
                                   num_kv_heads=cfg.num_kv_heads // tp)
    for name, meta in _metas(cfg).items():
        for r in range(tp):
            sources = hf.hf_sources(name, cfg)
            if meta.tp_dim is None:
                want = hf.merge_hf_to_megatron(name, {n: sd[n] for n in sources}, cfg)
            else:
                blocks = {n: sd[n].chunk(tp, dim=meta.tp_dim)[r] for n in sources}
                want = hf.merge_hf_to_megatron(name, blocks, rank_cfg)
            assert torch.equal(shard(full[name], meta, tp, r), want), (name, r)


# ------------------------------------------------------------------------------ vLLM


def _vllm_params(rank: int, world: int, configs: dict, root: str) -> dict:
    """Per config: vLLM's own model at TP=1 with an HF state dict loaded by vLLM's own weight
    loaders: {name: (tensor, TP split dim, fused layout)}."""
    import os

    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (init_distributed_environment,
                                                 initialize_model_parallel)
    from vllm.model_executor.layers.linear import (ColumnParallelLinear,
                                                   MergedColumnParallelLinear, QKVParallelLinear,
                                                   RowParallelLinear)
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    classes = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}
    out = {}
    for i, (key, cfg) in enumerate(configs.items()):
        path = os.path.join(root, key)
        hf.hf_config_from_model_config(cfg).save_pretrained(path)
        vllm_cfg = VllmConfig(model_config=ModelConfig(model=path, skip_tokenizer_init=True,
                                                       dtype="float32"))
        with set_current_vllm_config(vllm_cfg):
            if i == 0:
                init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                             distributed_init_method="env://", backend="gloo")
                initialize_model_parallel(1, 1)
            model = classes[cfg.arch](vllm_config=vllm_cfg)
            model.load_weights(make_tiny_hf_model(cfg, seed=4).state_dict().items())
        params, seen = {}, set()
        for prefix, module in model.named_modules():
            for name, p in module.named_parameters(prefix=prefix, recurse=False):
                if id(p) in seen:  # a tied lm_head is the embedding
                    continue
                seen.add(id(p))
                if isinstance(module, RowParallelLinear):
                    dim = p.input_dim
                elif isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
                    dim = 0
                else:
                    dim = None
                layout = ("qkv" if isinstance(module, QKVParallelLinear) else
                          f"concat{len(module.output_sizes)}"
                          if isinstance(module, MergedColumnParallelLinear) else None)
                params[name] = (p.detach().clone(), dim, layout)
        out[key] = params
    return out


@pytest.fixture(scope="module")
def vllm_models(tmp_path_factory):
    pytest.importorskip("vllm")
    return spawn(_vllm_params, 1, CONFIGS, str(tmp_path_factory.mktemp("vllm")))[0]


@pytest.mark.slow
@pytest.mark.parametrize("key", list(CONFIGS))
def test_vllm_view_is_vllms_model(vllm_models, key):
    """vLLM names, TP split dims and fused layouts of every Megatron parameter, and its tensors:
    the Megatron tensors built from an HF state dict, converted by ``to_vllm_shards``, equal what
    vLLM's own loaders make of that state dict."""
    cfg = CONFIGS[key]
    theirs = vllm_models[key]
    metas = _metas(cfg)
    full = hf.hf_to_megatron(make_tiny_hf_model(cfg, seed=4).state_dict(), cfg)
    ours = dict(to_vllm_shards(full, cfg, 1))
    assert sorted(ours) == sorted(theirs)  # one vLLM parameter per Megatron parameter
    for name, meta in metas.items():
        vname = vllm_name(name, cfg)
        tensor, dim, layout = theirs[vname]
        p, _ = resolve(name, cfg)
        want_layout = {"qkv": "qkv", "concat": f"concat{meta.tp_chunks}"}.get(p.merge)
        assert (tuple(tensor.shape), dim, layout) == (meta.shape, meta.tp_dim, want_layout), name
        assert torch.equal(ours[vname], tensor), name
    if cfg.tie_embeddings:  # the last stage's copy of a tied output layer is vLLM's embedding
        assert vllm_name("output_layer.weight", cfg) == "model.embed_tokens.weight"
