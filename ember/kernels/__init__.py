"""Standalone Triton kernels for the model's dense layers (the attention kernels live with their backend)."""
