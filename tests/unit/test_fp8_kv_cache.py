"""An fp8 (e4m3) KV cache on the CPU: the cache writes quantize K and V by their head's scale (the same bytes in
every backend as in torch), and every backend attends the dequantized cache: the Triton kernels interpreted (2D,
3D split-KV with the fused write of the new keys, flash prefill and decode), torch_ref and cpu_sdpa, against the
float32 reference over the dequantized cache. Plus the cache's sizing, the start-up log and the refusals.

Tolerances are the model dtype's (tests.helpers.paged_batches.tolerance): the kernels widen e4m3 exactly to q's
dtype, so what the cache's quantization costs is already in the reference."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import triton
import triton.language as tl

import ember.attention_backends.flash.kernels as F
import ember.attention_backends.triton_unified.kernels as K
from ember.attention_backends.torch_ref import quantize_kv
from ember.kernels.e4m3 import to_f16_saturated
from ember.kv_spec import KVCacheSpec
from tests.helpers.paged_batches import BatchShape, make_paged_batch, reference_output, tolerance

FP8 = torch.float8_e4m3fn


def _scales(num_kv_heads: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Different scales per head and for K and V (so a scale applied to the wrong head or half shows); small
    enough that unit-normal values use e4m3's range, and some saturate at 448."""
    k = torch.tensor([0.01, 0.03, 0.004, 0.02][:num_kv_heads]) if num_kv_heads <= 4 else torch.full((num_kv_heads,),
                                                                                                     0.01)
    return k.to(device), (k.flip(0) * 1.5).to(device)


def _quantized(cache: torch.Tensor, scales) -> torch.Tensor:
    """A head-major [2, blocks, Hkv, block_size, D] cache as an fp8 cache holds it (NaN stays NaN)."""
    out = torch.empty(cache.shape, dtype=FP8, device=cache.device)
    for half in (0, 1):
        rows = cache[half].transpose(1, 2)                       # [blocks, bs, Hkv, D]
        out[half] = quantize_kv(rows.reshape(-1, *rows.shape[2:]), scales[half]).view(rows.shape).transpose(1, 2)
    return out


def _dequantized(cache: torch.Tensor, scales) -> torch.Tensor:
    """float64 (exact products; the reference takes a float32 copy)."""
    return torch.stack([cache[h].double() * scales[h].double()[None, :, None, None] for h in (0, 1)])


def fp8_batch(shape: BatchShape, dtype: torch.dtype, device="cpu"):
    """A paged batch whose cache is e4m3 (its context quantized in torch), and whose reference cache is that
    context and the new tokens quantized and dequantized; the new tokens are not in the cache yet."""
    batch = make_paged_batch(shape, dtype, device)
    scales = _scales(shape.num_kv_heads, device)
    expected = _dequantized(_quantized(batch.expected_cache.float(), scales), scales)
    return dataclasses.replace(batch, kv_cache=_quantized(batch.kv_cache.float(), scales),
                               expected_cache=expected), scales


def _assert_matches(out, batch, dtype):
    ref = reference_output(batch)
    got = out[:batch.num_tokens].float()
    assert not got.isnan().any(), "some rows were not written"
    err = (got - ref).abs().max().item()
    assert err <= tolerance(dtype), f"{batch.shape.name}: max abs error {err:.3g} > {tolerance(dtype)}"


def test_write_quantizes_as_torch_does_and_skips_padding():
    shape = BatchShape("write", (1, 7, 20), (9, 7, 40), pad_tokens=4, num_heads=4, num_kv_heads=2)
    batch, scales = fp8_batch(shape, torch.float32)
    batch.key[:3] *= 30                            # some values past 448 x scale: they saturate
    K.write_kv(batch.key, batch.value, batch.kv_cache[0], batch.kv_cache[1], batch.slot_mapping, kv_scales=scales)
    rows = batch.slot_mapping[:batch.num_tokens]
    blk, off = rows // shape.block_size, rows % shape.block_size
    for half, source in ((0, batch.key), (1, batch.value)):
        want = quantize_kv(source[:batch.num_tokens], scales[half])                 # [T, Hkv, D]
        got = batch.kv_cache[half][blk, :, off]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert batch.kv_cache[0, 0].float().isnan().all(), "the null block was written"
    assert batch.kv_cache[0, 1:].float().abs().max().item() == 448.0


DECODES = BatchShape("ragged_decode", (1,) * 5, (3, 90, 16, 47, 64))
MIXED = BatchShape("mixed", (1, 1, 7, 3), (9, 20, 7, 30))
WINDOW = BatchShape("sliding_window", (1, 1, 30, 9), (60, 7, 50, 40), sliding_window=16)
SOFTCAP = BatchShape("softcap_gqa", (1, 12, 25), (40, 30, 25), soft_cap=2.0, num_heads=4, num_kv_heads=2)


def _kwargs(batch, scales):
    s = batch.shape
    return dict(scale=s.head_size ** -0.5, sliding_window=s.sliding_window, soft_cap=s.soft_cap, sinks=batch.sinks,
                alibi_slopes=batch.alibi_slopes, kv_scales=scales)


@pytest.mark.parametrize("shape,dtype", [(MIXED, torch.float32), (WINDOW, torch.float16), (SOFTCAP, torch.float32)],
                         ids=["mixed-fp32", "sliding_window-fp16", "softcap_gqa-fp32"])
def test_2d_kernel_attends_the_dequantized_cache(shape, dtype):
    batch, scales = fp8_batch(shape, dtype)
    K.write_kv(batch.key, batch.value, batch.kv_cache[0], batch.kv_cache[1], batch.slot_mapping, kv_scales=scales)
    out = torch.full_like(batch.query, float("nan"))
    K.unified_attention_2d(batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table,
                           batch.query_start_loc, batch.seq_lens, num_seqs=batch.num_reqs_padded,
                           num_tokens=batch.num_tokens_padded, config=K.TileConfig(block_m=32, tile_n=32),
                           **_kwargs(batch, scales))
    _assert_matches(out, batch, dtype)


def test_2d_kernel_multiplies_bfloat16_queries_in_float16(monkeypatch):
    """bfloat16 queries and the e4m3 cache meet in float16 products, the default (the interpreter's bfloat16 dot is
    wrong, so this passes only through the float16 path); bfloat16's tolerance."""
    monkeypatch.delenv("EMBER_FP8_KV_F16_DOT", raising=False)
    batch, scales = fp8_batch(MIXED, torch.bfloat16)
    K.write_kv(batch.key, batch.value, batch.kv_cache[0], batch.kv_cache[1], batch.slot_mapping, kv_scales=scales)
    out = torch.full_like(batch.query, float("nan"))
    K.unified_attention_2d(batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table,
                           batch.query_start_loc, batch.seq_lens, num_seqs=batch.num_reqs_padded,
                           num_tokens=batch.num_tokens_padded, config=K.TileConfig(block_m=32, tile_n=32),
                           **_kwargs(batch, scales))
    _assert_matches(out, batch, torch.bfloat16)


@triton.jit
def _to_f16_kernel(x_ptr, y_ptr):
    offs = tl.arange(0, 4)
    tl.store(y_ptr + offs, to_f16_saturated(tl.load(x_ptr + offs)))


def test_float16_products_saturate_the_queries():
    """A query past float16's range takes +-65504 rather than inf, so its scores stay finite; the switch applies to
    bfloat16 queries over an e4m3 cache only."""
    from ember.attention_backends.triton_common.kv_write import fp8_f16_products
    from ember.kernels.interpret import interpreted
    x = torch.tensor([1e6, -1e6, 3.0, -2.5], dtype=torch.bfloat16)
    y = torch.empty(4, dtype=torch.float16)
    interpreted(_to_f16_kernel)[(1,)](x, y)
    assert y.tolist() == [65504.0, -65504.0, 3.0, -2.5]
    cache = torch.empty(1, dtype=FP8)
    assert fp8_f16_products(x, cache) and not fp8_f16_products(x.half(), cache)
    assert not fp8_f16_products(x, torch.empty(1, dtype=torch.bfloat16))


@pytest.mark.parametrize("shape", [
    DECODES,
    pytest.param(dataclasses.replace(WINDOW, query_lens=(1,) * 4, seq_lens=(60, 7, 50, 40)), marks=pytest.mark.slow),
    pytest.param(dataclasses.replace(SOFTCAP, query_lens=(1, 1, 1)), marks=pytest.mark.slow)],
    ids=["ragged", "sliding_window", "softcap_gqa"])
def test_3d_split_kv_writes_and_attends_the_new_keys_in_fp8(shape):
    """The decode launch that writes the new K/V itself (fused write) quantizes them as the write kernel does
    and attends them as the cache will hold them; the segments' partials carry the value scale."""
    dtype = torch.float16
    batch, scales = fp8_batch(shape, dtype)
    out = torch.full_like(batch.query, float("nan"))
    num_segments = 4
    n_out, n_rows = K.segment_scratch_numel(batch.num_reqs_padded, shape.num_heads, shape.head_size, num_segments)
    scratch = [torch.full((n,), float("nan")) for n in (n_out, n_rows, n_rows)]
    K.unified_attention_3d(batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table,
                           batch.query_start_loc, batch.seq_lens, num_seqs=batch.num_reqs_padded,
                           config=K.TileConfig(block_m=16, tile_n=16), num_segments=num_segments,
                           scratch_out=scratch[0], scratch_max=scratch[1], scratch_sum=scratch[2],
                           new_kv=(batch.key, batch.value, batch.slot_mapping), **_kwargs(batch, scales))
    _assert_matches(out, batch, dtype)
    written = _dequantized(batch.kv_cache, scales)[:, 1:]
    assert torch.equal(written.nan_to_num(0), batch.expected_cache[:, 1:].nan_to_num(0)), "new K/V bytes differ"


@pytest.mark.parametrize("shape", [
    dataclasses.replace(MIXED, block_size=64),
    pytest.param(dataclasses.replace(WINDOW, block_size=64), marks=pytest.mark.slow),
    pytest.param(dataclasses.replace(SOFTCAP, block_size=64), marks=pytest.mark.slow)], ids=["mixed", "window", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_flash_kernels_attend_the_dequantized_cache(shape, dtype):
    """float16 queries, and bfloat16 ones through float16 products (the interpreter's bfloat16 dot is wrong)."""
    batch, scales = fp8_batch(shape, dtype)
    F.write_kv(batch.key, batch.value, batch.kv_cache[0], batch.kv_cache[1], batch.slot_mapping, kv_scales=scales)
    out = torch.full_like(batch.query, float("nan"))
    layout = (batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table, batch.query_start_loc,
              batch.seq_lens)
    decode = F.FlashTiles(block_m=16, tile_n=16, num_warps=4, num_stages=1)
    ws = F.DecodeWorkspace(batch.num_reqs_padded, shape.num_kv_heads, shape.head_size, decode.tile_n, 3, "cpu",
                           min_chunk=1)
    ws.plan(batch.seq_lens, shape.num_decodes, shape.sliding_window)
    options = dict(scale=shape.head_size ** -0.5, sliding_window=shape.sliding_window, soft_cap=shape.soft_cap,
                   sinks=batch.sinks, kv_scales=scales)
    F.flash_decode(*layout, workspace=ws, num_rows=batch.num_reqs_padded, tiles=decode, **options)
    F.flash_prefill(*layout, num_seqs=batch.num_reqs_padded, num_tokens=batch.num_tokens_padded,
                    tiles=F.FlashTiles(block_m=32, tile_n=16, num_warps=4, num_stages=1), num_decodes=ws.params[1:],
                    **options)
    _assert_matches(out, batch, dtype)


def test_triton_launch_without_scales_is_refused():
    batch, _ = fp8_batch(DECODES, torch.float32)
    with pytest.raises(ValueError, match=r"an fp8 KV cache needs kv_scales"):
        K.write_kv(batch.key, batch.value, batch.kv_cache[0], batch.kv_cache[1], batch.slot_mapping)


@pytest.mark.parametrize("backend", ["torch_ref", "cpu_sdpa"])
def test_torch_backends_attend_the_dequantized_cache(backend):
    """torch_ref and cpu_sdpa over token-major pages: the same bytes as the Triton write, the same outputs."""
    from ember.attention_backends.base import BuilderContext
    from ember.attention_backends.registry import get_backend
    from ember.kv_spec import KVCacheGroup
    from tests.helpers.paged_batches import common_metadata
    shape = dataclasses.replace(WINDOW, num_heads=4, num_kv_heads=2)
    batch, scales = fp8_batch(shape, torch.float32)
    cls = get_backend(backend)
    cache = batch.kv_cache.transpose(2, 3).contiguous()        # [2, blocks, block_size, Hkv, D]
    cache.view(torch.uint8)[cache.float().isnan()] = 0         # cpu_sdpa reads masked keys: finite, as in a cache
    spec = KVCacheSpec(shape.block_size, shape.num_kv_heads, shape.head_size, FP8, shape.sliding_window)
    ctx = BuilderContext(KVCacheGroup(("layer",), spec), 0, torch.float32, torch.device("cpu"), 8, 256, 256)
    impl = cls.impl_cls(shape.options())
    impl.kv_scales = scales
    out = torch.full_like(batch.query, float("nan"))
    impl.forward(batch.query, batch.key, batch.value, cache, cls.builder_cls(ctx).build(common_metadata(batch)), out)
    _assert_matches(out, batch, torch.float32)
    triton_written = batch.kv_cache.clone()
    K.write_kv(batch.key, batch.value, triton_written[0], triton_written[1], batch.slot_mapping, kv_scales=scales)
    live = slice(1, None)         # block 0 (the null block) takes the padding rows' writes here, and was zeroed
    assert torch.equal(cache[:, live].view(torch.uint8), triton_written.transpose(2, 3)[:, live].view(torch.uint8))


# ---- the cache in the engine --------------------------------------------------------------------------------------

def test_page_size_follows_the_dtype():
    bf16 = KVCacheSpec(16, 8, 128, torch.bfloat16)
    fp8 = dataclasses.replace(bf16, dtype=FP8)
    assert bf16.page_size_bytes == 2 * fp8.page_size_bytes == 2 * 2 * 16 * 8 * 128


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tests.helpers.model_harness import random_hf_model, tiny_config
    path = tmp_path_factory.mktemp("llama")
    random_hf_model(tiny_config("llama"), seed=5).save_pretrained(path)
    return path


def test_engine_holds_twice_the_tokens_and_logs_both(folder, caplog):
    from ember import LLM
    caplog.set_level(logging.INFO, logger="ember")
    llm = LLM(str(folder), device="cpu", kv_cache_dtype="fp8", dtype="float32")
    runner = llm.engine.runner
    assert runner.attn.groups[0].spec.dtype == FP8
    assert all(s.kv_cache.dtype == FP8 for s in runner.layer_states.values())
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache: ")
                and "tokens (full" in r.getMessage())
    held = runner.kv_capacity_tokens
    assert f"{held} tokens" in line and f"in torch.float32 the same memory holds {held // 4} tokens" in line
    # scale 1.0 per head without checkpoint scales
    impl = next(iter(runner.layer_states.values())).impl
    assert torch.equal(impl.kv_scales[0], torch.ones(2)) and torch.equal(impl.kv_scales[1], torch.ones(2))


def test_checkpoint_kv_scales_are_used(folder, tmp_path):
    """compressed-tensors' `self_attn.k_scale` / `v_scale` reach the layers' impls."""
    import json
    import shutil
    from safetensors.torch import load_file, save_file
    from ember import LLM
    target = tmp_path / "scaled"
    shutil.copytree(folder, target)
    tensors = load_file(target / "model.safetensors")
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5 + i)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.25, 0.125])
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(target), device="cpu", kv_cache_dtype="fp8", dtype="float32")
    states = llm.engine.runner.layer_states
    impl = states["model.layers.1.self_attn.attn"].impl
    assert torch.equal(impl.kv_scales[0], torch.tensor([1.5, 1.5]))
    assert torch.equal(impl.kv_scales[1], torch.tensor([0.25, 0.125]))
    json.loads((target / "config.json").read_text())      # the config is untouched


def test_a_backend_without_fp8_is_refused_at_start_up(folder, monkeypatch):
    """A backend whose `supports()` does not take an e4m3 cache (a plug-in written before fp8) is refused with its
    reason when named, and passed over for one that takes it under "auto"."""
    from ember import LLM
    from ember.attention_backends import registry
    from ember.attention_backends.base import AttentionBackend
    from ember.attention_backends.registry import BackendSelectionError
    monkeypatch.setattr(registry, "_factories", dict(registry._factories))
    monkeypatch.setattr(registry, "_loaded", dict(registry._loaded))

    @registry.register_backend("float_pages_only")
    class FloatPagesOnly(AttentionBackend):
        priority = 50

        @classmethod
        def supports(cls, spec, dtype, device, options=None):
            return [] if spec.dtype == dtype else [f"KV-cache dtype {spec.dtype} is not supported"]

    with pytest.raises(BackendSelectionError, match=r"float_pages_only.*KV-cache dtype torch.float8_e4m3fn is not "
                                                    r"supported"):
        LLM(str(folder), device="cpu", kv_cache_dtype="fp8", attention_backend="float_pages_only")
    llm = LLM(str(folder), device="cpu", kv_cache_dtype="fp8", num_kv_blocks=8)
    assert llm.engine.runner.attn.backends[0].name == "cpu_sdpa"
    assert llm.engine.runner.attn.refused[0]["float_pages_only"] == [
        "KV-cache dtype torch.float8_e4m3fn is not supported"]


# ---- compiled code (no GPU needed: Triton compiles for sm_90 on the CPU) ------------------------------------------

def _sm90(fn, dtypes: dict, constexprs: dict) -> str:
    from tests.helpers.sm90 import compile_for_sm90
    return compile_for_sm90(fn.fn, dtypes, constexprs).asm["ptx"]


@pytest.mark.slow      # 10-30 s of Triton's compile on a 2-core CPU
def test_sm90_decode_kernel_widens_e4m3_and_writes_it_with_the_hardware():
    """The split-KV decode with the fused write, for an H100 and an e4m3 cache: K/V tiles widen from e4m3
    (cvt.rn.f16x2.e4m3x2 / bf16 via f16), the new keys convert with the hardware's rounding."""
    from ember.attention_backends.triton_unified.kernels import unified_attention as U
    dtypes = {"part_out_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "counter_ptr": "*i32",
              "block_table_ptr": "*i32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
              "num_decodes_ptr": "*i32", "sinks_ptr": "*fp32", "alibi_ptr": "*fp32", "slot_mapping_ptr": "*i64",
              "cos_ptr": "*fp32", "sin_ptr": "*fp32", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv",
              "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    constexprs = dict(NUM_QUERIES_PER_KV=4, HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_Q=1,
                      TILE_N=64, NUM_SEGMENTS=16, MODE=K.MODE_DECODES, LIMIT_DECODES=False, USE_WINDOW=False,
                      USE_SOFTCAP=False, USE_SINKS=False, USE_ALIBI=False, IEEE=False, UNMASKED_MIDDLE=False,
                      FUSED_COMBINE=True, NEW_KV=True, PDL=False, ROPE=False, QK_NORM=False, FP8_KV=1)
    ptx = _sm90(U.unified_attention_kernel, dtypes, constexprs)
    assert "e4m3x2" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
