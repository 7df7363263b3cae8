"""Frozen descriptions of the KV cache: what one layer stores (`KVCacheSpec`) and which layers share a layout (`KVCacheGroup`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer keeps per token, and how the tokens are paged."""
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window: int | None = None      # None: full attention

    @property
    def kind(self) -> str:
        return "full" if self.sliding_window is None else "sliding_window"

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer, K and V together."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * torch.empty((), dtype=self.dtype).element_size()

    def first_needed_block(self, first_query_pos: int) -> int:
        """The lowest block index a query at `first_query_pos` or later can read: 0 for full attention; for a
        sliding window the block of key first_query_pos - window + 1 (a key j is visible to query i iff
        i - window < j <= i). Blocks before it can be freed."""
        if self.sliding_window is None:
            return 0
        return max(0, first_query_pos - self.sliding_window + 1) // self.block_size

    def max_blocks_held(self, num_tokens: int, chunk: int = 1) -> int:
        """The most blocks one request of `num_tokens` tokens holds at once when it is computed `chunk` tokens
        per step: every block for full attention; for a sliding window, the blocks its window and one chunk of
        queries span."""
        bs = self.block_size
        total = -(-num_tokens // bs)
        if self.sliding_window is None:
            return total
        return min(total, -(-(self.sliding_window - 1 + chunk) // bs) + 1)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one spec, hence one block table and one metadata builder per step.

    All groups draw from one pool of blocks: a block id stands for one page in each of a fixed number of slot
    tensors, and the i-th cache-owning layer of any group keeps its page in slot i. Groups therefore own equally
    many layers (a spec with more layers is split into several groups), and memory moves between full-attention
    and sliding-window groups as requests need it."""
    layer_names: tuple[str, ...]
    spec: KVCacheSpec
    # layer name -> name of the layer whose cache it reads (it writes nothing itself)
    kv_sharing: tuple[tuple[str, str], ...] = ()


def blocks_per_request(groups, num_tokens: int, chunk: int = 1) -> int:
    """Blocks of the shared pool one request of `num_tokens` tokens holds at most, over every group."""
    return sum(g.spec.max_blocks_held(num_tokens, chunk) for g in groups)
