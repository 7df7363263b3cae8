"""Pick the kernel object for the tensors' device: compiled kernels for a GPU, interpreted copies for a CPU.

Triton decides at decoration time whether a @triton.jit function is compiled or interpreted (TRITON_INTERPRET),
so which one a module holds would depend on import order. Instead, CPU tensors always get copies of the kernel
modules imported a second time, under a private package name, with the interpreter switched on for that import.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import threading

import torch

_PRIVATE_PACKAGE = __package__ + "._interpreted"
_lock = threading.Lock()


@functools.cache
def _interpreted_module(name: str):
    with _lock:
        if _PRIVATE_PACKAGE not in sys.modules:
            spec = importlib.machinery.ModuleSpec(_PRIVATE_PACKAGE, None, is_package=True)
            package = importlib.util.module_from_spec(spec)
            package.__path__ = [os.path.dirname(__file__)]
            sys.modules[_PRIVATE_PACKAGE] = package
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            return importlib.import_module(f"{_PRIVATE_PACKAGE}.{name}")
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous


def kernel_for(device: torch.device, module_name: str, kernel_name: str, compiled):
    """`compiled` for a GPU device; for a CPU device the same kernel from an interpreted copy of the module."""
    if device.type != "cpu":
        return compiled
    return getattr(_interpreted_module(module_name), kernel_name)
