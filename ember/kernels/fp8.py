"""FP8 (e4m3) quantization as torch ops: weights per tensor, per output row or per 128x128 block, activations per
token (or per token and column group) or by a static scale, and the inverse. The layers quantize with these at load
time, the CPU runs on their dequantized weights, and the kernels' tests use them as the reference.

A scale is the float32 multiplier that dequantizes: w ~= w_fp8 * scale, with scale = amax / 448 (e4m3's largest
finite value), so the largest magnitude of each group lands on 448.
"""

from __future__ import annotations

import torch

__all__ = ["FP8", "FP8_MAX", "dequantize", "quantize_blocks", "quantize_rows", "quantize_tensor",
           "quantize_token_groups", "quantize_tokens", "quantize_with_scale", "round_activations"]

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)       # 448
MIN_AMAX = 1e-12                            # an all-zero group gets a tiny scale, not a division by zero


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3, saturating at +-448 (scale broadcasts against x)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    return amax.float().clamp(min=MIN_AMAX) / FP8_MAX


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w in e4m3, one float32 scale []) for the whole tensor."""
    scale = _scale_of(w.abs().amax())
    return quantize_with_scale(w, scale), scale


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w [N, K] in e4m3, float32 scales [N]): one scale per output row (per channel)."""
    scale = _scale_of(w.abs().amax(dim=1))
    return quantize_with_scale(w, scale[:, None]), scale


def _pad_to_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = w.shape
    bn, bk = block
    return torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(w [N, K] in e4m3, float32 scales [ceil(N / bn), ceil(K / bk)]): one scale per block of bn rows and bk
    columns (the last blocks may be partial)."""
    n, k = w.shape
    bn, bk = block
    padded = _pad_to_blocks(w.float(), block)                         # [N', K']
    tiles = padded.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))      # [N'/bn, bn, K'/bk, bk]
    scale = _scale_of(tiles.abs().amax(dim=(1, 3)))                   # [N'/bn, K'/bk]
    return quantize_with_scale(w, expand_blocks(scale, block, n, k)), scale


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """Block scales [ceil(n / bn), ceil(k / bk)] repeated to one per element [n, k]."""
    return scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def dequantize(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               block: tuple[int, int] | None = None) -> torch.Tensor:
    """e4m3 w [N, K] times its scales (one [], per row [N], or per block [N/bn, K/bk] with `block`), in `dtype`."""
    n, k = w.shape
    if block is not None:
        full = expand_blocks(scale, block, n, k)
    elif scale.dim() == 0 or scale.numel() == 1:
        full = scale.reshape(())
    else:
        full = scale.reshape(n, 1)
    return (w.float() * full).to(dtype)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [M, K] in e4m3, float32 scales [M, 1]): dynamic per-token activation quantization."""
    scale = _scale_of(x.abs().amax(dim=-1, keepdim=True))
    return quantize_with_scale(x, scale), scale


def quantize_token_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [M, K] in e4m3, float32 scales [M, ceil(K / group)]): one scale per token and `group` columns."""
    m, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -k % group)).unflatten(1, (-1, group))   # [M, K'/g, g]
    scale = _scale_of(padded.abs().amax(dim=2))                                             # [M, K'/g]
    return quantize_with_scale(x, scale.repeat_interleave(group, 1)[:, :k]), scale


def round_activations(x: torch.Tensor, input_scale: torch.Tensor | None = None,
                      group: int | None = None) -> torch.Tensor:
    """x [..., K] rounded to the e4m3 values the GPU's scaled layers multiply (by the static `input_scale` [1], per
    token and `group` columns, or per token), times their scales, in x's dtype: the CPU's stand-in for fp8
    activations."""
    rows = x.reshape(-1, x.shape[-1])
    if input_scale is not None:
        scale = input_scale.float().reshape(())
        q = quantize_with_scale(rows, scale)
    elif group is not None:
        q, scale = quantize_token_groups(rows, group)
        scale = scale.repeat_interleave(group, 1)[:, :rows.shape[1]]
    else:
        q, scale = quantize_tokens(rows)
    return (q.float() * scale).to(x.dtype).reshape(x.shape)
