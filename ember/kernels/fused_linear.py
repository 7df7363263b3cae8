"""`ember::fused_linear`: a linear layer with an RMSNorm prologue, a SiLU·mul epilogue and a residual epilogue,
each optional, as one op. The fusion passes (ember.graphs.passes) put it where the model's plain ops were.

    out = act(norm(x) @ weight^T + bias) + residual
    norm: Llama-form RMSNorm with norm_weight [K] and eps (when norm_weight is given)
    act:  silu(gate) * up over [gate | up] when gated (weight [2N, K], bias [2N]), else identity

Decode-sized batches on CUDA run one GEMV launch with every part inside (ember.kernels.gemv), up to the row count at
which it was measured faster for the weight's shape (ember.kernels.gemv_routing). Other batches run
the parts as separate kernels: a Triton RMSNorm, cuBLAS (with the residual as its beta=1 accumulator where there is
no bias and no activation), a Triton SiLU·mul. On a CPU the parts are the torch ops of the unfused model.

`ember::fused_linear_into_residual` is the same op writing its result over `residual` instead of a new tensor, for
a residual nothing reads afterwards (ember.graphs.plain_pieces puts it there). cuBLAS's beta=1 accumulator then is
the residual itself: `torch.addmm(residual, ...)` first copies the residual into its new output (one device-to-device
copy of [M, N] per call, two per decoder layer), `residual.addmm_(...)` runs the same GEMM without it. Same kernels,
same numbers; the GEMV writes its output over the residual tile it has read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.kernels.gemv import gemv
from ember.kernels.linear_op import gemv_applies, gemv_enabled, gemv_pays
from ember.kernels.library import define, register_fake
from ember.kernels.rms_norm import rms_norm, silu_mul


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama-form RMSNorm as torch ops: normalise in float32, round to x's dtype, scale by the weight."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def fused_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           norm_weight: torch.Tensor | None, eps: float, gated: bool,
                           residual: torch.Tensor | None) -> torch.Tensor:
    """The unfused composition as torch ops (the rounding of the model's own ops)."""
    if norm_weight is not None:
        x = rms_norm_reference(x, norm_weight, eps)
    out = F.linear(x, weight, bias)
    if gated:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out if residual is None else out + residual


def _composed(x, weight, bias, norm_weight, eps, gated, residual) -> torch.Tensor:
    """The parts as separate kernels, for CUDA batches the GEMV does not take."""
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    if residual is not None and bias is None and not gated:
        return torch.addmm(residual, x, weight.t())
    out = F.linear(x, weight, bias)
    if gated:
        out = silu_mul(out)
    return out if residual is None else out.add_(residual)


@define("fused_linear")
def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
                 eps: float, gated: bool, residual: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] -> [M, N] (N = weight rows, or half of them when gated); see the module docstring."""
    if x.device.type == "cpu":
        return fused_linear_reference(x, weight, bias, norm_weight, eps, gated, residual)
    same_dtype = all(t is None or t.dtype == x.dtype for t in (norm_weight, residual))
    if gemv_enabled() and same_dtype and gemv_applies(x, weight, bias) and gemv_pays(x, weight, gated):
        return gemv(x, weight, bias, residual, norm_weight=norm_weight, eps=eps, gated=gated)
    return _composed(x, weight, bias, norm_weight, eps, gated, residual)


@define("fused_linear_into_residual", mutates_args=("residual",))
def fused_linear_into_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               norm_weight: torch.Tensor | None, eps: float, gated: bool,
                               residual: torch.Tensor) -> None:
    """`ember::fused_linear` with its result written over `residual` (contiguous [M, N] of x's dtype)."""
    if residual.dtype != x.dtype or not residual.is_contiguous():
        raise ValueError(f"fused_linear_into_residual writes a contiguous residual of x's dtype ({x.dtype}), got "
                         f"{residual.dtype} with strides {residual.stride()}")
    if x.device.type == "cpu":
        residual.add_(fused_linear_reference(x, weight, bias, norm_weight, eps, gated, None))
        return
    same_dtype = norm_weight is None or norm_weight.dtype == x.dtype
    if gemv_enabled() and same_dtype and gemv_applies(x, weight, bias) and gemv_pays(x, weight, gated):
        gemv(x, weight, bias, residual, norm_weight=norm_weight, eps=eps, gated=gated, out=residual)
        return
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    if bias is None and not gated:
        residual.addmm_(x, weight.t())
        return
    out = F.linear(x, weight, bias)
    residual.add_(silu_mul(out) if gated else out)


@register_fake("fused_linear")
def _fused_linear_fake(x, weight, bias, norm_weight, eps, gated, residual):
    return x.new_empty(x.shape[0], weight.shape[0] // 2 if gated else weight.shape[0])


@register_fake("fused_linear_into_residual")
def _fused_linear_into_residual_fake(x, weight, bias, norm_weight, eps, gated, residual):
    return None
