"""Programmatic dependent launch (Hopper and newer): a kernel launched as a dependent may start while the kernel
before it drains, so the launch gap between two short kernels is hidden; inside a CUDA graph the dependency is a
programmatic edge. A kernel that takes part starts with `gdc_wait()` (its inputs from the previous kernel are then
complete and visible) and `gdc_launch_dependents()` (the next kernel's programs may be scheduled once every program
of this one has started).

Kernels take a `PDL` constexpr, False by default, and their launchers add `pdl_options(device)`, which is empty
where PDL does not apply (CPU, the interpreter, GPUs before sm_90, a Triton without it, or EMBER_PDL=0)."""

from __future__ import annotations

import functools
import os

import torch
import triton.language as tl

_cuda = getattr(getattr(tl, "extra", None), "cuda", None)
gdc_wait = getattr(_cuda, "gdc_wait", None)
gdc_launch_dependents = getattr(_cuda, "gdc_launch_dependents", None)


@functools.cache
def pdl_options(device: torch.device) -> dict:
    """Keyword arguments that launch a PDL-aware kernel as a programmatic dependent on `device` ({} where PDL does
    not apply)."""
    if device.type != "cuda" or os.environ.get("EMBER_PDL", "1") == "0" or gdc_wait is None:
        return {}
    if torch.cuda.get_device_capability(device)[0] < 9:
        return {}
    return {"PDL": True, "launch_pdl": True}
