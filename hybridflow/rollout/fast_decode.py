"""Static-batch decoding on the Megatron generation model's own parameters, without Megatron's
per-step Python: a static KV cache, fixed-shape decode steps, and (on GPU) each step replayed as a
CUDA graph.

Megatron-Core's eager decode spends ~10x more host time launching kernels than the GPU spends
running them (measured on an H200: ~26 ms of host time per step against 2.7 ms of GPU time). Here
one decode step is a fixed sequence of kernels over fixed buffers, so it is captured once into a
``torch.cuda.CUDAGraph`` and replayed with a single launch.

What the step computes is Megatron's GPTModel at the generation layout (local spec: RMSNorm,
grouped ``linear_qkv`` = per query group [q_0 .. q_{nh/ng-1}, k, v], ``linear_fc1`` = [gate; up],
non-interleaved RoPE at the absolute cache slot, as Megatron's static inference does), reading the
parameters in place (``params`` maps Megatron names to the live ``nn.Parameter``s; nothing is
copied). Tensor parallelism: column-parallel shards hold whole query groups, row-parallel outputs
are all-reduced over ``tp_group``, the vocabulary-parallel embedding and output layer are summed
and gathered, as Megatron does.

Layout of the cache: ``[layers, 2 (k, v), batch, kv_heads, slots, head_dim]``. Prompts are
left-padded to a common width W and take slots [0, W); decode step t writes slot W + t for every
row. ``valid`` [batch, slots] marks the slots a row may attend to (its real prompt tokens and
everything generated). A decode step's attention either is torch's
``scaled_dot_product_attention`` over the first L slots with ``valid`` as its mask, L the step's
slot rounded up to ``block`` (one graph per L, so early steps do not read the whole cache), or
(``decode_attention``, Triton, the default on GPU) reads exactly the slots [start, slot] of each
row, which for left-padded prompts are all the slots it may see (one graph).

Queries of a KV group attend as one block of ``heads_per_group`` rows against that group's keys
(``[B, groups, heads_per_group, head_dim]`` against ``[B, groups, L, head_dim]``), so grouped-query
attention needs no copy of K/V per head.

The graphs hold raw pointers to the cache, the step's input buffers and the parameters: they are
dropped when the cache is reallocated and when any parameter's storage moved (new weights loaded
by pointer swap; weights copied in place keep their graphs), and by ``release``.
"""

from __future__ import annotations

import functools
from typing import Mapping

import torch
import torch.nn.functional as F

from hybridflow.models.config import ModelConfig

ATTENTION = ("auto", "sdpa", "triton")


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE (Megatron's ``_apply_rotary_pos_emb_bshd``, HF's rotate_half)."""
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * cos + rotated * sin


@functools.cache
def _triton_decode_kernel():
    """The Triton kernel of ``decode_attention`` (built on first use: Triton is optional)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(q_ptr, k_ptr, v_ptr, o_ptr, start_ptr, slot_ptr, scale,
               sq_b, sq_g, sq_h, sk_b, sk_g, sk_s, sv_b, sv_g, sv_s, so_b, so_g, so_h,
               GROUPS: tl.constexpr, HPG: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
               D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        # One program per (row, KV group): its HPG queries (padded to M rows, as tl.dot wants
        # 16) against the group's keys in [start, slot], with an online softmax.
        pid = tl.program_id(0)
        b = pid // GROUPS
        g = pid % GROUPS
        start = tl.load(start_ptr + b)
        end = tl.load(slot_ptr) + 1
        rows = tl.arange(0, M)
        cols = tl.arange(0, D_PAD)
        row_ok = rows < HPG
        col_ok = cols < D
        q = tl.load(q_ptr + b * sq_b + g * sq_g + rows[:, None] * sq_h + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D_PAD], tl.float32)
        k_base = k_ptr + b * sk_b + g * sk_g
        v_base = v_ptr + b * sv_b + g * sv_g
        for n0 in range((start // BLOCK_N) * BLOCK_N, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            ok = (n >= start) & (n < end)
            k = tl.load(k_base + n[:, None] * sk_s + cols[None, :],
                        mask=ok[:, None] & col_ok[None, :], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(ok[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the first block holds `start`
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + n[:, None] * sv_s + cols[None, :],
                        mask=ok[:, None] & col_ok[None, :], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * so_b + g * so_g + rows[:, None] * so_h + cols[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    return kernel


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     start: torch.Tensor, slot: torch.Tensor, block_n: int = 64) -> torch.Tensor:
    """One decode step of grouped-query attention over a static cache, in Triton.

    q [B, G, H, D] (H query heads per KV group), keys/values [B, G, S, D] (last dim contiguous,
    any other strides), start [B] int: row b attends to slots [start[b], slot[0]]; slot [1] int,
    read on the device (so a CUDA graph replays it with the current value). Returns [B, G, H, D]
    = softmax(q k^T / sqrt(D)) v. Rows are left-padded prompts followed by generated tokens, so
    the slots a row may see are one contiguous range, and nothing past ``slot`` is read.
    """
    import triton

    b, groups, hpg, d = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("decode_attention needs keys/values with a contiguous last dim")
    _triton_decode_kernel()[(b * groups,)](
        q, keys, values, out, start, slot, d ** -0.5,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        GROUPS=groups, HPG=hpg, M=max(16, triton.next_power_of_2(hpg)), D=d,
        D_PAD=triton.next_power_of_2(d), BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        num_warps=4)
    return out


class FastDecoder:
    """Prefill + fixed-shape decode steps over the parameters in ``params`` (see the module
    docstring). One decoding session at a time: ``begin`` then ``step`` per new token."""

    def __init__(self, cfg: ModelConfig, params: Mapping[str, torch.nn.Parameter], *,
                 dtype: torch.dtype, device: torch.device, inv_freq: torch.Tensor,
                 tp_group=None, cuda_graphs: bool | None = None, attention: str = "auto",
                 block: int = 64, prefill_tokens: int = 32768):
        """``params``: Megatron name (global layer index) -> this rank's parameter, read at every
        call (so loads that swap ``param.data`` are seen). ``inv_freq``: RoPE's inverse
        frequencies [head_dim/2], Megatron's. ``tp_group``: None or a group of one for TP = 1.
        ``cuda_graphs``: default on for a CUDA device. ``attention`` of the decode steps: "sdpa"
        (torch's scaled_dot_product_attention with a mask, over the step's bucket of ``block``
        slots, one graph per bucket), "triton" (``decode_attention``: reads exactly the slots
        each row may see; one graph), "auto" = triton on CUDA where Triton imports, else sdpa.
        ``prefill_tokens``: most prompt tokens (rows x width) prefilled at once,
        bounding the prefill's activations."""
        import torch.distributed as dist

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
        self._attention = None
        self.attention = attention
        self._layers = [self._layer_names(i) for i in range(cfg.num_layers)]
        self._out_name = ("embedding.word_embeddings.weight" if cfg.tie_embeddings
                          else "output_layer.weight")
        self.capture_seconds = 0.0  # host time spent warming up and capturing graphs, cumulative
        self.release()

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
    def attention(self) -> str:
        """The decode steps' attention, "sdpa" or "triton"; setting it drops the graphs."""
        return self._attention

    @attention.setter
    def attention(self, name: str) -> None:
        if name not in ATTENTION:
            raise ValueError(f"attention={name!r}: one of {ATTENTION}")
        if name == "auto":
            name = "sdpa"
            if self.device.type == "cuda":
                try:
                    import triton  # noqa: F401
                    name = "triton"
                except ImportError:
                    pass
        if name != self._attention:
            self._graphs, self._pool = {}, None
        self._attention = name

    def release(self) -> None:
        """Free the KV cache, the step buffers and the graphs."""
        self._cache = self._valid = self._tok = self._slot = self._cos = self._sin = None
        self._start = None
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
            import torch.distributed as dist
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
        import torch.distributed as dist
        parts = [torch.empty_like(logits) for _ in range(self.tp)]
        dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def _forward(self, ids: torch.Tensor, index: torch.Tensor, mask: torch.Tensor | None,
                 attend: int, rows: slice) -> torch.Tensor:
        """Logits [b, V] at the last of the W positions ``ids`` [b, W] of cache rows ``rows``,
        which take slots ``index`` [W] (their K/V are written there first); queries attend over
        slots [0, attend) where ``mask`` [b, 1, W*heads_per_group or 1, attend] (True = may
        attend) allows. ``mask`` None: one decode position of every row, attending in Triton to
        the slots [start, slot] of its row."""
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
            if mask is None:
                o = decode_attention(q, keys, values, self._start, self._slot)
            else:
                o = F.scaled_dot_product_attention(q, keys[:, :, :attend],
                                                   values[:, :, :attend], attn_mask=mask)
            o = o.view(b, g, w, hpg, hd).permute(0, 2, 1, 3, 4).reshape(b, w, g * hpg * hd)
            x = x + self._all_reduce(F.linear(o, p[names["proj"]]))
            h = F.rms_norm(x, (cfg.hidden_size,), p[names["norm2"]], eps)
            gate, up = F.linear(h, p[names["fc1"]]).chunk(2, dim=-1)
            x = x + self._all_reduce(F.linear(F.silu(gate) * up, p[names["fc2"]]))
        x = F.rms_norm(x[:, -1], (cfg.hidden_size,), p["decoder.final_layernorm.weight"], eps)
        return self._logits(x)

    # ------------------------------------------------------------------------------ decoding
    @torch.no_grad()
    def begin(self, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> torch.Tensor:
        """Prefill left-padded prompts ``ids`` [B, W] (``mask`` 1 = real token) for a session of
        up to ``steps`` new tokens; returns the logits [B, V] of the first new token."""
        rows, width = ids.shape
        self._ensure_cache(rows, width + steps)
        ptrs = self._weight_ptrs()
        if ptrs != self._ptrs:  # new parameter storage: the graphs point at the old
            self._graphs, self._pool, self._ptrs = {}, None, ptrs
        valid = mask.bool()
        self._valid.zero_()
        self._valid[:, :width] = valid
        self._start.copy_(width - valid.sum(dim=1))  # left-padded: the first real slot
        self._next = width
        index = torch.arange(width, device=self.device)
        # Causal over real keys; a padding query also sees itself, so no row is fully masked
        # (a fully masked row is NaN, and its K/V would carry the NaN to the next layer).
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        diagonal = torch.eye(width, dtype=torch.bool, device=self.device)
        chunk = max(1, self.prefill_tokens // width)
        logits = []
        for r in range(0, rows, chunk):
            allowed = (causal & valid[r:r + chunk, None, :]) | diagonal
            allowed = allowed.repeat_interleave(self.per_group, dim=1)[:, None]  # [b,1,W*hpg,W]
            logits.append(self._forward(ids[r:r + chunk], index, allowed, width,
                                        slice(r, r + chunk)))
        return torch.cat(logits) if len(logits) > 1 else logits[0]

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
        attend = min(-(-(slot + 1) // self.block) * self.block, self._cache.shape[4])
        if self.attention == "triton":  # reads [start, slot] whatever the bucket: one graph
            attend = self._cache.shape[4]
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
        mask = None if self.attention == "triton" else self._valid[:, None, None, :attend]
        return self._forward(self._tok[:, None], self._slot, mask, attend, slice(None))

    def _capture(self, attend: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up (on a side stream, as CUDA graphs want) and capture the step attending over
        ``attend`` slots. The warm-up runs the real step on the current inputs; running it again
        writes the same K/V and logits, so capturing mid-session is harmless."""
        import time
        start = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._decode_step(attend)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # The graphs share one pool: they run one at a time, and each one's output stays
        # referenced (below), so another capture never reuses its memory.
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._decode_step(attend)
        self.capture_seconds += time.perf_counter() - start
        return graph, logits
