"""Which kernels a step launches, and with which tiles: a pure function of the capture bucket.

The rule (documented here, tuned on an H100 with benches/bench_attention.py, which prints the 2D/3D crossover):

- A uniform-decode bucket launches one decode kernel over its `num_reqs_padded` requests (one query token each,
  the G query heads of a KV head packed into the tile rows). It is the 3D split-KV kernel when the 2D grid,
  (requests x KV heads) programs, is smaller than `SPLIT_KV_MAX_PAIRS_PER_SM` x num_sms (the GPU would idle), with
  enough segments for about `SPLIT_KV_TARGET_PROGRAMS_PER_SM` programs per SM; otherwise the 2D decode kernel.
- Any other bucket launches, by default, one 2D kernel over all requests, with a query tile sized for the
  bucket's average query length (num_tokens_padded / num_reqs_padded).
- With `split_launch`, a mixed bucket launches the decode kernel (chosen as above for up to
  min(num_reqs_padded, num_tokens_padded) decodes; programs past the live count, read from a device tensor, exit)
  and a prefill-tuned 2D kernel over the remaining requests.

- A uniform-decode bucket that plans split-KV has a second graph for short contexts (`SHORT_DECODE_LEN`): its
  builder plans it with no SMs to split over, so the 2D decode kernel.

Nothing here reads a live value, so a CUDA graph captured at a bucket replays the kernels it was captured with.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton

from .kernels import MAX_SEGMENTS, MODE_ALL, MODE_PREFILLS, TileConfig

SPLIT_KV_MAX_PAIRS_PER_SM = 2.0       # 3D while (decode requests x KV heads) < this x num_sms
SPLIT_KV_TARGET_PROGRAMS_PER_SM = 4   # 3D segments: about this many programs per SM
MAX_GROUP_3D = 16                     # 3D only for up to this many query heads per KV head (bounds the scratch)
# up to this many query heads per KV head, the last segment program of a (request, KV head) combines the segments
# (one head after another) instead of a second launch. Off (0): on an H100 at batch 1 it removed a launch per layer
# but made decode slower, Qwen3-0.6B 975 vs 1,021 tok/s and Llama-3.2-1B 743 vs 785 tok/s in one run (its serial
# combine lengthens the attention kernel's tail more than the reduce launch costs under PDL); measured again after
# the attention and reduce read their metadata before the PDL wait, Llama-3.1-8B (split-KV at every context) 171.7 /
# 171.8 with it against 177.2 / 177.1 tok/s without
FUSED_COMBINE_MAX_GROUP = 0
# A split-KV decode bucket also has a short-context graph, for steps whose requests are all at most this many tokens
# long; it launches the 2D kernel: one program a (request, KV head) walks the whole context, and the reduce launch
# goes. On an H100 at batch 1, Qwen3-0.6B config (`ember bench latency --batch-size 1`, one lease each, interleaved):
# contexts of 32-288 tokens (`--input-len 32 --output-len 256`), 2D 1,121.3 / 1,120.9 tok/s against split-KV
# 1,075.0 / 1,073.5; contexts of 400-512 (`--input-len 400 --output-len 112`), 2D 964.5 / 975.9 against split-KV
# 1,038.7 / 1,015.5. The crossover lies between; interpolating the per-step difference puts it near 280 tokens, so
# the bound is 256 (not itself measured).
SHORT_DECODE_LEN = 256
# ...where a query tile is at most this wide (query heads per KV head x head size): wider groups keep split-KV. On
# an H100 at batch 1, contexts of 32-288 tokens (one lease; `ember bench latency --batch-size 1 --input-len 32
# --output-len 256`, decode tok/s), the 2D kernel against split-KV: Llama-3.1-8B config (4 x 128) 169.3 / 169.5
# against 173.5 (the bucket-1 graph replayed at 160 tokens of context: 5.94 against 5.82 ms); Llama-3.2-1B (4 x 64)
# 910.4 / 907.6 against 866.6; Qwen3-0.6B (2 x 128) 1,106.7 / 1,169.1 against 1,151.0.
SHORT_DECODE_MAX_WIDTH = 256


@dataclass(frozen=True)
class LaunchPlan:
    """The launches of one bucket: an optional decode launch, then an optional launch over the rest."""
    decode: TileConfig | None         # MODE_DECODES launch over the leading decodes, or None
    num_decode_seqs: int              # its grid rows (requests it may serve)
    num_segments: int                 # 1: 2D decode kernel; > 1: 3D split-KV with that many segments
    decode_count_on_device: bool      # programs past the live decode count (a device tensor) exit
    rest: TileConfig | None           # the 2D launch over all requests (MODE_ALL) or the prefills (MODE_PREFILLS)
    rest_mode: int = MODE_ALL


def decode_tile(num_queries_per_kv: int, head_size: int, split: bool = True) -> TileConfig:
    """Tiles for single-token queries: just enough rows for one token's query heads. Unsplit (2D), each program
    walks a whole context, and longer key tiles keep more bytes in flight: on an H100, 256 requests of U[100, 2048]
    tokens, head 128, 16-token pages (benches/decode_attention_sweep.py), 128-key tiles with 2 stages read at
    96.9% (GQA 2) and 96.1% (GQA 4) of copy bandwidth, against 93.4% and 92.5% for 64-key tiles with 3 stages.

    Split (3D), a segment's range is a few tiles at most, and shorter tiles give more segments work: on an H100
    (benches/experiments/decode_tiles_chained.py), heads 16/8 of 128, 16-token pages, 28 launches chained in a CUDA
    graph as a decode step chains them, with the planner's segment counts (64, 32, 8, 4 at 1, 4, 16, 32 requests)
    and the reduce, 32-key tiles with 2 stages took less time than 64-key tiles with 3 stages at each of 1, 4, 16 and 32
    requests and contexts of 288, 512, 1024, 2048 and 4096 tokens: per layer, 1 request 6.62 / 7.73 / 13.08 us
    against 7.41 / 9.25 / 14.60 us at 288 / 1024 / 4096 tokens, 16 requests 14.89 / 33.41 / 100.77 against 18.28 /
    34.70 / 108.65. Over those 20 shapes the time was 0.92x of the 64-key tiles' (geometric mean); with four query
    heads per KV head 0.97x (head 64, 15 of 20 shapes not slower) and 0.96x (head 128, 17 of 20), where 1 request at
    288-1024 tokens took 4-10% longer (8.08 / 10.03 us against 7.46 / 9.42 at 288 / 1024). In one engine run
    (Qwen3-0.6B config, interleaved), 16 requests of 512-640 tokens decoded at 8,725 / 8,727 tok/s against 8,074 /
    8,016; 1 request of 1,024-1,152 tokens at a median step of 0.95 against 0.98 ms."""
    block_m = max(16, triton.next_power_of_2(num_queries_per_kv))
    if head_size > 128 or split:
        return TileConfig(block_m=block_m, tile_n=32, num_warps=4, num_stages=2)
    return TileConfig(block_m=block_m, tile_n=128, num_warps=4, num_stages=2)


def prefill_tile(num_queries_per_kv: int, head_size: int, block_m: int | None = None) -> TileConfig:
    """Tiles for long query runs: large query blocks to reuse every K/V tile across many rows."""
    largest = 128 if head_size <= 128 else 64
    block_m = min(block_m or largest, largest)
    block_m = max(block_m, 16, triton.next_power_of_2(num_queries_per_kv))
    # 8 warps from 128 rows, or for head 256 (4 warps spill its 64 x 256 fp32 accumulator heavily)
    return TileConfig(block_m=block_m, tile_n=64 if head_size <= 128 else 32,
                      num_warps=8 if block_m >= 128 or (head_size > 128 and block_m >= 64) else 4, num_stages=2)


def num_split_segments(num_decode_seqs: int, num_kv_heads: int, num_queries_per_kv: int, num_sms: int) -> int:
    """Segments of the 3D kernel for a decode launch of this size; 1 means use the 2D kernel."""
    pairs = num_decode_seqs * num_kv_heads
    if num_sms <= 0 or pairs == 0 or num_queries_per_kv > MAX_GROUP_3D:
        return 1
    if pairs >= SPLIT_KV_MAX_PAIRS_PER_SM * num_sms:
        return 1
    wanted = -(-SPLIT_KV_TARGET_PROGRAMS_PER_SM * num_sms // pairs)
    segments = min(MAX_SEGMENTS, triton.next_power_of_2(wanted))
    return segments if segments >= 2 else 1


@functools.lru_cache(maxsize=4096)
def plan_launch(num_tokens_padded: int, num_reqs_padded: int, uniform_decode: bool, num_heads: int,
                num_kv_heads: int, head_size: int, num_sms: int, split_launch: bool) -> LaunchPlan:
    """The kernels and tiles for a bucket (see the module docstring); never depends on live batch contents."""
    group = num_heads // num_kv_heads
    if uniform_decode:
        segments = num_split_segments(num_reqs_padded, num_kv_heads, group, num_sms)
        return LaunchPlan(decode_tile(group, head_size, segments > 1), num_reqs_padded, segments, False, None)
    if split_launch:
        num_decode_seqs = min(num_reqs_padded, num_tokens_padded)
        segments = num_split_segments(num_decode_seqs, num_kv_heads, group, num_sms)
        return LaunchPlan(decode_tile(group, head_size, segments > 1), num_decode_seqs, segments, True,
                          prefill_tile(group, head_size), MODE_PREFILLS)
    avg_query_len = -(-num_tokens_padded // max(num_reqs_padded, 1))
    block_m = triton.next_power_of_2(max(avg_query_len * group, 1))
    return LaunchPlan(None, 0, 1, False, prefill_tile(group, head_size, block_m), MODE_ALL)


def max_scratch_rows(max_decode_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Largest (request x query head x segment) count any bucket's 3D launch can need, for up to
    `max_decode_seqs` decodes and up to MAX_GROUP_3D query heads per KV head."""
    best = 0
    for n in range(1, max_decode_seqs + 1):
        if n * num_kv_heads >= SPLIT_KV_MAX_PAIRS_PER_SM * num_sms:
            break
        segments = num_split_segments(n, num_kv_heads, MAX_GROUP_3D, num_sms)
        if segments > 1:
            best = max(best, n * num_kv_heads * MAX_GROUP_3D * segments)
    return best
