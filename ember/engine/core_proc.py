"""The engine core in a process of its own: a loop that takes the front end's messages, steps the core while it
has work, and sends each step's outputs back, over zmq sockets (`ember.engine.wire`).

The loop is single-threaded: a step's host work, reading the inputs that arrived during it (a poll that does not
wait while there is work) and encoding its outputs. It sleeps in a poll only when idle. Its host time, steps less
their device waits plus the messages' handling, goes to the front end with every step's stats (`busy_s`).

The process ignores SIGINT and SIGTERM: the front end owns shutdown (a terminal's Ctrl-C reaches the whole
process group, and a front end that drains must keep its core). It exits on the front end's SHUTDOWN message, or
when the front end's process is gone (its parent changes), so that a killed front end does not leave a core
holding a GPU.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from ember.config import EngineConfig

logger = logging.getLogger("ember")

IDLE_POLL_MS = 500           # how often an idle core looks for its parent
PARENT_CHECK_STEPS = 64      # how often a busy one does
MEMORY_PERIOD_S = 1.0        # how often a busy core reads its memory use for the stats


@dataclass(frozen=True)
class CoreProcessArgs:
    """What a core process needs, sent once when it is spawned (this is pickled; nothing after it is)."""
    config: EngineConfig
    model_path: str
    hf_config: object
    load_format: str
    tokenizer: object              # the front end's (its EOS ids end requests; structured output compiles with it)
    input_address: str
    output_address: str
    replica: int
    parent_pid: int
    num_threads: int | None        # torch's intra-op threads (the front end's count), None: torch's default
    log_level: int
    rendezvous: object = None      # where this replica's tensor-parallel ranks meet (None: the environment's)


def run_engine_core(args: CoreProcessArgs) -> None:
    """The core process's entry point: start the core, say READY (or FATAL, with the reason), serve until told to
    stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s core{args.replica} %(levelname)s %(message)s")
    logging.getLogger("ember").setLevel(args.log_level)
    import zmq
    from ember.engine import wire
    codec = wire.Codec()
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(args.input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 5000)
    outputs.connect(args.output_address)
    code = 0
    try:
        try:
            core = _start_core(args)
        except BaseException as exc:   # noqa: BLE001 - the front end must learn why, not just that it exited
            outputs.send_multipart([wire.header(wire.FATAL, args.replica),
                                    codec.encode(f"start-up failed: {_describe(exc)}")])
            code = 1
            return
        outputs.send_multipart([wire.header(wire.READY, args.replica), codec.encode(core.info())])
        loop = CoreLoop(core, inputs, outputs, codec, args.replica, args.parent_pid)
        try:
            loop.run()
        except BaseException as exc:   # noqa: BLE001 - the same: a dying core names its cause
            outputs.send_multipart([wire.header(wire.FATAL, args.replica),
                                    codec.encode(f"the engine core stopped: {_describe(exc)}")])
            code = 1
        finally:
            core.shutdown()
    finally:
        inputs.close(0)
        outputs.close()
        context.term()
        sys.stdout.flush()
        sys.stderr.flush()
        if code:
            os._exit(code)


def _start_core(args: CoreProcessArgs):
    if args.num_threads is not None:
        import torch
        torch.set_num_threads(args.num_threads)
    from ember.engine.core import EngineCore
    return EngineCore(args.config, args.model_path, args.hf_config, args.load_format, args.tokenizer,
                      rendezvous=args.rendezvous)


def _describe(exc: BaseException) -> str:
    """The exception and where it was raised, in a few lines."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = "; ".join(f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" for f in frames)
    return f"{type(exc).__name__}: {exc}" + (f" (at {where})" if where else "")


class CoreLoop:
    """Serves one core: inputs in, a step, outputs out, until SHUTDOWN or the parent is gone."""

    def __init__(self, core, inputs, outputs, codec, replica: int, parent_pid: int):
        from ember.engine import wire
        self.core, self.inputs, self.outputs, self.codec = core, inputs, outputs, codec
        self.wire = wire
        self.replica = replica
        self.parent_pid = parent_pid
        self.io_s = 0.0              # host time outside steps: reading, applying and sending messages
        self.stopping = False
        self._outputs_header = wire.header(wire.OUTPUTS, replica)
        self._changed = False        # an input changed the load while idle: tell the front end
        # a call runs only while no request is in flight: it waits, and the requests sent after it wait behind it
        self._deferred: collections.deque = collections.deque()
        self._held = False           # between the front end's HOLD and RELEASE: read inputs, take no step
        self._memory = (0, 0, 0)     # device and resident memory as last read, and when
        self._memory_at = -MEMORY_PERIOD_S

    def run(self) -> None:
        import zmq
        core, inputs = self.core, self.inputs
        steps = 0
        while not self.stopping:
            if self._held:         # a batch of requests is arriving: no step until all of it has
                if inputs.poll(IDLE_POLL_MS, zmq.POLLIN):
                    self._read_inputs()
                else:
                    self._check_parent()
                continue
            if core.has_unfinished():
                if inputs.poll(0, zmq.POLLIN):
                    self._read_inputs()
                    if self.stopping:
                        break
                self._send_outputs(core.step())
                steps += 1
                if steps % PARENT_CHECK_STEPS == 0:
                    self._check_parent()
                continue
            if self._deferred:
                self._run_deferred()
                continue
            if self._changed:
                self._send_outputs(core.take_outputs())
            if inputs.poll(IDLE_POLL_MS, zmq.POLLIN):
                self._read_inputs()
            else:
                self._check_parent()

    def _check_parent(self) -> None:
        if os.getppid() != self.parent_pid:
            logger.error("the front end (pid %d) is gone; the engine core exits", self.parent_pid)
            self.stopping = True

    def _read_inputs(self) -> None:
        import zmq
        start = time.perf_counter()
        wire, codec, core = self.wire, self.codec, self.core
        refused = []
        while True:
            try:
                head, payload = self.inputs.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            kind = head[0]
            if kind in (wire.ADD, wire.CALL) and (self._deferred or (kind == wire.CALL and core.has_unfinished())):
                self._deferred.append((kind, payload))
            elif kind == wire.ADD:
                self._add(codec.decode_request(payload), refused)
            elif kind == wire.ABORT:
                core.abort_requests(codec.decode_ids(payload))
            elif kind == wire.FINISH:
                core.finish_requests(codec.decode_ids(payload))
            elif kind == wire.CALL:
                self._call(codec.decode_call(payload))
            elif kind in (wire.HOLD, wire.RELEASE):
                self._held = kind == wire.HOLD
            elif kind == wire.SHUTDOWN:
                self.stopping = True
                break
            self._changed = True
        self.io_s += time.perf_counter() - start
        for request_id, reason in refused:
            out = core.take_outputs()
            out.failed_ids.append(request_id)
            out.failure = reason
            self._send_outputs(out)

    def _add(self, request, refused: list) -> None:
        try:
            self.core.add_request(request)
        except ValueError as exc:     # an id in use: that request fails, nothing else does
            refused.append((request.request_id, str(exc)))

    def _run_deferred(self) -> None:
        """The core is idle: run the calls that waited for it, and add the requests behind them up to the next
        call (which waits for those to finish)."""
        refused = []
        while self._deferred:
            kind, payload = self._deferred[0]
            if kind == self.wire.CALL and self.core.has_unfinished():
                break
            self._deferred.popleft()
            if kind == self.wire.CALL:
                self._call(self.codec.decode_call(payload))
            else:
                self._add(self.codec.decode_request(payload), refused)
        self._changed = True
        for request_id, reason in refused:
            out = self.core.take_outputs()
            out.failed_ids.append(request_id)
            out.failure = reason
            self._send_outputs(out)

    def _call(self, call) -> None:
        try:
            if call.method not in self.wire.CALLS:
                raise ValueError(f"{call.method!r} is not a method a front end may call; "
                                 f"those are {sorted(self.wire.CALLS)}")
            value = getattr(self.core, call.method)(*call.args)
            result = self.codec.encode_call_result(call.call_id, value)
        except Exception as exc:   # noqa: BLE001 - the caller gets the error, the core goes on
            result = self.codec.encode_call_result(call.call_id, error=f"{type(exc).__name__}: {exc}")
        self.outputs.send_multipart([self.wire.header(self.wire.CALL_RESULT, self.replica), result])

    def _send_outputs(self, out) -> None:
        """Send outputs with the load and counters as they are now (this send's own time counts in the next)."""
        start = time.perf_counter()
        self._changed = False
        # reading it costs more than a step's bookkeeping; an idle core's last figures are its current ones
        if start - self._memory_at >= MEMORY_PERIOD_S or not self.core.has_unfinished():
            self._memory, self._memory_at = self.core.memory_use(), start
        out.stats = self.core.load(self.io_s, self._memory)
        self.outputs.send_multipart([self._outputs_header, self.codec.encode_outputs(out)], copy=False)
        self.io_s += time.perf_counter() - start


_SPAWN_LOCK = threading.Lock()


def replica_devices(config: EngineConfig, num_replicas: int) -> list[str | None]:
    """The CUDA_VISIBLE_DEVICES of each replica's process: its own GPUs, in order, from the ones this process may
    use; None (leave the environment as it is) for one replica or on the CPU. ValueError if there are too few."""
    if num_replicas == 1 or not config.device.startswith("cuda"):
        return [None] * num_replicas
    if config.device != "cuda":
        raise ValueError(f"device {config.device!r} names one GPU, but data_parallel_size {num_replicas} puts each "
                         f"replica on its own; use device 'cuda' (or 'auto')")
    per_replica = getattr(getattr(config, "parallel", None), "tensor_parallel_size", 1)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        import torch
        devices = [str(i) for i in range(torch.cuda.device_count())]
    if len(devices) < num_replicas * per_replica:
        raise ValueError(f"data_parallel_size {num_replicas} x tensor_parallel_size {per_replica} needs "
                         f"{num_replicas * per_replica} GPUs, but this process sees {len(devices)} "
                         f"({', '.join(devices) or 'none'}); lower data_parallel_size or make more GPUs visible")
    return [",".join(devices[i * per_replica:(i + 1) * per_replica]) for i in range(num_replicas)]


def replica_rendezvous(config: EngineConfig, num_replicas: int) -> list:
    """Where each replica's tensor-parallel ranks meet (`parallel_state.replica_rendezvous`: a store each, on
    MASTER_PORT + the replica where MASTER_PORT is set); None (the environment's, as in one engine) for one replica
    or one rank. ValueError, before any process starts, when those ports are not free."""
    if num_replicas == 1 or getattr(getattr(config, "parallel", None), "tensor_parallel_size", 1) == 1:
        return [None] * num_replicas
    from ember.distributed.parallel_state import replica_rendezvous as choose
    return choose(num_replicas)


def spawn_cores(config: EngineConfig, model_path: str, hf_config, load_format: str,
                tokenizer, input_addresses: list[str], output_address: str) -> list:
    """Start one core process per input address (the `spawn` method: a forked CUDA context is unusable), each
    seeing only its own GPUs and, under tensor parallel, its ranks meeting at a rendezvous of their own."""
    import multiprocessing

    import torch
    context = multiprocessing.get_context("spawn")
    devices = replica_devices(config, len(input_addresses))
    rendezvous = replica_rendezvous(config, len(input_addresses))
    procs = []
    for replica, (address, visible) in enumerate(zip(input_addresses, devices)):
        args = CoreProcessArgs(config, model_path, hf_config, load_format, tokenizer, address,
                               output_address, replica, os.getpid(), torch.get_num_threads(),
                               logging.getLogger("ember").getEffectiveLevel(), rendezvous[replica])
        proc = context.Process(target=run_engine_core, args=(args,), name=f"ember-core-{replica}")
        # the child takes this process's environment when it starts
        with _SPAWN_LOCK:
            saved = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible
            try:
                proc.start()
            finally:
                if visible is not None:
                    if saved is None:
                        del os.environ["CUDA_VISIBLE_DEVICES"]
                    else:
                        os.environ["CUDA_VISIBLE_DEVICES"] = saved
        procs.append(proc)
    return procs
