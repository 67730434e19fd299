"""An RL run's checkpoint exports to HF: ``tools/convert_checkpoint.py megatron-to-hf --ckpt`` a run
directory (its newest complete checkpoint) or a step directory writes the actor's trained weights,
which transformers loads and which equal the engine's, bit for bit; the tokenizer an RL checkpoint
lacks comes from ``--hf-config-from``. A bad RL checkpoint is one ConfigError on ``--ckpt``.

One 2-process gloo launch trains a tiny Llama one Adam step and saves its training state (weights +
optimizer state, as an RL run does); the test process wraps it into ``<run>/checkpoints/step_3``.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybridflow.checkpoint import run_identity, save_checkpoint
from hybridflow.models.tiny import save_tiny_checkpoint, tiny_llama_config
from hybridflow.parallel.spawn import spawn

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
MODEL = tiny_llama_config(num_layers=2)
LAYOUT = dict(tp=2, pp=1, dp=1)  # saved at tp=2; the export loads it at tp=1


def _tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint",
                                                  ROOT / "tools" / "convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _train_and_save(rank, world, actor_dir):
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.config import EngineConfig, OptimConfig
    from hybridflow.training.engine import TrainEngine
    from hybridflow.training.megatron_ckpt import save_train_state

    engine = TrainEngine(MODEL, TrainLayout(**LAYOUT), EngineConfig(
        micro_batch_size=1, optim=OptimConfig(name="adam", lr=1e-2)))
    initial = init_full_weights(llama_param_metas(MODEL), seed=3)
    engine.load_full_weights(initial)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, MODEL.vocab_size, (2, 10), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "weight": torch.rand(2, 10, generator=g)}
    engine.train_step(batch, lambda logprobs, mb: (-(logprobs * mb["weight"]).sum() / 20.0, {}))
    save_train_state(engine, actor_dir)
    trained = engine.full_weights()  # collective
    return (initial, trained) if rank == 0 else None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_rl")
    staging = root / "staging"
    initial, trained = spawn(_train_and_save, 2, str(staging / "actor"))[0]
    run_dir = root / "run"
    cfg = SimpleNamespace(algorithm=SimpleNamespace(name="grpo"))
    state = {**run_identity(cfg, MODEL), "sampler": {"epoch": 0, "position": 6}}
    save_checkpoint(run_dir, 3, state,
                    lambda tmp: shutil.copytree(staging / "actor", tmp / "actor"), keep=2)
    hf_model = save_tiny_checkpoint(root / "hf_model", MODEL, seed=1)  # config + tokenizer
    return SimpleNamespace(root=root, run_dir=run_dir, initial=initial, trained=trained,
                           hf_model=hf_model)


def _hf_weights(path: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


def _assert_exported(out: Path, trained: dict[str, torch.Tensor]) -> None:
    from hybridflow.models.hf import load_hf_config, megatron_to_hf

    want = megatron_to_hf(trained, MODEL)
    got = _hf_weights(out)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert load_hf_config(out) == MODEL


def test_run_dir_exports_the_newest_actor(run, capsys):
    # the step changed the weights: the export is of the trained actor, not of its start
    assert any(not torch.equal(run.trained[k], run.initial[k]) for k in run.initial)
    out = run.root / "from_run"
    assert _tool()(["megatron-to-hf", "--ckpt", str(run.run_dir), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "exporting the actor of" in stdout and "step_000003" in stdout
    assert "no tokenizer to copy" in stdout
    _assert_exported(out, run.trained)
    assert not (out / "tokenizer.json").exists()


def test_step_dir_with_hf_config_from_adds_the_tokenizer(run):
    out = run.root / "from_step"
    step = run.run_dir / "checkpoints" / "step_000003"
    assert _tool()(["megatron-to-hf", "--ckpt", str(step), "--out", str(out),
                    "--hf-config-from", str(run.hf_model), "--quiet"]) == 0
    _assert_exported(out, run.trained)
    text = "What is 1 + 1?"
    tok, src = (transformers.AutoTokenizer.from_pretrained(str(p)) for p in (out, run.hf_model))
    assert tok(text)["input_ids"] == src(text)["input_ids"]


def _bad(tmp: Path, run, edit) -> Path:
    """A copy of the run directory changed by ``edit(step_dir)``."""
    run_dir = tmp / "run"
    shutil.copytree(run.run_dir, run_dir)
    edit(run_dir / "checkpoints" / "step_000003")
    return run_dir


def _truncate(step: Path) -> None:
    f = next(p for p in sorted((step / "actor").iterdir()) if p.suffix == ".distcp")
    f.write_bytes(f.read_bytes()[:10])


def _manifest_lists(step: Path) -> None:
    state = json.loads((step / "trainer.json").read_text())
    state["files"]["actor/extra.distcp"] = 10
    (step / "trainer.json").write_text(json.dumps(state))


@pytest.mark.parametrize("edit, ckpt, pieces", [
    (_truncate, "run", ["actor/__", "bytes", "truncated?", "export another checkpoint"]),
    (_manifest_lists, "run", ["actor/extra.distcp is missing", "export another checkpoint"]),
    (lambda step: shutil.rmtree(step / "actor"), "run", ["actor/", "missing"]),
    (lambda step: (step / "trainer.json").unlink(), "run", ["holds no complete checkpoint"]),
    (lambda step: None, "run/checkpoints/step_000003/critic", ["not a directory"]),
    (lambda step: None, "nowhere", ["not a directory"]),
], ids=["truncated file", "file of the manifest missing", "no actor", "no complete checkpoint",
        "no critic", "path missing"])
def test_bad_rl_checkpoint_is_one_error(run, tmp_path, capsys, edit, ckpt, pieces):
    _bad(tmp_path, run, edit)
    out = tmp_path / "out"
    assert _tool()(["megatron-to-hf", "--ckpt", str(tmp_path / ckpt), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("convert_checkpoint: error: --ckpt: "), err
    for piece in pieces:
        assert piece in err, err
    assert not out.exists()


def test_out_inside_the_run_checkpoint_is_refused(run, tmp_path, capsys):
    run_dir = _bad(tmp_path, run, lambda step: None)
    for out in (run_dir, run_dir / "checkpoints" / "step_000003" / "hf"):
        assert _tool()(["megatron-to-hf", "--ckpt", str(run_dir), "--out", str(out),
                        "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("convert_checkpoint: error: --out: "), err
        assert "holds or is inside the checkpoint" in err
    assert (run_dir / "checkpoints" / "step_000003" / "actor").is_dir()
