"""``fuse_adam`` (applied on CUDA, where torch's multi-tensor Adam would allocate a temporary the size
of the fp32 state): it reaches the torch Adam inside the optimizer Megatron builds, and a step with
the fused kernel takes the weights where the default path does. Torch has the fused kernel on the
CPU too, so this runs here, in one gloo process."""

import torch

from hybridflow.models.config import ModelConfig
from hybridflow.parallel.spawn import spawn

MODEL = dict(vocab_size=128, hidden_size=32, ffn_hidden_size=64, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=8, max_position_embeddings=32)


def loss_fn(logprobs, mb):
    return -(logprobs * mb["attention_mask"]).sum() / 50.0, {}


def two_steps(rank, world):
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.config import EngineConfig, OptimConfig
    from hybridflow.training.engine import TrainEngine, fuse_adam

    model = ModelConfig(**MODEL)
    full = init_full_weights(llama_param_metas(model), seed=0)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, 128, (4, 10), generator=g),
             "attention_mask": torch.ones(4, 10, dtype=torch.long)}
    out = {}
    for fused in (False, True):
        engine = TrainEngine(model, TrainLayout(), EngineConfig(
            micro_batch_size=2, optim=OptimConfig(lr=1e-2)))
        engine.load_full_weights(full)
        if fused:
            out["changed"] = fuse_adam(engine.optimizer)
            out["groups"] = [(grp["fused"], grp["foreach"])
                             for grp in engine.optimizer.optimizer.param_groups]
        for _ in range(2):
            engine.train_step(batch, loss_fn)
        out[fused] = engine.full_weights()
    out["start"] = full
    return out


def test_fuse_adam_reaches_megatrons_torch_adam_and_keeps_the_step():
    (out,) = spawn(two_steps, 1)
    assert out["changed"] == 1 and out["groups"] and all(g == (True, False) for g in out["groups"])
    for name, w in out[False].items():
        torch.testing.assert_close(out[True][name], w, rtol=1e-5, atol=1e-6)
    # the two steps moved the weights (the comparison is not of untouched copies)
    assert max((w - out["start"][n]).abs().max().item() for n, w in out[False].items()) > 1e-3
