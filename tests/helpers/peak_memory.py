"""The most memory torch ops allocate at once inside a block, on any device: a dispatch mode counts each new
storage an op returns until it is freed. CPU tensors have no allocator statistics; this stands in for
`torch.cuda.max_memory_allocated`. It sees what ops return, not the scratch a kernel allocates and frees inside
itself."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakMemory(TorchDispatchMode):
    """`with PeakMemory() as m: ...`, then `m.peak`: the most bytes of storages made inside the block alive at once
    (storages that existed before it, and views of them, are not counted)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.section_peaks: list[int] = []
        self._sizes: dict[int, int] = {}

    @contextlib.contextmanager
    def section(self):
        """Inside the mode: appends to `section_peaks` the most bytes the block held at once above what was live
        when it began."""
        base, outer = self.live, self.peak
        self.peak = base
        try:
            yield
        finally:
            self.section_peaks.append(self.peak - base)
            self.peak = max(outer, self.peak)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t).data_ptr() for t in tree_leaves((args, kwargs)) if _storage(t) is not None}
        for t in tree_leaves(out):
            storage = _storage(t)
            if storage is None:
                continue
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in inputs or key in self._sizes:
                continue
            self._sizes[key] = nbytes
            self.live += nbytes
            weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key)


def _storage(t) -> torch.UntypedStorage | None:
    """A tensor's storage; None for anything else, and for tensors without one (oneDNN's packed weights)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t.untyped_storage()
    except NotImplementedError:
        return None
