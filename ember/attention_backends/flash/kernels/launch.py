"""Host-side launchers of the flash kernels. Grids depend only on the sizes passed in (a bucket's padded sizes under
CUDA graphs), never on device values; what varies per step is read by the kernels from device buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ember.attention_backends.triton_common.interpreted import kernel_for
from ember.attention_backends.triton_common.kv_write import check_kv_scales, fp8_f16_products, fp8_kv_mode

from .decode import decode_combine_kernel, decode_plan_kernel, flash_decode_kernel
from .prefill import flash_prefill_kernel

MAX_SPLIT_GROUP = 8   # decode splits only layers with at most this many query heads per KV head (sizes the scratch)


@dataclass(frozen=True)
class FlashTiles:
    """One launch's tiles: block_m rows (query tokens x the G heads of a KV head), tile_n keys per step."""
    block_m: int = 128
    tile_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    warp_specialize: bool = False
    maxnreg: int = 0          # registers a thread may use (0: the compiler's choice), so that more programs fit an SM

    def block_q(self, num_queries_per_kv: int) -> int:
        """Query tokens per prefill program."""
        if self.block_m < num_queries_per_kv:
            raise ValueError(f"block_m {self.block_m} is smaller than the {num_queries_per_kv} query heads per KV "
                             "head; use a block_m of at least that many rows")
        return self.block_m // num_queries_per_kv


def _check(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor):
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if key_cache.shape != value_cache.shape or key_cache.shape[3] != head_size or out.shape[1:] != query.shape[1:]:
        raise ValueError(f"shapes disagree: query {tuple(query.shape)}, cache {tuple(key_cache.shape)}, "
                         f"out {tuple(out.shape)}")
    if query.stride(2) != 1 or out.stride(2) != 1 or key_cache.stride(3) != 1 or key_cache.stride(2) != head_size:
        raise ValueError("query, out and the cache need contiguous [.., block_size, head_size] rows")
    return num_heads, num_kv_heads, head_size


def _check_tile(key_cache: torch.Tensor, tiles: FlashTiles) -> None:
    if key_cache.shape[2] % tiles.tile_n:
        raise ValueError(f"block_size {key_cache.shape[2]} is not a multiple of tile_n {tiles.tile_n}: a KV tile "
                         "must lie in one page; use a larger block_size or a smaller tile")


def can_use_tma(key_cache: torch.Tensor, tile_n: int) -> bool:
    """TMA boxes need a power-of-two head size and a contiguous 16-byte aligned cache (and a tile inside one
    page, as every tile here); on a GPU also compute capability 9.0 or newer (the interpreter emulates it)."""
    block_size, head_size = key_cache.shape[2], key_cache.shape[3]
    if block_size % tile_n or head_size != triton.next_power_of_2(head_size) or not key_cache.is_contiguous():
        return False
    if key_cache.data_ptr() % 16:
        return False
    if key_cache.device.type == "cuda":
        return torch.cuda.get_device_capability(key_cache.device)[0] >= 9
    return key_cache.device.type == "cpu"


def _cache_args(key_cache, value_cache, tile_n, use_tma):
    if use_tma is None:
        use_tma = can_use_tma(key_cache, tile_n)
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        head_size = key_cache.shape[3]
        k_desc = TensorDescriptor.from_tensor(key_cache.view(-1, head_size), [tile_n, head_size])
        v_desc = TensorDescriptor.from_tensor(value_cache.view(-1, head_size), [tile_n, head_size])
    else:   # unused placeholders (the kernel reads them only under USE_TMA)
        k_desc, v_desc = key_cache, value_cache
    return k_desc, v_desc, bool(use_tma), key_cache.numel() >= 2**31


def _scales(scale: float, soft_cap: float | None) -> tuple[float, float]:
    log2e = 1.4426950408889634
    if soft_cap:
        return scale / soft_cap, soft_cap * log2e
    return scale * log2e, 0.0


def flash_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                  block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, *,
                  num_seqs: int, num_tokens: int, scale: float, tiles: FlashTiles,
                  num_decodes: torch.Tensor | None = None, sliding_window: int | None = None,
                  soft_cap: float | None = None, sinks: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                  use_tma: bool | None = None, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Causal paged attention of the first `num_seqs` requests (those from num_decodes[0] on, if given) into
    out [T, Hq, D]. query [T, Hq, D]; caches [blocks, Hkv, block_size, D]; num_tokens: the (padded) token count
    the grid covers. lse: optional fp32 [T, Hq], the rows' natural-log log-sum-exp. kv_scales: (k_scale, v_scale)
    float32 [Hkv] of an e4m3 cache."""
    num_heads, num_kv_heads, head_size = _check(query, key_cache, value_cache, out)
    group = num_heads // num_kv_heads
    block_q = tiles.block_q(group)
    _check_tile(key_cache, tiles)
    programs = (num_tokens // block_q + num_seqs) * num_kv_heads
    if programs == 0 or num_seqs == 0:
        return
    k_desc, v_desc, use_tma, offset_64 = _cache_args(key_cache, value_cache, tiles.tile_n, use_tma)
    qk_scale, softcap_log2 = _scales(scale, soft_cap)
    dummy = query_start_loc
    kernel = kernel_for(query.device, flash_prefill_kernel)
    kernel[(programs,)](
        out, lse if lse is not None else out, query, key_cache, value_cache, k_desc, v_desc, block_table,
        query_start_loc, seq_lens, num_decodes if num_decodes is not None else dummy,
        sinks if sinks is not None else dummy, *check_kv_scales(kv_scales, key_cache, num_kv_heads),
        num_seqs, qk_scale, softcap_log2, int(sliding_window or 0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        NUM_KV_HEADS=num_kv_heads, NUM_QUERIES_PER_KV=group, HEAD_SIZE=head_size,
        HEAD_PAD=max(16, triton.next_power_of_2(head_size)), BLOCK_SIZE=key_cache.shape[2],
        BLOCK_M=tiles.block_m, BLOCK_Q=block_q, TILE_N=tiles.tile_n, SKIP_DECODES=num_decodes is not None,
        USE_TMA=use_tma, OFFSET_64=offset_64, USE_WINDOW=sliding_window is not None, USE_SOFTCAP=bool(soft_cap),
        USE_SINKS=sinks is not None, WRITE_LSE=lse is not None, IEEE=query.dtype == torch.float32,
        WARP_SPECIALIZE=tiles.warp_specialize, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **_fp8_flag(key_cache, query), **(dict(maxnreg=tiles.maxnreg) if tiles.maxnreg else {}))


def _fp8_flag(cache: torch.Tensor, query: torch.Tensor) -> dict:
    """FP8_KV (and F16_DOT) for a launch: passed only when set, so the other caches' specializations keep their
    keys."""
    mode = fp8_kv_mode(cache)
    return dict(FP8_KV=mode, F16_DOT=fp8_f16_products(query, cache)) if mode else {}


class DecodeWorkspace:
    """Persistent buffers of the balanced split-KV decode: the plan (filled on the device once per step by
    `plan`) and the partial-result scratch. Sized once, for up to `max_rows` decodes."""

    def __init__(self, max_rows: int, num_kv_heads: int, head_size: int, tile_n: int, target_items: int,
                 device: torch.device | str, min_chunk: int = 4):
        if target_items < 1 or max_rows < 1:
            raise ValueError(f"target_items {target_items} and max_rows {max_rows} must be at least 1")
        self.max_rows, self.tile_n, self.target_items, self.min_chunk = max_rows, tile_n, target_items, min_chunk
        self.num_kv_heads = num_kv_heads
        device = torch.device(device)
        i32 = dict(dtype=torch.int32, device=device)
        self.work_start = torch.zeros(max_rows + 1, **i32)     # [max_rows + 1] first item of each request
        self.split_start = torch.zeros(max_rows, **i32)        # [max_rows] first partial slot of each request
        self.num_items = target_items + max_rows
        self.item_seq = torch.full((self.num_items,), -1, **i32)    # [items] request, -1 = no work
        self.item_chunk = torch.zeros(self.num_items, **i32)         # [items] chunk index within the request
        self.item_part = torch.zeros(self.num_items, **i32)          # [items] partial slot, -1 = write the output
        self.params = torch.zeros(2, **i32)                          # [chunk tiles, live decodes]
        slots = 2 * target_items * num_kv_heads * MAX_SPLIT_GROUP   # (slot, query head) rows
        head_pad = max(16, triton.next_power_of_2(head_size))
        self.part_out = torch.empty(slots * head_pad, dtype=torch.float32, device=device)   # [slots * head_pad]
        self.part_ml = torch.empty(slots * 2, dtype=torch.float32, device=device)          # [slots * 2] max, sum

    def plan(self, seq_lens: torch.Tensor, num_decodes: int, sliding_window: int | None = None) -> None:
        """Divide the first `num_decodes` requests' KV tiles into work items (one tiny launch, no host sync)."""
        if not 0 <= num_decodes <= self.max_rows:
            raise ValueError(f"num_decodes {num_decodes} is outside [0, {self.max_rows}]")
        rows = min(self.max_rows, seq_lens.shape[0])
        kernel = kernel_for(seq_lens.device, decode_plan_kernel)
        # the row tile is sized for the workspace, not the bucket, so one compiled kernel serves every batch size
        kernel[(1,)](
            seq_lens, self.work_start, self.split_start, self.item_seq, self.item_chunk, self.item_part, self.params,
            num_decodes, rows, self.num_items, self.target_items, int(sliding_window or 0),
            TILE_N=self.tile_n, MIN_CHUNK=self.min_chunk, BLOCK_R=min(1024, triton.next_power_of_2(self.max_rows)),
            USE_WINDOW=sliding_window is not None, num_warps=4)


def flash_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                 block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, *,
                 workspace: DecodeWorkspace, num_rows: int, scale: float, tiles: FlashTiles,
                 sliding_window: int | None = None, soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                 use_tma: bool | None = None, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Single-token attention of the leading decodes (as many as the last `workspace.plan` counted) into out.

    num_rows: decode rows the grid covers (a bucket size >= the live decodes). Layers with more than
    MAX_SPLIT_GROUP query heads per KV head run one program per request instead of the balanced split."""
    num_heads, num_kv_heads, head_size = _check(query, key_cache, value_cache, out)
    group = num_heads // num_kv_heads
    if tiles.tile_n != workspace.tile_n or num_kv_heads != workspace.num_kv_heads:
        raise ValueError(f"tile_n {tiles.tile_n} / {num_kv_heads} KV heads differ from the workspace's plan "
                         f"({workspace.tile_n} / {workspace.num_kv_heads})")
    if num_rows > workspace.max_rows:
        raise ValueError(f"num_rows {num_rows} exceeds the workspace's {workspace.max_rows} rows")
    if tiles.block_m < group:
        raise ValueError(f"block_m {tiles.block_m} is smaller than the {group} query heads per KV head")
    _check_tile(key_cache, tiles)
    if num_rows == 0:
        return
    split = group <= MAX_SPLIT_GROUP
    k_desc, v_desc, use_tma, offset_64 = _cache_args(key_cache, value_cache, tiles.tile_n, use_tma)
    qk_scale, softcap_log2 = _scales(scale, soft_cap)
    head_pad = max(16, triton.next_power_of_2(head_size))
    ws = workspace
    kernel = kernel_for(query.device, flash_decode_kernel)
    grid = (ws.target_items + num_rows if split else num_rows, num_kv_heads)
    kernel[grid](
        out, ws.part_out, ws.part_ml, query, key_cache, value_cache, k_desc, v_desc, block_table, query_start_loc,
        seq_lens, ws.item_seq, ws.item_chunk, ws.item_part, ws.params,
        sinks if sinks is not None else query_start_loc, *check_kv_scales(kv_scales, key_cache, num_kv_heads),
        qk_scale, softcap_log2, int(sliding_window or 0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        NUM_KV_HEADS=num_kv_heads, NUM_QUERIES_PER_KV=group, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        BLOCK_SIZE=key_cache.shape[2], BLOCK_M=tiles.block_m, TILE_N=tiles.tile_n, SPLIT=split, USE_TMA=use_tma,
        OFFSET_64=offset_64, USE_WINDOW=sliding_window is not None, USE_SOFTCAP=bool(soft_cap),
        USE_SINKS=sinks is not None, IEEE=query.dtype == torch.float32,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **_fp8_flag(key_cache, query))
    if split:
        combine = kernel_for(query.device, decode_combine_kernel)
        combine[(num_rows, num_heads)](
            out, ws.part_out, ws.part_ml, query_start_loc, ws.work_start, ws.split_start, ws.params,
            out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_SIZE=head_size, HEAD_PAD=head_pad, BLOCK_C=32 if head_pad <= 128 else 16,
            num_warps=4)
