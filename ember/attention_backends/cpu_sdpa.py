"""CPU attention backend: batched `scaled_dot_product_attention` calls over K/V gathered block by block.

The metadata builder runs once per step (for all layers of a KV-cache group) and cuts the step into pieces: runs of
consecutive decodes, runs of consecutive prefills, and a prefill too large for one call split into chunks of its
query rows. Each piece has one flat list of block ids to gather and a mask; each layer gathers a piece's K/V with
one `index_select` and attends it with one SDPA call. There is no loop over requests. A piece is as large as
`PIECE_BYTES` allows (what one call allocates: gathered K/V, mask, queries, output; `PieceCost`), and its queries
are not padded to more than twice its tokens, so the step's workspace is bounded whatever the batch
(`CpuSdpaBackend.workspace_bytes`, docs/memory.md); an ordinary step is one piece of decodes and one of prefills.

Grouped-query attention needs no repeat of K/V: the `group` query heads that share a KV head are folded into
the query-length dimension, so the batched call is [reqs, kv_heads, group * query_len, head_size] against
[reqs, kv_heads, seq_len, head_size].

Masked positions (past a request's length, or table entries past its last block, which point at the null
block 0) are read but never weighted. They must hold finite values (a NaN key or value times a zero weight is NaN):
the cache is zero-initialised and receives only K/V rows, padding tokens' included (they go to the null block).
Padding tokens' output rows are zeroed, so that the next layer's padding K/V computed from them are finite too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ember.attention_backends.base import (AttentionBackend, AttentionImpl, AttentionLayerOptions, CudaGraphSupport,
                                           MetadataBuilder, StepBounds)
from ember.attention_backends.common import CommonAttentionMetadata
from ember.attention_backends.torch_ref import copy_rows
from ember.kv_spec import KVCacheSpec

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn      # a KV-cache dtype: pages of K / k_scale and V / v_scale, per KV head
PIECE_BYTES = 128 << 20       # the most one SDPA call of a step may allocate, unless one query row needs more
STEP_MASK_BYTES = 16 << 20    # masks the builder makes once per step for every layer; larger ones each call makes
SDPA_THREAD_BYTES = 1 << 20   # SDPA's own scratch a thread (its CPU flash kernel: 256 x 512 scores, float32 and
                              # reduced, and 256 output rows)


def sdpa_dtype(kv_dtype: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype SDPA computes in: the cache's, or the activations' `dtype` for an e4m3 cache (dequantized first)."""
    return dtype if kv_dtype == FP8 else kv_dtype


@dataclass(frozen=True)
class PieceCost:
    """Bytes one call allocates for a piece of R requests padded to L query rows and S keys, for one group's heads
    and dtypes: the gathered K and V (an e4m3 cache's pages dequantized through float32), the mask (built, its
    folded copy and SDPA's float copy of it), the queries (densely padded, folded, cast), the output (with SDPA's
    log-sum-exp and two copies on the way out) and SDPA's scratch."""
    num_kv_heads: int
    head_size: int
    group: int                 # query heads per KV head
    kv_itemsize: int           # the cache's dtype
    q_itemsize: int            # the activations'
    sdpa_itemsize: int         # what SDPA computes in (`sdpa_dtype`)

    @classmethod
    def of(cls, spec: KVCacheSpec, group: int, dtype: torch.dtype) -> "PieceCost":
        return cls(spec.num_kv_heads, spec.head_size, group, spec.dtype.itemsize, dtype.itemsize,
                   sdpa_dtype(spec.dtype, dtype).itemsize)

    def __call__(self, num_reqs: int, query_len: int, span: int) -> int:
        rows = num_reqs * query_len * self.num_kv_heads * self.group * self.head_size
        kv_numel = num_reqs * span * self.num_kv_heads * self.head_size
        kv = 2 * kv_numel * self.sdpa_itemsize
        if self.kv_itemsize != self.sdpa_itemsize:      # one half's pages, in float32 and scaled, as it converts
            kv += kv_numel * (self.kv_itemsize + 8)
        mask = num_reqs * query_len * span * (3 + self.group * (1 + self.sdpa_itemsize))
        queries = rows * (2 * self.q_itemsize + self.sdpa_itemsize)
        output = rows * 3 * self.sdpa_itemsize + num_reqs * query_len * self.num_kv_heads * self.group * 4
        return kv + mask + queries + output + torch.get_num_threads() * SDPA_THREAD_BYTES


def chunk_rows(cost: PieceCost, query_len: int, span: int, budget: int) -> int:
    """Query rows of one request per piece: the most whose piece costs at most `budget`, one at least."""
    lo, hi = 1, query_len      # the cost grows with the rows: the largest that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(1, mid, span) <= budget else (lo, mid - 1)
    return lo


@dataclass(frozen=True)
class PartMetadata:
    """One piece of the step (decodes, or prefills, or a chunk of one prefill's rows) laid out as a padded batch."""
    token_start: int             # first token of the piece in the step's token order
    num_tokens: int
    num_reqs: int
    max_query_len: int           # padded query length (1 for decodes)
    span: int                    # keys gathered per request: blocks_per_req * block_size
    block_ids: torch.Tensor      # [num_reqs * blocks_per_req] int64: the blocks to gather, request by request
    query_lens: torch.Tensor     # [num_reqs] int64 (host)
    seq_lens: torch.Tensor       # [num_reqs] int64 (host): context + the piece's queries
    sliding_window: int | None
    padded_rows: torch.Tensor | None   # [num_tokens] int64: each token's row in [num_reqs * max_query_len]; None
                                       # when the piece is already dense (decodes, or one unpadded prefill)
    single_len: int = 0          # a single decode without a window: it attends its first single_len keys, no mask
    mask: torch.Tensor | None = None   # built once per step for every layer, where it fits STEP_MASK_BYTES
    mask_group: int = 0          # the query heads per KV head `mask` is folded for

    def mask_for(self, group: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The piece's mask for `group` query heads folded into the query dimension: the step's (built once), or
        one built for this call. None for a single decode, which needs none."""
        if self.single_len:
            return None
        if self.mask is not None and self.mask_group == group and self.mask.dtype in (torch.bool, dtype):
            return self.mask
        return build_mask(self.query_lens, self.seq_lens, self.max_query_len, self.span, self.sliding_window,
                          self.padded_rows is not None, group, dtype)


def build_mask(query_lens: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, span: int,
               sliding_window: int | None, padded: bool, group: int, dtype: torch.dtype) -> torch.Tensor:
    """[R, 1, group * L, S]: True where a query row sees a key (causal, within the window; a padding row sees key 0
    alone, so no row is empty). Decodes get an additive `dtype` mask [R, 1, 1, S] that broadcasts over the folded
    heads: from a boolean mask SDPA would build that in every call."""
    offsets = torch.arange(max_query_len)[None, :]                           # [1, L]
    q_pos = (seq_lens - query_lens)[:, None] + offsets                       # [R, L] absolute position of each query
    k_pos = torch.arange(span)                                               # [S]
    allowed = k_pos <= q_pos[:, :, None]                                     # [R, L, S] causal; hides k >= seq_len
    if sliding_window is not None:
        allowed &= k_pos > (q_pos - sliding_window)[:, :, None]
    if padded:
        allowed[offsets.expand_as(q_pos) >= query_lens[:, None]] = k_pos == 0
    if max_query_len == 1:
        return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))[:, None]
    allowed = allowed[:, None]                                               # [R, 1, L, S]
    return allowed if group == 1 else allowed.repeat(1, 1, group, 1)


@dataclass(frozen=True)
class CpuSdpaMetadata:
    """The slots of the K/V write, and the step's pieces: decodes first, then prefills."""
    write_slots: torch.Tensor    # [num_tokens_padded] int64, padding's -1 sent to the null block 0
    parts: tuple[PartMetadata, ...]
    num_actual_tokens: int       # the live tokens; the output rows after them (padding) are zeroed


def _part(block_table: torch.Tensor, query_lens: torch.Tensor, seq_lens: torch.Tensor, max_q: int, max_seq: int,
          num_tokens: int, token_start: int, block_size: int, sliding_window: int | None,
          mask_of: tuple[int, torch.dtype] | None) -> PartMetadata:
    """Gather list and layout of a run of requests (host tensors on the CPU), and its mask for (group, dtype) when
    `mask_of` is given."""
    num_reqs = query_lens.shape[0]
    blocks_per_req = -(-max_seq // block_size)
    span = blocks_per_req * block_size
    block_ids = block_table[:num_reqs, :blocks_per_req].reshape(-1).long()
    single = max_seq if num_reqs == 1 and max_q == 1 and sliding_window is None else 0
    padded_rows = None
    if num_tokens != num_reqs * max_q:
        valid = torch.arange(max_q)[None, :] < query_lens[:, None]            # [R, L]
        padded_rows = torch.nonzero(valid.reshape(-1)).reshape(-1)           # each token's row in the [R * L] layout
    mask = None
    if mask_of is not None and not single:
        mask = build_mask(query_lens, seq_lens, max_q, span, sliding_window, padded_rows is not None, *mask_of)
    return PartMetadata(token_start, num_tokens, num_reqs, max_q, span, block_ids, query_lens, seq_lens,
                        sliding_window, padded_rows, single, mask, mask_of[0] if mask is not None else 0)


def split_into_pieces(query_lens: list[int], seq_lens: list[int], block_size: int, cost: PieceCost,
                      budget: int) -> list[tuple[int, int, int, int]]:
    """The step's requests as pieces (first request, end request, first query row, end query row): runs of
    consecutive requests that each cost at most `budget` and pad their queries to at most twice their tokens, and
    a request too large alone as chunks of its rows. A decode too large alone stays one piece."""
    count, length, tokens = len(query_lens), max(query_lens), sum(query_lens)
    if cost(count, length, -(-max(seq_lens) // block_size) * block_size) <= budget and \
            (count == 1 or count * length <= 2 * tokens):
        return [(0, count, 0, 0)]          # the common case: the whole run is one piece
    pieces: list[tuple[int, int, int, int]] = []
    first, run_len, run_span, run_tokens = 0, 0, 0, 0
    for r, (q, n) in enumerate(zip(query_lens, seq_lens)):
        span = -(-n // block_size) * block_size
        if q > 1 and cost(1, q, span) > budget:         # alone over the budget: its rows in chunks
            if r > first:
                pieces.append((first, r, 0, 0))
            rows = chunk_rows(cost, q, span, budget)
            pieces += [(r, r + 1, start, min(start + rows, q)) for start in range(0, q, rows)]
            first, run_len, run_span, run_tokens = r + 1, 0, 0, 0
            continue
        length, widest, tokens = max(run_len, q), max(run_span, span), run_tokens + q
        count = r - first + 1
        if count > 1 and (cost(count, length, widest) > budget or count * length > 2 * tokens):
            pieces.append((first, r, 0, 0))
            first, length, widest, tokens = r, q, span, q
        run_len, run_span, run_tokens = length, widest, tokens
    if len(query_lens) > first:
        pieces.append((first, len(query_lens), 0, 0))
    return pieces


class CpuSdpaMetadataBuilder(MetadataBuilder):
    """Cuts the step into its pieces (`split_into_pieces`) and builds each one's gather list, and its mask where
    the step's masks fit STEP_MASK_BYTES."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.cost = PieceCost.of(ctx.group.spec, ctx.num_queries_per_kv, ctx.dtype)

    def build(self, common: CommonAttentionMetadata) -> CpuSdpaMetadata:
        i, spec = self.ctx.group_index, self.ctx.group.spec
        table = common.block_tables[i]
        num_reqs = common.num_reqs
        qsl = common.query_start_loc_cpu[:num_reqs + 1].long()
        seq_lens = common.seq_lens_cpu[:num_reqs].long()
        query_lens = qsl[1:] - qsl[:-1]
        parts = []
        mask_bytes, group, dtype = 0, self.ctx.num_queries_per_kv, sdpa_dtype(spec.dtype, self.ctx.dtype)
        starts = qsl.tolist()
        for lo, hi in ((0, common.num_decodes), (common.num_decodes, num_reqs)):
            if hi == lo:
                continue
            q_all, n_all = query_lens[lo:hi], seq_lens[lo:hi]
            q_list, n_list = q_all.tolist(), n_all.tolist()
            for a, b, row_start, row_end in split_into_pieces(q_list, n_list, spec.block_size, self.cost,
                                                              PIECE_BYTES):
                if row_end:     # a chunk of one request's rows: a request that ends at its last row
                    rows, seq_len = row_end - row_start, n_list[a] - q_list[a] + row_end
                    q, n = torch.tensor([rows]), torch.tensor([seq_len])
                    max_q, max_seq, tokens, start = rows, seq_len, rows, starts[lo + a] + row_start
                else:
                    whole = b - a == hi - lo
                    q, n = (q_all, n_all) if whole else (q_all[a:b], n_all[a:b])
                    max_q, max_seq, tokens = max(q_list[a:b]), max(n_list[a:b]), starts[lo + b] - starts[lo + a]
                    start = starts[lo + a]
                span = -(-max_seq // spec.block_size) * spec.block_size
                size = (b - a) * span * (max_q * group if max_q > 1 else dtype.itemsize)
                cached = mask_bytes + size <= STEP_MASK_BYTES
                mask_bytes += size if cached else 0
                parts.append(_part(table[lo + a:lo + b], q, n, max_q, max_seq, tokens, start, spec.block_size,
                                   spec.sliding_window, (group, dtype) if cached else None))
        # clamped once here rather than in each layer's write
        return CpuSdpaMetadata(common.slot_mappings[i].clamp(min=0), tuple(parts), common.num_actual_tokens)


def attend_part(query: torch.Tensor, kv_cache: torch.Tensor, part: PartMetadata, options: AttentionLayerOptions,
                out: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """One SDPA call for every request of the piece; writes the piece's rows of `out` [T, Hq, D]. An e4m3 cache's
    gathered pages are dequantized with `kv_scales` to the query's dtype first."""
    hkv, d = options.num_kv_heads, options.head_size
    group = options.num_heads // hkv
    r, length, span = part.num_reqs, part.max_query_len, part.span
    q = query[part.token_start:part.token_start + part.num_tokens]              # [T, Hq, D]
    if part.padded_rows is not None:
        dense = q.new_zeros(r * length, hkv * group, d)
        dense.index_copy_(0, part.padded_rows, q)
        q = dense
    # [R, L, Hkv, G, D] -> [R, Hkv, G * L, D]: the query heads of one KV head share its K/V (a view for decodes,
    # whose L is 1: a decode step runs this for every layer, so it keeps to as few ops as it can)
    q = (q.reshape(r, hkv, group, d) if length == 1 else
         q.reshape(r, length, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(r, hkv, group * length, d))
    k = kv_cache[0].index_select(0, part.block_ids).view(r, span, hkv, d).transpose(1, 2)   # [R, Hkv, S, D]
    v = kv_cache[1].index_select(0, part.block_ids).view(r, span, hkv, d).transpose(1, 2)
    if part.single_len:            # one decode: its keys are exactly the first single_len, no mask needed
        k, v = k[:, :, :part.single_len], v[:, :, :part.single_len]
    if k.dtype == FP8:
        k = (k.float() * kv_scales[0][:, None, None]).to(q.dtype)
        v = (v.float() * kv_scales[1][:, None, None]).to(q.dtype)
    if q.dtype != k.dtype:
        q = q.to(k.dtype)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=part.mask_for(group, q.dtype), scale=options.scale)
    rows = out[part.token_start:part.token_start + part.num_tokens]            # [T, Hq, D]
    if length == 1:                # decodes: the rows are [R, Hkv, G, D] as they stand; one copy, which casts
        rows.view(r, hkv, group, d).copy_(o)
        return
    # [R, Hkv, G * L, D] -> [R * L, Hq, D]
    o = o.reshape(r, hkv, group, length, d).permute(0, 3, 1, 2, 4).reshape(r * length, hkv * group, d)
    if part.padded_rows is not None:
        o = o.index_select(0, part.padded_rows)
    rows.copy_(o)


class CpuSdpaImpl(AttentionImpl):
    """Writes K/V by slot, then attends each piece of the step with one SDPA call; padding tokens' rows of `out`
    (no piece covers them) are zeroed."""

    def forward(self, query, key, value, kv_cache, metadata: CpuSdpaMetadata, out) -> None:
        if self.options.kv_sharing_target is None:
            copy_rows(kv_cache, metadata.write_slots[:key.shape[0]], key, value, self.kv_scales)
        for part in metadata.parts:
            attend_part(query, kv_cache, part, self.options, out, self.kv_scales)
        out[metadata.num_actual_tokens:].zero_()


class CpuSdpaBackend(AttentionBackend):
    """Batched SDPA over gathered paged K/V on the CPU; no soft cap, sinks or ALiBi (torch_ref has them)."""
    name = "cpu_sdpa"
    priority = 5          # above torch_ref; below triton_unified, which runs on a CPU only under TRITON_INTERPRET
    cudagraph_support = CudaGraphSupport.NEVER
    builder_cls = CpuSdpaMetadataBuilder
    impl_cls = CpuSdpaImpl

    @classmethod
    def workspace_bytes(cls, bounds: StepBounds, spec: KVCacheSpec, options: AttentionLayerOptions,
                        dtype: torch.dtype) -> int:
        """One call over a piece: `PIECE_BYTES`, or a single query row against the longest context where that is
        more."""
        cost = PieceCost.of(spec, options.num_heads // options.num_kv_heads, dtype)
        return max(PIECE_BYTES, cost(1, 1, -(-bounds.context_len // spec.block_size) * spec.block_size))

    @classmethod
    def metadata_bytes(cls, bounds: StepBounds, spec: KVCacheSpec, num_queries_per_kv: int,
                       dtype: torch.dtype) -> int:
        """The masks built once per step (`STEP_MASK_BYTES`), every piece's block ids (a request's in one piece,
        or in each chunk of its rows) and padded rows (at most twice the step's tokens)."""
        span = -(-bounds.context_len // spec.block_size) * spec.block_size
        cost = PieceCost.of(spec, num_queries_per_kv, dtype)
        longest = bounds.longest_query
        chunks = -(-longest // chunk_rows(cost, longest, span, PIECE_BYTES))
        return STEP_MASK_BYTES + (bounds.num_reqs + chunks) * (span // spec.block_size) * 8 + 2 * bounds.num_tokens * 8

    @classmethod
    def supports(cls, spec: KVCacheSpec, dtype, device, options: AttentionLayerOptions | None = None) -> list[str]:
        reasons = []
        if torch.device(device).type != "cpu":
            reasons.append(f"runs on the CPU only, not on {torch.device(device).type}")
        for what, dt in (("dtype", dtype), ("KV-cache dtype", dtype if spec.dtype == FP8 else spec.dtype)):
            if dt not in SUPPORTED_DTYPES:
                reasons.append(f"{what} {dt} is not supported (float32, bfloat16, float16, or an fp8 cache)")
        if options is not None:
            if options.logits_soft_cap:
                reasons.append(f"logit soft-capping ({options.logits_soft_cap}) is not supported")
            if options.use_sinks:
                reasons.append("attention sinks are not supported")
            if options.use_alibi:
                reasons.append("ALiBi is not supported")
            if options.num_heads % options.num_kv_heads:
                reasons.append(f"{options.num_heads} query heads are not a multiple of "
                               f"{options.num_kv_heads} KV heads")
        return reasons
