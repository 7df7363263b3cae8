"""Row RMSNorm (Llama form) and SiLU·mul as single Triton kernels, rounded as the unfused torch ops round.

They serve `ember::fused_linear` when its GEMV does not apply (prefill-sized batches): there the norm or the
activation runs as one kernel beside cuBLAS, as Inductor's fused kernel would have, instead of the ~8 eager ops
of the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.gemv import _kernel
from ember.kernels.library import define, register_fake

MAX_BLOCK = 4096          # elements of a row one program holds per pass
ACT_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, K, stride_xm, stride_om, eps,
                     BLOCK: tl.constexpr):
    """Program per row: out = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), the product rounded once more."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    sum_sq = tl.full((BLOCK,), 0.0, tl.float32)
    for k in range(0, K, BLOCK):
        xs = tl.load(x_row + k + cols, mask=k + cols < K, other=0.0).to(tl.float32)
        sum_sq += xs * xs
    rstd = tl.math.rsqrt(tl.reduce(sum_sq, 0, tl.standard._sum_combine) / K + eps)
    for k in range(0, K, BLOCK):
        ok = k + cols < K
        x = tl.load(x_row + k + cols, mask=ok, other=0.0)
        w = tl.load(weight_ptr + k + cols, mask=ok, other=0.0)
        normed = (x.to(tl.float32) * rstd).to(x.dtype)
        out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_om + k + cols, out, mask=ok)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, N, stride_xm, stride_om, BLOCK: tl.constexpr):
    """Program (row, column block): out = silu(gate).to(dtype) * up over x = [gate | up] [M, 2N]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    gate = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_xm + N + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * stride_om + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=ok)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, K], weight [K] -> [M, K]: the Llama-form RMSNorm as one kernel (interpreted for CPU tensors)."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm needs x [M, K] and weight [K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)     # [M, K]
    if x.shape[0] == 0:
        return out
    block = min(MAX_BLOCK, _next_pow2(x.shape[1]))
    _kernel(_rms_norm_kernel, x.device)[(x.shape[0],)](
        x, weight.contiguous(), out, x.shape[1], x.stride(0), out.stride(0), float(eps),
        BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2N] = [gate | up] -> silu(gate) * up [M, N] as one kernel (interpreted for CPU tensors)."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_mul needs x [M, 2N], got {tuple(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    n = x.shape[1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)      # [M, N]
    if x.shape[0] == 0:
        return out
    _kernel(_silu_mul_kernel, x.device)[(x.shape[0], triton.cdiv(n, ACT_BLOCK))](
        x, out, n, x.stride(0), out.stride(0), BLOCK=ACT_BLOCK)
    return out


@define("rms_norm")
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`ember::rms_norm`: x [M, K], weight [K] -> a new [M, K], the Llama-form RMSNorm; the Triton kernel on a GPU,
    the torch ops of the model's own norm on a CPU."""
    if x.device.type == "cpu":
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return rms_norm(x, weight, eps)


@register_fake("rms_norm")
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
