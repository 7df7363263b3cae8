"""Small-M linear layers: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) (+ residual[M, N]) for M <= 16, as a Triton
kernel that streams W once (`ember::linear`, in ember.kernels.linear_op, picks it over cuBLAS when it applies).

Decode reads every weight once per step, so these layers are bound by memory bandwidth; cuBLAS's small-M tiles
(64x8, split-K plus a reduce kernel) reach ~43% of it on an H100 for Qwen3-0.6B's projections at batch 1.

Kernel: each program owns BLOCK_N rows of W (output columns) for all M rows, padded to BLOCK_M, and walks K in
BLOCK_K steps, loading a tile of W that is contiguous along K (16-byte loads); accumulation is float32 and the
output, plus bias and residual in float32, is rounded once to x's dtype.
- M < DOT_MIN_M (1..4 rows, BLOCK_M the next power of two): CUDA-core products. W is loaded as [1, BLOCK_N,
  BLOCK_K] and x as a stride-0 broadcast [BLOCK_M, BLOCK_N, BLOCK_K], so both arrive in one register layout; a
  2-D tile broadcast to 3-D afterwards makes Triton move it through shared memory, with barriers, every step.
  The products are summed along K each step, or, when [BLOCK_M, BLOCK_N, BLOCK_K] fits in ACC_3D_REGS registers a
  thread, accumulated element-wise and summed once after the loop (no shuffles in the loop).
- M >= DOT_MIN_M: tl.dot on tensor cores, 16 x 16 a program (padding rows masked), W loaded as its transpose
  [BLOCK_K, BLOCK_N]; Triton pipelines these loads through shared memory (cp.async, DOT_NUM_STAGES). At 8 rows
  the CUDA-core multiply-adds alone would take ~40% as long as reading W at full bandwidth.

Fusions (`ember::fused_linear`, put in place by the compile passes in ember.graphs.passes): an RMSNorm prologue
(a per-row scale: the products take x * norm weight while the program sums x^2 beside them, and the sums are
scaled by 1/rms at the end; a K split first sums the squares over all of K), a SiLU·mul epilogue (W holds gate rows then up rows; each program reads both rows of its columns and writes
silu(gate) * up), and the residual epilogue. Decode then writes no normed activations and no [M, 2N] projection.

When N / BLOCK_N gives fewer programs than SMs, K is split over a second grid axis: each split writes float32
partials [SPLIT_K, M, N] and a small kernel sums them in a fixed order and applies bias/residual and the cast (no
zero-filled buffer, no atomics, so results are deterministic).

Launch parameters: ember.kernels.gemv_config. e4m3 weights: ember.kernels.gemv_fp8.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ember.kernels import gemv_fp8_words as words
from ember.kernels.e4m3 import AMAX_FLOOR, E4M3_MAX, max_combine, scale_to_e4m3
from ember.kernels.gemv_config import CPU_SMS, GEMV_MAX_M, cached_config, gemv_config
from ember.kernels.gemv_routing import tma_shape
from ember.kernels.gemv_tma import gemv_tma, tma_applies
from ember.kernels.interpret import interpreted
from ember.kernels.launcher import launcher
from ember.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_options

__all__ = ["DTYPES", "GEMV_MAX_M", "gemv", "gemv_config"]

REDUCE_BLOCK = 256
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# M, the step's token count, varies per step: out of the specialization key (Triton would compile M == 1 and M == 16
# apart); the strides, N, K and the K split are fixed per layer and keep their divisibility hints
@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, residual_ptr, norm_weight_ptr, out_ptr,
                 M, N, K, stride_xm, stride_wn, stride_rm, stride_om, k_per_split, eps, w_scale_ptr, stride_sn,
                 act_scale_ptr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_DOT: tl.constexpr, ACC_3D: tl.constexpr, EVEN_K: tl.constexpr, PARTIAL: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
                 DOT_IN_FP32: tl.constexpr, IEEE_DOT: tl.constexpr, PDL: tl.constexpr = False,
                 W_SCALE: tl.constexpr = 0, SCALE_BN: tl.constexpr = 1, SCALE_BK: tl.constexpr = 1,
                 ACT_QUANT: tl.constexpr = 0, EXACT_E4M3: tl.constexpr = False):
    """Program (n block, K split): out[:M, n block] over K range [split * k_per_split, + k_per_split).

    NORM: x is RMS-normed on the fly (Llama form). Unsplit, in one pass: x * norm weight streams into the products
    while its squares are summed, and the sums are scaled by each row's 1/rms at the end. Split over K, each program
    first sums its rows' squares over all of K and norms x as it loads it, rounding as the unfused ops round. GATED: W is [2N, K] (gate rows, then up rows) and the output silu(gate) * up [M, N].
    PARTIAL: out_ptr is float32 partials [SPLIT_K, M, N] ([SPLIT_K, M, 2N] when GATED), bias, activation and
    residual left to the reduce kernel.
    PDL: launched as a programmatic dependent: load the first W tile, wait for the previous kernel's results, then
    let the next kernel's programs start, so that launches and weight reads overlap the tail of the kernel before
    them.
    W_SCALE (fp8 W, dequantized in registers): 1, one float32 scale per W row, applied to the sums at the end;
    2, one per block of SCALE_BN rows and SCALE_BK columns ([N / SCALE_BN, K / SCALE_BK], row stride stride_sn),
    applied to each K step's W tile (a step lies within one block column: BLOCK_K divides SCALE_BK).
    ACT_QUANT (fp8 W with row scales, ember.kernels.gemv_fp8): x rounded to e4m3 as the many-row path rounds it, 1
    per row by its amax (a first pass over K in every program), 2 by the static scale at act_scale_ptr; 3, x
    already rounded (e4m3 values in x's dtype, the norm folded in) with each row's scale at act_scale_ptr [M],
    applied to the sums: the K loop is weight-only's."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    # not tl.sum/tl.zeros/tl.cdiv: those are @triton.jit library functions that the interpreted copy cannot call
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # columns past N (and, on CUDA cores, padding rows) re-read W row N - 1 / x row M - 1 instead of masking: the
    # loads stay unpredicated and vectorised, and those results are never stored
    x_rows = tl.minimum(rows, M - 1)
    w_rows = tl.minimum(cols, N - 1).to(tl.int64)
    up_offset = N * stride_wn          # GATED: the up row of a column sits N rows below its gate row
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    if USE_DOT:
        x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]            # [BLOCK_M, BLOCK_K]
        nw_ptrs = norm_weight_ptr + ks[None, :]                             # [1, BLOCK_K]
        w_ptrs = w_ptr + w_rows[None, :] * stride_wn + ks[:, None]          # [BLOCK_K, BLOCK_N]: W^T
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    else:
        # x as a [BLOCK_M, BLOCK_N, BLOCK_K] broadcast (column stride 0) gets W's register layout: a smaller x tile
        # would be moved into it through shared memory, with two barriers, every K step
        x_ptrs = x_ptr + x_rows[:, None, None] * stride_xm + ks[None, None, :] + w_rows[None, :, None] * 0
        nw_ptrs = norm_weight_ptr + ks[None, None, :] + w_rows[None, :, None] * 0      # [1, BLOCK_N, BLOCK_K]
        w_ptrs = w_ptr + w_rows[None, :, None] * stride_wn + ks[None, None, :]   # [1, BLOCK_N, BLOCK_K]
        if ACC_3D:
            acc = tl.full((BLOCK_M, BLOCK_N, BLOCK_K), 0.0, tl.float32)
        else:
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_up = acc

    # W never comes from the kernel before this one: on CUDA cores the first W tile is loaded before the PDL wait,
    # so the weight stream starts while that kernel drains, and every step loads the next tile before it multiplies
    # (two tiles in registers, one in flight: the only pipelining a load that feeds no tl.dot gets)
    if not USE_DOT:
        # masked past the program's K range; the mask is constant over 16 elements (k_end's divisibility), so the
        # loads stay 16 bytes wide
        next_ok = ((k_begin + ks) < k_end)[None, None, :]
        w_next = tl.load(w_ptrs + k_begin, mask=next_ok, other=0.0)
        w_up_next = w_next
        if GATED:
            w_up_next = tl.load(w_ptrs + up_offset + k_begin, mask=next_ok, other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    out_mask = (rows < M)[:, None] & (cols < N)[None, :]
    if HAS_RESIDUAL and not PARTIAL:
        # loaded now, so its latency hides behind the K loop's instead of adding to the program's tail (after the
        # PDL wait: the residual may come from the kernel before this one)
        residual = tl.load(residual_ptr + rows[:, None] * stride_rm + cols[None, :], mask=out_mask, other=0.0)

    if NORM and not PARTIAL and not ACT_QUANT:
        # one pass: the norm is a per-row scale, so sum x^2 beside the products and scale the sums at the end
        if USE_DOT:
            sum_sq = tl.full((BLOCK_M,), 0.0, tl.float32)
        elif ACC_3D:
            sum_sq = tl.full((BLOCK_M, BLOCK_N, BLOCK_K), 0.0, tl.float32)
        else:
            sum_sq = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    if (NORM and PARTIAL) or ACT_QUANT == 1 or ACT_QUANT == 2:
        # a split sees part of K, and quantizing x needs its rows' amax: every program first sums its rows' squares
        # and takes their amax over all of K (x stays in L1/L2)
        if USE_DOT:
            sum_sq = tl.full((BLOCK_M,), 0.0, tl.float32)
        else:
            sum_sq = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        amax = sum_sq
        for k in range(0, K, BLOCK_K):
            if USE_DOT:
                k_ok = (k + ks)[None, :] < K
                xs = tl.load(x_ptrs + k, mask=(rows < M)[:, None] & k_ok, other=0.0).to(tl.float32)
                if NORM:
                    sum_sq += tl.reduce(xs * xs, 1, tl.standard._sum_combine)
            else:
                k_ok = (k + ks)[None, None, :] < K
                xs = tl.load(x_ptrs + k, mask=k_ok, other=0.0).to(tl.float32)
                if NORM:
                    sum_sq += tl.reduce(xs * xs, 2, tl.standard._sum_combine)
            if ACT_QUANT == 1:
                if NORM:
                    xs = xs * tl.load(nw_ptrs + k, mask=k_ok, other=0.0).to(tl.float32)
                if USE_DOT:
                    amax = tl.maximum(amax, tl.reduce(tl.abs(xs), 1, max_combine))
                else:
                    amax = tl.maximum(amax, tl.reduce(tl.abs(xs), 2, max_combine))
        rstd_rows = tl.math.rsqrt(sum_sq / K + eps)        # [BLOCK_M] (tensor cores) or [BLOCK_M, BLOCK_N]
        if ACT_QUANT == 1:
            x_scale_rows = tl.maximum(amax, AMAX_FLOOR) / E4M3_MAX
        else:
            x_scale_rows = tl.load(act_scale_ptr) + amax * 0.0 if ACT_QUANT else amax
        if USE_DOT:
            rstd = rstd_rows[:, None]
            x_scale = x_scale_rows[:, None]
        else:
            rstd = rstd_rows[:, :, None]
            x_scale = x_scale_rows[:, :, None]

    for k in range(k_begin, k_end, BLOCK_K):
        if USE_DOT:
            # padding rows masked, not re-read: at M = 1 they would be 15 of the 16 rows loaded into shared memory
            if EVEN_K:
                x = tl.load(x_ptrs + k, mask=(rows < M)[:, None], other=0.0)
                w = tl.load(w_ptrs + k)
                if GATED:
                    w_up = tl.load(w_ptrs + up_offset + k)
                if NORM:
                    nw = tl.load(nw_ptrs + k)
            else:
                k_ok = (k + ks) < k_end
                x = tl.load(x_ptrs + k, mask=(rows < M)[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs + k, mask=k_ok[:, None], other=0.0)
                if GATED:
                    w_up = tl.load(w_ptrs + up_offset + k, mask=k_ok[:, None], other=0.0)
                if NORM:
                    nw = tl.load(nw_ptrs + k, mask=k_ok[None, :], other=0.0)
        else:
            w = w_next
            w_up = w_up_next
            k_next = k + BLOCK_K
            next_ok = ((k_next + ks) < k_end)[None, None, :]
            w_next = tl.load(w_ptrs + k_next, mask=next_ok, other=0.0)
            if GATED:
                w_up_next = tl.load(w_ptrs + up_offset + k_next, mask=next_ok, other=0.0)
            if EVEN_K:
                x = tl.load(x_ptrs + k)
                if NORM:
                    nw = tl.load(nw_ptrs + k)
            else:
                k_ok = (k + ks)[None, None, :] < k_end
                x = tl.load(x_ptrs + k, mask=k_ok, other=0.0)
                if NORM:
                    nw = tl.load(nw_ptrs + k, mask=k_ok, other=0.0)
        if ACT_QUANT == 1 or ACT_QUANT == 2:
            # the values the many-row path quantizes: x * norm weight by its amax (1/rms applied to the sums), or
            # the normed x by the static scale
            xf = x.to(tl.float32)
            if NORM:
                xf = xf * nw.to(tl.float32)
                if ACT_QUANT == 2:
                    xf = xf * rstd
            q = scale_to_e4m3(xf, x_scale, EXACT_E4M3)
            if not EXACT_E4M3:
                q = q.to(tl.float8e4nv)
            x = q.to(x.dtype)             # e4m3 values are exact in bfloat16, float16 and float32
        elif NORM and PARTIAL:
            # the unfused RMSNorm rounds twice: the normed value to x's dtype, then its product with the weight
            x = (x.to(tl.float32) * rstd).to(x.dtype)
            x = (nw.to(tl.float32) * x.to(tl.float32)).to(x.dtype)
        elif NORM:
            xf = x.to(tl.float32)
            if USE_DOT:
                sum_sq += tl.reduce(xf * xf, 1, tl.standard._sum_combine)
            elif ACC_3D:
                sum_sq += xf * xf
            else:
                sum_sq += tl.reduce(xf * xf, 2, tl.standard._sum_combine)
            x = (nw.to(tl.float32) * xf).to(x.dtype)
        if W_SCALE == 2:
            # this K step's block column: a scale per W row of the tile (gate and up rows apart)
            s_ptrs = w_scale_ptr + (w_rows // SCALE_BN) * stride_sn + k // SCALE_BK
            if USE_DOT:
                w = w.to(tl.float32) * tl.load(s_ptrs)[None, :]
                if GATED:
                    w_up = w_up.to(tl.float32) * tl.load(s_ptrs + (N // SCALE_BN) * stride_sn)[None, :]
            else:
                w = w.to(tl.float32) * tl.load(s_ptrs)[None, :, None]
                if GATED:
                    w_up = w_up.to(tl.float32) * tl.load(s_ptrs + (N // SCALE_BN) * stride_sn)[None, :, None]
        if USE_DOT:
            if W_SCALE and not DOT_IN_FP32:
                # tensor cores take both operands in x's dtype: fp8 widens exactly, a block-scaled tile rounds once
                w = w.to(x.dtype)
                if GATED:
                    w_up = w_up.to(x.dtype)
            if DOT_IN_FP32:
                # the interpreter's tl.dot multiplies bfloat16 bit patterns as integers
                x = x.to(tl.float32)
                w = w.to(tl.float32)
                if GATED:
                    w_up = w_up.to(tl.float32)
            if IEEE_DOT:
                acc = tl.dot(x, w, acc, input_precision="ieee")
                if GATED:
                    acc_up = tl.dot(x, w_up, acc_up, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
                if GATED:
                    acc_up = tl.dot(x, w_up, acc_up)
        elif ACC_3D:
            acc += x.to(tl.float32) * w.to(tl.float32)
            if GATED:
                acc_up += x.to(tl.float32) * w_up.to(tl.float32)
        else:
            acc += tl.reduce(x.to(tl.float32) * w.to(tl.float32), 2, tl.standard._sum_combine)
            if GATED:
                acc_up += tl.reduce(x.to(tl.float32) * w_up.to(tl.float32), 2, tl.standard._sum_combine)
    if ACC_3D:
        acc = tl.reduce(acc, 2, tl.standard._sum_combine)    # [BLOCK_M, BLOCK_N]
        if GATED:
            acc_up = tl.reduce(acc_up, 2, tl.standard._sum_combine)
    if NORM and not PARTIAL and not ACT_QUANT:
        if ACC_3D:
            sum_sq = tl.reduce(sum_sq, 2, tl.standard._sum_combine)
        rstd = tl.math.rsqrt(sum_sq / K + eps)
        if USE_DOT:
            rstd = rstd[:, None]
        acc = acc * rstd
        if GATED:
            acc_up = acc_up * rstd
    if ACT_QUANT:
        # x's scale per row, times 1/rms where the quantized values are of x * norm weight
        if ACT_QUANT == 3:
            row_scale = tl.load(act_scale_ptr + x_rows)[:, None]
        else:
            row_scale = x_scale_rows
            if NORM and ACT_QUANT == 1:
                row_scale = row_scale * rstd_rows
            if USE_DOT:
                row_scale = row_scale[:, None]
        acc = acc * row_scale
        if GATED:
            acc_up = acc_up * row_scale
    if W_SCALE == 1:
        # the row scales are per output column of this program (before a K split's partial sums, which add up)
        acc = acc * tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(w_scale_ptr + N + cols, mask=cols < N, other=0.0)[None, :]

    if PARTIAL:
        partial_cols = 2 * N if GATED else N
        partial_ptrs = out_ptr + (split * M + rows[:, None]) * partial_cols + cols[None, :]
        tl.store(partial_ptrs, acc, mask=out_mask)
        if GATED:
            tl.store(partial_ptrs + N, acc_up, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(bias_ptr + N + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if HAS_RESIDUAL:
            acc += residual.to(tl.float32)
        # rounded to x's dtype first, as the layer in that dtype rounds: a float32 output (logits) holds those values
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
                 acc.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["M"])
def _split_k_reduce_kernel(partial_ptr, bias_ptr, residual_ptr, out_ptr, M, N, stride_rm, stride_om,
                           SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                           GATED: tl.constexpr, BLOCK: tl.constexpr):
    """Program (column block, row): out = sum over splits of partial[:, row, cols] (+ bias), silu(gate) * up when
    GATED, (+ residual)."""
    row = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    partial_cols = 2 * N if GATED else N
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    acc_up = tl.full((BLOCK,), 0.0, tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + (split * M + row) * partial_cols + cols, mask=ok, other=0.0)
        if GATED:
            acc_up += tl.load(partial_ptr + (split * M + row) * partial_cols + N + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        if GATED:
            acc_up += tl.load(bias_ptr + N + cols, mask=ok, other=0.0).to(tl.float32)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + row * stride_rm + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ---- launch parameters ---------------------------------------------------------------------------------------

@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _kernel(kernel, device: torch.device):
    return interpreted(kernel) if device.type == "cpu" else launcher(kernel)


# ---- entry points --------------------------------------------------------------------------------------------

def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, config: dict | None = None, *,
         norm_weight: torch.Tensor | None = None, eps: float = 1e-6, gated: bool = False,
         out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) (+ residual [M, N]) -> [M, N] in x's dtype, always with the Triton
    kernel (interpreted for CPU tensors). `config` overrides `gemv_config`'s choice. out_dtype float32: the same
    values (rounded to x's dtype) stored as float32, as `F.linear(x, weight).float()` gives them, without a second
    kernel or a copy in x's dtype (the LM head's logits).

    norm_weight [K]: x is first RMS-normed with it (Llama form, `eps`). gated: weight is [2N, K], gate rows then up
    rows (bias [2N]), and the output is silu(gate) * up [M, N], before the residual is added. e4m3 weights go
    through `ember.kernels.gemv_fp8.gemv_fp8`. out: a contiguous [M, N] of x's dtype to write instead of a new
    tensor; it may be the residual itself (each program reads its residual tile before it stores that tile)."""
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"gemv supports bfloat16, float16 and float32 with x and weight of one dtype (e4m3 "
                         f"weights: ember.kernels.gemv_fp8); got x {x.dtype} and weight {weight.dtype}")
    return launch_gemv(x, weight, bias, residual, config, norm_weight, eps, gated, out_dtype, out=out)


def launch_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                config: dict | None, norm_weight: torch.Tensor | None, eps: float, gated: bool,
                out_dtype: torch.dtype | None, weight_scale: torch.Tensor | None = None,
                act_scale: torch.Tensor | None = None, max_block_k: int | None = None,
                out: torch.Tensor | None = None, **fp8_constexprs) -> torch.Tensor:
    """`gemv` after its dtype check; `weight_scale`, `act_scale` and the fp8 constexprs (W_SCALE, SCALE_BN,
    SCALE_BK, ACT_QUANT) come from `gemv_fp8`, which has checked them."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv needs x [M, K] and weight [N, K], got x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)}")
    M, K = x.shape
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated gemv needs an even number of weight rows (gate, then up), got {weight.shape[0]}")
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{weight.shape[0]}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if residual is not None and residual.shape != (M, N):
        raise ValueError(f"residual must be [{M}, {N}], got {tuple(residual.shape)}")
    if norm_weight is not None and norm_weight.shape != (K,):
        raise ValueError(f"norm_weight must be [{K}], got {tuple(norm_weight.shape)}")
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"out_dtype must be x's dtype ({x.dtype}) or torch.float32, got {out_dtype}")
    if out is not None and (out.shape != (M, N) or out.dtype != x.dtype or not out.is_contiguous()
                            or out_dtype not in (None, x.dtype)):
        raise ValueError(f"out must be a contiguous [{M}, {N}] {x.dtype} tensor, got {tuple(out.shape)} {out.dtype}"
                         f"{'' if out.is_contiguous() else ' (not contiguous)'}")
    if out is not None and residual is not None and residual.stride(1) != 1:
        raise ValueError("out cannot be given with a residual whose rows are not contiguous")
    forced = config is not None
    if config is None:
        config = cached_config(M, N, K, _num_sms(x.device), weight.element_size(), gated=gated,
                                max_block_k=max_block_k)
        if config is None:
            raise ValueError(f"gemv handles 1 to {GEMV_MAX_M} rows, got M={M}; use torch.nn.functional.linear")
    elif not 1 <= M <= config["BLOCK_M"]:
        raise ValueError(f"config BLOCK_M {config['BLOCK_M']} cannot hold M={M} rows")
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    bias = bias.contiguous() if bias is not None else None
    norm_weight = norm_weight.contiguous() if norm_weight is not None else None

    if (fp8_constexprs.get("W_SCALE") == 1 and fp8_constexprs.get("ACT_QUANT", 0) in (0, 3) and norm_weight is None
            and out is None and out_dtype in (None, x.dtype) and words.enabled()
            and words.applies(x, weight, config, residual)):
        # one row of e4m3 weights, weight-only or on `round_rows`' output (ACT_QUANT 3), a word at a time
        # (ember.kernels.gemv_fp8_words)
        return words.gemv_fp8_words(x, weight, weight_scale, config, act_scale, bias, residual, gated)
    if M == 1 and not forced and weight_scale is None:
        shape = tma_shape(weight.shape[0], K, gated, _num_sms(x.device), x.element_size())
        if shape is not None and tma_applies(x, weight, N, shape):
            if out is None:
                out = torch.empty(1, N, dtype=out_dtype or x.dtype, device=x.device)
            return gemv_tma(x, weight, out, shape, bias=bias, residual=residual, norm_weight=norm_weight, eps=eps,
                            gated=gated, kernel=_kernel)
    split_k = config["SPLIT_K"]
    # the K split's reduce rounds to its output's dtype alone: it writes x's dtype, converted after
    if out is None:
        out = torch.empty(M, N, dtype=out_dtype if split_k == 1 and out_dtype else x.dtype, device=x.device)
    partial_cols = 2 * N if gated else N
    partial = out if split_k == 1 else torch.empty(split_k, M, partial_cols, dtype=torch.float32, device=x.device)
    cpu = x.device.type == "cpu"
    dummy = out     # pointer for absent bias/residual/norm weight/scales; never read
    _kernel(_gemv_kernel, x.device)[(triton.cdiv(N, config["BLOCK_N"]), split_k)](
        x, weight, bias if bias is not None else dummy, residual if residual is not None else dummy,
        norm_weight if norm_weight is not None else dummy, partial,
        M, N, K, x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        config["K_PER_SPLIT"], float(eps), weight_scale if weight_scale is not None else dummy,
        weight_scale.stride(0) if weight_scale is not None else 0, act_scale if act_scale is not None else dummy,
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
        USE_DOT=config["USE_DOT"], ACC_3D=config["ACC_3D"],
        EVEN_K=K % config["BLOCK_K"] == 0 and config["K_PER_SPLIT"] % config["BLOCK_K"] == 0,
        PARTIAL=split_k > 1, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        NORM=norm_weight is not None, GATED=gated,
        DOT_IN_FP32=cpu, IEEE_DOT=cpu or x.dtype == torch.float32,
        num_warps=config["num_warps"], num_stages=config["num_stages"], **pdl_options(x.device),
        **fp8_constexprs, **(dict(EXACT_E4M3=True) if cpu and fp8_constexprs.get("ACT_QUANT") else {}))
    if split_k > 1:
        _kernel(_split_k_reduce_kernel, x.device)[(triton.cdiv(N, REDUCE_BLOCK), M)](
            partial, bias if bias is not None else dummy, residual if residual is not None else dummy, out,
            M, N, residual.stride(0) if residual is not None else 0, out.stride(0),
            SPLIT_K=split_k, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, GATED=gated,
            BLOCK=REDUCE_BLOCK)
    return out if out_dtype is None else out.to(out_dtype)
