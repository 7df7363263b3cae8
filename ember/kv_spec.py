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


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one spec, hence one block table and one metadata builder per step."""
    layer_names: tuple[str, ...]
    spec: KVCacheSpec
    # layer name -> name of the layer whose cache it reads (it writes nothing itself)
    kv_sharing: tuple[tuple[str, str], ...] = ()
