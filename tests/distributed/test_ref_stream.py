"""The reference's weights streamed unit by unit (``TrainEngine.stream_weights``, ``ref.offload``):
its log-probs equal the resident engine's bit for bit, at TP=1/PP=1 (tied and untied output
layer), TP=2, PP=2 (tied) and PP=2 interleaved (two chunks a rank); between passes every
parameter is an empty placeholder; during a pass at most two units (the current and the
prefetched) are fetched, and a second pass still equals. On CPU the hooks swap the host tensors
in and out; the ``gpu`` test checks that the weights leave the device, that the pass's device
memory stays below the weights' and comes back to where it was.

GPU: ``pytest -m gpu tests/distributed/test_ref_stream.py`` (one process, one GPU).
"""

import pytest
import torch

from hybridflow.parallel.spawn import spawn

MODEL = dict(vocab_size=128, hidden_size=32, ffn_hidden_size=64, num_layers=4, num_heads=4,
             num_kv_heads=2, head_dim=8, max_position_embeddings=32)
SPANS = [(8, 8), (1, 1), (6, 2), (2, 7), (1, 1), (3, 5)]
MICRO_BATCH = 2  # three micro-batches: each streams the weights again


def make_batch(vocab_size: int = MODEL["vocab_size"]):
    from tests.distributed.update_common import spans_batch
    batch = spans_batch(SPANS, 8, 8, vocab_size)
    return {k: batch[k] for k in ("input_ids", "attention_mask", "response_mask")}


def engines(model, layout, engine_config, full):
    """(resident, streamed) engines of the same weights; ``streamed.stream_weights()`` not called
    yet."""
    from hybridflow.training.engine import TrainEngine
    out = []
    for _ in range(2):
        engine = TrainEngine(model, layout, engine_config, build_optimizer=False)
        engine.load_full_weights(full)
        out.append(engine)
    return out


def most_fetched(streamed) -> list[int]:
    """Hooks run after the streaming's own pre-hooks: the units on the device at each unit's
    start (the one about to run, the one prefetched)."""
    seen = []
    for unit in streamed.units:
        unit.first.register_forward_pre_hook(
            lambda *_: seen.append(sum(u.device is not None for u in streamed.units)))
    return seen


def run(rank, world, layouts):
    from hybridflow.models.config import ModelConfig
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.config import EngineConfig

    out = []
    for layout_kw, tied, micro_batch in layouts:
        model = ModelConfig(**MODEL, tie_embeddings=tied)
        full = init_full_weights(llama_param_metas(model), seed=3, std=0.3)
        resident, streamed = engines(model, TrainLayout(**layout_kw),
                                     EngineConfig(micro_batch_size=micro_batch), full)
        streamed.stream_weights()
        batch = make_batch()
        params = [p for _, p in streamed.named_local_params()]
        before = [p.numel() for p in params]
        seen = most_fetched(streamed.streamed)
        first = streamed.compute_logprobs(batch)
        after = [p.numel() for p in params]
        second = streamed.compute_logprobs(batch)
        out.append({"expected": resident.compute_logprobs(batch), "first": first,
                    "second": second, "before": before, "after": after,
                    "held": [p.numel() for _, p in resident.named_local_params()],
                    "units": len(streamed.streamed.units), "seen": seen,
                    "micro_batches": len(streamed._micro_batches(batch, forward_only=True)),
                    "fetched": streamed.streamed.fetched()})
    return out


def check(results, layouts):
    for per_rank in results:
        for r, layout in zip(per_rank, layouts):
            if r["expected"] is None:  # not the last pipeline stage
                continue
            assert torch.equal(r["first"], r["expected"]), layout
            assert torch.equal(r["second"], r["expected"]), layout
            assert r["expected"].abs().sum() > 0
    for per_rank in results:
        for r, layout in zip(per_rank, layouts):
            # between passes no parameter holds its weights; the resident engine's all do
            assert max(r["before"]) == 0 and max(r["after"]) == 0 and r["fetched"] == 0, layout
            assert min(r["held"]) > 0
            # every unit ran in each micro-batch of both passes, with at most two on the device
            # (the prefetched next one from a chunk's second unit on)
            assert r["micro_batches"] > 1
            assert len(r["seen"]) == 2 * r["micro_batches"] * r["units"], (layout, r["seen"])
            assert max(r["seen"]) == 2 and min(r["seen"]) >= 1, (layout, r["seen"])


def test_streamed_reference_equals_the_resident_one_on_one_process():
    layouts = [(dict(), False, MICRO_BATCH), (dict(), True, MICRO_BATCH)]
    check(spawn(run, 1, layouts), layouts)


def test_streamed_reference_equals_the_resident_one_at_tp2_pp2_and_vpp2():
    # interleaved: two chunks a rank, each streamed on its own (6 micro-batches: Megatron's
    # interleaving takes a multiple of pp)
    layouts = [(dict(tp=2), False, MICRO_BATCH), (dict(pp=2), True, MICRO_BATCH),
               (dict(pp=2, vpp=2), False, 1)]
    check(spawn(run, 2, layouts), layouts)


GPU_MODEL = dict(vocab_size=4096, hidden_size=512, ffn_hidden_size=1408, num_layers=8,
                 num_heads=8, num_kv_heads=4, head_dim=64, max_position_embeddings=64)


def run_gpu(rank, world):
    from hybridflow.models.config import ModelConfig
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.config import EngineConfig

    model = ModelConfig(**GPU_MODEL)
    full = init_full_weights(llama_param_metas(model), seed=3, std=0.02)
    resident, streamed = engines(model, TrainLayout(), EngineConfig(
        micro_batch_size=MICRO_BATCH, dtype="bf16"), full)
    weight_bytes = sum(p.numel() * p.element_size() for _, p in resident.named_local_params())
    batch = make_batch(GPU_MODEL["vocab_size"])
    expected = resident.compute_logprobs(batch)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    streamed.stream_weights()  # its weights leave the device
    left = held - torch.cuda.memory_allocated()
    streamed.compute_logprobs(batch)  # the first pass allocates what Megatron caches (RoPE)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = streamed.compute_logprobs(batch)
    torch.cuda.synchronize()
    return {"expected": expected, "got": got, "weight_bytes": weight_bytes, "left": left,
            "peak": torch.cuda.max_memory_allocated() - before,
            "before": before, "after": torch.cuda.memory_allocated()}


@pytest.mark.gpu
def test_streamed_reference_holds_two_units_on_the_gpu():
    r = spawn(run_gpu, 1, backend="nccl")[0]
    assert torch.equal(r["got"], r["expected"])
    assert r["left"] >= r["weight_bytes"], (r["left"], r["weight_bytes"])
    # 8 layers of 2.95M parameters and two tables of 2.1M at 2 bytes: 53 MiB resident; streamed,
    # the pass holds two units (at most 11.3 MiB) beside its activations and logits (< 1 MiB)
    assert r["peak"] < r["weight_bytes"] / 2, (r["peak"], r["weight_bytes"])
    assert r["after"] == r["before"], (r["before"], r["after"])
