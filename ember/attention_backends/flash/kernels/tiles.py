"""Device functions shared by the flash prefill and decode kernels: KV tile loads from the paged cache and one
online-softmax step.

The running max and sum live in log2 units (scores scaled by log2(e)) so the softmax uses exp2. Masked scores
become NEG_BIG rather than -inf: their exp2 underflows to exactly 0 once any visible key has raised the running
max, and no `-inf - -inf` NaN can arise, so masked tiles need no extra guard.

Not tl.cdiv, tl.max, tl.sum, tl.zeros: those are @triton.jit library functions that only run in the interpreter
when it was on before `import triton`; tl.reduce with Triton's combine functions compiles to the same code.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
NEG_BIG = tl.constexpr(-1.0e6)


@triton.jit
def cdiv(a, b):
    return (a + b - 1) // b


@triton.jit
def reduce_max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def reduce_sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^{2x} + 1): saturates cleanly at +-1 and needs only exp (which the interpreter has)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def load_kv_tile(k_base, v_base, k_desc, v_desc, block_table_row, t, seq_len, kv_head, stride_cb, stride_ct,
                 NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr,
                 OFFSET_64: tl.constexpr):
    """K and V of keys [t * TILE_N, (t + 1) * TILE_N), each [TILE_N, HEAD_PAD], of one KV head.

    BLOCK_SIZE is a multiple of TILE_N, so the tile lies in one page: one block-table read per tile. With USE_TMA
    (HEAD_PAD == HEAD_SIZE) the tile is one TMA box of the cache viewed as [blocks * heads * block_size,
    head_size], a row index that fits in 32 bits; otherwise a contiguous run read with 16-byte loads. In MASKED
    tiles V rows past seq_len read as zero (stale bytes there could be NaN, and 0 * NaN would leak)."""
    tl.static_assert(BLOCK_SIZE % TILE_N == 0)
    block = tl.load(block_table_row + (t * TILE_N) // BLOCK_SIZE)
    first = (t * TILE_N) % BLOCK_SIZE
    if USE_TMA:
        row = (block * NUM_KV_HEADS + kv_head) * BLOCK_SIZE + first
        k = k_desc.load([row, 0])
        v = v_desc.load([row, 0])
    else:
        if OFFSET_64:
            block = block.to(tl.int64)
        # every key's row starts a multiple of head_size (a multiple of 8) elements in: 16-byte loads
        offs = tl.multiple_of(block * stride_cb + (first + tl.arange(0, TILE_N)) * stride_ct, 8)   # [TILE_N]
        offs_d = tl.arange(0, HEAD_PAD)
        d_ok = offs_d < HEAD_SIZE
        k = tl.load(k_base + offs[:, None] + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        v = tl.load(v_base + offs[:, None] + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    if MASKED:
        keys = t * TILE_N + tl.arange(0, TILE_N)
        v = tl.where((keys < seq_len)[:, None], v, 0.0)
    return k, v


@triton.jit
def softmax_step(acc, m_i, l_i, q, k, v, t, q_pos, window, qk_scale, softcap_log2,
                 TILE_N: tl.constexpr, MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                 IEEE: tl.constexpr):
    """Fold one KV tile into (acc [M, HEAD_PAD], m_i [M], l_i [M]); q [M, HEAD_PAD], k/v [TILE_N, HEAD_PAD].

    qk_scale: softmax scale times log2(e) (or scale / softcap with USE_SOFTCAP, softcap_log2 = softcap * log2(e)).
    Without a softcap the raw scores are scaled inside exp2's argument, one FMA per score. MASKED tiles apply
    causality (key <= q_pos) and the sliding window; unmasked tiles skip both."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))                                          # [M, TILE_N] fp32
    if USE_SOFTCAP:
        s = softcap_log2 * _tanh(s * qk_scale)
        scale = 1.0
    else:
        scale = qk_scale
    if MASKED:
        keys = t * TILE_N + tl.arange(0, TILE_N)
        visible = keys[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            visible = visible & ((q_pos[:, None] - keys[None, :]) < window)
        s = tl.where(visible, s, NEG_BIG)
    m_new = tl.maximum(m_i, reduce_max(s, 1) * scale)
    p = tl.exp2(s * scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + reduce_sum(p, 1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def kv_tile_range(min_q_pos, max_q_pos, window, TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr):
    """Tiles (lo, a, b, hi) a block of queries at positions [min_q_pos, max_q_pos] reads: [lo, a) masked by the
    window, [a, b) visible to every query (unmasked), [b, hi) masked by causality.

    hi stops at the last tile the latest query can see; with a window (HF semantics: key j visible to query i iff
    i - window < j <= i) lo starts at the first tile the earliest query can see."""
    hi = cdiv(max_q_pos + 1, TILE_N)
    lo = min_q_pos * 0
    a = lo
    if USE_WINDOW:
        lo = tl.maximum(min_q_pos - window + 1, 0) // TILE_N
        a = tl.minimum(tl.maximum(cdiv(tl.maximum(max_q_pos - window + 1, 0), TILE_N), lo), hi)
    b = tl.minimum(tl.maximum((min_q_pos + 1) // TILE_N, a), hi)
    return lo, a, b, hi
