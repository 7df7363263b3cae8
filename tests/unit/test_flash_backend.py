"""The flash backend through its builder/impl API on the CPU (Triton interpreter) against torch_ref: mixed batches
as two launches, decodes and prefills alone equal to together, KV sharing, its support reasons and selection."""

import dataclasses

import pytest
import torch

from ember.attention_backends.base import AttentionLayerOptions, BuilderContext, CudaGraphSupport
from ember.attention_backends.flash import backend as B
from ember.attention_backends.registry import BackendSelectionError, select_backend
from ember.attention_backends.torch_ref import TorchRefBackend
from ember.kv_spec import KVCacheGroup, KVCacheSpec
from tests.helpers.paged_batches import BatchShape, common_metadata, make_paged_batch, tolerance

Backend = B.FlashBackend


def _context(shape: BatchShape, dtype, max_num_reqs=16, max_num_tokens=256):
    spec = KVCacheSpec(shape.block_size, shape.num_kv_heads, shape.head_size, dtype, shape.sliding_window)
    return BuilderContext(KVCacheGroup(("layer.0",), spec), 0, dtype, torch.device("cpu"), max_num_reqs,
                          max_num_tokens, 1024, capture_sizes=(1, 2, 4, 8), num_sms=0)


def _flash(batch, options, uniform_decode=None):
    out = torch.full_like(batch.query, float("nan"))
    cache = batch.kv_cache.clone()
    builder = Backend.builder_cls(_context(batch.shape, batch.query.dtype))
    impl = Backend.impl_cls(options, sinks=batch.sinks)
    impl.forward(batch.query, batch.key, batch.value, cache, builder.build(common_metadata(batch, uniform_decode)),
                 out)
    return out, cache


def _reference(batch, options):
    ref_cache = batch.kv_cache.transpose(2, 3).contiguous()            # torch_ref's [2, blocks, bs, Hkv, D]
    out = torch.zeros_like(batch.query)
    builder = TorchRefBackend.builder_cls(_context(batch.shape, batch.query.dtype))
    impl = TorchRefBackend.impl_cls(options, sinks=batch.sinks)
    impl.forward(batch.query, batch.key, batch.value, ref_cache, builder.build(common_metadata(batch)), out)
    return out, ref_cache.transpose(2, 3)


CASES = {
    "mixed": BatchShape("mixed", (1, 1, 9, 4), (20, 7, 30, 4), pad_reqs=2, pad_tokens=3, block_size=64),
    "decode": BatchShape("decode", (1, 1, 1), (140, 9, 70), pad_reqs=1, block_size=64),
    "prefill_only": BatchShape("prefill", (12, 30), (40, 30), block_size=128),
    "options": BatchShape("options", (1, 12), (150, 30), sliding_window=40, soft_cap=4.0, sinks=True,
                          block_size=64),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_matches_torch_ref(case, dtype):
    shape = CASES[case]
    batch = make_paged_batch(shape, dtype, "cpu")
    out, cache = _flash(batch, shape.options())
    ref_out, ref_cache = _reference(batch, shape.options())
    # block 0 aside: torch_ref parks padding writes in the null block, this backend skips them
    torch.testing.assert_close(cache[:, 1:], ref_cache[:, 1:], atol=0, rtol=0)
    assert cache[:, 0].isnan().all()
    n = batch.num_tokens
    assert not out[:n].isnan().any()
    err = (out[:n].float() - ref_out[:n].float()).abs().max().item()
    assert err <= tolerance(dtype), f"{case}: max abs error {err:.3g}"


def _sub_batch(batch, shape, reqs: slice, rows: slice):
    """Requests `reqs` (tokens `rows`) of `batch` as a batch of their own, over the same cache."""
    qsl = batch.query_start_loc[reqs.start:reqs.stop + 1]
    return dataclasses.replace(
        batch, shape=shape, query=batch.query[rows], key=batch.key[rows], value=batch.value[rows],
        block_table=batch.block_table[reqs], query_start_loc=qsl - qsl[0], seq_lens=batch.seq_lens[reqs],
        slot_mapping=batch.slot_mapping[rows])


def test_decodes_and_prefills_together_equal_each_alone():
    mixed = BatchShape("mixed", (1, 1, 1, 14, 5), (33, 170, 9, 40, 5), block_size=64)
    batch = make_paged_batch(mixed, torch.float32, "cpu")
    together, _ = _flash(batch, mixed.options())
    decodes = _sub_batch(batch, dataclasses.replace(mixed, query_lens=(1, 1, 1), seq_lens=(33, 70, 9)),
                         slice(0, 3), slice(0, 3))
    prefills = _sub_batch(batch, dataclasses.replace(mixed, query_lens=(14, 5), seq_lens=(40, 5)),
                          slice(3, 5), slice(3, 22))
    # the same kernels on the same rows: equal to the bit
    torch.testing.assert_close(together[:3], _flash(decodes, mixed.options())[0], atol=0, rtol=0)
    torch.testing.assert_close(together[3:22], _flash(prefills, mixed.options())[0], atol=0, rtol=0)


def test_kv_sharing_layer_writes_nothing():
    shape = BatchShape("shared", (1, 6), (12, 6), block_size=64)
    batch = make_paged_batch(shape, torch.float32, "cpu")
    batch.kv_cache.copy_(batch.expected_cache)      # the owning layer wrote this step's keys already
    out, cache = _flash(batch, dataclasses.replace(shape.options(), kv_sharing_target="layer.0"))
    torch.testing.assert_close(cache, batch.expected_cache, atol=0, rtol=0, equal_nan=True)
    ref_out, _ = _reference(batch, shape.options())
    assert (out[:batch.num_tokens] - ref_out[:batch.num_tokens]).abs().max().item() <= tolerance(torch.float32)


def test_supports_reasons(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = KVCacheSpec(64, 2, 64, torch.float32)
    opts = AttentionLayerOptions(4, 2, 64, 0.125)
    cpu = torch.device("cpu")
    assert Backend.supports(spec, torch.float32, cpu, opts) == []
    assert Backend.cudagraph_support == CudaGraphSupport.ALWAYS
    reasons = Backend.supports(dataclasses.replace(spec, block_size=24), torch.bfloat16, cpu,
                               dataclasses.replace(opts, use_alibi=True, head_size=300))
    text = "; ".join(reasons)
    assert "block_size 16 is not supported" in Backend.supports(dataclasses.replace(spec, block_size=16),
                                                                torch.float32, cpu)[0]
    for expected in ("block_size 24 is not supported", "dtype bfloat16 is not supported under "
                     "TRITON_INTERPRET", "head_size 300", "ALiBi"):
        assert expected in text, text
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "TRITON_INTERPRET=1" in Backend.supports(spec, torch.float32, cpu, opts)[0]


def test_selected_by_name_and_refused_with_reasons(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = KVCacheSpec(64, 2, 64, torch.float16)
    opts = [AttentionLayerOptions(4, 2, 64, 0.125)]
    assert select_backend(spec, torch.float16, torch.device("cpu"), opts, requested="flash").backend is Backend
    with pytest.raises(BackendSelectionError, match="flash.*ALiBi"):
        select_backend(spec, torch.float16, torch.device("cpu"), [dataclasses.replace(opts[0], use_alibi=True)],
                       requested="flash")


def test_prefill_tiles_by_bucket_rows():
    """128-row tiles, registers capped for two programs an SM, from 65,536 query rows (tokens x query heads) in
    bf16/fp16; 64 x 64 tiles below, float32 halved, heads over 128 on 64 rows."""
    from ember.attention_backends.flash.kernels import FlashTiles
    from ember.attention_backends.flash.plan import prefill_tiles
    wide = FlashTiles(128, 64, 8, 3, maxnreg=128)
    assert prefill_tiles(4, 128, torch.bfloat16, 64, 2048, 8) == wide           # GQA 32/8 at 2k tokens
    assert prefill_tiles(2, 128, torch.float16, 128, 4096, 8) == wide           # GQA 16/8 at 4k tokens
    assert prefill_tiles(2, 128, torch.bfloat16, 64, 2048, 8) == FlashTiles(64, 64, 4, 3)
    assert prefill_tiles(4, 128, torch.bfloat16, 64, 1024, 8) == FlashTiles(64, 64, 4, 3)
    assert prefill_tiles(4, 128, torch.float32, 64, 16384, 8) == FlashTiles(64, 32, 4, 2)
    assert prefill_tiles(4, 256, torch.bfloat16, 64, 16384, 8) == FlashTiles(64, 64, 8, 2)
