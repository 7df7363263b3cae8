"""Reference attention backend in plain PyTorch over the paged cache: the oracle for every other backend.

Runs on CPU and GPU in float32/float16/bfloat16 and computes in float32. It loops over requests on the host
(reading host copies of the batch layout, so no device sync), hence it is never captured in a CUDA graph. A request's
K/V are gathered once; its queries attend a chunk of rows at a time (`SCORE_CHUNK_ELEMENTS`), so that what it
allocates stays within its declared workspace at any context length (docs/memory.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.attention_backends.base import (AttentionBackend, AttentionImpl, AttentionLayerOptions, CudaGraphSupport,
                                           MetadataBuilder, StepBounds)
from ember.attention_backends.common import CommonAttentionMetadata
from ember.kv_spec import KVCacheSpec

# float32 scores one chunk of a request's queries may hold (64 MiB): torch_ref's workspace stays bounded whatever
# the step (the whole 8,192 x 8,192 matrix of 16 heads took 4 GiB)
SCORE_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class TorchRefMetadata:
    """The common metadata plus this group's block table and slot mapping."""
    common: CommonAttentionMetadata
    block_table: torch.Tensor   # [num_reqs_padded, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_tokens_padded] int64


class TorchRefMetadataBuilder(MetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> TorchRefMetadata:
        i = self.ctx.group_index
        return TorchRefMetadata(common, common.block_tables[i], common.slot_mappings[i])


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """K or V rows [T, Hkv, D] as an e4m3 cache holds them: divided by their head's scale [Hkv], rounded to
    nearest, saturated at +-448."""
    return (x.float() / scale[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Scatter new K/V rows into a [2, num_blocks, block_size, Hkv, D] cache. Slot -1 writes go to the null block 0,
    which no request owns, so padding needs no host-side filtering. An e4m3 cache stores them over `kv_scales`."""
    num_tokens = key.shape[0]
    slots = slot_mapping[:num_tokens].clamp(min=0)
    copy_rows(kv_cache, slots, key, value, kv_scales)


def copy_rows(kv_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              kv_scales: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """key/value [T, Hkv, D] into token-major pages (a [2, blocks, block_size, Hkv, D] cache) at `slots`; an e4m3
    cache takes them quantized, copied as bytes (index_copy_ has no float8 kernel on the CPU)."""
    if kv_cache.dtype == torch.float8_e4m3fn:
        key = quantize_kv(key, kv_scales[0]).view(torch.uint8)
        value = quantize_kv(value, kv_scales[1]).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    kv_cache[0].view(-1, *key.shape[1:]).index_copy_(0, slots, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, *value.shape[1:]).index_copy_(0, slots, value.to(kv_cache.dtype))


def paged_attention_ref(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                        query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, num_reqs: int,
                        options: AttentionLayerOptions, out: torch.Tensor, sinks: torch.Tensor | None = None,
                        alibi_slopes: torch.Tensor | None = None, chunk_elements: int | None = None,
                        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Causal attention of each request's queries over its own blocks; float32 math; writes rows of `out`. A
    request's queries go in chunks of at most `chunk_elements` scores (None: `SCORE_CHUNK_ELEMENTS`; one row at
    least), so that the workspace stays within `workspace_bytes` whatever the step. An e4m3 cache is dequantized
    with `kv_scales` as it is gathered."""
    chunk_elements = chunk_elements or SCORE_CHUNK_ELEMENTS
    block_size = kv_cache.shape[2]
    qsl = query_start_loc_cpu.tolist()
    lens = seq_lens_cpu.tolist()
    for r in range(num_reqs):
        q_start, q_end, seq_len = qsl[r], qsl[r + 1], lens[r]
        if q_end > q_start:
            blocks = block_table[r, :-(-seq_len // block_size)].long()
            _attend_request(query[q_start:q_end], kv_cache, blocks, seq_len, options, out[q_start:q_end], sinks,
                            alibi_slopes, chunk_elements, kv_scales)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int, scale: torch.Tensor | None) -> torch.Tensor:
    """A request's keys or values from one half of the cache: [Hkv, S, D] float32, laid out as [S, Hkv, D]; times
    the heads' scales [Hkv] for an e4m3 cache."""
    pages = cache[blocks]                                  # [num_blocks, block_size, Hkv, D], the cache's dtype
    # reshape, not view: a caller may pass a cache whose last two dimensions are transposed
    rows = pages.reshape(-1, *pages.shape[2:])[:seq_len].transpose(0, 1).float()
    return rows if scale is None else rows * scale[:, None, None]


def _attend_request(query: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int,
                    options: AttentionLayerOptions, out: torch.Tensor, sinks: torch.Tensor | None,
                    alibi_slopes: torch.Tensor | None, chunk_elements: int,
                    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """One request: its K/V gathered once, its queries [L, Hq, D] a chunk of rows at a time."""
    k_scale, v_scale = kv_scales if kv_cache.dtype == torch.float8_e4m3fn else (None, None)
    k = _gather(kv_cache[0], blocks, seq_len, k_scale)   # [Hkv, S, D]
    v = _gather(kv_cache[1], blocks, seq_len, v_scale)
    q_len = query.shape[0]
    rows = chunk_rows(q_len, seq_len, options.num_heads, chunk_elements)
    for start in range(0, q_len, rows):
        end = min(start + rows, q_len)
        _attend_rows(query[start:end], k, v, seq_len - q_len + start, options, out[start:end], sinks, alibi_slopes)


def chunk_rows(q_len: int, seq_len: int, num_heads: int, chunk_elements: int) -> int:
    """Query rows per chunk: as many as keep a chunk's scores [Hq, rows, S] within `chunk_elements`, one at least."""
    return max(1, min(q_len, chunk_elements // (num_heads * seq_len)))


def _attend_rows(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int,
                 options: AttentionLayerOptions, out: torch.Tensor, sinks: torch.Tensor | None,
                 alibi_slopes: torch.Tensor | None) -> None:
    """Queries [n, Hq, D] at positions first_pos.. against k/v [Hkv, S, D]; writes out [n, Hq, D]. The query
    heads of one KV head attend together, so K/V are never repeated per query head."""
    n, num_heads, head_size = query.shape
    num_kv_heads, seq_len = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    # [n, Hkv, G, D] -> [Hkv, G * n, D]
    q = query.float().view(n, num_kv_heads, group, head_size).permute(1, 2, 0, 3).reshape(num_kv_heads, -1, head_size)
    scores = torch.matmul(q, k.transpose(1, 2)).view(num_heads, n, seq_len)   # [Hq, n, S]
    scores.mul_(options.scale)
    if options.logits_soft_cap:
        cap = options.logits_soft_cap
        scores.div_(cap).tanh_().mul_(cap)
    q_pos = torch.arange(first_pos, first_pos + n, device=q.device)[:, None]   # [n, 1]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]                     # [1, S]
    if alibi_slopes is not None:
        scores.add_(alibi_slopes.float()[:, None, None] * (k_pos - q_pos)[None].float())
    allowed = k_pos <= q_pos
    if options.sliding_window is not None:
        allowed &= q_pos - k_pos < options.sliding_window
    scores.masked_fill_(~allowed[None], float("-inf"))
    del allowed
    if sinks is not None:
        sink_col = sinks.float()[:, None, None].expand(num_heads, n, 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    del scores
    o = torch.matmul(probs.reshape(num_kv_heads, group * n, seq_len), v)    # [Hkv, G * n, D]
    out.copy_(o.view(num_kv_heads, group, n, head_size).permute(2, 0, 1, 3).reshape(n, num_heads, head_size))


class TorchRefImpl(AttentionImpl):
    def forward(self, query, key, value, kv_cache, metadata: TorchRefMetadata, out) -> None:
        common = metadata.common
        if self.options.kv_sharing_target is None:
            write_kv(key, value, kv_cache, metadata.slot_mapping, self.kv_scales)
        paged_attention_ref(query, kv_cache, metadata.block_table, common.query_start_loc_cpu, common.seq_lens_cpu,
                            common.num_reqs, self.options, out, self.sinks, self.alibi_slopes,
                            kv_scales=self.kv_scales)
        # padding tokens' rows: zero, not whatever `out` held, or the next layer writes their NaN K/V into the
        # null block, which requests read (masked: a NaN times a zero weight is NaN)
        out[common.num_actual_tokens:].zero_()


class TorchRefBackend(AttentionBackend):
    """Plain PyTorch, any device, any float dtype, every option. Slow; never captured in a CUDA graph."""
    name = "torch_ref"
    priority = 0
    cudagraph_support = CudaGraphSupport.NEVER
    builder_cls = TorchRefMetadataBuilder
    impl_cls = TorchRefImpl

    @classmethod
    def workspace_bytes(cls, bounds: StepBounds, spec: KVCacheSpec, options: AttentionLayerOptions,
                        dtype: torch.dtype) -> int:
        """The longest request's K and V in float32 (with one half in the cache's dtype while it converts, and for an
        e4m3 cache its unscaled float32 copy too), and one chunk of its queries: its scores twice (and their
        softmax), three times with sinks (the scores, their concatenation with the sink column, its softmax), the
        chunk's masks and position offsets (24 bytes a score of one head at most) and five float32 copies of its
        rows."""
        seq_len = bounds.context_len
        padded = -(-seq_len // spec.block_size) * spec.block_size
        kv_row = spec.num_kv_heads * spec.head_size
        converting = spec.dtype.itemsize + (4 if spec.dtype == torch.float8_e4m3fn else 0)
        kv = padded * kv_row * (2 * 4 + converting)
        rows = chunk_rows(bounds.longest_query, seq_len, options.num_heads, SCORE_CHUNK_ELEMENTS)
        scores = options.num_heads * rows * (seq_len + 1) * 4
        row_copies = 5 * rows * options.num_heads * options.head_size * 4
        return kv + (3 if options.use_sinks else 2) * scores + 24 * rows * seq_len + row_copies

    @classmethod
    def supports(cls, spec: KVCacheSpec, dtype, device, options=None) -> list[str]:
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return [f"dtype {dtype} is not supported (float32, float16, bfloat16)"]
        if spec.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn):
            return [f"KV-cache dtype {spec.dtype} is not supported (float32, float16, bfloat16, float8_e4m3fn)"]
        return []
