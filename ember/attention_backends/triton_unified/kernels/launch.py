"""Host-side launchers for the unified attention kernels. Grids depend only on the sizes passed in (padded sizes
when called from a CUDA graph), never on device values, so a captured launch replays with any batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ember.attention_backends.triton_common.interpreted import kernel_for
from ember.attention_backends.triton_common.kv_write import check_kv_scales, fp8_f16_products, fp8_kv_mode
from ember.kernels.pdl import pdl_options

from .attention_core import MODE_ALL, MODE_DECODES, MODE_PREFILLS

from .unified_attention import reduce_segments_kernel, unified_attention_kernel

__all__ = ["TileConfig", "MODE_ALL", "MODE_DECODES", "MODE_PREFILLS", "unified_attention_2d",
           "unified_attention_3d", "segment_scratch_numel"]


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch options of one kernel launch. block_m rows hold block_m // G query tokens times the
    G query heads of one KV head; tile_n keys per KV step (independent of the cache's block size)."""
    block_m: int = 64
    tile_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    unmasked_middle: bool = False   # separate loops so fully visible tiles skip the mask (more registers)

    def block_q(self, num_queries_per_kv: int) -> int:
        """Query tokens per program."""
        if self.block_m < num_queries_per_kv:
            raise ValueError(f"block_m {self.block_m} is smaller than the {num_queries_per_kv} query heads per KV "
                             "head; use a block_m of at least that many rows")
        return self.block_m // num_queries_per_kv


def _check(query: torch.Tensor, key_cache: torch.Tensor, out: torch.Tensor) -> tuple[int, int, int]:
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if key_cache.shape[3] != head_size or out.shape[1:] != query.shape[1:]:
        raise ValueError(f"shapes disagree: query {tuple(query.shape)}, cache {tuple(key_cache.shape)}, "
                         f"out {tuple(out.shape)}")
    if query.stride(2) != 1 or out.stride(2) != 1 or key_cache.stride(3) != 1:
        raise ValueError("query, out and the cache need a contiguous last (head_size) dimension")
    return num_heads, num_kv_heads, head_size


def _new_kv_args(new_kv, query, key_cache):
    """The kernel's (key, value, slot_mapping) pointers and their strides for `new_kv`, or stand-ins without it."""
    if new_kv is None:
        return (query, query, query), (0, 0, 0, 0)
    key, value, slot_mapping = new_kv
    if (key.shape[0] < query.shape[0] or key.shape[1:] != key_cache.shape[1::2] or value.shape != key.shape):
        raise ValueError(f"new key {tuple(key.shape)} and value {tuple(value.shape)} must be [{query.shape[0]} "
                         f"tokens, {key_cache.shape[1]}, {key_cache.shape[3]}] like the query and the cache")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape[0] < query.shape[0]:
        raise ValueError(f"slot_mapping must be int64 with an entry per token, got {slot_mapping.dtype} "
                         f"[{slot_mapping.shape[0]}] for {query.shape[0]} tokens")
    key = key if key.stride(2) == 1 else key.contiguous()
    value = value if value.stride(2) == 1 else value.contiguous()
    return (key, value, slot_mapping), (key.stride(0), key.stride(1), value.stride(0), value.stride(1))


def _rope_args(rope, query, new_kv):
    """The kernel's (cos, sin, q norm, k norm) pointers, (eps, cos stride, sin stride) and flags for `rope`."""
    if rope is None:
        return (query, query, query, query), (0.0, 0, 0), dict(ROPE=False, QK_NORM=False)
    cos, sin, q_weight, k_weight, eps = rope
    head_size = query.shape[2]
    if new_kv is None:
        raise ValueError("rope needs new_kv: only a decode launch that writes the new keys can rotate them")
    if head_size & (head_size - 1) or head_size < 16:
        raise ValueError(f"rope needs a power-of-two head_size of at least 16, got {head_size}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[1] * 2 != head_size or t.stride(1) != 1 or t.shape[0] < query.shape[0]:
            raise ValueError(f"{name} must be [tokens, {head_size // 2}] with a contiguous last dimension, got "
                             f"{tuple(t.shape)} strides {t.stride()}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("rope takes both q and k norm weights or neither")
    if q_weight is not None and (q_weight.shape != (head_size,) or k_weight.shape != (head_size,)):
        raise ValueError(f"norm weights must be [{head_size}], got {tuple(q_weight.shape)} and {tuple(k_weight.shape)}")
    norm = q_weight is not None
    weights = (q_weight.contiguous(), k_weight.contiguous()) if norm else (query, query)
    return (cos, sin, *weights), (float(eps), cos.stride(0), sin.stride(0)), dict(ROPE=True, QK_NORM=norm)


def _common_args(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, num_decodes, sinks,
                 alibi_slopes, num_seqs, scale, sliding_window, soft_cap, stride_out, new_kv=None, rope=None,
                 single_tiles: int = 0, kv_scales=None):
    # Unused optional pointers get a harmless stand-in: the kernel never dereferences them (constexpr flags).
    dummy = query_start_loc
    new_ptrs, new_strides = _new_kv_args(new_kv, query, key_cache)
    rope_ptrs, (eps, stride_cos, stride_sin), rope_flags = _rope_args(rope, query, new_kv)
    scales = check_kv_scales(kv_scales, key_cache, key_cache.shape[1])
    fp8 = fp8_kv_mode(key_cache)
    return ((query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
             num_decodes if num_decodes is not None else dummy,
             sinks if sinks is not None else dummy, alibi_slopes if alibi_slopes is not None else dummy, *new_ptrs,
             *rope_ptrs, *scales, num_seqs, float(scale), float(soft_cap or 0.0), int(sliding_window or 0), eps,
             int(single_tiles), query.stride(0), query.stride(1), *stride_out,
             key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0), *new_strides,
             stride_cos, stride_sin),
            dict(USE_WINDOW=sliding_window is not None, USE_SOFTCAP=bool(soft_cap), USE_SINKS=sinks is not None,
                 USE_ALIBI=alibi_slopes is not None, IEEE=query.dtype == torch.float32,
                 BLOCK_SIZE=key_cache.shape[2], NEW_KV=new_kv is not None, **rope_flags,
                 **(dict(FP8_KV=fp8, F16_DOT=fp8_f16_products(query, key_cache)) if fp8 else {})))


def unified_attention_2d(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                         block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, *,
                         num_seqs: int, num_tokens: int, scale: float, config: TileConfig, mode: int = MODE_ALL,
                         num_decodes: torch.Tensor | None = None, sliding_window: int | None = None,
                         soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                         alibi_slopes: torch.Tensor | None = None,
                         new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                         rope: tuple | None = None, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> None:
    """Causal paged attention into out [T, Hq, D] for query [T, Hq, D] over caches [blocks, Hkv, block_size, D];
    an e4m3 cache with its kv_scales (k_scale, v_scale, float32 [Hkv]), as `write_kv` quantized it.

    num_seqs: rows of seq_lens (query_start_loc has num_seqs + 1); num_tokens: the padded token count the grid
    covers. mode: MODE_ALL, MODE_DECODES (program i is request i; config.block_m >= G) or MODE_PREFILLS (requests
    from num_decodes[0] on). num_decodes: int32 [1] device tensor of leading decodes, read by the kernel.

    new_kv: (key, value [T, Hkv, D], slot_mapping [T] int64), MODE_DECODES only: the cache does not hold the
    decodes' new tokens yet; the kernel attends them from key/value and writes them at their slots, the work of
    `write_kv` for these tokens (slot -1: nothing written, the cache's entry is attended).

    rope: (cos, sin [T, D/2] float32, q_weight, k_weight [D] or both None, eps), with new_kv only: query and the new
    keys are as the qkv projection wrote them, and the kernel applies the model's per-head RMSNorm (when weights
    are given) and rotary to them, the work of `ember.kernels.qk_norm_rope.norm_rope_qk`."""
    if new_kv is not None and mode != MODE_DECODES:
        raise ValueError(f"new_kv needs mode MODE_DECODES ({MODE_DECODES}), got mode {mode}")
    num_heads, num_kv_heads, head_size = _check(query, key_cache, out)
    group = num_heads // num_kv_heads
    block_q = config.block_q(group)
    if mode == MODE_DECODES:
        block_q = 1
    if mode == MODE_PREFILLS and num_decodes is None:
        raise ValueError("MODE_PREFILLS needs the num_decodes device tensor")
    if mode == MODE_DECODES:
        programs = num_seqs
    else:
        programs = num_tokens // block_q + num_seqs
    if programs == 0:
        return
    args, flags = _common_args(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, num_decodes,
                               sinks, alibi_slopes, num_seqs, scale, sliding_window, soft_cap,
                               (out.stride(0), out.stride(1)), new_kv, rope, kv_scales=kv_scales)
    kernel = kernel_for(query.device, unified_attention_kernel)
    kernel[(programs, num_kv_heads)](
        out, out, out, out, out, *args,
        NUM_QUERIES_PER_KV=group, HEAD_SIZE=head_size, HEAD_PAD=max(16, triton.next_power_of_2(head_size)),
        BLOCK_M=config.block_m, BLOCK_Q=block_q, TILE_N=config.tile_n, NUM_SEGMENTS=1, MODE=mode,
        UNMASKED_MIDDLE=config.unmasked_middle,
        LIMIT_DECODES=num_decodes is not None and mode == MODE_DECODES, **flags,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_options(query.device))


# the 3D kernel's most segments, and the tile its combine reads them in (a power of two): the count itself is the
# launch grid's, a runtime value, so one compiled 3D kernel and one reduce serve every decode bucket
MAX_SEGMENTS = 64


def segment_scratch_numel(num_seqs: int, num_heads: int, head_size: int, num_segments: int) -> tuple[int, int]:
    """fp32 elements the 3D kernel needs: (partial outputs, partial max = partial sums)."""
    rows = num_seqs * num_heads * num_segments
    return rows * max(16, triton.next_power_of_2(head_size)), rows


def unified_attention_3d(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                         block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, *,
                         num_seqs: int, scale: float, config: TileConfig, num_segments: int,
                         scratch_out: torch.Tensor, scratch_max: torch.Tensor, scratch_sum: torch.Tensor,
                         num_decodes: torch.Tensor | None = None, sliding_window: int | None = None,
                         soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                         alibi_slopes: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                         new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                         rope: tuple | None = None, single_segment_tiles: int = 0,
                         kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Split-KV decode attention over the first num_seqs requests (or the first num_decodes[0], if given), each with
    one query token: num_segments programs per (request, KV head), then a reduce. Scratch: flat fp32 tensors of at
    least segment_scratch_numel(...) elements.

    new_kv, rope: as in `unified_attention_2d`; the last segment program of each (request, KV head) attends and
    writes the new token (normed and rotated first with rope), and every program norms and rotates its queries.

    counters: int32, at least num_seqs x KV heads elements, all 0: the last segment program of each (request, KV
    head) combines the segments itself and resets its counter, and no reduce kernel is launched.

    single_segment_tiles: a request whose visible KV range is at most this many tiles of config.tile_n keys is
    attended by its first segment program alone, which writes its output (no partials, nothing to combine)."""
    num_heads, num_kv_heads, head_size = _check(query, key_cache, out)
    group = num_heads // num_kv_heads
    config.block_q(group)
    if not 2 <= num_segments <= MAX_SEGMENTS:
        raise ValueError(f"num_segments {num_segments} must be in 2..{MAX_SEGMENTS}")
    need_out, need_rows = segment_scratch_numel(num_seqs, num_heads, head_size, num_segments)
    if scratch_out.numel() < need_out or scratch_max.numel() < need_rows or scratch_sum.numel() < need_rows:
        raise ValueError(f"segment scratch holds {scratch_out.numel()}/{scratch_max.numel()} elements; "
                         f"{need_out}/{need_rows} needed for {num_seqs} requests x {num_segments} segments")
    if not isinstance(single_segment_tiles, int) or single_segment_tiles < 0:
        raise ValueError(f"single_segment_tiles must be a non-negative int, got {single_segment_tiles!r}")
    if counters is not None and (counters.dtype != torch.int32 or counters.numel() < num_seqs * num_kv_heads):
        raise ValueError(f"counters must be int32 with at least {num_seqs * num_kv_heads} elements, got "
                         f"{counters.dtype} [{counters.numel()}]")
    if num_seqs == 0:
        return
    args, flags = _common_args(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, num_decodes,
                               sinks, alibi_slopes, num_seqs, scale, sliding_window, soft_cap,
                               (out.stride(0), out.stride(1)), new_kv, rope, single_segment_tiles, kv_scales)
    head_pad = max(16, triton.next_power_of_2(head_size))
    limit = num_decodes is not None
    kernel = kernel_for(query.device, unified_attention_kernel)
    kernel[(num_seqs, num_kv_heads, num_segments)](
        out, scratch_out, scratch_max, scratch_sum, counters if counters is not None else out, *args,
        NUM_QUERIES_PER_KV=group, HEAD_SIZE=head_size, HEAD_PAD=head_pad, BLOCK_M=config.block_m, BLOCK_Q=1,
        TILE_N=config.tile_n, NUM_SEGMENTS=MAX_SEGMENTS, MODE=MODE_DECODES, LIMIT_DECODES=limit, **flags,
        UNMASKED_MIDDLE=config.unmasked_middle, FUSED_COMBINE=counters is not None,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_options(query.device))
    if counters is not None:
        return
    reduce = kernel_for(query.device, reduce_segments_kernel)
    reduce[(num_seqs, num_heads)](
        out, scratch_out, scratch_max, scratch_sum, query_start_loc, seq_lens,
        num_decodes if limit else query_start_loc, sinks if sinks is not None else query_start_loc,
        num_seqs, num_segments, int(sliding_window or 0), single_segment_tiles, out.stride(0), out.stride(1),
        HEAD_SIZE=head_size, HEAD_PAD=head_pad, TILE_N=config.tile_n, NUM_SEGMENTS=MAX_SEGMENTS,
        LIMIT_DECODES=limit, USE_WINDOW=sliding_window is not None, USE_SINKS=sinks is not None, num_warps=4,
        **pdl_options(query.device))
