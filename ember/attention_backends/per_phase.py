"""The per-phase backend: each phase through the backend that is fastest at it, over one cache.

Both Triton backends read and write the same [2, num_blocks, num_kv_heads, block_size, head_size] pages, so one
backend can hand a step's phases to both: a uniform-decode bucket is `triton_unified`'s, launch for launch (its
decode graphs, fused K/V write and fused rotary are unchanged); any other bucket writes the new K/V, runs
`triton_unified`'s decode launch over the leading decodes and `flash`'s prefill over the rest, which skips the
decodes by the same on-device count. It serves what both serve: `flash`'s pages of 64 or 128 tokens, no ALiBi.
"""

from __future__ import annotations

import torch

from ember.attention_backends.base import AttentionLayerOptions, BuilderContext, StepBounds
from ember.attention_backends.flash.backend import FlashBackend
from ember.attention_backends.flash.kernels import flash_prefill
from ember.attention_backends.flash.plan import prefill_tiles
from ember.attention_backends.triton_unified.backend import (TritonUnifiedBackend, TritonUnifiedImpl,
                                                             TritonUnifiedMetadata, TritonUnifiedMetadataBuilder)
from ember.kv_spec import KVCacheSpec

if FlashBackend.kv_cache_shape(3, 64, 2, 128) != TritonUnifiedBackend.kv_cache_shape(3, 64, 2, 128):
    raise ImportError("the flash and triton_unified backends no longer share one cache layout")


class PerPhaseMetadataBuilder(TritonUnifiedMetadataBuilder):
    """`triton_unified`'s builder with the mixed step always split into a decode and a prefill launch."""

    def __init__(self, ctx: BuilderContext):
        if "split_launch" in dict(ctx.backend_options):
            raise ValueError("split_launch is not an option of the per_phase backend: it always gives a mixed step "
                             "a decode launch and a prefill launch; drop the option, or choose triton_unified")
        super().__init__(ctx)
        self.split_launch = True


class PerPhaseImpl(TritonUnifiedImpl):
    """`triton_unified`'s launches, with the launch over the prefills replaced by `flash`'s prefill kernel."""

    def _launch_rest(self, layout, metadata: TritonUnifiedMetadata, plan, options) -> None:
        o = self.options
        key_cache = layout[1]
        options = {k: v for k, v in options.items() if k != "alibi_slopes"}    # None: `supports` refuses ALiBi
        tiles = prefill_tiles(o.num_heads // o.num_kv_heads, o.head_size, key_cache.dtype, key_cache.shape[2],
                              metadata.num_tokens_padded, o.num_kv_heads)
        flash_prefill(*layout, num_seqs=metadata.num_reqs_padded, num_tokens=metadata.num_tokens_padded,
                      tiles=tiles, num_decodes=metadata.num_decodes, **options)


class PerPhaseBackend(TritonUnifiedBackend):
    """Prefill through `flash`, decode through `triton_unified`, on one cache of 64- or 128-token pages (the
    default on CUDA). Why, on an H100 (bf16, GQA 32/8, head 128): `flash`'s causal prefill ran at 508 / 464 / 276
    TFLOP/s at 16k / 4k / 1k tokens against the unified kernel's 315 / 256 / 148 on the same pages; `triton_unified`'s
    decode step (split-KV for small batches, the new K/V and rotary inside the kernel) gave the higher engine
    throughput, 18,629 output tok/s against `flash`'s 17,166 (nano-vllm workload, Qwen3-0.6B config; 18,765 through
    this backend), and reads 64-token pages as fast as 16-token ones."""
    name = "per_phase"
    priority = 30
    builder_cls = PerPhaseMetadataBuilder
    impl_cls = PerPhaseImpl
    option_names = tuple(n for n in TritonUnifiedBackend.option_names if n != "split_launch")

    @classmethod
    def supports(cls, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device,
                 options: AttentionLayerOptions | None = None) -> list[str]:
        reasons = TritonUnifiedBackend.supports(spec, dtype, device, options)
        return reasons + [r for r in FlashBackend.supports(spec, dtype, device, options) if r not in reasons]

    @classmethod
    def workspace_bytes(cls, bounds: StepBounds, spec: KVCacheSpec, options: AttentionLayerOptions,
                        dtype: torch.dtype) -> int:
        return max(TritonUnifiedBackend.workspace_bytes(bounds, spec, options, dtype),
                   FlashBackend.workspace_bytes(bounds, spec, options, dtype))

    @classmethod
    def metadata_bytes(cls, bounds: StepBounds, spec: KVCacheSpec, num_queries_per_kv: int,
                       dtype: torch.dtype) -> int:
        return TritonUnifiedBackend.metadata_bytes(bounds, spec, num_queries_per_kv, dtype)

    @classmethod
    def describe(cls) -> str:
        return (f"{cls.name}: priority {cls.priority}, cudagraph {cls.cudagraph_support.name}; prefill through "
                f"flash, decode through triton_unified")


__all__ = ["PerPhaseBackend", "PerPhaseMetadataBuilder", "PerPhaseImpl"]
