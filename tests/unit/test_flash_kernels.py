"""The flash backend's kernels on the CPU (Triton interpreter) against the float32 reference, over the named table
of small batch shapes the unified backend is tested on. float16/float32 only: the interpreter's tl.dot is wrong
for bfloat16 (bfloat16 runs in tests/gpu)."""

import dataclasses

import pytest
import torch

# CPU tensors run the kernels in Triton's interpreter whatever TRITON_INTERPRET says at import time
import ember.attention_backends.flash.kernels as F
from tests.helpers.paged_batches import BatchShape, make_paged_batch, reference_output, tolerance



def _shape(name, query_lens, seq_lens, **kw):
    """A named batch in this backend's pages: 64 tokens unless the shape says otherwise."""
    return BatchShape(name, query_lens, seq_lens, **{"block_size": 64, **kw})


SHAPES = [
    _shape("small_decode", (1, 1, 1), (5, 17, 33)),
    _shape("large_decode", (1,) * 8, (3, 90, 16, 47, 64, 1, 33, 75)),
    _shape("single_long_decode", (1,), (300,)),
    _shape("small_prefill", (5, 12), (5, 12)),
    _shape("long_prefill", (150,), (150,)),
    _shape("mixed_small", (1, 1, 7, 3), (9, 20, 7, 30)),
    _shape("mixed_medium", (1, 1, 1, 40, 17, 2), (70, 3, 33, 40, 50, 18)),
    _shape("chunked_prefill_with_context", (1, 20, 33), (21, 50, 80)),
    _shape("prefix_cached", (10, 3), (42, 35)),
    _shape("sliding_window", (1, 1, 30, 9), (60, 7, 50, 40), sliding_window=16),
    _shape("softcap", (1, 12, 25), (40, 30, 25), soft_cap=2.0),
    _shape("sinks", (1, 1, 20), (50, 3, 33), sinks=True),
    _shape("all_options", (1, 1, 17), (70, 5, 40), sliding_window=20, soft_cap=3.0, sinks=True),
    _shape("gqa_1", (1, 9), (20, 30), num_heads=2, num_kv_heads=2),
    _shape("gqa_4", (1, 9), (20, 30), num_heads=4, num_kv_heads=1),
    _shape("gqa_8", (1, 9), (20, 30), num_heads=16, num_kv_heads=2),
    _shape("gqa_16_unsplit", (1, 1, 9), (20, 70, 30), num_heads=16, num_kv_heads=1),
    _shape("odd_lengths", (1, 13, 29), (61, 13, 45), block_size=128),
    _shape("block_size_128", (1, 11), (100, 75), block_size=128),
    _shape("head_size_80", (1, 6), (35, 20), head_size=80),
    _shape("padding_rows", (1, 1, 6), (30, 10, 20), pad_reqs=3, pad_tokens=5),
]
IDS = [s.name for s in SHAPES]
PREFILL = F.FlashTiles(block_m=32, tile_n=16, num_warps=4, num_stages=1)
DECODE = F.FlashTiles(block_m=16, tile_n=16, num_warps=4, num_stages=1)


def _dtype_for(shape: BatchShape) -> torch.dtype:
    # one dtype per shape keeps the module fast; both are covered across the table
    return torch.float16 if SHAPES.index(shape) % 2 else torch.float32


def _batch(shape, dtype):
    batch = make_paged_batch(shape, dtype, "cpu")
    F.write_kv(batch.key, batch.value, batch.kv_cache[0], batch.kv_cache[1], batch.slot_mapping)
    return batch


def _options(batch):
    s = batch.shape
    return dict(scale=s.head_size ** -0.5, sliding_window=s.sliding_window, soft_cap=s.soft_cap, sinks=batch.sinks)


def _run(batch, prefill=PREFILL, decode=DECODE, target_items=3, min_chunk=1, use_tma=None, out=None):
    """The decode launch over the leading decodes, then the prefill launch over the rest, as the backend does."""
    s = batch.shape
    out = torch.full_like(batch.query, float("nan")) if out is None else out
    layout = (batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table, batch.query_start_loc,
              batch.seq_lens)
    ws = F.DecodeWorkspace(batch.num_reqs_padded, s.num_kv_heads, s.head_size, decode.tile_n, target_items, "cpu",
                           min_chunk=min_chunk)
    ws.part_out.fill_(float("nan"))   # stale scratch must never reach an output
    ws.plan(batch.seq_lens, s.num_decodes, s.sliding_window)
    F.flash_decode(*layout, workspace=ws, num_rows=batch.num_reqs_padded, tiles=decode, use_tma=use_tma,
                   **_options(batch))
    if s.num_decodes < len(s.query_lens):
        assert out[s.num_decodes:batch.num_tokens].isnan().all(), "the decode launch touched a prefill row"
    F.flash_prefill(*layout, num_seqs=batch.num_reqs_padded, num_tokens=batch.num_tokens_padded, tiles=prefill,
                    num_decodes=ws.params[1:], use_tma=use_tma, **_options(batch))
    return out, ws


def _assert_matches(out, batch, dtype):
    ref = reference_output(batch)
    got = out[:batch.num_tokens].float()
    assert not got.isnan().any(), "some rows were not written"
    err = (got - ref).abs().max().item()
    assert err <= tolerance(dtype), f"{batch.shape.name}: max abs error {err:.3g} > {tolerance(dtype)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_write_fills_slots_and_skips_padding(dtype):
    batch = make_paged_batch(_shape("write", (1, 7, 20), (9, 7, 40), pad_tokens=4), dtype, "cpu")
    assert not torch.equal(batch.kv_cache[:, 1:], batch.expected_cache[:, 1:])
    F.write_kv(batch.key, batch.value, batch.kv_cache[0], batch.kv_cache[1], batch.slot_mapping)
    torch.testing.assert_close(batch.kv_cache, batch.expected_cache, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_decode_then_prefill_matches_reference(shape):
    dtype = _dtype_for(shape)
    batch = _batch(shape, dtype)
    out, _ = _run(batch)
    _assert_matches(out, batch, dtype)


@pytest.mark.parametrize("name", ["chunked_prefill_with_context", "sliding_window", "all_options", "block_size_128"])
def test_tma_and_pointer_tiles_agree_with_reference(name):
    """A 64-token page holds a 32- or 64-key tile: the TMA path, against the pointer path."""
    shape = dataclasses.replace(next(s for s in SHAPES if s.name == name), block_size=64)
    batch = _batch(shape, torch.float32)
    tiles = dict(prefill=F.FlashTiles(32, 32, 4, 1), decode=F.FlashTiles(16, 64, 4, 1))
    assert F.can_use_tma(batch.kv_cache[0], 32) and F.can_use_tma(batch.kv_cache[0], 64)
    tma, _ = _run(batch, use_tma=True, **tiles)
    pointer, _ = _run(batch, use_tma=False, **tiles)
    _assert_matches(tma, batch, torch.float32)
    _assert_matches(pointer, batch, torch.float32)


def test_decode_plan_balances_by_kv_length():
    # lengths 16 .. 400 tokens, 16-key tiles: 1 + 25 + 3 + 9 = 38 tiles over 4 target items: chunks of 10 tiles
    shape = _shape("ragged", (1, 1, 1, 1), (16, 400, 33, 144), pad_reqs=2)
    batch = _batch(shape, torch.float32)
    out, ws = _run(batch, target_items=4)
    _assert_matches(out, batch, torch.float32)
    assert ws.params.tolist() == [10, 4]
    # items per request: 1, 3, 1, 1; the padding rows none
    assert ws.work_start[:7].tolist() == [0, 1, 4, 5, 6, 6, 6]
    assert ws.item_seq[:6].tolist() == [0, 1, 1, 1, 2, 3] and (ws.item_seq[6:] == -1).all()
    assert ws.item_chunk[:6].tolist() == [0, 0, 1, 2, 0, 0]
    assert ws.item_part[:6].tolist() == [-1, 0, 1, 2, -1, -1]   # only the split request writes partials


def test_min_chunk_limits_splitting():
    shape = _shape("long", (1,), (300,))
    batch = _batch(shape, torch.float32)
    out, ws = _run(batch, target_items=64, min_chunk=8)   # 19 tiles: chunks of 8 tiles, not 1
    _assert_matches(out, batch, torch.float32)
    assert ws.params.tolist() == [8, 1] and ws.work_start[:2].tolist() == [0, 3]


def test_prefill_writes_log_sum_exp():
    shape = _shape("lse", (9, 20), (30, 20), sinks=True)
    batch = _batch(shape, torch.float32)
    out = torch.full_like(batch.query, float("nan"))
    lse = torch.full(batch.query.shape[:2], float("nan"))
    F.flash_prefill(batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table,
                    batch.query_start_loc, batch.seq_lens, num_seqs=batch.num_reqs_padded,
                    num_tokens=batch.num_tokens_padded, tiles=PREFILL, lse=lse, **_options(batch))
    _assert_matches(out, batch, torch.float32)
    # reference: logsumexp over visible keys (and the sink) of request 1's last query, head 3
    s = shape
    q = batch.query[28].float()[3]                                                     # last token of request 1
    blocks = batch.block_table[1, :1].long()
    k = batch.expected_cache[0, blocks, 3 // (s.num_heads // s.num_kv_heads)].reshape(-1, s.head_size)[:20]
    scores = torch.cat([(k.float() @ q) * s.head_size ** -0.5, batch.sinks[3:4].float()])
    assert abs(lse[28, 3].item() - torch.logsumexp(scores, 0).item()) < 1e-4


def test_launchers_reject_bad_arguments():
    batch = _batch(_shape("bad", (1,), (4,), num_heads=8, num_kv_heads=1), torch.float32)
    out = torch.empty_like(batch.query)
    layout = (batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table, batch.query_start_loc,
              batch.seq_lens)
    with pytest.raises(ValueError, match="block_m 4"):
        F.flash_prefill(*layout, num_seqs=1, num_tokens=1, scale=1.0, tiles=F.FlashTiles(block_m=4))
    ws = F.DecodeWorkspace(1, 1, 64, 16, 2, "cpu")
    with pytest.raises(ValueError, match="tile_n 32"):
        F.flash_decode(*layout, workspace=ws, num_rows=1, scale=1.0, tiles=F.FlashTiles(16, 32))
    with pytest.raises(ValueError, match="num_rows 2"):
        F.flash_decode(*layout, workspace=ws, num_rows=2, scale=1.0, tiles=DECODE)
    with pytest.raises(ValueError, match="block_size 64 is not a multiple of tile_n 128"):
        F.flash_prefill(*layout, num_seqs=1, num_tokens=1, scale=1.0, tiles=F.FlashTiles(128, 128))
    with pytest.raises(ValueError, match="num_decodes 5"):
        ws.plan(batch.seq_lens, 5)
