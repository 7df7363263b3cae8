"""The flash attention backend: a mixed batch runs as two launches, the balanced split-KV decode over its leading
decodes and the FlashAttention-2-style prefill over the rest, each with its own tiles.

The decode split is planned on the device once per step (in `build`, before any layer or graph replay), and
every grid is a function of the bucket, so the backend is capturable in every CUDA-graph mode."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.attention_backends.base import (AttentionBackend, AttentionImpl, AttentionLayerOptions, BuilderContext,
                                           CudaGraphSupport, MetadataBuilder)
from ember.attention_backends.common import CommonAttentionMetadata
from ember.attention_backends.triton_common.device import head_major_cache_shape, triton_layer_reasons
from ember.kv_spec import KVCacheSpec

from .kernels import DecodeWorkspace, flash_decode, flash_prefill, write_kv
from .plan import decode_min_chunk, decode_target_items, decode_tile_n, decode_tiles, prefill_tiles

MIN_HEAD_SIZE, MAX_HEAD_SIZE = 16, 256
MIN_BLOCK_SIZE = 64       # a page holds a whole 64-key tile: one block-table read and one TMA box per tile
MAX_QUERIES_PER_KV = 128   # a prefill tile packs at least one token's query heads into its 128 rows


@dataclass(frozen=True)
class FlashMetadata:
    """Views of the step's persistent buffers, the decode workspace the step's plan was written to, and the
    bucket's sizes that shape the grids."""
    query_start_loc: torch.Tensor   # [num_reqs_padded + 1] int32
    seq_lens: torch.Tensor          # [num_reqs_padded] int32
    block_table: torch.Tensor       # [num_reqs_padded, max_blocks_per_req] int32
    slot_mapping: torch.Tensor      # [num_tokens_padded] int64
    workspace: DecodeWorkspace
    num_decodes: torch.Tensor       # [1] int32 view of the plan: live leading decodes
    decode_rows: int                # decode grid rows: the bucket's most possible decodes
    num_reqs_padded: int
    num_tokens_padded: int
    uniform_decode: bool


class FlashMetadataBuilder(MetadataBuilder):
    """Owns the decode workspace (plan buffers and partial-result scratch, sized once) and plans each step."""

    def __init__(self, ctx: BuilderContext):
        super().__init__(ctx)
        spec = ctx.group.spec
        self.max_rows = max(1, min(ctx.max_num_reqs, ctx.max_num_tokens))
        self.workspace = DecodeWorkspace(self.max_rows, spec.num_kv_heads, spec.head_size,
                                         decode_tile_n(spec.head_size, spec.dtype, spec.block_size),
                                         decode_target_items(ctx.num_sms, spec.num_kv_heads), ctx.device,
                                         min_chunk=decode_min_chunk(ctx.num_sms))

    def build(self, common: CommonAttentionMetadata) -> FlashMetadata:
        i = self.ctx.group_index
        self.workspace.plan(common.seq_lens, common.num_decodes, self.ctx.group.spec.sliding_window)
        rows = common.num_reqs_padded if common.uniform_decode else min(common.num_reqs_padded,
                                                                         common.num_tokens_padded)
        return FlashMetadata(
            query_start_loc=common.query_start_loc, seq_lens=common.seq_lens, block_table=common.block_tables[i],
            slot_mapping=common.slot_mappings[i], workspace=self.workspace, num_decodes=self.workspace.params[1:],
            decode_rows=min(rows, self.max_rows), num_reqs_padded=common.num_reqs_padded,
            num_tokens_padded=common.num_tokens_padded, uniform_decode=common.uniform_decode)


class FlashImpl(AttentionImpl):
    """Writes K/V, then launches the decode kernel (always) and the prefill kernel (for non-uniform buckets)."""

    def forward(self, query, key, value, kv_cache, metadata: FlashMetadata, out) -> None:
        o = self.options
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if o.kv_sharing_target is None:
            write_kv(key, value, key_cache, value_cache, metadata.slot_mapping, kv_scales=self.kv_scales)
        group = o.num_heads // o.num_kv_heads
        sinks = None if self.sinks is None else self.sinks.float().contiguous()
        layout = (query, key_cache, value_cache, out, metadata.block_table, metadata.query_start_loc,
                  metadata.seq_lens)
        options = dict(scale=o.scale, sliding_window=o.sliding_window, soft_cap=o.logits_soft_cap, sinks=sinks,
                       kv_scales=self.kv_scales)
        block_size = key_cache.shape[2]
        flash_decode(*layout, workspace=metadata.workspace, num_rows=metadata.decode_rows,
                     tiles=decode_tiles(group, o.head_size, key_cache.dtype, block_size), **options)
        if not metadata.uniform_decode:
            flash_prefill(*layout, num_seqs=metadata.num_reqs_padded, num_tokens=metadata.num_tokens_padded,
                          tiles=prefill_tiles(group, o.head_size, key_cache.dtype, block_size,
                                              metadata.num_tokens_padded, o.num_kv_heads),
                          num_decodes=metadata.num_decodes, **options)


class FlashBackend(AttentionBackend):
    """Separate FlashAttention-2-style prefill and balanced split-KV decode kernels over a
    [2, num_blocks, num_kv_heads, block_size, head_size] cache; pages hold whole KV tiles, read as TMA boxes
    (block_size 64 or more). CUDA, or CPU under TRITON_INTERPRET=1. No workspace (`workspace_bytes` 0): the kernels
    write into the step's arguments and the decode workspace the builder allocates once, before the cache is sized."""
    name = "flash"
    # Above triton_unified (10) wherever it can serve (block_size >= 64): on an H100, bf16, GQA 32/8, head 128
    # (benches/bench_flash.py, CUDA-graph replays) causal prefill ran at 280 / 395 / 407 TFLOP/s at 1k / 4k / 16k
    # tokens (64-token pages) against the unified kernel's 131 / 221 / 274 (16-token pages) and 148 / 256 / 315
    # (64-token pages); ragged decode at 92.0 / 93.5 / 92.4 / 77.2 % of copy bandwidth against 93.1 / 86.3 / 81.4 /
    # 72.1 % (256 x U[100, 2048] / 64 x U[200, 8192] / 16 x U[100, 16384] / 4 x U[1000, 32768]).
    priority = 20
    cudagraph_support = CudaGraphSupport.ALWAYS
    builder_cls = FlashMetadataBuilder
    impl_cls = FlashImpl

    kv_cache_shape = staticmethod(head_major_cache_shape)

    @classmethod
    def supports(cls, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device,
                 options: AttentionLayerOptions | None = None) -> list[str]:
        reasons = triton_layer_reasons(spec, dtype, device, options, MIN_HEAD_SIZE, MAX_HEAD_SIZE, MAX_QUERIES_PER_KV)
        if spec.block_size < MIN_BLOCK_SIZE or spec.block_size & (spec.block_size - 1):
            reasons.append(f"block_size {spec.block_size} is not supported: a power of two of at least "
                           f"{MIN_BLOCK_SIZE}, so that a page holds a whole KV tile (one TMA box); use "
                           f"block_size {MIN_BLOCK_SIZE} or 128")
        if options is not None and options.use_alibi:
            reasons.append("ALiBi is not implemented in the flash kernels (triton_unified has it)")
        return reasons


__all__ = ["FlashBackend", "FlashMetadataBuilder", "FlashImpl", "FlashMetadata"]
