"""Decode attention reading an e4m3 cache as int32 words widened in inline PTX (`set_fp8_kv_words`) against the
byte-wise path on a GPU: bit-equal outputs at the benchmark's shapes (bfloat16 queries, float16 products, GQA 32/8,
head 128, 64-token pages, the plan's 2D decode tile; 256 x U[100, 2048] and 64 x U[200, 8192]), at a split-KV
bucket with the fused write and rotary, and over the options (window, soft cap, sinks, GQA 1 and 4, a padded head).
The caches' null block holds NaN bytes, so a value row the words path failed to zero would show."""

import pytest
import torch

import ember.attention_backends.triton_unified.kernels as K
from ember.attention_backends.triton_common import kv_write
from ember.attention_backends.triton_unified import plan as P
from tests.unit.test_fp8_kv_cache import _kwargs, fp8_batch
from tests.unit.test_fp8_kv_words import SHAPES, words_switch  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 64
WORKLOADS = {"256xU[100,2048]": (256, 100, 2048), "64xU[200,8192]": (64, 200, 8192)}


def _paged_fp8(lengths: list[int], gen: torch.Generator):
    """An e4m3 cache [2, blocks, Hkv, 64, 128] (random values within +-448, block 0 all NaN) with the requests'
    pages scattered at random, its block table and lengths, the per-head scales."""
    pages = [-(-n // BLOCK_SIZE) for n in lengths]
    num_blocks = 1 + sum(pages)
    cache = (torch.randn(2, num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE, device="cuda", generator=gen) * 64
             ).clamp(-448, 448).to(torch.float8_e4m3fn)
    cache[:, 0] = float("nan")
    order = (torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1).to(torch.int32)
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32, device="cuda")
    used = 0
    for r, n in enumerate(pages):
        table[r, :n] = order[used:used + n]
        used += n
    scales = (torch.rand(NUM_KV_HEADS, device="cuda", generator=gen) * 0.02 + 0.005,
              torch.rand(NUM_KV_HEADS, device="cuda", generator=gen) * 0.02 + 0.005)
    return cache, table, torch.tensor(lengths, dtype=torch.int32, device="cuda"), scales


def _both(run, words_switch):
    """run() with the cache read byte-wise, then as words; the two outputs."""
    words_switch(False)
    want = run()
    words_switch(True)
    got = run()
    torch.cuda.synchronize()
    return want, got


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_bench_shapes_bit_equal(workload, words_switch):
    batch, low, high = WORKLOADS[workload]
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = torch.randint(low, high + 1, (batch,), generator=gen, device="cuda").tolist()
    cache, table, seq_lens, scales = _paged_fp8(lengths, gen)
    q = torch.randn(batch, NUM_HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16, generator=gen)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    tile = P.decode_tile(NUM_HEADS // NUM_KV_HEADS, HEAD_SIZE, split=False)

    def run():
        out = torch.full_like(q, float("nan"))
        K.unified_attention_2d(q, cache[0], cache[1], out, table, qsl, seq_lens, num_seqs=batch, num_tokens=batch,
                               scale=HEAD_SIZE ** -0.5, config=tile, mode=K.MODE_DECODES, kv_scales=scales)
        return out
    want, got = _both(run, words_switch)
    assert kv_write.fp8_kv_words(q, cache) == 1
    assert want.isfinite().all() and want.abs().max().item() > 0
    assert torch.equal(got, want), f"{(got.float() - want.float()).abs().max().item():.3g} max difference"


def test_split_kv_bucket_with_the_fused_write_and_rotary_bit_equal(words_switch):
    """8 requests (the plan splits them: 8 x 8 pairs fill no H100), their new keys normed, rotated, quantized and
    written by the attention kernel itself, as the engine's decode step launches it."""
    batch = 8
    gen = torch.Generator(device="cuda").manual_seed(1)
    lengths = torch.randint(300, 3000, (batch,), generator=gen, device="cuda").tolist()
    cache, table, seq_lens, scales = _paged_fp8(lengths, gen)
    q = torch.randn(batch, NUM_HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16, generator=gen)
    key, value = (torch.randn(batch, NUM_KV_HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16, generator=gen)
                  for _ in range(2))
    positions = (seq_lens - 1).float()[:, None]
    inv_freq = 1e6 ** (-torch.arange(0, HEAD_SIZE, 2, device="cuda").float() / HEAD_SIZE)
    cos, sin = (positions * inv_freq).cos(), (positions * inv_freq).sin()
    norms = (torch.rand(HEAD_SIZE, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    rope = (cos, sin, norms, norms.flip(0), 1e-6)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    slots = (table[torch.arange(batch), (seq_lens - 1) // BLOCK_SIZE].long() * BLOCK_SIZE
             + (seq_lens.long() - 1) % BLOCK_SIZE)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    segments = P.num_split_segments(batch, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, sms)
    assert segments > 1
    tile = P.decode_tile(NUM_HEADS // NUM_KV_HEADS, HEAD_SIZE, split=True)
    n_out, n_rows = K.segment_scratch_numel(batch, NUM_HEADS, HEAD_SIZE, segments)
    caches = []

    def run():
        written = cache.clone()
        caches.append(written)
        out = torch.full_like(q, float("nan"))
        scratch = [torch.empty(n, device="cuda") for n in (n_out, n_rows, n_rows)]
        K.unified_attention_3d(q, written[0], written[1], out, table, qsl, seq_lens, num_seqs=batch,
                               scale=HEAD_SIZE ** -0.5, config=tile, num_segments=segments, scratch_out=scratch[0],
                               scratch_max=scratch[1], scratch_sum=scratch[2], new_kv=(key, value, slots), rope=rope,
                               kv_scales=scales)
        return out
    want, got = _both(run, words_switch)
    assert want.isfinite().all()
    assert torch.equal(got, want)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))


@pytest.mark.parametrize("shape,dtype", SHAPES, ids=[s.name for s, _ in SHAPES])
def test_options_bit_equal(shape, dtype, words_switch):
    batch, scales = fp8_batch(shape, dtype, "cuda")
    K.write_kv(batch.key, batch.value, batch.kv_cache[0], batch.kv_cache[1], batch.slot_mapping, kv_scales=scales)

    def run():
        out = torch.full_like(batch.query, float("nan"))
        K.unified_attention_2d(batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table,
                               batch.query_start_loc, batch.seq_lens, num_seqs=batch.num_reqs_padded,
                               num_tokens=batch.num_tokens_padded, config=K.TileConfig(block_m=16, tile_n=16),
                               mode=K.MODE_DECODES, **_kwargs(batch, scales))
        return out
    want, got = _both(run, words_switch)
    live = batch.num_tokens
    assert want[:live].isfinite().all()
    assert torch.equal(got[:live], want[:live])
