"""What every Triton attention backend needs from the device, the dtypes and the layers, as `supports()` reasons."""

from __future__ import annotations

import os

import torch

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_KV_DTYPE = torch.float8_e4m3fn     # both Triton backends read and write e4m3 caches with per-head scales


def triton_device_reasons(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> list[str]:
    """Reasons a Triton backend cannot run here: a CPU without the interpreter, another device, an unsupported
    dtype, or bfloat16 under the interpreter (whose tl.dot is wrong on it)."""
    reasons = []
    device = torch.device(device)
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"   # read now: tests set it per process
    if device.type == "cpu" and not interpreted:
        reasons.append("on a CPU the Triton kernels run only under TRITON_INTERPRET=1")
    elif device.type not in ("cpu", "cuda"):
        reasons.append(f"device {device.type} is not supported (cuda, or cpu with TRITON_INTERPRET=1)")
    if kv_dtype == FP8_KV_DTYPE:
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            reasons.append("an fp8 KV cache needs a GPU of compute capability 8.9 or newer (e4m3 conversions)")
        kv_dtype = dtype      # the kernels attend in the model's dtype
    for what, dt in (("dtype", dtype), ("KV-cache dtype", kv_dtype)):
        if dt not in TRITON_DTYPES:
            reasons.append(f"{what} {dt} is not supported (float16, bfloat16, float32)")
        elif dt == torch.bfloat16 and device.type == "cpu" and interpreted:
            reasons.append(f"{what} bfloat16 is not supported under TRITON_INTERPRET (its tl.dot is wrong "
                           "there); use float16 or float32 on a CPU")
    return reasons


def triton_layer_reasons(spec, dtype: torch.dtype, device: torch.device, options, min_head_size: int,
                         max_head_size: int, max_queries_per_kv: int) -> list[str]:
    """`triton_device_reasons`, plus what both Triton backends' kernels ask of the layers (`options`, an
    AttentionLayerOptions, or None): a head size that is a multiple of 8 within bounds, whole query-head groups
    of at most `max_queries_per_kv`, a sliding window of at least 1."""
    reasons = triton_device_reasons(device, dtype, spec.dtype)
    head_size = spec.head_size if options is None else options.head_size
    if not (min_head_size <= head_size <= max_head_size and head_size % 8 == 0):
        reasons.append(f"head_size {head_size} is not supported (a multiple of 8 from {min_head_size} to "
                       f"{max_head_size})")
    if options is not None:
        if options.num_heads % max(options.num_kv_heads, 1):
            reasons.append(f"num_heads {options.num_heads} is not a multiple of num_kv_heads {options.num_kv_heads}")
        elif options.num_heads // options.num_kv_heads > max_queries_per_kv:
            reasons.append(f"{options.num_heads // options.num_kv_heads} query heads per KV head exceed the "
                           f"supported {max_queries_per_kv}")
        if options.sliding_window is not None and options.sliding_window < 1:
            reasons.append(f"sliding_window {options.sliding_window} must be at least 1")
    return reasons


def head_major_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """One layer's cache, [2, num_blocks, num_kv_heads, block_size, head_size]: heads outside the token axis, so
    one (block, head) is a contiguous run and a tile of keys in one page one box (see `kv_write`)."""
    return (2, num_blocks, num_kv_heads, block_size, head_size)
