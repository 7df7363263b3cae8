"""The fp8 GEMV at a few rows under its launch variants, against the bf16 GEMV on the same shape and copy bandwidth:
weight-only (x in bf16) vs dynamic per-row e4m3 activations, CUDA cores vs tensor cores (use_dot), BLOCK_K scaled.

    PYTHONPATH=. python benches/experiments/fp8_gemv_modes.py [--rows 1 4 8]

Weights rotate through copies larger than L2, so each call reads from HBM.
"""

from __future__ import annotations

import argparse

import torch

from ember.kernels.fp8 import quantize_rows
from ember.kernels.gemv import gemv
from ember.kernels.gemv_config import gemv_config
from ember.kernels.gemv_fp8 import gemv_fp8

SHAPES = {"8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (28672, 4096), "8b down": (4096, 14336),
          "0.6b qkv": (4096, 1024)}


def time_us(fn, copies: int, iters: int = 50) -> float:
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fn(i % copies)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    src, dst = (torch.empty(1 << 28, dtype=torch.uint8, device=dev) for _ in range(2))
    t = time_us(lambda i: dst.copy_(src), 1, 10)
    bw = 2 * src.numel() / (t * 1e-6) / 1e9
    print(f"copy bandwidth {bw:,.0f} GB/s")
    for name, (n, k) in SHAPES.items():
        copies = max(2, (200 << 20) // (n * k))
        w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        q = [quantize_rows(w) for w in w16]
        w8 = [a for a, _ in q]
        s8 = [b.reshape(-1).float().contiguous() for _, b in q]
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            floor16 = n * k * 2 / bw / 1e3
            floor8 = n * k / bw / 1e3
            rows = {"bf16 gemv": (time_us(lambda i: gemv(x, w16[i]), copies), floor16)}
            for act in ("none", "dynamic"):
                for dot in (False, True):
                    cfg = gemv_config(m, n, k, sms, 1, use_dot=dot)
                    label = f"fp8 act={act} dot={int(dot)}"
                    try:
                        rows[label] = (time_us(lambda i: gemv_fp8(x, w8[i], s8[i], config=cfg, activations=act),
                                               copies), floor8)
                    except Exception as e:      # a variant the kernel refuses: say so, go on
                        print(f"{name} M={m} {label}: {type(e).__name__}: {str(e)[:120]}")
                    if m == 1 and not dot:
                        cfg2 = dict(cfg)
                        cfg2["BLOCK_K"] = cfg["BLOCK_K"] * 2
                        cfg2["BLOCK_N"] = max(1, cfg["BLOCK_N"] // 2)
                        try:
                            rows[label + " K*2,N/2"] = (time_us(lambda i: gemv_fp8(x, w8[i], s8[i], config=cfg2,
                                                                                   activations=act), copies), floor8)
                        except Exception as e:
                            print(f"{name} M={m} {label} K*2: {type(e).__name__}: {str(e)[:120]}")
            for label, (us, floor) in rows.items():
                print(f"{name:12s} M={m:2d} {label:28s} {us:7.2f} us  {100 * floor / us:5.1f}% of copy bandwidth")


if __name__ == "__main__":
    main()
