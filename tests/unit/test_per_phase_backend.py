"""The per-phase backend on the CPU (Triton interpreter): a mixed batch equals each backend alone (the decodes
`triton_unified`'s rows to the bit, the prefills `flash`'s), a uniform-decode step is `triton_unified`'s, both match
torch_ref, and `auto` picks it where both backends serve, with the reasons where it cannot."""

import dataclasses

import pytest
import torch

from ember.attention_backends.base import AttentionLayerOptions, BuilderContext
from ember.attention_backends.flash.backend import FlashBackend
from ember.attention_backends.per_phase import PerPhaseBackend
from ember.attention_backends.registry import select_backend
from ember.attention_backends.torch_ref import TorchRefBackend
from ember.attention_backends.triton_unified.backend import TritonUnifiedBackend
from ember.config import default_block_size
from ember.kv_spec import KVCacheGroup, KVCacheSpec
from tests.helpers.paged_batches import BatchShape, common_metadata, make_paged_batch, tolerance


def _context(shape: BatchShape, dtype, options=(), num_sms=0):
    spec = KVCacheSpec(shape.block_size, shape.num_kv_heads, shape.head_size, dtype, shape.sliding_window)
    return BuilderContext(KVCacheGroup(("layer.0",), spec), 0, dtype, torch.device("cpu"), 16, 256, 1024,
                          capture_sizes=(1, 2, 4, 8), num_sms=num_sms, backend_options=tuple(options),
                          num_queries_per_kv=shape.num_heads // shape.num_kv_heads)


def _run(backend, batch, options=(), uniform_decode=None, num_sms=0):
    """(output, cache) of one layer's call through `backend`'s builder and impl."""
    out = torch.full_like(batch.query, float("nan"))
    cache = batch.kv_cache.clone()
    if backend is TorchRefBackend:
        cache = cache.transpose(2, 3).contiguous()                     # torch_ref's [2, blocks, bs, Hkv, D]
    builder = backend.builder_cls(_context(batch.shape, batch.query.dtype, options, num_sms))
    impl = backend.impl_cls(batch.shape.options(), sinks=batch.sinks)
    impl.forward(batch.query, batch.key, batch.value, cache, builder.build(common_metadata(batch, uniform_decode)),
                 out)
    return out, cache.transpose(2, 3) if backend is TorchRefBackend else cache


# decodes first, then a chunk over cached context, a whole prompt and a one-token prefill tail; padding rows
MIXED = BatchShape("mixed", (1, 1, 1, 14, 40, 2), (33, 170, 9, 140, 40, 66), pad_reqs=2, pad_tokens=3,
                   block_size=64)


# num_sms 8: the decode launch takes the split-KV kernel; 0: the 2D one
@pytest.mark.parametrize("dtype,num_sms", [(torch.float32, 0), (torch.float16, 8)])
def test_mixed_batch_equals_each_backend_alone(dtype, num_sms):
    batch = make_paged_batch(MIXED, dtype, "cpu", torch.Generator().manual_seed(1))
    out, cache = _run(PerPhaseBackend, batch, num_sms=num_sms)
    unified, unified_cache = _run(TritonUnifiedBackend, batch, [("split_launch", True)], num_sms=num_sms)
    flash, _ = _run(FlashBackend, batch, num_sms=num_sms)
    d, n = MIXED.num_decodes, batch.num_tokens
    torch.testing.assert_close(out[:d], unified[:d], atol=0, rtol=0)
    torch.testing.assert_close(out[d:n], flash[d:n], atol=0, rtol=0)
    torch.testing.assert_close(cache, unified_cache, atol=0, rtol=0, equal_nan=True)
    ref, ref_cache = _run(TorchRefBackend, batch)
    torch.testing.assert_close(cache[:, 1:], ref_cache[:, 1:], atol=0, rtol=0)
    err = (out[:n].float() - ref[:n].float()).abs().max().item()
    assert err <= tolerance(dtype), f"max abs error {err:.3g} against torch_ref"


def test_uniform_decode_is_triton_unified():
    """The decode bucket launches what triton_unified launches: its fused K/V write, its output to the bit."""
    shape = BatchShape("decode", (1, 1, 1), (140, 9, 70), pad_reqs=1, block_size=64)
    batch = make_paged_batch(shape, torch.float32, "cpu", torch.Generator().manual_seed(2))
    out, cache = _run(PerPhaseBackend, batch, num_sms=8)
    unified, unified_cache = _run(TritonUnifiedBackend, batch, num_sms=8)
    torch.testing.assert_close(out[:3], unified[:3], atol=0, rtol=0)
    torch.testing.assert_close(cache, unified_cache, atol=0, rtol=0, equal_nan=True)
    ref, _ = _run(TorchRefBackend, batch)
    assert (out[:3] - ref[:3]).abs().max().item() <= tolerance(torch.float32)


def test_options_match_torch_ref():
    shape = BatchShape("options", (1, 12, 40), (150, 30, 100), sliding_window=40, soft_cap=4.0, sinks=True,
                       block_size=128)
    batch = make_paged_batch(shape, torch.float16, "cpu", torch.Generator().manual_seed(3))
    out, _ = _run(PerPhaseBackend, batch)
    ref, _ = _run(TorchRefBackend, batch)
    n = batch.num_tokens
    assert (out[:n].float() - ref[:n].float()).abs().max().item() <= tolerance(torch.float16)


def test_auto_picks_it_where_both_serve(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu, opts = torch.device("cpu"), [AttentionLayerOptions(4, 2, 64, 0.125)]
    spec = KVCacheSpec(64, 2, 64, torch.float16)
    assert select_backend(spec, torch.float16, cpu, opts).backend is PerPhaseBackend
    small = select_backend(dataclasses.replace(spec, block_size=16), torch.float16, cpu, opts)
    assert small.backend is TritonUnifiedBackend
    assert "block_size 16 is not supported" in "; ".join(small.refused["per_phase"])
    alibi = select_backend(spec, torch.float16, cpu, [dataclasses.replace(opts[0], use_alibi=True)])
    assert alibi.backend is TritonUnifiedBackend
    assert any("ALiBi" in r for r in alibi.refused["per_phase"])
    assert PerPhaseBackend.kv_cache_shape(5, 64, 2, 64) == FlashBackend.kv_cache_shape(5, 64, 2, 64) == \
        TritonUnifiedBackend.kv_cache_shape(5, 64, 2, 64) == (2, 5, 2, 64, 64)


def test_split_launch_option_refused():
    shape = BatchShape("decode", (1,), (10,), block_size=64)
    with pytest.raises(ValueError, match="split_launch is not an option of the per_phase backend"):
        PerPhaseBackend.builder_cls(_context(shape, torch.float32, [("split_launch", True)]))
    assert "split_launch" not in PerPhaseBackend.option_names
    assert "short_decode_len" in PerPhaseBackend.option_names


def test_default_block_size():
    # CUDA with a backend that reads 64-token pages (auto picks per_phase there): 64; else the unified default
    assert default_block_size("cuda", "auto") == 64
    assert default_block_size("cuda", "per_phase") == 64
    assert default_block_size("cuda", "flash") == 64
    assert default_block_size("cuda", "triton_unified") == 16
    assert default_block_size("cpu", "auto") == 16
