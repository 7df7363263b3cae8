"""Unified paged attention: one kernel for mixed batches of prefills and decodes.

The same program body is compiled two ways. With NUM_SEGMENTS == 1 (the 2D kernel, grid = query blocks x KV
heads) a program owns a query block's whole KV range and writes the normalized output. With NUM_SEGMENTS > 1
(the 3D split-KV kernel, a third grid axis over segments of the KV range) it writes fp32 partial
(out, max, sum) into scratch, which the last segment program of each (request, KV head) to finish combines
(FUSED_COMBINE, counted with an atomic per pair) or `reduce_segments` combines in a second launch; that fills the
GPU when a decode batch is too small to. The segment count is the grid's third axis, a runtime value: NUM_SEGMENTS
is only the combine's tile (at least the count), so every decode bucket's 3D launch shares one compiled kernel.
A 3D launch attends a request whose visible KV range is at most `single_tiles` tiles (a runtime value, 0: none) in
its first segment program alone, which writes the normalized output as the 2D kernel does; the other segment
programs and the reduce leave that request at once.

With NEW_KV (decode launches only: one query token per request) the kernel also does the KV-cache write of the
step's new tokens: the cache holds each request's keys up to seq_len - 1, the program whose KV range ends at the
new token attends that key from the key/value inputs (registers, never the cache) and stores it at the token's slot,
so no program reads a cache entry another program of the launch writes and no separate write kernel is launched.
With ROPE as well, q and the new keys arrive as the qkv projection wrote them: each program norms (QK_NORM) and
rotates its query rows after loading them, and the program that writes a new key norms and rotates it first, so
no separate QK-norm+RoPE kernel is launched either.

A query tile packs the query heads sharing one KV head (GQA): row m is query token m // G of the block and
query head kv_head * G + m % G, so every K/V tile is loaded once for the whole group.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ember.attention_backends.triton_common.tiles import LOG2E, cdiv, kv_tile_bounds, query_block_rows
from ember.kernels.e4m3 import scale_to_e4m3, to_f16_saturated
from ember.kernels.pdl import gdc_launch_dependents, gdc_wait

from .attention_core import attend_new_key, attend_tiles, combine_segments, locate_query_block, norm_rope


# num_seqs, the step's (padded) request count, varies per step: out of the specialization key (Triton would compile
# 1 and multiples of 16 apart), as does single_tiles (a setting: 0 and 1 would compile apart); strides, window and
# scales are fixed per layer and cache
@triton.jit(do_not_specialize=["num_seqs", "single_tiles"])
def unified_attention_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, counter_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr, num_decodes_ptr,
    sinks_ptr, alibi_ptr, key_ptr, value_ptr, slot_mapping_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr,
    k_scale_ptr, v_scale_ptr, num_seqs, qk_scale, softcap, window, norm_eps, single_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ch, stride_ct, stride_bt,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    NUM_QUERIES_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, MODE: tl.constexpr, LIMIT_DECODES: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr, USE_ALIBI: tl.constexpr,
    IEEE: tl.constexpr, UNMASKED_MIDDLE: tl.constexpr, FUSED_COMBINE: tl.constexpr = False,
    NEW_KV: tl.constexpr = False, PDL: tl.constexpr = False, ROPE: tl.constexpr = False,
    QK_NORM: tl.constexpr = False, FP8_KV: tl.constexpr = 0, F16_DOT: tl.constexpr = False,
):
    # FP8_KV (an e4m3 cache, as `triton_common.kv_write` writes it): the KV head's key scale joins qk_scale, its
    # value scale multiplies the output (or the partial output) once; the new keys of NEW_KV are quantized as the
    # cache-write kernel quantizes them (2: rounded in float32 first, for the interpreter)
    # Launched as a programmatic dependent (PDL, ember.kernels.pdl), a program reads the step's metadata (query
    # starts, lengths, slots: written before the step's first layer, so complete by the time this kernel starts)
    # before it waits for the kernel before it, and only q and the new keys and values after. A program that
    # leaves early waits first all the same: the kernel after this one must not start before the one before it
    # has finished, which holds only if this kernel's completion implies that one's.
    kv_head = tl.program_id(1)
    seq, q_block, valid = locate_query_block(tl.program_id(0), query_start_loc_ptr, num_decodes_ptr, num_seqs,
                                             BLOCK_Q, MODE, LIMIT_DECODES)
    if not valid:
        if PDL:
            gdc_wait()
        return
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:  # padding request, or a block past this request's queries
        if PDL:
            gdc_wait()
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # [BLOCK_M] each: the rows' tokens, query heads, validity and positions; the block's first and last position
    token_in_seq, head, row_ok, q_pos, min_q_pos, max_q_pos = query_block_rows(
        q_block, kv_head, q_len, context_len, BLOCK_M, BLOCK_Q, NUM_QUERIES_PER_KV)

    if USE_ALIBI:
        slopes = tl.load(alibi_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    else:
        slopes = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    if USE_SINKS and NUM_SEGMENTS == 1:
        # The sink is one more logit in the denominator: start the running max at it with a running sum of 1.
        # (The 3D path adds it in the reduce instead, once per row rather than once per segment.)
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)

    lo, a, b, hi = kv_tile_bounds(min_q_pos, max_q_pos, window, TILE_N, USE_WINDOW)
    seg_lo = lo
    seg_hi = hi
    # the program writes the normalized output: always in 2D; in 3D for a request short enough for one segment
    final = True
    if NUM_SEGMENTS > 1:
        final = hi - lo <= single_tiles
        tiles_per_segment = cdiv(hi - lo, tl.num_programs(2))
        if final:
            tiles_per_segment = hi - lo
        seg_lo = lo + tl.program_id(2) * tiles_per_segment
        if seg_lo >= hi:  # segment past the sequence's end
            if PDL:
                gdc_wait()
            return
        seg_hi = tl.minimum(seg_lo + tiles_per_segment, hi)
    # the loops read cached keys [0, kv_len); segments keep the split above (the reduce recomputes it)
    kv_len = seq_len
    if NEW_KV:
        # decode: the new token (position seq_len - 1) comes from the inputs, not the cache; a slot of -1 (write
        # nothing, as the cache-write kernel) leaves the cache as it is and reads the token from there
        slot = tl.load(slot_mapping_ptr + q_start).to(tl.int64)
        has_new = slot >= 0
        kv_len = tl.where(has_new, seq_len - 1, seq_len)
        hi_cached = cdiv(kv_len, TILE_N)
        a = tl.minimum(a, hi_cached)
        b = tl.minimum(tl.maximum(kv_len // TILE_N, a), hi_cached)   # tiles before b: cached and visible to all
        hi_loop = hi_cached
    else:
        hi_loop = hi

    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if FP8_KV:
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
        qk_scale = qk_scale * k_scale
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE
    # the queries, loaded once this program is known to have keys to attend (a 3D launch's programs past the
    # sequence's end have left)
    token = (q_start + token_in_seq).to(tl.int64)
    # ROPE (HEAD_PAD == HEAD_SIZE): each channel's rotate-half partner, frequency, and the sign of its partner's term
    swap = (offs_d + HEAD_SIZE // 2) % HEAD_SIZE
    freq = offs_d % (HEAD_SIZE // 2)
    sign = tl.where(offs_d < HEAD_SIZE // 2, -1.0, 1.0)
    if ROPE:
        q_rows = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
        q = norm_rope(q_rows + offs_d[None, :], q_rows + swap[None, :], row_ok[:, None],
                      cos_ptr + token[:, None] * stride_cos + freq[None, :],
                      sin_ptr + token[:, None] * stride_sin + freq[None, :], q_norm_ptr + offs_d[None, :],
                      q_norm_ptr + swap[None, :], sign[None, :], norm_eps, HEAD_SIZE, 1, QK_NORM)
    else:
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)            # [BLOCK_M, HEAD_PAD]
    if F16_DOT:     # bfloat16 queries over an e4m3 cache: products in float16 (`fp8_f16_products`)
        q = to_f16_saturated(q)

    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_ch
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_ch
    if NEW_KV:
        # the one program whose range ends at the new token (the last segment) stores it now, its loads overlapping
        # the loops, and attends it after them. The loops never attend that cache entry (at most they load the
        # key's bytes, whose score is masked), so the order of store and loads does not matter.
        owner = has_new & (seg_hi == hi)
        new_ok = tl.where(owner, d_ok, False)   # not d_ok & owner: the interpreter makes that int32, not a mask
        src = q_start.to(tl.int64)
        k_src = key_ptr + src * stride_kt + kv_head * stride_kh
        if ROPE:
            k_new = norm_rope(k_src + offs_d, k_src + swap, new_ok, cos_ptr + src * stride_cos + freq,
                              sin_ptr + src * stride_sin + freq, k_norm_ptr + offs_d, k_norm_ptr + swap, sign,
                              norm_eps, HEAD_SIZE, 0, QK_NORM)
        else:
            k_new = tl.load(k_src + offs_d, mask=new_ok, other=0.0)
        v_new = tl.load(value_ptr + src * stride_vt + kv_head * stride_vh + offs_d, mask=new_ok, other=0.0)
        if FP8_KV:   # FP8_KV 2 (interpreted): rounded to e4m3's values in float32 first
            k_new = scale_to_e4m3(k_new, k_scale, FP8_KV == 2)
            v_new = scale_to_e4m3(v_new, v_scale, FP8_KV == 2)
        k_new = k_new.to(k_cache_ptr.dtype.element_ty)
        v_new = v_new.to(v_cache_ptr.dtype.element_ty)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + offs_d
        tl.store(k_base + dst, k_new, mask=new_ok)
        tl.store(v_base + dst, v_new, mask=new_ok)
    if UNMASKED_MIDDLE:
        # three loops: masks only on the window edge and the causal diagonal (less ALU per tile, but three
        # inlined loops raise register pressure; TileConfig.unmasked_middle picks per launch)
        acc, m_i, l_i = attend_tiles(acc, m_i, l_i, q, k_base, v_base, block_table_row,
                                     tl.maximum(lo, seg_lo), tl.minimum(a, seg_hi), q_pos, kv_len, slopes,
                                     qk_scale, softcap, window, stride_cb, stride_ct, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE,
                                     TILE_N, True, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, IEEE)
        acc, m_i, l_i = attend_tiles(acc, m_i, l_i, q, k_base, v_base, block_table_row,
                                     tl.maximum(a, seg_lo), tl.minimum(b, seg_hi), q_pos, kv_len, slopes,
                                     qk_scale, softcap, window, stride_cb, stride_ct, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE,
                                     TILE_N, False, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, IEEE)
        acc, m_i, l_i = attend_tiles(acc, m_i, l_i, q, k_base, v_base, block_table_row,
                                     tl.maximum(b, seg_lo), tl.minimum(hi_loop, seg_hi), q_pos, kv_len, slopes,
                                     qk_scale, softcap, window, stride_cb, stride_ct, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE,
                                     TILE_N, True, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, IEEE)
    else:
        acc, m_i, l_i = attend_tiles(acc, m_i, l_i, q, k_base, v_base, block_table_row, seg_lo,
                                     tl.minimum(hi_loop, seg_hi), q_pos, kv_len, slopes, qk_scale, softcap, window,
                                     stride_cb, stride_ct, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, True, USE_WINDOW,
                                     USE_SOFTCAP, USE_ALIBI, IEEE)
    if NEW_KV:
        if owner:
            acc, m_i, l_i = attend_new_key(acc, m_i, l_i, q, k_new, v_new, qk_scale, softcap, USE_SOFTCAP)
    if FP8_KV:
        acc = acc * v_scale

    if final:
        if USE_SINKS and NUM_SEGMENTS > 1:
            # the 2D path started from the sink's logit; a 3D program adds it now, as the reduce would
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            m_all = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_all)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp2(sink - m_all)
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_i[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # scratch rows are (sequence, query head, segment); the 3D path runs decodes only (one token each)
        part_row = (seq.to(tl.int64) * tl.num_programs(1) * NUM_QUERIES_PER_KV + head) * tl.num_programs(2) \
            + tl.program_id(2)
        tl.store(part_max_ptr + part_row, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part_row, l_i, mask=row_ok)
        tl.store(part_out_ptr + part_row[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        if FUSED_COMBINE:
            # the last segment program of this (request, KV head) to finish combines them all, so no reduce kernel
            # is launched: every thread's partial stores come before the count's release (barrier, then acq_rel),
            # and the last program's reads after its acquire; it leaves the counter at 0 for the next launch
            tl.debug_barrier()
            count_ptr = counter_ptr + seq.to(tl.int64) * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
            num_written = cdiv(hi - lo, tiles_per_segment)
            if arrived == num_written - 1:
                tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
                tl.debug_barrier()
                for g in tl.static_range(NUM_QUERIES_PER_KV):
                    head_g = kv_head * NUM_QUERIES_PER_KV + g
                    row0 = (seq.to(tl.int64) * tl.num_programs(1) * NUM_QUERIES_PER_KV + head_g) \
                        * tl.num_programs(2)
                    combine_segments(out_ptr + q_start.to(tl.int64) * stride_ot + head_g * stride_oh, part_out_ptr,
                                     part_max_ptr, part_sum_ptr, sinks_ptr, row0, head_g, num_written, HEAD_SIZE,
                                     HEAD_PAD, NUM_SEGMENTS, USE_SINKS)


@triton.jit(do_not_specialize=["num_seqs", "num_segments", "single_tiles"])
def reduce_segments_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, query_start_loc_ptr, seq_lens_ptr, num_decodes_ptr,
    sinks_ptr, num_seqs, num_segments, window, single_tiles, stride_ot, stride_oh,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, TILE_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    LIMIT_DECODES: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr, PDL: tl.constexpr = False,
):
    """Combine the 3D kernel's per-segment partials of one (decode request, query head) into its output row;
    num_segments (the 3D grid's third axis) <= NUM_SEGMENTS, the combine's tile. A request of at most
    `single_tiles` KV tiles was finished by the attention kernel."""
    # launched as a programmatic dependent (ember.kernels.pdl): the step's metadata before the wait, the partials
    # after it; a program that leaves early waits first (see unified_attention_kernel)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    limit = num_seqs
    if LIMIT_DECODES:
        limit = tl.load(num_decodes_ptr)
    if seq >= limit:
        if PDL:
            gdc_wait()
        return
    q_start = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == q_start:  # padding request
        if PDL:
            gdc_wait()
        return
    q_pos = tl.load(seq_lens_ptr + seq) - 1
    # the segments the attention kernel wrote: same split as there, so stale scratch is never read
    lo, a, b, hi = kv_tile_bounds(q_pos, q_pos, window, TILE_N, USE_WINDOW)
    if hi - lo <= single_tiles:
        if PDL:
            gdc_wait()
        return
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    tiles_per_segment = cdiv(hi - lo, num_segments)
    row0 = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_segments
    combine_segments(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh, part_out_ptr, part_max_ptr,
                     part_sum_ptr, sinks_ptr, row0, head, cdiv(hi - lo, tiles_per_segment), HEAD_SIZE, HEAD_PAD,
                     NUM_SEGMENTS, USE_SINKS)
