"""Triton kernels of the flash attention backend: varlen paged prefill, balanced split-KV decode (the KV-cache
write is both Triton backends', `triton_common.kv_write`).

They import nothing from ember but `triton_common` and `ember.kernels`, so they can be tested and benchmarked on
their own."""

from ember.attention_backends.triton_common.kv_write import write_kv
from .launch import MAX_SPLIT_GROUP, DecodeWorkspace, FlashTiles, can_use_tma, flash_decode, flash_prefill

__all__ = ["write_kv", "FlashTiles", "DecodeWorkspace", "MAX_SPLIT_GROUP", "can_use_tma", "flash_decode",
           "flash_prefill"]
