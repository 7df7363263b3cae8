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

Launch parameters come from `gemv_config`, a pure function of (M, N, K, SMs, element size), not from autotuning:
nothing is timed at run time, so the first call for a shape (before CUDA-graph capture, as the engine does) only
compiles, and every process picks the same kernels. At one row, a weight shape measured faster under another
(programs per SM, W tile bytes) on a GPU of the same SM count takes that pair from a stored table
(`gemv_routing.launch_shape`, gemv_shapes.json); the others take the constants.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ember.kernels.gemv_routing import launch_shape, tma_shape
from ember.kernels.gemv_tma import gemv_tma, tma_applies
from ember.kernels.interpret import interpreted
from ember.kernels.launcher import launcher
from ember.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_options

__all__ = ["DTYPES", "GEMV_MAX_M", "gemv", "gemv_config"]

GEMV_MAX_M = 16          # rows handled by the kernel; more go to F.linear
PROGRAMS_PER_SM = 2      # programs an SM gets a layer: 2 measured 5-10% faster than 4 or 8 over a decode step's
                         # chained projections at 1 row (benches/gemv_sweep.py tiles)
W_TILE_BYTES = 8192      # bytes of W one program loads per K step: 4 x 16-byte loads a thread at 4 warps
MAX_BLOCK_N = 16
DOT_MIN_M = 5            # tensor cores from this many rows: at 8 rows CUDA-core multiply-adds cost ~40% of the read
DOT_BLOCK = 16           # rows and columns of a tensor-core program (tl.dot's smallest portable tile)
ACC_3D_REGS = 32         # float32 accumulator elements a thread may hold for the deferred K reduction
PRODUCT_REGS = 64        # float32 products a thread may hold for a per-step K reduction
MIN_BLOCK_K_BYTES = 512  # one warp of 16-byte loads: K steps are not shrunk below this to divide K
NUM_WARPS = 4
DOT_NUM_STAGES = 3
MAX_SPLIT_K = 16
REDUCE_BLOCK = 256
CPU_SMS = 4              # "SMs" under the interpreter: small test shapes still get several programs
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# M, the step's token count, varies per step: out of the specialization key (Triton would compile M == 1 and M == 16
# apart); the strides, N, K and the K split are fixed per layer and keep their divisibility hints
@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, residual_ptr, norm_weight_ptr, out_ptr,
                 M, N, K, stride_xm, stride_wn, stride_rm, stride_om, k_per_split, eps, w_scale_ptr, stride_sn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_DOT: tl.constexpr, ACC_3D: tl.constexpr, EVEN_K: tl.constexpr, PARTIAL: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
                 DOT_IN_FP32: tl.constexpr, IEEE_DOT: tl.constexpr, PDL: tl.constexpr = False,
                 W_SCALE: tl.constexpr = 0, SCALE_BN: tl.constexpr = 1, SCALE_BK: tl.constexpr = 1):
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
    applied to each K step's W tile (a step lies within one block column: BLOCK_K divides SCALE_BK)."""
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

    if NORM and not PARTIAL:
        # one pass: the norm is a per-row scale, so sum x^2 beside the products and scale the sums at the end
        if USE_DOT:
            sum_sq = tl.full((BLOCK_M,), 0.0, tl.float32)
        elif ACC_3D:
            sum_sq = tl.full((BLOCK_M, BLOCK_N, BLOCK_K), 0.0, tl.float32)
        else:
            sum_sq = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    if NORM and PARTIAL:
        # a split sees part of K: every program first sums its rows' squares over all of K (x stays in L1/L2)
        if USE_DOT:
            sum_sq = tl.full((BLOCK_M,), 0.0, tl.float32)
        else:
            sum_sq = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k in range(0, K, BLOCK_K):
            if USE_DOT:
                xs = tl.load(x_ptrs + k, mask=(rows < M)[:, None] & ((k + ks)[None, :] < K), other=0.0)
                xs = xs.to(tl.float32)
                sum_sq += tl.reduce(xs * xs, 1, tl.standard._sum_combine)
            else:
                xs = tl.load(x_ptrs + k, mask=(k + ks)[None, None, :] < K, other=0.0).to(tl.float32)
                sum_sq += tl.reduce(xs * xs, 2, tl.standard._sum_combine)
        rstd = tl.math.rsqrt(sum_sq / K + eps)
        if USE_DOT:
            rstd = rstd[:, None]
        else:
            rstd = rstd[:, :, None]

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
        if NORM and PARTIAL:
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
    if NORM and not PARTIAL:
        if ACC_3D:
            sum_sq = tl.reduce(sum_sq, 2, tl.standard._sum_combine)
        rstd = tl.math.rsqrt(sum_sq / K + eps)
        if USE_DOT:
            rstd = rstd[:, None]
        acc = acc * rstd
        if GATED:
            acc_up = acc_up * rstd
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

def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _prev_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _launch_shape(M: int, N: int, K: int, num_sms: int, element_size: int, gated: bool) -> tuple[int, int]:
    """(programs per SM, W tile bytes) for one row of this weight shape: the measured table's entry
    (ember.kernels.gemv_routing.launch_shape) where it has one for this GPU's SM count, else the constants."""
    if M == 1:
        shape = launch_shape(N * (2 if gated else 1), K, gated, num_sms, element_size)
        if shape is not None:
            return shape
    return PROGRAMS_PER_SM, W_TILE_BYTES


def gemv_config(M: int, N: int, K: int, num_sms: int, element_size: int = 2,
                use_dot: bool | None = None, gated: bool = False, max_block_k: int | None = None) -> dict | None:
    """Launch parameters for x[M, K] @ W[N, K]^T on `num_sms` SMs, or None when M is outside 1..GEMV_MAX_M.
    `gated`: W holds N gate rows, then N up rows; a program reads both rows of each of its columns. `element_size`
    is W's (1 for fp8); `max_block_k` caps the K step (block-scaled fp8: one scale block column a step).

    Tensor cores from DOT_MIN_M rows (or as `use_dot` says), padded to 16 rows and 16 columns a program. Otherwise
    BLOCK_N is the largest power of two (<= 16) leaving PROGRAMS_PER_SM programs per SM. BLOCK_K makes a W tile of
    W_TILE_BYTES (smaller, BLOCK_N first, where the products would not fit in registers), halved while that divides
    K. K is split only when the column blocks alone leave SMs idle."""
    if not 1 <= M <= GEMV_MAX_M:
        return None
    use_dot = M >= DOT_MIN_M if use_dot is None else use_dot
    programs_per_sm, tile_bytes = _launch_shape(M, N, K, num_sms, element_size, gated)
    vec = 16 // element_size                       # elements of one 16-byte load
    tile = tile_bytes // element_size              # elements of W per program per K step
    min_block_k = max(vec, MIN_BLOCK_K_BYTES // element_size)
    threads = 32 * NUM_WARPS
    if use_dot:
        block_m, block_n = DOT_BLOCK, DOT_BLOCK
        block_k = tile // block_n
    else:
        block_m = _next_pow2(M)
        block_n = min(MAX_BLOCK_N, _prev_pow2(N // (programs_per_sm * num_sms)))
        block_k = tile // block_n
        if block_m * block_n * block_k > ACC_3D_REGS * threads:
            # summed every step: the [BLOCK_M, BLOCK_N, BLOCK_K] products must fit; keep the K step long
            w_elements = PRODUCT_REGS * threads // block_m
            block_k = min(block_k, max(min_block_k, w_elements // block_n))
            block_n = max(1, min(block_n, w_elements // block_k))
    block_k = max(DOT_BLOCK if use_dot else vec, min(block_k, _next_pow2(K)))
    while K % block_k and block_k // 2 >= min_block_k:
        block_k //= 2
    if gated and block_k // 2 >= (DOT_BLOCK if use_dot else min_block_k):
        # each column streams a gate and an up row: halve the K step to keep the tile's bytes and registers
        block_k //= 2
    if max_block_k is not None and block_k > max_block_k:
        # a shorter K step: widen the column block instead, so the step's tile keeps its bytes (the K split below
        # makes up for the fewer column blocks)
        if not use_dot:
            block_n = min(MAX_BLOCK_N, block_n * (block_k // max_block_k))
        block_k = max_block_k
    acc_3d = not use_dot and block_m * block_n * block_k <= ACC_3D_REGS * threads

    programs_n = -(-N // block_n)
    k_steps = -(-K // block_k)
    split_k = 1
    if programs_n < num_sms and k_steps > 1:
        split_k = min(MAX_SPLIT_K, k_steps, -(-programs_per_sm * num_sms // programs_n))
    steps_per_split = -(-k_steps // split_k)
    split_k = -(-k_steps // steps_per_split)       # no empty split
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                K_PER_SPLIT=steps_per_split * block_k, USE_DOT=use_dot, ACC_3D=acc_3d, num_warps=NUM_WARPS,
                num_stages=DOT_NUM_STAGES if use_dot else 1)


_cached_config = functools.lru_cache(maxsize=None)(gemv_config)   # callers never mutate its dicts


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _kernel(kernel, device: torch.device):
    return interpreted(kernel) if device.type == "cpu" else launcher(kernel)


def _check_scale(weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None,
                 gated: bool) -> None:
    """Raise a ValueError unless `scale` fits an fp8 `weight` (float32, contiguous, one per row or per block)."""
    if scale is None:
        if block is not None:
            raise ValueError("scale_block is given without weight_scale")
        return
    rows, k = weight.shape
    expected = (rows,) if block is None else (-(-rows // block[0]), -(-k // block[1]))
    if scale.dtype != torch.float32 or tuple(scale.shape) != expected or not scale.is_contiguous():
        raise ValueError(f"weight_scale must be a contiguous float32 {list(expected)}, got {scale.dtype} "
                         f"{list(scale.shape)}")
    if block is not None and gated and (rows // 2) % block[0]:
        raise ValueError(f"a gated block-scaled gemv needs gate rows ({rows // 2}) in whole blocks of {block[0]}")


def _scale_args(scale: torch.Tensor | None, block: tuple[int, int] | None) -> dict:
    """The kernel's fp8 constexprs (none for a weight in x's dtype, so its specializations keep their keys)."""
    if scale is None:
        return {}
    if block is None:
        return dict(W_SCALE=1)
    return dict(W_SCALE=2, SCALE_BN=block[0], SCALE_BK=block[1])


# ---- entry points --------------------------------------------------------------------------------------------

def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, config: dict | None = None, *,
         norm_weight: torch.Tensor | None = None, eps: float = 1e-6, gated: bool = False,
         out_dtype: torch.dtype | None = None, weight_scale: torch.Tensor | None = None,
         scale_block: tuple[int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) (+ residual [M, N]) -> [M, N] in x's dtype, always with the Triton
    kernel (interpreted for CPU tensors). `config` overrides `gemv_config`'s choice. out_dtype float32: the same
    values (rounded to x's dtype) stored as float32, as `F.linear(x, weight).float()` gives them, without a second
    kernel or a copy in x's dtype (the LM head's logits).

    norm_weight [K]: x is first RMS-normed with it (Llama form, `eps`). gated: weight is [2N, K], gate rows then up
    rows (bias [2N]), and the output is silu(gate) * up [M, N], before the residual is added.

    weight_scale: weight is float8_e4m3fn, dequantized in registers by float32 scales, one per row [rows of W], or
    one per block [ceil(rows / bn), ceil(K / bk)] with `scale_block` (bn, bk)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv needs x [M, K] and weight [N, K], got x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)}")
    M, K = x.shape
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated gemv needs an even number of weight rows (gate, then up), got {weight.shape[0]}")
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    if x.dtype not in DTYPES or weight.dtype != (x.dtype if weight_scale is None else torch.float8_e4m3fn):
        raise ValueError(f"gemv supports bfloat16, float16 and float32 with x and weight of one dtype, or a "
                         f"float8_e4m3fn weight with weight_scale; got x {x.dtype} and weight {weight.dtype}")
    _check_scale(weight, weight_scale, scale_block, gated)
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{weight.shape[0]}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if residual is not None and residual.shape != (M, N):
        raise ValueError(f"residual must be [{M}, {N}], got {tuple(residual.shape)}")
    if norm_weight is not None and norm_weight.shape != (K,):
        raise ValueError(f"norm_weight must be [{K}], got {tuple(norm_weight.shape)}")
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"out_dtype must be x's dtype ({x.dtype}) or torch.float32, got {out_dtype}")
    forced = config is not None
    if config is None:
        config = _cached_config(M, N, K, _num_sms(x.device), weight.element_size(), gated=gated,
                                max_block_k=scale_block[1] if scale_block else None)
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

    if M == 1 and not forced and weight_scale is None:
        shape = tma_shape(weight.shape[0], K, gated, _num_sms(x.device), x.element_size())
        if shape is not None and tma_applies(x, weight, N, shape):
            out = torch.empty(1, N, dtype=out_dtype or x.dtype, device=x.device)
            return gemv_tma(x, weight, out, shape, bias=bias, residual=residual, norm_weight=norm_weight, eps=eps,
                            gated=gated, kernel=_kernel)
    split_k = config["SPLIT_K"]
    # the K split's reduce rounds to its output's dtype alone: it writes x's dtype, converted after
    out = torch.empty(M, N, dtype=out_dtype if split_k == 1 and out_dtype else x.dtype, device=x.device)
    partial_cols = 2 * N if gated else N
    partial = out if split_k == 1 else torch.empty(split_k, M, partial_cols, dtype=torch.float32, device=x.device)
    cpu = x.device.type == "cpu"
    dummy = out     # pointer for absent bias/residual/norm weight; never read
    _kernel(_gemv_kernel, x.device)[(triton.cdiv(N, config["BLOCK_N"]), split_k)](
        x, weight, bias if bias is not None else dummy, residual if residual is not None else dummy,
        norm_weight if norm_weight is not None else dummy, partial,
        M, N, K, x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        config["K_PER_SPLIT"], float(eps), weight_scale if weight_scale is not None else dummy,
        weight_scale.stride(0) if weight_scale is not None else 0,
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
        USE_DOT=config["USE_DOT"], ACC_3D=config["ACC_3D"],
        EVEN_K=K % config["BLOCK_K"] == 0 and config["K_PER_SPLIT"] % config["BLOCK_K"] == 0,
        PARTIAL=split_k > 1, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        NORM=norm_weight is not None, GATED=gated,
        DOT_IN_FP32=cpu, IEEE_DOT=cpu or x.dtype == torch.float32,
        num_warps=config["num_warps"], num_stages=config["num_stages"], **pdl_options(x.device),
        **_scale_args(weight_scale, scale_block))
    if split_k > 1:
        _kernel(_split_k_reduce_kernel, x.device)[(triton.cdiv(N, REDUCE_BLOCK), M)](
            partial, bias if bias is not None else dummy, residual if residual is not None else dummy, out,
            M, N, residual.stride(0) if residual is not None else 0, out.stride(0),
            SPLIT_K=split_k, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, GATED=gated,
            BLOCK=REDUCE_BLOCK)
    return out if out_dtype is None else out.to(out_dtype)
