"""The small-M GEMV (ember.kernels.gemv) on e4m3 weights: the same kernel, with every fusion, reading 1-byte
weights and dequantizing them in registers.

- Row scales (per tensor, per channel, online): one float32 scale per W row, applied to the sums once.
- Block scales (128x128 checkpoints): one per block of W, applied to each K step's tile (a step stays in one block
  column).
- Activations (row scales only): rounded to e4m3 exactly as the many-row path (`quantize_rows_fp8` before
  `torch._scaled_mm`) rounds them, so a row's numbers do not depend on which side of the crossover its batch fell:
  dynamic, x * norm weight by its row's amax / 448, with 1/rms and the scale applied to the sums; static, the
  normed x by the checkpoint's scale. Products of e4m3 values are exact in float32, so the two paths differ by
  their float32 summation order and the epilogues' rounding, as the bf16 GEMV and cuBLAS do.
  With block scales x stays in its dtype (weight-only): the block GEMM's per-128-column activation scales have no
  cheap equivalent in a kernel that walks K in shorter steps.

A row's scale needs all of its K first. `round_rows` computes it once a call, in a program per row before the GEMV
(`quantize_rows_fp8`'s arithmetic in the same order, its loop unrolled so that a row's loads are all in flight at
once), and writes the rounded row as e4m3 values in x's dtype (exact in bfloat16, float16 and float32) with the
row's scale (times 1/rms); the GEMV then runs weight-only's K loop on it and scales the sums by row (ACT_QUANT 3).
Done inside the GEMV instead (`set_row_prepass(False)`, or EMBER_FP8_ROW_PREPASS=0 for a whole process: A/B runs),
every program first walks all of K for the amax and 1/rms and rounds x again at every step: on an H100 about twice
weight-only's time at one row.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ember.kernels.e4m3 import AMAX_FLOOR, E4M3_MAX, max_combine, scale_to_e4m3
from ember.kernels.gemv import _kernel, launch_gemv
from ember.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_options

__all__ = ["ACTIVATIONS", "gemv_fp8", "round_rows", "set_row_prepass"]

FP8 = torch.float8_e4m3fn
ACTIVATIONS = {"none": 0, "dynamic": 1, "static": 2}     # how x is rounded to e4m3 (ACT_QUANT)
ROUNDED = 3                  # ACT_QUANT of a GEMV on `round_rows`' output
ROW_BLOCK = 1024             # elements a step of `round_rows` (quantize_rows_fp8's, for the same sums)
ROW_WARPS = 4                # warps of a `round_rows` program

_row_prepass = os.environ.get("EMBER_FP8_ROW_PREPASS", "1") != "0"      # an A/B switch (module docstring)


def set_row_prepass(on: bool) -> None:
    """Round x in a kernel before the GEMV (True, the default) or inside every GEMV program (False): a switch for
    A/B runs (benches/experiments/fp8_gemv_modes.py --prepass)."""
    global _row_prepass
    _row_prepass = bool(on)


@triton.jit
def _round_rows_kernel(x_ptr, norm_weight_ptr, static_scale_ptr, out_ptr, scale_ptr, K, stride_xm, stride_om, eps,
                       BLOCK: tl.constexpr, STEPS: tl.constexpr, NORM: tl.constexpr, STATIC: tl.constexpr,
                       EXACT_E4M3: tl.constexpr, PDL: tl.constexpr = False):
    """Program per row: out = e4m3(x' / scale) in out's dtype and scale_ptr[row] = the row's scale, x' as in
    `quantize_rows_fp8` (x * norm weight by its amax, the stored scale times 1/rms; or the normed x by the static
    scale). STEPS static steps of BLOCK: the loads of a row do not wait on each other."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    if PDL:
        # the next kernel (the GEMV) may start loading its first weight tile now; it waits for this one's rows
        gdc_wait()
        gdc_launch_dependents()
    amax = tl.full((BLOCK,), 0.0, tl.float32)
    sum_sq = tl.full((BLOCK,), 0.0, tl.float32)
    if NORM or not STATIC:
        for step in tl.static_range(STEPS):
            ok = step * BLOCK + cols < K
            x = tl.load(x_row + step * BLOCK + cols, mask=ok, other=0.0).to(tl.float32)
            if NORM:
                sum_sq += x * x
                x = x * tl.load(norm_weight_ptr + step * BLOCK + cols, mask=ok, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
    if NORM:
        rstd = tl.math.rsqrt(tl.reduce(sum_sq, 0, tl.standard._sum_combine) / K + eps)
    if STATIC:
        scale = tl.load(static_scale_ptr)
        tl.store(scale_ptr + row, scale)
    else:
        scale = tl.maximum(tl.reduce(amax, 0, max_combine), AMAX_FLOOR) / E4M3_MAX
        if NORM:
            tl.store(scale_ptr + row, scale * rstd)
        else:
            tl.store(scale_ptr + row, scale)
    for step in tl.static_range(STEPS):
        ok = step * BLOCK + cols < K
        x = tl.load(x_row + step * BLOCK + cols, mask=ok, other=0.0).to(tl.float32)
        if NORM:
            x = x * tl.load(norm_weight_ptr + step * BLOCK + cols, mask=ok, other=0.0).to(tl.float32)
            if STATIC:
                x = x * rstd
        q = scale_to_e4m3(x, scale, EXACT_E4M3)
        if not EXACT_E4M3:
            q = q.to(tl.float8e4nv)
        tl.store(out_ptr + row * stride_om + step * BLOCK + cols, q.to(out_ptr.dtype.element_ty), mask=ok)


def round_rows(x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
               static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x's rows rounded to e4m3 values, in x's dtype [M, K]; float32 scales [M]): the values and
    scales of `quantize_rows_fp8(x, norm_weight, eps, static_scale)` (dynamic per row, or `static_scale` [1]; the
    norm folded in). Interpreted for CPU tensors."""
    if x.dim() != 2 or (norm_weight is not None and norm_weight.shape != (x.shape[1],)):
        raise ValueError(f"round_rows needs x [M, K] and norm_weight [K], got {tuple(x.shape)} and "
                         f"{None if norm_weight is None else tuple(norm_weight.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    m, k = x.shape
    out = torch.empty(m, k, dtype=x.dtype, device=x.device)             # [M, K]
    scale = torch.empty(m, dtype=torch.float32, device=x.device)        # [M]
    if m == 0:
        return out, scale
    static = static_scale.reshape(1).float().contiguous() if static_scale is not None else scale
    block = min(ROW_BLOCK, triton.next_power_of_2(k))
    _kernel(_round_rows_kernel, x.device)[(m,)](
        x, norm_weight if norm_weight is not None else x, static, out, scale, k, x.stride(0), out.stride(0),
        float(eps), BLOCK=block, STEPS=triton.cdiv(k, block), NORM=norm_weight is not None,
        STATIC=static_scale is not None, EXACT_E4M3=x.device.type == "cpu", num_warps=ROW_WARPS,
        **pdl_options(x.device))
    return out, scale


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
    act_scale = input_scale.reshape(1).float().contiguous() if input_scale is not None else None
    if activations != "none" and _row_prepass:
        # rounded once a call, the norm folded in (module docstring)
        x, act_scale = round_rows(x, norm_weight, eps, input_scale)
        norm_weight = None
        constexprs["ACT_QUANT"] = ROUNDED
    elif activations != "none":
        constexprs["ACT_QUANT"] = ACTIVATIONS[activations]
    return launch_gemv(x, weight, bias, residual, config, norm_weight, eps, gated, out_dtype,
                       weight_scale=weight_scale, act_scale=act_scale,
                       max_block_k=scale_block[1] if scale_block else None, **constexprs)
