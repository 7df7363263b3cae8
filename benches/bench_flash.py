"""The flash backend's kernels against the measured rooflines and their peers in the same run: causal prefill
beside PyTorch SDPA (cuDNN, and its default pick) and the unified 2D kernel; ragged decode beside the unified
decode and the copy bandwidth.

Run: PYTHONPATH=. python -m pytest benches/bench_flash.py --benchmark-only -s -q
Each row prints time, TFLOP/s (and % of the measured bf16 matmul rate) or GB/s (and % of the measured copy
bandwidth), and the peers; tile and split variants are swept so the plan's choices can be checked. Kernel times
come from CUDA-graph replays (as the runner replays them), so host launch costs stay out; the decode plan, which
runs outside the graphs once per step, is also timed eagerly (plan_eager_ms).
"""

from __future__ import annotations

import statistics

import pytest
import torch

from benches.conftest import BenchTable, rotation_count, time_cuda

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="benchmarks need a CUDA device")

DTYPE = torch.bfloat16
HEAD_SIZE = 128
PREFILL_LENGTHS = (1024, 4096, 16384)
PREFILL_HEADS = {"gqa32/8": (32, 8), "gqa16/8": (16, 8)}
RAGGED = {"256xU[100,2048]": (256, 100, 2048), "64xU[200,8192]": (64, 200, 8192),
          "16xU[100,16384]": (16, 100, 16384), "4xU[1000,32768]": (4, 1000, 32768)}
DECODE_HEADS = (32, 8)


def time_graph(fns, calls_per_replay: int = 10, reps: int = 15) -> float:
    """Median milliseconds of one call, from replays of a CUDA graph holding `calls_per_replay` calls that cycle
    through `fns` (the same work over different input copies, so calls do not find their inputs in L2)."""
    for fn in fns:      # compile and warm up outside the capture
        fn()
    torch.cuda.synchronize()
    calls = max(calls_per_replay, len(fns))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def _flash():
    from ember.attention_backends.flash import kernels, plan
    return kernels, plan


def _prefill_variants(F, P, group, length, num_kv_heads):
    """(label, block_size, tiles): the plan's pick per page size first, then a sweep around it."""
    variants = [("plan bs64", 64, P.prefill_tiles(group, HEAD_SIZE, DTYPE, 64, length, num_kv_heads)),
                ("plan bs128", 128, P.prefill_tiles(group, HEAD_SIZE, DTYPE, 128, length, num_kv_heads))]
    if group == 4:
        T = F.FlashTiles
        variants += [("bs64 m64 4w 3stg", 64, T(64, 64, 4, 3)), ("bs128 n128 8w 3stg", 128, T(128, 128, 8, 3)),
                     ("bs64 m128 4w 2stg", 64, T(128, 64, 4, 2))]
    return variants


def _paged(lengths: list[int], num_kv_heads: int, block_size: int, copies: int):
    """A random cache holding `copies` disjoint sets of the sequences, blocks scattered at random, and one block
    table per set: [copies, num_seqs, max_blocks]."""
    blocks = [-(-n // block_size) for n in lengths]
    width = max(blocks)
    total = sum(blocks)
    cache = torch.empty(2, 1 + copies * total, num_kv_heads, block_size, HEAD_SIZE, dtype=DTYPE, device="cuda")
    cache.normal_()
    order = torch.randperm(copies * total, device="cuda", dtype=torch.int32) + 1
    tables = torch.zeros(copies, len(lengths), width, dtype=torch.int32, device="cuda")
    used = 0
    for c in range(copies):
        for r, n in enumerate(blocks):
            tables[c, r, :n] = order[used:used + n]
            used += n
    return cache, tables


def _row(table: BenchTable, suite, case, ms, peaks, flops=None, bytes_moved=None, **peers):
    row = dict(suite=suite, case=case, ms=ms)
    if flops is not None:
        tflops = flops / (ms * 1e-3) / 1e12
        row.update(TFLOP_s=tflops, mm_pct=100 * tflops * 1e12 / peaks.bf16_flops_per_s)
    if bytes_moved is not None:
        gbps = bytes_moved / (ms * 1e-3) / 1e9
        row.update(GB_s=gbps, bw_pct=100 * gbps * 1e9 / peaks.copy_bytes_per_s)
    row.update(peers)
    table.add(**row)
    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def _sdpa_ms(q, k, v) -> dict:
    """SDPA on [1, H, T, D] with K/V expanded to the query heads: cuDNN forced, and PyTorch's own pick."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    result = {}
    for label, backends in (("cudnn", [SDPBackend.CUDNN_ATTENTION]), ("default", None)):
        def run():
            if backends is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        try:
            result[label] = time_graph([run])
        except RuntimeError as exc:
            print(f"SDPA {label} unavailable in a graph ({str(exc)[:120]}); timed eagerly")
            try:
                result[label] = time_cuda([run], reps=20)
            except RuntimeError as exc2:
                print(f"SDPA {label} unavailable: {str(exc2)[:200]}")
    return result


@pytest.mark.parametrize("heads", list(PREFILL_HEADS))
@pytest.mark.parametrize("length", PREFILL_LENGTHS)
def test_prefill(benchmark, device_peaks, bench_table, heads, length):
    F, P = _flash()
    from ember.attention_backends.triton_unified import kernels as U, plan as UP
    num_heads, num_kv_heads = PREFILL_HEADS[heads]
    group = num_heads // num_kv_heads
    flops = 4 * (length * (length + 1) / 2) * num_heads * HEAD_SIZE
    qkv_bytes = length * (num_heads + 2 * num_kv_heads) * HEAD_SIZE * DTYPE.itemsize
    copies = rotation_count(qkv_bytes, device_peaks.l2_bytes)
    q = torch.randn(length, num_heads, HEAD_SIZE, device="cuda", dtype=DTYPE)   # [T, Hq, D]
    out = torch.empty_like(q)
    qsl = torch.tensor([0, length], device="cuda", dtype=torch.int32)
    seq_lens = torch.tensor([length], device="cuda", dtype=torch.int32)
    scale = HEAD_SIZE ** -0.5
    caches = {}

    def cache_for(block_size):
        if block_size not in caches:
            caches[block_size] = _paged([length], num_kv_heads, block_size, copies)
        return caches[block_size]

    # peers: SDPA on contiguous K/V of the first copy, and the unified 2D kernel on its default 16-token pages
    cache, tables = _paged([length], num_kv_heads, 16, copies)
    k = cache[0][tables[0, 0].long()].transpose(0, 1).reshape(1, num_kv_heads, -1, HEAD_SIZE)[:, :, :length]
    v = cache[1][tables[0, 0].long()].transpose(0, 1).reshape(1, num_kv_heads, -1, HEAD_SIZE)[:, :, :length]
    sdpa = _sdpa_ms(q.transpose(0, 1)[None].contiguous(), k.repeat_interleave(group, 1).contiguous(),
                    v.repeat_interleave(group, 1).contiguous(), )
    del k, v
    uplan = UP.plan_launch(length, 1, False, num_heads, num_kv_heads, HEAD_SIZE, device_peaks.num_sms, False)
    def unified(cache, tables):
        return [lambda i=i: U.unified_attention_2d(q, cache[0], cache[1], out, tables[i], qsl, seq_lens, num_seqs=1,
                                                   num_tokens=length, scale=scale, config=uplan.rest)
                for i in range(copies)]
    unified_ms = time_graph(unified(cache, tables))
    del cache, tables
    unified64_ms = time_graph(unified(*cache_for(64)))
    sdpa_ref = sdpa.get("cudnn") or sdpa.get("default")
    peers = dict(sdpa_cudnn_tflops=flops / sdpa["cudnn"] / 1e9 if "cudnn" in sdpa else None,
                 sdpa_default_tflops=flops / sdpa["default"] / 1e9 if "default" in sdpa else None,
                 unified_tflops=flops / unified_ms / 1e9, unified_bs64_tflops=flops / unified64_ms / 1e9)
    for label, block_size, tiles in _prefill_variants(F, P, group, length, num_kv_heads):
        cache, tables = cache_for(block_size)

        def run(i, cache=cache, tables=tables, tiles=tiles):
            return lambda: F.flash_prefill(q, cache[0], cache[1], out, tables[i], qsl, seq_lens, num_seqs=1,
                                           num_tokens=length, scale=scale, tiles=tiles)
        try:
            ms = time_graph([run(i) for i in range(copies)])
        except Exception as exc:   # a variant this Triton cannot compile is reported, not fatal
            print(f"prefill {label}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        _row(bench_table, "prefill", f"{heads} causal {length} {label}", ms, device_peaks, flops=flops,
             vs_sdpa=(sdpa_ref / ms) if sdpa_ref else None, tma=F.can_use_tma(cache[0], tiles.tile_n), **peers)
    benchmark.extra_info.update(peers)
    benchmark.pedantic(lambda: torch.cuda.synchronize(), rounds=1, iterations=1)


def _ragged_lengths(name: str) -> list[int]:
    n, lo, hi = RAGGED[name]
    g = torch.Generator().manual_seed(0)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


@pytest.mark.parametrize("workload", list(RAGGED))
def test_ragged_decode(benchmark, device_peaks, bench_table, workload):
    F, P = _flash()
    from ember.attention_backends.triton_unified import kernels as U, plan as UP
    num_heads, num_kv_heads = DECODE_HEADS
    group = num_heads // num_kv_heads
    lengths = _ragged_lengths(workload)
    batch = len(lengths)
    kv_bytes = sum(lengths) * num_kv_heads * HEAD_SIZE * 2 * DTYPE.itemsize
    copies = rotation_count(kv_bytes, device_peaks.l2_bytes)
    q = torch.randn(batch, num_heads, HEAD_SIZE, device="cuda", dtype=DTYPE)    # [B, Hq, D]
    out = torch.empty_like(q)
    bytes_moved = kv_bytes + 2 * q.numel() * q.element_size()
    flops = 4 * sum(lengths) * num_heads * HEAD_SIZE
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    scale = HEAD_SIZE ** -0.5
    sms = device_peaks.num_sms

    # peer: the unified backend's decode as its plan picks it for this uniform-decode bucket, on its default
    # 16-token pages and on 64-token pages
    uplan = UP.plan_launch(batch, batch, True, num_heads, num_kv_heads, HEAD_SIZE, sms, False)
    n_out, n_rows = U.segment_scratch_numel(batch, num_heads, HEAD_SIZE, max(2, uplan.num_segments))
    scratch = [torch.empty(n, device="cuda", dtype=torch.float32) for n in (n_out, n_rows, n_rows)]

    def unified(cache, tables):
        if uplan.num_segments > 1:
            return [lambda i=i: U.unified_attention_3d(q, cache[0], cache[1], out, tables[i], qsl, seq_lens,
                                                       num_seqs=batch, scale=scale, config=uplan.decode,
                                                       num_segments=uplan.num_segments, scratch_out=scratch[0],
                                                       scratch_max=scratch[1], scratch_sum=scratch[2])
                    for i in range(copies)]
        return [lambda i=i: U.unified_attention_2d(q, cache[0], cache[1], out, tables[i], qsl, seq_lens,
                                                   num_seqs=batch, num_tokens=batch, scale=scale, config=uplan.decode,
                                                   mode=U.MODE_DECODES) for i in range(copies)]
    unified_ms = time_graph(unified(*_paged(lengths, num_kv_heads, 16, copies)))
    peers = dict(unified_bw_pct=100 * bytes_moved / (unified_ms * 1e-3) / device_peaks.copy_bytes_per_s)

    T = F.FlashTiles
    pps = P.DECODE_PROGRAMS_PER_SM
    variants = [("plan bs64", 64, P.decode_tiles(group, HEAD_SIZE, DTYPE, 64), pps),
                ("plan bs128", 128, P.decode_tiles(group, HEAD_SIZE, DTYPE, 128), pps),
                ("bs64 pps4", 64, T(16, 64, 4, 3), 4), ("bs64 pps16", 64, T(16, 64, 4, 3), 16),
                ("bs128 n128 3stg", 128, T(16, 128, 4, 3), pps)]
    for block_size in (64, 128):
        cache, tables = _paged(lengths, num_kv_heads, block_size, copies)
        if block_size == 64:
            peers["unified_bs64_bw_pct"] = 100 * bytes_moved / (time_graph(unified(cache, tables)) * 1e-3) \
                / device_peaks.copy_bytes_per_s
        for label, bs, tiles, programs_per_sm in variants:
            if bs != block_size:
                continue
            ws = F.DecodeWorkspace(batch, num_kv_heads, HEAD_SIZE, tiles.tile_n,
                                   max(1, -(-programs_per_sm * sms // num_kv_heads)), "cuda",
                                   min_chunk=P.DECODE_MIN_CHUNK)
            ws.plan(seq_lens, batch)
            plan_eager_ms = time_cuda([lambda ws=ws: ws.plan(seq_lens, batch)], reps=20)

            def run(i, cache=cache, tables=tables, tiles=tiles, ws=ws):
                return lambda: F.flash_decode(q, cache[0], cache[1], out, tables[i], qsl, seq_lens, workspace=ws,
                                              num_rows=batch, scale=scale, tiles=tiles)
            try:
                ms = time_graph([run(i) for i in range(copies)])
            except Exception as exc:
                print(f"decode {label}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            chunk, _ = ws.params.tolist()
            items = int(ws.work_start[batch].item())
            _row(bench_table, "decode", f"{workload} {label}", ms, device_peaks, flops=flops, bytes_moved=bytes_moved,
                 plan_eager_ms=plan_eager_ms, chunk_tiles=chunk, items=items, vs_unified=unified_ms / ms, **peers)
        del cache, tables
    benchmark.extra_info.update(peers)
    benchmark.pedantic(lambda: torch.cuda.synchronize(), rounds=1, iterations=1)


@pytest.mark.parametrize("workload", list(RAGGED))
def test_ragged_decode_fp8(benchmark, device_peaks, bench_table, workload):
    """Ragged decode over an fp8 (e4m3) cache with per-head scales: flash (its plan, 64-token pages) and the unified
    backend's plan (16-token pages), % of copy bandwidth counting the e4m3 bytes, beside flash on bf16 pages."""
    F, P = _flash()
    from ember.attention_backends.triton_unified import kernels as U, plan as UP
    num_heads, num_kv_heads = DECODE_HEADS
    group = num_heads // num_kv_heads
    lengths = _ragged_lengths(workload)
    batch = len(lengths)
    kv_bytes = sum(lengths) * num_kv_heads * HEAD_SIZE * 2          # one byte an element
    copies = rotation_count(kv_bytes, device_peaks.l2_bytes)
    q = torch.randn(batch, num_heads, HEAD_SIZE, device="cuda", dtype=DTYPE)    # [B, Hq, D]
    out = torch.empty_like(q)
    bytes_moved = kv_bytes + 2 * q.numel() * q.element_size()
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    scale = HEAD_SIZE ** -0.5
    scales = (torch.full((num_kv_heads,), 0.5, device="cuda"), torch.full((num_kv_heads,), 0.25, device="cuda"))
    sms = device_peaks.num_sms

    def fp8_paged(block_size):
        cache, tables = _paged(lengths, num_kv_heads, block_size, copies)
        return cache.to(torch.float8_e4m3fn), tables

    uplan = UP.plan_launch(batch, batch, True, num_heads, num_kv_heads, HEAD_SIZE, sms, False)
    n_out, n_rows = U.segment_scratch_numel(batch, num_heads, HEAD_SIZE, max(2, uplan.num_segments))
    scratch = [torch.empty(n, device="cuda", dtype=torch.float32) for n in (n_out, n_rows, n_rows)]
    cache, tables = fp8_paged(16)
    if uplan.num_segments > 1:
        fns = [lambda i=i: U.unified_attention_3d(q, cache[0], cache[1], out, tables[i], qsl, seq_lens,
                                                  num_seqs=batch, scale=scale, config=uplan.decode,
                                                  num_segments=uplan.num_segments, scratch_out=scratch[0],
                                                  scratch_max=scratch[1], scratch_sum=scratch[2], kv_scales=scales)
               for i in range(copies)]
    else:
        fns = [lambda i=i: U.unified_attention_2d(q, cache[0], cache[1], out, tables[i], qsl, seq_lens,
                                                  num_seqs=batch, num_tokens=batch, scale=scale, config=uplan.decode,
                                                  mode=U.MODE_DECODES, kv_scales=scales) for i in range(copies)]
    unified_ms = time_graph(fns)
    del cache, tables
    _row(bench_table, "decode_fp8", f"{workload} unified plan bs16", unified_ms, device_peaks,
         bytes_moved=bytes_moved)

    tiles = P.decode_tiles(group, HEAD_SIZE, torch.float8_e4m3fn, 64)
    ws = F.DecodeWorkspace(batch, num_kv_heads, HEAD_SIZE, tiles.tile_n, P.decode_target_items(sms, num_kv_heads),
                           "cuda", min_chunk=P.DECODE_MIN_CHUNK)
    ws.plan(seq_lens, batch)
    times = {}
    for kind in ("fp8", "bf16"):
        cache, tables = fp8_paged(64) if kind == "fp8" else _paged(lengths, num_kv_heads, 64, copies)
        kv = dict(kv_scales=scales) if kind == "fp8" else {}
        times[kind] = time_graph([lambda i=i, cache=cache, tables=tables, kv=kv: F.flash_decode(
            q, cache[0], cache[1], out, tables[i], qsl, seq_lens, workspace=ws, num_rows=batch, scale=scale,
            tiles=tiles, **kv) for i in range(copies)])
        del cache, tables
    _row(bench_table, "decode_fp8", f"{workload} flash plan bs64", times["fp8"], device_peaks, bytes_moved=bytes_moved,
         bf16_ms=times["bf16"], speedup_vs_bf16=times["bf16"] / times["fp8"])
    benchmark.pedantic(lambda: torch.cuda.synchronize(), rounds=1, iterations=1)
