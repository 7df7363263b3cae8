"""Standalone Triton kernels for the model's dense layers (the attention kernels live with their backend)."""

from ember.kernels.triton_key import order_dependency_hashes

order_dependency_hashes()     # before any of ember's kernels is hashed, in this process and in its compile workers
