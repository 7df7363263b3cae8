"""torch_ref attends a request's queries a chunk at a time: the same output as the whole score matrix at once (the
math it replaced, kept here), and no more memory than its declared workspace."""

from __future__ import annotations

import pytest
import torch

from ember.attention_backends.base import AttentionLayerOptions, StepBounds
from ember.attention_backends import torch_ref
from ember.attention_backends.torch_ref import TorchRefBackend, chunk_rows, paged_attention_ref
from ember.kv_spec import KVCacheSpec
from tests.helpers.peak_memory import PeakMemory


def unchunked_reference(query, kv_cache, block_table, query_start_loc_cpu, seq_lens_cpu, num_reqs, options, out,
                        sinks=None, alibi_slopes=None) -> None:
    """torch_ref's math before it chunked: each request's whole [Hq, L, S] score matrix at once, K/V repeated for
    every query head."""
    block_size = kv_cache.shape[2]
    num_heads, num_kv_heads = options.num_heads, options.num_kv_heads
    group = num_heads // num_kv_heads
    qsl, lens = query_start_loc_cpu.tolist(), seq_lens_cpu.tolist()
    for r in range(num_reqs):
        q_start, q_end, seq_len = qsl[r], qsl[r + 1], lens[r]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        context_len = seq_len - q_len
        blocks = block_table[r, :-(-seq_len // block_size)].long()
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, options.head_size)[:seq_len].float()
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, options.head_size)[:seq_len].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()
        scores = torch.einsum("lhd,shd->hls", q, k) * options.scale
        if options.logits_soft_cap:
            scores = options.logits_soft_cap * torch.tanh(scores / options.logits_soft_cap)
        q_pos = torch.arange(context_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.float()[:, None, None] * (k_pos - q_pos)[None].float()
        allowed = k_pos <= q_pos
        if options.sliding_window is not None:
            allowed = allowed & (q_pos - k_pos < options.sliding_window)
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        if sinks is not None:
            sink_col = sinks.float()[:, None, None].expand(num_heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hls,shd->lhd", probs, v).to(out.dtype)


def _batch(query_lens, seq_lens, dtype, num_heads=8, num_kv_heads=2, head_size=32, block_size=16, seed=0, **options):
    """Random inputs: each request's blocks scattered over a cache whose null block 0 holds NaN."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_req)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=g).to(dtype)
    cache[:, 0] = float("nan")
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks_per_req):
        table[r, :n] = order[used:used + n]
        used += n
    query = torch.randn(sum(query_lens), num_heads, head_size, generator=g).to(dtype)
    qsl = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    sinks = torch.randn(num_heads, generator=g) if options.get("use_sinks") else None
    slopes = torch.rand(num_heads, generator=g) if options.get("use_alibi") else None
    opts = AttentionLayerOptions(num_heads, num_kv_heads, head_size, head_size ** -0.5, **options)
    return (query, cache, table, qsl, torch.tensor(seq_lens, dtype=torch.int32), len(seq_lens), opts), sinks, slopes


OPTIONS = {
    "plain": {},
    "sliding_soft_cap": {"sliding_window": 9, "logits_soft_cap": 20.0},
    "sinks_alibi": {"use_sinks": True, "use_alibi": True},
}


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_small_chunks_give_the_unchunked_output(name, dtype):
    # a decode, a prefill after context, a whole prompt: with 64 scores a chunk, every query row is a chunk
    query_lens, seq_lens = (1, 23, 40), (57, 50, 40)
    args, sinks, slopes = _batch(query_lens, seq_lens, dtype, **OPTIONS[name])
    assert chunk_rows(40, 40, 8, 64) == 1 and chunk_rows(40, 40, 8, 8 * 40 * 7) == 7
    expected = torch.full_like(args[0], float("nan"))
    unchunked_reference(*args, expected, sinks, slopes)
    for chunk_elements in (64, 8 * 40 * 7, 1 << 24):      # a row, seven rows (a short last chunk), all at once
        out = torch.full_like(args[0], float("nan"))
        paged_attention_ref(*args, out, sinks, slopes, chunk_elements=chunk_elements)
        assert not out.isnan().any()
        if dtype == torch.float32:      # float32 rounding of the same sums, grouped differently
            torch.testing.assert_close(out, expected, atol=2e-6, rtol=0)
        else:                           # computed in float32: the bfloat16 outputs round the same
            assert (out.float() - expected.float()).abs().max().item() <= 2 ** -7


@pytest.mark.parametrize("query_len,seq_len,options,kv_dtype", [
    (1, 3000, {}, torch.bfloat16), (512, 512, {}, torch.bfloat16), (300, 1000, {}, torch.bfloat16),
    (512, 512, {"use_sinks": True, "use_alibi": True}, torch.bfloat16), (1, 3000, {}, torch.float8_e4m3fn),
    (512, 512, {}, torch.float8_e4m3fn)])
def test_what_it_allocates_stays_within_its_declared_workspace(monkeypatch, query_len, seq_len, options, kv_dtype):
    """Measured on the CPU (every tensor an op returns, until freed), with chunks of 2**18 scores (1 MiB) to keep
    the shapes small: within the declaration, which is not loose by more than half, and well under what the whole
    score matrix took. An e4m3 cache is dequantized as it is gathered."""
    monkeypatch.setattr(torch_ref, "SCORE_CHUNK_ELEMENTS", 1 << 18)
    args, sinks, slopes = _batch((query_len,), (seq_len,), torch.bfloat16, **options)
    scales = None
    if kv_dtype != torch.bfloat16:
        scales = (torch.full((2,), 0.5), torch.full((2,), 0.25))
        args = (args[0], args[1].float().to(kv_dtype), *args[2:])
    out = torch.empty_like(args[0])
    spec = KVCacheSpec(16, 2, 32, kv_dtype, None)
    declared = TorchRefBackend.workspace_bytes(StepBounds(query_len, 1, seq_len), spec, args[-1], torch.bfloat16)
    with PeakMemory() as chunked:
        paged_attention_ref(*args, out, sinks, slopes, kv_scales=scales)
    assert chunked.peak <= declared <= 1.5 * chunked.peak
    if query_len == seq_len and scales is None:
        with PeakMemory() as whole:
            unchunked_reference(*args, out, sinks, slopes)
        # 8 heads x 512 x 512 float32 scores are 8 MiB a copy; a chunk's, 1 MiB
        assert whole.peak > 5 * chunked.peak
