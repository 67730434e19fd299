"""Static-batch decoding on the Megatron generation model's own parameters, without Megatron's
per-step Python: a static KV cache, fixed-shape decode steps, and (on GPU) each step replayed as a
CUDA graph.

Megatron-Core's eager decode spends ~10x more host time launching kernels than the GPU spends
running them (measured on an H200: ~26 ms of host time per step against 2.7 ms of GPU time). Here
one decode step is a fixed sequence of kernels over fixed buffers, so it is captured once into a
``torch.cuda.CUDAGraph`` and replayed with a single launch. Inside a graph every kernel still
costs a few microseconds however small it is, so on GPU the step's elementwise work is fused into
three small Triton kernels (residual add + RMSNorm; RoPE + K/V cache write; SiLU(gate) * up) next
to a Triton decode attention: about 9 kernels per layer instead of ~35 (``kernels="triton"``).
``kernels="torch"`` runs the same step with torch ops and ``scaled_dot_product_attention``; it is
what the CPU uses and the fallback where Triton does not work. Prefill attends with
``scaled_dot_product_attention`` either way; with ``kernels="triton"`` its norms, RoPE, K/V cache
write and SiLU(gate) * up are the decode step's Triton kernels (over every prompt position).

What the step computes is Megatron's GPTModel at the generation layout (local spec: RMSNorm,
grouped ``linear_qkv`` = per query group [q_0 .. q_{nh/ng-1}, k, v], ``linear_fc1`` = [gate; up],
non-interleaved RoPE at the absolute cache slot, as Megatron's static inference does; the Triton
kernels round where torch's ops round), reading the parameters in place (``params`` maps Megatron
names to the live ``nn.Parameter``s; nothing is copied). Tensor parallelism: column-parallel
shards hold whole query groups, row-parallel outputs are all-reduced over ``tp_group``, the
vocabulary-parallel embedding and output layer are summed and gathered, as Megatron does.

Layout of the cache: ``[layers, 2 (k, v), batch, kv_heads, slots, head_dim]``. Prompts are
left-padded to a common width W and take slots [0, W); decode step t writes slot W + t for every
row, so the slots row b may see are the contiguous range [start_b, slot]. The torch step attends
over the first L slots with a mask (``valid`` [batch, slots]), L the step's slot rounded up to
``block`` (one graph per L, so early steps do not read the whole cache); the Triton attention
(``decode_attention``) reads exactly [start_b, slot] of each row (one graph). Queries of a KV group
attend as one block of ``heads_per_group`` rows against that group's keys, so grouped-query
attention needs no copy of K/V per head.

Stacked weights. A generation shard the 3D-HybridEngine builds from ``s`` training shards without
copying them (``plan_reshard(blocks=True)``) comes as those shards stacked: a row-parallel weight
``[s, out, in/s]`` (block j = columns j of the standard weight), ``linear_fc1`` ``[s, 2f/s, h]``
(block j = [gate_j; up_j]). The step computes with them as they are: a row-parallel product is
the sum of the ``s`` block products (as TP ranks would all-reduce them: for up to 128 rows one
batched GEMM and a sum, else ``addmm`` into one output, strided inputs and no copy), and fc1's
output, [gate_0 up_0 gate_1 up_1 ...] per token, goes to SiLU(gate) * up as ``s`` rows of
[gate_j | up_j], whose products are the standard order.

The graphs hold raw pointers to the cache, the step's input buffers and the parameters: they are
dropped when the cache is reallocated, when any parameter's storage moved (new weights loaded by
pointer swap; weights copied in place keep their graphs), and by ``release``.
"""

from __future__ import annotations

import functools
import logging
import time
from types import SimpleNamespace
from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridflow.models.config import ModelConfig

log = logging.getLogger(__name__)

KERNELS = ("auto", "torch", "triton")
PREFILL_TOKENS = 32768
"""``FastDecoder``'s default ``prefill_tokens``: most prompt tokens prefilled at once."""


def row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` for a row-parallel weight, standard ``[out, in]`` or stacked ``[s, out, in/s]``
    (the sum of the block products)."""
    if weight.dim() == 2:
        return F.linear(x, weight)
    s, out, k = weight.shape
    flat = x.reshape(-1, s * k)
    if flat.shape[0] <= 128:  # decode: one batched GEMM and a sum beat s launches (one H200)
        y = torch.bmm(flat.view(-1, s, k).transpose(0, 1), weight.transpose(1, 2)).sum(0)
        return y.view(*x.shape[:-1], out)
    y = flat[:, :k] @ weight[0].t()
    for j in range(1, s):
        y.addmm_(flat[:, j * k:(j + 1) * k], weight[j].t())
    return y.view(*x.shape[:-1], out)


def gate_up(x: torch.Tensor, fc1: torch.Tensor) -> torch.Tensor:
    """``x @ fc1^T`` arranged as rows of [gate | up] for ``silu_mul``: [..., 2f] for a standard
    fc1 [2f, h]; for a stacked one [s, 2f/s, h], [..., s, 2f/s] (SiLU(gate) * up of it, flattened
    over the last two dims, is the standard order)."""
    if fc1.dim() == 2:
        return F.linear(x, fc1)
    s = fc1.shape[0]
    return F.linear(x, fc1.reshape(-1, fc1.shape[-1])).view(*x.shape[:-1], s, -1)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE (Megatron's ``_apply_rotary_pos_emb_bshd``, HF's rotate_half)."""
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * cos + rotated * sin


# ------------------------------------------------------------------------------ Triton kernels
@functools.cache
def _triton_kernels() -> SimpleNamespace:
    """The decode step's Triton kernels (``triton_kernels``), imported on first use."""
    # Deferred: Triton is optional, and only the Triton decode path needs it.
    import triton

    from hybridflow.rollout import triton_kernels as k

    return SimpleNamespace(attention=k.attention, add_rms_norm=k.add_rms_norm, rope_kv=k.rope_kv,
                           silu_mul=k.silu_mul, sample=k.sample,
                           next_power_of_2=triton.next_power_of_2)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     start: torch.Tensor, slot: torch.Tensor, block_n: int = 64) -> torch.Tensor:
    """One decode step of grouped-query attention over a static cache, in Triton.

    q [B, G, H, D] (H query heads per KV group), keys/values [B, G, S, D] (last dim contiguous,
    any other strides), start [B] int: row b attends to slots [start[b], slot[0]]; slot [1] int,
    read on the device (so a CUDA graph replays it with the current value). Returns [B, G, H, D]
    = softmax(q k^T / sqrt(D)) v. Rows are left-padded prompts followed by generated tokens, so
    the slots a row may see are one contiguous range, and nothing past ``slot`` is read.
    """
    k = _triton_kernels()
    b, groups, hpg, d = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("decode_attention needs keys/values with a contiguous last dim")
    k.attention[(b * groups,)](
        q, keys, values, out, start, slot, d ** -0.5,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        GROUPS=groups, HPG=hpg, M=max(16, k.next_power_of_2(hpg)), D=d,
        D_PAD=k.next_power_of_2(d), BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        num_warps=4)
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta) * weight) for x [rows, N] contiguous, in one kernel; delta
    None: (x, rms_norm(x) * weight)."""
    k = _triton_kernels()
    rows, n = x.shape
    out = torch.empty_like(x) if delta is not None else x
    h = torch.empty_like(x)
    k.add_rms_norm[(rows,)](x, delta if delta is not None else x, weight, out, h, eps, N=n,
                            BLOCK=k.next_power_of_2(n), HAS_DELTA=delta is not None,
                            num_warps=8 if n >= 4096 else 4)
    return out, h


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    """RoPE and the cache write of W positions at once: qkv [B, W, G*(H+2)*D] (Megatron's
    grouped layout, contiguous; [B, G*(H+2)*D] for one decode position) -> rotated queries
    [B, G, W*H, D], position-major in each group (for W = 1 [B, G, H, D]); the rotated keys and
    the values go to keys/values [B, G, S, D] at ``slot`` [W] (read on the device). cos/sin:
    tables [S, D] indexed by slot."""
    k = _triton_kernels()
    b = qkv.shape[0]
    w = qkv.shape[1] if qkv.dim() == 3 else 1
    groups, _, d = keys.shape[1], keys.shape[2], keys.shape[3]
    q = torch.empty(b, groups, w * heads_per_group, d, dtype=qkv.dtype, device=qkv.device)
    k.rope_kv[(b * groups, w)](qkv, cos, sin, slot, q, keys, values,
                             keys.stride(0), keys.stride(1), keys.stride(2),
                             values.stride(0), values.stride(1), values.stride(2),
                             GROUPS=groups, HPG=heads_per_group, D=d, HALF=d // 2,
                             HALF_PAD=k.next_power_of_2(d // 2), num_warps=1)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2F] = [gate | up] -> silu(gate) * up [rows, F]."""
    k = _triton_kernels()
    rows, f = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, f, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    k.silu_mul[(rows, -(-f // block))](gate_up, out, F_=f, BLOCK=block, num_warps=4)
    return out


def sample_triton(logits: torch.Tensor, noise: torch.Tensor, temperature: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature sampling in one kernel: logits [B, V] (last dim contiguous), noise [B, V]
    fp32 ~ Exp(1) -> (tokens [B] int64 = argmax(softmax(logits / T) / noise), the raw model's
    log-probs at them [B] fp32), as ``sample_tokens`` computes without top-k or top-p."""
    k = _triton_kernels()
    rows, vocab = logits.shape
    if logits.stride(-1) != 1 or not noise.is_contiguous():
        raise ValueError("sample_triton needs logits with a contiguous last dim and contiguous "
                         "noise")
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    k.sample[(rows,)](logits, noise, tokens, logprobs, 1.0 / temperature, vocab, logits.stride(0),
                      BLOCK=4096, num_warps=8)
    return tokens, logprobs


def check_triton_kernels(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run each Triton kernel once on small inputs against torch; None if all agree, else why
    not (Triton missing, no C compiler for its launcher, a wrong result...)."""
    try:
        gen = torch.Generator(device=device).manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, generator=gen, device=device).to(dtype)

        tol = 1e-4 if dtype == torch.float32 else 3e-2
        x, d, w = rand(4, 96), rand(4, 96), rand(96)
        xo, h = add_rms_norm(x, d, w, 1e-5)
        torch.testing.assert_close(xo, x + d, atol=tol, rtol=tol)
        torch.testing.assert_close(h, F.rms_norm(x + d, (96,), w, 1e-5), atol=tol, rtol=tol)
        gu = rand(3, 2 * 80)
        gate, up = gu.chunk(2, dim=-1)
        torch.testing.assert_close(silu_mul(gu), F.silu(gate) * up, atol=tol, rtol=tol)
        b, g, hpg, hd, s = 3, 2, 2, 32, 20
        qkv, cache = rand(b, g * (hpg + 2) * hd), rand(2, b, g, s, hd)
        cos, sin = rand(s, hd), rand(s, hd)
        slot, start = torch.tensor([7], device=device), torch.tensor([0, 3, 6], device=device)
        q = rope_kv_write(qkv, cos, sin, slot, cache[0], cache[1], hpg)
        parts = qkv.view(b, g, hpg + 2, hd)
        torch.testing.assert_close(q, _rotate(parts[:, :, :hpg], cos[7], sin[7]), atol=tol,
                                   rtol=tol)
        torch.testing.assert_close(cache[0, :, :, 7], _rotate(parts[:, :, hpg], cos[7], sin[7]),
                                   atol=tol, rtol=tol)
        torch.testing.assert_close(cache[1, :, :, 7], parts[:, :, hpg + 1], atol=0, rtol=0)
        slots = torch.tensor([2, 3, 4, 5, 6], device=device)  # a prefill of 5 positions
        wide = rand(b, 5, g * (hpg + 2) * hd)
        q5 = rope_kv_write(wide, cos, sin, slots, cache[0], cache[1], hpg)
        parts = wide.view(b, 5, g, hpg + 2, hd)
        rot = _rotate(parts[:, :, :, :hpg], cos[2:7, None, None], sin[2:7, None, None])
        torch.testing.assert_close(q5, rot.permute(0, 2, 1, 3, 4).reshape(b, g, 5 * hpg, hd),
                                   atol=tol, rtol=tol)
        torch.testing.assert_close(cache[0, :, :, 2:7], _rotate(
            parts[:, :, :, hpg], cos[2:7, None], sin[2:7, None]).transpose(1, 2), atol=tol,
            rtol=tol)
        torch.testing.assert_close(cache[1, :, :, 2:7], parts[:, :, :, hpg + 1].transpose(1, 2),
                                   atol=0, rtol=0)
        got = decode_attention(q, cache[0], cache[1], start.int(), slot)
        pos = torch.arange(s, device=device)
        mask = ((pos >= start[:, None]) & (pos <= 7))[:, None, None, :]
        want = F.scaled_dot_product_attention(q.float(), cache[0].float(), cache[1].float(),
                                              attn_mask=mask)
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    except Exception as e:  # noqa: BLE001 - any failure means: use the torch kernels
        return f"{type(e).__name__}: {e}"
    return None


def prefill_bytes(cfg: ModelConfig, prompts: int, width: int, tp: int, dtype_bytes: int,
                  prefill_tokens: int = PREFILL_TOKENS) -> int:
    """The most bytes ``FastDecoder.begin`` holds beyond the weights and the KV cache while it
    prefills ``prompts`` prompts left-padded to ``width`` tokens with the Triton kernels
    (``_prefill_triton``), at generation TP ``tp``, activations of ``dtype_bytes`` = B bytes.

    It prefills c = min(prompts, max(1, prefill_tokens // width)) prompts at once, t = c * width
    tokens, and keeps the logits of the last position only. Its fullest moment is the end of a
    layer, when ``_layer_tail`` writes the next norm's input and output: per token, B bytes an
    entry, the loop's residual and norm output (2h), linear_qkv's output (q + 2kv), the rotated
    queries and the attention output in the projection's layout (2q), all still referenced,
    beside the tail's projection output, residual and norm (3h), fc1's output [gate | up] (2f),
    SiLU(gate) * up (f), fc2's output (h) and the two being written (2h); and the boolean
    attention mask [c, width * heads_per_group, width]:
    ``t * B * (8h + 3q + 2kv + 3f) + c * heads_per_group * width**2``, with q = heads *
    head_dim / tp, kv = kv_heads * head_dim / tp, f = ffn_hidden_size / tp this rank's shares.
    SDPA's own buffers (the mask converted to the dtype, its output) live within the layer's
    attention, when less is held."""
    c = min(prompts, max(1, prefill_tokens // width))
    hd = cfg.head_dim
    q, kv = cfg.num_heads * hd // tp, max(1, cfg.num_kv_heads // tp) * hd
    per_token = 8 * cfg.hidden_size + 3 * q + 2 * kv + 3 * cfg.ffn_hidden_size // tp
    return c * width * dtype_bytes * per_token + c * cfg.heads_per_group * width ** 2


# ------------------------------------------------------------------------------ the decoder
class FastDecoder:
    """Prefill + fixed-shape decode steps over the parameters in ``params`` (see the module
    docstring). One decoding session at a time: ``begin`` then ``step`` per new token."""

    def __init__(self, cfg: ModelConfig, params: Mapping[str, torch.nn.Parameter], *,
                 dtype: torch.dtype, device: torch.device, inv_freq: torch.Tensor,
                 tp_group=None, cuda_graphs: bool | None = None, kernels: str = "auto",
                 block: int = 64, prefill_tokens: int = PREFILL_TOKENS):
        """``params``: Megatron name (global layer index) -> this rank's parameter, read at every
        call (so loads that swap ``param.data`` are seen). ``inv_freq``: RoPE's inverse
        frequencies [head_dim/2], Megatron's. ``tp_group``: None or a group of one for TP = 1.
        ``cuda_graphs``: default on for a CUDA device. ``kernels`` of the decode steps: "torch"
        or "triton" (see the module docstring); "auto" = triton on CUDA if its kernels pass
        ``check_triton_kernels`` there, else torch. ``block``: slots per attention bucket of
        the torch step. ``prefill_tokens``: most prompt tokens (rows x width) prefilled at once,
        bounding the prefill's activations."""
        self.cfg, self.params, self.dtype, self.device = cfg, params, dtype, torch.device(device)
        self.tp_group = tp_group
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self.groups = cfg.num_kv_heads // self.tp  # local KV groups
        self.per_group = cfg.heads_per_group
        self.vocab_local = cfg.vocab_size // self.tp
        self.inv_freq = inv_freq.detach().float().to(self.device)
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs needs a CUDA device")
        self.block, self.prefill_tokens = block, prefill_tokens
        self._layers = [self._layer_names(i) for i in range(cfg.num_layers)]
        self._out_name = ("embedding.word_embeddings.weight" if cfg.tie_embeddings
                          else "output_layer.weight")
        self.capture_seconds = 0.0  # host time spent warming up and capturing graphs, cumulative
        self._stream = None  # the side stream of every warm-up and capture
        self._warmed = False  # a capture has run: the stream's lazy state exists
        self.release()
        self._kernels = None
        self.kernels = kernels

    @staticmethod
    def _layer_names(i: int) -> dict[str, str]:
        p = f"decoder.layers.{i}."
        return dict(norm1=p + "input_layernorm.weight", qkv=p + "self_attention.linear_qkv.weight",
                    qkv_bias=p + "self_attention.linear_qkv.bias",
                    proj=p + "self_attention.linear_proj.weight",
                    norm2=p + "pre_mlp_layernorm.weight", fc1=p + "mlp.linear_fc1.weight",
                    fc2=p + "mlp.linear_fc2.weight")

    # ------------------------------------------------------------------------------ state
    @property
    def kernels(self) -> str:
        """The decode steps' kernels, "torch" or "triton"; setting it drops the graphs."""
        return self._kernels

    @kernels.setter
    def kernels(self, name: str) -> None:
        if name not in KERNELS:
            raise ValueError(f"kernels={name!r}: one of {KERNELS}")
        if name == "auto":
            name = "torch"
            if self.device.type == "cuda":
                why = check_triton_kernels(self.device, self.dtype)
                if why is None:
                    name = "triton"
                else:
                    log.warning("FastDecoder: Triton kernels unavailable (%s); decoding with "
                                "torch ops", why)
        if name != self._kernels:
            self._graphs, self._pool = {}, None
        self._kernels = name

    def release(self) -> None:
        """Free the KV cache, the step buffers and the graphs."""
        self._cache = self._valid = self._tok = self._slot = self._start = None
        self._cos = self._sin = None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._ptrs = None
        self._next = 0

    def _weight_ptrs(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.params.values())

    def _ensure_cache(self, rows: int, slots: int) -> None:
        """A cache for ``rows`` rows and at least ``slots`` slots; the old one if it fits."""
        c = self._cache
        if c is not None and c.shape[2] == rows and c.shape[4] >= slots:
            return
        self.release()
        slots = -(-slots // self.block) * self.block
        cfg = self.cfg
        # Zeros, not empty: masked slots get weight 0, and 0 * NaN from stale memory is NaN.
        self._cache = torch.zeros(cfg.num_layers, 2, rows, self.groups, slots, cfg.head_dim,
                                  dtype=self.dtype, device=self.device)
        self._valid = torch.zeros(rows, slots, dtype=torch.bool, device=self.device)
        self._tok = torch.zeros(rows, dtype=torch.long, device=self.device)
        self._slot = torch.zeros(1, dtype=torch.long, device=self.device)
        self._start = torch.zeros(rows, dtype=torch.int32, device=self.device)
        # Megatron: freqs in fp32 at positions 0.., cos/sin cast to the activations' dtype.
        pos = torch.arange(slots, dtype=torch.float32, device=self.device)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    # ------------------------------------------------------------------------------ model
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.params["embedding.word_embeddings.weight"]
        if self.tp == 1:
            return F.embedding(ids, table)
        # Vocabulary-parallel: each rank looks up its rows, zeros elsewhere, summed over TP.
        local = ids - self.tp_rank * self.vocab_local
        outside = (local < 0) | (local >= self.vocab_local)
        x = F.embedding(local.masked_fill(outside, 0), table)
        return self._all_reduce(x.masked_fill(outside[..., None], 0))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.params[self._out_name])  # [B, V/tp]
        if self.tp == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp)]
        dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def _forward(self, ids: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, attend: int,
                 rows: slice) -> torch.Tensor:
        """torch ops: logits [b, V] at the last of the W positions ``ids`` [b, W] of cache rows
        ``rows``, which take slots ``index`` [W] (their K/V are written there first); queries
        attend over slots [0, attend) where ``mask`` [b, 1, W*heads_per_group or 1, attend]
        (True = may attend) allows."""
        cfg, p = self.cfg, self.params
        b, w = ids.shape
        g, hpg, hd, eps = self.groups, self.per_group, cfg.head_dim, cfg.rms_norm_eps
        cos = self._cos.index_select(0, index)[None, :, None, :]  # [1, W, 1, hd]
        sin = self._sin.index_select(0, index)[None, :, None, :]
        x = self._embed(ids)
        for layer, names in enumerate(self._layers):
            h = F.rms_norm(x, (cfg.hidden_size,), p[names["norm1"]], eps)
            qkv = F.linear(h, p[names["qkv"]], p.get(names["qkv_bias"]))
            qkv = qkv.view(b, w, g, hpg + 2, hd)
            q = _rotate(qkv[:, :, :, :hpg], cos[..., None, :], sin[..., None, :])
            k = _rotate(qkv[:, :, :, hpg], cos, sin)  # [b, W, g, hd]
            keys, values = self._cache[layer, 0, rows], self._cache[layer, 1, rows]
            keys.index_copy_(2, index, k.transpose(1, 2))
            values.index_copy_(2, index, qkv[:, :, :, hpg + 1].transpose(1, 2))
            # [b, g, W*hpg, hd]: a group's queries, position-major, against the group's keys.
            q = q.permute(0, 2, 1, 3, 4).reshape(b, g, w * hpg, hd)
            o = F.scaled_dot_product_attention(q, keys[:, :, :attend], values[:, :, :attend],
                                               attn_mask=mask)
            o = o.view(b, g, w, hpg, hd).permute(0, 2, 1, 3, 4).reshape(b, w, g * hpg * hd)
            x = x + self._all_reduce(row_linear(o, p[names["proj"]]))
            h = F.rms_norm(x, (cfg.hidden_size,), p[names["norm2"]], eps)
            gate, up = gate_up(h, p[names["fc1"]]).chunk(2, dim=-1)
            act = (F.silu(gate) * up).flatten(-2) if gate.dim() > h.dim() else F.silu(gate) * up
            x = x + self._all_reduce(row_linear(act, p[names["fc2"]]))
        x = F.rms_norm(x[:, -1], (cfg.hidden_size,), p["decoder.final_layernorm.weight"], eps)
        return self._logits(x)

    def _prefill_triton(self, ids: torch.Tensor, index: torch.Tensor, mask: torch.Tensor,
                        attend: int, rows: slice) -> torch.Tensor:
        """``_forward``'s prefill with the decode step's Triton kernels around the same GEMMs and
        attention: residual adds fused into the norms, RoPE and the K/V cache write in one
        kernel that also lays the queries out for attention, SiLU(gate) * up in one (the torch
        ops take ~10 elementwise passes a layer, each a kernel). Same arguments and result."""
        cfg, p = self.cfg, self.params
        b, w = ids.shape
        g, hpg, eps = self.groups, self.per_group, cfg.rms_norm_eps
        x, h = add_rms_norm(self._embed(ids).view(b * w, -1), None,
                            p[self._layers[0]["norm1"]], eps)
        for layer, names in enumerate(self._layers):
            keys, values = self._cache[layer, 0, rows], self._cache[layer, 1, rows]
            qkv = F.linear(h, p[names["qkv"]], p.get(names["qkv_bias"])).view(b, w, -1)
            q = rope_kv_write(qkv, self._cos, self._sin, index, keys, values, hpg)
            o = F.scaled_dot_product_attention(q, keys[:, :, :attend], values[:, :, :attend],
                                               attn_mask=mask)
            o = o.view(b, g, w, hpg, -1).permute(0, 2, 1, 3, 4).reshape(b * w, -1)
            x, h = self._layer_tail(layer, names, x, o)
        return self._logits(h.view(b, w, -1)[:, -1])

    def _layer_tail(self, layer: int, names: dict[str, str], x: torch.Tensor, o: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer after its attention, with the Triton kernels: the output projection of ``o``
        [rows, heads * head_dim] added into the residual ``x`` [rows, hidden] by the MLP's norm,
        the SwiGLU MLP, its output added by the next norm (the next layer's input norm, or the
        final one). Returns (the residual, the next norm's output)."""
        p, eps = self.params, self.cfg.rms_norm_eps
        attn = self._all_reduce(row_linear(o, p[names["proj"]]))
        x, h = add_rms_norm(x, attn, p[names["norm2"]], eps)
        gu = gate_up(h, p[names["fc1"]])
        act = silu_mul(gu.reshape(-1, gu.shape[-1])).view(h.shape[0], -1)
        mlp = self._all_reduce(row_linear(act, p[names["fc2"]]))
        nxt = (self._layers[layer + 1]["norm1"] if layer + 1 < len(self._layers)
               else "decoder.final_layernorm.weight")
        return add_rms_norm(x, mlp, p[nxt], eps)

    def _forward_triton(self) -> torch.Tensor:
        """The decode step with the Triton kernels: logits [B, V] of the tokens in ``_tok`` at
        slot ``_slot``. Each residual add is fused into the next norm."""
        cfg, p = self.cfg, self.params
        hpg, eps = self.per_group, cfg.rms_norm_eps
        x = self._embed(self._tok)  # [B, hidden]
        x, h = add_rms_norm(x, None, p[self._layers[0]["norm1"]], eps)
        for layer, names in enumerate(self._layers):
            keys, values = self._cache[layer, 0], self._cache[layer, 1]
            qkv = F.linear(h, p[names["qkv"]], p.get(names["qkv_bias"]))
            q = rope_kv_write(qkv, self._cos, self._sin, self._slot, keys, values, hpg)
            o = decode_attention(q, keys, values, self._start, self._slot)
            x, h = self._layer_tail(layer, names, x, o.view(o.shape[0], -1))
        return self._logits(h)

    # ------------------------------------------------------------------------------ decoding
    @torch.no_grad()
    def begin(self, ids: torch.Tensor, mask: torch.Tensor, steps: int, repeat: int = 1
              ) -> torch.Tensor:
        """Prefill left-padded prompts ``ids`` [U, W] (``mask`` 1 = real token, each row's real
        tokens contiguous at the right) for a session of up to ``steps`` new tokens over
        U x ``repeat`` rows, row b continuing prompt b // repeat (GRPO's samples of a prompt);
        returns the logits [U x repeat, V] of the first new token. Each prompt is prefilled
        once and its K/V copied to the other rows of its group."""
        prompts, width = ids.shape
        rows = prompts * repeat
        self._ensure_cache(rows, width + steps)
        ptrs = self._weight_ptrs()
        if ptrs != self._ptrs:  # new parameter storage: the graphs point at the old
            self._graphs, self._pool, self._ptrs = {}, None, ptrs
        valid = mask.bool()
        self._valid.zero_()
        self._valid[:, :width] = valid.repeat_interleave(repeat, dim=0)
        self._start.copy_((width - valid.sum(dim=1)).repeat_interleave(repeat))  # first real slot
        self._next = width
        index = torch.arange(width, device=self.device)
        # Causal over real keys; a padding query also sees itself, so no row is fully masked
        # (a fully masked row is NaN, and its K/V would carry the NaN to the next layer).
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        diagonal = torch.eye(width, dtype=torch.bool, device=self.device)
        chunk = max(1, self.prefill_tokens // width)
        forward = self._prefill_triton if self.kernels == "triton" else self._forward
        logits = []
        for r in range(0, prompts, chunk):
            allowed = (causal & valid[r:r + chunk, None, :]) | diagonal
            allowed = allowed.repeat_interleave(self.per_group, dim=1)[:, None]  # [b,1,W*hpg,W]
            # Prompt u's K/V go to row u * repeat, the first of its group (a strided view).
            first = slice(r * repeat, min(r + chunk, prompts) * repeat, repeat)
            logits.append(forward(ids[r:r + chunk], index, allowed, width, first))
        prompt_slots = self._cache[:, :, :, :, :width]
        for j in range(1, repeat):
            prompt_slots[:, :, j::repeat].copy_(prompt_slots[:, :, 0::repeat])
        logits = torch.cat(logits) if len(logits) > 1 else logits[0]
        return logits.repeat_interleave(repeat, dim=0) if repeat > 1 else logits

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` [B] (one per row, at the next slot); returns the next logits [B, V].
        On CUDA graphs the result is a static buffer, overwritten by the next step."""
        slot = self._next
        if slot >= self._cache.shape[4]:
            raise RuntimeError(f"decode past the {self._cache.shape[4]} cache slots begun for")
        self._next += 1
        self._tok.copy_(tokens)
        self._slot.fill_(slot)
        if self.kernels == "triton":  # reads [start, slot] whatever the bucket: one graph
            attend = self._cache.shape[4]
        else:
            attend = min(-(-(slot + 1) // self.block) * self.block, self._cache.shape[4])
        if not self.cuda_graphs:
            return self._decode_step(attend)
        if attend not in self._graphs:
            self._graphs[attend] = self._capture(attend)
        graph, logits = self._graphs[attend]
        graph.replay()
        return logits

    def _decode_step(self, attend: int) -> torch.Tensor:
        """The captured work: mark the slot valid, run one position for every row."""
        self._valid.index_fill_(1, self._slot, True)
        if self.kernels == "triton":
            return self._forward_triton()
        mask = self._valid[:, None, None, :attend]
        return self._forward(self._tok[:, None], self._slot, mask, attend, slice(None))

    def _capture(self, attend: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up and capture the step attending over ``attend`` slots, both on this decoder's
        side stream (as CUDA graphs want). The warm-up runs the real step on the current inputs;
        running it again writes the same K/V and logits, so capturing mid-session is harmless.
        It initialises what a capture cannot (cuBLAS's workspace of the stream, Triton's
        compilation of a new specialisation): twice on the decoder's first capture, once on
        later ones (after every ``sleep`` in an RL run), where only a new specialisation can be
        left. ``torch.cuda.graph`` is not used: it runs ``gc.collect()`` and ``empty_cache()``
        at every capture, which in an RL worker took longer than the capture itself."""
        start = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            for _ in range(1 if self._warmed else 2):
                self._decode_step(attend)
            self._warmed = True
            # The graphs share one pool: they run one at a time, and each one's output stays
            # referenced (below), so another capture never reuses its memory.
            graph.capture_begin(pool=self._pool)
            try:
                logits = self._decode_step(attend)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self.capture_seconds += time.perf_counter() - start
        return graph, logits
