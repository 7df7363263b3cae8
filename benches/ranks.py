"""A multi-rank benchmark's plumbing: start its ranks as processes of their own (spawned, one a rank) and collect
rank 0's results; capture a round of calls in a CUDA graph; time a round with the ranks lined up."""

from __future__ import annotations

import statistics
import time

import torch


def captured(run):
    """(a CUDA graph of `run()`, what the captured call returned), `run` warmed up once on a side stream first."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


def median_us_per_call(run, calls: int, reps: int, device: torch.device) -> float:
    """Median microseconds per call of `run()` (one round of `calls`) over `reps` rounds, the ranks lined up (a
    barrier of the default group) before each; CUDA rounds timed by events, CPU ones by the host clock."""
    import torch.distributed as dist
    times = []
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(1e3 * start.elapsed_time(end) / calls)
        else:
            start_s = time.perf_counter()
            run()
            times.append(1e6 * (time.perf_counter() - start_s) / calls)
    return statistics.median(times)


def spawn_ranks(target, ranks: int, *args):
    """Run target(rank, ranks, port, *args, out) in `ranks` spawned processes (port: a free local one for their
    store) and return what rank 0 puts on `out`. A rank that exits with an error kills the others and exits naming
    their codes; a rank still alive 30 s after the results is killed, said on the terminal."""
    import multiprocessing as mp
    import queue
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, ranks, port, *args, out)) for r in range(ranks)]
    for proc in procs:
        proc.start()
    while True:
        try:
            results = out.get(timeout=5.0)
            break
        except queue.Empty:
            if any(proc.exitcode not in (None, 0) for proc in procs):
                for proc in procs:
                    proc.kill()
                raise SystemExit(f"a rank failed: exit codes {[proc.exitcode for proc in procs]}")
    for proc in procs:
        proc.join(30)
        if proc.is_alive():
            print(f"rank process {proc.pid} did not exit within 30 s of its results; killing it")
            proc.kill()
    return results
