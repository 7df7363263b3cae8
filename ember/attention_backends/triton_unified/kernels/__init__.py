"""Triton kernels of the unified attention backend: KV-cache write, 2D/3D unified attention, segment reduce.

They import nothing from ember, so they can be tested and benchmarked on their own."""

from .kv_cache_write import write_kv_cache
from .launch import (MAX_SEGMENTS, MODE_ALL, MODE_DECODES, MODE_PREFILLS, TileConfig, segment_scratch_numel,
                     unified_attention_2d, unified_attention_3d)

__all__ = ["write_kv_cache", "MAX_SEGMENTS", "TileConfig", "MODE_ALL", "MODE_DECODES", "MODE_PREFILLS",
           "unified_attention_2d", "unified_attention_3d", "segment_scratch_numel"]
