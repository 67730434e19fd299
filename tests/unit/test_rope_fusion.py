"""megatron_patches.rope: Megatron's fused-RoPE dispatch without Transformer Engine.

Megatron still calls ``fused_apply_rotary_pos_emb`` behind ``apply_rope_fusion`` (else apply()
raises, naming the text), and the stand-in gives the values and input gradients of Megatron's own
unfused ``_apply_rotary_pos_emb_bshd``, in fp32 and bf16, for queries and grouped keys.
"""

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from megatron_patches import rope
from megatron_patches._source import PatchError


def test_megatron_still_dispatches_to_the_fused_function(monkeypatch):
    assert rope.apply()
    assert rope_utils.fused_apply_rotary_pos_emb is not None
    monkeypatch.setattr(rope, "CALL_SITE", "return no_such_rope(t, freqs)")
    with pytest.raises(PatchError, match="no_such_rope"):
        rope.apply()


def freqs_for(seq: int, dim: int, offset: int = 0) -> torch.Tensor:
    """Megatron's RotaryEmbedding output: [s, 1, 1, d] fp32 angles, the half repeated."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    f = torch.outer(torch.arange(offset, offset + seq).float(), inv)
    return torch.cat([f, f], -1)[:, None, None, :]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 0.02)])
def test_the_stand_in_equals_megatrons_unfused_rope(dtype, tol):
    g = torch.Generator().manual_seed(0)
    freqs = freqs_for(7, 16)
    for heads in (4, 2):  # queries, grouped keys
        t = torch.randn(7, 3, heads, 16, generator=g).to(dtype).requires_grad_()
        dy = torch.randn(7, 3, heads, 16, generator=g).to(dtype)
        want = rope_utils._apply_rotary_pos_emb_bshd(t, freqs)
        (want_grad,) = torch.autograd.grad(want, t, dy)
        got = rope.fused_apply_rotary_pos_emb(t, freqs)
        (got_grad,) = torch.autograd.grad(got, t, dy)
        assert got.dtype == dtype
        # bf16: one rounding less than Megatron's three (t*cos, rot*sin, their sum): <= 1 ulp
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        torch.testing.assert_close(got_grad, want_grad, atol=tol, rtol=tol)
        assert (got - t).abs().max() > 0.1  # it did rotate


def test_a_new_frequency_tensor_is_never_served_from_the_cache():
    t = torch.randn(5, 1, 2, 8)
    first = rope.fused_apply_rotary_pos_emb(t, freqs_for(5, 8))
    shifted = freqs_for(5, 8, offset=3)
    torch.testing.assert_close(rope.fused_apply_rotary_pos_emb(t, shifted),
                               rope_utils._apply_rotary_pos_emb_bshd(t, shifted))
    assert not torch.allclose(first, rope.fused_apply_rotary_pos_emb(t, shifted))


def test_what_it_does_not_implement_is_refused():
    t = torch.randn(5, 1, 2, 8)
    with pytest.raises(NotImplementedError, match="rotary_interleaved"):
        rope.fused_apply_rotary_pos_emb(t, freqs_for(5, 8), interleaved=True)
    with pytest.raises(NotImplementedError, match="rotary_percent"):
        rope.fused_apply_rotary_pos_emb(t, freqs_for(5, 4))
