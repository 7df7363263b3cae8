"""Which tiles make the flash backend's causal prefill fastest on this GPU, beside cuDNN SDPA in the same process.

One table: per (heads, length), cuDNN's TFLOP/s, then each variant's TFLOP/s, its ratio to cuDNN, its error against
the cuDNN output (relative Frobenius norm; a wrong variant shows here), and its compiled registers, spills and
shared memory. Times are CUDA-graph replays over enough paged-cache copies that no call finds its inputs in L2.

Also, on request: `triton_unified`'s decode on 16-, 64- and 128-token pages (--decode), a 16k prompt in 2k chunks
against one pass (--chunked), each variant launched once for a profiler (--once).

Run: PYTHONPATH=. python benches/experiments/flash_prefill_sweep.py [--lengths 16384,4096,2048,1024]
     [--heads 32/8,16/8] [--variants NAME,NAME | --plan-only] [--decode] [--chunked] [--once] [--log PATH]
Profile: ncu --clock-control none --kernel-name flash_prefill_kernel --launch-count 1 --section SpeedOfLight
     --section Occupancy --section WarpStateStats python benches/experiments/flash_prefill_sweep.py --once
     --plan-only --lengths 16384 --heads 32/8
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benches.bench_flash import time_graph as bench_time_graph

HEAD_SIZE = 128
DTYPE = torch.bfloat16


def variants():
    """name -> (block_size, FlashTiles)."""
    from ember.attention_backends.flash.kernels import FlashTiles as T
    return {
        "bs64 m64n64 w4 s3": (64, T(64, 64, 4, 3)),
        "bs64 m64n64 w4 s4": (64, T(64, 64, 4, 4)),
        "bs64 m128n64 w8 s2 r128": (64, T(128, 64, 8, 2, False, 128)),
        "bs64 m128n64 w8 s2 r120": (64, T(128, 64, 8, 2, False, 120)),
        "bs64 m128n64 w4 s2": (64, T(128, 64, 4, 2)),
        "bs64 m128n64 w8 s2 r128 ws": (64, T(128, 64, 8, 2, True, 128)),
        "bs64 m128n64 w8 s3 r128": (64, T(128, 64, 8, 3, False, 128)),
        "bs64 m128n64 w8 s4 r128": (64, T(128, 64, 8, 4, False, 128)),
        "bs64 m64n64 w8 s3": (64, T(64, 64, 8, 3)),
        "bs128 m128n64 w8 s2 r128": (128, T(128, 64, 8, 2, False, 128)),
        "bs128 m128n128 w8 s3": (128, T(128, 128, 8, 3)),
    }


def time_graph(fns, calls: int = 10, reps: int = 10) -> float:
    """Median ms of one call, from replays of a CUDA graph of `calls` calls cycling through `fns`."""
    return bench_time_graph(fns, calls_per_replay=calls, reps=reps)


def paged(k, v, block_size, copies):
    """K/V [T, Hkv, D] scattered into `copies` random page sets of a [2, blocks, Hkv, block_size, D] cache."""
    length, num_kv_heads, _ = k.shape
    n = -(-length // block_size)
    cache = torch.randn(2, 1 + copies * n, num_kv_heads, block_size, HEAD_SIZE, dtype=DTYPE, device="cuda")
    order = torch.randperm(copies * n, device="cuda") + 1
    tables = order.view(copies, 1, n).int()
    pad = n * block_size - length
    kp = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).view(n, block_size, num_kv_heads, HEAD_SIZE).transpose(1, 2)
    vp = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).view(n, block_size, num_kv_heads, HEAD_SIZE).transpose(1, 2)
    for c in range(copies):
        cache[0, tables[c, 0].long()] = kp
        cache[1, tables[c, 0].long()] = vp
    return cache, tables


def compiled_info(kernel) -> dict:
    """(num_warps, num_stages, block_m, tile_n, ws) -> (regs, spills, shared) of every compiled specialization."""
    info = {}
    for cache in getattr(kernel, "device_caches", {}).values():
        for compiled in cache[0].values():
            md = compiled.metadata
            info[(md.num_warps, md.num_stages)] = info.get((md.num_warps, md.num_stages), []) + [
                (compiled.n_regs, compiled.n_spills, md.shared)]
    return info


RAGGED = {"256xU[100,2048]": (256, 100, 2048), "64xU[200,8192]": (64, 200, 8192),
          "16xU[100,16384]": (16, 100, 16384), "4xU[1000,32768]": (4, 1000, 32768)}


def decode_pages(say, num_heads=32, num_kv_heads=8):
    """triton_unified's decode plan (as a uniform-decode bucket launches it) on 16-, 64- and 128-token pages: % of
    the measured copy bandwidth on ragged batches."""
    from ember.attention_backends.triton_unified import kernels as U, plan as UP
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = time_graph([lambda: dst.copy_(src)])
    copy_bps = 2 * 2**30 / (copy_ms * 1e-3)
    del src, dst
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    say(f"# decode: copy {copy_bps / 1e12:.2f} TB/s; triton_unified decode plan, % of copy bandwidth")
    for name, (n, lo, hi) in RAGGED.items():
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
        kv_bytes = sum(lengths) * num_kv_heads * HEAD_SIZE * 2 * 2
        copies = 1 if kv_bytes >= 4 * l2 else min(16, -(-4 * l2 // kv_bytes))
        q = torch.randn(n, num_heads, HEAD_SIZE, device="cuda", dtype=DTYPE)
        out = torch.empty_like(q)
        qsl = torch.arange(n + 1, device="cuda", dtype=torch.int32)
        seq_lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
        plan = UP.plan_launch(n, n, True, num_heads, num_kv_heads, HEAD_SIZE, sms, False)
        n_out, n_rows = U.segment_scratch_numel(n, num_heads, HEAD_SIZE, max(2, plan.num_segments))
        scratch = [torch.empty(k, device="cuda", dtype=torch.float32) for k in (n_out, n_rows, n_rows)]
        cells = []
        for block_size in (16, 64, 128):
            blocks = [-(-x // block_size) for x in lengths]
            width, total = max(blocks), sum(blocks)
            cache = torch.randn(2, 1 + copies * total, num_kv_heads, block_size, HEAD_SIZE, dtype=DTYPE,
                                device="cuda")
            order = torch.randperm(copies * total, device="cuda", dtype=torch.int32) + 1
            tables = torch.zeros(copies, n, width, dtype=torch.int32, device="cuda")
            used = 0
            for c in range(copies):
                for r, b in enumerate(blocks):
                    tables[c, r, :b] = order[used:used + b]
                    used += b

            def run(i):
                if plan.num_segments > 1:
                    return lambda: U.unified_attention_3d(
                        q, cache[0], cache[1], out, tables[i], qsl, seq_lens, num_seqs=n, scale=HEAD_SIZE ** -0.5,
                        config=plan.decode, num_segments=plan.num_segments, scratch_out=scratch[0],
                        scratch_max=scratch[1], scratch_sum=scratch[2])
                return lambda: U.unified_attention_2d(q, cache[0], cache[1], out, tables[i], qsl, seq_lens,
                                                      num_seqs=n, num_tokens=n, scale=HEAD_SIZE ** -0.5,
                                                      config=plan.decode, mode=U.MODE_DECODES)
            ms = time_graph([run(i) for i in range(copies)])
            cells.append(f"bs{block_size} {100 * (kv_bytes + 2 * q.numel() * 2) / (ms * 1e-3) / copy_bps:.1f}% "
                         f"({ms * 1e3:.1f} us)")
            del cache, tables
            torch.cuda.empty_cache()
        say(f"  decode {name:16s} segments {plan.num_segments}: " + ", ".join(cells))


def chunked(say, tiles_of, length=16384, chunk=2048, num_heads=32, num_kv_heads=8, block_size=64):
    """A `length`-token prompt's causal attention in one pass against `chunk`-token pieces, each attending to the
    pages the earlier ones wrote (chunked prefill, or a prefix hit): total ms, and TFLOP/s over the same FLOPs."""
    from ember.attention_backends.flash.kernels import flash_prefill
    n = -(-length // block_size)
    cache = torch.randn(2, 1 + n, num_kv_heads, block_size, HEAD_SIZE, dtype=DTYPE, device="cuda")
    table = (torch.randperm(n, device="cuda") + 1).int()[None]
    q = torch.randn(length, num_heads, HEAD_SIZE, dtype=DTYPE, device="cuda")
    out = torch.empty_like(q)
    flops = 4 * (length * (length + 1) / 2) * num_heads * HEAD_SIZE

    def piece(start, stop):
        qsl = torch.tensor([0, stop - start], device="cuda", dtype=torch.int32)
        seq_lens = torch.tensor([stop], device="cuda", dtype=torch.int32)
        tiles = tiles_of(stop - start)
        return lambda: flash_prefill(q[start:stop], cache[0], cache[1], out[start:stop], table, qsl, seq_lens,
                                     num_seqs=1, num_tokens=stop - start, scale=HEAD_SIZE ** -0.5, tiles=tiles)
    whole = time_graph([piece(0, length)], calls=4)
    pieces = [piece(s, min(s + chunk, length)) for s in range(0, length, chunk)]
    ref = out.clone()
    for fn in pieces:
        fn()
    torch.cuda.synchronize()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()

    def all_pieces():
        for fn in pieces:
            fn()
    split = time_graph([all_pieces], calls=2)
    say(f"# chunked prefill, {length} tokens, GQA {num_heads}/{num_kv_heads}, {block_size}-token pages: one pass "
        f"{whole:.2f} ms ({flops / whole / 1e9:.0f} TFLOP/s), {chunk}-token chunks {split:.2f} ms "
        f"({flops / split / 1e9:.0f} TFLOP/s), x{split / whole:.2f}; chunks vs one pass err {err:.1e}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="4096,16384,1024")
    ap.add_argument("--heads", default="32/8,16/8")
    ap.add_argument("--variants", default="")
    ap.add_argument("--plan-only", action="store_true", help="only the plan's tiles on 64- and 128-token pages")
    ap.add_argument("--log", default="")
    ap.add_argument("--once", action="store_true", help="launch each variant once, untimed, without cuDNN (under "
                                                        "a profiler: ncu --kernel-name flash_prefill_kernel ...)")
    ap.add_argument("--chunked", action="store_true", help="also time a 16k prompt in 2k chunks against one pass")
    ap.add_argument("--decode", action="store_true", help="also time triton_unified's decode on 16- and 64-token "
                                                          "pages (the per-phase backend's page-size question)")
    args = ap.parse_args()
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ember.attention_backends.flash.kernels import flash_prefill
    from ember.attention_backends.flash.kernels.prefill import flash_prefill_kernel
    log = open(args.log, "a") if args.log else None

    def say(line):
        print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()

    props = torch.cuda.get_device_properties(0)
    say(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    chosen = variants()
    from ember.attention_backends.flash.plan import prefill_tiles
    if args.variants or args.plan_only:
        chosen = {k: v for k, v in chosen.items() if k in args.variants.split(",")}
    if args.decode:
        decode_pages(say)
    if args.chunked:
        from ember.attention_backends.flash.plan import prefill_tiles
        chunked(say, lambda tokens: prefill_tiles(4, HEAD_SIZE, DTYPE, 64, tokens, 8))
    rows = []
    l2 = props.L2_cache_size
    for heads in args.heads.split(","):
        num_heads, num_kv_heads = map(int, heads.split("/"))
        group = num_heads // num_kv_heads
        for length in map(int, args.lengths.split(",")):
            flops = 4 * (length * (length + 1) / 2) * num_heads * HEAD_SIZE
            qkv_bytes = length * (num_heads + 2 * num_kv_heads) * HEAD_SIZE * 2
            copies = 1 if qkv_bytes >= 4 * l2 else min(16, -(-4 * l2 // qkv_bytes))
            q = torch.randn(length, num_heads, HEAD_SIZE, dtype=DTYPE, device="cuda")
            k = torch.randn(length, num_kv_heads, HEAD_SIZE, dtype=DTYPE, device="cuda")
            v = torch.randn(length, num_kv_heads, HEAD_SIZE, dtype=DTYPE, device="cuda")
            qs = [q.transpose(0, 1)[None].contiguous() for _ in range(copies)]
            ks = [k.transpose(0, 1)[None].repeat_interleave(group, 1).contiguous() for _ in range(copies)]
            vs = [v.transpose(0, 1)[None].repeat_interleave(group, 1).contiguous() for _ in range(copies)]

            plan = {f"plan bs{bs}": (bs, prefill_tiles(group, HEAD_SIZE, DTYPE, bs, length, num_kv_heads))
                    for bs in (64, 128)}
            if args.once:
                for name, (block_size, tiles) in {**plan, **chosen}.items():
                    cache, tables = paged(k, v, block_size, 1)
                    flash_prefill(q, cache[0], cache[1], torch.empty_like(q), tables[0],
                                  torch.tensor([0, length], device="cuda", dtype=torch.int32),
                                  torch.tensor([length], device="cuda", dtype=torch.int32), num_seqs=1,
                                  num_tokens=length, scale=HEAD_SIZE ** -0.5, tiles=tiles)
                    torch.cuda.synchronize()
                    say(f"  {name}: launched once")
                continue

            def sdpa(i):
                def run():
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        return torch.nn.functional.scaled_dot_product_attention(qs[i], ks[i], vs[i], is_causal=True)
                return run
            ref = sdpa(0)().float()[0].transpose(0, 1)      # [T, Hq, D]
            cudnn_ms = time_graph([sdpa(i) for i in range(copies)])
            cudnn = flops / cudnn_ms / 1e9
            del qs, ks, vs
            say(f"{heads} {length}: cudnn {cudnn:.0f} TFLOP/s ({cudnn_ms:.3f} ms), {copies} copies")
            qsl = torch.tensor([0, length], device="cuda", dtype=torch.int32)
            seq_lens = torch.tensor([length], device="cuda", dtype=torch.int32)
            caches = {}
            for name, (block_size, tiles) in {**plan, **chosen}.items():
                if block_size not in caches:
                    caches.clear()
                    torch.cuda.empty_cache()
                    caches[block_size] = paged(k, v, block_size, copies)
                cache, tables = caches[block_size]
                out = torch.full_like(q, float("nan"))
                fns = [lambda i=i: flash_prefill(q, cache[0], cache[1], out, tables[i], qsl, seq_lens, num_seqs=1,
                                                 num_tokens=length, scale=HEAD_SIZE ** -0.5, tiles=tiles)
                       for i in range(copies)]
                try:
                    t0 = time.time()
                    fns[0]()
                    torch.cuda.synchronize()
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    ms = time_graph(fns)
                except Exception as exc:
                    say(f"  {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                    continue
                tf = flops / ms / 1e9
                rows.append((heads, length, name, tf, tf / cudnn, err))
                say(f"  {name:26s} {tf:6.0f} TFLOP/s  x{tf / cudnn:.2f} cudnn  err {err:.1e}  ({ms:.3f} ms, "
                    f"first call {time.time() - t0:.1f} s)")
            del caches
            torch.cuda.empty_cache()
    say("# compiled (warps, stages): [(regs, spills, shared bytes)]")
    for key, val in compiled_info(flash_prefill_kernel).items():
        say(f"#   {key}: {val}")
    say("# heads length variant TFLOP/s vs_cudnn err")
    for heads, length, name, tf, ratio, err in rows:
        say(f"{heads} {length} {name} {tf:.0f} {ratio:.2f} {err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
