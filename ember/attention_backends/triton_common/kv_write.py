"""Scatter new K/V rows into the paged cache by slot, for both Triton backends.

Cache layout, per K and per V: [num_blocks, num_kv_heads, block_size, head_size]. The attention kernels read
one KV head of a tile of consecutive tokens at a time; with the head outside the token axis, each (block, head)
is one contiguous run of block_size * head_size elements (4 KiB for 16 x 128 bf16), so a tile is a few long
contiguous reads (a single TMA box when a page holds the tile) instead of block_size short rows strided by
num_kv_heads * head_size. The write side pays the strided access instead, once per token, which is cheap next to
the many reads of every cached token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_options

from ember.attention_backends.triton_common.interpreted import kernel_for


@triton.jit
def kv_write_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ch, stride_ct,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PDL: tl.constexpr = False,
):
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
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, pdl: bool = False) -> None:
    """Write key/value [T, Hkv, D] into key_cache/value_cache [num_blocks, Hkv, block_size, D] at slot_mapping[:T]
    (int64, -1 = skip). One program per token; no host sync. pdl: launch it as a programmatic dependent where the
    device allows (ember.kernels.pdl)."""
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
    kernel = kernel_for(key.device, kv_write_kernel)
    kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size), BLOCK_SIZE=key_cache.shape[2], num_warps=4,
        **(pdl_options(key.device) if pdl else {}))
