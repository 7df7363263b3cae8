"""Launch parameters of the small-M GEMV (ember.kernels.gemv): tile shapes, K splits and warps for x [M, K] @
W[N, K]^T on a GPU of a given SM count.

Launch parameters come from `gemv_config`, a pure function of (M, N, K, SMs, element size), not from autotuning:
nothing is timed at run time, so the first call for a shape (before CUDA-graph capture, as the engine does) only
compiles, and every process picks the same kernels. At one row, a weight shape measured faster under another
(programs per SM, W tile bytes) on a GPU of the same SM count takes that pair from a stored table
(`gemv_routing.launch_shape`, gemv_shapes.json; e4m3 weights gemv_fp8_shapes.json); the others take the constants.
At 2..16 rows, a weight shape whose row count was measured faster under another (programs per SM, W tile bytes, tensor
or CUDA cores, the tensor-core kernel's stages and warps) takes those from the same documents' `row_shapes`
(`gemv_routing.row_shape`: the nearest measured row count of the same power-of-two bucket), written on an H100 by

    PYTHONPATH=. python benches/gemv_sweep.py shapes --rows 2 4 5 8 --configs llama-3.1-8b qwen3-0.6b --write
    PYTHONPATH=. python benches/gemv_sweep.py shapes --rows 2 4 5 8 --configs llama-3.1-8b qwen3-0.6b --fp8 --write

A shape and row count without an entry takes the constants, exactly as without the table.
"""

from __future__ import annotations

import functools

from ember.kernels.gemv_routing import launch_shape, row_shape

__all__ = ["CPU_SMS", "GEMV_MAX_M", "cached_config", "gemv_config"]

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
CPU_SMS = 4              # "SMs" under the interpreter: small test shapes still get several programs


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
    # a stored shape of this many rows (never when the caller picks the path): its pair, path, stages and warps
    row = row_shape(N * (2 if gated else 1), K, gated, num_sms, element_size, M) if M > 1 and use_dot is None else None
    if row is not None:
        programs_per_sm, tile_bytes, use_dot = row.programs_per_sm, row.w_tile_bytes, row.use_dot
    else:
        use_dot = M >= DOT_MIN_M if use_dot is None else use_dot
        programs_per_sm, tile_bytes = _launch_shape(M, N, K, num_sms, element_size, gated)
    vec = 16 // element_size                       # elements of one 16-byte load
    tile = tile_bytes // element_size              # elements of W per program per K step
    min_block_k = max(vec, MIN_BLOCK_K_BYTES // element_size)
    num_warps = (row.num_warps if row is not None else None) or NUM_WARPS
    num_stages = ((row.num_stages if row is not None else None) or DOT_NUM_STAGES) if use_dot else 1
    if not use_dot and max_block_k is None and tile > PRODUCT_REGS * 32 * num_warps:
        # a tile of more values than 4 warps' products hold (a stored 16 KiB shape of 1-byte weights): 8 warps keep
        # its bytes, where cutting it would leave the 8 KiB tile that the shape was measured against (block scales
        # cap a step at one block column, far below)
        num_warps *= 2
    threads = 32 * num_warps
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
                K_PER_SPLIT=steps_per_split * block_k, USE_DOT=use_dot, ACC_3D=acc_3d, num_warps=num_warps,
                num_stages=num_stages)


cached_config = functools.lru_cache(maxsize=None)(gemv_config)   # callers never mutate its dicts
