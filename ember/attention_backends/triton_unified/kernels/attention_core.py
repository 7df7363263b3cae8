"""Device helpers shared by the 2D and 3D unified attention kernels and the segment combine.

Scores live in log2 units (multiplied by log2(e)) so the online softmax can use exp2. Masks are applied only on
the tiles that need them: the KV range of a query block is split into a masked front (sliding-window edge), an
unmasked middle (every key visible to every query of the block) and a masked back (the causal diagonal and the
sequence end). The helpers both Triton backends share (cdiv, reductions, tanh, tile bounds) are in
`triton_common.tiles`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ember.attention_backends.triton_common.tiles import LOG2E, reduce_max, reduce_sum, tanh

# How programs map to sequences (a kernel's MODE).
MODE_ALL = 0        # every request; programs are query blocks found by binary search over query_start_loc
MODE_DECODES = 1    # the leading single-token requests only; program i is request i
MODE_PREFILLS = 2   # the requests after the leading decodes; like MODE_ALL but starting at the first prefill


@triton.jit
def norm_rope(ptrs, swap_ptrs, mask, cos_ptrs, sin_ptrs, w_ptrs, w_swap_ptrs, sign, eps,
              HEAD_SIZE: tl.constexpr, AXIS: tl.constexpr, QK_NORM: tl.constexpr):
    """Heads as the model hands them to rotary: per-head RMSNorm times the weight (QK_NORM), then rotary in
    rotate-half layout, with the arithmetic and roundings of the model's ops (as ember.kernels.qk_norm_rope).

    ptrs: each element of the heads (head dimension along AXIS, the last); swap_ptrs: its rotate-half partner
    (channel d + D/2 mod D); cos_ptrs / sin_ptrs: its frequency's entry (d mod D/2) of the token's row; w_ptrs /
    w_swap_ptrs: the norm weight at d and at the partner; sign: -1 on the first half of the channels, +1 after."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    f = x.to(tl.float32)
    fs = tl.load(swap_ptrs, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        rstd = tl.math.rsqrt(tl.reduce(f * f, AXIS, tl.standard._sum_combine, keep_dims=True) / HEAD_SIZE + eps)
        f = (tl.load(w_ptrs).to(tl.float32) * (f * rstd).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
        fs = (tl.load(w_swap_ptrs).to(tl.float32) * (fs * rstd).to(x.dtype).to(tl.float32)).to(x.dtype) \
            .to(tl.float32)
    c = tl.load(cos_ptrs, mask=mask, other=0.0).to(x.dtype).to(tl.float32)
    s = tl.load(sin_ptrs, mask=mask, other=0.0).to(x.dtype).to(tl.float32)
    return ((f * c).to(x.dtype).to(tl.float32) + sign * (fs * s).to(x.dtype).to(tl.float32)).to(x.dtype)


@triton.jit
def locate_query_block(pid, query_start_loc_ptr, num_decodes_ptr, num_seqs,
                       BLOCK_Q: tl.constexpr, MODE: tl.constexpr, LIMIT_DECODES: tl.constexpr):
    """(sequence index, query block within it, valid) for program `pid`, without any host sync.

    Sequence i's query blocks are numbered from query_start_loc[i] // BLOCK_Q + i: an upper bound of the blocks
    before it, so the grid num_tokens_padded // BLOCK_Q + num_seqs always suffices and the numbering is monotone,
    which lets a binary search find the sequence of any program."""
    if MODE == 1:
        seq = pid
        block_in_seq = pid * 0
        limit = num_seqs + pid * 0
        if LIMIT_DECODES:
            limit = tl.load(num_decodes_ptr)
        valid = seq < limit
    else:
        lo = pid * 0
        if MODE == 2:
            lo = tl.load(num_decodes_ptr)
            pid = pid + tl.load(query_start_loc_ptr + lo) // BLOCK_Q + lo
        hi = num_seqs + pid * 0
        # largest i in [lo, num_seqs) with query_start_loc[i] // BLOCK_Q + i <= pid
        while hi - lo > 1:
            mid = (lo + hi) // 2
            start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            take = start <= pid
            lo = tl.where(take, mid, lo)
            hi = tl.where(take, hi, mid)
        seq = lo
        block_in_seq = pid - (tl.load(query_start_loc_ptr + lo) // BLOCK_Q + lo)
        valid = lo < num_seqs
    return seq, block_in_seq, valid


@triton.jit
def attend_tiles(acc, m_i, l_i, q, k_base, v_base, block_table_row, tile_lo, tile_hi, q_pos, seq_len,
                 slopes, qk_scale, softcap, window, stride_cb, stride_ct,
                 HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                 MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                 USE_ALIBI: tl.constexpr, IEEE: tl.constexpr):
    """Online-softmax accumulation of KV tiles [tile_lo, tile_hi) into (acc [M, HEAD_PAD], m_i [M], l_i [M]).

    q [M, HEAD_PAD]; q_pos [M] absolute positions; slopes [M] ALiBi slopes already in log2 units."""
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_PAD)
    for t in range(tile_lo, tile_hi):
        keys = t * TILE_N + offs_n                                               # [TILE_N] positions
        if MASKED:
            in_seq = keys < seq_len
            block = tl.load(block_table_row + keys // BLOCK_SIZE, mask=in_seq, other=0)
        else:
            block = tl.load(block_table_row + keys // BLOCK_SIZE)
        # Out-of-sequence keys read the null block 0 (always in bounds); their scores are masked below and their
        # values zeroed, so stale or NaN bytes there cannot leak into the output.
        kv_off = block.to(tl.int64) * stride_cb + (keys % BLOCK_SIZE) * stride_ct   # [TILE_N]
        if HEAD_PAD == HEAD_SIZE:
            k = tl.load(k_base + kv_off[None, :] + offs_d[:, None])                # [HEAD_PAD, TILE_N]
            if MASKED:
                v = tl.load(v_base + kv_off[:, None] + offs_d[None, :], mask=in_seq[:, None], other=0.0)
            else:
                v = tl.load(v_base + kv_off[:, None] + offs_d[None, :])             # [TILE_N, HEAD_PAD]
        else:
            d_ok = offs_d < HEAD_SIZE
            k = tl.load(k_base + kv_off[None, :] + offs_d[:, None], mask=d_ok[:, None], other=0.0)
            v_mask = d_ok[None, :]
            if MASKED:
                v_mask = v_mask & in_seq[:, None]
            v = tl.load(v_base + kv_off[:, None] + offs_d[None, :], mask=v_mask, other=0.0)
        # an e4m3 cache widens exactly to q's dtype (its scales are in qk_scale and applied to the output)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)                                                        # [M, TILE_N] fp32
        if USE_SOFTCAP:
            s = softcap * tanh(s * (qk_scale / softcap)) * LOG2E
        else:
            s = s * (qk_scale * LOG2E)
        if USE_ALIBI:
            s += slopes[:, None] * (keys[None, :] - q_pos[:, None]).to(tl.float32)
        if MASKED:
            visible = (keys[None, :] <= q_pos[:, None]) & in_seq[None, :]
            if USE_WINDOW:
                visible = visible & ((q_pos[:, None] - keys[None, :]) < window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, reduce_max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at 0
        else:
            m_new = tl.maximum(m_i, reduce_max(s, 1))
            m_ref = m_new
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + reduce_sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def attend_new_key(acc, m_i, l_i, q, k_new, v_new, qk_scale, softcap, USE_SOFTCAP: tl.constexpr):
    """One more key at the query's own position, from registers: the online-softmax step of `attend_tiles` for
    k_new/v_new [HEAD_PAD] (already in the cache's dtype: e4m3 over the head's scales, which qk_scale and the
    output carry, for an fp8 cache). Neither ALiBi (distance 0) nor the window or the causal mask can hide a
    token's own key, so it needs no mask."""
    s = reduce_sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1)            # [M]
    if USE_SOFTCAP:
        s = softcap * tanh(s * (qk_scale / softcap)) * LOG2E
    else:
        s = s * (qk_scale * LOG2E)
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    l_i = l_i * alpha + p
    # p rounded to q's dtype as attend_tiles' P @ V rounds it
    acc = acc * alpha[:, None] + p.to(q.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
    return acc, m_new, l_i


@triton.jit
def combine_segments(out_row_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, sinks_ptr, row0, head, num_written,
                     HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
                     USE_SINKS: tl.constexpr):
    """One (request, query head) of the 3D kernel: out_row_ptr[:HEAD_SIZE] = the combination of its partial rows
    row0 .. row0 + num_written - 1 (fp32 out [HEAD_PAD], max and sum in log2 units), plus the sink's logit.
    Partials are read past L1 (.cg): another SM of the same grid may have written them."""
    segs = tl.arange(0, NUM_SEGMENTS)
    seg_ok = segs < num_written
    row = row0 + segs                                                               # [NUM_SEGMENTS]
    m = tl.load(part_max_ptr + row, mask=seg_ok, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(part_sum_ptr + row, mask=seg_ok, other=0.0, cache_modifier=".cg")
    m_all = reduce_max(m, 0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        m_all = tl.maximum(m_all, sink)
    m_ref = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.where(seg_ok, tl.exp2(m - m_ref), 0.0)                                   # [NUM_SEGMENTS]
    denom = reduce_sum(l * w, 0)
    if USE_SINKS:
        denom += tl.exp2(sink - m_ref)
    denom = tl.where(denom == 0.0, 1.0, denom)
    offs_d = tl.arange(0, HEAD_PAD)
    acc = tl.load(part_out_ptr + row[:, None] * HEAD_PAD + offs_d[None, :], mask=seg_ok[:, None], other=0.0,
                  cache_modifier=".cg")
    o = reduce_sum(acc * w[:, None], 0) / denom                                    # [HEAD_PAD]
    tl.store(out_row_ptr + offs_d, o.to(out_row_ptr.dtype.element_ty), mask=offs_d < HEAD_SIZE)
