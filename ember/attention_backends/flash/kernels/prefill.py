"""Varlen paged prefill in the FlashAttention-2 design, tuned for Hopper.

One program is one query block of one request and one KV head. Its rows pack the G query heads that share the
KV head (row m is query token m // G and head kv_head * G + m % G), so each K/V tile feeds G heads. Programs go
heaviest first: the 1D grid is walked from the last query block (the longest causal KV range) of the last request
down to the first, KV heads innermost, so the long blocks start in the first wave and short ones fill the tail.

The KV range of a block is split into loops: tiles every query of the block sees whole run without any mask;
only the causal diagonal (and the sliding-window edge) is masked. K/V tiles come through TMA when a tile lies in
one page (block_size a multiple of the tile), else through one block-table read per page and 32-bit offsets
where the cache is small enough. Optionally the log-sum-exp of each row is written, so partial results can be
merged.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ember.attention_backends.triton_common.tiles import LOG2E, kv_tile_bounds, query_block_rows
from ember.kernels.e4m3 import to_f16_saturated

from .tiles import attend_ranges


@triton.jit
def _locate_block(v, query_start_loc_ptr, first, num_seqs, BLOCK_Q: tl.constexpr):
    """Request of virtual query block v: request i owns blocks from query_start_loc[i] // BLOCK_Q + i on (an
    upper bound of the blocks before it, so the numbering is monotone and a binary search finds it)."""
    lo = first
    hi = num_seqs + first * 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        take = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= v
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid)
    return lo, v - (tl.load(query_start_loc_ptr + lo) // BLOCK_Q + lo)


# num_seqs, the step's (padded) request count, varies per step: out of the specialization key; the rest is fixed per
# layer and cache
@triton.jit(do_not_specialize=["num_seqs"])
def flash_prefill_kernel(
    out_ptr, lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_desc, v_desc, block_table_ptr, query_start_loc_ptr,
    seq_lens_ptr, num_decodes_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
    num_seqs, qk_scale, softcap_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_cb, stride_ch, stride_ct, stride_bt,
    NUM_KV_HEADS: tl.constexpr, NUM_QUERIES_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    SKIP_DECODES: tl.constexpr, USE_TMA: tl.constexpr, OFFSET_64: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr, WRITE_LSE: tl.constexpr, IEEE: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, FP8_KV: tl.constexpr = 0, F16_DOT: tl.constexpr = False,
):
    # FP8_KV (an e4m3 cache): q stays in its dtype, the tiles widen to it; the KV head's key scale joins qk_scale
    # and its value scale multiplies the output
    pid = tl.program_id(0)
    kv_head = pid % NUM_KV_HEADS
    rank = pid // NUM_KV_HEADS
    first = pid * 0
    if SKIP_DECODES:   # the leading single-token requests belong to the decode kernel
        first = tl.load(num_decodes_ptr)
    if first >= num_seqs:
        return
    v = tl.load(query_start_loc_ptr + num_seqs) // BLOCK_Q + num_seqs - 1 - rank   # heaviest first
    if v < tl.load(query_start_loc_ptr + first) // BLOCK_Q + first:
        return
    seq, q_block = _locate_block(v, query_start_loc_ptr, first, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:   # padding request, or a virtual block past this request's queries
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # [BLOCK_M] each: the rows' tokens, query heads, validity and positions; the block's first and last position
    token_in_seq, head, row_ok, q_pos, min_q_pos, max_q_pos = query_block_rows(
        q_block, kv_head, q_len, context_len, BLOCK_M, BLOCK_Q, NUM_QUERIES_PER_KV)

    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE
    token = (q_start + token_in_seq).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)                 # [BLOCK_M, HEAD_PAD]
    if FP8_KV:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
        if F16_DOT:     # bfloat16 queries over an e4m3 cache: products in float16 (`fp8_f16_products`)
            q = to_f16_saturated(q)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)

    acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    if USE_SINKS:   # the sink is one more logit in the denominator: a running max at it, with a sum of 1
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)

    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    lo, a, b, hi = kv_tile_bounds(min_q_pos, max_q_pos, window, TILE_N, USE_WINDOW)
    acc, m_i, l_i = attend_ranges(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, block_table_row, lo, a, b, b,
                                  hi, seq_len, kv_head, q_pos, window, qk_scale, softcap_log2, stride_cb, stride_ct,
                                  NUM_KV_HEADS, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, USE_TMA, OFFSET_64,
                                  USE_WINDOW, USE_SOFTCAP, IEEE, WARP_SPECIALIZE)

    if FP8_KV:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    o = acc / l_i[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:   # natural-log log-sum-exp of each row's scores (sink included)
        lse = (m_i + tl.log2(l_i)) / LOG2E
        tl.store(lse_ptr + token * stride_lt + head, lse, mask=row_ok)
