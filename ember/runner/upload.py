"""`PackedUpload`: everything one step sends to the device, gathered in one pinned int64 buffer and moved by one
host-to-device copy. Float values travel as the bits of float64."""

from __future__ import annotations

import numpy as np
import torch


class PackedUpload:
    """A ring of two pinned staging buffers: a step writes segments with `put`, `flush` copies them to the device in
    one transfer and returns the device view; `segment` slices a segment out of it.

    Two host buffers alternate so that writing step t+1's segments never waits for step t's copy, which the stream
    runs only after step t-1's kernels; a buffer is reused only after the copy out of it has finished. With
    `max_depth` > 2 (a runner that uploads several times a step: a draft model's k steps), the ring takes a new
    buffer instead of waiting for a copy still queued, up to that many buffers."""

    def __init__(self, capacity: int, device: torch.device, max_depth: int = 2):
        self.device = device
        self._cuda = device.type == "cuda"
        self._ring = [self._alloc(capacity) for _ in range(2)]
        self._events = [None, None]
        self._turn = 0
        self._used = 0
        self.max_depth = max_depth
        self._device_buf = torch.empty(capacity, dtype=torch.int64, device=device)
        # current_stream() without a device index looks the device up through several Python calls each step
        self._device_index = (device.index if device.index is not None else torch.cuda.current_device()) \
            if self._cuda else None

    def _alloc(self, capacity: int) -> tuple[torch.Tensor, np.ndarray]:
        host = torch.empty(capacity, dtype=torch.int64, pin_memory=self._cuda)
        return host, host.numpy()

    def begin(self) -> None:
        """Start a step's upload: take the next host buffer once the copy out of it has finished (or, below
        `max_depth`, a new one if it has not)."""
        self._turn = (self._turn + 1) % len(self._ring)
        event = self._events[self._turn]
        if event is not None and len(self._ring) < self.max_depth and not event.query():
            # the next buffer's copy waits behind kernels still queued: a new buffer rather than a host wait
            capacity = max(host.numel() for host, _ in self._ring)
            self._ring.insert(self._turn, self._alloc(capacity))
            self._events.insert(self._turn, None)
            event = None
        if event is not None:
            event.synchronize()
        self._used = 0

    def put(self, values) -> tuple[int, int]:
        """Append int values (or floats, as float64 bits); returns the segment (start, length)."""
        arr = np.asarray(values)
        if arr.dtype.kind == "f":
            arr = arr.astype(np.float64).view(np.int64)
        n = arr.size
        self._reserve(self._used + n + 1)
        start = self._used
        self._ring[self._turn][1][start:start + n] = arr.reshape(-1)
        self._used += n + (n & 1)       # segments start 16-byte aligned, as kernels like their pointers
        return start, n

    def _reserve(self, size: int) -> None:
        host, np_view = self._ring[self._turn]
        if size <= host.numel():
            return
        # a step larger than any before (e.g. many long prompts at once): grow, keeping what is written
        capacity = max(size, 2 * host.numel())
        new_host, new_np = self._alloc(capacity)
        new_np[:self._used] = np_view[:self._used]
        self._ring[self._turn] = (new_host, new_np)
        if self._device_buf.numel() < capacity:
            self._device_buf = torch.empty(capacity, dtype=torch.int64, device=self.device)

    def flush(self) -> torch.Tensor:
        """Copy the step's segments to the device (asynchronously on CUDA); returns the device buffer."""
        host = self._ring[self._turn][0]
        if not self._cuda:
            return host          # host and device memory are one: nothing to copy
        self._device_buf[:self._used].copy_(host[:self._used], non_blocking=True)
        event = self._events[self._turn] or torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device_index))
        self._events[self._turn] = event
        return self._device_buf

    @staticmethod
    def segment(buf: torch.Tensor, seg: tuple[int, int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """The segment `seg` of a flushed buffer, as int64 or (float64 bits) as `dtype` floats."""
        start, n = seg
        view = buf[start:start + n]
        if dtype.is_floating_point:
            return view.view(torch.float64).to(dtype)
        return view
