"""The CPU SDPA backend through its builder/impl API against torch_ref over the named batch shapes, its support
reasons, and its selection on the CPU."""

import dataclasses

import pytest
import torch

from ember.attention_backends.base import BuilderContext
from ember.attention_backends.cpu_sdpa import CpuSdpaBackend
from ember.attention_backends.registry import select_backend
from ember.attention_backends.torch_ref import TorchRefBackend
from ember.kv_spec import KVCacheGroup, KVCacheSpec
from tests.helpers.paged_batches import BatchShape, common_metadata, make_paged_batch, tolerance

SHAPES = {
    "single_decode": BatchShape("single_decode", (1,), (37,)),
    "small_decode": BatchShape("small_decode", (1, 1, 1), (40, 9, 70), pad_reqs=1),
    "one_prefill": BatchShape("one_prefill", (24,), (24,)),
    "prefill_with_context": BatchShape("prefill_with_context", (7, 12), (30, 12)),
    "mixed_medium": BatchShape("mixed_medium", (1, 1, 9, 4), (20, 7, 30, 4), pad_reqs=2, pad_tokens=3),
    "mha_block8": BatchShape("mha_block8", (1, 5), (17, 21), num_heads=2, num_kv_heads=2, block_size=8),
    "gqa4_sliding": BatchShape("gqa4_sliding", (1, 1, 12), (50, 9, 30), num_heads=8, num_kv_heads=2,
                               sliding_window=8),
}


def _context(shape: BatchShape, dtype):
    spec = KVCacheSpec(shape.block_size, shape.num_kv_heads, shape.head_size, dtype, shape.sliding_window)
    return BuilderContext(KVCacheGroup(("layer.0",), spec), 0, dtype, torch.device("cpu"), 16, 256, 1024,
                          num_queries_per_kv=shape.num_heads // shape.num_kv_heads)


def _run(backend, shape, dtype, batch, share=False):
    options = shape.options()
    if share:
        options = dataclasses.replace(options, kv_sharing_target="layer.0")
    # the backends' layout is [2, blocks, block_size, Hkv, D]; the helper's is [2, blocks, Hkv, block_size, D]
    cache = batch.kv_cache.transpose(2, 3).contiguous()
    cache[:, 0] = 0.0        # the null block holds finite padding writes in an engine (see cpu_sdpa's docstring)
    out = torch.full_like(batch.query, float("nan"))
    builder = backend.builder_cls(_context(shape, dtype))
    backend.impl_cls(options).forward(batch.query, batch.key, batch.value, cache, builder.build(common_metadata(batch)),
                                      out)
    return out, cache


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_ref(name, dtype):
    shape = SHAPES[name]
    batch = make_paged_batch(shape, dtype, "cpu", torch.Generator().manual_seed(0))
    out, cache = _run(CpuSdpaBackend, shape, dtype, batch)
    ref_out, ref_cache = _run(TorchRefBackend, shape, dtype, batch)
    n = batch.num_tokens
    torch.testing.assert_close(cache[:, 1:], ref_cache[:, 1:], atol=0, rtol=0)
    assert not out[:n].isnan().any()
    # padding tokens' rows (mixed_medium has 3): zero in both, not the NaN `out` held, so that the next layer's
    # padding K/V, which go to the null block every request reads, stay finite
    assert out.shape[0] - n == (3 if name == "mixed_medium" else 0)
    assert not out[n:].any() and not ref_out[n:].any()
    err = (out[:n].float() - ref_out[:n].float()).abs().max().item()
    assert err <= tolerance(dtype), f"{name}: max abs error {err:.3g}"


def test_kv_sharing_layer_writes_nothing():
    shape = SHAPES["mixed_medium"]
    batch = make_paged_batch(shape, torch.float32, "cpu", torch.Generator().manual_seed(1))
    before = batch.kv_cache.transpose(2, 3).contiguous()
    before[:, 0] = 0.0
    _, cache = _run(CpuSdpaBackend, shape, torch.float32, batch, share=True)
    torch.testing.assert_close(cache, before, atol=0, rtol=0)


def test_one_builder_call_serves_every_layer_without_a_request_loop():
    # an ordinary step is two pieces, one gather list each: decodes then prefills
    shape = SHAPES["mixed_medium"]
    batch = make_paged_batch(shape, torch.float32, "cpu", torch.Generator().manual_seed(2))
    md = CpuSdpaBackend.builder_cls(_context(shape, torch.float32)).build(common_metadata(batch))
    decodes, prefills = md.parts
    assert (decodes.num_reqs, decodes.num_tokens, decodes.max_query_len) == (2, 2, 1)
    assert (prefills.num_reqs, prefills.num_tokens, prefills.max_query_len) == (2, 13, 9)
    assert prefills.padded_rows.tolist() == list(range(9)) + [9, 10, 11, 12]
    mask = prefills.mask_for(2, torch.float32)
    assert mask.shape == (2, 1, 18, 32) and mask is prefills.mask_for(2, torch.float32)    # built once per step
    # decodes attend with an additive mask that broadcasts over the folded query heads: 0 where a key is seen
    decode_mask = decodes.mask_for(2, torch.float32)
    assert decode_mask.shape == (2, 1, 1, decodes.span) and decode_mask.dtype == torch.float32
    seen = torch.arange(decodes.span) < decodes.seq_lens[:, None]
    assert torch.equal(decode_mask[:, 0, 0] == 0, seen) and bool(torch.isneginf(decode_mask[:, 0, 0][~seen]).all())


SPEC = KVCacheSpec(16, 2, 64, torch.float32)
OPTS = [BatchShape("x", (1,), (1,)).options()]


def test_selected_by_default_on_cpu_and_refusals_are_reported(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    sel = select_backend(SPEC, torch.float32, torch.device("cpu"), OPTS)
    assert sel.backend is CpuSdpaBackend
    assert sel.refused["triton_unified"], sel.refused
    assert "torch_ref" not in sel.refused       # it can serve, it just ranks lower


@pytest.mark.parametrize("kwargs, reason", [
    (dict(logits_soft_cap=30.0), "logit soft-capping (30.0) is not supported"),
    (dict(use_sinks=True), "attention sinks are not supported"),
    (dict(use_alibi=True), "ALiBi is not supported"),
])
def test_options_it_refuses_fall_to_torch_ref_with_the_reason(monkeypatch, kwargs, reason):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    opts = [dataclasses.replace(OPTS[0], **kwargs)]
    sel = select_backend(SPEC, torch.float32, torch.device("cpu"), opts)
    assert sel.backend is TorchRefBackend and reason in sel.refused["cpu_sdpa"]


def test_refuses_cuda_and_unsupported_dtypes():
    assert CpuSdpaBackend.supports(SPEC, torch.float32, torch.device("cuda")) == ["runs on the CPU only, not on cuda"]
    spec8 = KVCacheSpec(16, 2, 64, torch.float8_e4m3fn)
    assert "dtype torch.float8_e4m3fn is not supported (float32, bfloat16, float16, or an fp8 cache)" in \
        CpuSdpaBackend.supports(spec8, torch.float8_e4m3fn, torch.device("cpu"))
    # an fp8 cache under a float model is served (tests/unit/test_fp8_kv_cache.py); other cache dtypes are not
    assert CpuSdpaBackend.supports(spec8, torch.float32, torch.device("cpu")) == []
    assert "KV-cache dtype torch.float64 is not supported" in \
        CpuSdpaBackend.supports(KVCacheSpec(16, 2, 64, torch.float64), torch.float32, torch.device("cpu"))[0]
