"""`kernel_for(device, kernel)`: a Triton attention kernel for the tensors' device, through ember's launcher on a
GPU and run by Triton's interpreter on a CPU (`ember.kernels.interpret.interpreted`: the device functions it calls
are interpreted too)."""

from __future__ import annotations

import torch

from ember.kernels.interpret import interpreted
from ember.kernels.launcher import launcher


def kernel_for(device: torch.device, kernel):
    """`kernel` (a compiled @triton.jit kernel of an attention backend) as it runs on `device`."""
    return launcher(kernel) if device.type != "cpu" else interpreted(kernel)
