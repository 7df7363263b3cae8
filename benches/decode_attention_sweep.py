"""Decode attention tile sweep on a ragged batch, the shape a throughput run spends most of its device time in:
each 2D tile config and 3D segment count of the unified kernel, against the measured copy bandwidth.

    PYTHONPATH=. python benches/decode_attention_sweep.py --heads 16 8 --batch 256 --context 100:2048
"""

from __future__ import annotations

import argparse
import itertools
import random

import torch

from benches.conftest import time_cuda
from ember.attention_backends.triton_unified import kernels as K

HEAD_SIZE = 128


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write)."""
    a = torch.empty(2**29, dtype=torch.int16, device="cuda")
    b = torch.empty_like(a)
    ms = time_cuda([lambda: b.copy_(a)])
    return 2 * a.numel() * a.element_size() / (ms * 1e-3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, nargs=2, default=[16, 8])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", default="100:2048")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64])
    args = p.parse_args()
    num_heads, num_kv_heads = args.heads
    lo, hi = (int(x) for x in args.context.split(":"))
    rng = random.Random(0)
    lens = [rng.randint(lo, hi) for _ in range(args.batch)]
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; batch {args.batch}, contexts U[{lo}, {hi}] (mean {sum(lens) / len(lens):.0f}), "
          f"heads {num_heads}/{num_kv_heads}, head {HEAD_SIZE}")
    group = num_heads // num_kv_heads
    q = torch.randn(args.batch, num_heads, HEAD_SIZE, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    qsl = torch.arange(args.batch + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    kv_bytes = sum(lens) * num_kv_heads * HEAD_SIZE * 2 * 2
    for bs in args.block_sizes:
        per_seq = -(-hi // bs)
        num_blocks = 1 + args.batch * per_seq
        cache = torch.randn(2, num_blocks, num_kv_heads, bs, HEAD_SIZE, dtype=torch.bfloat16, device="cuda")
        table = (torch.randperm(num_blocks - 1, device="cuda", dtype=torch.int32) + 1).view(args.batch, per_seq)
        results = []
        block_m = max(16, triton_next_pow2(group))
        for tile_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3)):
            cfg = K.TileConfig(block_m=block_m, tile_n=tile_n, num_warps=warps, num_stages=stages)
            try:
                ms = time_cuda([lambda: K.unified_attention_2d(q, cache[0], cache[1], out, table, qsl, seq_lens,
                                                               num_seqs=args.batch, num_tokens=args.batch,
                                                               scale=HEAD_SIZE ** -0.5, config=cfg,
                                                               mode=K.MODE_DECODES)])
            except Exception as exc:    # a config that does not compile (shared memory) is skipped
                print(f"  2d tile_n={tile_n} warps={warps} stages={stages}: {type(exc).__name__}")
                continue
            results.append((ms, f"2d tile_n={tile_n:3d} warps={warps} stages={stages}"))
        for segments, tile_n in itertools.product((2, 4, 8), (32, 64)):
            cfg = K.TileConfig(block_m=block_m, tile_n=tile_n, num_warps=4, num_stages=3)
            n_out, n_rows = K.segment_scratch_numel(args.batch, num_heads, HEAD_SIZE, segments)
            scratch = [torch.empty(n, device="cuda", dtype=torch.float32) for n in (n_out, n_rows, n_rows)]
            ms = time_cuda([lambda: K.unified_attention_3d(q, cache[0], cache[1], out, table, qsl, seq_lens,
                                                           num_seqs=args.batch, scale=HEAD_SIZE ** -0.5, config=cfg,
                                                           num_segments=segments, scratch_out=scratch[0],
                                                           scratch_max=scratch[1], scratch_sum=scratch[2])])
            results.append((ms, f"3d segments={segments} tile_n={tile_n}"))
        results.sort()
        print(f"block_size {bs}: best 8 of {len(results)}")
        for ms, name in results[:8]:
            print(f"  {name:40s} {ms * 1e3:8.1f} us  {kv_bytes / (ms * 1e-3) / bw * 100:5.1f}% of copy bandwidth")
        default = [r for r in results if r[1] == "2d tile_n= 64 warps=4 stages=3"]
        if default:
            print(f"  current default (2d 64/4/3): {default[0][0] * 1e3:.1f} us, "
                  f"{kv_bytes / (default[0][0] * 1e-3) / bw * 100:.1f}%")
        del cache


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if __name__ == "__main__":
    main()
