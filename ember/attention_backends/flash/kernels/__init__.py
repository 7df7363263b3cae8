"""Triton kernels of the flash attention backend: KV-cache write, varlen paged prefill, balanced split-KV decode.

They import nothing from ember, so they can be tested and benchmarked on their own."""

from .kv_write import write_kv
from .launch import MAX_SPLIT_GROUP, DecodeWorkspace, FlashTiles, can_use_tma, flash_decode, flash_prefill

__all__ = ["write_kv", "FlashTiles", "DecodeWorkspace", "MAX_SPLIT_GROUP", "can_use_tma", "flash_decode",
           "flash_prefill"]
