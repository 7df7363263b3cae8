"""Device functions for e4m3 (fp8) values in Triton kernels: the scaled, saturated value a kernel stores, and the
same rounded to e4m3's nearest value in float32 where the interpreter runs the kernel (CPU tensors): its float32 to
e4m3 conversion does not carry a rounding into the exponent. Kernels running interpreted need these helpers
interpreted too (`ember.kernels.interpret.interpreted` sees to it)."""

from __future__ import annotations

import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)     # e4m3's largest finite value (ember.kernels.fp8.FP8_MAX)
AMAX_FLOOR = tl.constexpr(1e-12)   # an all-zero row's amax (ember.kernels.fp8.MIN_AMAX): a tiny scale, not 0 / 0


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
