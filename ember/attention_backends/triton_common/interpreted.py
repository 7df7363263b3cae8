"""`kernel_for(device, kernel)`: a Triton attention kernel for the tensors' device, compiled for a GPU and
interpreted for a CPU.

Triton decides when a @triton.jit function is decorated whether it is compiled or interpreted (TRITON_INTERPRET),
so the module imported first would fix the choice for everyone. Instead, CPU tensors get kernels from a second
import of the kernel's module, made with the interpreter switched on, under a private mirror of this package tree
(`ember.attention_backends._interpreted.<the module's path>`). The mirror's packages are empty stand-ins, so no
package `__init__` runs again; a relative import in a mirrored module (`from ...triton_common.tiles import cdiv`)
stays inside the mirror and gets interpreted helpers, which an interpreted kernel needs (it cannot call compiled
ones).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import threading

import torch

from ember.kernels.interpret import interpreter_on
from ember.kernels.launcher import launcher

ROOT = "ember.attention_backends"
MIRROR = ROOT + "._interpreted"
_ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_lock = threading.Lock()
_modules: dict[str, object] = {}


def _stand_in(name: str) -> None:
    """An empty package `name` in the mirror whose submodules load from the matching folder of the real tree."""
    if name in sys.modules:
        return
    folder = os.path.join(_ROOT_DIR, *name[len(MIRROR):].split(".")[1:])
    package = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(name, None, is_package=True))
    package.__path__ = [folder]
    sys.modules[name] = package


def interpreted_module(module_name: str):
    """The interpreted copy of `module_name`, a module under ember.attention_backends (imported once)."""
    if not module_name.startswith(ROOT + "."):
        raise ValueError(f"{module_name} is not a module of {ROOT}; only its kernels have interpreted copies here")
    with _lock:
        module = _modules.get(module_name)
        if module is not None:
            return module
        parts = module_name[len(ROOT) + 1:].split(".")
        for i in range(len(parts)):     # the mirror root and every package above the module
            _stand_in(".".join([MIRROR, *parts[:i]]))
        _stand_in(f"{MIRROR}.triton_common")     # what a kernel module imports relatively, without its __init__
        with interpreter_on():
            module = importlib.import_module(".".join([MIRROR, *parts]))
        _modules[module_name] = module
        return module


def kernel_for(device: torch.device, kernel):
    """`kernel` (a compiled @triton.jit kernel of an attention backend) through ember's launcher on a GPU; on a CPU
    the kernel of the same name from its module's interpreted copy."""
    if device.type != "cpu":
        return launcher(kernel)
    fn = kernel.fn
    return getattr(interpreted_module(fn.__module__), fn.__name__)
