"""What every Triton attention backend needs from the device and dtypes, as `supports()` reasons."""

from __future__ import annotations

import os

import torch

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_device_reasons(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> list[str]:
    """Reasons a Triton backend cannot run here: a CPU without the interpreter, another device, an unsupported
    dtype, or bfloat16 under the interpreter (whose tl.dot is wrong on it)."""
    reasons = []
    device = torch.device(device)
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"   # read now: tests set it per process
    if device.type == "cpu" and not interpreted:
        reasons.append("on a CPU the Triton kernels run only under TRITON_INTERPRET=1")
    elif device.type not in ("cpu", "cuda"):
        reasons.append(f"device {device.type} is not supported (cuda, or cpu with TRITON_INTERPRET=1)")
    for what, dt in (("dtype", dtype), ("KV-cache dtype", kv_dtype)):
        if dt not in TRITON_DTYPES:
            reasons.append(f"{what} {dt} is not supported (float16, bfloat16, float32)")
        elif dt == torch.bfloat16 and device.type == "cpu" and interpreted:
            reasons.append(f"{what} bfloat16 is not supported under TRITON_INTERPRET (its tl.dot is wrong "
                           "there); use float16 or float32 on a CPU")
    return reasons
