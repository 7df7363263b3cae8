"""Compile ember's Triton kernels in worker processes at start-up.

A cold start compiles about thirty specializations of ember's @triton.jit kernels (GEMV tiles per row count,
attention tiles per bucket, ...), each at its first launch, one after another in the launching thread: a Triton
frontend pass, MLIR passes and a ptxas run, about 0.4 s each on an H100 host. Threads do not help (Triton's
frontend holds the GIL: 16 threads compiled about 1.4x as fast as one); processes do.

`compile_only(pool)` turns launches of ember's kernels into specializations handed to a `CompilePool`: Triton's
`jit_cache_hook` sees every launch that would compile, with the specialization serialized as JSON, and answering
True makes the launch return without compiling or launching anything. A start-up runs its step shapes once that way
(`ember.runner.warmup.precompile`), the pool's worker processes compile the specializations into Triton's on-disk
cache, and the real steps then load each kernel from that cache instead of compiling it.

What such a dry step computes is garbage: ember's kernels write nothing, so what reads their outputs reads
uninitialised memory. The dry steps must therefore be steps whose host code never reads a device value and whose
device code never indexes with one an ember kernel produced (the runner's forward, its FULL-graph decode tail and
the LM head qualify; the step as a whole does not, since the next step's inputs come from its sampled tokens: the
sampler runs on its own, on zero hidden states, where only torch's argmax and `where` read what its kernels
return). Kernels that produce indices or step metadata (the prepare-inputs kernel, decode plans) are marked
`launch_always`: they compile at once and launch as usual in a dry step too. Kernels that are not ember's
(Inductor's, a plug-in's) launch as usual.

A worker is `python -m ember.kernels.precompile`: it reads one JSON request a line on stdin (kernel module and name,
the specialization, the target, and the launching process's Triton environment variables at the launch) and answers
one JSON line on stdout (the compiled kernel's hash, or the error).
It never touches the GPU. A specialization it cannot compile is reported and left to compile, and to fail loudly,
at its real launch.

On by default with CUDA (`triton_compile_workers=None`: one fewer than the CPUs, at most 12; 0 turns it off, and so
does `EMBER_HOOKS=compile_workers=off`: this is the `compile_workers` hook of ember.kernels.hooks). Every CUDA start
pins TRITON_PTXAS_PATH first (`triton_key.pin_ptxas`).
Triton keys its cache with the ptxas version it reads at a process's first compile, but runs whatever that variable
names at each compile, and torch's Inductor points it at torch's ptxas (CUDA 13.0 on the H100 host, where Triton 3.6
ships 12.8) only at its first kernel, after the start-up's first compiles. The launching process so keyed every kernel
with 12.8, the workers with another version, and it found none of their entries and compiled each kernel again (the
capture wrote 11 new cache entries after them). Each job also carries the launching process's Triton variables
(`triton_environment`), which the worker takes before it compiles. With the pin, measured on an H100 host (Qwen3-0.6B
config, empty caches, `LLM(...)` to ready, interleaved, one lease): 12 workers 22.1 / 27.2 s against 25.0 / 26.8 s
without. The workers compiled the 26 specializations they were handed and the capture fell from 8.4-9.2 s to 1.5-2.2 s,
but the 72 dry steps took 6.8-9.1 s: every dry launch of a key went through Triton's binder and serialized its
specialization for this module's hook again. The hook now says it answers the same for a key (`answers_per_key`), and
ember's launcher returns at once on a key it took. Then, in another lease: 12 workers 18.48 / 21.51 s against 25.77 s
without (dry steps 4.0 / 3.6 s, the workers' wait 1.7 / 2.4 s after them, capture 1.57 / 2.17 against 8.84 s, warm-up
1.43 / 1.82 against 3.51 s). The step sampler's kernels (four of the partial kernel and the noise kernel) still compiled
in the launching process; the dry pass now runs the sampler with each sampling mix of the warm-up too, and ember's
kernels hash their callees before merging their constants (`triton_key.order_dependency_hashes`: Triton 3.6 gave a
kernel another source hash after other kernels had compiled, so the workers, a cold start and the warm start after it
keyed the sampler's kernels and the split-KV combine differently). Then, on one host, interleaved: cold 22.60 / 24.46 s
with 12 workers against 30.91 / 31.48 s without; nothing compiled again in the warm starts after them. ember's kernels
use ember's own launcher (`ember.kernels.launcher`) unless its `fast_launch` hook is off, so the C launchers the
workers build for Triton's path only serve that case."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Iterator

from ember.kernels.triton_key import installed_key, use_key

logger = logging.getLogger("ember")


def launch_always(kernel):
    """Mark a @triton.jit kernel (a decorator above `triton.jit`) to compile and launch inside `compile_only` too:
    its outputs are indices or metadata that later kernels index with."""
    kernel.ember_launch_always = True
    return kernel


def _dry(jit_function) -> bool:
    module = getattr(jit_function, "module", None) or getattr(getattr(jit_function, "fn", None), "__module__", "")
    return str(module).startswith("ember.") and not getattr(jit_function, "ember_launch_always", False)


# ---- the worker side ------------------------------------------------------------------------------------------

def _tuples(value):
    """JSON turned the specialization's tuples into lists: turn them back, nested ones too."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _constant(value):
    import triton.language as tl
    if isinstance(value, str) and tl.dtype.is_dtype(value):
        return tl.dtype(value)
    if isinstance(value, dict) and "constexpr" in value:
        return tl.constexpr(_tuples(value["constexpr"]))
    if isinstance(value, dict) and "jit_function" in value:
        module, _, name = value["jit_function"].partition(":")
        return _resolve(module, name)
    return _tuples(value)


def _resolve(module: str, name: str):
    """The JITFunction `name` of `module` (compiled even where TRITON_INTERPRET made it an interpreted one)."""
    from triton.runtime.jit import JITFunction
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj if isinstance(obj, JITFunction) else JITFunction(obj.fn)


def compile_specialization(module: str, name: str, spec: str, target) -> str:
    """Compile kernel `name` of `module` for one specialization (the JSON Triton's jit_cache_hook hands out) and
    `target` (backend, arch, warp size) into Triton's cache; returns the compiled kernel's hash."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    data = json.loads(spec)
    fn = _resolve(module, name)
    constexprs = {tuple(k): _constant(v) for k, v in zip(data["constant_keys"], data["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"])}
    signature = {k: _tuples(v) for k, v in data["signature"].items()}
    options = {k: _tuples(v) for k, v in data["options"].items()}
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(*target), options=options)
    _build_launcher(compiled)
    return compiled.hash


def _build_launcher(compiled) -> None:
    """Where Triton builds a C launcher per kernel signature (3.6 does, with the host compiler, into its cache), build
    it here too, so the launching process loads that as well; best effort: it needs the GPU driver's library, not a
    GPU, and a Triton without such launchers (or a host without the library) just skips it."""
    try:
        from triton.runtime import driver
        driver.active.launcher_cls(compiled.src, compiled.metadata)
    except Exception as e:   # the launching process builds it then, as without workers
        logger.debug("no launcher built in the compile worker: %s", e)


# what a worker takes from each job before it compiles: Triton reads these as it compiles, some enter the key
_TRITON_ENV_PREFIXES = ("TRITON_", "MLIR_", "LLVM_")


def triton_environment() -> dict[str, str]:
    """The environment variables Triton reads as it compiles, as this process has them now."""
    return {k: v for k, v in os.environ.items() if k.startswith(_TRITON_ENV_PREFIXES)}


def _mirror_environment(env: dict[str, str]) -> None:
    """Make this process's Triton variables exactly `env`: set those it names, drop the others."""
    for k in [k for k in os.environ if k.startswith(_TRITON_ENV_PREFIXES) and k not in env]:
        del os.environ[k]
    os.environ.update(env)


def _serve() -> None:
    """A worker's loop: one JSON request a line in, one JSON answer a line out, until stdin closes."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                       # whatever else prints goes to stderr, never into the answers
    importlib.import_module("triton.compiler")     # loaded before the first request
    key = os.environ.get("EMBER_TRITON_KEY")
    if key:                             # the parent's: no worker hashes Triton's library again
        use_key(key)
    for line in sys.stdin:
        job = json.loads(line)
        t0 = time.perf_counter()
        if "env" in job:
            _mirror_environment(job["env"])
        try:
            answer = {"hash": compile_specialization(job["module"], job["name"], job["spec"], job["target"])}
        except Exception as e:   # reported to the parent, which leaves the kernel to its real launch
            answer = {"error": f"{type(e).__name__}: {e}"}
        answer["seconds"] = time.perf_counter() - t0
        answers.write(json.dumps(answer) + "\n")


# ---- the parent side ------------------------------------------------------------------------------------------

# how long a start-up waits for its workers after the dry steps: they take seconds (2-8 s for the ~30 specializations
# of a cold start on an H100 host); one that hangs must not hang the start-up, and its kernels compile at launch
WAIT_S = 120.0


class CompilePool:
    """`workers` worker processes, each driven by a thread of its own; `submit` queues a specialization, `wait`
    returns (compiled, failed) once all are done or its time is up, `close` ends the workers (killing any that
    hangs). The processes start at once, so their imports overlap whatever the parent does next."""

    command = (sys.executable, "-m", "ember.kernels.precompile")     # one worker process

    def __init__(self, workers: int, target):
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"a compile pool needs at least one worker, got {workers!r}")
        self.workers = workers
        self.target = list(target)
        self.futures: list[Future] = []
        self.errors: list[str] = []
        self._local = threading.local()
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._closed = False
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="ember-triton-compile")
        for _ in range(workers):
            self._threads.submit(self._process)

    def _process(self) -> subprocess.Popen:
        proc = getattr(self._local, "proc", None)
        if proc is None or proc.poll() is not None:
            root = str(Path(__file__).resolve().parents[2])    # ember importable in the worker, as it is here
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
            key = installed_key()
            if key is not None:
                env["EMBER_TRITON_KEY"] = key
            with self._lock:     # no process starts once `close` has taken the list of those to end
                if self._closed:
                    raise RuntimeError("the compile pool is closed")
                proc = subprocess.Popen(list(self.command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True, env=env)
                self._procs.append(proc)
            self._local.proc = proc
        return proc

    def _request(self, job: dict) -> dict:
        proc = self._process()
        proc.stdin.write(json.dumps(job) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"Triton compile worker {proc.pid} exited with code {proc.wait()}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{job['module']}.{job['name']}: {answer['error']}")
        return answer

    def submit(self, module: str, name: str, spec: str) -> Future:
        if self._closed:
            raise RuntimeError("the compile pool is closed")
        future = self._threads.submit(self._request, {"module": module, "name": name, "spec": spec,
                                                      "target": self.target, "env": triton_environment()})
        self.futures.append(future)
        return future

    def wait(self, timeout: float | None = None) -> tuple[int, int]:
        """Wait for every submitted compile, for at most `timeout` seconds in all: (compiled, failed), where a
        compile without an answer by then counts as failed (its kernel compiles at its launch, as without workers);
        the failures' messages are in `errors`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        compiled = failed = 0
        for future in self.futures:
            try:
                future.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
                compiled += 1
            except FutureTimeout:
                failed += 1
                self.errors.append(f"no answer within {timeout:g} s")
            except Exception as e:
                failed += 1
                self.errors.append(str(e))
        self.futures = []
        return compiled, failed

    def close(self, grace: float = 10.0) -> None:
        """End the workers: they exit when their stdin closes, and one that has not within `grace` seconds (a hung
        compile) is killed; then the threads that drove them, whose reads end with their process."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs = list(self._procs)
        for proc in procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        for proc in procs:
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._threads.shutdown(wait=True, cancel_futures=True)
        for proc in procs:
            with contextlib.suppress(OSError):
                proc.stdout.close()

    def __enter__(self) -> "CompilePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def keys_name_current_ptxas(arch: int) -> bool:
    """Whether the ptxas version in this process's Triton cache keys is that of the ptxas it would run now.

    Triton reads the version once a process (`get_ptxas_version` is cached) but runs whatever TRITON_PTXAS_PATH
    names at each compile. In a process whose keys took their version before the variable changed, a worker (a
    fresh process) keys the same kernel differently, and the launching process would compile it again."""
    import subprocess as sp
    from triton.backends.nvidia import compiler as nvidia
    keyed = nvidia.get_ptxas_version(arch)
    try:
        current = sp.check_output([nvidia.get_ptxas(arch).path, "--version"]).decode("utf-8")
    except (OSError, sp.CalledProcessError):
        return False
    return keyed == current


def current_target() -> tuple:
    """(backend, arch, warp size) of the active Triton driver's device."""
    from triton.runtime import driver
    t = driver.active.get_current_target()
    return t.backend, t.arch, t.warp_size


@contextlib.contextmanager
def compile_only(pool: CompilePool) -> Iterator[set[tuple[str, str, str]]]:
    """For the duration, a launch of one of ember's Triton kernels (but `launch_always` ones) that would compile
    hands its specialization to `pool` and launches nothing; yields the set of (module, name, specialization) handed
    over. Other kernels launch as usual. Triton's previous jit_cache_hook is restored on exit and still sees every
    launch that is not ember's."""
    from triton import knobs
    previous = knobs.runtime.jit_cache_hook
    handed: set[tuple[str, str, str]] = set()

    def hook(*args, **kwargs):
        info, compile_args = kwargs.get("fn"), kwargs.get("compile") or {}
        spec = compile_args.get("specialization_data")
        if info is None or spec is None or not _dry(info.jit_function):
            return previous(*args, **kwargs) if previous is not None else None
        entry = (str(info.module), str(info.name), spec)
        if entry not in handed:
            handed.add(entry)
            pool.submit(*entry)
        return True

    hook.answers_per_key = True         # ember's launcher returns at once on a key this hook already took
    knobs.runtime.jit_cache_hook = hook
    try:
        yield handed
    finally:
        knobs.runtime.jit_cache_hook = previous


if __name__ == "__main__":
    _serve()
