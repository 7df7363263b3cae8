"""CPU attention backend: one batched `scaled_dot_product_attention` per step part over K/V gathered block by block.

The metadata builder runs once per step (for all layers of a KV-cache group) and turns the block tables into a
flat list of block ids and a boolean mask; each layer then gathers its K/V blocks with one `index_select` and
attends with one SDPA call for the decodes and one for the prefills. There is no loop over requests.

Grouped-query attention needs no repeat of K/V: the `group` query heads that share a KV head are folded into
the query-length dimension, so the batched call is [reqs, kv_heads, group * query_len, head_size] against
[reqs, kv_heads, seq_len, head_size].

Masked positions (past a request's length, or table entries past its last block, which point at the null
block 0) are read but never weighted. They hold finite values: the cache is zero-initialised and receives
only K/V rows, padding rows included (they go to the null block).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ember.attention_backends.base import (AttentionBackend, AttentionImpl, AttentionLayerOptions, CudaGraphSupport,
                                           MetadataBuilder)
from ember.attention_backends.common import CommonAttentionMetadata
from ember.attention_backends.torch_ref import copy_rows
from ember.kv_spec import KVCacheSpec

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn      # a KV-cache dtype: pages of K / k_scale and V / v_scale, per KV head


@dataclass(frozen=True)
class PartMetadata:
    """One part of the step (the decodes, or the prefills) laid out as a padded batch."""
    token_start: int             # first token of the part in the step's token order
    num_tokens: int
    num_reqs: int
    max_query_len: int           # padded query length (1 for decodes)
    span: int                    # keys gathered per request: blocks_per_req * block_size
    block_ids: torch.Tensor      # [num_reqs * blocks_per_req] int64: the blocks to gather, request by request
    mask: torch.Tensor | None    # [num_reqs, 1, max_query_len, span] bool, True = attend; None: a single decode,
                                 # which attends to its first `single_len` keys
    padded_rows: torch.Tensor | None   # [num_tokens] int64: each token's row in [num_reqs * max_query_len]; None
                                       # when the part is already dense (decodes, or one unpadded prefill)
    single_len: int = 0
    _group_masks: dict = field(default_factory=dict, compare=False)

    def mask_for(self, group: int, dtype: torch.dtype) -> torch.Tensor | None:
        """[R, 1, group * L, S]: the mask repeated for the query heads folded into the query dimension; built
        once per step and shared by every layer. Decodes get an additive `dtype` mask [R, 1, 1, S] that broadcasts
        over the folded heads: from a boolean mask SDPA would build that in every layer."""
        if self.mask is None:
            return None
        key = (group, dtype)
        if key not in self._group_masks:
            if self.max_query_len == 1:
                mask = torch.zeros(self.mask.shape, dtype=dtype).masked_fill_(~self.mask, float("-inf"))
            else:
                mask = self.mask if group == 1 else self.mask.repeat(1, 1, group, 1)
            self._group_masks[key] = mask
        return self._group_masks[key]


@dataclass(frozen=True)
class CpuSdpaMetadata:
    """The slots of the K/V write, and the decode and prefill parts (either may be None)."""
    write_slots: torch.Tensor    # [num_tokens_padded] int64, padding's -1 sent to the null block 0
    decodes: PartMetadata | None
    prefills: PartMetadata | None


def _part(block_table: torch.Tensor, query_lens: torch.Tensor, seq_lens: torch.Tensor, token_start: int,
          block_size: int, sliding_window: int | None) -> PartMetadata:
    """Gather list and mask of a run of requests; all tensors are host tensors on the CPU."""
    num_reqs = query_lens.shape[0]
    max_q = int(query_lens.max())
    max_seq = int(seq_lens.max())
    blocks_per_req = -(-max_seq // block_size)
    span = blocks_per_req * block_size
    block_ids = block_table[:num_reqs, :blocks_per_req].reshape(-1).long()
    num_tokens = int(query_lens.sum())
    if num_reqs == 1 and max_q == 1 and sliding_window is None:
        return PartMetadata(token_start, 1, 1, 1, span, block_ids, None, None, max_seq)
    offsets = torch.arange(max_q)[None, :]                            # [1, L]
    q_pos = (seq_lens - query_lens)[:, None] + offsets                # [R, L] absolute position of each query
    k_pos = torch.arange(span)[None, None, :]                         # [1, 1, S]
    mask = k_pos <= q_pos[:, :, None]                                 # [R, L, S] causal; also hides k >= seq_len
    if sliding_window is not None:
        mask &= (q_pos[:, :, None] - k_pos) < sliding_window
    padded_rows = None
    if num_tokens != num_reqs * max_q:
        valid = offsets < query_lens[:, None]                         # [R, L]
        mask[~valid] = k_pos[0] == 0                                  # padding rows attend to one key: no NaN
        padded_rows = torch.nonzero(valid.reshape(-1)).reshape(-1)    # each token's row in the [R * L] layout
    return PartMetadata(token_start, num_tokens, num_reqs, max_q, span, block_ids, mask[:, None], padded_rows)


class CpuSdpaMetadataBuilder(MetadataBuilder):
    """Splits the step into its decode and prefill parts and builds each part's gather list and mask."""

    def build(self, common: CommonAttentionMetadata) -> CpuSdpaMetadata:
        i, spec = self.ctx.group_index, self.ctx.group.spec
        table = common.block_tables[i]
        num_reqs, num_decodes = common.num_reqs, common.num_decodes
        qsl = common.query_start_loc_cpu[:num_reqs + 1].long()
        seq_lens = common.seq_lens_cpu[:num_reqs].long()
        query_lens = qsl[1:] - qsl[:-1]
        decodes = prefills = None
        if num_decodes:
            decodes = _part(table[:num_decodes], query_lens[:num_decodes], seq_lens[:num_decodes], 0,
                            spec.block_size, spec.sliding_window)
        if num_reqs > num_decodes:
            prefills = _part(table[num_decodes:num_reqs], query_lens[num_decodes:], seq_lens[num_decodes:],
                             num_decodes, spec.block_size, spec.sliding_window)
        # clamped once here rather than in each layer's write
        return CpuSdpaMetadata(common.slot_mappings[i].clamp(min=0), decodes, prefills)


def attend_part(query: torch.Tensor, kv_cache: torch.Tensor, part: PartMetadata, options: AttentionLayerOptions,
                out: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """One SDPA call for every request of the part; writes the part's rows of `out` [T, Hq, D]. An e4m3 cache's
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
    if part.mask is None:          # one decode: its keys are exactly the first single_len, no mask needed
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
    """Writes K/V by slot, then attends the decode part and the prefill part with one SDPA call each."""

    def forward(self, query, key, value, kv_cache, metadata: CpuSdpaMetadata, out) -> None:
        if self.options.kv_sharing_target is None:
            copy_rows(kv_cache, metadata.write_slots[:key.shape[0]], key, value, self.kv_scales)
        for part in (metadata.decodes, metadata.prefills):
            if part is not None:
                attend_part(query, kv_cache, part, self.options, out, self.kv_scales)


class CpuSdpaBackend(AttentionBackend):
    """Batched SDPA over gathered paged K/V on the CPU; no soft cap, sinks or ALiBi (torch_ref has them)."""
    name = "cpu_sdpa"
    priority = 5          # above torch_ref; below triton_unified, which runs on a CPU only under TRITON_INTERPRET
    cudagraph_support = CudaGraphSupport.NEVER
    builder_cls = CpuSdpaMetadataBuilder
    impl_cls = CpuSdpaImpl

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
