"""The Triton unified attention kernels on the CPU under TRITON_INTERPRET=1, against the float32 reference, over a
named table of small batch shapes (the interpreter is slow). float16/float32 only: the interpreter's tl.dot is
wrong for bfloat16 (bfloat16 runs in tests/gpu)."""

import pytest
import torch
import triton

# CPU tensors run the kernels in Triton's interpreter whatever TRITON_INTERPRET says at import time (the kernel
# package keeps interpreted copies for them), so this module needs no environment set-up.
import ember.attention_backends.triton_unified.kernels as K
from tests.helpers.paged_batches import BatchShape, make_paged_batch, reference_output, tolerance

SHAPES = [
    BatchShape("small_decode", (1, 1, 1), (5, 17, 33)),
    BatchShape("large_decode", (1,) * 8, (3, 90, 16, 47, 64, 1, 33, 75)),
    BatchShape("single_long_decode", (1,), (300,)),
    BatchShape("small_prefill", (5, 12), (5, 12)),
    BatchShape("long_prefill", (150,), (150,)),
    BatchShape("mixed_small", (1, 1, 7, 3), (9, 20, 7, 30)),
    BatchShape("mixed_medium", (1, 1, 1, 40, 17, 2), (70, 3, 33, 40, 50, 18)),
    BatchShape("chunked_prefill_with_context", (1, 20, 33), (21, 50, 80)),
    BatchShape("prefix_cached", (10, 3), (42, 35)),
    BatchShape("sliding_window", (1, 1, 30, 9), (60, 7, 50, 40), sliding_window=16),
    BatchShape("softcap", (1, 12, 25), (40, 30, 25), soft_cap=2.0),
    BatchShape("sinks", (1, 1, 20), (50, 3, 33), sinks=True),
    BatchShape("alibi", (1, 9), (40, 30), alibi=True),
    BatchShape("all_options", (1, 1, 17), (70, 5, 40), sliding_window=20, soft_cap=3.0, sinks=True, alibi=True),
    BatchShape("gqa_1", (1, 9), (20, 30), num_heads=2, num_kv_heads=2),
    BatchShape("gqa_2", (1, 9), (20, 30), num_heads=4, num_kv_heads=2),
    BatchShape("gqa_4", (1, 9), (20, 30), num_heads=4, num_kv_heads=1),
    BatchShape("gqa_8", (1, 9), (20, 30), num_heads=16, num_kv_heads=2),
    BatchShape("odd_lengths", (1, 13, 29), (61, 13, 45), block_size=32),
    BatchShape("block_size_64", (1, 11), (100, 75), block_size=64),
    BatchShape("head_size_80", (1, 6), (35, 20), head_size=80),
    BatchShape("padding_rows", (1, 1, 6), (30, 10, 20), pad_reqs=3, pad_tokens=5),
]
SHAPE_IDS = [s.name for s in SHAPES]
DECODE_SHAPES = [s for s in SHAPES if s.num_decodes == len(s.query_lens)]
MIXED_SHAPES = [s for s in SHAPES if 0 < s.num_decodes < len(s.query_lens)]
TILE = K.TileConfig(block_m=16, tile_n=16)          # tile_n below and above the block size (16/32/64)
PREFILL_TILE = K.TileConfig(block_m=32, tile_n=32)


def _dtype_for(shape: BatchShape) -> torch.dtype:
    # one dtype per shape keeps the module fast; both are covered across the table
    return torch.float16 if SHAPES.index(shape) % 2 else torch.float32


def _batch(shape: BatchShape, dtype: torch.dtype):
    batch = make_paged_batch(shape, dtype, "cpu")
    K.write_kv(batch.key, batch.value, batch.kv_cache[0], batch.kv_cache[1], batch.slot_mapping)
    return batch


def _kwargs(batch):
    s = batch.shape
    return dict(scale=s.head_size ** -0.5, sliding_window=s.sliding_window, soft_cap=s.soft_cap, sinks=batch.sinks,
                alibi_slopes=batch.alibi_slopes)


def _assert_matches(out, batch, dtype):
    ref = reference_output(batch)
    got = out[:batch.num_tokens].float()
    assert not got.isnan().any(), "some rows were not written"
    err = (got - ref).abs().max().item()
    assert err <= tolerance(dtype), f"{batch.shape.name}: max abs error {err:.3g} > {tolerance(dtype)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_cache_write_matches_slots_and_skips_padding(dtype):
    shape = BatchShape("write", (1, 7, 20), (9, 7, 40), pad_tokens=4)
    batch = make_paged_batch(shape, dtype, "cpu")
    assert not torch.equal(batch.kv_cache[:, 1:], batch.expected_cache[:, 1:])
    K.write_kv(batch.key, batch.value, batch.kv_cache[0], batch.kv_cache[1], batch.slot_mapping)
    # exact: every slot written once, padding (-1) nowhere, the NaN null block untouched
    torch.testing.assert_close(batch.kv_cache, batch.expected_cache, atol=0, rtol=0, equal_nan=True)


def test_kv_cache_write_casts_to_cache_dtype():
    shape = BatchShape("write_cast", (3,), (5,))
    batch = make_paged_batch(shape, torch.float32, "cpu")
    cache = batch.kv_cache.to(torch.float16)
    K.write_kv(batch.key, batch.value, cache[0], cache[1], batch.slot_mapping)
    torch.testing.assert_close(cache[:, 1:], batch.expected_cache[:, 1:].half(), atol=0, rtol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_2d_single_launch_matches_reference(shape):
    dtype = _dtype_for(shape)
    batch = _batch(shape, dtype)
    out = torch.full_like(batch.query, float("nan"))
    K.unified_attention_2d(batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table,
                           batch.query_start_loc, batch.seq_lens, num_seqs=batch.num_reqs_padded,
                           num_tokens=batch.num_tokens_padded, config=K.TileConfig(block_m=32, tile_n=32),
                           **_kwargs(batch))
    _assert_matches(out, batch, dtype)


@pytest.mark.parametrize("shape", MIXED_SHAPES, ids=lambda s: s.name)
def test_split_launch_decodes_then_prefills_matches_reference(shape):
    dtype = _dtype_for(shape)
    batch = _batch(shape, dtype)
    out = torch.full_like(batch.query, float("nan"))
    num_decodes = torch.tensor([shape.num_decodes], dtype=torch.int32)
    common = (batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table, batch.query_start_loc,
              batch.seq_lens)
    # decode grid sized like a bucket (more rows than live decodes); the live count comes from the tensor
    K.unified_attention_2d(*common, num_seqs=batch.num_reqs_padded, num_tokens=batch.num_tokens_padded,
                           config=TILE, mode=K.MODE_DECODES, num_decodes=num_decodes, **_kwargs(batch))
    assert out[shape.num_decodes:].isnan().all(), "the decode launch touched a prefill row"
    K.unified_attention_2d(*common, num_seqs=batch.num_reqs_padded, num_tokens=batch.num_tokens_padded,
                           config=PREFILL_TILE, mode=K.MODE_PREFILLS, num_decodes=num_decodes, **_kwargs(batch))
    _assert_matches(out, batch, dtype)


@pytest.mark.parametrize("shape,num_segments",
                         [(s, 8) for s in DECODE_SHAPES]
                         + [(s, 2) for s in SHAPES if s.name in ("small_decode", "mixed_small", "all_options")]
                         + [(s, 4) for s in SHAPES if s.name in ("sinks", "sliding_window", "gqa_8")]
                         # the count is the grid's, not a compiled constant: any 2..MAX_SEGMENTS, one kernel
                         + [(DECODE_SHAPES[0], n) for n in (3, 5, K.MAX_SEGMENTS)],
                         ids=lambda v: v.name if isinstance(v, BatchShape) else f"seg{v}")
@pytest.mark.parametrize("fused", [False, True], ids=["reduce_kernel", "fused_combine"])
def test_3d_split_kv_matches_reference(shape, num_segments, fused):
    """Split-KV decode with a reduce launch, or combined by each pair's last segment program (counters back at 0)."""
    dtype = _dtype_for(shape)
    batch = _batch(shape, dtype)
    out = torch.full_like(batch.query, float("nan"))
    n_out, n_rows = K.segment_scratch_numel(batch.num_reqs_padded, shape.num_heads, shape.head_size, num_segments)
    scratch = [torch.full((n,), float("nan")) for n in (n_out, n_rows, n_rows)]   # stale scratch must not leak
    num_decodes = torch.tensor([shape.num_decodes], dtype=torch.int32)
    counters = torch.zeros(batch.num_reqs_padded * shape.num_kv_heads, dtype=torch.int32) if fused else None
    K.unified_attention_3d(batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table,
                           batch.query_start_loc, batch.seq_lens, num_seqs=batch.num_reqs_padded, config=TILE,
                           num_segments=num_segments, scratch_out=scratch[0], scratch_max=scratch[1],
                           scratch_sum=scratch[2], num_decodes=num_decodes, counters=counters, **_kwargs(batch))
    if fused:
        assert not counters.any(), "a pair's counter was not reset"
    if shape.num_decodes < len(shape.query_lens):   # mixed: finish the prefills with the 2D kernel
        assert out[shape.num_decodes:].isnan().all()
        K.unified_attention_2d(batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table,
                               batch.query_start_loc, batch.seq_lens, num_seqs=batch.num_reqs_padded,
                               num_tokens=batch.num_tokens_padded, config=PREFILL_TILE, mode=K.MODE_PREFILLS,
                               num_decodes=num_decodes, **_kwargs(batch))
    _assert_matches(out, batch, dtype)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s.name in ("large_decode", "sinks", "sliding_window",
                                                                   "all_options", "padding_rows")],
                         ids=lambda s: s.name)
@pytest.mark.parametrize("fused", [False, True], ids=["reduce_kernel", "fused_combine"])
def test_3d_single_segment_requests_match_reference(shape, fused):
    """Requests of at most `single_segment_tiles` KV tiles are finished by their first segment program (their
    scratch rows stay untouched); the longer ones still split, and all match the reference."""
    dtype = _dtype_for(shape)
    batch = _batch(shape, dtype)
    out = torch.full_like(batch.query, float("nan"))
    num_segments, single = 4, 3
    n_out, n_rows = K.segment_scratch_numel(batch.num_reqs_padded, shape.num_heads, shape.head_size, num_segments)
    scratch = [torch.full((n,), float("nan")) for n in (n_out, n_rows, n_rows)]
    num_decodes = torch.tensor([shape.num_decodes], dtype=torch.int32)
    counters = torch.zeros(batch.num_reqs_padded * shape.num_kv_heads, dtype=torch.int32) if fused else None
    K.unified_attention_3d(batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table,
                           batch.query_start_loc, batch.seq_lens, num_seqs=batch.num_reqs_padded, config=TILE,
                           num_segments=num_segments, scratch_out=scratch[0], scratch_max=scratch[1],
                           scratch_sum=scratch[2], num_decodes=num_decodes, counters=counters,
                           single_segment_tiles=single, **_kwargs(batch))
    if fused:
        assert not counters.any(), "a pair's counter was not reset"
    if shape.num_decodes < len(shape.query_lens):
        K.unified_attention_2d(batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table,
                               batch.query_start_loc, batch.seq_lens, num_seqs=batch.num_reqs_padded,
                               num_tokens=batch.num_tokens_padded, config=PREFILL_TILE, mode=K.MODE_PREFILLS,
                               num_decodes=num_decodes, **_kwargs(batch))
    _assert_matches(out, batch, dtype)
    # the visible KV tiles of each decode (its window, if any), as the kernel counts them
    written = scratch[1].view(batch.num_reqs_padded, shape.num_heads, num_segments)[:, :, 0].isfinite()
    short_seen = long_seen = False
    for i, seq_len in enumerate(shape.seq_lens[:shape.num_decodes]):
        first = max(seq_len - shape.sliding_window, 0) // TILE.tile_n if shape.sliding_window else 0
        tiles = -(-seq_len // TILE.tile_n) - first
        if tiles <= single:
            short_seen = True
            assert not written[i].any(), f"request {i} ({tiles} tiles) wrote partials"
        else:
            long_seen = True
            assert written[i].all(), f"request {i} ({tiles} tiles) wrote no partials"
    assert short_seen and (long_seen or shape.name != "large_decode")


def test_head_size_256_and_block_q_packing():
    shape = BatchShape("head_size_256", (1, 5), (20, 5), num_heads=6, num_kv_heads=2, head_size=256)
    batch = _batch(shape, torch.float32)
    out = torch.full_like(batch.query, float("nan"))
    # 3 query heads per KV head in 16 rows: 5 tokens per block, one row unused
    K.unified_attention_2d(batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table,
                           batch.query_start_loc, batch.seq_lens, num_seqs=batch.num_reqs_padded,
                           num_tokens=batch.num_tokens_padded, config=K.TileConfig(block_m=16, tile_n=16),
                           **_kwargs(batch))
    _assert_matches(out, batch, torch.float32)


def test_launchers_reject_bad_arguments():
    batch = _batch(BatchShape("bad", (1,), (4,), num_heads=8, num_kv_heads=1), torch.float32)
    out = torch.empty_like(batch.query)
    args = (batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table, batch.query_start_loc,
            batch.seq_lens)
    with pytest.raises(ValueError, match="block_m 4"):
        K.unified_attention_2d(*args, num_seqs=1, num_tokens=1, scale=1.0, config=K.TileConfig(block_m=4))
    for bad in (1, K.MAX_SEGMENTS + 1):
        with pytest.raises(ValueError, match=f"num_segments {bad} must be in 2..{K.MAX_SEGMENTS}"):
            K.unified_attention_3d(*args, num_seqs=1, scale=1.0, config=TILE, num_segments=bad,
                                   scratch_out=out, scratch_max=out, scratch_sum=out)
    with pytest.raises(ValueError, match="segment scratch"):
        tiny = torch.empty(1)
        K.unified_attention_3d(*args, num_seqs=1, scale=1.0, config=TILE, num_segments=2,
                               scratch_out=tiny, scratch_max=tiny, scratch_sum=tiny)
    n_out, n_rows = K.segment_scratch_numel(1, 8, batch.query.shape[2], 2)
    with pytest.raises(ValueError, match="counters must be int32"):
        K.unified_attention_3d(*args, num_seqs=1, scale=1.0, config=TILE, num_segments=2,
                               scratch_out=torch.empty(n_out), scratch_max=torch.empty(n_rows),
                               scratch_sum=torch.empty(n_rows), counters=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="single_segment_tiles must be a non-negative int, got -1"):
        K.unified_attention_3d(*args, num_seqs=1, scale=1.0, config=TILE, num_segments=2,
                               scratch_out=torch.empty(n_out), scratch_max=torch.empty(n_rows),
                               scratch_sum=torch.empty(n_rows), single_segment_tiles=-1)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s.name in ("long_prefill", "chunked_prefill_with_context",
                                                                   "sliding_window", "all_options", "odd_lengths")],
                         ids=lambda s: s.name)
def test_unmasked_middle_loops_match_reference(shape):
    """The three-loop variant (masks only on edge tiles) against the reference, 2D and 3D."""
    dtype = torch.float32
    batch = _batch(shape, dtype)
    out = torch.full_like(batch.query, float("nan"))
    layout = (batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table, batch.query_start_loc,
              batch.seq_lens)
    num_decodes = torch.tensor([shape.num_decodes], dtype=torch.int32)
    n_out, n_rows = K.segment_scratch_numel(batch.num_reqs_padded, shape.num_heads, shape.head_size, 4)
    scratch = [torch.full((n,), float("nan")) for n in (n_out, n_rows, n_rows)]
    tile = K.TileConfig(16, 16, unmasked_middle=True)
    K.unified_attention_3d(*layout, num_seqs=batch.num_reqs_padded, config=tile, num_segments=4,
                           scratch_out=scratch[0], scratch_max=scratch[1], scratch_sum=scratch[2],
                           num_decodes=num_decodes, **_kwargs(batch))
    K.unified_attention_2d(*layout, num_seqs=batch.num_reqs_padded, num_tokens=batch.num_tokens_padded,
                           config=tile, mode=K.MODE_PREFILLS,
                           num_decodes=num_decodes, **_kwargs(batch))
    _assert_matches(out, batch, dtype)


def test_sm90_code_of_the_fused_combine_counts_with_an_acq_rel_atomic():
    """Compiled for an H100 on the CPU: each 3D program releases its partials through a GPU-scope acq_rel atomic
    after a barrier, and the combining program reads partials past L1 (ld.global.cg)."""
    from ember.attention_backends.triton_unified.kernels import unified_attention as U
    from tests.helpers.sm90 import compile_for_sm90
    fn = U.unified_attention_kernel.fn
    dtypes = {"part_out_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "counter_ptr": "*i32",
              "block_table_ptr": "*i32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
              "num_decodes_ptr": "*i32", "sinks_ptr": "*fp32", "alibi_ptr": "*fp32", "slot_mapping_ptr": "*i64"}
    constexprs = dict(NUM_QUERIES_PER_KV=2, HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_Q=1,
                      TILE_N=64, NUM_SEGMENTS=16, MODE=K.MODE_DECODES, LIMIT_DECODES=False, USE_WINDOW=False,
                      USE_SOFTCAP=False, USE_SINKS=False, USE_ALIBI=False, IEEE=False, UNMASKED_MIDDLE=False,
                      FUSED_COMBINE=True, NEW_KV=False, PDL=False, ROPE=False, QK_NORM=False, FP8_KV=0)
    compiled = compile_for_sm90(fn, dtypes, constexprs, floats=("qk_scale", "softcap"))
    ptx = compiled.asm["ptx"]
    atomic = [line for line in ptx.splitlines() if "atom." in line and ".add" in line]
    assert atomic and all(".acq_rel" in line and ".gpu" in line for line in atomic), atomic
    assert "bar.sync" in ptx[:ptx.index(atomic[0])], "no barrier before the release"
    assert "ld.global.cg" in ptx
