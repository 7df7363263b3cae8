"""`make_executor`: what runs the model for an engine core. One rank: the `ModelRunner` itself. Several: a
`MultiprocExecutor`, which runs rank 0's `ModelRunner` in this process and one worker process a further rank
(`ember.executor.worker`), and has the runner's surface (`execute_async`, `update_table`, `all_logits`,
`prompt_logprobs`, `launch_forward` and `launch_sample` of a step with grammar rows, `shutdown`, and the sizes the
engine reads).

Each call writes its message (the `StepInput`, pickled once) to the step ring (`channel.RingWriter`) before rank 0
runs its own part, so every rank runs the same step at about the same time; each rank keeps its own request table,
builds its own inputs and replays its own graphs; only rank 0's results come to the host.

A worker that dies, or ranks that stop answering, must not hang the engine. A monitor thread waits on every
worker's status pipe (its end closes when the worker exits, however it exits) and times each call. A dead worker
or a call older than `worker_timeout_s` makes the executor failed: the call in progress raises `WorkerFailure`
naming the rank (a gloo collective with a dead peer fails by itself; NCCL's communicators are aborted), and so does
every later call. Where rank 0 stays stuck in a collective anyway, the monitor logs the cause and exits the process
after `STUCK_GRACE_S`.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

import torch

from ember.config import EngineConfig
from ember.distributed.channel import RingWriter
from ember.distributed.parallel_state import (COLLECTIVE_ENV, Rendezvous, init_tensor_parallel, leave_tensor_parallel,
                                              open_store)
from ember.executor.start import ForkedProcess, start_method, start_worker
from ember.executor.worker import WorkerArgs
from ember.runner.model_runner import ModelRunner

logger = logging.getLogger("ember")

STUCK_GRACE_S = 15.0        # how long rank 0 may stay inside a call after a worker failed, before the process exits
JOIN_S = 10.0               # how long a worker has to exit at shutdown before it is killed


class WorkerFailure(RuntimeError):
    """A tensor-parallel worker died or stopped answering; the executor is unusable (restart the engine)."""


def make_executor(config: EngineConfig, model_path: str, hf_config=None, load_format: str = "auto",
                  rendezvous: Rendezvous | None = None):
    """Rank 0's `ModelRunner` for `tensor_parallel_size` 1, else a `MultiprocExecutor` of that many ranks meeting
    at `rendezvous` (None: `Rendezvous.from_environment()`; a data-parallel replica is given its own)."""
    if config.parallel.tensor_parallel_size == 1:
        return ModelRunner(config, model_path, hf_config=hf_config, load_format=load_format)
    return MultiprocExecutor(config, model_path, hf_config=hf_config, load_format=load_format, rendezvous=rendezvous)


@dataclass
class _Worker:
    rank: int
    process: subprocess.Popen | ForkedProcess
    status: Connection
    state: str = "starting"          # "joining", "ready", "exited"
    error: str | None = None


@dataclass
class _Shared:
    """What the monitor thread and the shutdown share with the executor (the executor's finalizer holds this, not
    the executor)."""
    workers: list[_Worker]
    ring: RingWriter | None
    timeout_s: float
    cond: threading.Condition = field(default_factory=threading.Condition)
    failure: WorkerFailure | None = None
    failed_at: float | None = None
    in_call: bool = False           # rank 0 is inside a call (its start-up included): a failure may leave it stuck
    busy_since: float | None = None   # the start of the call in progress that the timeout applies to
    stopping: bool = False
    wake: tuple | None = None       # a pipe that wakes the monitor at shutdown
    monitor: threading.Thread | None = None
    release_graphs: Callable[[], int] | None = None    # rank 0's runner's, once it is built


class MultiprocExecutor:
    """Rank 0's `ModelRunner` here and ranks 1..N-1 in worker processes, one a GPU; the runner's surface."""

    def __init__(self, config: EngineConfig, model_path: str, hf_config=None, load_format: str = "auto",
                 rendezvous: Rendezvous | None = None):
        size = config.parallel.tensor_parallel_size
        device_type = torch.device(config.device).type
        _check_shardable(config, model_path, hf_config)
        for name, value in COLLECTIVE_ENV.items():
            os.environ.setdefault(name, value)
        timeout = config.parallel.worker_timeout_s
        rendezvous = rendezvous if rendezvous is not None else Rendezvous.from_environment()
        store = open_store(rendezvous, 0, size, timeout)
        rendezvous = Rendezvous(rendezvous.host, store.port)
        busy_wait_s = 1.0 if device_type == "cuda" else 0.0     # the CPU's cores are the ranks' compute
        self._shared = shared = _Shared([], RingWriter(size - 1, busy_wait_s=busy_wait_s), timeout)
        self._finalizer = weakref.finalize(self, _shutdown, shared)
        method, why = start_method(device_type)
        logger.info("tensor parallel: starting %d workers by %s (%s)", size - 1, method, why)
        for rank in range(1, size):
            args = WorkerArgs(rank, size, rank, rendezvous, config, model_path, hf_config, load_format,
                              shared.ring.handle, busy_wait_s, logger.getEffectiveLevel())
            shared.workers.append(_start(args, method))
        wake_r, wake_w = os.pipe()
        shared.wake = (wake_r, wake_w)
        shared.monitor = threading.Thread(target=_monitor, args=(shared,), name="ember-tp-monitor", daemon=True)
        shared.monitor.start()
        shared.in_call = True
        try:
            self._wait_for("joining")
            init_tensor_parallel(0, size, 0, device_type, store, timeout, config.parallel.symm_mem_all_reduce)
            self.runner = ModelRunner(config, model_path, hf_config=hf_config, load_format=load_format)
            shared.release_graphs = self.runner.release_graphs
            self._wait_for("ready")
        except BaseException as e:
            failure = self._failure_after(e)
            self.shutdown()
            if failure is not None:
                raise failure from e
            raise
        finally:
            shared.in_call = False
        logger.info("tensor parallel: %d ranks ready (workers %s)", size,
                    ", ".join(f"rank {w.rank} pid {w.process.pid}" for w in shared.workers))

    # ---- the runner's surface --------------------------------------------------------------------------------
    @property
    def driver(self) -> ModelRunner:
        """Rank 0's runner (in this process)."""
        return self.runner

    @property
    def worker_pids(self) -> dict[int, int]:
        """The process id of each worker, by rank."""
        return {w.rank: w.process.pid for w in self._shared.workers}

    def __getattr__(self, name: str):
        # sizes and start-up facts of rank 0's runner (max_model_len, vocab_size, num_blocks, attn, hf_config,
        # model, device, dtype, times, ...): the same on every rank, or rank 0's own
        if name == "runner":
            raise AttributeError(name)
        return getattr(self.runner, name)

    def execute_async(self, step):
        """Hand the step to every rank and launch rank 0's; returns rank 0's output on its way to the host."""
        return _WatchedOutput(self._call("execute", step, self.runner.execute_async), self)

    def execute(self, step):
        return self.execute_async(step).result()

    def launch_forward(self, step, split: bool = True, idle=None):
        """A step with grammar rows, its first launch on every rank (`runner.constrained_step`): rank 0's
        `ConstrainedStep`."""
        return self._call("forward", (step, split), lambda message: self.runner.launch_forward(*message, idle))

    def launch_sample(self, launched, num_rows: int):
        """Its second, once rank 0's engine has filled the bitmask: every rank samples under rank 0's rows."""
        return _WatchedOutput(self._call("sample", num_rows, lambda n: self.runner.launch_sample(launched, n)), self)

    def update_table(self, step) -> None:
        self._call("update", step, self.runner.update_table)

    def all_logits(self, step):
        return self._call("logits", step, self.runner.all_logits)

    def prompt_logprobs(self, step, k: int):
        """Rank 0's prompt logprobs; the other ranks run the same chunks of the LM head (their `k` does not matter)."""
        return self._call("prompt_logprobs", step, lambda s: self.runner.prompt_logprobs(s, k))

    def shutdown(self) -> None:
        """Stop the workers (each finishes the messages before the end) and leave the group; idempotent."""
        self._finalizer()

    # ---- failures ---------------------------------------------------------------------------------------------
    def _call(self, kind: str, step, run):
        def send_and_run():
            self._shared.ring.send(pickle.dumps((kind, step), protocol=5), self._raise_if_failed)
            return run(step)
        return self._guard(send_and_run)

    def _guard(self, wait):
        """Run `wait` (a call: the step sent and rank 0's part run, or a wait on rank 0's result) under the watch
        that turns an error into the workers' failure."""
        shared = self._shared
        self._raise_if_failed()
        shared.in_call, shared.busy_since = True, time.monotonic()
        try:
            return wait()
        except WorkerFailure:
            raise
        except BaseException as e:
            raise self._failure_after(e, broken=True) from e
        finally:
            shared.in_call, shared.busy_since = False, None

    def _raise_if_failed(self) -> None:
        if self._shared.failure is not None:
            raise self._shared.failure

    def _failure_after(self, error: BaseException, broken: bool = False) -> WorkerFailure | None:
        """The worker failure behind `error` (a collective with a dead peer fails before its exit is seen: wait a
        moment for it); with `broken`, any error leaves the ranks out of step, so the executor fails with it."""
        shared = self._shared
        with shared.cond:
            shared.cond.wait_for(lambda: shared.failure is not None, timeout=2.0)
            if shared.failure is None and broken:
                _fail(shared, WorkerFailure(f"rank 0 failed in a step ({type(error).__name__}: {error}); ranks that "
                                            f"have not taken the step: {_behind(shared) or 'none'}; the ranks are out "
                                            f"of step, so this engine stops: restart it"))
            return shared.failure

    def _wait_for(self, state: str) -> None:
        """Wait until every worker has reached `state` ("joining", "ready"), or raise its failure."""
        shared = self._shared
        order = ("starting", "joining", "ready")
        with shared.cond:
            done = shared.cond.wait_for(
                lambda: shared.failure is not None or all(
                    w.state in order and order.index(w.state) >= order.index(state) for w in shared.workers),
                timeout=shared.timeout_s)
        self._raise_if_failed()
        if not done:
            slow = [w.rank for w in shared.workers if w.state != state]
            raise WorkerFailure(f"tensor-parallel ranks {slow} did not report {state!r} within worker_timeout_s "
                                f"{shared.timeout_s:.0f} s")


def _check_shardable(config: EngineConfig, model_path: str, hf_config) -> None:
    """Build rank 0's shard on the meta device (no memory): a model the ranks cannot split (heads, KV heads, MLP
    width, fp8 weight blocks a shard would cut) is refused before any worker starts, with the reason."""
    from ember.config import resolve_dtype
    from ember.distributed.shard import ShardSpec
    from ember.models.loader import build_on_meta, load_config
    from ember.quant import resolve_quant_config
    hf_config = hf_config if hf_config is not None else load_config(model_path)
    device = torch.device(config.device)
    dtype = resolve_dtype(config.model.dtype, device, hf_config)
    quant = resolve_quant_config(hf_config, config.model.quantization, dtype, device)
    parallel = config.parallel
    build_on_meta(hf_config, dtype, quant, ShardSpec(0, parallel.tensor_parallel_size, parallel.enable_expert_parallel),
                  config.model.model_impl)


class _WatchedOutput:
    """Rank 0's launched step: `result()` waits for it under the executor's watch."""

    def __init__(self, inner, executor: MultiprocExecutor):
        self._inner, self._executor = inner, executor

    def result(self):
        return self._executor._guard(self._inner.result)


def _start(args: WorkerArgs, method: str) -> _Worker:
    """Start rank `args.rank` by `method` (`executor.start`), its status pipe's write end its own; a fresh
    interpreter gets this process's import path and the collective settings of `COLLECTIVE_ENV`."""
    process, read_fd = start_worker(args, method, COLLECTIVE_ENV)
    return _Worker(args.rank, process, Connection(read_fd, writable=False))


def _fail(shared: _Shared, failure: WorkerFailure) -> None:
    """Record the first failure, wake every waiter, and abort NCCL's communicators so that a collective blocked on
    a dead peer returns."""
    with shared.cond:
        if shared.failure is not None or shared.stopping:
            return
        shared.failure, shared.failed_at = failure, time.monotonic()
        shared.cond.notify_all()
    logger.error("%s", failure)
    try:
        import torch.distributed as dist
        if dist.is_initialized() and dist.get_backend() != "gloo":
            dist.distributed_c10d._abort_process_group()
    except Exception as e:      # noqa: BLE001 - the stuck-call exit below still applies
        logger.warning("aborting the process group failed: %s", e)


def _monitor(shared: _Shared) -> None:
    """Watch the workers' status pipes and the call in progress until shutdown (see the module docstring)."""
    wake_r = shared.wake[0]
    while not shared.stopping:
        pipes = {w.status: w for w in shared.workers if w.state != "exited"}
        for ready in wait(list(pipes) + [wake_r], timeout=1.0):
            if ready == wake_r:
                return
            _read_status(shared, pipes[ready])
        now = time.monotonic()
        busy = shared.busy_since
        if busy is not None and now - busy > shared.timeout_s + 5.0:
            _fail(shared, WorkerFailure(f"a tensor-parallel call has waited {now - busy:.0f} s, more than "
                                        f"worker_timeout_s {shared.timeout_s:.0f} s; ranks that have not taken the "
                                        f"last step: {_behind(shared) or 'none (a collective or kernel hangs)'}"))
        if shared.failure is not None and shared.in_call and now - shared.failed_at > STUCK_GRACE_S:
            logger.critical("rank 0 is still inside a call %.0f s after: %s; exiting", now - shared.failed_at,
                            shared.failure)
            logging.shutdown()
            os._exit(1)


def _behind(shared: _Shared) -> list[int]:
    """The ranks that have not read the last message written to the ring."""
    ring = shared.ring
    if ring is None:
        return []
    return [w.rank for w in shared.workers if w.state == "ready" and ring.consumed(w.rank - 1) < ring.published]


def _read_status(shared: _Shared, worker: _Worker) -> None:
    try:
        kind, value = worker.status.recv()
    except (EOFError, OSError):
        worker.state = "exited"
        try:
            code = worker.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = None
        if not shared.stopping:
            detail = f"; its error: {worker.error}" if worker.error else ""
            _fail(shared, WorkerFailure(f"tensor-parallel worker rank {worker.rank} (pid {worker.process.pid}) "
                                        f"exited with code {code}{detail}"))
        with shared.cond:
            shared.cond.notify_all()
        return
    with shared.cond:
        if kind == "error":
            worker.error = value
        else:
            worker.state = kind
        shared.cond.notify_all()


def _shutdown(shared: _Shared) -> None:
    """End the workers (a "shutdown" message, then a kill after JOIN_S), the monitor, the ring and the group."""
    with shared.cond:
        if shared.stopping:
            return
        shared.stopping = True
    told = False
    if shared.ring is not None and shared.failure is None:
        try:
            shared.ring.send(pickle.dumps(("shutdown", None)), _give_up_after(JOIN_S))
            told = True
        except Exception:       # noqa: BLE001 - the workers are killed below
            pass
    if told:        # with the workers, which leave on the message (NCCL's teardown waits for peers'); graphs first
        leave_tensor_parallel(release=shared.release_graphs)
    deadline = time.monotonic() + JOIN_S
    for worker in shared.workers:
        try:
            worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()
    if shared.wake is not None:
        os.write(shared.wake[1], b"x")
        if shared.monitor is not None and shared.monitor is not threading.current_thread():
            shared.monitor.join()
        os.close(shared.wake[0])
        os.close(shared.wake[1])
    for worker in shared.workers:
        worker.status.close()
    if shared.ring is not None:
        shared.ring.close()
        shared.ring = None
    if not told:
        leave_tensor_parallel()     # after the workers' exit or kill: a group some rank left in a failure


def _give_up_after(seconds: float):
    deadline = time.monotonic() + seconds

    def check() -> None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the workers did not take the shutdown message within {seconds:.0f} s")
    return check
