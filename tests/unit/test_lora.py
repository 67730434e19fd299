"""LoRA's pieces without processes: the config and its refusals, the adapters' shapes and TP
splits, the merge and PEFT's names against hand-built tensors, dropout acting in training only."""

import pytest
import torch
import torch.nn.functional as F

from hybridflow.config import RLConfig, load_config
from hybridflow.errors import ConfigError
from hybridflow.models.config import ModelConfig
from hybridflow.training.lora import (Adapters, LoraConfig, lora_metas, merge_adapters,
                                      peft_state_dict)

CFG = ModelConfig(vocab_size=64, hidden_size=8, ffn_hidden_size=12, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=2, max_position_embeddings=16)


@pytest.mark.parametrize("kwargs, field", [
    (dict(rank=-1), "rank"), (dict(rank=4, alpha=0), "alpha"), (dict(rank=4, dropout=1.0),
                                                                "dropout"),
    (dict(rank=4, target_modules=["q_proj"]), "target_modules"),
    (dict(rank=4, target_modules=[]), "target_modules"),
    (dict(rank=4, target_modules=["linear_qkv", "linear_qkv"]), "target_modules")])
def test_config_refuses_bad_values(kwargs, field):
    with pytest.raises(ConfigError) as e:
        LoraConfig(**kwargs)
    assert e.value.field == field


@pytest.mark.parametrize("overrides, field", [
    (["actor.lora.alpha=8"], "actor.lora.alpha"),  # no rank: LoRA is off, alpha would do nothing
    (["actor.lora.rank=4", "ref.offload=true"], "ref.offload"),  # the reference is the base
    (["actor.lora.rank=4", "actor.layout.tp=2", "actor.engine.sequence_parallel=true"],
     "actor.lora")])
def test_run_config_refuses_what_lora_would_ignore(overrides, field):
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, None, ["model=tiny-llama", *overrides])
    assert e.value.field == field


def test_metas_split_like_their_weights():
    metas = {m.name: m for m in lora_metas(CFG, LoraConfig(rank=3, target_modules=[
        "linear_qkv", "linear_fc1", "linear_fc2"]))}
    assert len(metas) == 2 * 3 * CFG.num_layers  # no linear_proj
    qkv = "decoder.layers.1.self_attention.linear_qkv."
    assert (metas[qkv + "lora_A"].shape, metas[qkv + "lora_A"].tp_dim) == ((3, 8), None)
    assert (metas[qkv + "lora_B"].shape, metas[qkv + "lora_B"].tp_dim) == ((16, 3), 0)
    fc1, fc2 = "decoder.layers.0.mlp.linear_fc1.", "decoder.layers.0.mlp.linear_fc2."
    assert metas[fc1 + "lora_B"].tp_chunks == 2  # [gate; up], split each on its own
    assert (metas[fc2 + "lora_A"].shape, metas[fc2 + "lora_A"].tp_dim) == ((3, 12), 1)
    assert (metas[fc2 + "lora_B"].shape, metas[fc2 + "lora_B"].tp_dim) == ((8, 3), None)


def test_merge_is_w_plus_scaled_ba():
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    a, b = torch.tensor([[1.0, -1.0]]), torch.tensor([[2.0], [0.5]])
    name = "decoder.layers.0.mlp.linear_fc2."
    out = merge_adapters({name + "weight": w, "other": w}, {name + "lora_A": a,
                                                            name + "lora_B": b}, scaling=4.0)
    # 4 * b @ a = [[8, -8], [2, -2]]
    assert torch.equal(out[name + "weight"], torch.tensor([[9.0, -6.0], [5.0, 2.0]]))
    assert out["other"] is w


def test_peft_names_and_qkv_fc1_splits():
    lora = LoraConfig(rank=1)
    metas = lora_metas(CFG, lora)
    adapters = {m.name: torch.arange(m.numel, dtype=torch.float32).reshape(m.shape)
                for m in metas}
    peft = peft_state_dict(adapters, CFG)
    layer = "base_model.model.model.layers.0."
    qkv = adapters["decoder.layers.0.self_attention.linear_qkv.lora_B"].flatten()
    # Megatron's qkv rows per query group: [q heads of the group (2 x 2 rows), k (2), v (2)].
    assert peft[layer + "self_attn.q_proj.lora_B.weight"].flatten().tolist() == [0, 1, 2, 3, 8,
                                                                                 9, 10, 11]
    assert peft[layer + "self_attn.k_proj.lora_B.weight"].flatten().tolist() == [4, 5, 12, 13]
    assert peft[layer + "self_attn.v_proj.lora_B.weight"].flatten().tolist() == [6, 7, 14, 15]
    assert qkv.tolist() == list(range(16))
    fc1 = adapters["decoder.layers.0.mlp.linear_fc1.lora_B"]
    assert torch.equal(peft[layer + "mlp.gate_proj.lora_B.weight"], fc1[:12])
    assert torch.equal(peft[layer + "mlp.up_proj.lora_B.weight"], fc1[12:])
    for proj in ("q_proj", "k_proj", "v_proj"):  # one input, one A
        assert torch.equal(peft[layer + f"self_attn.{proj}.lora_A.weight"],
                           adapters["decoder.layers.0.self_attention.linear_qkv.lora_A"])
    assert len(peft) == 2 * 7 * CFG.num_layers


def test_dropout_acts_in_training_only():
    module = torch.nn.Module()
    module.lora_A = torch.nn.Parameter(torch.ones(2, 1000))
    x = torch.ones(3, 1000)
    for p, differs in ((0.5, True), (0.0, False)):
        adapters = Adapters(LoraConfig(rank=2, dropout=p), [])
        module.train()
        train = F.linear(adapters._input(module, x), module.lora_A)
        module.eval()
        assert torch.equal(F.linear(adapters._input(module, x), module.lora_A),
                           torch.full((3, 2), 1000.0))
        assert (not torch.equal(train, torch.full((3, 2), 1000.0))) == differs
        if differs:  # inverted dropout: the expectation is kept
            assert train.mean().item() == pytest.approx(1000.0, rel=0.1)


def test_a_failed_generation_switches_back_to_training():
    # The switch back also writes a LoRA base merged in place back: it must run even when the
    # rollout fails, or a checkpoint saved afterwards would hold the merged weights as the base.
    from types import SimpleNamespace

    from hybridflow.workers.actor import ActorRolloutRefWorker

    calls = []

    def fail(*args):
        raise RuntimeError("rollout failed")

    worker = SimpleNamespace(
        rollout_cfg=SimpleNamespace(sampling=None),
        hybrid=SimpleNamespace(to_generation=lambda: SimpleNamespace(tensors={}),
                               to_training=lambda: calls.append("to_training")),
        rollout=SimpleNamespace(load_from_switch=lambda t: None, wake=lambda: None,
                                capture_seconds=0.0, generate=fail),
        tools=None)
    with pytest.raises(RuntimeError, match="rollout failed"):
        ActorRolloutRefWorker.generate(worker, {"prompt_ids": []})
    assert calls == ["to_training"]
