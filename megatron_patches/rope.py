"""RoPE in three kernels each way, in place of Megatron's unfused rotary embedding.

Target: megatron-core 0.16.1 (``megatron.core.models.common.embeddings.rope_utils``).

Reason: without Transformer Engine, ``apply_rotary_pos_emb`` takes its unfused path
(``_apply_rotary_pos_emb_bshd``) for the queries and the keys of every layer: ``cos`` and ``sin``
of the frequencies in fp32 and their casts, recomputed per layer, a product, ``_rotate_half``'s
chunk, negation and ``cat``, a second product, a sum, and a ``cat`` with the empty non-rotated
part -- about ten kernels each forward, as many backward, with the input kept for the backward.
Megatron calls TE's ``fused_apply_rotary_pos_emb`` instead when ``apply_rope_fusion`` is set and
that name (a module global of ``rope_utils``) is not None. This module's function stands in for
it, as ``wgrad.py`` stands in for APEX: ``cos`` and ``sin`` in the input's dtype once per
frequency tensor (the same object for every layer of a forward), then ``t * cos`` and two
``addcmul_`` on the halves; the backward is the same three kernels on the gradient and saves no
activation. The same on CPU and CUDA.

``tests/unit/test_rope_fusion.py`` fails if Megatron's dispatch text changes, and checks the
stand-in's values and gradients against Megatron's unfused function.
"""

from __future__ import annotations

import torch

from megatron_patches._source import PatchError

ENABLED = True
"""False: leave Megatron's unfused path (the tests compare the two)."""

# Megatron's dispatch to the fused function (rope_utils.apply_rotary_pos_emb)
CALL_SITE = "return fused_apply_rotary_pos_emb(t, freqs, interleaved=config.rotary_interleaved)"

_cache: list = [None, None]  # [frequency tensor, (cos, sin)]: one forward's, kept by reference


def _cos_sin(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``freqs`` in ``dtype``, computed once per frequency tensor. The cache
    holds the tensor itself, so a new tensor at a reused address is never mistaken for it."""
    hit = _cache[0] is freqs and _cache[1][0].dtype == dtype
    if not hit:
        _cache[0], _cache[1] = freqs, (torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype))
    return _cache[1]


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """``t * cos + sign * rotate_half(t) * sin`` on the last dimension's halves a, b:
    ``[a c_a - sign b s_a, b c_b + sign a s_b]`` (sign -1 is the backward's transpose)."""
    h = t.shape[-1] // 2
    out = t * cos
    out[..., :h].addcmul_(t[..., h:], sin[..., :h], value=-sign)
    out[..., h:].addcmul_(t[..., :h], sin[..., h:], value=sign)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(t, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        # d out_a = c_a d a - s_a d b, d out_b = c_b d b + s_b d a: the transpose is
        # [g_a c_a + g_b s_b, g_b c_b - g_a s_a]
        h = grad.shape[-1] // 2
        g = grad * cos
        g[..., :h].addcmul_(grad[..., h:], sin[..., h:])
        g[..., h:].addcmul_(grad[..., :h], sin[..., :h], value=-1.0)
        return g, None, None


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor,
                               interleaved: bool = False) -> torch.Tensor:
    """TE's signature: ``t`` [s, b, n, d] rotated by ``freqs`` [s, 1, 1, d] (fp32 angles),
    non-interleaved (rotate-half) RoPE over the whole head dimension."""
    if interleaved or freqs.shape[-1] != t.shape[-1]:
        raise NotImplementedError("megatron_patches.rope: rotate-half RoPE over the whole head "
                                  "dimension only (rotary_interleaved false, rotary_percent 1)")
    cos, sin = _cos_sin(freqs, t.dtype)
    return _Rope.apply(t, cos, sin)


def apply() -> bool:
    """Make this module's function Megatron's ``fused_apply_rotary_pos_emb``; returns whether
    ``apply_rope_fusion`` can be switched on (False with ``ENABLED`` False). Call before a
    TransformerConfig with ``apply_rope_fusion`` is built: its check reads the name."""
    import inspect

    from megatron.core.models.common.embeddings import rope_utils
    if CALL_SITE not in inspect.getsource(rope_utils.apply_rotary_pos_emb):
        raise PatchError("megatron.core.models.common.embeddings.rope_utils no longer calls "
                         f"{CALL_SITE!r}; megatron_patches.rope targets megatron-core 0.16.1")
    if not ENABLED:
        return False
    if rope_utils.fused_apply_rotary_pos_emb is None:  # TE's, when installed, is kept
        rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
    return True
