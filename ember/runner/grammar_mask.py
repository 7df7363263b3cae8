"""`GrammarMask`: the device buffer a step's token bitmask goes into, and the pinned host buffers it comes from.

The bitmask has one row of ceil(V / 32) int32 words per constrained row of the step, bit t of a row set where token t
is allowed. Row j belongs to the step's j-th constrained batch row; the batch's per-row info holds j + 1 there (0 for
a row without a grammar), so the sampler, and the decode tail a FULL CUDA graph records, find it without a scatter.
The device buffer is allocated once and filled in place, so a graph reads it at the address it was captured with.
A step without constrained rows copies nothing.

Under tensor parallelism only rank 0's engine fills and puts the bitmask; `share` broadcasts it from rank 0's device
buffer into every other rank's (eagerly, or inside the split decode tail's graph), so every rank's sampler reads the
same rows. The row index comes with the step itself (`StepInput.grammar_rows`), which every rank receives.
"""

from __future__ import annotations

import torch

from ember.distributed.ops import broadcast_


class GrammarMask:
    """[max_num_reqs, words] int32 on the device, filled from a ring of two pinned host buffers (made on first use):
    the engine writes `staging()`, then `put(k)` copies its first k rows."""

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device, group: str | None = None):
        self.group = group         # the tensor-parallel group the bitmask is shared over (None: one rank)
        self.words = -(-vocab_size // 32)
        self.device = device
        self.bitmask = torch.full((max_num_reqs, self.words), -1, dtype=torch.int32, device=device)   # [R, W]
        self._cuda = device.type == "cuda"
        self._host: list[torch.Tensor] = []
        self._events: list = [None, None]
        self._turn = 0
        self.num_puts = 0          # steps that copied a bitmask (tests and the benchmark read it)

    def staging(self) -> torch.Tensor:
        """The host buffer to fill next [max_num_reqs, words] int32, once the copy out of it has finished; on the
        CPU the device buffer itself (nothing to copy)."""
        if not self._cuda:
            return self.bitmask
        if not self._host:
            self._host = [torch.empty_like(self.bitmask, device="cpu").pin_memory() for _ in range(2)]
        self._turn ^= 1
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()
        return self._host[self._turn]

    def put(self, num_rows: int) -> None:
        """Copy the first `num_rows` rows of the buffer `staging()` returned to the device (asynchronously)."""
        self.num_puts += 1
        if not self._cuda or num_rows == 0:
            return
        self.bitmask[:num_rows].copy_(self._host[self._turn][:num_rows], non_blocking=True)
        event = self._events[self._turn] or torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._events[self._turn] = event

    def share(self, num_rows: int) -> None:
        """Under tensor parallelism, overwrite the first `num_rows` rows of every rank's device buffer with rank 0's
        (after rank 0's `put`, in stream order); one rank: nothing."""
        if self.group is not None and num_rows > 0:
            broadcast_(self.bitmask[:num_rows], self.group)
