"""The Triton kernel of `ngram_device` (imported only when a step runs it)."""

import triton
import triton.language as tl


# tl.reduce with combine functions of this module, not tl.max/tl.min: the library's @triton.jit functions cannot be
# called from the interpreted copy the CPU tests run
@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min(a, b):
    return tl.minimum(a, b)

@triton.jit(do_not_specialize=["k", "n_min", "lookback"])
def ngram_search_kernel(token_ids, token_stride, rows, counts, latest_out, earliest_out, k, n_min, lookback,
                        N_MAX: tl.constexpr, BLOCK: tl.constexpr, NONE: tl.constexpr):
    # program (r, c): request r's matches of its last n = n_min + c tokens; a window starting at i matches
    # when tokens i .. i + n - 1 equal the last n, and i + n < count (a token follows it)
    r = tl.program_id(0)
    c = tl.program_id(1)
    num_c = tl.num_programs(1)
    n = n_min + c
    base = token_ids + tl.load(rows + r) * token_stride
    count = tl.load(counts + r)
    lo = tl.maximum(count - lookback, 0)
    hi = tl.where(count - lo >= n + 1, count - n, lo)          # window starts lo .. hi - 1
    offs = tl.arange(0, BLOCK)
    latest = tl.full([BLOCK], -1, tl.int64)
    earliest = tl.full([BLOCK], NONE, tl.int64)
    for off in range(lo, hi, BLOCK):
        i = off + offs
        m = i < hi
        for j in tl.static_range(N_MAX):
            t = tl.load(base + tl.minimum(i + j, count - 1), mask=m, other=0)
            s = tl.load(base + tl.maximum(tl.minimum(count - n + j, count - 1), 0))   # (unused past n)
            m = tl.where(n <= j, m, m & (t == s))
        latest = tl.maximum(latest, tl.where(m & (i + n + k <= count), i, -1))
        earliest = tl.minimum(earliest, tl.where(m, i, NONE))
    tl.store(latest_out + r * num_c + c, tl.reduce(latest, 0, _max))
    tl.store(earliest_out + r * num_c + c, tl.reduce(earliest, 0, _min))

