"""The small-M GEMV (ember.kernels.gemv) on e4m3 weights: the same kernel, with every fusion, reading 1-byte
weights and dequantizing them in registers.

- Row scales (per tensor, per channel, online): one float32 scale per W row, applied to the sums once.
- Block scales (128x128 checkpoints): one per block of W, applied to each K step's tile (a step stays in one block
  column).
- Activations (row scales only): rounded to e4m3 exactly as the many-row path (`quantize_rows_fp8` before
  `torch._scaled_mm`) rounds them, so a row's numbers do not depend on which side of the crossover its batch fell:
  dynamic, x * norm weight by its row's amax / 448 (a first pass over K), with 1/rms and the scale applied to the
  sums; static, the normed x by the checkpoint's scale. Products of e4m3 values are exact in float32, so the two
  paths differ by their float32 summation order and the epilogues' rounding, as the bf16 GEMV and cuBLAS do.
  With block scales x stays in its dtype (weight-only): the block GEMM's per-128-column activation scales have no
  cheap equivalent in a kernel that walks K in shorter steps.
"""

from __future__ import annotations

import torch

from ember.kernels.gemv import launch_gemv

__all__ = ["ACTIVATIONS", "gemv_fp8"]

FP8 = torch.float8_e4m3fn
ACTIVATIONS = {"none": 0, "dynamic": 1, "static": 2}     # how x is rounded to e4m3 (ACT_QUANT)


def _check(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, gated: bool,
           activations: str, input_scale: torch.Tensor | None) -> None:
    """Raise a ValueError unless `scale` fits the e4m3 `weight` and the activation mode its arguments."""
    if weight.dtype != FP8:
        raise ValueError(f"gemv_fp8 needs a float8_e4m3fn weight, got {weight.dtype}")
    rows, k = weight.shape
    expected = (rows,) if block is None else (-(-rows // block[0]), -(-k // block[1]))
    if scale.dtype != torch.float32 or tuple(scale.shape) != expected or not scale.is_contiguous():
        raise ValueError(f"weight_scale must be a contiguous float32 {list(expected)}, got {scale.dtype} "
                         f"{list(scale.shape)}")
    if block is not None and gated and (rows // 2) % block[0]:
        raise ValueError(f"a gated block-scaled gemv needs gate rows ({rows // 2}) in whole blocks of {block[0]}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations {activations!r} is not one of {sorted(ACTIVATIONS)}")
    if block is not None and activations != "none":
        raise ValueError("a block-scaled gemv keeps x in its dtype: activations must be 'none'")
    if (activations == "static") != (input_scale is not None and input_scale.numel() == 1):
        raise ValueError("activations 'static' takes input_scale, one float32 value; the other modes take none")


def gemv_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None = None, residual: torch.Tensor | None = None, config: dict | None = None, *,
             scale_block: tuple[int, int] | None = None, activations: str = "none",
             input_scale: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
             gated: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] e4m3 x weight_scale)^T with `gemv`'s fusions and arguments -> [M, N] in x's dtype.
    weight_scale: float32, one per row [rows of W], or one per block [ceil(rows / bn), ceil(K / bk)] with
    `scale_block` (bn, bk). activations: "none" (x in its dtype), "dynamic" (per row) or "static" (`input_scale`
    [1]), row scales only (module docstring)."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"gemv_fp8 takes x in bfloat16, float16 or float32, got {x.dtype}")
    _check(weight, weight_scale, scale_block, gated, activations, input_scale)
    constexprs = dict(W_SCALE=1) if scale_block is None else \
        dict(W_SCALE=2, SCALE_BN=scale_block[0], SCALE_BK=scale_block[1])
    if activations != "none":
        constexprs["ACT_QUANT"] = ACTIVATIONS[activations]
    act_scale = input_scale.reshape(1).float().contiguous() if input_scale is not None else None
    return launch_gemv(x, weight, bias, residual, config, norm_weight, eps, gated, out_dtype,
                       weight_scale=weight_scale, act_scale=act_scale,
                       max_block_k=scale_block[1] if scale_block else None, **constexprs)
