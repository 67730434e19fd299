"""hybridflow.training.norm: the engine's RMSNorm is torch's, numerically, in every norm slot of
the block spec, its weight flagged for sequence parallelism as the config says; on a GPU too
(bf16, built under CUDA from the spec with sequence parallelism on).

Megatron's own local norm (WrappedTorchNorm) is the reference where it runs: without sequence
parallelism. tests/distributed/test_module_origin.py checks the built engine and rollout.
"""

import pytest
import torch

from hybridflow.models.config import ModelConfig
from hybridflow.parallel.layout import TrainLayout
from hybridflow.training.config import EngineConfig
from hybridflow.training.model import block_spec, transformer_config
from hybridflow.training.norm import RMSNorm

MODEL = ModelConfig(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=32,
                    rms_norm_eps=1e-5)


def config(tp=1, sp=False, dtype="fp32"):
    return transformer_config(MODEL, TrainLayout(tp=tp),
                              EngineConfig(sequence_parallel=sp, dtype=dtype))


def norm_slots(block):
    """The norm slots of a block spec: each layer's two and the final one."""
    layers = [spec.submodules for spec in block.layer_specs]
    return ([s.input_layernorm for s in layers] + [s.pre_mlp_layernorm for s in layers]
            + [block.layer_norm])


def build(slot, cfg):
    from megatron.core.transformer.spec_utils import build_module
    return build_module(slot, config=cfg, hidden_size=cfg.hidden_size, eps=cfg.layernorm_epsilon)


def out_and_grads(norm, x, dy):
    """The norm's output at ``x`` and the gradients of <output, dy> for x and the weight."""
    x = x.detach().clone().requires_grad_()
    y = norm(x)
    y.backward(dy)
    return y.detach(), x.grad, norm.weight.grad


def test_every_norm_slot_of_the_spec_is_ours():
    from megatron.core.transformer.identity_op import IdentityOp
    block = block_spec(config(), vp_stage=None, pp_rank=0, sdpa=True)
    assert len(block.layer_specs) == MODEL.num_layers
    assert norm_slots(block) == [RMSNorm] * (2 * MODEL.num_layers + 1)
    attention = block.layer_specs[0].submodules.self_attention.submodules
    assert attention.q_layernorm is IdentityOp and attention.k_layernorm is IdentityOp


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_equals_megatrons_local_norm_and_torchs(dtype):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    cfg = config(dtype=dtype)
    g = torch.Generator().manual_seed(0)
    weight = 1 + 0.3 * torch.randn(MODEL.hidden_size, generator=g)
    x = 3 * torch.randn(5, 2, MODEL.hidden_size, generator=g).to(cfg.params_dtype)
    dy = torch.randn(x.shape, generator=g).to(cfg.params_dtype)
    ours = RMSNorm(cfg, MODEL.hidden_size, eps=cfg.layernorm_epsilon)
    # Megatron's: torch's RMSNorm built in fp32, cast as the engine casts its chunks
    megatron = WrappedTorchNorm(cfg, MODEL.hidden_size, eps=cfg.layernorm_epsilon)
    plain = torch.nn.RMSNorm(MODEL.hidden_size, eps=MODEL.rms_norm_eps)
    results = []
    for norm in (ours, megatron.to(cfg.params_dtype), plain.to(cfg.params_dtype)):
        with torch.no_grad():
            norm.weight.copy_(weight)
        results.append(out_and_grads(norm, x, dy))
    assert ours.weight.dtype == cfg.params_dtype and ours.eps == MODEL.rms_norm_eps
    for other in results[1:]:
        for got, want in zip(results[0], other):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
    # and it is an RMS norm: x / rms(x) * weight
    want = x.float() * (x.float().pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt() * weight
    torch.testing.assert_close(results[0][0].float(), want, **_tolerance(cfg.params_dtype))


def _tolerance(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sp", [False, True])
def test_the_weight_is_flagged_as_the_config_says(sp):
    # finalize_model_grads all-reduces over TP the grads of params flagged sequence_parallel
    norm = RMSNorm(config(tp=2, sp=sp), MODEL.hidden_size)
    assert [p.sequence_parallel for p in norm.parameters()] == [sp]


def test_refuses_a_norm_it_does_not_implement():
    cfg = config()
    cfg.normalization = "LayerNorm"
    with pytest.raises(NotImplementedError, match="LayerNorm"):
        RMSNorm(cfg, MODEL.hidden_size)


@pytest.mark.gpu
def test_on_a_gpu_the_spec_builds_it_flagged_and_it_matches_torch_in_bf16():
    # TP=1 engines refuse sequence parallelism: the config says TP=2, the norms are built alone.
    cfg = config(tp=2, sp=True, dtype="bf16")
    assert cfg.sequence_parallel and not cfg.use_cpu_initialization
    g = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(6, 2, MODEL.hidden_size, generator=g)
    dy = torch.randn(x.shape, generator=g)
    weight = 1 + 0.3 * torch.randn(MODEL.hidden_size, generator=g)
    block = block_spec(cfg, vp_stage=None, pp_rank=0, sdpa=True)
    layer = block.layer_specs[0].submodules
    for slot in (layer.input_layernorm, layer.pre_mlp_layernorm, block.layer_norm):
        norm = build(slot, cfg)
        assert type(norm) is RMSNorm
        assert norm.weight.is_cuda and norm.weight.dtype == torch.bfloat16
        assert norm.weight.sequence_parallel
        with torch.no_grad():
            norm.weight.copy_(weight)
        got = out_and_grads(norm, x.cuda().bfloat16(), dy.cuda().bfloat16())
        # torch's RMSNorm in fp32 on the same bf16 values
        ref = torch.nn.RMSNorm(MODEL.hidden_size, eps=cfg.layernorm_epsilon).cuda()
        with torch.no_grad():
            ref.weight.copy_(norm.weight.float())
        want = out_and_grads(ref, x.cuda().bfloat16().float(), dy.cuda().bfloat16().float())
        for a, b in zip(got, want):
            assert a.is_cuda and a.dtype == torch.bfloat16
            torch.testing.assert_close(a.float(), b, **_tolerance(torch.bfloat16))
