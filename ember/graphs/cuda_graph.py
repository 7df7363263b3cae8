"""CUDA-graph capture and replay per `BatchDescriptor`, all graphs sharing one memory pool.

API:
    manager = CUDAGraphManager(device, debug_check_addresses=False, lazy=False)
    manager.wrap_piece(fn, name) -> CUDAGraphWrapper   (compile.py wraps each compiled piece when given a manager)
    manager.wrap_full(forward) -> CUDAGraphWrapper     the whole forward, attention included
    manager.capture_all(run_step, captures, num_warmups=1, warmup_each=False) -> CaptureReport   eager capture
    manager.graphs_captured[mode] / manager.num_descriptors(mode)           counters
    manager.release()                                   every captured graph dropped (before leaving a NCCL group)
    wrapper.entries (descriptor -> captured graph), wrapper.num_replays

A wrapper reads the forward context (`ember.attention_backends.op`): when its runtime mode equals the context's
`cudagraph_runtime_mode` and a `batch_descriptor` is set, it captures a graph on first sight of that descriptor
(then replays it once, so the capturing call returns real results) and replays it afterwards; otherwise it calls
`fn` directly. So a PIECEWISE wrapper passes through inside a FULL capture, and both pass through in NONE steps.

Lazy capture (`lazy=True`, nothing captured at start-up): a wrapper runs a descriptor's first step without a graph,
which is that bucket's warm-up (Triton JIT and autotuning happen outside any capture), captures on its second
step, and replays from the third. The first request of each size pays nothing extra on its first step and one
capture (tens of milliseconds) on its second. Graphs then come in the order sizes are used, not largest first,
so the pool reuses less memory between them than an eager capture does.

Static inputs. Nothing is copied on replay: every tensor a graph reads must sit at the address it had at capture.
For FULL, the runner passes views of its persistent `input_ids` / `positions` buffers. For PIECEWISE, a piece's
inputs are the parameters, those buffers, and outputs of the previous piece's graph, including the attention `out`
tensor that the previous piece allocated and the eager attention op filled in place; a replayed graph writes its
outputs to the addresses it had at capture, so the chain is stable. `debug_check_addresses=True` verifies this on
every replay and raises on the first moved input.

Outputs. A wrapper keeps only non-owning aliases of its captured outputs, so that after a capturing forward ends,
its activations return to the shared pool and the next (smaller) capture reuses them. Replays therefore must run
one forward at a time, in any order, and a forward's output is valid until the next replay: consume the hidden
states (logits) before the next step. Capture the largest descriptor first (`capture_all` does), between steps.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ember.attention_backends.op import get_forward_context
from ember.graphs.modes import BatchDescriptor, CUDAGraphMode

logger = logging.getLogger("ember")


def _weak_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over `t`'s memory that does not keep it allocated (the graph pool owns that memory)."""
    storage = t.untyped_storage()
    # a storage over the same bytes with no deleter (the construction torch's own cudagraph trees use)
    alias_storage = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(alias_storage, t.storage_offset(), t.size(), t.stride())


def _weak_outputs(output: Any) -> Any:
    return pytree.tree_map(lambda x: _weak_alias(x) if isinstance(x, torch.Tensor) and x.is_cuda else x, output)


def _input_signature(args: Sequence[Any]) -> tuple:
    """Tensor addresses and plain values of a call's arguments, for the debug check."""
    return tuple(("tensor", a.data_ptr()) if isinstance(a, torch.Tensor) else ("value", a) for a in args)


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    output: Any                       # non-owning aliases of the captured outputs
    signature: tuple | None           # argument addresses at capture (debug only)


class CUDAGraphWrapper:
    """Captures `fn` once per descriptor under its runtime mode, replays it afterwards; passes through otherwise."""

    def __init__(self, fn: Callable, runtime_mode: CUDAGraphMode, manager: "CUDAGraphManager", name: str):
        if runtime_mode not in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            raise ValueError(f"a graph wrapper's runtime mode must be PIECEWISE or FULL, not {runtime_mode.name}")
        self.fn = fn
        self.runtime_mode = runtime_mode
        self.manager = manager
        self.name = name
        self.entries: dict[BatchDescriptor, _Entry] = {}
        self.warmed: set[BatchDescriptor] = set()     # lazy capture: descriptors run once without a graph
        self.num_replays = 0
        manager._wrappers.append(self)

    def __call__(self, *args):
        try:
            ctx = get_forward_context()
        except RuntimeError:
            return self.fn(*args)
        desc = ctx.batch_descriptor
        if ctx.cudagraph_runtime_mode != self.runtime_mode or desc is None or self.manager.paused:
            return self.fn(*args)
        entry = self.entries.get(desc)
        if entry is None:
            if self.manager.lazy and desc not in self.warmed:
                self.warmed.add(desc)
                return self.fn(*args)
            return self._capture(desc, args)
        if entry.signature is not None:
            self._check_addresses(desc, entry.signature, args)
        entry.graph.replay()
        self.num_replays += 1
        return entry.output

    def _capture(self, desc: BatchDescriptor, args: tuple) -> Any:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{self.name}: nested CUDA-graph capture for {desc}; a {self.runtime_mode.name} graph "
                               f"cannot be captured inside another graph")
        mgr = self.manager
        graph = torch.cuda.CUDAGraph()
        stream = mgr.capture_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=mgr.pool)
            try:
                output = self.fn(*args)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        # capture records work without running it: replay once so this call returns real results
        graph.replay()
        signature = _input_signature(args) if mgr.debug_check_addresses else None
        self.entries[desc] = _Entry(graph, _weak_outputs(output), signature)
        mgr._record(self.runtime_mode, desc)
        return output

    def _check_addresses(self, desc: BatchDescriptor, expected: tuple, args: tuple) -> None:
        got = _input_signature(args)
        for i, (want, have) in enumerate(zip(expected, got)):
            if want != have:
                raise RuntimeError(f"{self.name} replay for {desc}: argument {i} is {have}, but was {want} at capture; "
                                   f"graph inputs must stay in the buffers they were captured with")
        if len(expected) != len(got):
            raise RuntimeError(f"{self.name} replay for {desc}: {len(got)} arguments, {len(expected)} at capture")


@dataclass(frozen=True)
class CaptureReport:
    """What `capture_all` did: descriptors captured, torch CUDA graphs made per mode, seconds (of which warm-up
    runs) and pool bytes."""
    num_descriptors: int
    graphs: dict[str, int]
    seconds: float
    memory_bytes: int
    warmup_seconds: float = 0.0


class CUDAGraphManager:
    """Owns the memory pool all graphs share, the capture stream and the capture counters."""

    def __init__(self, device: torch.device | str | None = None, debug_check_addresses: bool = False,
                 lazy: bool = False):
        self.device = torch.device(device if device is not None else "cuda")
        self.debug_check_addresses = debug_check_addresses
        self.lazy = lazy
        self.paused = False          # see pause()
        self.graphs_captured: Counter[CUDAGraphMode] = Counter()    # torch CUDA graphs, per runtime mode
        self._descriptors: dict[CUDAGraphMode, set[BatchDescriptor]] = {}
        self._pool = None
        self._stream: torch.cuda.Stream | None = None
        self._wrappers: list[CUDAGraphWrapper] = []

    def release(self) -> int:
        """Wait for the device, then drop every captured graph (the next step of a descriptor captures again) and
        return how many were dropped. A graph that holds NCCL work keeps its communicator busy: NCCL's teardown of
        that communicator waits for the graph's destruction, so a rank releases its graphs before leaving its
        tensor-parallel group."""
        captured = any(w.entries for w in self._wrappers) and torch.cuda.is_available()
        # on this manager's GPU whichever thread calls (the teardown runs in a thread of its own)
        with torch.cuda.device(self.device) if captured else contextlib.nullcontext():
            if captured:
                torch.cuda.synchronize(self.device)
            dropped = 0
            for wrapper in self._wrappers:
                for entry in wrapper.entries.values():
                    entry.graph.reset()
                    dropped += 1
                wrapper.entries.clear()
                wrapper.warmed.clear()
        self._descriptors.clear()
        return dropped

    @property
    def pool(self):
        """The one memory pool every graph is captured into (created on first use)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    @property
    def capture_stream(self) -> torch.cuda.Stream:
        """A side stream for capture (capturing on the default stream is not allowed)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def wrap_piece(self, fn: Callable, name: str) -> CUDAGraphWrapper:
        """A PIECEWISE wrapper for one compiled piece."""
        return CUDAGraphWrapper(fn, CUDAGraphMode.PIECEWISE, self, name)

    @contextlib.contextmanager
    def pause(self):
        """Every wrapper calls its function directly for the duration: no graph is captured or replayed (start-up
        warm-up steps under lazy capture, which must not count as a bucket's uses)."""
        previous, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = previous

    def wrap_full(self, forward: Callable) -> CUDAGraphWrapper:
        """A FULL wrapper for the whole forward (compiled or eager), attention included."""
        return CUDAGraphWrapper(forward, CUDAGraphMode.FULL, self, "forward")

    def num_descriptors(self, mode: CUDAGraphMode) -> int:
        """How many distinct descriptors have a graph under `mode` (PIECEWISE: one per bucket, for all pieces)."""
        return len(self._descriptors.get(mode, ()))

    def _record(self, mode: CUDAGraphMode, desc: BatchDescriptor) -> None:
        self.graphs_captured[mode] += 1
        self._descriptors.setdefault(mode, set()).add(desc)

    def capture_all(self, run_step: Callable[[CUDAGraphMode, BatchDescriptor], Any],
                    captures: Sequence[tuple[CUDAGraphMode, BatchDescriptor]], num_warmups: int = 1,
                    warmup_each: bool = False) -> CaptureReport:
        """Capture every (mode, descriptor), largest first.

        `run_step(mode, desc)` must run one forward on a dummy batch padded to `desc` with the forward context's
        runtime mode and descriptor set; it is called `num_warmups` times with NONE and then once with `mode`,
        which captures. The warm-up runs before the first capture of each kind of step (mode, uniform decode or
        not): that is where lazy initialisation happens (cuBLAS workspaces, the first call of each compiled piece),
        outside any capture. Other descriptors of the kind capture without one (`warmup_each` runs it for every
        descriptor): the kernels they add are Triton specializations of other tile sizes and row counts, and a
        Triton compile (and the loading of its module) inside a capture records nothing. Measured on an H100 for
        the Qwen3-0.6B config, 50 FULL graphs: capture 1.9 s instead of 4.7 s from warm caches, same tokens.
        ember's kernels pick their launch parameters without autotuning, so no kernel times itself in a capture.
        """
        ordered = sorted(captures, key=lambda md: -md[1].num_tokens)
        before = Counter(self.graphs_captured)
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        warmup = 0.0
        progress = _Progress(len(ordered))
        warmed_kinds: set[tuple[CUDAGraphMode, bool]] = set()
        for i, (mode, desc) in enumerate(ordered):
            t0 = time.perf_counter()
            if warmup_each or (mode, desc.uniform_decode) not in warmed_kinds:
                warmed_kinds.add((mode, desc.uniform_decode))
                for _ in range(num_warmups):
                    run_step(CUDAGraphMode.NONE, desc)
            warmup += time.perf_counter() - t0
            run_step(mode, desc)
            progress.update(i + 1)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        progress.close()
        memory = free_before - torch.cuda.mem_get_info(self.device)[0]
        graphs = {m.name: n - before.get(m, 0) for m, n in self.graphs_captured.items() if n - before.get(m, 0)}
        logger.info("captured %d CUDA-graph descriptors (%s graphs) in %.2f s (warm-up runs %.2f s), graph memory "
                    "%.1f MiB", len(ordered), ", ".join(f"{k} {v}" for k, v in graphs.items()) or "no", seconds,
                    warmup, memory / 2**20)
        return CaptureReport(len(ordered), graphs, seconds, memory, warmup)


class _Progress:
    """A one-line progress bar of the graph count on a terminal's stderr (nothing when stderr is not a terminal)."""

    def __init__(self, total: int):
        import sys
        self.total, self.stream = total, sys.stderr
        self.enabled = total > 0 and self.stream.isatty()

    def update(self, done: int) -> None:
        if self.enabled:
            filled = 30 * done // self.total
            self.stream.write(f"\rcapturing CUDA graphs [{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total}")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
