"""Split-KV decode balanced by KV length, in three kernels: a plan, the attention, a combine.

The plan (one program, run once per step before the layers) divides the decodes' total KV tiles into work items
of `chunk` tiles, chunk = max(min_chunk, ceil(total / target_items)), so every item costs about the same whatever
the mix of lengths: a long request becomes several items, a short one a single item. It writes, per item, its
request, its chunk index and its partial-result slot (-1 when the request is a single item), plus per-request
offsets for the combine. Item count <= target_items + live decodes, so the attention grid (target_items +
decode rows) x KV heads depends only on the bucket, and items past the count exit.

The attention program of an item that is a whole request writes the normalized output directly; items of split
requests write fp32 partials (unnormalized output, max, sum in log2 units), which the combine merges. At most
2 x target_items items are split (a split request has more tiles than chunk >= total / target_items), which
bounds the scratch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ember.attention_backends.triton_common.tiles import LOG2E, cdiv, reduce_max, reduce_sum
from ember.kernels.e4m3 import to_f16_saturated
from ember.kernels.precompile import launch_always

from .tiles import attend_ranges


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _decode_tiles(seq_lens, window, TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr):
    """(first tile, tile count) a single query at position seq_len - 1 reads; 0 tiles for empty rows."""
    hi = cdiv(seq_lens, TILE_N)
    lo = seq_lens * 0
    if USE_WINDOW:
        lo = tl.maximum(seq_lens - window, 0) // TILE_N
    return lo, tl.where(seq_lens > 0, hi - lo, 0)


# the live decode count and the bucket's rows vary per step: out of the specialization key
@launch_always   # its outputs are indices: it runs in compile-only start-up steps too
@triton.jit(do_not_specialize=["num_decodes", "num_rows"])
def decode_plan_kernel(
    seq_lens_ptr, work_start_ptr, split_start_ptr, item_seq_ptr, item_chunk_ptr, item_part_ptr, params_ptr,
    num_decodes, num_rows, num_items, target_items, window,
    TILE_N: tl.constexpr, MIN_CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, USE_WINDOW: tl.constexpr,
):
    """work_start [num_rows + 1], split_start [num_rows], item_* [num_items], params [2] = (chunk, num_decodes)."""
    offs = tl.arange(0, BLOCK_R)
    total = num_decodes * 0
    for start in range(0, num_rows, BLOCK_R):
        rows = start + offs
        lens = tl.load(seq_lens_ptr + rows, mask=rows < num_decodes, other=0)
        _, tiles = _decode_tiles(lens, window, TILE_N, USE_WINDOW)
        total += reduce_sum(tiles, 0)
    chunk = tl.maximum(cdiv(total, target_items), MIN_CHUNK)
    tl.store(params_ptr, chunk)
    tl.store(params_ptr + 1, num_decodes)

    done = total * 0
    split_done = total * 0
    for start in range(0, num_rows, BLOCK_R):
        rows = start + offs
        lens = tl.load(seq_lens_ptr + rows, mask=rows < num_decodes, other=0)
        _, tiles = _decode_tiles(lens, window, TILE_N, USE_WINDOW)
        n = cdiv(tiles, chunk)                                   # items of each request
        split = tl.where(n > 1, n, 0)                            # partial slots of each request
        first_item = done + tl.associative_scan(n, 0, _add) - n
        first_part = split_done + tl.associative_scan(split, 0, _add) - split
        in_rows = rows < num_rows
        tl.store(work_start_ptr + rows, first_item, mask=in_rows)
        tl.store(split_start_ptr + rows, first_part, mask=in_rows)
        widest = reduce_max(n, 0)
        for c in range(0, widest):
            has = c < n
            tl.store(item_seq_ptr + first_item + c, rows, mask=has)
            tl.store(item_chunk_ptr + first_item + c, rows * 0 + c, mask=has)
            tl.store(item_part_ptr + first_item + c, tl.where(n > 1, first_part + c, -1), mask=has)
        done += reduce_sum(n, 0)
        split_done += reduce_sum(split, 0)
    tl.store(work_start_ptr + num_rows, done)
    for start in range(done, num_items, BLOCK_R):   # items past the count: their programs exit
        items = start + offs
        tl.store(item_seq_ptr + items, items * 0 - 1, mask=items < num_items)


@triton.jit
def flash_decode_kernel(
    out_ptr, part_out_ptr, part_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_desc, v_desc, block_table_ptr,
    query_start_loc_ptr, seq_lens_ptr, item_seq_ptr, item_chunk_ptr, item_part_ptr, params_ptr, sinks_ptr,
    k_scale_ptr, v_scale_ptr, qk_scale, softcap_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ch, stride_ct, stride_bt,
    NUM_KV_HEADS: tl.constexpr, NUM_QUERIES_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, SPLIT: tl.constexpr,
    USE_TMA: tl.constexpr, OFFSET_64: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr, IEEE: tl.constexpr, FP8_KV: tl.constexpr = 0, F16_DOT: tl.constexpr = False,
):
    """One work item (SPLIT) or one whole request (not SPLIT) of one KV head: the G query heads of that KV head
    are the tile's rows. FP8_KV (an e4m3 cache): as in the prefill kernel; partials carry the value scale too."""
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    if SPLIT:
        seq = tl.load(item_seq_ptr + item)
        if seq < 0:
            return
        c = tl.load(item_chunk_ptr + item)
        part = tl.load(item_part_ptr + item)
        chunk = tl.load(params_ptr)
    else:
        seq = item
        if seq >= tl.load(params_ptr + 1):
            return
        c = item * 0
        part = c - 1
        chunk = c
    seq_len = tl.load(seq_lens_ptr + seq)
    if seq_len == 0:   # padding row
        return
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_pos_s = seq_len - 1
    lo, num_tiles = _decode_tiles(seq_len, window, TILE_N, USE_WINDOW)
    hi = lo + num_tiles
    t0 = lo
    t1 = hi
    if SPLIT:
        t0 = lo + c * chunk
        t1 = tl.minimum(t0 + chunk, hi)

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + rows
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE
    q = tl.load(q_ptr + token * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP8_KV:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
        if F16_DOT:     # bfloat16 queries over an e4m3 cache: products in float16 (`fp8_f16_products`)
            q = to_f16_saturated(q)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)
    q_pos = rows * 0 + q_pos_s

    acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    if USE_SINKS:
        if c == 0:   # the sink joins the first item only, so merging counts it once
            m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)

    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    # unmasked middle; masked: the window's first tile and the sequence's last tile
    u1 = tl.minimum(t1, hi - 1)
    u0 = t0
    if USE_WINDOW:
        u0 = tl.where(t0 == lo, t0 + 1, t0)
        u0 = tl.minimum(u0, t1)
    acc, m_i, l_i = attend_ranges(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, block_table_row, t0, u0, u1,
                                  tl.maximum(u0, u1), t1, seq_len, kv_head, q_pos, window, qk_scale, softcap_log2,
                                  stride_cb, stride_ct, NUM_KV_HEADS, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, USE_TMA,
                                  OFFSET_64, USE_WINDOW, USE_SOFTCAP, IEEE)

    if FP8_KV:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    if part < 0:
        o = acc / l_i[:, None]
        tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # partial rows are (slot, query head); num_heads = NUM_KV_HEADS * NUM_QUERIES_PER_KV
        slot_row = part.to(tl.int64) * (NUM_KV_HEADS * NUM_QUERIES_PER_KV) + head
        tl.store(part_out_ptr + slot_row[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + slot_row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + slot_row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def decode_combine_kernel(
    out_ptr, part_out_ptr, part_ml_ptr, query_start_loc_ptr, work_start_ptr, split_start_ptr, params_ptr,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Merge the partials of one split (request, query head) into its output row; others exit at once."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    if seq >= tl.load(params_ptr + 1):
        return
    first_item = tl.load(work_start_ptr + seq)
    n = tl.load(work_start_ptr + seq + 1) - first_item
    if n <= 1:
        return
    first = tl.load(split_start_ptr + seq)
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, HEAD_PAD)
    m_all = tl.full([1], float("-inf"), dtype=tl.float32)
    l_all = tl.full([1], 0.0, dtype=tl.float32)
    acc = tl.full([HEAD_PAD], 0.0, dtype=tl.float32)
    for start in range(0, n, BLOCK_C):
        c = start + offs_c
        ok = c < n
        slot_row = (first + c).to(tl.int64) * NUM_HEADS + head                    # [BLOCK_C]
        m = tl.load(part_ml_ptr + slot_row * 2, mask=ok, other=float("-inf"))
        l = tl.load(part_ml_ptr + slot_row * 2 + 1, mask=ok, other=0.0)
        part = tl.load(part_out_ptr + slot_row[:, None] * HEAD_PAD + offs_d[None, :], mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m_all, reduce_max(m, 0))                                 # [1]
        w = tl.where(ok, tl.exp2(m - m_new), 0.0)                                   # [BLOCK_C]
        alpha = tl.exp2(m_all - m_new)
        l_all = l_all * alpha + reduce_sum(l * w, 0)
        acc = acc * alpha + reduce_sum(part * w[:, None], 0)
        m_all = m_new
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, (acc / l_all).to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_SIZE)
