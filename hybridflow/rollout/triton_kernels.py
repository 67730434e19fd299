"""The fast decoder's Triton kernels (``hybridflow.rollout.fast_decode`` launches them and says
what each computes). A module of their own so that Triton, which is optional, is imported only
when the decoder first launches one: ``fast_decode`` imports this module lazily.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attention(q_ptr, k_ptr, v_ptr, o_ptr, start_ptr, slot_ptr, scale,
              sq_b, sq_g, sq_h, sk_b, sk_g, sk_s, sv_b, sv_g, sv_s, so_b, so_g, so_h,
              GROUPS: tl.constexpr, HPG: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
              D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    # One program per (row, KV group): its HPG queries (padded to M rows, as tl.dot wants
    # 16) against the group's keys in [start, slot], with an online softmax.
    pid = tl.program_id(0)
    b = (pid // GROUPS).to(tl.int64)  # int64: b * stride passes 2**31 in large caches
    g = pid % GROUPS
    start = tl.load(start_ptr + b).to(tl.int32)
    end = tl.load(slot_ptr).to(tl.int32) + 1
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


@triton.jit
def add_rms_norm(x_ptr, d_ptr, w_ptr, xo_ptr, h_ptr, eps, N: tl.constexpr,
                 BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr):
    # One program per row: x + delta (rounded, as torch's add), then torch's rms_norm:
    # normalise in fp32, round, times the weight, round.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * N + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(xo_ptr.dtype.element_ty)
        tl.store(xo_ptr + row * N + cols, x, mask=ok)
    xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    y = (xf * r).to(h_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(h_ptr + row * N + cols, (y * w).to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def rope_kv(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
            sk_b, sk_g, sk_s, sv_b, sv_g, sv_s,
            GROUPS: tl.constexpr, HPG: tl.constexpr, D: tl.constexpr,
            HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    # One program per (row, KV group, position w of the W in qkv): rotate the group's
    # queries into q, rotate its key into the cache at slot[w], copy its value there. Each
    # product and the sum are rounded, as torch computes t * cos + rotate_half(t) * sin.
    pid = tl.program_id(0)
    w = tl.program_id(1).to(tl.int64)
    W = tl.num_programs(1)
    b = (pid // GROUPS).to(tl.int64)
    g = pid % GROUPS
    slot = tl.load(slot_ptr + w)
    j = tl.arange(0, HALF_PAD)
    ok = j < HALF
    c1 = tl.load(cos_ptr + slot * D + j, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + slot * D + HALF + j, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + slot * D + j, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + slot * D + HALF + j, mask=ok, other=0.0).to(tl.float32)
    base = qkv_ptr + ((b * W + w) * GROUPS + g) * (HPG + 2) * D
    dt = q_ptr.dtype.element_ty
    for h in tl.static_range(HPG + 1):
        x1 = tl.load(base + h * D + j, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(base + h * D + HALF + j, mask=ok, other=0.0).to(tl.float32)
        o1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
        if h < HPG:
            out = q_ptr + (((b * GROUPS + g) * W + w) * HPG + h) * D
        else:
            out = k_ptr + b * sk_b + g * sk_g + slot * sk_s
        tl.store(out + j, o1, mask=ok)
        tl.store(out + HALF + j, o2, mask=ok)
    v_out = v_ptr + b * sv_b + g * sv_g + slot * sv_s
    v_in = base + (HPG + 1) * D
    tl.store(v_out + j, tl.load(v_in + j, mask=ok, other=0.0), mask=ok)
    tl.store(v_out + HALF + j, tl.load(v_in + HALF + j, mask=ok, other=0.0), mask=ok)


@triton.jit
def silu_mul(gu_ptr, o_ptr, F_: tl.constexpr, BLOCK: tl.constexpr):
    # [rows, 2F] = [gate | up] -> silu(gate) * up, rounded after the silu as torch does.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F_
    gate = tl.load(gu_ptr + row * 2 * F_ + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * 2 * F_ + F_ + cols, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(o_ptr.dtype.element_ty).to(tl.float32)
    tl.store(o_ptr + row * F_ + cols, (act * up).to(o_ptr.dtype.element_ty), mask=ok)


@triton.jit
def sample(l_ptr, q_ptr, tok_ptr, lp_ptr, inv_t, V, s_l, BLOCK: tl.constexpr):
    # One program per row, one pass over the vocabulary: the token argmax(p_T / q) with
    # p_T = softmax(logits / T) and q ~ Exp(1) (torch.multinomial's draw of one sample,
    # as argmax(logits / T - log q)), and the raw log-softmax at it (online logsumexp).
    row = tl.program_id(0).to(tl.int64)
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    arg = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(l_ptr + row * s_l + cols, mask=ok, other=float("-inf")).to(tl.float32)
        q = tl.load(q_ptr + row * V + cols, mask=ok, other=1.0)
        new_m = tl.maximum(m, tl.max(x, 0))
        total = total * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)
        m = new_m
        score = tl.where(ok, x * inv_t - tl.log(q), float("-inf"))
        block_best = tl.max(score, 0)
        block_arg = tl.argmax(score, 0) + start
        arg = tl.where(block_best > best, block_arg, arg)
        best = tl.maximum(best, block_best)
    chosen = tl.load(l_ptr + row * s_l + arg).to(tl.float32)
    tl.store(tok_ptr + row, arg.to(tl.int64))
    tl.store(lp_ptr + row, chosen - m - tl.log(total))
