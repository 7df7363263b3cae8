"""The Triton unified backend through its builder/impl API on the CPU (TRITON_INTERPRET=1) against torch_ref, its
support reasons, and the bucket-only kernel plan."""

import dataclasses

import pytest
import torch

from ember.attention_backends.base import AttentionLayerOptions, BuilderContext, CudaGraphSupport
from ember.attention_backends.torch_ref import TorchRefBackend
from ember.attention_backends.triton_unified import backend as B
from ember.attention_backends.triton_unified import plan as P
from tests.helpers.paged_batches import BatchShape, common_metadata, make_paged_batch, tolerance
from ember.kv_spec import KVCacheGroup, KVCacheSpec

Backend = B.TritonUnifiedBackend


def _context(shape: BatchShape, dtype, num_sms=0, split_launch=False, max_num_reqs=16, max_num_tokens=256,
             fused_write=None, extra_options=()):
    spec = KVCacheSpec(shape.block_size, shape.num_kv_heads, shape.head_size, dtype, shape.sliding_window)
    group = KVCacheGroup(("layer.0",), spec)
    options = (("split_launch", split_launch),)
    if fused_write is not None:   # None: the builder's default
        options += (("fused_decode_kv_write", fused_write),)
    options += tuple(extra_options)
    return BuilderContext(group, 0, dtype, torch.device("cpu"), max_num_reqs, max_num_tokens, 1024,
                          capture_sizes=(1, 2, 4, 8), num_sms=num_sms, backend_options=options)


def _run_both(shape: BatchShape, dtype, *, num_sms=0, split_launch=False, uniform_decode=None, share=False,
              fused_write=None, seed=0, extra_options=()):
    """(triton output, triton cache, reference output, reference cache in the triton layout)."""
    batch = make_paged_batch(shape, dtype, "cpu", torch.Generator().manual_seed(seed))
    common = common_metadata(batch, uniform_decode)
    options = shape.options()
    if share:
        options = dataclasses.replace(options, kv_sharing_target="layer.0")
    out = torch.full_like(batch.query, float("nan"))
    builder = Backend.builder_cls(_context(shape, dtype, num_sms, split_launch, fused_write=fused_write,
                                           extra_options=extra_options))
    impl = Backend.impl_cls(options, sinks=batch.sinks, alibi_slopes=batch.alibi_slopes)
    cache = batch.kv_cache.clone()
    impl.forward(batch.query, batch.key, batch.value, cache, builder.build(common), out)

    ref_cache = batch.kv_cache.transpose(2, 3).contiguous()            # torch_ref's [2, blocks, bs, Hkv, D]
    ref_out = torch.zeros_like(batch.query)
    ref_builder = TorchRefBackend.builder_cls(_context(shape, dtype))
    ref_impl = TorchRefBackend.impl_cls(options, sinks=batch.sinks, alibi_slopes=batch.alibi_slopes)
    ref_impl.forward(batch.query, batch.key, batch.value, ref_cache, ref_builder.build(common), ref_out)
    return batch, out, cache, ref_out, ref_cache.transpose(2, 3)


CASES = {
    "mixed_single_launch": (BatchShape("mixed", (1, 1, 9, 4), (20, 7, 30, 4), pad_reqs=2, pad_tokens=3), {}),
    "mixed_split_launch": (BatchShape("mixed", (1, 1, 9, 4), (20, 7, 30, 4), pad_reqs=2, pad_tokens=3),
                           dict(split_launch=True)),
    "decode_3d": (BatchShape("decode", (1, 1, 1), (40, 9, 70), pad_reqs=1), dict(num_sms=8)),
    "decode_2d": (BatchShape("decode", (1, 1, 1), (40, 9, 70), pad_reqs=1), {}),
    "options_split": (BatchShape("options", (1, 12), (50, 30), sliding_window=8, soft_cap=4.0, sinks=True,
                                 alibi=True), dict(split_launch=True, num_sms=4)),
}

DECODE_CASES = {
    "decode_3d": CASES["decode_3d"],
    "decode_2d": CASES["decode_2d"],
    "decode_options_3d": (BatchShape("options", (1, 1, 1), (50, 16, 33), sliding_window=8, soft_cap=4.0, sinks=True,
                                     alibi=True, pad_reqs=1, pad_tokens=2), dict(num_sms=8)),
    "decode_gqa_4": (BatchShape("gqa", (1, 1), (31, 64), num_heads=8, num_kv_heads=2, pad_reqs=2), {}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_matches_torch_ref(case, dtype):
    shape, kwargs = CASES[case]
    batch, out, cache, ref_out, ref_cache = _run_both(shape, dtype, **kwargs)
    plan = P.plan_launch(batch.num_tokens_padded, batch.num_reqs_padded, shape.num_decodes == len(shape.query_lens),
                         shape.num_heads, shape.num_kv_heads, shape.head_size, kwargs.get("num_sms", 0),
                         kwargs.get("split_launch", False))
    assert (plan.num_segments > 1) == (case in ("decode_3d", "options_split"))   # the case runs the kernel it names
    n = batch.num_tokens
    # block 0 aside: torch_ref parks padding writes in the null block, this backend skips them
    torch.testing.assert_close(cache[:, 1:], ref_cache[:, 1:], atol=0, rtol=0)
    assert cache[:, 0].isnan().all()
    err = (out[:n].float() - ref_out[:n].float()).abs().max().item()
    assert err <= tolerance(dtype), f"{case}: max abs error {err:.3g}"


@pytest.mark.parametrize("case", ["decode_3d", "decode_2d", "decode_options_3d", "decode_gqa_4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_uniform_decode_writes_kv_in_the_attention_launch_or_not_alike(case, dtype):
    """`fused_decode_kv_write` on and off: both match torch_ref and leave the same cache, byte for byte."""
    shape, kwargs = DECODE_CASES[case]
    plan = P.plan_launch(len(shape.query_lens) + shape.pad_reqs, len(shape.query_lens) + shape.pad_reqs, True,
                         shape.num_heads, shape.num_kv_heads, shape.head_size, kwargs.get("num_sms", 0), False)
    assert (plan.num_segments > 1) == case.endswith("3d") and plan.rest is None   # the kernel the case names
    _, out_on, cache_on, ref_out, ref_cache = _run_both(shape, dtype, fused_write=True, **kwargs)
    batch, out_off, cache_off, _, _ = _run_both(shape, dtype, fused_write=False, **kwargs)
    torch.testing.assert_close(cache_on, cache_off, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(cache_on[:, 1:], ref_cache[:, 1:], atol=0, rtol=0)
    n = batch.num_tokens
    for out in (out_on, out_off):
        err = (out[:n].float() - ref_out[:n].float()).abs().max().item()
        assert err <= tolerance(dtype), f"{case}: max abs error {err:.3g}"


@pytest.mark.parametrize("shape,uniform,fused_write,share,writes", [
    (DECODE_CASES["decode_2d"][0], True, None, False, 0),     # on by default: the attention launch writes
    (DECODE_CASES["decode_2d"][0], True, False, False, 1),
    (BatchShape("mixed", (1, 5), (9, 12)), False, True, False, 1),   # a prefill in the step: the write kernel
    (DECODE_CASES["decode_2d"][0], True, True, True, 0),      # KV sharing: nothing writes
], ids=["decode_default", "decode_off", "mixed_on", "decode_shared"])
def test_write_kernel_launches_only_where_the_attention_launch_does_not_write(monkeypatch, shape, uniform,
                                                                             fused_write, share, writes):
    calls = []
    monkeypatch.setattr(B, "write_kv", lambda *args, **kwargs: calls.append(args))
    batch = make_paged_batch(shape, torch.float32, "cpu")
    options = shape.options()
    if share:
        options = dataclasses.replace(options, kv_sharing_target="layer.0")
    metadata = Backend.builder_cls(_context(shape, torch.float32, fused_write=fused_write)).build(
        common_metadata(batch, uniform))
    assert metadata.fused_decode_kv_write == (fused_write is not False)
    cache = batch.kv_cache.clone()
    Backend.impl_cls(options).forward(batch.query, batch.key, batch.value, cache, metadata,
                                      torch.empty_like(batch.query))
    assert len(calls) == writes
    # the fused decode wrote the new tokens itself; the stubbed write kernel and a sharing layer wrote nothing
    assert torch.equal(cache.nan_to_num(), batch.expected_cache.nan_to_num()) == (uniform and not share
                                                                                  and fused_write is not False)


SINGLE_SEGMENT_CASES = {
    "plain": BatchShape("decode", (1, 1, 1), (40, 9, 70), pad_reqs=1),
    "sinks_softcap_alibi": BatchShape("options", (1, 1, 1), (150, 16, 33), soft_cap=4.0, sinks=True, alibi=True,
                                      pad_reqs=1, pad_tokens=2),
    "window": BatchShape("window", (1, 1, 1), (150, 16, 100), sliding_window=70, num_heads=8, num_kv_heads=2),
}


@pytest.mark.parametrize("case", list(SINGLE_SEGMENT_CASES))
@pytest.mark.parametrize("fused_write", [True, False])
def test_single_segment_decodes_match_torch_ref(case, fused_write):
    """`single_segment_tiles`: the short requests of a split-KV decode launch run in one program each, the long ones
    still split (each case holds both), alike with the KV write in the launch or before it."""
    shape = SINGLE_SEGMENT_CASES[case]
    tile_n = P.decode_tile(shape.num_heads // shape.num_kv_heads, shape.head_size).tile_n
    window = shape.sliding_window or 1 << 30
    tiles = [-(-n // tile_n) - max(n - window, 0) // tile_n for n in shape.seq_lens]
    single = 1
    assert min(tiles) <= single < max(tiles)
    reqs = len(shape.query_lens) + shape.pad_reqs
    assert P.plan_launch(reqs, reqs, True, shape.num_heads, shape.num_kv_heads, shape.head_size, 8,
                         False).num_segments > 1
    batch, out, cache, ref_out, ref_cache = _run_both(shape, torch.float32, fused_write=fused_write, num_sms=8,
                                                      extra_options=(("single_segment_tiles", single),))
    torch.testing.assert_close(cache[:, 1:], ref_cache[:, 1:], atol=0, rtol=0)
    n = batch.num_tokens
    err = (out[:n] - ref_out[:n]).abs().max().item()
    assert err <= tolerance(torch.float32), f"{case}: max abs error {err:.3g}"


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_single_segment_tiles_rejects_bad_values(bad):
    shape = DECODE_CASES["decode_3d"][0]
    with pytest.raises(ValueError, match=f"single_segment_tiles {bad!r} is not a non-negative number"):
        Backend.builder_cls(_context(shape, torch.float32, 8, extra_options=(("single_segment_tiles", bad),)))


@pytest.mark.parametrize("shape,fused_write", [(BatchShape("shared", (1, 6), (12, 6)), None),
                                               (DECODE_CASES["decode_2d"][0], True),
                                               (DECODE_CASES["decode_3d"][0], True)],
                         ids=["mixed", "decode_2d_fused_on", "decode_3d_fused_on"])
def test_kv_sharing_layer_writes_nothing(shape, fused_write):
    num_sms = 8 if shape is DECODE_CASES["decode_3d"][0] else 0
    batch, out, cache, ref_out, _ = _run_both(shape, torch.float32, share=True, fused_write=fused_write,
                                              num_sms=num_sms)
    torch.testing.assert_close(cache, batch.kv_cache, atol=0, rtol=0, equal_nan=True)
    assert (out[:batch.num_tokens] - ref_out[:batch.num_tokens]).abs().max().item() <= tolerance(torch.float32)


def test_builder_fills_decode_count_in_place_and_sizes_scratch():
    shape = BatchShape("b", (1, 1, 5), (9, 3, 5))
    builder = Backend.builder_cls(_context(shape, torch.float32, num_sms=4, split_launch=True))
    first = builder.build(common_metadata(make_paged_batch(shape, torch.float32, "cpu")))
    assert int(first.num_decodes[0]) == 2
    assert (first.num_decode_tokens, first.num_prefill_tokens) == (2, 5)
    second_shape = BatchShape("b", (1, 1, 1, 2), (9, 3, 5, 8))
    second = builder.build(common_metadata(make_paged_batch(second_shape, torch.float32, "cpu")))
    assert second.num_decodes.data_ptr() == first.num_decodes.data_ptr() and int(first.num_decodes[0]) == 3
    assert second.scratch_out.data_ptr() == first.scratch_out.data_ptr()
    # scratch covers every decode bucket's 3D launch up to max_num_reqs, for any head grouping up to the cap
    segments = {n: P.num_split_segments(n, shape.num_kv_heads, 2, 4) for n in range(1, 17)}
    need = max(s * n * shape.num_kv_heads * P.MAX_GROUP_3D for n, s in segments.items() if s > 1)
    assert first.scratch_max.numel() >= need > 0
    assert first.scratch_out.numel() == first.scratch_max.numel() * 64


def test_kv_cache_layout_and_class_description():
    assert Backend.kv_cache_shape(10, 16, 8, 128) == (2, 10, 8, 16, 128)
    assert Backend.cudagraph_support == CudaGraphSupport.ALWAYS
    assert Backend.priority > TorchRefBackend.priority


@pytest.mark.parametrize("env,dtype,head_size,heads,expect", [
    ("1", torch.float32, 64, (4, 2), []),
    ("1", torch.float16, 80, (32, 8), []),
    ("0", torch.float32, 64, (4, 2), ["TRITON_INTERPRET=1"]),
    ("1", torch.bfloat16, 64, (4, 2), ["bfloat16 is not supported under TRITON_INTERPRET"]),
    ("1", torch.float64, 64, (4, 2), ["dtype torch.float64 is not supported"]),
    ("1", torch.float32, 300, (4, 2), ["head_size 300 is not supported"]),
    ("1", torch.float32, 64, (6, 4), ["num_heads 6 is not a multiple of num_kv_heads 4"]),
    ("1", torch.float32, 64, (256, 1), ["256 query heads per KV head"]),
])
def test_supports_reasons_on_cpu(monkeypatch, env, dtype, head_size, heads, expect):
    monkeypatch.setenv("TRITON_INTERPRET", env)   # read at call time
    spec = KVCacheSpec(16, heads[1], head_size, dtype)
    options = AttentionLayerOptions(heads[0], heads[1], head_size, 1.0)
    reasons = Backend.supports(spec, dtype, torch.device("cpu"), options)
    assert len(reasons) >= len(expect) and all(any(e in r for r in reasons) for e in expect), reasons
    if not expect:
        assert reasons == []


def test_supports_bfloat16_on_cuda_device_description():
    spec = KVCacheSpec(16, 8, 128, torch.bfloat16)
    assert Backend.supports(spec, torch.bfloat16, torch.device("cuda"), AttentionLayerOptions(32, 8, 128, 1.0)) == []


def test_plan_uses_split_kv_only_for_small_decode_buckets():
    # H100-like: 132 SMs, 8 KV heads, 2 query heads per KV head
    small = P.plan_launch(1, 1, True, 16, 8, 128, 132, False)
    assert small.decode is not None and small.rest is None and small.num_segments == P.MAX_SEGMENTS
    assert P.plan_launch(8, 8, True, 16, 8, 128, 132, False).num_segments == 16   # 64 pairs -> 528/64 -> 16
    large = P.plan_launch(64, 64, True, 16, 8, 128, 132, False)
    assert large.num_segments == 1 and large.decode.block_m == 16
    assert P.plan_launch(1, 1, True, 16, 8, 128, 0, False).num_segments == 1          # no SM count: 2D
    assert P.plan_launch(1, 1, True, 8 * 32, 8, 128, 132, False).num_segments == 1    # group 32 > cap: 2D


def test_plan_mixed_buckets():
    single = P.plan_launch(512, 64, False, 32, 8, 128, 132, False)
    assert single.decode is None and single.rest_mode == P.MODE_ALL
    assert single.rest.block_m == 32            # average 8 tokens x 4 heads
    assert P.plan_launch(8192, 2, False, 32, 8, 128, 132, False).rest.block_m == 128
    assert P.plan_launch(8192, 2, False, 32, 8, 256, 132, False).rest.block_m == 64
    split = P.plan_launch(512, 64, False, 32, 8, 128, 132, True)
    assert split.decode_count_on_device and split.num_decode_seqs == 64 and split.rest_mode == P.MODE_PREFILLS
    assert split.rest.block_m == 128 and split.decode.block_m == 16
    assert P.plan_launch(4, 64, False, 32, 8, 128, 132, True).num_decode_seqs == 4


@pytest.mark.parametrize("value", [False, 0, "off"])
def test_split_kv_off_decodes_in_the_2d_kernel(value):
    """`split_kv` off: a decode bucket that would split (8 SMs, 3 requests) plans the 2D kernel, sizes no segment
    scratch, and still matches torch_ref."""
    shape, _ = CASES["decode_3d"]
    reqs = len(shape.query_lens) + shape.pad_reqs
    assert P.plan_launch(reqs, reqs, True, shape.num_heads, shape.num_kv_heads, shape.head_size, 8,
                         False).num_segments > 1
    builder = Backend.builder_cls(_context(shape, torch.float32, 8, extra_options=(("split_kv", value),)))
    assert builder.scratch_max.numel() == 0
    batch = make_paged_batch(shape, torch.float32, "cpu", torch.Generator().manual_seed(0))
    metadata = builder.build(common_metadata(batch, None))
    impl = Backend.impl_cls(shape.options(), sinks=batch.sinks, alibi_slopes=batch.alibi_slopes)
    assert metadata.num_sms == 0 and impl._plan(metadata).num_segments == 1
    batch, out, cache, ref_out, ref_cache = _run_both(shape, torch.float32, num_sms=8,
                                                      extra_options=(("split_kv", value),))
    torch.testing.assert_close(cache[:, 1:], ref_cache[:, 1:], atol=0, rtol=0)
    n = batch.num_tokens
    assert (out[:n] - ref_out[:n]).abs().max().item() <= tolerance(torch.float32)


def test_short_decode_graphs_plan_the_2d_kernel():
    """A decode bucket that splits (8 SMs, 3 requests) asks for a short-context graph; metadata built for one
    (`max_seq_len_bound` within `short_decode_len`) plans the 2D kernel and matches torch_ref; a longer bound, an
    unbounded step and `short_decode_len=0` keep split-KV."""
    shape, _ = CASES["decode_3d"]
    reqs = len(shape.query_lens) + shape.pad_reqs
    batch = make_paged_batch(shape, torch.float32, "cpu", torch.Generator().manual_seed(0))
    impl = Backend.impl_cls(shape.options(), sinks=batch.sinks, alibi_slopes=batch.alibi_slopes)
    builder = Backend.builder_cls(_context(shape, torch.float32, 8, extra_options=(("short_decode_len", 128),)))
    assert builder.short_context_len(reqs) == 128 and builder.short_context_len(64) is None   # 64 x Hkv: 2D anyway
    assert max(shape.seq_lens) <= 128
    common = common_metadata(batch, None)
    short = builder.build(dataclasses.replace(common, max_seq_len_bound=128))
    assert short.num_sms == 0 and impl._plan(short).num_segments == 1
    for bound in (None, 129):
        split = builder.build(dataclasses.replace(common, max_seq_len_bound=bound))
        assert split.num_sms == 8 and impl._plan(split).num_segments > 1
    off = Backend.builder_cls(_context(shape, torch.float32, 8, extra_options=(("short_decode_len", 0),)))
    assert off.short_context_len(reqs) is None
    assert off.build(dataclasses.replace(common, max_seq_len_bound=128)).num_sms == 8
    no_split = Backend.builder_cls(_context(shape, torch.float32, 8, extra_options=(("split_kv", "off"),)))
    assert no_split.short_context_len(reqs) is None
    out = torch.full_like(batch.query, float("nan"))
    cache = batch.kv_cache.clone()
    impl.forward(batch.query, batch.key, batch.value, cache, short, out)
    _, _, _, ref_out, ref_cache = _run_both(shape, torch.float32, num_sms=8)
    torch.testing.assert_close(cache[:, 1:], ref_cache[:, 1:], atol=0, rtol=0)
    n = batch.num_tokens
    assert (out[:n] - ref_out[:n]).abs().max().item() <= tolerance(torch.float32)


def test_short_decode_graphs_by_default_only_for_narrow_query_tiles():
    """Unset, `short_decode_len` is SHORT_DECODE_LEN where query heads per KV head x head size is at most
    SHORT_DECODE_MAX_WIDTH, and off for wider groups (split-KV measured faster there); a value given wins."""
    from ember.attention_backends.triton_unified.plan import SHORT_DECODE_LEN, SHORT_DECODE_MAX_WIDTH
    shape, _ = CASES["decode_3d"]
    reqs = len(shape.query_lens) + shape.pad_reqs
    widest = SHORT_DECODE_MAX_WIDTH // shape.head_size
    assert widest >= 1
    for group, expected in ((widest, SHORT_DECODE_LEN), (widest * 2, None)):
        ctx = dataclasses.replace(_context(shape, torch.float32, 8), num_queries_per_kv=group)
        assert Backend.builder_cls(ctx).short_context_len(reqs) == expected, group
    wide = dataclasses.replace(_context(shape, torch.float32, 8, extra_options=(("short_decode_len", 64),)),
                               num_queries_per_kv=widest * 2)
    assert Backend.builder_cls(wide).short_context_len(reqs) == 64


@pytest.mark.parametrize("bad", [-1, "long", 1.5, True])
def test_short_decode_len_rejects_what_is_not_a_length(bad):
    shape, _ = CASES["decode_3d"]
    with pytest.raises(ValueError, match=f"short_decode_len {bad!r} is not a non-negative number"):
        Backend.builder_cls(_context(shape, torch.float32, 8, extra_options=(("short_decode_len", bad),)))


@pytest.mark.parametrize("name", ["split_kv", "split_launch", "fused_decode_kv_write"])
@pytest.mark.parametrize("bad", ["maybe", 2, -1, 0.5])
def test_flag_options_reject_what_is_not_on_or_off(name, bad):
    shape, _ = CASES["decode_3d"]
    with pytest.raises(ValueError, match=f"{name} {bad!r} is not on or off"):
        Backend.builder_cls(_context(shape, torch.float32, 8, extra_options=((name, bad),)))
