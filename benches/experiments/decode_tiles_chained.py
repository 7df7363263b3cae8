"""Decode attention tiles at small batches, timed as a decode step runs them: one launch per layer, each layer its
own KV cache, all chained in one CUDA graph (so launch gaps and programmatic dependent launch count as in a step).
The new token's K/V go in with the launch (the fused cache write of a uniform-decode step).

    PYTHONPATH=. python benches/experiments/decode_tiles_chained.py                      # Qwen3-0.6B heads: 16/8 of 128
    PYTHONPATH=. python benches/experiments/decode_tiles_chained.py --heads 32 8 --head-size 64 --what split

`split`: the 3D split-KV kernel and its reduce at the planner's segment count for each batch, per (tile, warps,
stages); `short`: the 2D kernel at contexts up to the short-context graph's bound. Prints microseconds per layer.
"""

from __future__ import annotations

import argparse

import torch
import triton

from ember.attention_backends.triton_unified import kernels as K
from ember.attention_backends.triton_unified.plan import num_split_segments

BLOCK_SIZE = 16
SPLIT_TILES = [(64, 4, 3), (32, 4, 3), (32, 4, 2), (32, 2, 3), (16, 4, 3), (16, 2, 3)]
SHORT_TILES = [(128, 4, 2), (128, 4, 3), (64, 4, 2), (64, 4, 3), (32, 4, 1), (32, 4, 2), (32, 4, 3)]


def _step(batch: int, ctx: int, heads: int, kv_heads: int, head_size: int, layers: int) -> dict:
    """Caches of `layers` layers where each of `batch` requests holds `ctx` tokens, and one new token each."""
    per_seq = -(-(ctx + 1) // BLOCK_SIZE)
    num_blocks = 1 + batch * per_seq
    table = (torch.arange(batch * per_seq, device="cuda", dtype=torch.int32) + 1).view(batch, per_seq)
    key = torch.randn(batch, kv_heads, head_size, device="cuda", dtype=torch.bfloat16)
    return dict(
        caches=[torch.randn(2, num_blocks, kv_heads, BLOCK_SIZE, head_size, dtype=torch.bfloat16, device="cuda")
                for _ in range(layers)],
        table=table, query=torch.randn(batch, heads, head_size, device="cuda", dtype=torch.bfloat16),
        new_kv=(key, torch.randn_like(key), table[:, ctx // BLOCK_SIZE].long() * BLOCK_SIZE + ctx % BLOCK_SIZE),
        qsl=torch.arange(batch + 1, device="cuda", dtype=torch.int32),
        seq_lens=torch.full((batch,), ctx + 1, device="cuda", dtype=torch.int32))


def _graph_us_per_layer(fn, layers: int, replays: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, nargs=2, default=[16, 8], metavar=("Q", "KV"))
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--what", choices=["split", "short", "both"], default="both")
    args = p.parse_args()
    heads, kv_heads = args.heads
    d = args.head_size
    block_m = max(16, triton.next_power_of_2(heads // kv_heads))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if args.what in ("split", "both"):
        print(f"split-KV + reduce, us per layer, tiles (keys, warps, stages): {SPLIT_TILES}", flush=True)
        for batch in args.batches:
            segments = num_split_segments(batch, kv_heads, heads // kv_heads, sms)
            if segments < 2:
                continue
            n_out, n_rows = K.segment_scratch_numel(batch, heads, d, segments)
            scratch = [torch.empty(n, device="cuda", dtype=torch.float32) for n in (n_out, n_rows, n_rows)]
            split = dict(num_segments=segments, scratch_out=scratch[0], scratch_max=scratch[1],
                         scratch_sum=scratch[2])
            for ctx in (288, 512, 1024, 2048, 4096):
                row = _row(K.unified_attention_3d, split, SPLIT_TILES, block_m, batch, ctx, heads, kv_heads, d,
                           args.layers)
                print(f"batch {batch:3d} segments {segments:2d} context {ctx:5d}: {row}", flush=True)
    if args.what in ("short", "both"):
        print(f"2D (short contexts), us per layer, tiles (keys, warps, stages): {SHORT_TILES}", flush=True)
        for batch in args.batches:
            short = dict(num_tokens=batch, mode=K.MODE_DECODES)
            for ctx in (16, 64, 128, 192, 256):
                row = _row(K.unified_attention_2d, short, SHORT_TILES, block_m, batch, ctx, heads, kv_heads, d,
                           args.layers)
                print(f"batch {batch:3d} context {ctx:5d}: {row}", flush=True)


def _row(launch, options: dict, tiles, block_m: int, batch: int, ctx: int, heads: int, kv_heads: int, d: int,
         layers: int) -> str:
    """Microseconds a layer of `launch` (with `options`) at each tile, on a fresh step of this shape."""
    s = _step(batch, ctx, heads, kv_heads, d, layers)
    row = []
    for tile_n, warps, stages in tiles:
        cfg = K.TileConfig(block_m=block_m, tile_n=tile_n, num_warps=warps, num_stages=stages)

        def run(cfg=cfg):
            for c in s["caches"]:
                launch(s["query"], c[0], c[1], torch.empty_like(s["query"]), s["table"], s["qsl"], s["seq_lens"],
                       num_seqs=batch, scale=d ** -0.5, config=cfg, new_kv=s["new_kv"], **options)
        row.append(_graph_us_per_layer(run, layers))
    return "  ".join(f"{us:7.2f}" for us in row)


if __name__ == "__main__":
    main()
