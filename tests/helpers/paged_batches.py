"""Random paged batches in this backend's cache layout, and the reference output for them: shared by the tests
and the benchmark of the Triton unified attention kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.attention_backends.base import AttentionLayerOptions
from ember.attention_backends.torch_ref import paged_attention_ref


@dataclass(frozen=True)
class BatchShape:
    """One named batch: per request its new query tokens and total sequence length (context + new), decodes first
    where a test relies on that; plus head layout, cache block size, options and padding rows."""
    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    sliding_window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False
    alibi: bool = False
    pad_reqs: int = 0      # padding requests: zero-length queries, seq_len 0, null block table rows
    pad_tokens: int = 0    # padding tokens: slot -1

    @property
    def num_decodes(self) -> int:
        n = 0
        for q in self.query_lens:
            if q != 1:
                break
            n += 1
        return n

    def options(self) -> AttentionLayerOptions:
        return AttentionLayerOptions(self.num_heads, self.num_kv_heads, self.head_size, self.head_size ** -0.5,
                                     sliding_window=self.sliding_window, logits_soft_cap=self.soft_cap,
                                     use_sinks=self.sinks, use_alibi=self.alibi)


@dataclass
class PagedBatch:
    """Tensors of one batch. `kv_cache` holds the context only; `expected_cache` also holds the new tokens."""
    shape: BatchShape
    query: torch.Tensor            # [num_tokens_padded, Hq, D]
    key: torch.Tensor              # [num_tokens_padded, Hkv, D] the new tokens' keys
    value: torch.Tensor            # [num_tokens_padded, Hkv, D]
    kv_cache: torch.Tensor         # [2, num_blocks, Hkv, block_size, D]
    expected_cache: torch.Tensor   # [2, num_blocks, Hkv, block_size, D]
    block_table: torch.Tensor      # [num_reqs_padded, max_blocks] int32, 0 = null block
    query_start_loc: torch.Tensor  # [num_reqs_padded + 1] int32
    seq_lens: torch.Tensor         # [num_reqs_padded] int32
    slot_mapping: torch.Tensor     # [num_tokens_padded] int64, -1 for padding tokens
    sinks: torch.Tensor | None     # [Hq] float32
    alibi_slopes: torch.Tensor | None   # [Hq] float32

    @property
    def num_reqs(self) -> int:
        return len(self.shape.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.shape.query_lens)

    @property
    def num_reqs_padded(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens_padded(self) -> int:
        return self.query.shape[0]


def make_paged_batch(shape: BatchShape, dtype: torch.dtype, device: torch.device | str,
                     generator: torch.Generator | None = None, extra_blocks: int = 3) -> PagedBatch:
    """Fresh random inputs; blocks scattered at random (never the null block 0, which holds NaN so that a
    kernel reading it unmasked shows up)."""
    s = shape
    if len(s.query_lens) != len(s.seq_lens) or any(q > n for q, n in zip(s.query_lens, s.seq_lens)):
        raise ValueError(f"{s.name}: query_lens {s.query_lens} must pair with seq_lens {s.seq_lens} (q <= seq)")
    device = torch.device(device)
    g = generator
    bs, hkv, d = s.block_size, s.num_kv_heads, s.head_size
    blocks_per_req = [-(-n // bs) for n in s.seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + extra_blocks
    num_reqs_padded = len(s.seq_lens) + s.pad_reqs
    num_tokens = sum(s.query_lens)
    num_tokens_padded = num_tokens + s.pad_tokens

    def randn(*size):
        return torch.randn(*size, generator=g).to(dtype)

    expected = randn(2, num_blocks, hkv, bs, d)   # context, plus stale bytes past each sequence's end
    expected[:, 0] = float("nan")
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    width = max(blocks_per_req, default=1) + 1
    block_table = torch.zeros(num_reqs_padded, width, dtype=torch.int32)
    qsl = torch.zeros(num_reqs_padded + 1, dtype=torch.int32)
    lens = torch.zeros(num_reqs_padded, dtype=torch.int32)
    slots = torch.full((num_tokens_padded,), -1, dtype=torch.int64)
    key, value = randn(num_tokens_padded, hkv, d), randn(num_tokens_padded, hkv, d)
    kv_cache = expected.clone()
    used, t = 0, 0
    for r, (q_len, seq_len) in enumerate(zip(s.query_lens, s.seq_lens)):
        blocks = order[used:used + blocks_per_req[r]]
        used += blocks_per_req[r]
        block_table[r, :len(blocks)] = blocks.to(torch.int32)
        positions = torch.arange(seq_len - q_len, seq_len)
        token_slots = blocks[positions // bs] * bs + positions % bs
        slots[t:t + q_len] = token_slots
        blk, off = token_slots // bs, token_slots % bs
        expected[0, blk, :, off] = key[t:t + q_len]
        expected[1, blk, :, off] = value[t:t + q_len]
        kv_cache[0, blk, :, off] = randn(q_len, hkv, d)   # the kernel must overwrite these
        kv_cache[1, blk, :, off] = randn(q_len, hkv, d)
        t += q_len
        qsl[r + 1] = t
        lens[r] = seq_len
    qsl[len(s.query_lens) + 1:] = t
    sinks = (torch.randn(s.num_heads, generator=g) * 2.0) if s.sinks else None
    slopes = (torch.rand(s.num_heads, generator=g) * 0.2) if s.alibi else None

    def dev(x):
        return None if x is None else x.to(device)
    return PagedBatch(s, dev(randn(num_tokens_padded, s.num_heads, d)), dev(key), dev(value), dev(kv_cache),
                      dev(expected), dev(block_table), dev(qsl), dev(lens), dev(slots), dev(sinks), dev(slopes))


def reference_output(batch: PagedBatch) -> torch.Tensor:
    """float32 reference [num_tokens, Hq, D] over `expected_cache` (torch_ref's layout is a transposed view of it)."""
    out = torch.zeros(batch.num_tokens_padded, batch.shape.num_heads, batch.shape.head_size,
                      dtype=torch.float32, device=batch.query.device)
    paged_attention_ref(batch.query.float(), batch.expected_cache.transpose(2, 3).float(), batch.block_table,
                        batch.query_start_loc.cpu(), batch.seq_lens.cpu(), batch.num_reqs, batch.shape.options(),
                        out, batch.sinks, batch.alibi_slopes)
    return out[:batch.num_tokens]


def tolerance(dtype: torch.dtype) -> float:
    """Absolute tolerance on outputs (weighted means of unit-normal values, so |out| <= ~3)."""
    return {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}[dtype]


def common_metadata(batch: PagedBatch, uniform_decode: bool | None = None):
    """A `CommonAttentionMetadata` over the batch (one KV-cache group), as the runner would build it."""
    from ember.attention_backends.common import CommonAttentionMetadata
    s = batch.shape
    live = s.num_decodes == len(s.query_lens)
    return CommonAttentionMetadata(
        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
        query_start_loc_cpu=batch.query_start_loc.cpu(), seq_lens_cpu=batch.seq_lens.cpu(),
        block_tables=(batch.block_table,), slot_mappings=(batch.slot_mapping,), num_reqs=batch.num_reqs,
        num_actual_tokens=batch.num_tokens, num_reqs_padded=batch.num_reqs_padded,
        num_tokens_padded=batch.num_tokens_padded, max_query_len=max(s.query_lens), max_seq_len=max(s.seq_lens),
        num_decodes=s.num_decodes, uniform_decode=live if uniform_decode is None else uniform_decode)
