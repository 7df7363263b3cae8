"""How rank 0 hands each step's message to the other ranks: bytes, written once and read by every reader.

`ShmRing` (ranks on one host): a ring of slots in one shared-memory block. The writer copies a message into the
next slot with its sequence number, length and CRC-32, then publishes the sequence number; each reader copies the
slot out, checks the CRC (a slot read before its bytes are visible fails it and is read again, so no memory-order
guarantee beyond eventual visibility is needed) and publishes what it has consumed. The writer reuses a slot
only once every reader has consumed it; a message longer than a slot spans several. A reader polls: it spins
(yielding its core) while messages keep coming, as they do while the engine steps, and backs off to sleeping once
none came for `busy_wait_s`.

`GlooBroadcast` (ranks on several hosts): the message's length, then its bytes, broadcast from rank 0 over the
host-side (gloo) group.

Measured by `benches/step_channel.py`; docs/distributed.md has the figures and the choice.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

_LINE = 64                                  # counters sit on cache lines of their own
_HEADER = struct.Struct("<qqII")            # sequence number, length, CRC-32, more slots follow (0/1)
_HEADER_BYTES = _LINE


class ChannelClosed(RuntimeError):
    """The other side of a channel is gone (the check a wait runs said so)."""


@dataclass(frozen=True)
class RingHandle:
    """What a reader needs to attach to a ring (picklable, handed to a worker at its spawn)."""
    name: str                   # the block's path
    num_readers: int
    num_slots: int
    slot_bytes: int

    @property
    def size(self) -> int:
        return _LINE * (1 + self.num_readers) + self.num_slots * (_HEADER_BYTES + self.slot_bytes)


class _Waiter:
    """Spin (yielding the core) while the last message is younger than `busy_wait_s`, then sleep in steps
    growing to `max_sleep_s`; run `check` (which raises to give up) every `check_every_s`."""

    def __init__(self, busy_wait_s: float, max_sleep_s: float = 1e-3, check_every_s: float = 0.1):
        self.busy_wait_s, self.max_sleep_s, self.check_every_s = busy_wait_s, max_sleep_s, check_every_s
        self.last_message = time.monotonic()

    def wait(self, ready: Callable[[], bool], check: Callable[[], None] | None) -> None:
        if ready():
            self.last_message = time.monotonic()
            return
        sleep, next_check = 1e-5, time.monotonic() + self.check_every_s
        while not ready():
            now = time.monotonic()
            if now - self.last_message < self.busy_wait_s:
                os.sched_yield()
            else:
                time.sleep(sleep)
                sleep = min(2 * sleep, self.max_sleep_s)
            if check is not None and now >= next_check:
                check()
                next_check = now + self.check_every_s
        self.last_message = time.monotonic()


class _Ring:
    def __init__(self, handle: RingHandle, block: "_SharedBlock"):
        self.handle, self._block = handle, block
        self._buf = block.buf
        # [published, reader 0's consumed, reader 1's, ...], each the first int64 of its own line
        self._counters = np.ndarray((1 + handle.num_readers,), dtype=np.int64, buffer=self._buf,
                                    strides=(_LINE,))
        self._slots = _LINE * (1 + handle.num_readers)

    def _slot(self, seq: int) -> int:
        return self._slots + (seq % self.handle.num_slots) * (_HEADER_BYTES + self.handle.slot_bytes)

    def close(self) -> None:
        self._counters = None
        self._buf = None
        self._block.close()


class RingWriter(_Ring):
    """The writing end: creates the shared-memory block; `handle` attaches readers; `close` removes it."""

    def __init__(self, num_readers: int, num_slots: int = 16, slot_bytes: int = 1 << 20, busy_wait_s: float = 0.0):
        block = _SharedBlock.create(RingHandle("", num_readers, num_slots, slot_bytes).size)
        super().__init__(RingHandle(block.path, num_readers, num_slots, slot_bytes), block)
        self._counters[:] = 0
        self.published = 0
        self._waiter = _Waiter(busy_wait_s)

    def consumed(self, reader: int) -> int:
        """How many slots reader `reader` has consumed (a message spans one or more)."""
        return int(self._counters[1 + reader])

    def send(self, data: bytes, check: Callable[[], None] | None = None) -> None:
        """Write one message (any length; it spans slots as it needs); waits while every slot holds a message some
        reader has not consumed, running `check` now and then."""
        size, view = self.handle.slot_bytes, memoryview(data)
        pieces = [view[i:i + size] for i in range(0, len(view), size)] or [view]
        counters, k = self._counters, self.handle.num_slots
        for index, piece in enumerate(pieces):
            seq = self.published + 1
            self._waiter.wait(lambda: int(counters[1:].min()) >= seq - k, check)
            offset = self._slot(seq)
            self._buf[offset + _HEADER_BYTES:offset + _HEADER_BYTES + len(piece)] = piece
            _HEADER.pack_into(self._buf, offset, seq, len(piece), zlib.crc32(piece), index + 1 < len(pieces))
            counters[0] = seq
            self.published = seq

    def close(self) -> None:
        """Release and remove the block (readers that still hold it keep their mapping)."""
        block = self._block
        super().close()
        block.unlink()


class _SharedBlock:
    """A file in /dev/shm (the temporary folder where there is none) mapped into memory: the writer creates and
    removes it, readers map it by path. Not multiprocessing.shared_memory, whose resource tracker (shared between
    a process and those it spawns) removes a block at the exit of whichever process attached it last."""

    def __init__(self, path: str, size: int, create: bool):
        import mmap
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._map)

    @classmethod
    def create(cls, size: int) -> "_SharedBlock":
        import tempfile
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        return cls(os.path.join(folder, f"ember-ring-{os.getpid()}-{os.urandom(6).hex()}"), size, create=True)

    def close(self) -> None:
        self.buf.release()
        self._map.close()

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class RingReader(_Ring):
    """Reader `index` of a ring made by a `RingWriter` (in another process)."""

    def __init__(self, handle: RingHandle, index: int, busy_wait_s: float = 0.0):
        if not 0 <= index < handle.num_readers:
            raise ValueError(f"reader {index} of a ring of {handle.num_readers} readers")
        super().__init__(handle, _SharedBlock(handle.name, handle.size, create=False))
        self.index = index
        self.consumed = int(self._counters[1 + index])
        self._waiter = _Waiter(busy_wait_s)

    def recv(self, check: Callable[[], None] | None = None) -> bytes:
        """The next message, waiting for it (running `check` now and then)."""
        counters, parts = self._counters, []
        while True:
            seq = self.consumed + 1
            self._waiter.wait(lambda: int(counters[0]) >= seq, check)
            piece, more = self._read(seq, check)
            counters[1 + self.index] = seq
            self.consumed = seq
            parts.append(piece)
            if not more:
                return parts[0] if len(parts) == 1 else b"".join(parts)

    def _read(self, seq: int, check) -> tuple[bytes, bool]:
        offset = self._slot(seq)
        while True:
            got, length, crc, more = _HEADER.unpack_from(self._buf, offset)
            if got == seq and 0 <= length <= self.handle.slot_bytes:
                piece = bytes(self._buf[offset + _HEADER_BYTES:offset + _HEADER_BYTES + length])
                if zlib.crc32(piece) == crc:
                    return piece, bool(more)
            os.sched_yield()        # published, but its bytes are not all visible here yet: read it again


class GlooBroadcast:
    """Messages from rank 0 to every rank over a gloo process group (the default group's host side): for ranks
    that share no memory."""

    def __init__(self, group=None):
        self.group = group

    def _broadcast(self, tensor) -> None:
        import torch.distributed as dist
        dist.broadcast(tensor, src=0, group=self.group)

    def send(self, data: bytes, check: Callable[[], None] | None = None) -> None:
        import torch
        self._broadcast(torch.tensor([len(data)], dtype=torch.int64))
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        self._broadcast(payload)

    def recv(self, check: Callable[[], None] | None = None) -> bytes:
        import torch
        length = torch.empty(1, dtype=torch.int64)
        self._broadcast(length)
        payload = torch.empty(int(length[0]), dtype=torch.uint8)
        self._broadcast(payload)
        return payload.numpy().tobytes()
