"""Scatter new K/V rows into the paged cache by slot, for both Triton backends.

Cache layout, per K and per V: [num_blocks, num_kv_heads, block_size, head_size]. The attention kernels read
one KV head of a tile of consecutive tokens at a time; with the head outside the token axis, each (block, head)
is one contiguous run of block_size * head_size elements (4 KiB for 16 x 128 bf16), so a tile is a few long
contiguous reads (a single TMA box when a page holds the tile) instead of block_size short rows strided by
num_kv_heads * head_size. The write side pays the strided access instead, once per token, which is cheap next to
the many reads of every cached token.

An fp8 (e4m3) cache stores each value divided by its KV head's scale (k_scale / v_scale, float32 [Hkv]), rounded
to nearest and saturated at +-448; the attention kernels multiply the scale back in.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ember.attention_backends.triton_common.interpreted import kernel_for
from ember.kernels.e4m3 import scale_to_e4m3
from ember.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_options


@triton.jit
def kv_write_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ch, stride_ct,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PDL: tl.constexpr = False, FP8_KV: tl.constexpr = 0,
):
    """FP8_KV: 0, the cache holds the inputs' values; 1, e4m3 over the per-head scales; 2, the same with the
    rounding done in float32 first (the interpreter's conversion does not carry a rounding into the exponent)."""
    if PDL:   # launched as a programmatic dependent (ember.kernels.pdl)
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: writes nothing
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_SIZE)
    dst = block * stride_cb + heads * stride_ch + offset * stride_ct + dims
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    if FP8_KV:
        k = scale_to_e4m3(k, tl.load(k_scale_ptr + heads, mask=heads < NUM_KV_HEADS, other=1.0), FP8_KV == 2)
        v = scale_to_e4m3(v, tl.load(v_scale_ptr + heads, mask=heads < NUM_KV_HEADS, other=1.0), FP8_KV == 2)
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def fp8_kv_mode(cache: torch.Tensor) -> int:
    """The kernels' FP8_KV for a cache: 0 unless it is e4m3; 2 for CPU tensors (interpreted), else 1."""
    if cache.dtype != torch.float8_e4m3fn:
        return 0
    return 2 if cache.device.type == "cpu" else 1


def fp8_f16_products(query: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether attention of `query` over `cache` multiplies in float16: for bfloat16 queries over an e4m3 cache,
    whose values widen to float16 in one conversion a pair (to bfloat16 in several, which held decode attention
    at 61% of copy bandwidth against 79% on an H100: docs/performance.md). `EMBER_FP8_KV_F16_DOT=0` turns it off
    (an A/B switch)."""
    return (cache.dtype == torch.float8_e4m3fn and query.dtype == torch.bfloat16
            and os.environ.get("EMBER_FP8_KV_F16_DOT", "1") != "0")


def check_kv_scales(kv_scales, cache: torch.Tensor, num_kv_heads: int):
    """(k_scale, v_scale) float32 [Hkv] for an e4m3 cache (ValueError without them), stand-ins for another."""
    if cache.dtype != torch.float8_e4m3fn:
        return cache, cache
    if kv_scales is None:
        raise ValueError("an fp8 KV cache needs kv_scales (k_scale, v_scale), float32 [num_kv_heads] each")
    for scale in kv_scales:
        if scale.dtype != torch.float32 or scale.shape != (num_kv_heads,) or scale.device != cache.device:
            raise ValueError(f"kv_scales must be float32 [{num_kv_heads}] on {cache.device}, got {scale.dtype} "
                             f"{list(scale.shape)} on {scale.device}")
    return kv_scales


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, pdl: bool = False, kv_scales=None) -> None:
    """Write key/value [T, Hkv, D] into key_cache/value_cache [num_blocks, Hkv, block_size, D] at slot_mapping[:T]
    (int64, -1 = skip). One program per token; no host sync. pdl: launch it as a programmatic dependent where the
    device allows (ember.kernels.pdl). kv_scales: (k_scale, v_scale) float32 [Hkv] for an e4m3 cache."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if key_cache.shape[1:] != value_cache.shape[1:] or key_cache.shape[1] != num_kv_heads \
            or key_cache.shape[3] != head_size:
        raise ValueError(f"cache shape {tuple(key_cache.shape)} does not hold keys of shape {tuple(key.shape)}")
    key = key if key.stride(2) == 1 else key.contiguous()
    value = value if value.stride(2) == 1 else value.contiguous()
    k_scale, v_scale = check_kv_scales(kv_scales, key_cache, num_kv_heads)
    kernel = kernel_for(key.device, kv_write_kernel)
    kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size), BLOCK_SIZE=key_cache.shape[2], num_warps=4,
        **(pdl_options(key.device) if pdl else {}), **_fp8_flag(key_cache))


def _fp8_flag(cache: torch.Tensor) -> dict:
    """FP8_KV for a launch: passed only when set, so the other caches' specializations keep their keys."""
    mode = fp8_kv_mode(cache)
    return dict(FP8_KV=mode) if mode else {}
