"""hybridflow.training.embedding: the lookup's gradient added into main_grad by row.

A training step's gradients (every weight's ``main_grad``) equal those of Megatron's lookup, which
writes a dense table gradient that DDP's hook adds. This holds with the table tied and untied, at
TP=1, TP=2 (tokens of the other rank's vocabulary shard) and PP=2 (the tied table on both
stages), over gloo. It also shows what changed: no gradient of the table reaches autograd (the
hook has nothing to add), and the output layer's dummy is no longer zeroed.
"""

import pytest
import torch

from hybridflow.parallel.spawn import spawn

TABLE = "embedding.word_embeddings.weight"


def run(rank, world, layouts, dtype="fp32"):
    from hybridflow.models.config import ModelConfig
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training import embedding
    from hybridflow.training.config import EngineConfig, OptimConfig
    from hybridflow.training.engine import TrainEngine
    from tests.distributed.update_common import GRAD_MODEL, weighted_logprob_batch
    # Token ids over the whole vocabulary: at TP=2 each rank sees ids of the other's shard.
    batch, loss_fn = weighted_logprob_batch()
    out = {}
    for layout in layouts:
        for tie in (False, True):
            model = ModelConfig(**GRAD_MODEL, tie_embeddings=tie)
            full = init_full_weights(llama_param_metas(model), seed=3, std=0.3)
            for by_row in (False, True):
                embedding.ENABLED = by_row
                engine = TrainEngine(model, TrainLayout(**layout), EngineConfig(
                    micro_batch_size=2, dtype=dtype,
                    optim=OptimConfig(name="sgd", clip_grad=0.0)))
                engine.load_full_weights(full)
                table = dict(engine.named_local_params()).get(TABLE)
                seen = []  # gradients autograd hands the table (DDP's hook then adds them)
                if table is not None:
                    table.register_hook(lambda grad: seen.extend([] if grad is None else [1]))
                engine.train_step(batch, loss_fn)  # two micro-batches: one accumulation at least
                out[str(layout), tie, by_row] = {
                    "holds_table": table is not None, "table_autograd": len(seen),
                    "zero_out_wgrad": getattr(table, "zero_out_wgrad", False),
                    "grads": {n: w.main_grad.float().cpu() for n, w in engine.named_local_params()}}
    return out


def check(results, layouts, tolerance=1e-6):
    for rank_out in results:
        for layout in layouts:
            for tie in (False, True):
                dense, by_row = rank_out[str(layout), tie, False], rank_out[str(layout), tie, True]
                assert set(dense["grads"]) == set(by_row["grads"])
                for name, grad in dense["grads"].items():
                    error = (by_row["grads"][name] - grad).norm() / max(grad.norm(), 1e-12)
                    assert error < tolerance, (layout, tie, name, float(error))
                if not dense["holds_table"]:  # PP=2's last stage: its copy is the output layer
                    assert layout.get("pp", 1) > 1
                    continue
                # Megatron's lookup hands autograd a dense table each micro-batch, and a tied
                # table needs the output layer's dummy zeroed so that the hook adds it. By row,
                # a table gets no gradient through autograd but the output layer's dummy where
                # that layer shares it, left unfilled.
                assert dense["table_autograd"] == 2
                same_stage = tie and layout.get("pp", 1) == 1  # the output layer uses it too
                assert by_row["table_autograd"] == (2 if same_stage else 0)
                assert dense["zero_out_wgrad"] == tie and not by_row["zero_out_wgrad"]


def test_gradients_by_row_equal_the_dense_lookup_at_tp1():
    layouts = [{}]
    check(spawn(run, 1, layouts), layouts)


@pytest.mark.slow
def test_gradients_by_row_equal_the_dense_lookup_at_tp2_and_pp2():
    layouts = [{"tp": 2}, {"pp": 2}]
    check(spawn(run, 2, layouts), layouts)


@pytest.mark.gpu
def test_gradients_by_row_equal_the_dense_lookup_in_bf16():
    # Megatron's lookup sums a micro-batch's rows into a bf16 table before the fp32 main_grad;
    # by row they are summed in fp32.
    layouts = [{}]
    check(spawn(run, 1, layouts, "bf16", backend="nccl"), layouts, 0.01)
