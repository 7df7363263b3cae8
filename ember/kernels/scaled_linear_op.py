"""`ember::scaled_linear`: a linear layer with e4m3 weights and float32 scales, with the same optional RMSNorm
prologue, SiLU·mul epilogue and residual epilogue as `ember::fused_linear` (the fusion passes extend it in place).

    out = act(norm(x) @ (weight x scales)^T + bias) + residual
    scales: one per weight row [N] (block_n == 0), or one per block_n x block_k block [N / block_n, K / block_k]

The kernel is picked per call, like `ember::linear`'s:
- CUDA, a few rows (up to the crossover measured for the weight's shape, ember.kernels.gemv_routing): ember's GEMV
  reads the e4m3 weight and dequantizes it in registers, with every fusion inside one launch. With row scales it
  rounds x to e4m3 exactly as the many-row path does (ember.kernels.gemv_fp8), so greedy output does not depend on
  the batch a request shares; with block scales x stays in its dtype.
- CUDA, more rows, row scales: x is quantized to e4m3 per token (dynamic) or by the checkpoint's static scale, with
  the norm folded into that kernel, then `torch._scaled_mm` (cuBLASLt) with row-wise scales; bias, SiLU·mul and
  the residual follow as separate kernels.
- CUDA, more rows, block scales: the Triton block-scaled GEMM (ember.kernels.fp8_gemm), which quantizes x per token
  and 128 columns inside; norm, SiLU·mul and residual as separate kernels.
- CPU: x rounded to e4m3 as the GPU rounds it (ember.kernels.fp8.round_activations), the weight dequantized to
  x's dtype, then the torch ops of the unfused layer.
"""

from __future__ import annotations

import torch

from ember.kernels.fp8 import dequantize, round_activations
from ember.kernels.fp8_gemm import block_fp8_gemm, quantize_rows_fp8
from ember.kernels.fused_linear import fused_linear_reference, rms_norm_reference
from ember.kernels.gemv import DTYPES, GEMV_MAX_M
from ember.kernels.gemv_fp8 import gemv_fp8
from ember.kernels.gemv_routing import gemv_fp8_max_rows
from ember.kernels.library import define, register_fake
from ember.kernels.linear_op import gemv_enabled
from ember.kernels.rms_norm import rms_norm, silu_mul

__all__ = ["linear_fp8", "scaled_gemv_applies", "scaled_gemv_pays", "scaled_linear", "scaled_linear_reference",
           "set_scaled_gemv_routing"]

FP8 = torch.float8_e4m3fn

_routed = True


def set_scaled_gemv_routing(routed: bool) -> None:
    """Follow the measured fp8 GEMV crossover (True, the default), or send every row count the GEMV applies to
    through it (False: kernel tests, and the sweep that measures the crossover). `set_gemv_enabled(False)`
    (ember.kernels.linear_op) turns the GEMV off for fp8 weights too."""
    global _routed
    _routed = bool(routed)


def scaled_gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fp8 GEMV is made for these tensors: CUDA, 1..GEMV_MAX_M rows, x bfloat16/float16/float32, an
    e4m3 weight contiguous along K, and K a multiple of 16 (16-byte weight loads)."""
    return (x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_M and x.dtype in DTYPES
            and weight.dtype == FP8 and weight.stride(1) == 1 and x.shape[1] % 16 == 0)


def scaled_gemv_pays(x: torch.Tensor, weight: torch.Tensor, gated: bool) -> bool:
    """Whether the fp8 GEMV was measured faster than the many-row path at x's row count (or routing is off)."""
    return not _routed or x.shape[0] <= gemv_fp8_max_rows(weight.shape[0], weight.shape[1], gated)


def _block(block_n: int, block_k: int) -> tuple[int, int] | None:
    return (block_n, block_k) if block_n else None


def scaled_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            bias: torch.Tensor | None, block_n: int = 0, block_k: int = 0,
                            norm_weight: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
                            residual: torch.Tensor | None = None,
                            input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path: the normed x rounded to e4m3 as the GPU rounds it (per token, per token and block column, or
    by the static `input_scale`), the weight dequantized to x's dtype, then the unfused layer's torch ops."""
    block = _block(block_n, block_k)
    if norm_weight is not None:
        x = rms_norm_reference(x, norm_weight, eps)
    x = round_activations(x, input_scale, block[1] if block else None)
    w = dequantize(weight, weight_scale, x.dtype, block)
    return fused_linear_reference(x, w, bias, None, eps, gated, residual)


def _scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
               norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x (normed) quantized per row, times the e4m3 weight with row-wise scales on cuBLASLt -> [M, N] bfloat16."""
    xq, x_scale = quantize_rows_fp8(x, norm_weight, eps, input_scale)
    # row-wise scaling takes scale_a [M, 1] and scale_b [1, N] in float32, and writes bfloat16
    return torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=_row_scales(weight_scale),
                            out_dtype=torch.bfloat16)


def _row_scales(weight_scale: torch.Tensor) -> torch.Tensor:
    return weight_scale.view(1, -1)


def _many_rows(x, weight, weight_scale, input_scale, bias, block, norm_weight, eps, gated, residual):
    """The CUDA path for batches the GEMV does not take (module docstring)."""
    if block is not None:
        if norm_weight is not None:
            x = rms_norm(x, norm_weight, eps)
        out = block_fp8_gemm(x, weight, weight_scale, block, bias)
    else:
        out = _scaled_mm(x, weight, weight_scale, input_scale, norm_weight, eps)
        out = out if out.dtype == x.dtype else out.to(x.dtype)
        if bias is not None:
            out.add_(bias)
    if gated:
        out = silu_mul(out)
    return out if residual is None else out.add_(residual)


@define("scaled_linear")
def scaled_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  input_scale: torch.Tensor | None, bias: torch.Tensor | None, block_n: int, block_k: int,
                  norm_weight: torch.Tensor | None, eps: float, gated: bool,
                  residual: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] -> [M, N] (N = weight rows, or half of them when gated); see the module docstring. input_scale [1]:
    the checkpoint's static activation scale (None: dynamic per-token scales)."""
    block = _block(block_n, block_k)
    if x.device.type != "cuda":
        return scaled_linear_reference(x, weight, weight_scale, bias, block_n, block_k, norm_weight, eps, gated,
                                       residual, input_scale)
    same_dtype = all(t is None or t.dtype == x.dtype for t in (norm_weight, residual, bias))
    if gemv_enabled() and same_dtype and scaled_gemv_applies(x, weight) and scaled_gemv_pays(x, weight, gated):
        # row scales: x rounded to e4m3 as the many-row path rounds it, so a row's numbers do not depend on its
        # batch's size; block scales: weight-only (ember.kernels.gemv_fp8)
        activations = "none" if block is not None else "dynamic" if input_scale is None else "static"
        return gemv_fp8(x, weight, weight_scale, bias, residual, scale_block=block, activations=activations,
                        input_scale=input_scale, norm_weight=norm_weight, eps=eps, gated=gated)
    return _many_rows(x, weight, weight_scale, input_scale, bias, block, norm_weight, eps, gated, residual)


@register_fake("scaled_linear")
def _scaled_linear_fake(x, weight, weight_scale, input_scale, bias, block_n, block_k, norm_weight, eps, gated,
                        residual):
    return x.new_empty(x.shape[0], weight.shape[0] // 2 if gated else weight.shape[0])


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
               bias: torch.Tensor | None, block: tuple[int, int] | None) -> torch.Tensor:
    """`ember::scaled_linear` without fusions: x [..., K] -> [..., N], leading dimensions flattened for the op."""
    block_n, block_k = block or (0, 0)
    out = torch.ops.ember.scaled_linear(x.reshape(-1, x.shape[-1]), weight, weight_scale, input_scale, bias,
                                        block_n, block_k, None, 0.0, False, None)
    return out.reshape(*x.shape[:-1], weight.shape[0])

