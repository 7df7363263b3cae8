"""A tensor-parallel worker: rank r > 0 of an engine, in a process of its own (`python -m ember.executor.worker`,
started by `multiproc.MultiprocExecutor`).

It joins the group, builds its `ModelRunner` (its shard of the weights and KV heads, its own request table and
graphs), reports ready, then applies every message rank 0 writes to the step ring in order: a step to run (or a
step with grammar rows in its two parts, the forward, then the sampling under rank 0's bitmask), a table update, a
scoring step, or the end. Each step it runs exactly what rank 0 runs (the same collectives, the
same sampled tokens into its own table) and copies nothing to the host. It reports an error on its status pipe
before it exits, and it exits when rank 0's process is gone.

It is forked from rank 0's process, or started as a fresh interpreter whose arguments come pickled on stdin
(`executor.start`); either way it runs nothing of the launching program (a script without a `__main__` guard starts
no second engine) and leaves by `os._exit`.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import traceback
from dataclasses import dataclass

from ember.config import EngineConfig, usable_cpus
from ember.distributed.channel import ChannelClosed, RingHandle, RingReader
from ember.distributed.parallel_state import Rendezvous, init_tensor_parallel, leave_tensor_parallel, open_store

logger = logging.getLogger("ember")


@dataclass(frozen=True)
class WorkerArgs:
    """Everything rank `rank` needs to start: where the ranks meet, what to load, where its steps come from."""
    rank: int
    size: int
    local_rank: int
    rendezvous: Rendezvous
    config: EngineConfig
    model_path: str
    hf_config: object
    load_format: str
    ring: RingHandle
    busy_wait_s: float
    log_level: int


def _die_with_parent(rank: int) -> None:
    """Ask Linux to kill this process when its parent (rank 0) goes, however it goes (elsewhere the step loop's
    check finds out within a tenth of a second of its next wait), and name it `ember-rank<r>` (what `ps` and
    /proc/<pid>/comm show)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)                                   # PR_SET_PDEATHSIG
            libc.prctl(15, ctypes.c_char_p(f"ember-rank{rank}".encode()))   # PR_SET_NAME
        except OSError:
            pass


def serve(args: WorkerArgs, status) -> None:
    """Start rank `args.rank` and run the messages of the step ring until the end (or rank 0's exit)."""
    import torch
    from ember.runner.model_runner import ModelRunner
    parent = os.getppid()

    def check() -> None:
        if os.getppid() != parent:
            raise ChannelClosed("rank 0's process is gone")

    config = args.config
    if config.device.startswith("cpu"):
        torch.set_num_threads(max(1, usable_cpus() // args.size))   # the ranks share the host's cores
    status.send(("joining", None))
    store = open_store(args.rendezvous, args.rank, args.size, config.parallel.worker_timeout_s)
    init_tensor_parallel(args.rank, args.size, args.local_rank, torch.device(config.device).type, store,
                         config.parallel.worker_timeout_s, config.parallel.symm_mem_all_reduce)
    runner = ModelRunner(config, args.model_path, hf_config=args.hf_config, load_format=args.load_format)
    reader = RingReader(args.ring, args.rank - 1, busy_wait_s=args.busy_wait_s)
    status.send(("ready", runner.num_blocks))
    try:
        while True:
            kind, step = pickle.loads(reader.recv(check))
            if kind == "execute":
                runner.execute_async(step)
            elif kind == "forward":     # a step with grammar rows: its forward, then ("sample", rows) its sampling
                constrained = runner.launch_forward(*step)
            elif kind == "sample":
                runner.launch_sample(constrained, step)
            elif kind == "update":
                runner.update_table(step)
            elif kind == "logits":
                runner.all_logits(step)
            elif kind == "prompt_logprobs":
                runner.prompt_logprobs(step, 1)
            elif kind == "shutdown":
                break
            else:
                raise ValueError(f"unknown message {kind!r} from rank 0")
    finally:
        reader.close()
    leave_tensor_parallel(release=runner.release_graphs)


def run(args: WorkerArgs, status_fd: int, forked: bool = False) -> int:
    """Run rank `args.rank` to its end, reporting on the status pipe `status_fd`; the exit code. A forked worker
    keeps the launching process's logging, with the rank named in each line."""
    from multiprocessing.connection import Connection
    _die_with_parent(args.rank)
    fmt = f"%(asctime)s rank {args.rank} %(levelname)s %(message)s"
    if forked:
        for handler in logging.getLogger().handlers + logger.handlers:
            handler.setFormatter(logging.Formatter(fmt))
        logging.getLogger().setLevel(args.log_level)
    else:
        logging.basicConfig(level=args.log_level, format=fmt)
    status = Connection(status_fd, readable=False)
    try:
        serve(args, status)
    except ChannelClosed:
        return 1
    except BaseException as e:     # no process-group teardown: a peer may be gone, and NCCL's would wait for it
        try:
            status.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except BaseException:      # noqa: BLE001 - rank 0 may be gone; the exit code still tells
            pass
        return 1
    status.close()
    logging.shutdown()
    return 0


def main() -> None:
    args, status_fd = pickle.load(sys.stdin.buffer)
    os._exit(run(args, status_fd))  # the group is left; the interpreter's teardown (about a second) gives nothing


if __name__ == "__main__":
    main()
