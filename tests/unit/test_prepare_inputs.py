"""The prepare-inputs kernel (interpreted Triton on the CPU) and its torch fallback against a numpy reference, on
unpadded and padded batches, with table rows out of batch order and two KV-cache groups."""

import numpy as np
import pytest
import torch

from ember.kernels.prepare import prepare_inputs

BLOCK_SIZE = 4
NUM_TABLE_ROWS, WIDTH, MAX_BLOCKS, GROUPS = 6, 200, 50, 2


def _reference(idx, starts, qlens, token_ids, block_tables, num_rows_padded, num_tokens_padded):
    """Per-token loops in numpy: what the step's inputs must be."""
    ids, pos, slots = [], [], [[] for _ in range(GROUPS)]
    qsl, lens = [0], []
    for r in range(num_rows_padded):
        row, start, n = idx[r], starts[r], qlens[r]
        for p in range(start, start + n):
            ids.append(token_ids[row, p])
            pos.append(p)
            for g in range(GROUPS):
                slots[g].append(block_tables[g, row, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        qsl.append(qsl[-1] + n)
        lens.append(start + n)
    pad = num_tokens_padded - len(ids)
    return (np.array(ids + [0] * pad), np.array(pos + [0] * pad), np.array([s + [-1] * pad for s in slots]),
            np.array(qsl), np.array(lens), np.array(qsl[1:]) - 1)


CASES = {
    # (table rows in batch order, chunk starts, query lengths, padded rows, padded tokens)
    "unpadded_mixed": ([4, 0, 2, 5], [7, 12, 0, 9], [1, 1, 9, 3], 4, 14),
    "padded_decode": ([3, 1, 5], [20, 3, 31], [1, 1, 1], 8, 8),
    "padded_prefill_long": ([2, 0], [0, 5], [1, 150], 3, 160),   # a query over two 128-token tiles
    "single": ([1], [0], [1], 1, 1),
}


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton_interpreted", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_prepare_inputs_equals_numpy(case, use_triton):
    if use_triton:
        pytest.importorskip("triton")
    live_idx, live_starts, live_qlens, num_rows_padded, num_tokens_padded = CASES[case]
    rng = np.random.default_rng(0)
    token_ids = rng.integers(0, 1000, size=(NUM_TABLE_ROWS, WIDTH)).astype(np.int32)
    block_tables = rng.integers(1, 500, size=(GROUPS, NUM_TABLE_ROWS, MAX_BLOCKS)).astype(np.int32)
    pad = num_rows_padded - len(live_idx)
    idx = np.array(live_idx + [0] * pad)
    starts = np.array(live_starts + [0] * pad)
    qlens = np.array(live_qlens + [0] * pad)
    num_tokens = int(qlens.sum())

    def buf(n, fill, dtype):
        return torch.full((n,), fill, dtype=dtype)   # stale values: the kernel must overwrite what it owns

    qsl, lens, logits_idx = buf(num_rows_padded + 1, 77, torch.int32), buf(num_rows_padded, 77, torch.int32), \
        buf(num_rows_padded, 77, torch.int64)
    ids, pos = buf(num_tokens_padded, 77, torch.int64), buf(num_tokens_padded, 77, torch.int64)
    slots = torch.full((GROUPS, num_tokens_padded), 77, dtype=torch.int64)
    prepare_inputs(torch.from_numpy(idx), torch.from_numpy(starts), torch.from_numpy(qlens),
                   torch.from_numpy(token_ids), torch.from_numpy(block_tables), BLOCK_SIZE, num_tokens,
                   qsl, lens, logits_idx, ids, pos, slots, use_triton=use_triton)

    want_ids, want_pos, want_slots, want_qsl, want_lens, want_logits = _reference(
        idx, starts, qlens, token_ids, block_tables, num_rows_padded, num_tokens_padded)
    np.testing.assert_array_equal(ids.numpy(), want_ids)
    np.testing.assert_array_equal(pos.numpy(), want_pos)
    np.testing.assert_array_equal(slots.numpy(), want_slots)
    np.testing.assert_array_equal(qsl.numpy(), want_qsl)
    np.testing.assert_array_equal(lens.numpy(), want_lens)
    np.testing.assert_array_equal(logits_idx.numpy()[:len(live_idx)], want_logits[:len(live_idx)])


def test_prepare_inputs_names_mismatched_lengths():
    z = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="disagree"):
        prepare_inputs(z, z[:2], z, torch.zeros(2, 4), torch.zeros(1, 2, 2, dtype=torch.int32), 4, 0,
                       torch.zeros(4, dtype=torch.int32), z, z, z, z, torch.zeros(1, 3, dtype=torch.int64))
