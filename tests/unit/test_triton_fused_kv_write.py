"""The decode attention kernels writing the step's new K/V themselves (`new_kv`) against the cache-write kernel
followed by the same kernels without it: the same outputs and byte-identical caches, 2D and 3D split-KV. CPU tensors
run the interpreted kernels; float16/float32 only (the interpreter's tl.dot is wrong for bfloat16)."""

import pytest
import torch
import triton

import ember.attention_backends.triton_unified.kernels as K
from tests.helpers.paged_batches import BatchShape, make_paged_batch, reference_output, tolerance

SHAPES = {
    # seq_len 1 (no context), on and just past a 16-key tile edge; padding requests and tokens
    "edges_padded": BatchShape("edges_padded", (1, 1, 1, 1), (1, 16, 17, 40), pad_reqs=2, pad_tokens=3),
    "gqa_4": BatchShape("gqa_4", (1, 1, 1), (33, 64, 5), num_heads=8, num_kv_heads=2),
    "sliding_window": BatchShape("sliding_window", (1, 1, 1), (60, 9, 33), sliding_window=16),
    "window_1": BatchShape("window_1", (1, 1), (20, 17), sliding_window=1),
    "all_options": BatchShape("all_options", (1, 1, 1), (70, 5, 48), sliding_window=20, soft_cap=3.0, sinks=True,
                              alibi=True),
    "block_32_head_80": BatchShape("block_32_head_80", (1, 1), (61, 32), block_size=32, head_size=80),
}
TILE = K.TileConfig(block_m=16, tile_n=16)
# fused and unfused differ only in the summation order of the new key's score (and an output rounding in float16)
SAME = {torch.float32: 1e-5, torch.float16: 4e-3}


def _attend(batch, cache, segments, new_kv, tile=TILE, query=None, rope=None):
    """Output of one decode launch over `cache` (2D for segments == 1, else 3D split-KV)."""
    s = batch.shape
    query = batch.query if query is None else query
    out = torch.full_like(query, float("nan"))
    layout = (query, cache[0], cache[1], out, batch.block_table, batch.query_start_loc, batch.seq_lens)
    kwargs = dict(scale=s.head_size ** -0.5, sliding_window=s.sliding_window, soft_cap=s.soft_cap, sinks=batch.sinks,
                  alibi_slopes=batch.alibi_slopes, new_kv=new_kv, rope=rope)
    if segments == 1:
        K.unified_attention_2d(*layout, num_seqs=batch.num_reqs_padded, num_tokens=batch.num_tokens_padded,
                               config=tile, mode=K.MODE_DECODES, **kwargs)
    else:
        n_out, n_rows = K.segment_scratch_numel(batch.num_reqs_padded, s.num_heads, s.head_size, segments)
        scratch = [torch.full((n,), float("nan")) for n in (n_out, n_rows, n_rows)]
        K.unified_attention_3d(*layout, num_seqs=batch.num_reqs_padded, config=tile, num_segments=segments,
                               scratch_out=scratch[0], scratch_max=scratch[1], scratch_sum=scratch[2], **kwargs)
    return out


def _both(batch, segments, tile=TILE):
    """(fused output, fused cache, unfused output, unfused cache), each from a copy of the batch's stale cache."""
    unfused_cache = batch.kv_cache.clone()
    K.write_kv(batch.key, batch.value, unfused_cache[0], unfused_cache[1], batch.slot_mapping)
    unfused = _attend(batch, unfused_cache, segments, None, tile)
    fused_cache = batch.kv_cache.clone()
    fused = _attend(batch, fused_cache, segments, (batch.key, batch.value, batch.slot_mapping), tile)
    return fused, fused_cache, unfused, unfused_cache


CASES = [(name, segments) for name in SHAPES for segments in (1, 4)] + [("edges_padded", 2), ("all_options", 8)]


@pytest.mark.parametrize("name,segments", CASES, ids=[f"{n}-{'2d' if g == 1 else f'3d_seg{g}'}" for n, g in CASES])
def test_fused_write_matches_write_kernel_then_attention(name, segments):
    shape = SHAPES[name]
    dtype = torch.float16 if list(SHAPES).index(name) % 2 else torch.float32
    batch = make_paged_batch(shape, dtype, "cpu")
    fused, fused_cache, unfused, unfused_cache = _both(batch, segments)
    # every new token written once at its slot, padding nowhere, the NaN null block untouched: the write kernel's
    # cache, byte for byte, and the batch's expected one
    torch.testing.assert_close(fused_cache, unfused_cache, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(fused_cache, batch.expected_cache, atol=0, rtol=0, equal_nan=True)
    n = batch.num_tokens
    assert not fused[:n].isnan().any(), "a decode row was not written"
    assert fused[n:].isnan().all(), "a padding row was written"
    assert (fused[:n].float() - unfused[:n].float()).abs().max().item() <= SAME[dtype]
    assert (fused[:n].float() - reference_output(batch)).abs().max().item() <= tolerance(dtype)


@pytest.mark.parametrize("segments", [1, 4], ids=["2d", "3d"])
def test_fused_write_unmasked_middle_loops(segments):
    """The three-loop variant: the tile that holds the new token must stay out of the unmasked middle."""
    batch = make_paged_batch(BatchShape("middle", (1, 1, 1), (48, 49, 70), sliding_window=40), torch.float32, "cpu")
    fused, fused_cache, unfused, unfused_cache = _both(batch, segments, K.TileConfig(16, 16, unmasked_middle=True))
    torch.testing.assert_close(fused_cache, unfused_cache, atol=0, rtol=0, equal_nan=True)
    assert (fused[:3] - unfused[:3]).abs().max().item() <= SAME[torch.float32]
    assert (fused[:3] - reference_output(batch)).abs().max().item() <= tolerance(torch.float32)


@pytest.mark.parametrize("segments", [1, 4], ids=["2d", "3d"])
def test_slot_minus_one_writes_nothing_and_attends_the_cache(segments):
    """As the write kernel: a token whose slot is -1 is not written, and its position is read from the cache."""
    batch = make_paged_batch(BatchShape("unslotted", (1, 1, 1), (30, 17, 9)), torch.float32, "cpu")
    batch.slot_mapping[1] = -1
    fused, fused_cache, unfused, unfused_cache = _both(batch, segments)
    torch.testing.assert_close(fused_cache, unfused_cache, atol=0, rtol=0, equal_nan=True)
    assert not torch.equal(fused_cache[:, 1:], batch.expected_cache[:, 1:]), "the unslotted token was written"
    assert (fused[:3] - unfused[:3]).abs().max().item() <= SAME[torch.float32]


def test_fused_write_casts_to_the_cache_dtype():
    batch = make_paged_batch(BatchShape("cast", (1, 1), (20, 7)), torch.float32, "cpu")
    batch.kv_cache = batch.kv_cache.half()
    batch.query = batch.query.half()
    fused, fused_cache, unfused, unfused_cache = _both(batch, 1)
    torch.testing.assert_close(fused_cache, unfused_cache, atol=0, rtol=0, equal_nan=True)
    assert (fused[:2].float() - unfused[:2].float()).abs().max().item() <= SAME[torch.float16]


def _raw_qk(batch, norm: bool, seed: int = 0):
    """q and the new keys as a qkv projection writes them (one [T, (Hq + 2 Hkv) * D] buffer), the cos/sin rows of
    positions around each token's, the norm weights, and the model's normed and rotated q and k for them."""
    from ember.kernels.qk_norm_rope import qk_norm_rope_reference
    s, g = batch.shape, torch.Generator().manual_seed(seed)
    t, d, dtype = batch.query.shape[0], s.head_size, batch.query.dtype
    qkv = torch.randn(t, (s.num_heads + 2 * s.num_kv_heads) * d, generator=g).to(dtype)
    q, k = qkv[:, :s.num_heads * d], qkv[:, s.num_heads * d:(s.num_heads + s.num_kv_heads) * d]
    angles = torch.rand(t, d // 2, generator=g) * 6.0
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)           # [T, D], as the model's gathered rows
    cos, sin = cos_sin.chunk(2, dim=-1)
    weights = (torch.rand(d, generator=g).to(dtype) + 0.5, torch.rand(d, generator=g).to(dtype) + 0.5) if norm \
        else (None, None)
    q_ref, k_ref = qk_norm_rope_reference(q, k, *weights, cos, sin, 1e-6, d)
    raw_q, raw_k = q.unflatten(-1, (s.num_heads, d)), k.unflatten(-1, (s.num_kv_heads, d))
    return raw_q, raw_k, (cos, sin, *weights, 1e-6), q_ref, k_ref


ROPE_CASES = [("edges_padded", 1, True), ("edges_padded", 4, False), ("gqa_4", 4, True), ("all_options", 1, True),
              ("sliding_window", 8, False)]


@pytest.mark.parametrize("name,segments,norm", ROPE_CASES,
                         ids=[f"{n}-{'2d' if g == 1 else f'3d_seg{g}'}-{'norm' if m else 'rope'}"
                              for n, g, m in ROPE_CASES])
def test_fused_rope_matches_norm_rope_then_attention(name, segments, norm):
    """q and the new keys handed over raw (views into one qkv buffer): the kernel's norm and rotary give the
    output and the cache of the model's ops followed by the launch without rope."""
    shape = SHAPES[name]
    dtype = torch.float16 if list(SHAPES).index(name) % 2 else torch.float32
    batch = make_paged_batch(shape, dtype, "cpu")
    raw_q, raw_k, rope, q_ref, k_ref = _raw_qk(batch, norm)
    ref_cache = batch.kv_cache.clone()
    ref = _attend(batch, ref_cache, segments, (k_ref, batch.value, batch.slot_mapping), query=q_ref)
    fused_cache = batch.kv_cache.clone()
    fused = _attend(batch, fused_cache, segments, (raw_k, batch.value, batch.slot_mapping), query=raw_q, rope=rope)
    # the rotated keys reach the cache as the model's ops make them (the same roundings, in that order; the norm's
    # sum of squares may differ in order, by an ulp of the scale)
    torch.testing.assert_close(fused_cache, ref_cache, atol=SAME[dtype], rtol=0, equal_nan=True)
    assert not torch.equal(fused_cache, batch.kv_cache), "no new key was written"
    n = batch.num_tokens
    assert not fused[:n].isnan().any() and fused[n:].isnan().all()
    assert (fused[:n].float() - ref[:n].float()).abs().max().item() <= 4 * SAME[dtype]


def test_rope_arguments_are_checked():
    batch = make_paged_batch(SHAPES["gqa_4"], torch.float32, "cpu")
    raw_q, raw_k, (cos, sin, qw, kw, eps), _, _ = _raw_qk(batch, True)
    new_kv = (raw_k, batch.value, batch.slot_mapping)
    cache = batch.kv_cache.clone()
    with pytest.raises(ValueError, match="rope needs new_kv"):
        _attend(batch, cache, 1, None, query=raw_q, rope=(cos, sin, qw, kw, eps))
    with pytest.raises(ValueError, match=r"cos must be \[tokens, 32\]"):
        _attend(batch, cache, 1, new_kv, query=raw_q, rope=(cos[:, :8], sin, qw, kw, eps))
    with pytest.raises(ValueError, match="both q and k norm weights or neither"):
        _attend(batch, cache, 1, new_kv, query=raw_q, rope=(cos, sin, qw, None, eps))
    with pytest.raises(ValueError, match="power-of-two head_size"):
        odd = make_paged_batch(SHAPES["block_32_head_80"], torch.float32, "cpu")
        q80, k80, rope80, _, _ = _raw_qk(odd, False)
        _attend(odd, odd.kv_cache.clone(), 1, (k80, odd.value, odd.slot_mapping), query=q80, rope=rope80)


def test_new_kv_arguments_are_checked():
    batch = make_paged_batch(BatchShape("bad", (1, 5), (4, 9)), torch.float32, "cpu")
    out = torch.empty_like(batch.query)
    layout = (batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table, batch.query_start_loc,
              batch.seq_lens)
    with pytest.raises(ValueError, match="new_kv needs mode MODE_DECODES"):
        K.unified_attention_2d(*layout, num_seqs=2, num_tokens=6, scale=1.0, config=TILE,
                               new_kv=(batch.key, batch.value, batch.slot_mapping))
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        K.unified_attention_2d(*layout, num_seqs=2, num_tokens=6, scale=1.0, config=TILE, mode=K.MODE_DECODES,
                               new_kv=(batch.key, batch.value, batch.slot_mapping.int()))
    with pytest.raises(ValueError, match=r"new key \(6, 1, 64\)"):
        K.unified_attention_2d(*layout, num_seqs=2, num_tokens=6, scale=1.0, config=TILE, mode=K.MODE_DECODES,
                               new_kv=(batch.key[:, :1], batch.value[:, :1], batch.slot_mapping))


@pytest.mark.parametrize("segments,rope", [(1, False), (16, False), (16, True)], ids=["2d", "3d", "3d-rope"])
def test_fused_write_compiles_for_sm90(segments, rope):
    """Compiled for an H100 on the CPU (the GPU path the interpreter does not check): both the key and the value
    store are in the code, guarded by the branch of the program that owns the new token; with rope, the norm's
    rsqrt is there too (for the queries and the new key)."""
    from ember.attention_backends.triton_unified.kernels import unified_attention as U
    from tests.helpers.sm90 import compile_for_sm90
    fn = U.unified_attention_kernel.fn
    dtypes = {"part_out_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "counter_ptr": "*i32",
              "block_table_ptr": "*i32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
              "num_decodes_ptr": "*i32", "sinks_ptr": "*fp32", "alibi_ptr": "*fp32", "slot_mapping_ptr": "*i64",
              "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    constexprs = dict(NUM_QUERIES_PER_KV=2, HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_Q=1,
                      TILE_N=64, NUM_SEGMENTS=segments, MODE=K.MODE_DECODES, LIMIT_DECODES=False, USE_WINDOW=False,
                      USE_SOFTCAP=False, USE_SINKS=False, USE_ALIBI=False, IEEE=False, UNMASKED_MIDDLE=False,
                      FUSED_COMBINE=False, NEW_KV=True, PDL=False, ROPE=rope, QK_NORM=rope, FP8_KV=0)
    compiled = compile_for_sm90(fn, dtypes, constexprs)
    ttir = compiled.asm["ttir"]
    stores = [line for line in ttir.splitlines() if "tt.store" in line]
    # the output (2D, or a 3D request of at most single_tiles KV tiles), the three partials (3D), the new key and value
    assert len(stores) == 1 + (0 if segments == 1 else 3) + 2, stores
    assert "scf.if" in ttir
    assert ttir.count("math.rsqrt") == (2 if rope else 0), [line for line in ttir.splitlines() if "rsqrt" in line]
