"""The many-row half of `ember::scaled_linear` (ember.kernels.scaled_linear_op): activations quantized to e4m3 on
the fly, and a block-scaled GEMM.

- `quantize_rows_fp8`: one program per row quantizes x [M, K] to e4m3 with a scale per row (dynamic: amax / 448)
  or the checkpoint's static scale, with the RMSNorm prologue folded in: the first pass sums the squares and the
  largest |x * norm weight|, so the normed row is never written in x's dtype. A dynamic scale quantizes
  x * norm weight and carries 1/rms in the row's scale, as the fp8 GEMV does (bit for bit the same e4m3 values). Its output feeds `torch._scaled_mm`
  with row-wise scales.
- `block_fp8_gemm`: out = x @ dequant(W)^T for W in e4m3 with a float32 scale per 128x128 block. Each program
  owns a BLOCK_M x BLOCK_N tile and walks K one 128-column block at a time: it loads x's tile in x's dtype,
  quantizes it per row over those 128 columns (the activation scale per token and block column the block
  checkpoints are made for), multiplies on fp8 tensor cores and adds the product times both scales into a float32
  accumulator. Quantizing inside the GEMM spares a kernel and an fp8 copy of x; each column tile re-reads x's tile,
  which stays in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.e4m3 import scale_to_e4m3
from ember.kernels.fp8 import FP8, FP8_MAX, MIN_AMAX
from ember.kernels.gemv import _kernel

__all__ = ["block_fp8_gemm", "quantize_rows_fp8"]

QUANT_BLOCK = 1024          # elements of a row one program holds per pass


@triton.jit
def _quantize_rows_kernel(x_ptr, norm_weight_ptr, static_scale_ptr, out_ptr, scale_ptr, K, stride_xm, stride_om,
                          eps, FP8_LIMIT: tl.constexpr, AMAX_FLOOR: tl.constexpr, BLOCK: tl.constexpr,
                          NORM: tl.constexpr, STATIC: tl.constexpr, EXACT_E4M3: tl.constexpr):
    """Program per row: out = e4m3(x' / scale), x' = x or its RMSNorm (Llama form) with norm_weight; scale the
    static one, else max|x'| / 448 (stored in scale_ptr), where with the norm x' is x * norm weight and the stored
    scale carries 1/rms."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    amax = tl.full((BLOCK,), 0.0, tl.float32)
    sum_sq = tl.full((BLOCK,), 0.0, tl.float32)
    if NORM or not STATIC:
        for k in range(0, K, BLOCK):
            ok = k + cols < K
            x = tl.load(x_row + k + cols, mask=ok, other=0.0).to(tl.float32)
            if NORM:
                sum_sq += x * x
                x = x * tl.load(norm_weight_ptr + k + cols, mask=ok, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
    if NORM:
        rstd = tl.math.rsqrt(tl.reduce(sum_sq, 0, tl.standard._sum_combine) / K + eps)
    if STATIC:
        scale = tl.load(static_scale_ptr)
    elif NORM:
        # x * norm weight is quantized by its own amax and the row's scale takes 1/rms: the same e4m3 values as the
        # fp8 GEMV's (ember.kernels.gemv_fp8), which learns 1/rms only at the end of its pass over K
        scale = tl.maximum(tl.reduce(amax, 0, _max_combine), AMAX_FLOOR) / FP8_LIMIT
        tl.store(scale_ptr + row, scale * rstd)
    else:
        scale = tl.maximum(tl.reduce(amax, 0, _max_combine), AMAX_FLOOR) / FP8_LIMIT
        tl.store(scale_ptr + row, scale)
    for k in range(0, K, BLOCK):
        ok = k + cols < K
        x = tl.load(x_row + k + cols, mask=ok, other=0.0).to(tl.float32)
        if NORM:
            x = x * tl.load(norm_weight_ptr + k + cols, mask=ok, other=0.0).to(tl.float32)
            if STATIC:
                x = x * rstd
        # a division, as the torch reference (ember.kernels.fp8) divides: the same e4m3 values without the norm;
        # under the interpreter rounded to e4m3's values here (its conversion does not carry into the exponent)
        q = scale_to_e4m3(x, scale, EXACT_E4M3)
        tl.store(out_ptr + row * stride_om + k + cols, q.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


def quantize_rows_fp8(x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                      static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]): per-row dynamic scales, or `static_scale` [1] for every
    row; `norm_weight` [K]: x is RMS-normed first (Llama form, `eps`). Interpreted for CPU tensors."""
    if x.dim() != 2 or (norm_weight is not None and norm_weight.shape != (x.shape[1],)):
        raise ValueError(f"quantize_rows_fp8 needs x [M, K] and norm_weight [K], got {tuple(x.shape)} and "
                         f"{None if norm_weight is None else tuple(norm_weight.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    m, k = x.shape
    out = torch.empty(m, k, dtype=FP8, device=x.device)                  # [M, K]
    if static_scale is not None:
        scale = static_scale.reshape(1, 1).float().expand(m, 1).contiguous()     # [M, 1], one value
    else:
        scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)  # [M, 1]
    if m == 0:
        return out, scale
    block = min(QUANT_BLOCK, triton.next_power_of_2(k))
    _kernel(_quantize_rows_kernel, x.device)[(m,)](
        x, norm_weight if norm_weight is not None else x, scale, out, scale, k, x.stride(0), out.stride(0),
        float(eps), FP8_LIMIT=FP8_MAX, AMAX_FLOOR=MIN_AMAX, BLOCK=block, NORM=norm_weight is not None,
        STATIC=static_scale is not None, EXACT_E4M3=x.device.type == "cpu", num_warps=4)
    return out, scale


# ---- block-scaled GEMM ------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["M"])
def _block_gemm_kernel(x_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                       stride_om, FP8_LIMIT: tl.constexpr, AMAX_FLOOR: tl.constexpr, SCALE_BN: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """Program (row tile, column tile): out tile = sum over K blocks of dot(e4m3(x / sx), W^T) * sx * sw; BLOCK_K is
    the scale block's column count and BLOCK_N divides its row count, so one weight scale covers a step's tile."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]                    # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + tl.minimum(cols, N - 1)[None, :].to(tl.int64) * stride_wn + ks[:, None]   # [BLOCK_K, BLOCK_N]
    s_ptr = w_scale_ptr + ((pid_n * BLOCK_N) // SCALE_BN) * stride_sn
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = (k + ks) < K
        x = tl.load(x_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x_scale = tl.maximum(tl.reduce(tl.abs(x), 1, _max_combine), AMAX_FLOOR) / FP8_LIMIT     # [BLOCK_M]
        # the interpreter has no fp8 dot: there x is rounded to e4m3's values in float32, whose products with the
        # widened weights are exact
        q = scale_to_e4m3(x, x_scale[:, None], DOT_IN_FP32)
        w = tl.load(w_ptrs + k, mask=k_ok[:, None], other=0.0)
        w_scale = tl.load(s_ptr + k // BLOCK_K)
        if DOT_IN_FP32:
            part = tl.dot(q, w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(q.to(w_ptr.dtype.element_ty), w)
        acc += part * (x_scale[:, None] * w_scale)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _block_config(m: int, block: tuple[int, int], device: torch.device) -> dict:
    """Tile sizes: 128 columns of K a step (one scale block), 128 output columns (one scale block row), and 64 or
    128 rows; small tiles under the interpreter, which runs every program in Python."""
    if device.type == "cpu":
        return dict(BLOCK_M=16, BLOCK_N=min(32, block[0]), num_warps=4, num_stages=1)
    return dict(BLOCK_M=64 if m <= 64 else 128, BLOCK_N=128 if block[0] % 128 == 0 else block[0], num_warps=8,
                num_stages=3)


def block_fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                   bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] e4m3 x weight_scale [ceil(N / bn), ceil(K / bk)])^T (+ bias [N]) -> [M, N] in
    x's dtype (or `out_dtype`), with x quantized per row and block column inside the kernel."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.dtype != FP8 or weight.shape[1] != k or tuple(weight_scale.shape) != (-(-n // block[0]),
                                                                                    -(-k // block[1])):
        raise ValueError(f"block_fp8_gemm needs x [M, K], an e4m3 weight [N, K] and scales [N/{block[0]}, "
                         f"K/{block[1]}]; got x {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}, "
                         f"scales {tuple(weight_scale.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)     # [M, N]
    if m == 0:
        return out
    c = _block_config(m, block, x.device)
    grid = (triton.cdiv(m, c["BLOCK_M"]), triton.cdiv(n, c["BLOCK_N"]))
    _kernel(_block_gemm_kernel, x.device)[grid](
        x, weight, weight_scale, bias if bias is not None else out, out, m, n, k, x.stride(0), weight.stride(0),
        weight_scale.stride(0), out.stride(0), FP8_LIMIT=FP8_MAX, AMAX_FLOOR=MIN_AMAX, SCALE_BN=block[0],
        BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=block[1], HAS_BIAS=bias is not None,
        DOT_IN_FP32=x.device.type == "cpu", num_warps=c["num_warps"], num_stages=c["num_stages"])
    return out
