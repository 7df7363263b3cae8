"""Triton unified attention against the measured rooflines and its peers (SDPA on contiguous data, torch_ref).

Run: PYTHONPATH=. python -m pytest benches/bench_attention.py --benchmark-only -s -q
Each case prints time, bandwidth as % of the measured copy bandwidth, TFLOP/s as % of the measured bf16 matmul
rate, and the peers; the session ends with a summary table and the 2D/3D decode crossover.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from benches.conftest import BenchTable, rotation_count, time_cuda

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="benchmarks need a CUDA device")

DTYPE = torch.bfloat16
HEAD_SIZE = 128
BLOCK_SIZE = 16
MODELS = {"qwen3-0.6b": (16, 8), "llama-3.1-8b": (32, 8)}    # (query heads, KV heads)
DECODE_BATCHES = (1, 8, 64, 256)
DECODE_CONTEXTS = (512, 4096, 32768)
MAX_KV_BYTES = 40 * 2**30     # skip decode combos whose cache (plus the SDPA copy) would not fit in 78 GiB
SDPA_MAX_BYTES = 16 * 2**30
REF_MAX_TOKENS = 8 * 4096     # torch_ref loops over requests on the host: small cases only


def _kernels():
    from ember.attention_backends.triton_unified import kernels, plan
    return kernels, plan


def _paged(num_seqs: int, seq_len: int, num_kv_heads: int, copies: int, device="cuda"):
    """A random cache holding `copies` disjoint sets of num_seqs sequences (for L2 rotation) and a block table
    per set, blocks scattered at random."""
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    num_blocks = 1 + copies * num_seqs * blocks_per_seq
    cache = torch.empty(2, num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_SIZE, dtype=DTYPE, device=device)
    cache.normal_()     # [2, blocks, Hkv, block_size, D]
    order = torch.randperm(num_blocks - 1, device=device, dtype=torch.int32) + 1
    tables = order.view(copies, num_seqs, blocks_per_seq)   # [copies, num_seqs, blocks_per_seq]
    return cache, tables


def _row(table: BenchTable, suite, case, ms, bytes_moved, flops, peaks, **peers):
    gbps = bytes_moved / (ms * 1e-3) / 1e9
    tflops = flops / (ms * 1e-3) / 1e12
    row = dict(suite=suite, case=case, ms=ms, GB_s=gbps, bw_pct=100 * gbps * 1e9 / peaks.copy_bytes_per_s,
               TFLOP_s=tflops, mm_pct=100 * tflops * 1e12 / peaks.bf16_flops_per_s, **peers)
    table.add(**row)
    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return row


def _sdpa_ms(table: BenchTable, q, k, v, causal: bool) -> float | None:
    """SDPA on [B, H, S, D] tensors; K/V with fewer heads than Q use SDPA's GQA support."""
    import torch.nn.functional as F
    gqa = k.shape[1] != q.shape[1]
    try:
        return time_cuda([lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)])
    except (RuntimeError, TypeError) as exc:   # an SDPA build without GQA support
        table.notes.append(f"SDPA skipped: {exc}")
        return None


DECODE_CASES = [(m, b, c) for m in MODELS for b in DECODE_BATCHES for c in DECODE_CONTEXTS
                if b * c * MODELS[m][1] * HEAD_SIZE * 4 <= MAX_KV_BYTES]


@pytest.mark.parametrize("model,batch,context", DECODE_CASES, ids=[f"{m}-b{b}-c{c}" for m, b, c in DECODE_CASES])
def test_decode(benchmark, device_peaks, bench_table, model, batch, context):
    K, P = _kernels()
    num_heads, num_kv_heads = MODELS[model]
    kv_bytes = batch * context * num_kv_heads * HEAD_SIZE * 2 * DTYPE.itemsize
    copies = rotation_count(kv_bytes, device_peaks.l2_bytes)
    cache, tables = _paged(batch, context, num_kv_heads, copies)
    q = torch.randn(batch, num_heads, HEAD_SIZE, device="cuda", dtype=DTYPE)   # [B, Hq, D]
    out = torch.empty_like(q)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    group = num_heads // num_kv_heads
    tile_2d, tile_3d = P.decode_tile(group, HEAD_SIZE, split=False), P.decode_tile(group, HEAD_SIZE)
    pairs = batch * num_kv_heads
    # the 3D kernel with the plan's segment rule even where the plan would pick 2D, to find the crossover
    wanted = -(-P.SPLIT_KV_TARGET_PROGRAMS_PER_SM * device_peaks.num_sms // pairs)
    segments = min(P.MAX_SEGMENTS, max(2, 1 << (wanted - 1).bit_length()))
    n_out, n_rows = K.segment_scratch_numel(batch, num_heads, HEAD_SIZE, segments)
    scratch = [torch.empty(n, device="cuda", dtype=torch.float32) for n in (n_out, n_rows, n_rows)]
    common = dict(scale=HEAD_SIZE ** -0.5, num_seqs=batch)

    def run_2d(i):
        return lambda: K.unified_attention_2d(q, cache[0], cache[1], out, tables[i], qsl, seq_lens,
                                              num_tokens=batch, mode=K.MODE_DECODES, config=tile_2d, **common)

    def run_3d(i):
        return lambda: K.unified_attention_3d(q, cache[0], cache[1], out, tables[i], qsl, seq_lens,
                                              num_segments=segments, config=tile_3d, scratch_out=scratch[0],
                                              scratch_max=scratch[1], scratch_sum=scratch[2], **common)

    ms_2d = time_cuda([run_2d(i) for i in range(copies)])
    ms_3d = time_cuda([run_3d(i) for i in range(copies)])
    chosen = P.plan_launch(batch, batch, True, num_heads, num_kv_heads, HEAD_SIZE, device_peaks.num_sms, False)
    peers = dict(ms_2d=ms_2d, ms_3d=ms_3d, segs=segments, rule="3d" if chosen.num_segments > 1 else "2d")
    if kv_bytes <= SDPA_MAX_BYTES and kv_bytes + cache.numel() * cache.element_size() <= MAX_KV_BYTES:
        k = cache[0][tables[0].long()].permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, -1, HEAD_SIZE)
        v = cache[1][tables[0].long()].permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, -1, HEAD_SIZE)
        peers["sdpa_ms"] = _sdpa_ms(bench_table, q[:, :, None], k, v, False)
        del k, v
    if batch * context <= REF_MAX_TOKENS:
        peers["ref_ms"] = _ref_ms(q, cache, tables[0], qsl, seq_lens, num_heads, num_kv_heads)
    ms = ms_3d if chosen.num_segments > 1 else ms_2d
    bytes_moved = kv_bytes + 2 * q.numel() * q.element_size()
    flops = 4 * batch * context * num_heads * HEAD_SIZE
    _row(bench_table, "decode", f"{model} b{batch} c{context}", ms, bytes_moved, flops, device_peaks, **peers)
    benchmark.extra_info.update(peers)
    benchmark.pedantic(_synced(run_3d(0) if chosen.num_segments > 1 else run_2d(0)), rounds=3, iterations=1)


def _ref_ms(q, cache, table, qsl, seq_lens, num_heads, num_kv_heads) -> float:
    from ember.attention_backends.base import AttentionLayerOptions
    from ember.attention_backends.torch_ref import paged_attention_ref
    options = AttentionLayerOptions(num_heads, num_kv_heads, HEAD_SIZE, HEAD_SIZE ** -0.5)
    ref_cache = cache.transpose(2, 3)   # torch_ref's [2, blocks, block_size, Hkv, D] view
    out = torch.empty_like(q)
    qsl_cpu, lens_cpu = qsl.cpu(), seq_lens.cpu()
    return time_cuda([lambda: paged_attention_ref(q, ref_cache, table, qsl_cpu, lens_cpu, len(lens_cpu), options,
                                                  out)], warmup=1, reps=3)


def _synced(fn):
    def run():
        fn()
        torch.cuda.synchronize()
    return run


PREFILL_LENGTHS = (1024, 4096, 16384)


@pytest.mark.parametrize("length", PREFILL_LENGTHS)
def test_prefill(benchmark, device_peaks, bench_table, length):
    K, P = _kernels()
    num_heads, num_kv_heads = MODELS["llama-3.1-8b"]
    qkv_bytes = length * (num_heads + 2 * num_kv_heads) * HEAD_SIZE * DTYPE.itemsize
    copies = rotation_count(qkv_bytes, device_peaks.l2_bytes)
    cache, tables = _paged(1, length, num_kv_heads, copies)
    q = torch.randn(length, num_heads, HEAD_SIZE, device="cuda", dtype=DTYPE)   # [T, Hq, D]
    out = torch.empty_like(q)
    qsl = torch.tensor([0, length], device="cuda", dtype=torch.int32)
    seq_lens = torch.tensor([length], device="cuda", dtype=torch.int32)
    plan = P.plan_launch(length, 1, False, num_heads, num_kv_heads, HEAD_SIZE, device_peaks.num_sms, False)

    def run(i):
        return lambda: K.unified_attention_2d(q, cache[0], cache[1], out, tables[i], qsl, seq_lens, num_seqs=1,
                                              num_tokens=length, scale=HEAD_SIZE ** -0.5, config=plan.rest)

    ms = time_cuda([run(i) for i in range(copies)])
    k = cache[0][tables[0, 0].long()].transpose(0, 1).reshape(1, num_kv_heads, -1, HEAD_SIZE)[:, :, :length]
    v = cache[1][tables[0, 0].long()].transpose(0, 1).reshape(1, num_kv_heads, -1, HEAD_SIZE)[:, :, :length]
    group = num_heads // num_kv_heads   # K/V expanded to the query heads: SDPA's flash path, no GQA fallback
    sdpa_ms = _sdpa_ms(bench_table, q.transpose(0, 1)[None].contiguous(),
                       k.repeat_interleave(group, dim=1).contiguous(), v.repeat_interleave(group, dim=1).contiguous(),
                       True)
    peers = dict(sdpa_ms=sdpa_ms, vs_sdpa=(sdpa_ms / ms) if sdpa_ms else None, block_m=plan.rest.block_m)
    flops = 4 * (length * (length + 1) / 2) * num_heads * HEAD_SIZE
    _row(bench_table, "prefill", f"llama-3.1-8b causal {length}", ms, qkv_bytes + q.numel() * q.element_size(), flops,
         device_peaks, **peers)
    benchmark.extra_info.update(peers)
    benchmark.pedantic(_synced(run(0)), rounds=3, iterations=1)


@pytest.mark.parametrize("prefill_len", (16384, 65536))
def test_mixed_split_vs_single(benchmark, device_peaks, bench_table, prefill_len):
    """One long prefill plus 63 decodes of 2k context: split launch against one 2D launch."""
    K, P = _kernels()
    num_heads, num_kv_heads = MODELS["llama-3.1-8b"]
    num_decodes, decode_ctx = 63, 2048
    seq_lens_list = [decode_ctx] * num_decodes + [prefill_len]
    query_lens = [1] * num_decodes + [prefill_len]
    num_tokens, num_reqs = sum(query_lens), len(query_lens)
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens_list]
    num_blocks = 1 + sum(blocks)
    cache = torch.empty(2, num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_SIZE, dtype=DTYPE, device="cuda").normal_()
    order = (torch.randperm(num_blocks - 1, dtype=torch.int32) + 1).tolist()
    table = torch.zeros(num_reqs, max(blocks), dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks):
        table[r, :n] = torch.tensor(order[used:used + n], dtype=torch.int32)
        used += n
    table = table.cuda()
    qsl = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device="cuda")
    q = torch.randn(num_tokens, num_heads, HEAD_SIZE, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    nd = torch.tensor([num_decodes], dtype=torch.int32, device="cuda")
    layout = (q, cache[0], cache[1], out, table, qsl, seq_lens)
    opts = dict(scale=HEAD_SIZE ** -0.5, num_seqs=num_reqs, num_tokens=num_tokens, num_decodes=nd)
    sms = device_peaks.num_sms
    single = P.plan_launch(num_tokens, num_reqs, False, num_heads, num_kv_heads, HEAD_SIZE, sms, False)
    split = P.plan_launch(num_tokens, num_reqs, False, num_heads, num_kv_heads, HEAD_SIZE, sms, True)

    def run_single(config):
        return lambda: K.unified_attention_2d(*layout, config=config, **opts)

    def run_split():
        if split.num_segments > 1:
            n_out, n_rows = K.segment_scratch_numel(split.num_decode_seqs, num_heads, HEAD_SIZE, split.num_segments)
            scratch = [torch.empty(n, device="cuda", dtype=torch.float32) for n in (n_out, n_rows, n_rows)]

            def decode():
                K.unified_attention_3d(*layout, num_seqs=split.num_decode_seqs, scale=HEAD_SIZE ** -0.5,
                                       config=split.decode, num_segments=split.num_segments, scratch_out=scratch[0],
                                       scratch_max=scratch[1], scratch_sum=scratch[2], num_decodes=nd)
        else:
            def decode():
                K.unified_attention_2d(*layout, config=split.decode, mode=K.MODE_DECODES,
                                       **{**opts, "num_seqs": split.num_decode_seqs})

        def both():
            decode()
            K.unified_attention_2d(*layout, config=split.rest, mode=K.MODE_PREFILLS, **opts)
        return both

    ms_split = time_cuda([run_split()], reps=10)
    ms_single = time_cuda([run_single(single.rest)], reps=10)
    decode_tile = P.prefill_tile(num_heads // num_kv_heads, HEAD_SIZE, block_m=16)
    ms_single_small = time_cuda([run_single(decode_tile)], reps=5)
    flops = 4 * (prefill_len * (prefill_len + 1) / 2 + num_decodes * decode_ctx) * num_heads * HEAD_SIZE
    kv = (prefill_len + num_decodes * decode_ctx) * num_kv_heads * HEAD_SIZE * 2 * DTYPE.itemsize
    peers = dict(single_ms=ms_single, single_vs_split=ms_single / ms_split, single_m16_ms=ms_single_small,
                 single_m16_vs_split=ms_single_small / ms_split, single_block_m=single.rest.block_m)
    bytes_moved = kv + 2 * q.numel() * q.element_size()
    _row(bench_table, "mixed", f"prefill {prefill_len} + 63 decodes x 2k", ms_split, bytes_moved, flops, device_peaks,
         **peers)
    benchmark.extra_info.update(peers)
    benchmark.pedantic(_synced(run_split()), rounds=2, iterations=1)


def test_decode_crossover(benchmark, device_peaks, bench_table):
    """Summarize where the 3D kernel stops beating the 2D one, next to the threshold the plan uses."""
    _, P = _kernels()
    rows = [r for r in bench_table.rows if r["suite"] == "decode"]
    if not rows:
        pytest.skip("no decode rows recorded in this session")
    threshold = P.SPLIT_KV_MAX_PAIRS_PER_SM * device_peaks.num_sms
    for model, (_, num_kv_heads) in MODELS.items():
        for context in DECODE_CONTEXTS:
            cases = sorted((int(r["case"].split()[1][1:]), r) for r in rows
                           if r["case"].startswith(model + " ") and r["case"].endswith(f"c{context}"))
            wins = [b for b, r in cases if r["ms_3d"] < r["ms_2d"]]
            detail = ", ".join(f"b{b}: 2d {r['ms_2d']:.3f} / 3d {r['ms_3d']:.3f} ms" for b, r in cases)
            bench_table.notes.append(f"crossover {model} ctx {context}: 3D faster up to batch "
                               f"{max(wins) if wins else 0} ({detail}); plan uses 3D while batch x {num_kv_heads} "
                               f"KV heads < {threshold:.0f} (SPLIT_KV_MAX_PAIRS_PER_SM={P.SPLIT_KV_MAX_PAIRS_PER_SM})")
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
