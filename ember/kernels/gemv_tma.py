"""One-row linear layers whose weights stream through the tensor memory accelerator (Hopper's bulk copy engine):
y[1, N] = x[1, K] @ W[N, K]^T with the fusions of ember.kernels.gemv (RMSNorm prologue, SiLU·mul of gate and up
rows, bias, residual), for the weight shapes where a measured table says it beats the register-streaming kernel.

Each program owns BLOCK_N output columns and walks all of K in BLOCK_K steps; W tiles [BLOCK_N, BLOCK_K] arrive in
shared memory by TMA, STAGES deep (Triton's pipeliner issues the copies and waits on their barriers), so a program
keeps STAGES - 1 tiles in flight without holding them in registers. On an H100 (`benches/gemv_sweep.py shapes`,
one row, weights out of L2, many calls in one CUDA graph) this read Llama-3.1-8B's fused gate_up at 99% of copy
bandwidth against 96% for the register-streaming kernel; for the small models' projections it was slower.

The arithmetic and roundings are those of the register-streaming kernel's unsplit path: x * norm weight rounded to
x's dtype, float32 products and sums, the sums scaled by 1/rms, bias, silu(gate) * up, residual, one rounding."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_options

__all__ = ["tma_applies", "gemv_tma"]

NUM_WARPS = 4


@triton.jit
def _gemv_tma_kernel(x_ptr, w_desc, bias_ptr, residual_ptr, norm_weight_ptr, out_ptr, N, K, eps,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, HAS_BIAS: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr = False):
    """Program n: out[0, n * BLOCK_N:(n + 1) * BLOCK_N]. GATED: W is [2N, K], gate rows then up rows. N and K are
    multiples of BLOCK_N and BLOCK_K (tma_applies)."""
    n0 = tl.program_id(0) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
    acc_up = acc
    sum_sq = tl.full((BLOCK_K,), 0.0, tl.float32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + cols)      # after the wait: it may come from the kernel before this one
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([n0, k])
        if GATED:
            w_up = w_desc.load([N + n0, k])
        x = tl.load(x_ptr + k + ks)
        xf = x.to(tl.float32)
        if NORM:
            sum_sq += xf * xf
            xf = (tl.load(norm_weight_ptr + k + ks).to(tl.float32) * xf).to(x.dtype).to(tl.float32)
        acc += w.to(tl.float32) * xf[None, :]
        if GATED:
            acc_up += w_up.to(tl.float32) * xf[None, :]
    y = tl.reduce(acc, 1, tl.standard._sum_combine)
    if GATED:
        up = tl.reduce(acc_up, 1, tl.standard._sum_combine)
    if NORM:
        rstd = tl.math.rsqrt(tl.reduce(sum_sq, 0, tl.standard._sum_combine) / K + eps)
        y = y * rstd
        if GATED:
            up = up * rstd
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols).to(tl.float32)
        if GATED:
            up += tl.load(bias_ptr + N + cols).to(tl.float32)
    if GATED:
        y = y / (1.0 + tl.exp(-y)) * up
    if HAS_RESIDUAL:
        y += residual.to(tl.float32)
    tl.store(out_ptr + cols, y.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty))


def tma_applies(x: torch.Tensor, weight: torch.Tensor, n: int, shape: tuple[int, int, int]) -> bool:
    """Whether one row of x against `weight` ([n, K], or [2n, K] gated) can take the TMA kernel with `shape`
    (BLOCK_N, BLOCK_K, STAGES): one row, a GPU with the bulk copy engine (sm_90 on) or the interpreter, a weight
    contiguous and 16-byte aligned, and N and K whole multiples of the blocks."""
    block_n, block_k, _ = shape
    if x.shape[0] != 1 or n % block_n or x.shape[1] % block_k or not weight.is_contiguous():
        return False
    if weight.data_ptr() % 16 or (weight.shape[1] * weight.element_size()) % 16:
        return False
    if x.device.type == "cuda":
        return torch.cuda.get_device_capability(x.device)[0] >= 9
    return x.device.type == "cpu"


def gemv_tma(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, shape: tuple[int, int, int], *,
             bias: torch.Tensor | None, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
             gated: bool, kernel) -> torch.Tensor:
    """Fill out [1, N] with the TMA kernel (checked by ember.kernels.gemv.gemv, and tma_applies); `kernel` wraps
    the JIT function for the device (the interpreter's copy on the CPU)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    block_n, block_k, stages = shape
    n = out.shape[1]
    desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    dummy = out
    kernel(_gemv_tma_kernel, x.device)[(n // block_n,)](
        x, desc, bias if bias is not None else dummy, residual if residual is not None else dummy,
        norm_weight if norm_weight is not None else dummy, out, n, x.shape[1], float(eps),
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, NORM=norm_weight is not None, GATED=gated, num_warps=NUM_WARPS,
        **pdl_options(x.device))
    return out
