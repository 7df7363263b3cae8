"""Decode attention reading an e4m3 cache as int32 words (`EMBER_FP8_KV_WORDS`, `set_fp8_kv_words`) gives the
output of the byte-wise path bit for bit: the same float16 values reach the same products. Interpreted on the CPU
(the words widened by Triton's conversions, E4M3_WORDS 2), over the 2D decode launch and the 3D split-KV launch with
the fused write: ragged lengths ending mid-page, GQA 1, 2 and 4, a sliding window, a soft cap, sinks, a padded head,
float16 and bfloat16 (float16 products) queries. The widening itself is checked on every byte."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

import ember.attention_backends.triton_unified.kernels as K
from ember.attention_backends.triton_common import kv_write
from ember.attention_backends.triton_unified.kernels.attention_core import load_e4m3_words
from ember.kernels.e4m3 import e4m3_words_to_f16
from ember.kernels.interpret import interpreted
from tests.helpers.paged_batches import BatchShape
from tests.unit.test_fp8_kv_cache import _kwargs, fp8_batch

FP8 = torch.float8_e4m3fn


@pytest.fixture
def words_switch():
    """Yields `set_fp8_kv_words`, restoring the switch afterwards."""
    before = kv_write._words
    yield kv_write.set_fp8_kv_words
    kv_write.set_fp8_kv_words(before)


@triton.jit
def _widen_kernel(words_ptr, out_ptr, ROWS: tl.constexpr, WORDS: tl.constexpr):
    rows = tl.arange(0, ROWS)[:, None]
    words = tl.load(words_ptr + rows * WORDS + tl.arange(0, WORDS)[None, :])
    tl.store(out_ptr + rows * (4 * WORDS) + tl.arange(0, 4 * WORDS)[None, :], e4m3_words_to_f16(words, False))


def test_words_widen_every_e4m3_byte_in_memory_order():
    """All 256 bytes, each at every position of a word: the float16 values torch's conversion gives, in the bytes'
    memory order (e4m3's two NaN bytes aside: the interpreter's conversion reads them as +-480, where the GPU's
    `cvt` gives NaN; the kernels never let a NaN byte's value through, masked or not)."""
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    data = torch.stack([data.roll(shift) for shift in range(4)], 1).reshape(16, 64)     # [16 rows, 64 bytes]
    out = torch.empty(16, 64, dtype=torch.float16)
    interpreted(_widen_kernel)[(1,)](data.view(torch.int32), out, ROWS=16, WORDS=16)
    want = data.view(FP8).to(torch.float16)
    finite = ~want.isnan()
    assert finite.sum().item() == 1024 - 8
    assert torch.equal(out[finite].view(torch.int16), want[finite].view(torch.int16))


@triton.jit
def _tile_kernel(k_ptr, v_ptr, k_out_ptr, v_out_ptr, seq_len, TILE_N: tl.constexpr, HEAD_SIZE: tl.constexpr,
                 HEAD_PAD: tl.constexpr):
    keys = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_PAD)
    k, v = load_e4m3_words(k_ptr, v_ptr, keys * HEAD_SIZE, keys, seq_len, HEAD_SIZE, HEAD_PAD, True, False)
    tl.store(k_out_ptr + offs_d[:, None] * TILE_N + keys[None, :], k)
    tl.store(v_out_ptr + keys[:, None] * HEAD_PAD + offs_d[None, :], v)


def test_tile_loads_zero_the_values_past_the_sequence_and_the_padded_head():
    """K [HEAD_PAD, TILE_N] and V [TILE_N, HEAD_PAD] of 16 keys of head 40 (padded to 64) with 11 in the sequence:
    V's rows past it are 0 (on a GPU a NaN byte there would reach the output as 0 x NaN), the padding columns 0."""
    cache = (torch.randn(2, 16, 40, generator=torch.Generator().manual_seed(0)) * 10).to(FP8)
    k_out, v_out = torch.full((64, 16), float("nan"), dtype=torch.float16), torch.empty(16, 64, dtype=torch.float16)
    interpreted(_tile_kernel)[(1,)](cache[0], cache[1], k_out, v_out, 11, TILE_N=16, HEAD_SIZE=40, HEAD_PAD=64)
    keys = cache.to(torch.float16)
    assert torch.equal(k_out[:40], keys[0].T) and not k_out[40:].any()
    assert torch.equal(v_out[:11, :40], keys[1, :11]) and not v_out[11:].any() and not v_out[:, 40:].any()


def test_the_switch_applies_to_float16_products_over_whole_words(words_switch):
    cache = torch.zeros(3, 2, 16, 64, dtype=FP8)
    bf16, f16, f32 = (torch.zeros(1, 4, 64, dtype=d) for d in (torch.bfloat16, torch.float16, torch.float32))
    words_switch(False)
    assert kv_write.fp8_kv_words(f16, cache) == 0
    words_switch(True)
    assert kv_write.fp8_kv_words(f16, cache) == 2 and kv_write.fp8_kv_words(bf16, cache) == 2
    assert kv_write.fp8_kv_words(f32, cache) == 0                                    # float32 products
    assert kv_write.fp8_kv_words(f16, torch.zeros(3, 2, 16, 64, dtype=torch.float16)) == 0
    assert kv_write.fp8_kv_words(f16, torch.zeros(3, 2, 16, 66, dtype=FP8)) == 0      # rows not whole words
    shifted = torch.zeros(1 + cache.numel(), dtype=FP8)[1:].view(cache.shape)      # starts 1 byte past a word
    assert shifted.data_ptr() % 4 == 1 and kv_write.fp8_kv_words(f16, shifted) == 0


DECODES = BatchShape("ragged_gqa2", (1,) * 5, (3, 90, 16, 47, 64))                      # 90, 47, 3 end mid-page
SHAPES = [
    (DECODES, torch.float16),
    (dataclasses.replace(DECODES, name="gqa4_bf16", num_heads=8, num_kv_heads=2), torch.bfloat16),
    (BatchShape("gqa1_window_sinks", (1,) * 4, (60, 7, 50, 41), num_heads=2, num_kv_heads=2, sliding_window=16,
                sinks=True, pad_reqs=1), torch.float16),
    (BatchShape("gqa4_softcap_head80", (1,) * 3, (40, 30, 25), num_heads=8, num_kv_heads=2, head_size=80,
                soft_cap=2.0, block_size=32), torch.bfloat16),
]


def _decode_2d(batch, scales, tile_n):
    out = torch.full_like(batch.query, float("nan"))
    K.unified_attention_2d(batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table,
                           batch.query_start_loc, batch.seq_lens, num_seqs=batch.num_reqs_padded,
                           num_tokens=batch.num_tokens_padded, config=K.TileConfig(block_m=16, tile_n=tile_n),
                           mode=K.MODE_DECODES, **_kwargs(batch, scales))
    return out


@pytest.mark.parametrize("shape,dtype", SHAPES, ids=[s.name for s, _ in SHAPES])
def test_2d_decode_reads_words_bit_for_bit(shape, dtype, words_switch):
    batch, scales = fp8_batch(shape, dtype)
    K.write_kv(batch.key, batch.value, batch.kv_cache[0], batch.kv_cache[1], batch.slot_mapping, kv_scales=scales)
    tile_n = 32 if shape.block_size >= 32 else 16
    words_switch(False)
    want = _decode_2d(batch, scales, tile_n)
    words_switch(True)
    assert kv_write.fp8_kv_words(batch.query, batch.kv_cache) == 2
    got = _decode_2d(batch, scales, tile_n)
    live = batch.num_tokens
    assert not want[:live].isnan().any()
    assert torch.equal(got[:live], want[:live])


def _decode_3d(batch, scales, cache):
    s = batch.shape
    out = torch.full_like(batch.query, float("nan"))
    n_out, n_rows = K.segment_scratch_numel(batch.num_reqs_padded, s.num_heads, s.head_size, 4)
    scratch = [torch.full((n,), float("nan")) for n in (n_out, n_rows, n_rows)]
    K.unified_attention_3d(batch.query, cache[0], cache[1], out, batch.block_table, batch.query_start_loc,
                           batch.seq_lens, num_seqs=batch.num_reqs_padded, config=K.TileConfig(block_m=16, tile_n=16),
                           num_segments=4, scratch_out=scratch[0], scratch_max=scratch[1], scratch_sum=scratch[2],
                           new_kv=(batch.key, batch.value, batch.slot_mapping), **_kwargs(batch, scales))
    return out


@pytest.mark.parametrize("shape,dtype", [SHAPES[1], SHAPES[2]], ids=["gqa4_bf16", "gqa1_window_sinks"])
def test_3d_split_decode_with_the_fused_write_reads_words_bit_for_bit(shape, dtype, words_switch):
    """Segments of a few tiles each, the new key attended from registers and written: the same output and the
    same cache bytes as the byte-wise path."""
    batch, scales = fp8_batch(shape, dtype)
    words_switch(False)
    cache_want = batch.kv_cache.clone()
    want = _decode_3d(batch, scales, cache_want)
    words_switch(True)
    cache_got = batch.kv_cache.clone()
    got = _decode_3d(batch, scales, cache_got)
    live = batch.num_tokens
    assert not want[:live].isnan().any()
    assert torch.equal(got[:live], want[:live])
    assert torch.equal(cache_got.view(torch.uint8), cache_want.view(torch.uint8))


def test_sm90_decode_loop_widens_whole_words():
    """The plan's 2D decode kernel for an H100 (GQA 4, head 128, compiled on the CPU): read as words, the KV loop
    widens with one `cvt` a pair of bytes and loads no byte on its own; the byte-wise read gathers V a byte at a
    time from shared memory (what the words remove)."""
    from benches.experiments.fp8_decode_sass import compile_decode, loop_body
    from ember.attention_backends.triton_unified.plan import decode_tile
    tile = decode_tile(4, 128, split=False)
    pairs = tile.tile_n * 128 * 2 // (32 * tile.num_warps) // 2        # K and V bytes a thread, in pairs
    for words in (True, False):
        body = loop_body(compile_decode("fp8e4nv", words, tile)[0])
        widen = sum("F2FP.F16.E4M3" in i for i in body)
        byte_loads = sum("LDS.U8" in i for i in body)
        assert widen == pairs and (byte_loads == 0) == words, (words, widen, byte_loads)
