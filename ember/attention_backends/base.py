"""The three roles of an attention backend: a class-level description, a metadata builder per KV-cache group,
and an impl per layer."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ember.attention_backends.common import CommonAttentionMetadata
from ember.kv_spec import KVCacheGroup, KVCacheSpec


class CudaGraphSupport(enum.IntEnum):
    """How much of a step a backend's attention may be captured in a CUDA graph."""
    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


@dataclass(frozen=True)
class AttentionLayerOptions:
    """Per-layer attention options a backend may or may not support."""
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    use_sinks: bool = False
    use_alibi: bool = False
    kv_sharing_target: str | None = None   # name of the layer whose cache this layer reads


@dataclass(frozen=True)
class StepBounds:
    """The largest step an engine may run: at most `num_tokens` query tokens over at most `num_reqs` requests, no
    request longer than `context_len` tokens (its new tokens included). Backends declare their workspace for it."""
    num_tokens: int
    num_reqs: int
    context_len: int

    @property
    def longest_query(self) -> int:
        """The most query tokens one request may bring to a step."""
        return min(self.num_tokens, self.context_len)


@dataclass(frozen=True)
class BuilderContext:
    """The frozen pieces a metadata builder needs; it never sees the runner or the engine config."""
    group: KVCacheGroup
    group_index: int
    dtype: torch.dtype
    device: torch.device
    max_num_reqs: int
    max_num_tokens: int
    max_model_len: int
    capture_sizes: tuple[int, ...] = ()
    num_sms: int = 0                        # the device's multiprocessor count (0 on CPU)
    backend_options: tuple[tuple[str, Any], ...] = ()   # backend-specific switches, e.g. ("split_launch", True)
    num_queries_per_kv: int = 1             # query heads per KV head (the widest of the group's layers)

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.backend_options).get(name, default)


class MetadataBuilder:
    """Turns the step's `CommonAttentionMetadata` into this backend's metadata for one KV-cache group.

    It owns whatever persistent buffers the backend needs (allocated in __init__, filled in place in build),
    so that a CUDA graph captured with one step's metadata replays correctly with the next step's.
    """

    def __init__(self, ctx: BuilderContext):
        self.ctx = ctx

    def build(self, common: CommonAttentionMetadata) -> Any:
        raise NotImplementedError

    def build_for_capture(self, common: CommonAttentionMetadata) -> Any:
        """Metadata for a CUDA-graph capture at a bucket; by default the same as `build`."""
        return self.build(common)

    def short_context_len(self, num_reqs_padded: int) -> int | None:
        """For a uniform-decode bucket of this many request rows: the longest request (in tokens) for which this
        builder plans other, faster kernels when told that every request is at most that long
        (`CommonAttentionMetadata.max_seq_len_bound`); the runner then captures such a bucket twice, short and any
        length. None (the default): one plan for every length."""
        return None


@dataclass(frozen=True)
class RopeInputs:
    """The model's rotary, and per-head q/k RMSNorm (weights, or None for rotary alone), that an attention call's
    query and key have not had yet: `AttentionImpl.forward_rope` applies them before attending."""
    cos: torch.Tensor                   # [T, D/2] float32, the rows of the tokens' positions
    sin: torch.Tensor                   # [T, D/2] float32
    q_norm: torch.Tensor | None         # [D]
    k_norm: torch.Tensor | None         # [D]
    eps: float

    def apply(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(query [T, Hq, D], key [T, Hkv, D]) normed and rotated, as the model's ops would (one kernel on CUDA)."""
        from ember.kernels.qk_norm_rope import norm_rope_qk
        return norm_rope_qk(query.flatten(1), key.flatten(1), self.q_norm, self.k_norm, self.cos, self.sin,
                            self.eps, query.shape[-1])

    def as_tuple(self) -> tuple:
        return self.cos, self.sin, self.q_norm, self.k_norm, self.eps


class AttentionImpl:
    """One layer's attention: write the new K/V into the paged cache, then attend."""

    def __init__(self, options: AttentionLayerOptions, sinks: torch.Tensor | None = None,
                 alibi_slopes: torch.Tensor | None = None):
        self.options = options
        self.sinks = sinks                 # [num_heads] float32, or None
        self.alibi_slopes = alibi_slopes   # [num_heads] float32, or None
        # an fp8 (e4m3) cache's (k_scale, v_scale), float32 [num_kv_heads] each: the cache holds K / k_scale and
        # V / v_scale. Set by the runner when it binds the layer to its cache; None for a cache in the model's dtype
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: Any, out: torch.Tensor) -> None:
        """query [T, Hq, D], key/value [T, Hkv, D], out [T, Hq, D]; T may include padding tokens."""
        raise NotImplementedError

    def forward_rope(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                     metadata: Any, out: torch.Tensor, rope: RopeInputs) -> None:
        """`forward` for a query and key still to be normed and rotated (`rope`). Here they are, first, by their own
        kernel; a backend whose `takes_rope` is set may fold that into its attention kernels instead."""
        query, key = rope.apply(query, key)
        self.forward(query, key, value, kv_cache, metadata, out)


class AttentionBackend:
    """Class-level description of a backend. Subclass, set the class variables, register with `register_backend`."""
    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0                          # higher wins in "auto" selection
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER
    builder_cls: ClassVar[type[MetadataBuilder]] = MetadataBuilder
    impl_cls: ClassVar[type[AttentionImpl]] = AttentionImpl
    option_names: ClassVar[tuple[str, ...]] = ()         # the `backend_options` its builder reads
    # the model hands this backend's layers q and k before its rotary and q/k norm (`AttentionImpl.forward_rope`)
    takes_rope: ClassVar[bool] = False

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor; by default [2 (K, V), num_blocks, block_size, num_kv_heads,
        head_size], a token's heads side by side (the Triton backends put the heads outside the token axis)."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports(cls, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device,
                 options: AttentionLayerOptions | None = None) -> list[str]:
        """Reasons this backend cannot serve the given layers; an empty list means it can."""
        return []

    @classmethod
    def workspace_bytes(cls, bounds: StepBounds, spec: KVCacheSpec, options: AttentionLayerOptions,
                        dtype: torch.dtype) -> int:
        """The most memory one layer's attention call may allocate for itself (beyond its arguments, its cache
        and its builder's buffers, which exist before the KV cache is sized) in any step within `bounds`, for
        `options`' heads and activations of `dtype`; an upper bound, which the KV-cache sizing sets aside
        (docs/memory.md). 0, the default: the backend writes only into its arguments and its builder's buffers."""
        return 0

    @classmethod
    def metadata_bytes(cls, bounds: StepBounds, spec: KVCacheSpec, num_queries_per_kv: int,
                       dtype: torch.dtype) -> int:
        """The most memory one group's metadata builder may allocate in `build` for a step within `bounds` and hold
        through it (every group's at once); an upper bound. 0, the default: views and buffers allocated once."""
        return 0

    @classmethod
    def describe(cls) -> str:
        """One line for `ember backends`."""
        return f"{cls.name}: priority {cls.priority}, cudagraph {cls.cudagraph_support.name}"
