"""Device functions shared by the flash prefill and decode kernels: KV tile loads from the paged cache and one
online-softmax step.

The running max and sum live in log2 units (scores scaled by log2(e)) so the softmax uses exp2. Masked scores
become NEG_BIG rather than -inf: their exp2 underflows to exactly 0 once any visible key has raised the running
max, and no `-inf - -inf` NaN can arise, so masked tiles need no extra guard.

The helpers both Triton backends share (cdiv, reductions, tanh, tile bounds) come from `triton_common.tiles`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ember.attention_backends.triton_common.tiles import reduce_max, reduce_sum, tanh

NEG_BIG = tl.constexpr(-1.0e6)


@triton.jit
def load_kv_tile(k_base, v_base, k_desc, v_desc, block_table_row, t, seq_len, kv_head, stride_cb, stride_ct,
                 NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr,
                 OFFSET_64: tl.constexpr):
    """K and V of keys [t * TILE_N, (t + 1) * TILE_N), each [TILE_N, HEAD_PAD], of one KV head.

    BLOCK_SIZE is a multiple of TILE_N, so the tile lies in one page: one block-table read per tile. With USE_TMA
    (HEAD_PAD == HEAD_SIZE) the tile is one TMA box of the cache viewed as [blocks * heads * block_size,
    head_size], a row index that fits in 32 bits; otherwise a contiguous run read with 16-byte loads. The tiles
    come in the cache's dtype (`_attend_tile` widens an e4m3 cache's and zeroes V rows past seq_len)."""
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
        s = softcap_log2 * tanh(s * qk_scale)
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
def attend_ranges(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, block_table_row, lo, a, b, c, hi, seq_len,
                  kv_head, q_pos, window, qk_scale, softcap_log2, stride_cb, stride_ct,
                  NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, USE_TMA: tl.constexpr, OFFSET_64: tl.constexpr,
                  USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
                  WARP_SPECIALIZE: tl.constexpr = False):
    """Fold KV tiles into (acc, m_i, l_i) in three loops: [lo, a) masked (the window's edge, only with a window),
    [a, b) unmasked (on producer/consumer warps with WARP_SPECIALIZE), [c, hi) masked (the causal diagonal)."""
    if USE_WINDOW:
        acc, m_i, l_i = _attend_loop(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, block_table_row, lo, a,
                                     seq_len, kv_head, q_pos, window, qk_scale, softcap_log2, stride_cb, stride_ct,
                                     NUM_KV_HEADS, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, True, USE_TMA, OFFSET_64,
                                     USE_WINDOW, USE_SOFTCAP, IEEE)
    acc, m_i, l_i = _attend_loop(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, block_table_row, a, b, seq_len,
                                 kv_head, q_pos, window, qk_scale, softcap_log2, stride_cb, stride_ct, NUM_KV_HEADS,
                                 HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, False, USE_TMA, OFFSET_64, USE_WINDOW,
                                 USE_SOFTCAP, IEEE, WARP_SPECIALIZE)
    return _attend_loop(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, block_table_row, c, hi, seq_len, kv_head,
                        q_pos, window, qk_scale, softcap_log2, stride_cb, stride_ct, NUM_KV_HEADS, HEAD_SIZE, HEAD_PAD,
                        BLOCK_SIZE, TILE_N, True, USE_TMA, OFFSET_64, USE_WINDOW, USE_SOFTCAP, IEEE)


@triton.jit
def _attend_loop(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, block_table_row, t_lo, t_hi, seq_len, kv_head,
                 q_pos, window, qk_scale, softcap_log2, stride_cb, stride_ct,
                 NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr,
                 OFFSET_64: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
                 WARP_SPECIALIZE: tl.constexpr = False):
    """Fold KV tiles [t_lo, t_hi), each loaded by `load_kv_tile` and folded by `softmax_step`."""
    if WARP_SPECIALIZE:
        for t in tl.range(t_lo, t_hi, warp_specialize=True):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, block_table_row, t,
                                         seq_len, kv_head, q_pos, window, qk_scale, softcap_log2, stride_cb,
                                         stride_ct, NUM_KV_HEADS, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, MASKED,
                                         USE_TMA, OFFSET_64, USE_WINDOW, USE_SOFTCAP, IEEE)
    else:
        for t in range(t_lo, t_hi):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, block_table_row, t,
                                         seq_len, kv_head, q_pos, window, qk_scale, softcap_log2, stride_cb,
                                         stride_ct, NUM_KV_HEADS, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, MASKED,
                                         USE_TMA, OFFSET_64, USE_WINDOW, USE_SOFTCAP, IEEE)
    return acc, m_i, l_i


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, block_table_row, t, seq_len, kv_head, q_pos,
                 window, qk_scale, softcap_log2, stride_cb, stride_ct,
                 NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr,
                 OFFSET_64: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    k, v = load_kv_tile(k_base, v_base, k_desc, v_desc, block_table_row, t, seq_len, kv_head, stride_cb, stride_ct,
                        NUM_KV_HEADS, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, MASKED, USE_TMA, OFFSET_64)
    # an e4m3 cache widens exactly to q's dtype (its scales are in qk_scale and applied to the output)
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    if MASKED:   # V rows past seq_len read as zero: stale bytes there could be NaN, and 0 * NaN would leak
        keys = t * TILE_N + tl.arange(0, TILE_N)
        v = tl.where((keys < seq_len)[:, None], v, 0.0)
    return softmax_step(acc, m_i, l_i, q, k, v, t, q_pos, window, qk_scale, softcap_log2, TILE_N, MASKED,
                        USE_WINDOW, USE_SOFTCAP, IEEE)
