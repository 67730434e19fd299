"""HF checkpoints loaded shard by shard into the engine give transformers' logits at every layout
(and a critic starts from them), and every way back to HF (export, a Megatron checkpoint saved at
one layout and loaded at another, the conversion tool) gives the original tensors bit for bit.

One 4-process launch does all engine work; the conversion tool runs its own processes before it
(hf-to-megatron at tp=2, pp=1: 2 processes; megatron-to-hf: 1 process).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybridflow.errors import ConfigError
from hybridflow.models.tiny import save_tiny_checkpoint, tiny_llama_config, tiny_qwen2_config
from hybridflow.parallel.layout import TrainLayout
from hybridflow.parallel.spawn import spawn

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"llama": tiny_llama_config(), "qwen2": tiny_qwen2_config()}  # untied; tied + qkv bias
LAYOUTS = [TrainLayout(tp=1, pp=1, dp=4), TrainLayout(tp=2, pp=1, dp=2),
           TrainLayout(tp=1, pp=2, dp=2), TrainLayout(tp=2, pp=2, dp=1)]
BATCH, SEQ = 4, 10


def make_batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    mask[2, -4:] = 0  # right padding
    mask[3, :1] = 0
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask}


def engine_work(rank: int, world: int, ckpts: dict[str, str], tool_ckpt: str, out: str):
    """Per arch: logits at each layout; export at (2,2); a Megatron checkpoint saved at (2,2)
    and loaded at (2,1,dp2); the tool's (2,1) checkpoint loaded at (1,2,dp2)."""
    import torch.distributed as dist

    from hybridflow.models.hf import hf_to_megatron, load_hf_state_dict
    from hybridflow.training.config import EngineConfig
    from hybridflow.training.engine import TrainEngine
    from hybridflow.training.loading import export_engine_to_hf, load_hf_into_engine
    from hybridflow.training.megatron_ckpt import (MODEL_FILE, load_megatron_checkpoint,
                                                   save_megatron_checkpoint)
    from hybridflow.training.model import VALUE_HEAD

    out = Path(out)
    logits = {}
    for arch, hf_dir in ckpts.items():
        cfg = CONFIGS[arch]
        batch = make_batch(cfg.vocab_size)
        for layout in LAYOUTS:
            engine = TrainEngine(cfg, layout, EngineConfig(micro_batch_size=1))
            load_hf_into_engine(engine, hf_dir)
            d = layout.coords(rank)[0]
            per = BATCH // layout.dp
            mine = engine.compute_logits({k: v[d * per:(d + 1) * per] for k, v in batch.items()})
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            logits[arch, str(layout)] = torch.cat([gathered[layout.rank(dd, 0, 0)]
                                                   for dd in range(layout.dp)])
            if (layout.tp, layout.pp) == (2, 2):
                export_engine_to_hf(engine, out / f"{arch}-export-tp2pp2", tokenizer_dir=hf_dir)
                save_megatron_checkpoint(engine, out / f"{arch}-mg-tp2pp2", tokenizer_dir=hf_dir)
        engine = TrainEngine(cfg, TrainLayout(tp=2, pp=1, dp=2), EngineConfig())
        load_megatron_checkpoint(engine, out / f"{arch}-mg-tp2pp2")
        export_engine_to_hf(engine, out / f"{arch}-mg-tp2pp2-loaded-tp2pp1")
    engine = TrainEngine(CONFIGS["qwen2"], TrainLayout(tp=1, pp=2, dp=2), EngineConfig(),
                         build_optimizer=False)
    load_megatron_checkpoint(engine, tool_ckpt)
    export_engine_to_hf(engine, out / "qwen2-tool-tp2pp1-loaded-tp1pp2")

    # another model's checkpoint is refused, by its stored config or else by a missing tensor
    bare = out / "llama-mg-without-config"
    if rank == 0:
        shutil.copytree(out / "llama-mg-tp2pp2", bare)
        (bare / MODEL_FILE).unlink()
    dist.barrier()
    errors = []
    for ckpt in (out / "llama-mg-tp2pp2", bare):
        try:
            load_megatron_checkpoint(engine, ckpt)
            errors.append(None)
        except ConfigError as e:
            errors.append(str(e))

    # a critic starts from the tied LM checkpoint: every weight but its fresh value head
    critic = TrainEngine(CONFIGS["qwen2"], TrainLayout(tp=2, pp=2, dp=1), EngineConfig(),
                         build_optimizer=False, head="value")
    load_hf_into_engine(critic, ckpts["qwen2"])
    weights = critic.full_weights()
    want = hf_to_megatron(load_hf_state_dict(ckpts["qwen2"]), CONFIGS["qwen2"])
    critic_ok = sorted(weights) == sorted([*want, VALUE_HEAD]) and all(
        torch.equal(weights[k], want[k]) for k in want)
    return (logits, errors, critic_ok) if rank == 0 else None


def _tool(*args: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[convert] done" in done.stdout


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_megatron")
    ckpts = {arch: str(save_tiny_checkpoint(root / arch, cfg, seed=11))
             for arch, cfg in CONFIGS.items()}
    tool_ckpt = root / "qwen2-tool-tp2pp1"
    _tool("hf-to-megatron", "--hf", ckpts["qwen2"], "--out", str(tool_ckpt), "--tp", "2",
          "--pp", "1")
    _tool("megatron-to-hf", "--ckpt", str(tool_ckpt), "--out", str(root / "qwen2-tool-back"))
    logits, errors, critic_ok = spawn(engine_work, 4, ckpts, str(tool_ckpt), str(root))[0]
    return SimpleNamespace(root=root, ckpts=ckpts, logits=logits, errors=errors,
                           critic_ok=critic_ok)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("arch", CONFIGS)
def test_logits_match_transformers(run, arch, layout):
    from hybridflow.training.model import batch_position_ids

    batch = make_batch(CONFIGS[arch].vocab_size)
    model = transformers.AutoModelForCausalLM.from_pretrained(run.ckpts[arch], dtype=torch.float32)
    with torch.no_grad():
        # the engine's positions: left padding does not shift RoPE
        positions = batch_position_ids(batch["attention_mask"])
        want = model.eval()(**batch, position_ids=positions).logits
    got = run.logits[arch, str(layout)]
    assert got.shape == want.shape == (BATCH, SEQ, CONFIGS[arch].vocab_size)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch,name", [
    ("llama", "llama-export-tp2pp2"), ("qwen2", "qwen2-export-tp2pp2"),
    ("llama", "llama-mg-tp2pp2-loaded-tp2pp1"), ("qwen2", "qwen2-mg-tp2pp2-loaded-tp2pp1"),
    ("qwen2", "qwen2-tool-tp2pp1-loaded-tp1pp2"), ("qwen2", "qwen2-tool-back")])
def test_round_trip_is_bit_exact(run, arch, name):
    from safetensors.torch import load_file

    from hybridflow.models.hf import load_hf_config

    root, ckpts = run.root, run.ckpts
    want = load_file(str(Path(ckpts[arch]) / "model.safetensors"))
    got = load_file(str(root / name / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    assert load_hf_config(root / name) == CONFIGS[arch]
    if "export" in name or "back" in name:  # the tokenizer travelled with it
        assert (root / name / "tokenizer.json").exists()


def test_megatron_checkpoint_keeps_config_and_tokenizer(run):
    from hybridflow.training.megatron_ckpt import (TOKENIZER_DIR, checkpoint_dtype,
                                                   read_checkpoint_model)

    root = run.root
    for name, arch in (("qwen2-tool-tp2pp1", "qwen2"), ("llama-mg-tp2pp2", "llama")):
        assert read_checkpoint_model(root / name) == CONFIGS[arch]
        assert checkpoint_dtype(root / name) == "fp32"
        assert (root / name / TOKENIZER_DIR / "tokenizer.json").exists()
    assert not [p.name for p in root.iterdir() if ".tmp-" in p.name]  # nothing half-written left


def test_checkpoint_of_another_model_is_refused(run):
    with_config, without_config = run.errors
    assert with_config is not None and without_config is not None
    assert with_config.startswith("model: model.arch: the checkpoint ")
    assert "has arch='llama' but the engine was built with 'qwen2'" in with_config
    assert "does not fit this model (KeyError" in without_config
    assert "linear_qkv.bias" in without_config  # llama has no q/k/v biases


def test_critic_loads_the_lm_checkpoint(run):
    assert run.critic_ok  # all LM weights equal the checkpoint's; the value head is extra
