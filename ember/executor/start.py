"""How a tensor-parallel worker process starts: forked from rank 0's process where that is safe, else a fresh
interpreter (`python -m ember.executor.worker`).

A fork starts in milliseconds with everything rank 0 has imported (torch, ember, transformers: seconds of a fresh
interpreter's start that rank 0 paid before the engine was built); a fresh interpreter pays them again. A fork is
safe only while this process has not initialized the CUDA driver: a child forked after `cuInit` cannot use CUDA.
`ember` sets `PYTORCH_NVML_BASED_CUDA_CHECK=1` on import so that torch's availability checks ask NVML instead of the
driver, and the driver itself is asked here (`cuDeviceGetCount` answers CUDA_ERROR_NOT_INITIALIZED before `cuInit`).

`EMBER_WORKER_START` (`auto`, the default; `fork`; `spawn`) overrides the choice, for A/B runs and debugging;
`fork` is still refused where the driver is initialized.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import subprocess
import sys
import threading
import time

METHODS = ("auto", "fork", "spawn")
_CUDA_ERROR_NOT_INITIALIZED = 3


def cuda_driver_initialized() -> bool:
    """Whether this process has initialized the CUDA driver (True where that cannot be told: assume the worst)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False        # no driver: nothing to inherit
    count = ctypes.c_int(0)
    try:
        return driver.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED
    except AttributeError:
        return True


def start_method(device_type: str) -> tuple[str, str]:
    """("fork" or "spawn", why), from `EMBER_WORKER_START` and this process's state."""
    wanted = os.environ.get("EMBER_WORKER_START", "auto").strip().lower() or "auto"
    if wanted not in METHODS:
        raise ValueError(f"EMBER_WORKER_START={wanted!r}; use one of {', '.join(METHODS)}")
    if wanted == "spawn":
        return "spawn", "EMBER_WORKER_START=spawn"
    if not hasattr(os, "fork"):
        return "spawn", "this platform has no fork"
    if device_type == "cuda" and cuda_driver_initialized():
        why = "this process has initialized the CUDA driver, and a child forked from it could not use CUDA"
        if wanted == "fork":
            raise RuntimeError(f"EMBER_WORKER_START=fork cannot be met: {why}. Build the engine before this "
                               f"process touches CUDA, or leave EMBER_WORKER_START unset")
        return "spawn", why
    return "fork", "EMBER_WORKER_START=fork" if wanted == "fork" else "the CUDA driver is not initialized here"


class ForkedProcess:
    """A forked worker, with the part of `subprocess.Popen`'s surface the executor uses (`pid`, `poll`, `wait`,
    `kill`); safe to wait on from two threads."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:       # reaped elsewhere: its code is lost
                    self.returncode = -1
                    return self.returncode
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass


def start_worker(args, method: str, env: dict[str, str]):
    """Start the worker of `args` (a `WorkerArgs`) by `method`, its status pipe's write end handed to it: (its
    process, the read end's file descriptor). `env` is what a fresh interpreter's environment adds to this one's
    (a fork has this process's own)."""
    read_fd, write_fd = os.pipe()
    if method == "fork":
        pid = os.fork()
        if pid == 0:                    # the worker; it never returns into the launching program
            code = 1
            try:
                os.close(read_fd)
                from ember.executor.worker import run
                code = run(args, write_fd, forked=True)
            finally:
                os._exit(code)
        os.close(write_fd)
        return ForkedProcess(pid), read_fd
    process = subprocess.Popen([sys.executable, "-m", "ember.executor.worker"], stdin=subprocess.PIPE,
                               pass_fds=(write_fd,), env={**env, **os.environ,
                                                          "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    os.close(write_fd)
    process.stdin.write(pickle.dumps((args, write_fd), protocol=5))
    process.stdin.close()
    return process, read_fd
