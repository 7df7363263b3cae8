"""`ember::qk_norm_rope`: per-head RMSNorm of q and k, then rotary (rotate-half layout, whole head), as one kernel
that reads q and k where the qkv projection wrote them and writes each contiguous. The compile pass
`qk_norm_rope` (ember.graphs.passes) puts it where a model norms and rotates q and k as one [T, Hq + Hkv, D]
tensor (Qwen3); Inductor made four kernels of that (the norm's reduction, the rotation, a copy of q, a copy of k).

Arithmetic and roundings follow the model's ops: normalise in float32, round to the dtype, scale by the weight
(rounded), then x1*cos - x2*sin and x2*cos + x1*sin with cos/sin rounded to the dtype and each product rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.gemv import _kernel
from ember.kernels.library import define, register_fake
from ember.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_options

# Steps of at least this many tokens (prefills) take the kernel that handles ROWS_BLOCK tokens a program; smaller
# ones (every decode bucket) one token a program, as a PDL dependent. A 16k-token prefill of the Qwen3-0.6B config
# spent 13 ms of its 100 ms on one program a (token, head), about 7x its bytes at copy bandwidth.
ROWS_MIN_TOKENS = 1024
ROWS_BLOCK = 32


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
                         stride_q, stride_k, stride_cos, stride_sin, eps,
                         HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr = False,
                         NORM: tl.constexpr = True):
    """Program (token, head): head h of [q heads | k heads], read at q_ptr + t * stride_q + h * 2 * HALF (or the
    same in k for h - HQ). NORM off: rotary only (no weights read). PDL: launched as a programmatic dependent
    (`ember.kernels.pdl`)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HALF)
    is_q = h < HQ
    # the weights and the rotary rows (gathered before the step's first layer) before the PDL wait, q and k after
    w_ptr = tl.where(is_q, q_weight_ptr, k_weight_ptr)
    if NORM:
        w1 = tl.load(w_ptr + d).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
    cos = tl.load(cos_ptr + t * stride_cos + d)
    sin = tl.load(sin_ptr + t * stride_sin + d)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    src = tl.where(is_q, q_ptr + t * stride_q + h * (2 * HALF), k_ptr + t * stride_k + (h - HQ) * (2 * HALF))
    x1 = tl.load(src + d)
    x2 = tl.load(src + HALF + d)
    n1 = x1.to(tl.float32)
    n2 = x2.to(tl.float32)
    if NORM:
        sum_sq = tl.reduce(n1 * n1 + n2 * n2, 0, tl.standard._sum_combine)
        n1, n2 = _scale(n1, n2, w1, w2, tl.math.rsqrt(sum_sq / (2 * HALF) + eps), x1.dtype)
    out1, out2 = _rotate(n1, n2, cos, sin, x1.dtype)
    dst = tl.where(is_q, q_out_ptr + (t * HQ + h) * (2 * HALF), k_out_ptr + (t * HKV + h - HQ) * (2 * HALF))
    tl.store(dst + d, out1)
    tl.store(dst + HALF + d, out2)


@triton.jit
def _scale(n1, n2, w1, w2, rstd, dtype):
    """The norm's roundings: x * rstd rounded to the dtype, times the weight, rounded again (float32 values)."""
    n1 = (w1 * (n1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    n2 = (w2 * (n2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return n1, n2


@triton.jit
def _rotate(n1, n2, cos, sin, dtype):
    """Rotate-half with cos/sin rounded to the dtype and each product rounded; the two halves in the dtype."""
    cos = cos.to(dtype).to(tl.float32)
    sin = sin.to(dtype).to(tl.float32)
    out1 = (n1 * cos).to(dtype).to(tl.float32) - (n2 * sin).to(dtype).to(tl.float32)
    out2 = (n2 * cos).to(dtype).to(tl.float32) + (n1 * sin).to(dtype).to(tl.float32)
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def _qk_norm_rope_rows_kernel(q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
                              num_tokens, stride_q, stride_k, stride_cos, stride_sin, eps,
                              HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                              NORM: tl.constexpr = True):
    """Program (block of BLOCK_T tokens, head): the same arithmetic as `_qk_norm_rope_kernel` on [BLOCK_T, HALF]
    tiles, for long prefills, where one program a (token, head) spent more time starting than moving its 512
    bytes. The rotation's roundings are the same; the norm's sum of squares may add in another order."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)     # [BT]
    h = tl.program_id(1)
    d = tl.arange(0, HALF)[None, :]                                        # [1, HALF]
    rows = (t < num_tokens)[:, None]                                       # [BT, 1]
    t = t[:, None]
    is_q = h < HQ
    cos = tl.load(cos_ptr + t * stride_cos + d, mask=rows, other=0.0)
    sin = tl.load(sin_ptr + t * stride_sin + d, mask=rows, other=0.0)
    src = tl.where(is_q, q_ptr + t * stride_q + h * (2 * HALF), k_ptr + t * stride_k + (h - HQ) * (2 * HALF))
    x1 = tl.load(src + d, mask=rows, other=0.0)
    x2 = tl.load(src + HALF + d, mask=rows, other=0.0)
    n1 = x1.to(tl.float32)
    n2 = x2.to(tl.float32)
    if NORM:
        w_ptr = tl.where(is_q, q_weight_ptr, k_weight_ptr)
        w1 = tl.load(w_ptr + d).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
        sum_sq = tl.reduce(n1 * n1 + n2 * n2, 1, tl.standard._sum_combine)[:, None]     # [BT, 1]
        n1, n2 = _scale(n1, n2, w1, w2, tl.math.rsqrt(sum_sq / (2 * HALF) + eps), x1.dtype)
    out1, out2 = _rotate(n1, n2, cos, sin, x1.dtype)
    dst = tl.where(is_q, q_out_ptr + (t * HQ + h) * (2 * HALF), k_out_ptr + (t * HKV + h - HQ) * (2 * HALF))
    tl.store(dst + d, out1, mask=rows)
    tl.store(dst + HALF + d, out2, mask=rows)


def qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps, head_size: int | None = None):
    """The model's ops: q [T, Hq*D], k [T, Hkv*D] -> (q [T, Hq, D], k [T, Hkv, D]), normed (unless the weights are
    None; then `head_size` gives D) and rotated."""
    d = q_weight.shape[0] if q_weight is not None else head_size

    def one(x, weight):
        x = x.unflatten(-1, (-1, d))
        if weight is not None:
            x32 = x.float()
            x = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).contiguous()

    return one(q, q_weight), one(k, k_weight)


def _kernel_applies(q, k, head_size: int, cos, sin) -> bool:
    """Heads contiguous in each token's row of q and of k, a power-of-two size; cos/sin rows of D/2."""
    d = head_size
    return (q.stride(1) == 1 and k.stride(1) == 1 and d >= 2 and d & (d - 1) == 0 and q.shape[0] > 0
            and cos.shape[-1] * 2 == d and cos.stride(1) == 1 and sin.stride(1) == 1)


def norm_rope_qk(q, k, q_weight, k_weight, cos, sin, eps, head_size: int):
    """q [T, Hq*D], k [T, Hkv*D] -> (q [T, Hq, D], k [T, Hkv, D]): per-head RMSNorm (weights None: none) and
    rotary, by the kernel where it applies (CUDA), else by the reference ops."""
    if q.device.type == "cpu" or not _kernel_applies(q, k, head_size, cos, sin):
        return qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps, head_size)
    return qk_norm_rope_triton(q, k, q_weight, k_weight, cos, sin, eps, head_size)


@define("qk_norm_rope")
def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq*D], k [T, Hkv*D], weights [D], cos/sin [T, D/2] float32 -> q [T, Hq, D], k [T, Hkv, D]."""
    return norm_rope_qk(q, k, q_weight, k_weight, cos, sin, eps, q_weight.shape[0])


def qk_norm_rope_triton(q, k, q_weight, k_weight, cos, sin, eps, head_size: int | None = None):
    """The kernel (interpreted for CPU tensors); q and k as `_kernel_applies` requires (each may be a slice of the
    qkv projection's output, or a buffer of its own); weights None: no norm."""
    d = q_weight.shape[0] if q_weight is not None else head_size
    num_tokens, hq, hkv = q.shape[0], q.shape[1] // d, k.shape[1] // d
    q_out = torch.empty(num_tokens, hq, d, dtype=q.dtype, device=q.device)     # [T, Hq, D]
    k_out = torch.empty(num_tokens, hkv, d, dtype=k.dtype, device=k.device)    # [T, Hkv, D]
    norm = q_weight is not None
    weights = (q_weight.contiguous(), k_weight.contiguous()) if norm else (q, q)
    if num_tokens >= ROWS_MIN_TOKENS:
        grid = (triton.cdiv(num_tokens, ROWS_BLOCK), hq + hkv)
        _kernel(_qk_norm_rope_rows_kernel, q.device)[grid](
            q, k, *weights, cos, sin, q_out, k_out, num_tokens, q.stride(0), k.stride(0), cos.stride(0),
            sin.stride(0), float(eps), HQ=hq, HKV=hkv, HALF=d // 2, BLOCK_T=ROWS_BLOCK, NORM=norm, num_warps=4)
        return q_out, k_out
    _kernel(_qk_norm_rope_kernel, q.device)[(num_tokens, hq + hkv)](
        q, k, *weights, cos, sin, q_out, k_out,
        q.stride(0), k.stride(0), cos.stride(0), sin.stride(0), float(eps), HQ=hq, HKV=hkv, HALF=d // 2, NORM=norm,
        num_warps=1, **pdl_options(q.device))
    return q_out, k_out


@register_fake("qk_norm_rope")
def _qk_norm_rope_fake(q, k, q_weight, k_weight, cos, sin, eps):
    d = q_weight.shape[0]
    return q.new_empty(q.shape[0], q.shape[1] // d, d), k.new_empty(k.shape[0], k.shape[1] // d, d)
