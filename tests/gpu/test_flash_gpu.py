"""The flash backend on a GPU: full-size named batch shapes in bf16 (and fp16 on a few) against the float32
reference through the TMA and pointer tile paths, decodes and prefills together equal to alone, and CUDA-graph
replay with other data equal to eager."""

import dataclasses

import pytest
import torch

from tests.helpers.paged_batches import BatchShape, common_metadata, make_paged_batch, reference_output, tolerance

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PAGE = dict(block_size=64)   # this backend's smallest page: a whole 64-key tile
Q8 = dict(num_heads=32, num_kv_heads=8, head_size=128, **PAGE)   # Llama-3.1-8B heads
SHAPES = [
    BatchShape("small_decode", (1,) * 4, (17, 300, 1000, 64), **Q8),
    BatchShape("large_decode", (1,) * 128, tuple(range(37, 128 * 61, 61)), **Q8),
    BatchShape("single_long_decode", (1,), (32768,), **Q8),
    BatchShape("small_prefill", (20, 77, 128), (20, 77, 128), **Q8),
    BatchShape("long_prefill", (8192,), (8192,), num_heads=8, num_kv_heads=2, head_size=128, **PAGE),
    BatchShape("mixed_medium", (1,) * 32 + (500, 1000, 37), tuple(range(100, 3300, 100)) + (500, 1800, 2000), **Q8),
    BatchShape("chunked_prefill_with_context", (1, 1, 512, 700), (900, 20, 1536, 4000), **Q8),
    BatchShape("sliding_window", (1, 1, 300, 1000), (5000, 100, 700, 1000), sliding_window=256, **Q8),
    BatchShape("softcap_sinks", (1, 1, 200), (3000, 60, 900), soft_cap=30.0, sinks=True, **Q8),
    BatchShape("gqa_7", (1, 1, 99), (700, 80, 500), num_heads=28, num_kv_heads=4, head_size=128, **PAGE),
    BatchShape("gqa_16_unsplit", (1, 1, 99), (700, 80, 500), num_heads=32, num_kv_heads=2, head_size=128, **PAGE),
    BatchShape("head_size_64", (1, 1, 120), (999, 65, 1000), num_heads=16, num_kv_heads=8, head_size=64, **PAGE),
    BatchShape("head_size_80", (1, 1, 120), (999, 65, 1000), num_heads=16, num_kv_heads=8, head_size=80, **PAGE),
    BatchShape("head_size_256", (1, 1, 120), (999, 65, 1000), num_heads=8, num_kv_heads=4, head_size=256, **PAGE),
    BatchShape("padding_rows", (1, 1, 50), (400, 20, 300), pad_reqs=13, pad_tokens=77, **Q8),
]
FP16_SHAPES = ("mixed_medium", "sliding_window", "head_size_256")


def _backend():
    from ember.attention_backends.flash import backend
    return backend


def _builder(shape, dtype, max_num_reqs=256, max_num_tokens=16384, backend="flash", options=()):
    from ember.attention_backends.base import BuilderContext
    from ember.attention_backends.registry import get_backend
    from ember.kv_spec import KVCacheGroup, KVCacheSpec
    spec = KVCacheSpec(shape.block_size, shape.num_kv_heads, shape.head_size, dtype, shape.sliding_window)
    ctx = BuilderContext(KVCacheGroup(("layer.0",), spec), 0, dtype, torch.device("cuda"), max_num_reqs,
                         max_num_tokens, 65536, num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                         backend_options=tuple(options), num_queries_per_kv=shape.num_heads // shape.num_kv_heads)
    return get_backend(backend).builder_cls(ctx)


def _forward(batch, builder=None, out=None, cache=None, backend="flash", options=()):
    from ember.attention_backends.registry import get_backend
    builder = builder or _builder(batch.shape, batch.query.dtype, backend=backend, options=options)
    out = torch.full_like(batch.query, float("nan")) if out is None else out
    cache = batch.kv_cache.clone() if cache is None else cache
    impl = get_backend(backend).impl_cls(batch.shape.options(), sinks=batch.sinks)
    impl.forward(batch.query, batch.key, batch.value, cache, builder.build(common_metadata(batch)), out)
    return out, cache


def _err(out, batch):
    ref = reference_output(batch)
    got = out[:batch.num_tokens].float()
    assert not got.isnan().any(), "rows left unwritten"
    return (got - ref).abs().max().item()


CASES = [(s, torch.bfloat16, bs) for s in SHAPES for bs in (64, 128)] + \
        [(s, torch.float16, 64) for s in SHAPES if s.name in FP16_SHAPES]


@pytest.mark.parametrize("shape,dtype,block_size", CASES,
                         ids=[f"{s.name}-{str(d)[6:]}-bs{b}" for s, d, b in CASES])
def test_backend_matches_reference(shape, dtype, block_size):
    """Pages of 64 and 128 tokens: TMA tiles for power-of-two head sizes, 16-byte pointer loads otherwise."""
    batch = make_paged_batch(dataclasses.replace(shape, block_size=block_size), dtype, "cuda")
    out, cache = _forward(batch)
    torch.testing.assert_close(cache[:, 1:], batch.expected_cache[:, 1:], atol=0, rtol=0)
    assert _err(out, batch) <= tolerance(dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_per_phase_matches_reference(shape):
    """The default backend (prefill through flash, decode through triton_unified) on the same named batches."""
    batch = make_paged_batch(shape, torch.bfloat16, "cuda")
    out, cache = _forward(batch, backend="per_phase")
    torch.testing.assert_close(cache[:, 1:], batch.expected_cache[:, 1:], atol=0, rtol=0)
    assert _err(out, batch) <= tolerance(torch.bfloat16)


def test_per_phase_mixed_batch_equals_each_backend_alone():
    """Its decode rows are triton_unified's (split launch) to the bit, its prefill rows flash's."""
    mixed = next(s for s in SHAPES if s.name == "mixed_medium")
    batch = make_paged_batch(mixed, torch.bfloat16, "cuda")
    out, _ = _forward(batch, backend="per_phase")
    unified, _ = _forward(batch, backend="triton_unified", options=[("split_launch", True)])
    flash, _ = _forward(batch)
    nd, n = mixed.num_decodes, batch.num_tokens
    torch.testing.assert_close(out[:nd], unified[:nd], atol=0, rtol=0)
    torch.testing.assert_close(out[nd:n], flash[nd:n], atol=0, rtol=0)


def test_decodes_and_prefills_together_equal_each_alone():
    mixed = next(s for s in SHAPES if s.name == "mixed_medium")
    batch = make_paged_batch(mixed, torch.bfloat16, "cuda")
    together, _ = _forward(batch)
    nd = mixed.num_decodes
    qsl = batch.query_start_loc
    decodes = dataclasses.replace(
        batch, shape=dataclasses.replace(mixed, query_lens=mixed.query_lens[:nd], seq_lens=mixed.seq_lens[:nd]),
        query=batch.query[:nd], key=batch.key[:nd], value=batch.value[:nd], block_table=batch.block_table[:nd],
        query_start_loc=qsl[:nd + 1], seq_lens=batch.seq_lens[:nd], slot_mapping=batch.slot_mapping[:nd])
    n = batch.num_tokens
    prefills = dataclasses.replace(
        batch, shape=dataclasses.replace(mixed, query_lens=mixed.query_lens[nd:], seq_lens=mixed.seq_lens[nd:]),
        query=batch.query[nd:n], key=batch.key[nd:n], value=batch.value[nd:n], block_table=batch.block_table[nd:],
        query_start_loc=qsl[nd:] - nd, seq_lens=batch.seq_lens[nd:], slot_mapping=batch.slot_mapping[nd:n])
    torch.testing.assert_close(together[:nd], _forward(decodes)[0], atol=0, rtol=0)
    torch.testing.assert_close(together[nd:n], _forward(prefills)[0], atol=0, rtol=0)


@pytest.mark.parametrize("name", ["large_decode", "mixed_medium"])
def test_cuda_graph_replay_with_new_data_equals_eager(name):
    """Capture one step, then refill the same buffers with another batch of the same bucket (lengths in another
    order, other blocks, other values), re-plan, replay: equal to an eager run of the new batch."""
    shape = next(s for s in SHAPES if s.name == name)
    first = make_paged_batch(shape, torch.bfloat16, "cuda", generator=torch.Generator().manual_seed(1))
    # the decodes' lengths reversed: another plan, the same number of blocks (so the same cache tensor)
    nd = shape.num_decodes
    lens = shape.seq_lens[:nd][::-1] + shape.seq_lens[nd:]
    second = make_paged_batch(dataclasses.replace(shape, seq_lens=lens), torch.bfloat16, "cuda",
                              generator=torch.Generator().manual_seed(2))
    builder = _builder(shape, torch.bfloat16)
    B = _backend()
    impl = B.FlashBackend.impl_cls(shape.options(), sinks=first.sinks)
    out = torch.full_like(first.query, float("nan"))
    cache = first.kv_cache.clone()
    # the same persistent buffers for both steps, as the runner keeps them
    width = max(first.block_table.shape[1], second.block_table.shape[1])
    block_table = torch.zeros(first.block_table.shape[0], width, dtype=torch.int32, device="cuda")
    block_table[:, :first.block_table.shape[1]] = first.block_table
    live = dataclasses.replace(first, block_table=block_table, kv_cache=cache)
    common = common_metadata(live)
    metadata = builder.build(common)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        impl.forward(live.query, live.key, live.value, cache, metadata, out)   # warm-up (compiles)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(live.query, live.key, live.value, cache, metadata, out)

    cache.copy_(second.kv_cache)
    block_table.zero_()
    block_table[:, :second.block_table.shape[1]] = second.block_table
    for dst, src in ((live.query, second.query), (live.key, second.key), (live.value, second.value),
                     (live.seq_lens, second.seq_lens), (live.query_start_loc, second.query_start_loc),
                     (live.slot_mapping, second.slot_mapping)):
        dst.copy_(src)
    out.fill_(float("nan"))
    builder.build(common_metadata(dataclasses.replace(live, shape=second.shape)))   # the plan of the new step
    graph.replay()
    torch.cuda.synchronize()
    eager, _ = _forward(second)
    n = second.num_tokens
    torch.testing.assert_close(out[:n], eager[:n], atol=0, rtol=0)
    assert _err(out, second) <= tolerance(torch.bfloat16)
