"""Device functions both Triton attention backends' kernels call.

Not tl.cdiv, tl.max, tl.sum, tl.zeros: those are @triton.jit library functions that run in the interpreter only
when it was on before `import triton`, and the CPU path must work whatever the import order. tl.reduce with
Triton's own combine functions compiles to the same code, and the interpreter runs it with numpy.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def cdiv(a, b):
    return (a + b - 1) // b


@triton.jit
def reduce_max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def reduce_sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def tanh(x):
    # 1 - 2 / (e^{2x} + 1): overflow gives 1, underflow -1, and it needs only exp (which the interpreter has)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def query_block_rows(q_block, kv_head, q_len, context_len, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                     NUM_QUERIES_PER_KV: tl.constexpr):
    """The rows of a query tile that packs the G query heads sharing one KV head (GQA): row m is query token
    m // G of block `q_block` and query head kv_head * G + m % G. Returns (token in the request [BLOCK_M], query
    head [BLOCK_M], row holds a query [BLOCK_M], its position [BLOCK_M], the block's first and last position)."""
    rows = tl.arange(0, BLOCK_M)
    token_in_seq = q_block * BLOCK_Q + rows // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
    row_ok = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (token_in_seq < q_len)
    q_pos = context_len + token_in_seq
    min_q_pos = context_len + q_block * BLOCK_Q
    max_q_pos = context_len + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    return token_in_seq, head, row_ok, q_pos, min_q_pos, max_q_pos


@triton.jit
def kv_tile_bounds(min_q_pos, max_q_pos, window, TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr):
    """Tile indices (lo, a, b, hi) of a query block's KV range: [lo, a) masked by the window, [a, b) visible to
    every query of the block (unmasked), [b, hi) masked by causality.

    hi stops at the last tile the latest query can see, so fully masked tails are never loaded; with a sliding
    window lo starts at the first tile the earliest query can see (HF semantics: key j visible to query i iff
    i - window < j <= i)."""
    hi = cdiv(max_q_pos + 1, TILE_N)
    lo = min_q_pos * 0
    a = lo
    if USE_WINDOW:
        lo = tl.maximum(min_q_pos - window + 1, 0) // TILE_N
        all_see_from = tl.maximum(max_q_pos - window + 1, 0)  # first key inside every query's window
        a = tl.minimum(tl.maximum(cdiv(all_see_from, TILE_N), lo), hi)
    b = tl.minimum(tl.maximum((min_q_pos + 1) // TILE_N, a), hi)
    return lo, a, b, hi
