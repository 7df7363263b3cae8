"""Tiles of the flash kernels and the decode split's target: pure functions of the layer, the page size and the
bucket, never of the live batch.

Measured on an H100 (benches/bench_flash.py, bf16, head 128, CUDA-graph replays; 2026-11-22):

- Prefill, causal GQA 32/8 at 1k / 4k / 16k tokens, TFLOP/s: 64 rows x 64 keys, 4 warps, 3 stages: 280 / 395 / 407
  (two programs share an SM, so one's softmax overlaps the other's matrix products; 4 stages: the same); 128 rows
  x 128 keys, 8 warps, 2 stages (128-token pages): 246 / 388 / 429; 128 x 64, 8 warps, 3 stages: 239 / 356 / 370.
  So 64 x 64 by default, 128 x 128 for buckets of LONG_PREFILL_TOKENS or more on 128-token pages. Head sizes over
  128 take 64 rows and 2 stages (a 64 x 256 fp32 accumulator needs 8 warps' registers); float32 halves the tiles
  to fit shared memory.
- Decode, ragged GQA 32/8 batches, % of copy bandwidth on 256 x U[100, 2048] / 64 x U[200, 8192] /
  16 x U[100, 16384] / 4 x U[1000, 32768]: DECODE_PROGRAMS_PER_SM 8: 92.0 / 93.5 / 92.4 / 77.2; 4: 92.2 / 89.5 /
  88.1 / 82.2; 16: 90.6 / 94.7 / 89.9 / 73.0. 64-key tiles, 4 warps, 3 stages (128-key tiles within a point).
"""

from __future__ import annotations

import torch
import triton

from .kernels import FlashTiles

DECODE_PROGRAMS_PER_SM = 8     # work items x KV heads the decode split aims at, per SM
DECODE_MIN_CHUNK = 4           # tiles: shorter items would spend more on the pipeline's start than on reading
CPU_TARGET_ITEMS = 4           # interpreter runs: a small target so that tests exercise the split
LONG_PREFILL_TOKENS = 8192     # buckets from this many tokens take 128-key tiles where pages hold them


def prefill_tiles(num_queries_per_kv: int, head_size: int, dtype: torch.dtype, block_size: int,
                  num_tokens: int = 0) -> FlashTiles:
    """Tiles of the prefill kernel for one layer's head layout, the cache's page size and the bucket's (padded)
    token count."""
    if dtype == torch.float32:
        tiles = FlashTiles(block_m=64, tile_n=32, num_warps=4, num_stages=2)
    elif head_size > 128:
        tiles = FlashTiles(block_m=64, tile_n=64, num_warps=8, num_stages=2)
    elif block_size >= 128 and num_tokens >= LONG_PREFILL_TOKENS:
        tiles = FlashTiles(block_m=128, tile_n=128, num_warps=8, num_stages=2)
    else:
        tiles = FlashTiles(block_m=64, tile_n=64, num_warps=4, num_stages=3)
    return FlashTiles(max(tiles.block_m, triton.next_power_of_2(num_queries_per_kv)),
                      min(tiles.tile_n, block_size), tiles.num_warps, tiles.num_stages)


def decode_tile_n(head_size: int, dtype: torch.dtype, block_size: int) -> int:
    """Keys per decode step; the metadata builder plans the split in these tiles, so it depends on no more than
    a KV-cache group's spec."""
    return min(64 if head_size <= 128 and dtype != torch.float32 else 32, block_size)


def decode_tiles(num_queries_per_kv: int, head_size: int, dtype: torch.dtype, block_size: int) -> FlashTiles:
    """Tiles of the decode kernel: just enough rows for one token's query heads."""
    return FlashTiles(block_m=max(16, triton.next_power_of_2(num_queries_per_kv)),
                      tile_n=decode_tile_n(head_size, dtype, block_size), num_warps=4, num_stages=3)


def decode_min_chunk(num_sms: int) -> int:
    """Smallest work item in tiles (1 in interpreter runs, so that small test batches split too)."""
    return DECODE_MIN_CHUNK if num_sms > 0 else 1


def decode_target_items(num_sms: int, num_kv_heads: int) -> int:
    """Work items per KV head the decode split aims at."""
    if num_sms <= 0:
        return CPU_TARGET_ITEMS
    return max(1, -(-DECODE_PROGRAMS_PER_SM * num_sms // num_kv_heads))
