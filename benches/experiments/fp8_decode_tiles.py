"""Decode attention over an fp8 (e4m3) cache against the same over bf16: the unified backend's 2D decode kernel
with the plan's tiles and a sweep of key-tile widths, stages and warps, on ragged batches, in one process, graph
replays over L2-evicting copies (benches/bench_flash.py's harness). Prints ms and % of copy bandwidth counting each
cache's own bytes, to find whether the fp8 cache wants other tiles than bf16 (half the bytes a key tile), and
whether products in float16 (`EMBER_FP8_KV_F16_DOT=1`: e4m3 widens to float16 in one conversion) pay.

    python benches/experiments/fp8_decode_tiles.py [--workloads 256xU[100,2048] 64xU[200,8192]] [--block-sizes 64]
"""

from __future__ import annotations

import argparse
import itertools
import os


def main() -> None:
    import torch

    from benches.bench_flash import DECODE_HEADS, HEAD_SIZE, RAGGED, _paged, _ragged_lengths, time_graph
    from benches.conftest import measure_peaks, rotation_count
    from ember.attention_backends.triton_unified import kernels as U, plan as UP

    p = argparse.ArgumentParser()
    p.add_argument("--workloads", nargs="+", default=["256xU[100,2048]", "64xU[200,8192]"], choices=list(RAGGED))
    p.add_argument("--block-sizes", type=int, nargs="+", default=[64])
    p.add_argument("--tile-n", type=int, nargs="+", default=[128, 256])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--unmasked", action="store_true", help="also each variant with unmasked middle tiles")
    args = p.parse_args()

    peaks = measure_peaks(torch.device("cuda"))
    num_heads, num_kv_heads = DECODE_HEADS
    group = num_heads // num_kv_heads
    plan_tile = UP.decode_tile(group, HEAD_SIZE, split=False)
    print(f"copy bandwidth {peaks.copy_bytes_per_s / 1e9:,.0f} GB/s; plan's 2D decode tile {plan_tile}")
    scales = (torch.full((num_kv_heads,), 0.5, device="cuda"), torch.full((num_kv_heads,), 0.25, device="cuda"))
    for workload, block_size in itertools.product(args.workloads, args.block_sizes):
        lengths = _ragged_lengths(workload)
        batch = len(lengths)
        q = torch.randn(batch, num_heads, HEAD_SIZE, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        seq_lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
        for kind in ("bf16", "fp8"):
            width = 2 if kind == "bf16" else 1
            kv_bytes = sum(lengths) * num_kv_heads * HEAD_SIZE * 2 * width
            copies = rotation_count(kv_bytes, peaks.l2_bytes)
            cache, tables = _paged(lengths, num_kv_heads, block_size, copies)
            if kind == "fp8":
                cache = cache.to(torch.float8_e4m3fn)
            kv = dict(kv_scales=scales) if kind == "fp8" else {}
            variants = [("plan", plan_tile, False)]
            if kind == "fp8":
                variants.append(("plan f16 dot", plan_tile, True))
                variants += [(f"n{n} {w}w {s}stg{' unmasked' if um else ''}{' f16 dot' if f16 else ''}",
                              U.TileConfig(block_m=plan_tile.block_m, tile_n=n, num_warps=w, num_stages=s,
                                           unmasked_middle=um), f16)
                             for n, w, s, um, f16 in itertools.product(
                                 args.tile_n, args.warps, args.stages, (False, True) if args.unmasked else (False,),
                                 (False, True))]
            for label, tile, f16 in variants:
                os.environ["EMBER_FP8_KV_F16_DOT"] = "1" if f16 else "0"     # read at each launch
                try:
                    ms = time_graph([lambda i=i, tile=tile: U.unified_attention_2d(
                        q, cache[0], cache[1], out, tables[i], qsl, seq_lens, num_seqs=batch, num_tokens=batch,
                        scale=HEAD_SIZE ** -0.5, config=tile, mode=U.MODE_DECODES, **kv) for i in range(copies)])
                except Exception as e:      # noqa: BLE001 - a variant that does not compile (shared memory)
                    print(f"{workload} bs{block_size} {kind} {label}: failed: {str(e)[:120]}", flush=True)
                    continue
                moved = kv_bytes + 2 * q.numel() * q.element_size()
                pct = 100 * moved / (ms * 1e-3) / peaks.copy_bytes_per_s
                print(f"{workload} bs{block_size} {kind} {label}: {ms * 1e3:.1f} us, {pct:.1f}% of copy bandwidth",
                      flush=True)
            del cache, tables
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
