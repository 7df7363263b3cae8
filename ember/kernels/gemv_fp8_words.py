"""The one-row fp8 GEMV (ember.kernels.gemv_fp8's decode path) reading W and x a word at a time, for the instruction
count: y[1, N] = x[1, K] @ (W[N, K] e4m3 x row scales)^T, x in bfloat16 (rounded to e4m3 values by `round_rows`
with its row scale, or as it is), with the GEMV's bias, SiLU·mul and residual epilogues.

Why: a GEMV streaming 1-byte weights at an H100's or H200's copy bandwidth must finish each byte in about 8 issue
slots of an SM's 128 a cycle, and the general kernel (ember.kernels.gemv) spends 5.6-6.4 on sm_90 with Triton 3.6
(its loop in SASS, `python benches/experiments/gemv_sass.py`; this kernel 3.8-4.0): Triton widens e4m3 by taking
every loaded word apart byte by byte and packing the pairs again for `cvt.rn.f16x2.e4m3x2` (PRMT, LOP3 and IMAD
about 2.5 a byte), then widens x's bfloat16 values one at a time. Here W is loaded as int32 words (four e4m3 values)
and x as int64 words (four bfloat16 values at the same K), and one inline-PTX block a word widens them: two
`cvt.rn.f16x2.e4m3x2` on the word's halves and four `cvt.f32.f16`, and four bfloat16 -> float32 moves; the four
products of a word are added to a float32 accumulator per (column, word) and summed over K once after the loop.
Products of e4m3 values (and of an e4m3 value and a bfloat16 one) are exact in float32, so the results differ from
the general kernel's by the summation order only.

`ASM=False` widens the same words with Triton's own conversions (shifts, masks, bitcasts): what the interpreter runs
(CPU tests of the word layout), and a fallback. Applies to one row, bfloat16 x, row scales, K a multiple of the
K step and no K split (`applies`). The fp8 GEMV takes it wherever it applies, routed in
`ember.kernels.gemv.launch_gemv` after its checks; EMBER_FP8_WORDS=0 (or `set_enabled(False)`) keeps the general
kernel, for A/B runs (on an H200 it took Llama-3.1-8B's fp8 batch-1 decode from 294 to 341 tok/s).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ember.kernels.interpret import interpreted
from ember.kernels.launcher import launcher
from ember.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_options

__all__ = ["applies", "enabled", "gemv_fp8_words", "set_enabled"]

_enabled = os.environ.get("EMBER_FP8_WORDS", "1") != "0"

_E4M3X4 = tl.constexpr("{ .reg .b16 lo, hi; .reg .b32 p, q; .reg .f16 a, b, c, d; mov.b32 {lo, hi}, $4; "
           "cvt.rn.f16x2.e4m3x2 p, lo; cvt.rn.f16x2.e4m3x2 q, hi; mov.b32 {a, b}, p; mov.b32 {c, d}, q; "
           "cvt.f32.f16 $0, a; cvt.f32.f16 $1, b; cvt.f32.f16 $2, c; cvt.f32.f16 $3, d; }")
_BF16X4 = tl.constexpr("{ .reg .b16 a, b, c, d; mov.b64 {a, b, c, d}, $4; "
           "cvt.f32.bf16 $0, a; cvt.f32.bf16 $1, b; cvt.f32.bf16 $2, c; cvt.f32.bf16 $3, d; }")


def enabled() -> bool:
    return _enabled


def set_enabled(on: bool) -> None:
    """Take this kernel where it applies (True) or the general GEMV (False): a switch for A/B runs."""
    global _enabled
    _enabled = bool(on)


@triton.jit
def _field(v, SHIFT: tl.constexpr, E4M3: tl.constexpr):
    """The value in the bits from SHIFT of words, in float32 (Triton's conversions): an e4m3 byte, or a bfloat16
    half-word (the upper half of its float32)."""
    if E4M3:
        return ((v >> SHIFT) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return (((v >> SHIFT) & 0xFFFF) << 16).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _widen_word(v, E4M3: tl.constexpr, ASM: tl.constexpr):
    """int32 words of four e4m3 values (E4M3) or int64 words of four bfloat16 values, the lowest first -> four
    float32 tensors of v's shape."""
    STEP: tl.constexpr = 8 if E4M3 else 16
    if ASM:
        return tl.inline_asm_elementwise(_E4M3X4 if E4M3 else _BF16X4, "=r,=r,=r,=r,r" if E4M3 else "=r,=r,=r,=r,l",
                                         [v], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True,
                                         pack=1)
    else:
        return (_field(v, 0, E4M3), _field(v, STEP, E4M3), _field(v, 2 * STEP, E4M3),
                _field(v, 3 * STEP, E4M3))


@triton.jit
def _dot_words(acc, x_words, w_words, ASM: tl.constexpr):
    x0, x1, x2, x3 = _widen_word(x_words, False, ASM)
    w0, w1, w2, w3 = _widen_word(w_words, True, ASM)
    return acc + x0 * w0 + x1 * w1 + x2 * w2 + x3 * w3


@triton.jit
def _words_kernel(x_ptr, w_ptr, w_scale_ptr, act_scale_ptr, bias_ptr, residual_ptr, out_ptr, N, K,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                  HAS_RESIDUAL: tl.constexpr, ACT_SCALE: tl.constexpr, ASM: tl.constexpr,
                  PDL: tl.constexpr = False):
    """Program per BLOCK_N output columns: the K loop in steps of BLOCK_K values (BLOCK_K / 4 words); W rows past N
    re-read row N - 1 (never stored), as the general kernel does."""
    WORDS: tl.constexpr = BLOCK_K // 4
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    kw = tl.arange(0, WORDS)
    k_words = K // 4
    w_rows = tl.minimum(cols, N - 1).to(tl.int64)
    w_ptrs = w_ptr.to(tl.pointer_type(tl.int32)) + w_rows[:, None] * k_words + kw[None, :]      # [BLOCK_N, WORDS]
    # x as a [BLOCK_N, WORDS] broadcast (column stride 0): W's register layout, no shuffle through shared memory
    x_ptrs = x_ptr.to(tl.pointer_type(tl.int64)) + kw[None, :] + w_rows[:, None] * 0
    up_offset = N * k_words
    w_next = tl.load(w_ptrs)            # W never comes from the kernel before: its first tile before the PDL wait
    u_next = w_next
    if GATED:
        u_next = tl.load(w_ptrs + up_offset)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + cols, mask=cols < N, other=0.0)
    acc = tl.full((BLOCK_N, WORDS), 0.0, tl.float32)
    acc_up = acc
    for k in range(0, k_words, WORDS):
        w = w_next
        u = u_next
        next_ok = (k + WORDS + kw)[None, :] < k_words
        w_next = tl.load(w_ptrs + k + WORDS, mask=next_ok, other=0)
        if GATED:
            u_next = tl.load(w_ptrs + up_offset + k + WORDS, mask=next_ok, other=0)
        x = tl.load(x_ptrs + k)
        acc = _dot_words(acc, x, w, ASM)
        if GATED:
            acc_up = _dot_words(acc_up, x, u, ASM)
    out = tl.reduce(acc, 1, tl.standard._sum_combine)          # [BLOCK_N]
    if ACT_SCALE:
        out = out * tl.load(act_scale_ptr)
    out = out * tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    if GATED:
        up = tl.reduce(acc_up, 1, tl.standard._sum_combine)
        if ACT_SCALE:
            up = up * tl.load(act_scale_ptr)
        up = up * tl.load(w_scale_ptr + N + cols, mask=cols < N, other=0.0)
        if HAS_BIAS:
            up += tl.load(bias_ptr + N + cols, mask=cols < N, other=0.0).to(tl.float32)
        out = out / (1.0 + tl.exp(-out)) * up
    if HAS_RESIDUAL:
        out += residual.to(tl.float32)
    tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=cols < N)


def applies(x: torch.Tensor, weight: torch.Tensor, config: dict, residual: torch.Tensor | None) -> bool:
    """Whether this kernel takes the call: one bfloat16 row whose start is 8-byte aligned, a contiguous e4m3 weight
    with K a multiple of the config's K step (itself a multiple of 4), no K split, a contiguous residual row."""
    K = x.shape[1]
    return (x.shape[0] == 1 and x.dtype == torch.bfloat16 and x.stride(1) == 1 and x.data_ptr() % 8 == 0
            and weight.is_contiguous() and config["SPLIT_K"] == 1 and not config["USE_DOT"]
            and config["BLOCK_K"] % 4 == 0 and K % config["BLOCK_K"] == 0
            and (residual is None or residual.stride(1) == 1))


def gemv_fp8_words(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, config: dict,
                   act_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                   residual: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """x [1, K] bfloat16 @ (weight [N or 2N, K] e4m3 x weight_scale [rows])^T (x act_scale [1]) (+ bias) -> [1, N]
    bfloat16, gated as `gemv` is; `ember.kernels.gemv.launch_gemv` checks the arguments and `applies` first."""
    rows, K = weight.shape
    N = rows // 2 if gated else rows
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    cpu = x.device.type == "cpu"
    kernel = interpreted(_words_kernel) if cpu else launcher(_words_kernel)
    kernel[(triton.cdiv(N, config["BLOCK_N"]),)](
        x, weight, weight_scale, act_scale if act_scale is not None else weight_scale,
        bias if bias is not None else out, residual if residual is not None else out, out, N, K,
        BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], GATED=gated, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, ACT_SCALE=act_scale is not None, ASM=not cpu,
        num_warps=config["num_warps"], **pdl_options(x.device))
    return out
