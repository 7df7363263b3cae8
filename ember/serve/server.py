"""`ember serve`: bind the address (a busy port fails before anything loads), start the engine cores, each in a
process of its own, then run the app under uvicorn in this process, on that socket, until SIGINT or SIGTERM.

On a signal the server stops accepting connections, refuses new requests on open ones (503), lets the requests in
flight finish for up to `--drain-timeout` seconds, aborts what is left, stops the engine cores and exits 0. If an
engine core's process dies, every open request ends with an error naming it, `/health` answers 503, and the server
exits with status 1 a moment later (`DEAD_EXIT_DELAY_S`: long enough for the error events to go out)."""

from __future__ import annotations

import contextlib
import errno
import logging
import signal
import socket
import sys
import threading

logger = logging.getLogger("ember.serve")

DEAD_EXIT_DELAY_S = 1.0


def served_model_name(args) -> str:
    """The name clients pass as `model`: --served-model-name, else the model or config as given, else the default
    model's folder name."""
    if args.served_model_name:
        return args.served_model_name
    if args.model or args.config:
        return args.model or args.config
    from ember.models.default_model import DEFAULT_MODEL_NAME
    return DEFAULT_MODEL_NAME


def startup_message(name: str, checkpoint, host: str, port: int, core_pids: list[int] = ()) -> str:
    """The lines `ember serve` prints once it serves: which weights, where, and the engine cores' processes."""
    cores = ", ".join(f"{i}: pid {pid}" for i, pid in enumerate(core_pids))
    return (f"ember serve: weights: {checkpoint.describe()}\nember serve: {name} on http://{host}:{port}/v1"
            + (f"\nember serve: engine cores {cores}" if cores else ""))


def make_server(app, host: str, port: int, drain_timeout: float, log_level: str = "warning"):
    """A uvicorn server for `app` that marks the engine front as draining as soon as it is told to exit."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            app.state.ember.front.draining = True
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the signal after its shutdown, so a drained server would die of SIGTERM (exit
            # status 143); one that drained has finished its work and exits 0
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=drain_timeout, timeout_keep_alive=30)
    return DrainingServer(config)


def bound_port(server) -> int:
    """The port a started uvicorn server listens on (useful with port 0)."""
    return server.servers[0].sockets[0].getsockname()[1]


def start_in_thread(server, timeout: float = 60.0) -> threading.Thread:
    """Run a uvicorn server in a daemon thread (no signal handlers there) and wait until it listens."""
    thread = threading.Thread(target=server.run, name="ember-uvicorn", daemon=True)
    thread.start()
    waited = 0.0
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server failed to start; see the log above")
        thread.join(0.02)
        waited += 0.02
        if waited > timeout:
            raise RuntimeError(f"the server did not start within {timeout} s")
    return thread


def reserve_address(host: str, port: int) -> socket.socket:
    """Bind the server's address before the model loads, without listening yet: a port in use fails at once rather
    than after the load, and a client that connects while the model loads is refused rather than left waiting
    (uvicorn listens on this socket once the app starts)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is already in use; stop the process that listens there or pass "
                             f"another --port") from None
        raise ValueError(f"cannot bind {host}:{port} ({exc.strerror or exc}); pass another --host or --port") from None
    return sock


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: the text of a template file, or the value itself when it is a template ('{' in it)."""
    if value is None:
        return None
    from pathlib import Path
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template; give the path of a template "
                     f"file")


def main(args) -> int:
    """Run `ember serve` with parsed arguments; returns the exit status."""
    from ember.args import engine_kwargs
    from ember.llm import engine_setup, start_engine_cores
    from ember.serve.app import build_app
    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting {args.max_waiting} must be >= 0")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout {args.drain_timeout} must be >= 0")
    if args.config and args.model:
        raise ValueError(f"give a model {args.model!r} or --config {args.config!r}, not both")
    chat_template = read_chat_template(getattr(args, "chat_template", None))
    sock = reserve_address(args.host, args.port)
    client = None
    try:
        kwargs = dict(engine_kwargs(args), data_parallel_size=args.data_parallel_size)
        if args.config:
            setup = engine_setup(args.config, load_format="dummy", **kwargs)
        else:
            setup = engine_setup(args.model, load_format=args.load_format, **kwargs)
        client = start_engine_cores(setup)
        name = served_model_name(args)
        app = build_app(client, setup, name, max_waiting=args.max_waiting,
                        tool_call_parser=getattr(args, "tool_call_parser", None), chat_template=chat_template)
        port = sock.getsockname()[1]      # the one the system chose, for --port 0
        server = make_server(app, args.host, port, args.drain_timeout, "info" if args.verbose else "warning")
        front = app.state.ember.front
        front.on_dead = lambda error: exit_soon(server)
        print(startup_message(name, setup.checkpoint, args.host, port, [p.pid for p in client.procs]), flush=True)
        server.run(sockets=[sock])
    finally:
        sock.close()
        if client is not None:
            client.shutdown()
    if front.error is not None:
        print(f"ember serve: exiting: {front.error}", file=sys.stderr, flush=True)
        return 1
    return 0


def exit_soon(server) -> None:
    """Make uvicorn shut down after `DEAD_EXIT_DELAY_S` (call on its loop)."""
    import asyncio
    asyncio.get_running_loop().call_later(DEAD_EXIT_DELAY_S, setattr, server, "should_exit", True)
