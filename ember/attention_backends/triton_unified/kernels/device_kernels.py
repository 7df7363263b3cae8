"""This kernel package's `kernel_for`: compiled kernels for a GPU, interpreted copies of its modules for a CPU
(see `ember.attention_backends.interpreted_kernels`)."""

from __future__ import annotations

import os

from ember.attention_backends.interpreted_kernels import KernelPicker

kernel_for = KernelPicker(__package__, os.path.dirname(__file__))
