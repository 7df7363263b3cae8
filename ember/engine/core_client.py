"""One interface to an engine core, wherever it runs: `InprocClient` (the core in this process: each call is the
core's own, with no copy and no message) and `MPClient` (cores in processes of their own, one per data-parallel
replica; `ember.engine.core_proc` is the process's side).

A front end adds requests as `EngineCoreRequest`s, aborts them, finishes those whose stop string matched, and
reads `EngineCoreOutputs` with `get_output()`: in-process that runs one step; behind a process boundary it waits
for the next outputs a core sent."""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import shutil
import signal
import tempfile
import time

from ember.config import EngineConfig
from ember.engine.core_io import CoreInfo, CoreStats, EngineCoreOutputs, EngineCoreRequest, PromptLogprobData
from ember.engine.sample_group import sample_request_id


class InprocClient:
    """The engine core in this process, driven by the caller: `get_output()` is one `EngineCore.step()`."""

    def __init__(self, config: EngineConfig, model_path: str, hf_config=None, load_format: str = "auto",
                 tokenizer=None):
        from ember.engine.core import EngineCore     # the front end of cores elsewhere never imports the runner
        self.core = EngineCore(config, model_path, hf_config, load_format, tokenizer)
        self.info: CoreInfo = self.core.info()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request in the core (ValueError if its id is in use)."""
        self.core.add_request(request)

    def abort_requests(self, request_ids) -> None:
        self.core.abort_requests(request_ids)

    def finish_requests(self, request_ids) -> None:
        """Finish requests whose stop string matched."""
        self.core.finish_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        """Run one step and return what it produced."""
        return self.core.step()

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def prompt_logprobs(self, token_ids: list[int], k: int) -> PromptLogprobData:
        return self.core.prompt_logprobs(token_ids, k)

    def shutdown(self) -> None:
        self.core.shutdown()

    def batch(self):
        """Requests added inside are one batch: here they are, since the caller steps the core."""
        return contextlib.nullcontext()


class EngineCoreDead(RuntimeError):
    """An engine core's process exited (or failed to start); the message names the replica, the exit and why."""


class MPClient:
    """Engine cores in processes of their own (spawned: CUDA does not survive a fork), one per data-parallel
    replica, behind one front end. Each request goes to the replica with the fewest unfinished requests (running
    and waiting, as this front end counts them: the core's own count plus those on their way); every replica's
    outputs come back on one socket.

    No thread of its own: `get_output()` waits on the socket and on the cores' process sentinels (offline), or
    `attach` puts both on an asyncio loop, which then decodes each step's outputs as they arrive and learns at once
    of a core that died (the server)."""

    def __init__(self, config: EngineConfig, model_path: str, hf_config=None, load_format: str = "auto",
                 tokenizer=None, num_replicas: int = 1):
        try:
            import msgspec  # noqa: F401 - the messages
            import zmq
        except ImportError as exc:
            raise ImportError(f"an engine core in a process of its own (engine_process, data_parallel_size, ember "
                              f"serve) needs pyzmq and msgspec, and {exc.name} is missing: "
                              f"pip install 'ember[serve]'") from None
        from ember.engine import wire
        from ember.engine.core_proc import spawn_cores
        self._zmq, self._wire = zmq, wire
        self.codec = wire.Codec()
        self.num_replicas = num_replicas
        self._dir = tempfile.mkdtemp(prefix="ember-core-")
        self._context = zmq.Context()
        self._output = self._context.socket(zmq.PULL)
        self._output.bind(f"ipc://{self._dir}/outputs")
        self._inputs = []
        for i in range(num_replicas):
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 1000)
            socket.bind(f"ipc://{self._dir}/inputs{i}")
            self._inputs.append(socket)
        self.stats: list[CoreStats] = [CoreStats() for _ in range(num_replicas)]
        self.num_unfinished = [0] * num_replicas        # requests (samples) sent and not finished, per replica
        self.num_routed = [0] * num_replicas            # requests sent, per replica
        self._owner: dict[str, int] = {}                 # unfinished requests' replicas, by core id
        self.error: EngineCoreDead | None = None
        self._fatal: dict[int, str] = {}
        self._ready = self._stopping = self._closed = False
        self._pending: collections.deque = collections.deque()     # (replica, outputs) received, not yet taken
        self._results: dict[int, object] = {}           # call results received, by call id
        self._futures: dict[int, tuple] = {}            # (future, method) of calls an attached loop waits for
        self._call_ids = itertools.count()
        self._loop = None
        self._on_output = self._on_dead = None
        self.procs = []
        atexit.register(self.shutdown)
        try:
            self.procs = spawn_cores(config, model_path, hf_config, load_format, tokenizer,
                                     [f"ipc://{self._dir}/inputs{i}" for i in range(num_replicas)],
                                     f"ipc://{self._dir}/outputs")
            self._poller = zmq.Poller()
            self._poller.register(self._output, zmq.POLLIN)
            for proc in self.procs:
                self._poller.register(proc.sentinel, zmq.POLLIN)
            infos = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self._ready = True
        self.infos = infos
        self.info: CoreInfo = infos[0]

    # ---- start-up ---------------------------------------------------------------------------------------------
    def _wait_ready(self) -> list[CoreInfo]:
        wire = self._wire
        infos: dict[int, CoreInfo] = {}
        while len(infos) < self.num_replicas:
            events = dict(self._poller.poll(1000))
            for proc in self.procs:
                if proc.sentinel in events:
                    proc.join(5)
            for head, payload in self._receive():
                h = wire.read_header(head)
                if h.kind == wire.READY:
                    infos[h.replica] = self.codec.decode_info(payload)
            for i, proc in enumerate(self.procs):
                if i not in infos and not proc.is_alive():
                    proc.join(5)
                    self._receive()           # its last words, if it sent any
                    raise EngineCoreDead(self._death(i))
        return [infos[i] for i in range(self.num_replicas)]

    def _death(self, replica: int) -> str:
        proc = self.procs[replica]
        code = proc.exitcode
        if code is not None and code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        why = self._fatal.get(replica)
        if why is None and not self._ready:
            why = ("it died before starting the core; if its log above shows an error while importing your "
                   "script, guard the script's entry with `if __name__ == \"__main__\":` (the engine core's process "
                   "is spawned, and a spawned process imports the script that started it)")
        if why is None and (code is None or code > 0):
            why = "its log above may say why"
        return f"the engine core of replica {replica} (pid {proc.pid}) {how}" + (f": {why}" if why else "")

    # ---- requests ---------------------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> int:
        """Send a request to the least-loaded replica; returns the replica."""
        self._check_alive()
        counts = self.num_unfinished
        replica = 0 if self.num_replicas == 1 else min(range(self.num_replicas), key=counts.__getitem__)
        n = request.sampling_params.n
        rid = request.request_id
        for core_id in ([rid] if n == 1 else [sample_request_id(rid, i) for i in range(n)]):
            self._owner[core_id] = replica
        counts[replica] += n
        self.num_routed[replica] += 1
        self._inputs[replica].send_multipart([self._wire.header(self._wire.ADD, replica),
                                              self.codec.encode_request(request)])
        return replica

    @contextlib.contextmanager
    def batch(self):
        """Requests added inside reach each core as one batch: the cores take no step between them (offline
        `generate` then schedules as the in-process core does, whatever the arrival times)."""
        self._check_alive()
        for replica in range(self.num_replicas):
            self._inputs[replica].send_multipart([self._wire.header(self._wire.HOLD, replica), b""])
        try:
            yield
        finally:
            if self.error is None and not self._closed:
                for replica in range(self.num_replicas):
                    self._inputs[replica].send_multipart([self._wire.header(self._wire.RELEASE, replica), b""])

    def abort_requests(self, request_ids) -> None:
        self._send_ids(self._wire.ABORT, request_ids)

    def finish_requests(self, request_ids) -> None:
        """Finish requests whose stop string matched."""
        self._send_ids(self._wire.FINISH, request_ids)

    def _send_ids(self, kind: int, request_ids) -> None:
        by_replica: dict[int, list[str]] = {}
        for core_id in request_ids:
            replica = self._owner.pop(core_id, None)
            if replica is not None:
                self.num_unfinished[replica] -= 1
                by_replica.setdefault(replica, []).append(core_id)
        if self.error is not None or self._closed:
            return
        for replica, ids in by_replica.items():
            self._inputs[replica].send_multipart([self._wire.header(kind, replica), self.codec.encode(ids)])

    def prompt_logprobs(self, token_ids: list[int], k: int) -> PromptLogprobData:
        return self._call("prompt_logprobs", (list(token_ids), k))

    def _call(self, method: str, args: tuple):
        """Call a method of a core and wait for its answer (outputs that arrive meanwhile are kept). The core runs
        it once no request is in flight there."""
        if self._loop is not None:
            raise RuntimeError(f"{method} waits for its answer, which the attached event loop would take; "
                               f"use call_async")
        call_id = self._send_call(method, args)
        while call_id not in self._results:
            self._wait(0.5)
        return self._call_value(method, self._results.pop(call_id))

    def call_async(self, method: str, args: tuple):
        """Call a method of a core from the attached loop; returns a future of its answer."""
        call_id = self._send_call(method, args)
        future = self._loop.create_future()
        self._futures[call_id] = (future, method)
        return future

    def _send_call(self, method: str, args: tuple) -> int:
        self._check_alive()
        counts = self.num_unfinished
        replica = 0 if self.num_replicas == 1 else min(range(self.num_replicas), key=counts.__getitem__)
        call_id = next(self._call_ids)
        self._inputs[replica].send_multipart([self._wire.header(self._wire.CALL, replica),
                                              self.codec.encode(self._wire.WireCall(call_id, method, args))])
        return call_id

    def _call_value(self, method: str, result):
        if result.error is not None:
            raise RuntimeError(f"the engine core's {method} failed: {result.error}")
        return self.codec.decode_value(method, result.value)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise self.error
        if self._closed:
            raise EngineCoreDead("the engine cores have been shut down")

    # ---- outputs ----------------------------------------------------------------------------------------------
    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        """The next outputs any replica sent (waits for them, or `timeout` seconds: then None); EngineCoreDead if a
        core died."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pending:
            self._check_alive()
            wait = 1.0 if deadline is None else deadline - time.monotonic()
            if wait <= 0:
                return None
            self._wait(min(wait, 1.0))
        return self._accept(*self._pending.popleft())

    def _wait(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for a message or a core's exit; take every message there is."""
        events = dict(self._poller.poll(int(timeout * 1000)))
        for proc in self.procs:
            if proc.sentinel in events:
                proc.join(5)      # it is exiting: its sentinel closes a moment before it can be reaped
        self._take_messages()
        self._check_procs()

    def _receive(self) -> list[tuple[bytes, bytes]]:
        """Every message waiting on the output socket, without waiting (FATALs recorded on the way)."""
        zmq, wire = self._zmq, self._wire
        messages = []
        while True:
            try:
                head, payload = self._output.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            if head[0] == wire.FATAL:
                self._fatal[wire.read_header(head).replica] = self.codec.decode_text(payload)
            else:
                messages.append((head, payload))

    def _take_messages(self) -> None:
        wire, codec = self._wire, self.codec
        for head, payload in self._receive():
            h = wire.read_header(head)
            if h.kind == wire.OUTPUTS:
                self._pending.append((h.replica, codec.decode_outputs(payload)))
            elif h.kind == wire.CALL_RESULT:
                result = codec.decode_call_result(payload)
                self._results[result.call_id] = result

    def _check_procs(self) -> None:
        """Raise EngineCoreDead (and remember it) if a core's process has exited while it should serve."""
        if self.error is None and not self._stopping:
            for replica, proc in enumerate(self.procs):
                if not proc.is_alive():
                    proc.join(1)
                    self._receive()
                    self.error = EngineCoreDead(self._death(replica))
                    break
        if self.error is not None:
            raise self.error

    def _accept(self, replica: int, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """Account for a batch of outputs: the replica's stats, and its requests that ended."""
        self.stats[replica] = outputs.stats
        owner, counts = self._owner, self.num_unfinished
        for core_id in outputs.finished:
            if owner.pop(core_id, None) is not None:
                counts[replica] -= 1
        for core_id in outputs.failed_ids:
            if owner.pop(core_id, None) is not None:
                counts[replica] -= 1
        return outputs

    # ---- on an event loop -------------------------------------------------------------------------------------
    def attach(self, loop, on_output, on_dead) -> None:
        """From now on, `loop` takes each batch of outputs as it arrives (`on_output(outputs)`) and the death of a
        core (`on_dead(error)`), on its own thread; call from that thread. One loop at a time."""
        if self._loop is not None:
            raise RuntimeError("the engine cores' outputs already go to another event loop; detach it first")
        self._loop, self._on_output, self._on_dead = loop, on_output, on_dead
        loop.add_reader(self._output.getsockopt(self._zmq.FD), self._on_readable)
        for replica, proc in enumerate(self.procs):
            loop.add_reader(proc.sentinel, self._on_exit, replica)
        loop.call_soon(self._on_readable)       # what arrived before

    def detach(self) -> None:
        """Stop handing outputs to the attached loop (they wait for `get_output()` again)."""
        loop, self._loop = self._loop, None
        if loop is None or loop.is_closed():
            return
        self._fail_calls(EngineCoreDead("the server stopped taking the engine cores' answers"))
        loop.remove_reader(self._output.getsockopt(self._zmq.FD))
        for proc in self.procs:
            loop.remove_reader(proc.sentinel)

    def _on_readable(self) -> None:
        # zmq's descriptor says only that something may have changed: take every message, then check again
        if self._loop is None or self._closed:
            return
        while True:
            self._take_messages()
            if not self._output.getsockopt(self._zmq.EVENTS) & self._zmq.POLLIN:
                break
        for call_id in [c for c in self._results if c in self._futures]:
            future, method = self._futures.pop(call_id)
            result = self._results.pop(call_id)
            if not future.done():
                try:
                    future.set_result(self._call_value(method, result))
                except RuntimeError as exc:
                    future.set_exception(exc)
        while self._pending and self._loop is not None:
            self._on_output(self._accept(*self._pending.popleft()))

    def _on_exit(self, replica: int) -> None:
        proc = self.procs[replica]
        self._loop.remove_reader(proc.sentinel)
        if self._stopping:
            return
        # the sentinel closes while the process exits, a moment before it can be reaped: wait for that
        proc.join(5)
        self._on_readable()          # the outputs it sent before it died come first
        try:
            self._check_procs()
        except EngineCoreDead as error:
            self._fail_calls(error)
            self._on_dead(error)

    def _fail_calls(self, error: BaseException) -> None:
        futures, self._futures = self._futures, {}
        for future, _ in futures.values():
            if not future.done():
                future.set_exception(error)

    # ---- shutdown ---------------------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 10.0) -> None:
        """Tell every core to stop and wait for it (then terminate it); close the sockets."""
        if self._closed:
            return
        self._stopping = True
        self.detach()
        for i, socket in enumerate(self._inputs):
            try:
                socket.send_multipart([self._wire.header(self._wire.SHUTDOWN, i), b""], self._zmq.NOBLOCK)
            except self._zmq.ZMQError:
                pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2)
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        self._closed = True
        for socket in [self._output, *self._inputs]:
            socket.close(0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        atexit.unregister(self.shutdown)
