"""Kernel objects for the tensors' device: compiled kernels for a GPU, interpreted copies for a CPU.

Triton decides when a @triton.jit function is decorated whether it is compiled or interpreted (TRITON_INTERPRET),
so the module a test imports first would fix the choice for everyone. Instead, CPU tensors get kernels from a
second import of the kernel modules, under a private package name, made with the interpreter switched on.
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
    """`compiled` on a GPU; on a CPU the kernel of the same name from an interpreted copy of the module."""
    if device.type != "cpu":
        return compiled
    return getattr(_interpreted_module(module_name), kernel_name)
