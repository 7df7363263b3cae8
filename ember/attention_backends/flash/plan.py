"""Tiles of the flash kernels and the decode split's target: pure functions of the layer, the page size and the
bucket, never of the live batch.

Measured on an H100 (benches/bench_flash.py, bf16, head 128, CUDA-graph replays; 2026-11-22):

- Prefill, causal, against cuDNN SDPA in the same process (benches/experiments/flash_prefill_sweep.py, 2026-11-27,
  64-token pages; GQA 32/8 / 16/8): 128 rows x 64 keys on 8 warps, registers capped at 128 so that two programs
  share an SM (98 KB of shared memory each; one's softmax overlaps the other's products). 3 stages (the same
  shared memory as 2, 4 spilled registers against 10): 508 / 500 TFLOP/s at 16k, 476 / 447 at 4k, against 2
  stages' 501 / 497 and 445 / 448 in the same run; in another, 508 / 502 at 16k (0.85 / 0.87x cuDNN), 464 / 454
  at 4k (0.85 / 0.97x). With 2 stages it ran at
  494-505 / 502-508 TFLOP/s at 16k tokens (0.85 / 0.88x cuDNN), 454-470 / 451-461 at 4k (0.87 / 0.99-1.02x) and
  400 / 252 at 2k, against 64 x 64 on 4 warps, 3 stages: 430 / 428 at 16k, 387 / 385 at 4k, 347 / 331 at 2k and
  278 / 177 at 1k (1.07 / 0.86x). The wider tile wins once a bucket has about 512 programs (65,536 query rows: GQA
  32/8 from 2k tokens, 16/8 from 4k), so WIDE_PREFILL_ROWS. Not taken: the same tile with 120 registers (54 spills;
  0.6x), 128 rows on 4 warps (1 program an SM; 489 at 16k, 373 at 2k), 128 x 128 on 128-token pages (472 / 421 at
  16k / 4k), a 128-key step over two 64-token pages (427 / 369), Triton 3.6's warp specialization (no change on 8
  warps; its pass fails on 64 x 64). 128-token pages gave the same tile 498-534 TFLOP/s at 16k and 465-489 at 4k
  (-2 to +7%), ragged decode the same as 64 (within 1%).
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
WIDE_PREFILL_ROWS = 65536      # buckets of this many query rows (tokens x query heads) take 128-row tiles


def prefill_tiles(num_queries_per_kv: int, head_size: int, dtype: torch.dtype, block_size: int,
                  num_tokens: int = 0, num_kv_heads: int = 1) -> FlashTiles:
    """Tiles of the prefill kernel for one layer's head layout, the cache's page size and the bucket's (padded)
    token count."""
    if dtype == torch.float32:
        tiles = FlashTiles(block_m=64, tile_n=32, num_warps=4, num_stages=2)
    elif head_size > 128:
        tiles = FlashTiles(block_m=64, tile_n=64, num_warps=8, num_stages=2)
    elif dtype in (torch.bfloat16, torch.float16) and \
            num_tokens * num_queries_per_kv * num_kv_heads >= WIDE_PREFILL_ROWS:
        # 128 rows on two warp groups, registers capped so that two programs (98 KB of shared memory each) share
        # an SM: one's softmax runs while the other's products do
        tiles = FlashTiles(block_m=128, tile_n=64, num_warps=8, num_stages=3, maxnreg=128)
    else:
        tiles = FlashTiles(block_m=64, tile_n=64, num_warps=4, num_stages=3)
    return FlashTiles(max(tiles.block_m, triton.next_power_of_2(num_queries_per_kv)),
                      min(tiles.tile_n, block_size), tiles.num_warps, tiles.num_stages, maxnreg=tiles.maxnreg)


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
