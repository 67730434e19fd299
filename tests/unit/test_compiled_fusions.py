"""Megatron's torch.compile'd fusions on a GPU (``hybridflow.training.model._compiled_fusions``):
SwiGLU (``bias_activation_fusion``) and the vocabulary-parallel cross entropy
(``cross_entropy_loss_fusion``, its native implementation, in bf16 only). On CPU they stay off.
With them switched on, their fused functions are the ones that run, and a training step gives
the unfused path's log-probs and gradients: to fp32's rounding in fp32; in bf16, no further from
the fp32 step than the unfused bf16 step is. That test runs wherever it is: on a GPU (Triton's
kernels, the path runs take), and on CPU, where inductor compiles the same functions to C++
(the wiring and the arithmetic; runs there keep the fusions off).
"""

import pytest
import torch

from hybridflow.models.config import ModelConfig
from hybridflow.parallel.layout import TrainLayout
from hybridflow.parallel.spawn import spawn
from hybridflow.training.config import EngineConfig
from hybridflow.training.model import transformer_config
from tests.distributed.update_common import GRAD_MODEL


def test_off_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("a CPU-only machine's configuration")
    cfg = transformer_config(ModelConfig(**GRAD_MODEL), TrainLayout(), EngineConfig())
    assert not cfg.bias_activation_fusion and not cfg.cross_entropy_loss_fusion


def run(rank, world):
    from megatron.core.fusions import fused_bias_swiglu, fused_cross_entropy
    from megatron.core.models.common.language_module import language_module
    from megatron.core.transformer import mlp

    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.training import model as model_module
    from hybridflow.training.config import OptimConfig
    from hybridflow.training.engine import TrainEngine
    from tests.distributed.update_common import weighted_logprob_batch

    calls = {"swiglu": 0, "cross_entropy": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    # the names the MLP and the language module call (imported into their modules)
    mlp.bias_swiglu_impl = counted("swiglu", fused_bias_swiglu.bias_swiglu_impl)
    language_module.fused_vocab_parallel_cross_entropy = counted(
        "cross_entropy", fused_cross_entropy.fused_vocab_parallel_cross_entropy)
    batch, loss_fn = weighted_logprob_batch()
    model = ModelConfig(**GRAD_MODEL)
    full = init_full_weights(llama_param_metas(model), seed=3, std=0.3)
    out = {}
    for dtype in ("fp32", "bf16"):
        for fused in (False, True):
            model_module._compiled_fusions = lambda: fused
            before = dict(calls)
            engine = TrainEngine(model, TrainLayout(), EngineConfig(
                micro_batch_size=2, dtype=dtype, optim=OptimConfig(name="sgd", clip_grad=0.0)))
            engine.load_full_weights(full)
            logprobs = engine.compute_logprobs(batch).float().cpu()
            engine.train_step(batch, loss_fn)
            out[dtype, fused] = {
                "config": (engine.tf_config.bias_activation_fusion,
                           engine.tf_config.cross_entropy_loss_fusion),
                "calls": {k: calls[k] - before[k] for k in calls}, "logprobs": logprobs,
                "grads": {n: w.main_grad.float().cpu() for n, w in engine.named_local_params()}}
    return out


def relative_errors(a, b):
    """Per parameter, ||a - b|| / ||b|| of two runs' gradients."""
    return {n: float((a["grads"][n] - g).norm() / max(g.norm(), 1e-12))
            for n, g in b["grads"].items()}


def test_fused_equals_unfused():
    out = spawn(run, 1, backend="nccl" if torch.cuda.is_available() else "gloo")[0]
    # each layer's MLP and the loss, in the forward-only pass and the training step (2
    # micro-batches each); the fused cross entropy only in bf16 (its gradient comes out bf16)
    swiglu, cross_entropy = 2 * 2 * GRAD_MODEL["num_layers"], 2 * 2
    assert out["fp32", False]["calls"] == out["bf16", False]["calls"] == {
        "swiglu": 0, "cross_entropy": 0}
    assert out["fp32", True]["config"] == (True, False)
    assert out["fp32", True]["calls"] == {"swiglu": swiglu, "cross_entropy": 0}
    assert out["bf16", True]["config"] == (True, True)
    assert out["bf16", True]["calls"] == {"swiglu": swiglu, "cross_entropy": cross_entropy}
    # fp32: the same arithmetic in fewer kernels
    reference = out["fp32", False]
    torch.testing.assert_close(out["fp32", True]["logprobs"], reference["logprobs"])
    assert max(relative_errors(out["fp32", True], reference).values()) < 1e-4
    # bf16: each path rounds differently (the fused SwiGLU and cross entropy round once where
    # the unfused ops round after each), so each is compared with the fp32 run: the fused path
    # no further from it than the unfused one, but for noise. A wrong fusion (gate and up
    # swapped, a lost gradient) is off by its whole size.
    fused, plain = (relative_errors(out["bf16", f], reference) for f in (True, False))
    for name, error in fused.items():
        assert error < 1.5 * plain[name] + 0.01, (name, error, plain[name])
    for f in (True, False):
        torch.testing.assert_close(out["bf16", f]["logprobs"], reference["logprobs"],
                                   atol=0.1, rtol=0.05)
