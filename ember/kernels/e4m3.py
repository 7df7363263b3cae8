"""Device functions for e4m3 (fp8) values in Triton kernels: the scaled, saturated value a kernel stores, and the
same rounded to e4m3's nearest value in float32 where the interpreter runs the kernel (CPU tensors): its float32 to
e4m3 conversion does not carry a rounding into the exponent; and int32 words of four e4m3 values widened to float16
a word at a time (`e4m3_words_to_f16`), where Triton's own widening takes each word apart byte by byte. Kernels
running interpreted need these helpers interpreted too (`ember.kernels.interpret.interpreted` sees to it)."""

from __future__ import annotations

import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)     # e4m3's largest finite value (ember.kernels.fp8.FP8_MAX)
AMAX_FLOOR = tl.constexpr(1e-12)   # an all-zero row's amax (ember.kernels.fp8.MIN_AMAX): a tiny scale, not 0 / 0
ROW_BLOCK = 1024    # elements a step and warps where a row's amax and sum of squares are taken (quantize_rows_fp8,
ROW_WARPS = 4       # round_rows, the word-wise GEMV's prologue): the same sums in the same order, so the same scales


@triton.jit
def max_combine(a, b):
    """tl.reduce's combine for an amax (tl.max is a library function an interpreted kernel cannot call)."""
    return tl.maximum(a, b)


@triton.jit
def round_to_e4m3(x):
    """float32 x within e4m3's range at e4m3's nearest value (ties to even), still float32: steps of
    2**(exponent - 3), 2**-9 below 2**-6."""
    a = tl.abs(x)
    step = ((tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6) + 124) << 23
            ).to(tl.float32, bitcast=True)
    t = a / step
    r = tl.floor(t + 0.5)
    a = tl.where(((r - t) == 0.5) & ((r.to(tl.int32) & 1) == 1), r - 1.0, r) * step
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -a, a)


@triton.jit
def scale_to_e4m3(x, scale, ROUND: tl.constexpr):
    """x / scale in float32, saturated at +-448 (the value a division of the torch reference stores as e4m3);
    with ROUND already at e4m3's nearest value (`round_to_e4m3`)."""
    q = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -E4M3_MAX), E4M3_MAX)
    if ROUND:
        q = round_to_e4m3(q)
    return q


@triton.jit
def to_f16_saturated(x):
    """x in float16, saturated at +-65504 (float16's largest finite value) rather than overflowing to inf: the
    queries' side of products with an e4m3 cache widened to float16."""
    return tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


# two `cvt.rn.f16x2.e4m3x2` on a word's halves: its four e4m3 values as float16, the lowest byte first
_E4M3X4_F16 = tl.constexpr("{ .reg .b16 lo, hi; .reg .b32 p, q; mov.b32 {lo, hi}, $4; "
                           "cvt.rn.f16x2.e4m3x2 p, lo; cvt.rn.f16x2.e4m3x2 q, hi; "
                           "mov.b32 {$0, $1}, p; mov.b32 {$2, $3}, q; }")


@triton.jit
def _e4m3_field(words, SHIFT: tl.constexpr):
    return ((words >> SHIFT) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def e4m3_words_to_f16(words, ASM: tl.constexpr):
    """int32 words [R, W] of four e4m3 values each (memory order: the lowest byte is the first value) -> float16
    [R, 4 W] in memory order, exactly (every e4m3 value is a float16). ASM: one inline-PTX block a word (two
    `cvt.rn.f16x2.e4m3x2`), for a GPU; otherwise Triton's conversions (shifts, masks, bitcasts: the interpreter)."""
    if ASM:
        a, b, c, d = tl.inline_asm_elementwise(_E4M3X4_F16, "=h,=h,=h,=h,r", [words],
                                               dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                               is_pure=True, pack=1)
    else:
        a = _e4m3_field(words, 0)
        b = _e4m3_field(words, 8)
        c = _e4m3_field(words, 16)
        d = _e4m3_field(words, 24)
    # [R, W, 2, 2]: [.., i, j] is value 2 i + j of the word, so the reshape keeps memory order. Triton 3.6 reads
    # the joins as halving the loaded width, so a product over the result takes the operand layout of 8-bit
    # loads: the one Triton's own widening of e4m3 bytes gets, the same values in the same MMA slots
    values = tl.join(tl.join(a, c), tl.join(b, d))
    return tl.reshape(values, (words.shape[0], words.shape[1] * 4))

