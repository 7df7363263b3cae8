"""Reference attention backend in plain PyTorch over the paged cache: the oracle for every other backend.

Runs on CPU and GPU in float32/float16/bfloat16 and computes in float32. It loops over requests on the host
(reading host copies of the batch layout, so no device sync), hence it is never captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.attention_backends.base import (AttentionBackend, AttentionImpl, AttentionLayerOptions, CudaGraphSupport,
                                           MetadataBuilder)
from ember.attention_backends.common import CommonAttentionMetadata
from ember.kv_spec import KVCacheSpec


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


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows into a [2, num_blocks, block_size, Hkv, D] cache. Slot -1 writes go to the null block 0,
    which no request owns, so padding needs no host-side filtering."""
    num_tokens = key.shape[0]
    slots = slot_mapping[:num_tokens].clamp(min=0)
    kv_cache[0].view(-1, *key.shape[1:]).index_copy_(0, slots, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, *value.shape[1:]).index_copy_(0, slots, value.to(kv_cache.dtype))


def paged_attention_ref(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                        query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, num_reqs: int,
                        options: AttentionLayerOptions, out: torch.Tensor, sinks: torch.Tensor | None = None,
                        alibi_slopes: torch.Tensor | None = None) -> None:
    """Causal attention of each request's queries over its own blocks; float32 math; writes rows of `out`."""
    block_size = kv_cache.shape[2]
    num_heads, num_kv_heads = options.num_heads, options.num_kv_heads
    group = num_heads // num_kv_heads
    qsl = query_start_loc_cpu.tolist()
    lens = seq_lens_cpu.tolist()
    for r in range(num_reqs):
        q_start, q_end, seq_len = qsl[r], qsl[r + 1], lens[r]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        context_len = seq_len - q_len
        num_blocks = -(-seq_len // block_size)
        blocks = block_table[r, :num_blocks].long()
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, options.head_size)[:seq_len].float()  # [S, Hkv, D]
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, options.head_size)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)   # [S, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()        # [L, Hq, D]
        scores = torch.einsum("lhd,shd->hls", q, k) * options.scale   # [Hq, L, S]
        if options.logits_soft_cap:
            cap = options.logits_soft_cap
            scores = cap * torch.tanh(scores / cap)
        q_pos = torch.arange(context_len, seq_len, device=q.device)[:, None]   # [L, 1]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]                # [1, S]
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


class TorchRefImpl(AttentionImpl):
    def forward(self, query, key, value, kv_cache, metadata: TorchRefMetadata, out) -> None:
        common = metadata.common
        if self.options.kv_sharing_target is None:
            write_kv(key, value, kv_cache, metadata.slot_mapping)
        paged_attention_ref(query, kv_cache, metadata.block_table, common.query_start_loc_cpu, common.seq_lens_cpu,
                            common.num_reqs, self.options, out, self.sinks, self.alibi_slopes)


class TorchRefBackend(AttentionBackend):
    """Plain PyTorch, any device, any float dtype, every option. Slow; never captured in a CUDA graph."""
    name = "torch_ref"
    priority = 0
    cudagraph_support = CudaGraphSupport.NEVER
    builder_cls = TorchRefMetadataBuilder
    impl_cls = TorchRefImpl

    @staticmethod
    def kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports(cls, spec: KVCacheSpec, dtype, device, options=None) -> list[str]:
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return [f"dtype {dtype} is not supported (float32, float16, bfloat16)"]
        return []
