"""An engine's training state (weights + Adam state) saved and loaded: the steps after a load
equal, bitwise, the steps an engine that never stopped takes, at the layout it was saved at and
at another (uneven pipeline stages included); and a step with non-finite gradients is not
applied."""

import pytest
import torch

from hybridflow.parallel.spawn import spawn

MODEL = dict(vocab_size=128, hidden_size=32, ffn_hidden_size=64, num_layers=4, num_heads=4,
             num_kv_heads=2, head_dim=8, max_position_embeddings=32)


def _batch(seed, layout):
    """This rank's data-parallel share of a global batch of 4."""
    import torch.distributed as dist
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MODEL["vocab_size"], (4, 10), generator=g)
    full = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "weight": torch.rand(4, 10, generator=g)}
    d = dist.get_rank() // (layout["tp"] * layout["pp"])  # tp innermost, then pp, then dp
    return {k: v.chunk(layout["dp"])[d] for k, v in full.items()}


def _loss(logprobs, mb):
    return -(logprobs * mb["weight"]).sum() / 50.0, {}


def _nan_loss(logprobs, mb):
    return (logprobs * float("nan")).sum(), {}


def _engine(layout, distributed=False):
    from hybridflow.models.config import ModelConfig
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.config import EngineConfig, OptimConfig
    from hybridflow.training.engine import TrainEngine
    model = ModelConfig(**MODEL)
    engine = TrainEngine(model, TrainLayout(**layout), EngineConfig(
        micro_batch_size=1, optim=OptimConfig(name="adam", lr=1e-2, distributed=distributed)))
    engine.load_full_weights(init_full_weights(llama_param_metas(model), seed=3))
    return engine


def _save_then_continue(rank, world, ckpt, layout, distributed):
    from hybridflow.training.megatron_ckpt import save_train_state
    engine = _engine(layout, distributed)
    engine.train_step(_batch(0, layout), _loss)
    save_train_state(engine, ckpt)
    saved = engine.full_weights()
    for seed in (1, 2):
        engine.train_step(_batch(seed, layout), _loss)
    return saved, engine.full_weights()


def _load_then_continue(rank, world, ckpt, layout, distributed):
    from hybridflow.training.megatron_ckpt import load_train_state
    engine = _engine(layout, distributed)
    engine.train_step(_batch(5, layout), _loss)  # state the load must replace entirely
    load_train_state(engine, ckpt)
    loaded = engine.full_weights()
    for seed in (1, 2):
        engine.train_step(_batch(seed, layout), _loss)
    before_nan = engine.full_weights()
    out = engine.train_step(_batch(3, layout), _nan_loss)
    return loaded, engine.full_weights(), before_nan, engine.full_weights(), out


@pytest.mark.parametrize("saved_at, distributed, loads", [
    # The same layout: bitwise. Others: the same state loads, and the steps after agree up to
    # the reduction order of the changed tp/dp sums.
    # Saved at 2/2 layers per stage, loaded at 1/3: layers sit at global indices in the
    # checkpoint, whichever stage holds them.
    (dict(tp=1, pp=2, dp=1), False, [(dict(tp=1, pp=2, dp=1), True),
                                     (dict(tp=1, pp=2, dp=1, last_stage_layers=3), False),
                                     (dict(tp=2, pp=1, dp=1), False),
                                     (dict(tp=1, pp=1, dp=2), False)]),
    # Megatron's distributed optimizer (ZeRO-1) shards its state over dp (on CPU it reloads at
    # another dp only: two processes leave no other layout to try).
    (dict(tp=1, pp=1, dp=2), True, [(dict(tp=1, pp=1, dp=2), True)]),
])
def test_resumed_steps_equal_uninterrupted_ones_at_any_layout(tmp_path, saved_at, distributed,
                                                                loads):
    ckpt = str(tmp_path / "actor")
    saved, uninterrupted = spawn(_save_then_continue, 2, ckpt, saved_at, distributed)[0]
    for layout, exact in loads:
        loaded, resumed, before_nan, after_nan, out = spawn(
            _load_then_continue, 2, ckpt, layout, distributed)[0]
        # Another layout sums in another order; Adam (lr 1e-2) divides by sqrt(v), so a gradient
        # near zero turns that fp32 noise into weight (1.5e-6 at tp=2). A wrong load (state
        # dropped, a layer misplaced) moves a weight by O(lr) = 1e-2.
        tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-5)
        for name in saved:
            torch.testing.assert_close(loaded[name], saved[name], rtol=0, atol=0)
            torch.testing.assert_close(resumed[name], uninterrupted[name], **tol, msg=(
                f"{name} after resuming at {layout}"))
            # A NaN loss: the step is reported and not applied.
            torch.testing.assert_close(after_nan[name], before_nan[name], rtol=0, atol=0)
        assert out["nonfinite"] == 1.0


def _save_into(rank, world, folders):
    from hybridflow.checkpoint import CheckpointWriteError
    from hybridflow.training.megatron_ckpt import save_train_state
    layout = dict(tp=1, pp=1, dp=1)
    engine = _engine(layout)
    engine.train_step(_batch(0, layout), _loss)
    messages = []
    for folder in folders:
        try:
            save_train_state(engine, f"{folder}/actor")
            messages.append(None)
        except CheckpointWriteError as e:
            messages.append(str(e))
    return messages


def test_a_refused_write_is_one_line_naming_the_checkpoint(small_fs):
    """Issue 45, item 10: however the file system refuses a save (real tmpfs mounts), the
    worker's error is one line naming the folder and the OS's reason. The disk full before
    common.pt (torch.save's C++ writer reports no errno: a probe write finds it), during the
    tensor data (Megatron's writer process, the errno only in its message), during .metadata
    (an OSError; the tiny model's data takes ~711 KiB of the 730), and a read-only mount."""
    folders = [small_fs("1m", full=True), small_fs("300k"), small_fs("730k"),
               small_fs("1m", read_only=True)]
    messages = spawn(_save_into, 1, [str(f) for f in folders])[0]
    reasons = ["No space left on device"] * 3 + ["Read-only file system"]
    assert messages == [f"{f}/actor: {r}" for f, r in zip(folders, reasons)], messages
