"""Triton kernels of the unified attention backend: 2D/3D unified attention, segment reduce (the KV-cache write is
both Triton backends', `triton_common.kv_write`).

They import nothing from ember but `triton_common` and `ember.kernels`, so they can be tested and benchmarked on
their own."""

from ember.attention_backends.triton_common.kv_write import write_kv
from .launch import (MAX_SEGMENTS, MODE_ALL, MODE_DECODES, MODE_PREFILLS, TileConfig, segment_scratch_numel,
                     unified_attention_2d, unified_attention_3d)

__all__ = ["write_kv", "MAX_SEGMENTS", "TileConfig", "MODE_ALL", "MODE_DECODES", "MODE_PREFILLS",
           "unified_attention_2d", "unified_attention_3d", "segment_scratch_numel"]
