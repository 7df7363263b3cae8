"""The Triton prepare-inputs kernel (see `ember.kernels.prepare`); imported only when a step runs it."""

import triton
import triton.language as tl

from ember.kernels.precompile import launch_always


# tl.reduce with a combine function of this module, not tl.sum: the library's @triton.jit functions cannot be called
# from the interpreted copy the CPU tests run
@triton.jit
def _add(a, b):
    return a + b


# batch sizes and the upload's segment offsets change every step: keep them out of the specialization key, so one
# compiled kernel serves every step
@launch_always   # its outputs are indices: it runs in compile-only start-up steps too
@triton.jit(do_not_specialize=["idx_mapping", "starts", "query_lens", "num_rows", "num_tokens_padded"])
def prepare_inputs_kernel(idx_mapping, starts, query_lens, token_ids, token_stride, block_tables, bt_group_stride,
                          bt_row_stride, query_start_loc, seq_lens, logits_indices, input_ids, positions,
                          slot_mappings, slot_group_stride, num_rows, num_tokens_padded, block_size,
                          NUM_GROUPS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_TOKENS: tl.constexpr):
    r = tl.program_id(0)
    offs_r = tl.arange(0, BLOCK_ROWS)
    before = tl.load(query_lens + offs_r, mask=offs_r < r, other=0)
    token_start = tl.reduce(before.to(tl.int32), 0, _add)                      # tokens of the rows before r
    offs_t = tl.arange(0, BLOCK_TOKENS)
    if r == num_rows:
        # the padding tail: id 0, position 0, no KV write
        for off in range(token_start, num_tokens_padded, BLOCK_TOKENS):
            t = off + offs_t
            m = t < num_tokens_padded
            tl.store(input_ids + t, tl.full([BLOCK_TOKENS], 0, tl.int64), mask=m)
            tl.store(positions + t, tl.full([BLOCK_TOKENS], 0, tl.int64), mask=m)
            for g in tl.static_range(NUM_GROUPS):
                tl.store(slot_mappings + g * slot_group_stride + t,
                         tl.full([BLOCK_TOKENS], -1, tl.int64), mask=m)
    else:
        n = tl.load(query_lens + r).to(tl.int32)
        start = tl.load(starts + r).to(tl.int32)
        row = tl.load(idx_mapping + r).to(tl.int64)
        if r == 0:
            tl.store(query_start_loc, 0)
        tl.store(query_start_loc + r + 1, (token_start + n).to(tl.int32))
        tl.store(seq_lens + r, (start + n).to(tl.int32))
        tl.store(logits_indices + r, (token_start + n - 1).to(tl.int64))
        for off in range(0, n, BLOCK_TOKENS):
            i = off + offs_t
            m = i < n
            pos = start + i
            ids = tl.load(token_ids + row * token_stride + pos, mask=m, other=0)
            tl.store(input_ids + token_start + i, ids.to(tl.int64), mask=m)
            tl.store(positions + token_start + i, pos.to(tl.int64), mask=m)
            for g in tl.static_range(NUM_GROUPS):
                block = tl.load(block_tables + g * bt_group_stride + row * bt_row_stride + pos // block_size,
                                mask=m, other=0).to(tl.int64)
                tl.store(slot_mappings + g * slot_group_stride + token_start + i,
                         block * block_size + (pos % block_size).to(tl.int64), mask=m)

