"""The fp8 GEMV at a few rows under its variants, against the bf16 GEMV on the same shape and copy bandwidth:
weight-only (x in bf16) against dynamic per-row e4m3 activations, rounded once a call before the GEMV (`round_rows`,
the default) or inside every GEMV program (`set_row_prepass(False)`, the earlier path), on CUDA cores or tensor
cores (use_dot); at one row, the word-wise kernel (ember.kernels.gemv_fp8_words); `round_rows` alone; with
--shapes, the one-row launch shapes (programs per SM, W tile bytes) of the rounded path.

    PYTHONPATH=. python benches/experiments/fp8_gemv_modes.py [--rows 1 4] [--fused] [--shapes] [--eager]

Each variant is many calls captured in one CUDA graph and replayed (device time; --eager: back-to-back launches
timed with events, which the small shapes' launch cost bounds). --fused: the decode step's fusions (RMSNorm
prologue on qkv and gate_up, gate_up gated). Weights rotate through copies larger than L2, so each call reads from
HBM. Percentages count the bytes of the weight as stored (2 or 1 a value).
"""

from __future__ import annotations

import argparse

import torch

from benches.bench_gemv import graph_us_per_call
from ember.kernels import gemv_config as GC
from ember.kernels.fp8 import quantize_rows
from ember.kernels.gemv import gemv
from ember.kernels.gemv_config import gemv_config
from ember.kernels import gemv_fp8 as GF
from ember.kernels import gemv_fp8_words as words
from ember.kernels.gemv_fp8 import gemv_fp8, round_rows, set_row_prepass

SHAPES = {"8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (28672, 4096), "8b down": (4096, 14336),
          "0.6b qkv": (4096, 1024)}
NORMED = ("qkv", "gate_up")          # projections with the RMSNorm prologue under --fused
LAUNCH_SHAPES = [(2, 8192), (2, 16384), (4, 8192), (4, 16384), (8, 16384)]    # (2, 8192): the constants


def time_us(fns, eager: bool, iters: int = 50) -> float:
    """Microseconds per call, cycling through `fns` (one per weight copy)."""
    if not eager:
        return graph_us_per_call(fns, max(64, 2 * len(fns)))
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fns[i % len(fns)]()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _tile(cfg: dict) -> str:
    return f"{'tc' if cfg['USE_DOT'] else 'cc'} {cfg['BLOCK_N']}x{cfg['BLOCK_K']}/s{cfg['SPLIT_K']}"


def round_rows_warps(row_counts, eager: bool) -> None:
    """`round_rows` alone on the 8B's rows (4096 with the norm, 14336 without) under each warp count."""
    dev = torch.device("cuda")
    for k, norm in ((4096, True), (14336, False)):
        nw = 1 + 0.1 * torch.randn(k, device=dev, dtype=torch.bfloat16) if norm else None
        for m in row_counts:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            for warps in (1, 2, 4, 8, 16):
                GF.ROW_WARPS = warps
                us = time_us([lambda: round_rows(x, nw)], eager)
                print(f"round_rows K={k:5d} M={m:2d} norm={int(norm)} warps={warps:2d} {us:6.2f} us", flush=True)
    GF.ROW_WARPS = 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--fused", action="store_true", help="RMSNorm prologue on qkv and gate_up, gate_up gated")
    ap.add_argument("--shapes", action="store_true", help="one-row launch shapes of the rounded dynamic path")
    ap.add_argument("--eager", action="store_true", help="back-to-back launches instead of a CUDA graph")
    ap.add_argument("--round-rows", action="store_true",
                    help="only `round_rows`, under each ROW_WARPS (the block stays: it fixes the sums' order)")
    args = ap.parse_args()
    if args.round_rows:
        return round_rows_warps(args.rows, args.eager)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    src, dst = (torch.empty(1 << 28, dtype=torch.uint8, device=dev) for _ in range(2))
    t = time_us([lambda: dst.copy_(src)], True, 10)
    bw = 2 * src.numel() / (t * 1e-6) / 1e9
    print(f"copy bandwidth {bw:,.0f} GB/s; {'eager launches' if args.eager else 'CUDA graphs'}")
    for name, (n, k) in SHAPES.items():
        gated = args.fused and name.endswith("gate_up")
        norm = args.fused and name.endswith(NORMED)
        n_out = n // 2 if gated else n
        copies = max(2, (200 << 20) // (n * k))
        w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        q = [quantize_rows(w) for w in w16]
        w8 = [a for a, _ in q]
        s8 = [b.reshape(-1).float().contiguous() for _, b in q]
        nw = 1 + 0.1 * torch.randn(k, device=dev, dtype=torch.bfloat16) if norm else None
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            floor16 = n * k * 2 / bw / 1e3
            floor8 = n * k / bw / 1e3
            rows = {"bf16 gemv": (time_us([lambda i=i: gemv(x, w16[i], norm_weight=nw, gated=gated)
                                           for i in range(copies)], args.eager), floor16, "")}

            def fp8(label, act, dot, prepass, config=None, word_wise=False):
                cfg = config or gemv_config(m, n_out, k, sms, 1, use_dot=dot, gated=gated)
                set_row_prepass(prepass)
                words.set_enabled(word_wise)
                try:
                    rows[label] = (time_us([lambda i=i: gemv_fp8(x, w8[i], s8[i], config=cfg, activations=act,
                                                                 norm_weight=nw, gated=gated)
                                            for i in range(copies)], args.eager), floor8, _tile(cfg))
                except Exception as e:      # a variant the kernel refuses: say so, go on
                    print(f"{name} M={m} {label}: {type(e).__name__}: {str(e)[:120]}")
                finally:
                    set_row_prepass(True)
                    words.set_enabled(False)

            for dot in (False, True):
                fp8(f"fp8 none dot={int(dot)}", "none", dot, True)
                fp8(f"fp8 dynamic in-kernel dot={int(dot)}", "dynamic", dot, False)
                fp8(f"fp8 dynamic rounded dot={int(dot)}", "dynamic", dot, True)
            if m == 1:
                fp8("fp8 none, word-wise", "none", False, True, word_wise=True)
                fp8("fp8 dynamic rounded, word-wise", "dynamic", False, True, word_wise=True)
            rows["round_rows alone"] = (time_us([lambda: round_rows(x, nw)], args.eager), 0.0, "")
            if args.shapes and m == 1:
                saved = GC.launch_shape, GC.PROGRAMS_PER_SM, GC.W_TILE_BYTES
                GC.launch_shape = lambda *a: None         # the constants below, not the stored table's
                try:
                    for pps, tile in LAUNCH_SHAPES:
                        GC.PROGRAMS_PER_SM, GC.W_TILE_BYTES = pps, tile
                        cfg = gemv_config(m, n_out, k, sms, 1, gated=gated)
                        fp8(f"fp8 dynamic rounded {pps}/SM {tile // 1024}K", "dynamic", False, True, cfg)
                finally:
                    GC.launch_shape, GC.PROGRAMS_PER_SM, GC.W_TILE_BYTES = saved
            for label, (us, floor, tile) in rows.items():
                pct = f"{100 * floor / us:5.1f}% of copy bandwidth" if floor else ""
                print(f"{name:12s} M={m:2d} {label:36s} {us:7.2f} us  {pct:26s} {tile}", flush=True)
        del w16, q, w8, s8
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
