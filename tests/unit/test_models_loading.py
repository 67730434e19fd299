"""Sliced HF loading into a TrainEngine's shards, checkpoint errors, and the conversion tool's
bad-input handling, without processes: a stand-in engine holds one rank's parameters."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridflow.errors import ConfigError
from hybridflow.models import hf
from hybridflow.models.params import ParamMeta, llama_param_metas, shard
from hybridflow.models.tiny import (make_tiny_hf_model, save_tiny_checkpoint, tiny_llama_config,
                                    tiny_qwen2_config, tiny_tp4_config)
from hybridflow.parallel.layout import TrainLayout
from hybridflow.training.loading import check_hf_checkpoint, load_hf_into_engine
from hybridflow.training.model import VALUE_HEAD

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]

CONFIGS = {"llama": tiny_llama_config(num_layers=2), "qwen2": tiny_qwen2_config(num_layers=2),
           "qwen2-tp4": tiny_tp4_config("qwen2", num_layers=1)}


class RankStandIn:
    """What ``load_hf_into_engine`` uses of a TrainEngine: the parameters one TP rank holds
    (every stage's, and the last stage's copy of tied embeddings)."""

    def __init__(self, cfg, tp: int, tp_rank: int, head: str = "lm"):
        if head == "value":  # as TrainEngine builds critics: untied, a value head for the output
            cfg = dataclasses.replace(cfg, tie_embeddings=False)
        self.model_config, self.layout = cfg, TrainLayout(tp=tp)
        self.tp_rank, self.head = tp_rank, head
        self.metas = {m.name: m for m in llama_param_metas(cfg)}
        self.optimizer = None
        if head == "value":
            del self.metas["output_layer.weight"]
            self.metas[VALUE_HEAD] = ParamMeta(name=VALUE_HEAD, shape=(1, cfg.hidden_size),
                                               tp_dim=None, layer=None, position="post")
        names = list(self.metas) + (["output_layer.weight"] if cfg.tie_embeddings else [])
        source = {n: "embedding.word_embeddings.weight" if n == "output_layer.weight" else n
                  for n in names}
        self.params = {n: torch.nn.Parameter(torch.full(self.metas[source[n]].shard_shape(tp),
                                                        float("nan"))) for n in names}

    def named_local_params(self):
        return iter(self.params.items())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: save_tiny_checkpoint(root / name, cfg, seed=3) for name, cfg in CONFIGS.items()}


@pytest.mark.parametrize("name,tp", [("llama", 1), ("llama", 2), ("qwen2", 2), ("qwen2-tp4", 4)])
def test_sliced_shards_equal_shards_of_the_full_tensors(checkpoints, name, tp):
    cfg = CONFIGS[name]
    full = hf.hf_to_megatron(hf.load_hf_state_dict(checkpoints[name]), cfg)
    for rank in range(tp):
        engine = RankStandIn(cfg, tp, rank)
        load_hf_into_engine(engine, checkpoints[name])
        for pname, param in engine.params.items():
            tied_output = pname == "output_layer.weight" and cfg.tie_embeddings
            source = "embedding.word_embeddings.weight" if tied_output else pname
            want = shard(full[source], engine.metas[source], tp, rank)
            assert torch.equal(param.detach(), want), (pname, rank)


def test_critic_starts_from_a_tied_lm_checkpoint(checkpoints):
    engine = RankStandIn(CONFIGS["qwen2"], 2, 1, head="value")
    load_hf_into_engine(engine, checkpoints["qwen2"])
    assert engine.params[VALUE_HEAD].isnan().all()  # left to the engine's own initialisation
    full = hf.hf_to_megatron(hf.load_hf_state_dict(checkpoints["qwen2"]), CONFIGS["qwen2"])
    for name in ("embedding.word_embeddings.weight",
                 "decoder.layers.1.self_attention.linear_qkv.bias"):
        want = shard(full[name], engine.metas[name], 2, 1)
        assert torch.equal(engine.params[name].detach(), want), name


def test_sharded_index_checkpoint_loads(tmp_path):
    cfg = CONFIGS["llama"]
    sd = make_tiny_hf_model(cfg, seed=5).state_dict()
    ckpt = hf.save_hf_checkpoint(tmp_path / "ckpt", sd, cfg, max_shard_bytes=200_000)
    assert (ckpt / "model.safetensors.index.json").exists()
    engine = RankStandIn(cfg, 2, 1)
    load_hf_into_engine(engine, ckpt)
    full = hf.hf_to_megatron(sd, cfg)
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    assert torch.equal(engine.params[name].detach(), shard(full[name], engine.metas[name], 2, 1))


def test_truncated_file_names_the_tensor(checkpoints, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in checkpoints["llama"].iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    path = ckpt / "model.safetensors"
    os.truncate(path, path.stat().st_size - 4096)
    with pytest.raises(ConfigError) as err:
        load_hf_into_engine(RankStandIn(CONFIGS["llama"], 2, 0), ckpt)
    assert err.value.field == "model" and err.value.message.startswith(f"{path}: ")
    assert "truncated" in str(err.value) and "tensor model." in str(err.value)


def _resave(src: Path, dest: Path, change) -> Path:
    """Copy an HF checkpoint, with its tensors changed by ``change(state_dict)``."""
    from safetensors.torch import load_file, save_file

    dest.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dest / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(src / "model.safetensors"))
    change(sd)
    save_file(sd, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_mismatched_shape_names_the_file_and_tensor(checkpoints, tmp_path):
    bad = "model.layers.1.mlp.up_proj.weight"
    ckpt = _resave(checkpoints["qwen2"], tmp_path / "ckpt",
                   lambda sd: sd.update({bad: sd[bad][:-8].clone()}))
    with pytest.raises(ConfigError) as err:
        load_hf_into_engine(RankStandIn(CONFIGS["qwen2"], 1, 0), ckpt)
    assert err.value.field == "model"
    assert err.value.message.startswith(f"{ckpt / 'model.safetensors'}: ")
    assert f"tensor {bad} has shape [248, 128], expected [256, 128]" in str(err.value)


def test_missing_tensor_is_named(checkpoints, tmp_path):
    bad = "model.layers.0.self_attn.k_proj.bias"
    ckpt = _resave(checkpoints["qwen2"], tmp_path / "ckpt", lambda sd: sd.pop(bad))
    with pytest.raises(ConfigError, match=f"tensor {bad}: missing from the checkpoint"):
        load_hf_into_engine(RankStandIn(CONFIGS["qwen2"], 2, 1), ckpt)


def test_config_mismatch_names_the_field(checkpoints):
    engine = RankStandIn(tiny_llama_config(num_layers=2, rms_norm_eps=1e-5), 1, 0)
    with pytest.raises(ConfigError) as err:
        load_hf_into_engine(engine, checkpoints["llama"])
    assert err.value.field == "model" and err.value.message.startswith("model.rms_norm_eps: ")
    assert "has rms_norm_eps=1e-06 but the engine was built with 1e-05" in str(err.value)
    assert check_hf_checkpoint(checkpoints["llama"]) == CONFIGS["llama"]


def test_tool_bad_input_is_one_message(tmp_path):
    tool = ROOT / "tools" / "convert_checkpoint.py"
    out = subprocess.run([sys.executable, str(tool), "hf-to-megatron", "--hf", str(tmp_path / "no"),
                          "--out", str(tmp_path / "o")], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"convert_checkpoint: error: --hf: {tmp_path / 'no'}: is not a directory; point to an HF "
        "checkpoint directory"]


def test_conversion_checks_input_before_starting_processes(checkpoints, tmp_path):
    from hybridflow.training.megatron_ckpt import (hf_to_megatron_checkpoint,
                                                   megatron_to_hf_checkpoint)

    out = tmp_path / "o"
    with pytest.raises(ConfigError, match=r"^--tp: tp=4 must divide model.num_kv_heads=2$"):
        hf_to_megatron_checkpoint(checkpoints["llama"], out, tp=4, verbose=False)
    with pytest.raises(ConfigError, match="^--pp: must be a positive integer"):
        hf_to_megatron_checkpoint(checkpoints["llama"], out, pp=0, verbose=False)
    with pytest.raises(ConfigError, match="is the input directory"):
        hf_to_megatron_checkpoint(checkpoints["llama"], checkpoints["llama"], verbose=False)
    with pytest.raises(ConfigError, match="exists; remove it or pass --overwrite"):
        hf_to_megatron_checkpoint(checkpoints["llama"], checkpoints["qwen2"], verbose=False)
    with pytest.raises(ConfigError, match="is not a Megatron-Core distributed checkpoint"):
        megatron_to_hf_checkpoint(checkpoints["llama"], out, verbose=False)
    assert not out.exists()
