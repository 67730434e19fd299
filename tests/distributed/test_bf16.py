"""A bf16 engine holds one dtype (Megatron's local norms are built in fp32 unless the model is
cast), switches to the generation layout, and takes optimizer steps (bf16 params, fp32 main
weights) -- at TP=2 on gloo, with the distributed optimizer too."""

import torch

from hybridflow.parallel.spawn import spawn


def run(rank, world):
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.hybrid_engine.switch import HybridEngine
    from hybridflow.models.config import ModelConfig
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.config import EngineConfig, OptimConfig
    from hybridflow.training.engine import TrainEngine

    model = ModelConfig(vocab_size=256, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16)
    full = init_full_weights(llama_param_metas(model), seed=0)
    ids = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    out = []
    for distributed in (False, True):
        engine = TrainEngine(model, TrainLayout(tp=2), EngineConfig(
            dtype="bf16", micro_batch_size=2,
            optim=OptimConfig(name="adam", lr=1e-2, distributed=distributed)))
        engine.load_full_weights(full)
        dtypes = {p.dtype for _, p in engine.named_local_params()}
        hybrid = HybridEngine(engine)
        gen_dtypes = {t.dtype for t in hybrid.to_generation().tensors.values()}
        hybrid.to_training()
        metrics = engine.train_step(batch, lambda lp, mb: (-lp.float().sum() / 100, {}))
        moved = max((w.float() - full[k]).abs().max().item()
                    for k, w in engine.full_weights().items())
        out.append((dtypes, gen_dtypes, metrics["grad_norm"], moved))
    return out


def test_bf16_engine_switches_and_trains():
    for dtypes, gen_dtypes, grad_norm, moved in spawn(run, 2)[0]:
        assert dtypes == {torch.bfloat16} and gen_dtypes == {torch.bfloat16}
        assert grad_norm > 0 and moved > 1e-3
