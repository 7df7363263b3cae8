"""Kernel objects for the tensors' device: compiled kernels for a GPU, interpreted copies for a CPU.

Triton decides when a @triton.jit function is decorated whether it is compiled or interpreted (TRITON_INTERPRET),
so the module imported first would fix the choice for everyone. Instead, CPU tensors get kernels from a second
import of a kernel package's modules, under a private package name, made with the interpreter switched on.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import threading

import torch

from ember.kernels.interpret import interpreter_on
from ember.kernels.launcher import launcher

_lock = threading.Lock()


class KernelPicker:
    """`picker(device, module_name, kernel_name, compiled)`: `compiled` on a GPU; on a CPU the kernel of the same
    name from an interpreted copy of `module_name`, a module of the kernel package `package` (in `directory`)."""

    def __init__(self, package: str, directory: str):
        self.private_package = package + "._interpreted"
        self.directory = directory
        self._modules: dict[str, object] = {}

    def _interpreted_module(self, name: str):
        with _lock:
            module = self._modules.get(name)
            if module is not None:
                return module
            if self.private_package not in sys.modules:
                spec = importlib.machinery.ModuleSpec(self.private_package, None, is_package=True)
                package = importlib.util.module_from_spec(spec)
                package.__path__ = [self.directory]
                sys.modules[self.private_package] = package
            with interpreter_on():
                module = importlib.import_module(f"{self.private_package}.{name}")
            self._modules[name] = module
            return module

    def __call__(self, device: torch.device, module_name: str, kernel_name: str, compiled):
        if device.type != "cpu":
            return launcher(compiled)
        return getattr(self._interpreted_module(module_name), kernel_name)
