"""What a step gives back: its sampled tokens (and logprobs) on their way to the host, and the host-side result;
and the runner's start-up times."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from ember.profiling import section


@dataclass
class ModelRunnerOutput:
    """Host-side results of one step, per scheduled request in batch order."""
    sampled_token_ids: list[int]
    logprob_token_ids: list[list[int]] | None = None
    logprobs: list[list[float]] | None = None
    ranks: list[int] | None = None
    # a verify step (ember.spec_decode): per row, the tokens it emitted after `sampled_token_ids[i]` (accepted
    # proposals, then the resampled or bonus token); logprobs are then per slot, row i's slot j at i * stride + j
    spec_token_ids: list[list[int]] | None = None
    logprob_stride: int = 1
    num_proposed: list[int] | None = None    # per row, the real proposals of a step whose proposer ran on the device


@dataclass
class StartupTimes:
    """Seconds the runner spent on each start-up phase, and what the compile cache and graphs gave."""
    load_s: float = 0.0
    compile_s: float = 0.0
    capture_s: float = 0.0
    warmup_s: float = 0.0              # the Triton warm-up (ember.runner.warmup)
    precompile_s: float = 0.0          # the dry steps and worker compiles before them (ember.runner.warmup.precompile)
    compile_cache_hit: bool = False
    graph_memory_bytes: int = 0

    def summary(self, total: float) -> str:
        """One line: the total and each phase; the worker compiles count in the warm-up."""
        warmup = self.warmup_s + self.precompile_s
        other = total - self.load_s - self.compile_s - self.capture_s - warmup
        return (f"{total:.1f} s: load {self.load_s:.1f} s, compile {self.compile_s:.1f} s"
                f"{' (cached)' if self.compile_cache_hit else ''}, capture {self.capture_s:.1f} s "
                f"({self.graph_memory_bytes / 2**20:.0f} MiB), warm-up {warmup:.1f} s"
                + (f" (of which Triton compiles in worker processes {self.precompile_s:.1f} s)" if self.precompile_s
                   else "") + f", other {other:.1f} s")


class HostRing:
    """Pinned host buffers for the sampled tokens, allocated once and used in turn, each with an event made for
    blocking waits (the host thread sleeps until the copy is done instead of spinning a core).

    A buffer is written again `size` steps later; the engine has processed a step's tokens long before that (at
    most two steps are in flight with async scheduling)."""

    def __init__(self, max_num_reqs: int, device: torch.device, size: int = 4):
        self._buffers = [torch.empty(max_num_reqs, dtype=torch.int64, pin_memory=True) for _ in range(size)]
        self._events = [torch.cuda.Event(blocking=True) for _ in range(size)]
        self._turn = 0
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()

    def take(self) -> tuple[torch.Tensor, "torch.cuda.Event"]:
        self._turn = (self._turn + 1) % len(self._buffers)
        return self._buffers[self._turn], self._events[self._turn]


class DeviceOnlyOutput:
    """A step of a tensor-parallel rank other than 0: its tokens stay in its request table on the device (rank 0
    reports them), so there is nothing to wait for."""

    def result(self) -> None:
        return None


class AsyncModelRunnerOutput:
    """A launched step's sampled tokens (and logprobs) on their way to the host: the step's single device-to-host
    transfer, into pinned memory (a `HostRing` buffer for plain tokens), with an event to wait on. `result()`
    blocks until they are there."""

    def __init__(self, sampled, device: torch.device, ring: HostRing | None = None):
        if sampled.logprobs is None:
            packed, self._k = sampled.sampled_token_ids, None
        else:
            self._k = sampled.logprobs.shape[1]
            packed = torch.cat([sampled.sampled_token_ids[:, None].double(), sampled.ranks[:, None].double(),
                                sampled.logprob_token_ids.double(), sampled.logprobs.double()], dim=1)
        self._event = None
        if device.type == "cuda":
            if ring is not None and self._k is None and packed.dtype == torch.int64:
                buf, self._event = ring.take()
                host = buf[:packed.shape[0]]
            else:
                host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
                self._event = torch.cuda.Event(blocking=True)
            host.copy_(packed, non_blocking=True)
            # an explicit device index: current_stream() without one looks the device up in Python each step
            self._event.record(torch.cuda.current_stream(ring.device_index if ring is not None else device))
            packed = host
        self._packed = packed
        self._result: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        """The step's tokens (and logprobs) on the host, waiting for them the first time."""
        if self._result is not None:
            return self._result
        if self._event is not None:
            with section("ember.wait"):
                self._event.synchronize()
        packed, k = self._packed, self._k
        if k is None:
            self._result = ModelRunnerOutput(packed.tolist())
        else:
            self._result = ModelRunnerOutput(packed[:, 0].long().tolist(), packed[:, 2:2 + k].long().tolist(),
                                             packed[:, 2 + k:].tolist(), packed[:, 1].long().tolist())
        return self._result
