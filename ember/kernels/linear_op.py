"""`ember::linear`: a linear layer that decode-sized batches run on ember's GEMV (ember.kernels.gemv) and others on
cuBLAS, by the measured per-shape crossover (ember.kernels.gemv_routing), with the switches that A/B runs and kernel
tests turn: `set_gemv_enabled` (the GEMV at all) and `set_gemv_routing` (follow the crossover, or take the GEMV at
every row count it applies to). `ember::logits` is the LM head's: the same routing, float32 out."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.kernels.gemv import DTYPES, GEMV_MAX_M, gemv
from ember.kernels.gemv_routing import gemv_max_rows
from ember.kernels.library import define, register_fake

__all__ = ["LOGITS_ON_GEMV", "gemv_applies", "gemv_enabled", "gemv_pays", "linear", "logits", "set_gemv_enabled",
           "set_gemv_routing"]

_enabled = True


def set_gemv_enabled(enabled: bool) -> None:
    """Send `ember::linear` to the Triton kernel where it applies (True, the default) or always to F.linear
    (False), e.g. to compare the two in one process."""
    global _enabled
    _enabled = bool(enabled)


def gemv_enabled() -> bool:
    """Whether `ember::linear` may use the Triton kernel (see set_gemv_enabled)."""
    return _enabled


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the Triton kernel is made for these tensors: CUDA, 1..GEMV_MAX_M rows, one supported dtype, K a
    multiple of 8 and W contiguous along K."""
    return (x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_M and x.dtype in DTYPES
            and weight.dtype == x.dtype and weight.stride(1) == 1 and x.shape[1] % 8 == 0
            and (bias is None or bias.dtype == x.dtype))


_routed = True


def set_gemv_routing(routed: bool) -> None:
    """Follow the measured GEMV/cuBLAS crossover (True, the default), or send every row count the kernel applies to
    through it (False: kernel tests, and the sweep that measures the crossover)."""
    global _routed
    _routed = bool(routed)


def gemv_pays(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether the GEMV was measured faster than cuBLAS at x's row count for this weight shape
    (ember.kernels.gemv_routing), or routing is off."""
    return not _routed or x.shape[0] <= gemv_max_rows(weight.shape[0], weight.shape[1], gated)


@define("linear")
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> a new [M, N]: the Triton kernel when it is enabled, applies and
    was measured faster for this shape and row count, else F.linear."""
    if gemv_enabled() and gemv_applies(x, weight, bias) and gemv_pays(x, weight):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


@register_fake("linear")
def _linear_fake(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear through `ember::linear`: x [..., K] -> [..., N], leading dimensions flattened for the op."""
    out = torch.ops.ember.linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


# The LM head's decode rows on the GEMV where the crossover says so (True), or always on cuBLAS and a float32 copy
# (False, for A/B runs). On an H100 (`benches/gemv_sweep.py crossover`: weights out of L2, many calls in one CUDA
# graph) one row took 100.8 against 116.0 us for Qwen3-0.6B's head (151936 x 1024), 170.1 against 191.1 us for
# Llama-3.2-1B's (128256 x 2048) and 341.4 against 375.5 us for Llama-3.1-8B's (128256 x 4096), the GEMV at 102-103%
# of copy bandwidth (it only reads); from 3 rows cuBLAS wins.
LOGITS_ON_GEMV = True


@define("logits")
def _logits_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [V, K]^T -> float32 [M, V], the product rounded to x's dtype first (as
    `F.linear(x, weight).float()`): on the GEMV, which stores float32 itself, where `ember::linear` would take it."""
    if LOGITS_ON_GEMV and gemv_enabled() and gemv_applies(x, weight, None) and gemv_pays(x, weight):
        return gemv(x, weight, out_dtype=torch.float32)
    return F.linear(x, weight).float()


@register_fake("logits")
def _logits_fake(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


def logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight).float()` through `ember::logits`: x [..., K] -> float32 [..., V]."""
    out = torch.ops.ember.logits(x.reshape(-1, x.shape[-1]), weight)
    return out.reshape(*x.shape[:-1], weight.shape[0])
