"""Full activation recompute (``engine.recompute``) changes where a training step's activations
come from, not what it computes: the same step with it on and off gives the same loss, grad norm
and updated weights (adapters for LoRA; fp32 on CPU: equal to 1e-6), and with it on every
transformer layer runs its forward twice per micro-batch (the forward, then again in the
backward), once with it off -- so the equality is not that of a switch doing nothing.

One process: fixed-size micro-batches (two), a token budget, the entropy in the loss, LoRA (a
frozen embedding before the checkpointed layers), a value head, bf16. Two processes: TP=2 with
sequence parallelism, TP=2 with LoRA, PP=2 (1F1B over four micro-batches), PP=2 with virtual
stages (interleaved), PP=2 split 1 + 3 layers (``last_stage_layers``), PP=2 under a token
budget. What the recompute saves is tests/unit/test_memory_terms.py's.
"""

import pytest
import torch

from hybridflow.parallel.spawn import spawn

MODEL = dict(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=4, num_heads=4,
             num_kv_heads=2, head_dim=16, max_position_embeddings=32)
PROMPT, RESPONSE = 8, 8
SPANS = [(8, 8), (1, 1), (6, 2), (2, 7), (1, 1), (1, 2), (2, 1), (1, 1)]
BUDGET = 18
# name -> (layout, engine, lora rank, head, with_entropy)
SINGLE = {"fixed": ({}, dict(micro_batch_size=4), 0, "lm", False),
          "budget": ({}, dict(max_tokens_per_micro_batch=BUDGET), 0, "lm", False),
          "entropy": ({}, dict(micro_batch_size=4), 0, "lm", True),
          "lora": ({}, dict(micro_batch_size=4), 4, "lm", False),
          "value head": ({}, dict(micro_batch_size=4), 0, "value", False),
          "bf16": ({}, dict(micro_batch_size=4, dtype="bf16"), 0, "lm", False)}
PAIR = {"tp2 sp": (dict(tp=2), dict(micro_batch_size=4, sequence_parallel=True), 0, "lm", False),
        "tp2 lora": (dict(tp=2), dict(micro_batch_size=4), 4, "lm", False),
        "pp2": (dict(pp=2), dict(micro_batch_size=2), 0, "lm", False),
        "pp2 vpp2": (dict(pp=2, vpp=2), dict(micro_batch_size=2), 0, "lm", False),
        "pp2 uneven": (dict(pp=2, last_stage_layers=3), dict(micro_batch_size=2), 0, "lm",
                       False),
        "pp2 budget": (dict(pp=2), dict(max_tokens_per_micro_batch=BUDGET), 0, "lm", False)}


def make_batch():
    from tests.distributed.update_common import spans_batch
    return spans_batch(SPANS, PROMPT, RESPONSE, MODEL["vocab_size"])


def loss_fn(out, mb):
    """A token-mean over the batch's response tokens of log-probs (or values) weighted by the
    advantages, minus the entropy where the micro-batch carries it."""
    tokens = make_batch()["response_mask"].sum()
    loss = -(out * mb["advantages"] * mb["response_mask"]).sum() / tokens
    if "entropy" in mb:
        loss = loss - 0.1 * (mb["entropy"] * mb["response_mask"]).sum() / tokens
    return loss, {}


def step(case, recompute: bool):
    """One SGD step of ``case`` on the batch: (loss, grad norm, what it trained, full, and how
    many times each layer's forward ran)."""
    from hybridflow.models.config import ModelConfig
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.config import EngineConfig, OptimConfig
    from hybridflow.training.engine import TrainEngine
    from hybridflow.training.lora import LoraConfig

    layout_kw, engine_kw, rank, head, with_entropy = case
    model = ModelConfig(**MODEL)
    engine = TrainEngine(model, TrainLayout(**layout_kw), EngineConfig(
        recompute=recompute, optim=OptimConfig(name="sgd", lr=0.5, clip_grad=0.0), **engine_kw),
        head=head, lora=LoraConfig(rank=rank) if rank else None)
    full = init_full_weights(llama_param_metas(model), seed=3, std=0.3)
    if head == "value":
        del full["output_layer.weight"]
    engine.load_full_weights(full)
    calls = []
    for chunk in engine.chunks:
        for layer in chunk.module.decoder.layers:
            calls.append(0)
            layer.register_forward_hook(
                lambda *_, i=len(calls) - 1: calls.__setitem__(i, calls[i] + 1))
    metrics = engine.train_step(make_batch(), loss_fn, with_entropy=with_entropy)
    trained = engine.full_adapters() if rank else engine.full_weights()
    return metrics["loss"], metrics["grad_norm"], trained, calls, len(
        engine._micro_batches(make_batch(), forward_only=False))


def run(rank, world, cases):
    return {name: {on: step(case, on) for on in (False, True)} for name, case in cases.items()}


@pytest.fixture(scope="module")
def single():
    return spawn(run, 1, SINGLE)


@pytest.fixture(scope="module")
def pair():
    return spawn(run, 2, PAIR)


def check(per_rank, name):
    for result in per_rank:
        (loss, norm, trained, calls, micro), (loss_r, norm_r, trained_r, calls_r, micro_r) = (
            result[name][False], result[name][True])
        assert micro == micro_r > 1  # gradients accumulate over micro-batches
        assert calls == [micro] * len(calls) and calls_r == [2 * micro] * len(calls), (calls,
                                                                                     calls_r)
        assert norm > 0
        assert loss_r == pytest.approx(loss, rel=1e-6, abs=1e-9)
        assert norm_r == pytest.approx(norm, rel=1e-6)
        for key, value in trained.items():
            torch.testing.assert_close(trained_r[key], value, rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.parametrize("name", SINGLE)
def test_one_process_recompute_changes_nothing(single, name):
    check(single, name)


@pytest.mark.parametrize("name", PAIR)
def test_two_processes_recompute_changes_nothing(pair, name):
    check(pair, name)


# On a GPU: bf16, Megatron's CUDA RNG tracker saved and restored around each recompute (the CPU
# skips it: megatron_patches), the fused SwiGLU and the weight gradients added into main_grad
# inside the recomputed layers. Small vocabulary, so that the layers' activations are most of
# the step's.
GPU_MODEL = dict(vocab_size=4096, hidden_size=1024, ffn_hidden_size=2816, num_layers=8,
                 num_heads=16, num_kv_heads=4, head_dim=64, max_position_embeddings=512)
GPU_ROWS, GPU_SEQ = 8, 256


def gpu_run(rank, world):
    """Per recompute setting, two SGD steps of one micro-batch of GPU_ROWS x GPU_SEQ tokens: the
    second's loss and grad norm, the weights after it, and the allocator's peak during it above
    what was allocated before it (the first step warms up: cuBLAS workspaces, compiled
    kernels)."""
    import gc

    from hybridflow.models.config import ModelConfig
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.config import EngineConfig, OptimConfig
    from hybridflow.training.engine import TrainEngine

    model = ModelConfig(**GPU_MODEL)
    full = init_full_weights(llama_param_metas(model), seed=3, std=0.02)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, model.vocab_size, (GPU_ROWS, GPU_SEQ), generator=g),
             "attention_mask": torch.ones(GPU_ROWS, GPU_SEQ, dtype=torch.long)}

    def loss_fn(logprobs, mb):
        return -logprobs.sum() / (GPU_ROWS * GPU_SEQ), {}

    out = {"initial": {k: v.to(torch.bfloat16).float() for k, v in full.items()}}
    for recompute in (False, True):
        engine = TrainEngine(model, TrainLayout(), EngineConfig(
            dtype="bf16", micro_batch_size=GPU_ROWS, recompute=recompute,
            optim=OptimConfig(name="sgd", lr=0.5, clip_grad=0.0)))
        engine.load_full_weights(full)
        engine.train_step(batch, loss_fn)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        metrics = engine.train_step(batch, loss_fn)
        torch.cuda.synchronize()
        out[recompute] = {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                          "peak": torch.cuda.max_memory_allocated() - before,
                          "weights": {k: v.float().cpu()
                                      for k, v in engine.full_weights().items()}}
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return out


@pytest.mark.gpu
def test_on_a_gpu_recompute_changes_nothing_and_saves_what_the_estimate_says():
    from hybridflow.models.config import ModelConfig
    from hybridflow.planner.memory import checkpoint_bytes, layer_activation_bytes

    out = spawn(gpu_run, 1, backend="nccl")[0]
    off, on = out[False], out[True]
    assert on["loss"] == pytest.approx(off["loss"], rel=1e-3)
    assert on["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-2)
    # the two steps moved the weights alike: apart by a small share of how far they moved
    moved = sum((w - out["initial"][k]).norm() ** 2 for k, w in off["weights"].items()) ** 0.5
    apart = sum((on["weights"][k] - w).norm() ** 2 for k, w in off["weights"].items()) ** 0.5
    assert moved > 0 and apart < 0.02 * moved, (float(apart), float(moved))
    # the peak drops by the estimate's difference: every layer's activations and the logits
    # against the layers' inputs and the larger of one layer's and the logits (pp = 1, one
    # micro-batch, every position's logits: no response mask)
    model = ModelConfig(**GPU_MODEL)
    layer = layer_activation_bytes(model, GPU_SEQ, GPU_ROWS, 1, False, "bf16")
    logits = GPU_ROWS * GPU_SEQ * model.vocab_size * (2 + 8)  # bf16, the fp32 softmax, its grad
    kept = checkpoint_bytes(model, GPU_SEQ, GPU_ROWS, model.num_layers, 1, False, "bf16")
    want = model.num_layers * layer + logits - (kept + max(layer, logits))
    got = off["peak"] - on["peak"]
    assert abs(got / want - 1) < 0.15, (got, want, off["peak"], on["peak"])
