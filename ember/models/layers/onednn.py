"""Linear layers on the CPU through oneDNN, with each weight packed once into oneDNN's blocked layout.

For decode-sized inputs (a few rows against a weight read from memory), oneDNN's packed GEMM runs about twice as
fast as `F.linear`'s MKL path on the CPU (the LM head of a 135M model at 8 rows: 8 ms instead of 20). The packed
copy is a second copy of the weight: the original stays the parameter, for state dicts and for the paths that slice
it. Float32 only: bfloat16 and float16 GEMMs on CPUs without native support are emulated and gain nothing.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

logger = logging.getLogger("ember")

PACKED_DTYPES = (torch.float32,)


def onednn_packing_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether linear weights of `dtype` on `device` can be packed for oneDNN (a CPU build with it, float32)."""
    return (torch.device(device).type == "cpu" and dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available())


@torch.no_grad()
def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [N, K] weight reordered into oneDNN's layout for `onednn_linear` (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


# Inputs of more rows take the unpacked weight. oneDNN (and ideep above it) keep a primitive for each input shape,
# up to 1,024 of them: on a 2-core CPU, SmolLM2-135M's five weight shapes held 178 MiB more once every row count from
# 1 to 64 had run, and 425 MiB more after 200 row counts, so a server whose step sizes vary grew by that much. Past
# 64 rows the packed GEMM gains little (one thread, the five weights, packed vs F.linear: 14.7 / 26.4 ms at 8 rows,
# 59 / 71 at 64, 110 / 115 at 128, 207 / 209 at 256), and decode steps, where it gains most, stay under it.
ONEDNN_MAX_ROWS = 64


def takes_packed(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether `x` [..., K] goes through its layer's packed weight: there is one, and `x` has at most
    `ONEDNN_MAX_ROWS` rows."""
    return packed is not None and x.numel() <= ONEDNN_MAX_ROWS * x.shape[-1]


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N], W packed by `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")


def packable_bytes(model: nn.Module) -> int:
    """Bytes that `pack_linear_weights` would add: one more copy of every packable weight."""
    return sum(m.weight_to_pack().nbytes for m in model.modules()
               if hasattr(m, "packed_weight") and hasattr(m, "weight_to_pack"))


def pack_linear_weights(model: nn.Module) -> int:
    """Give every module with a `packed_weight` slot (ember's Linear layers and LM head) its packed weight; returns
    how many were packed. Call after the weights are loaded; later changes to a weight are not seen."""
    count = 0
    for module in model.modules():
        if hasattr(module, "packed_weight") and hasattr(module, "weight_to_pack"):
            module.packed_weight = pack_weight(module.weight_to_pack())
            count += 1
    return count


def pack_if_it_fits(model: nn.Module, available_bytes: int | None) -> int:
    """`pack_linear_weights` when the packed copy takes at most half of `available_bytes` (None: unknown, pack);
    returns how many weights were packed (0 when they stay unpacked and run through F.linear)."""
    extra = packable_bytes(model)
    if available_bytes is not None and extra > available_bytes // 2:
        logger.info("linear weights stay unpacked (F.linear): their oneDNN copy of %.2f GiB would take more than "
                    "half of the %.2f GiB available", extra / 2**30, available_bytes / 2**30)
        return 0
    t0 = time.perf_counter()
    packed = pack_linear_weights(model)
    logger.info("packed %d linear weights (%.2f GiB) for oneDNN in %.2f s", packed, extra / 2**30,
                time.perf_counter() - t0)
    return packed
