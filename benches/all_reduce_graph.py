"""The all-reduce inside a CUDA graph, as a decode step replays it: `ember::all_reduce` through NCCL against the
symmetric-memory one-shot kernel (ember.distributed.symm_mem), per message size, on every GPU pair (or more) of
this host. Each rank captures `--calls` all-reduces of one message in one graph and replays it; the figure is the
median replay time over the calls, in microseconds per all-reduce. NVLink multicast stays off (parallel_state.COLLECTIVE_ENV).

    PYTHONPATH=. python benches/all_reduce_graph.py                       # 2 GPUs, 8 KiB and the sweep
    PYTHONPATH=. python benches/all_reduce_graph.py --ranks 4 --sizes 8192 65536

The largest size at which the one-shot kernel wins is what `symm_mem.MAX_BYTES` should be.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

SIZES = [2048, 8192, 32768, 131072, 262144, 524288, 1048576]


def _rank(rank: int, ranks: int, port: int, sizes: list[int], calls: int, reps: int, out) -> None:
    import datetime
    import torch.distributed as dist
    from ember.distributed import ops
    from ember.distributed.parallel_state import COLLECTIVE_ENV
    from ember.distributed.parallel_state import TP_GROUP, init_tensor_parallel
    from ember.distributed.symm_mem import OneShotAllReduce
    for name, value in COLLECTIVE_ENV.items():
        os.environ.setdefault(name, value)
    store = dist.TCPStore("127.0.0.1", port, ranks, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    init_tensor_parallel(rank, ranks, rank, "cuda", store, 120.0)
    # a buffer for the largest size of the sweep (the engine's holds symm_mem.MAX_BYTES)
    one_shot = OneShotAllReduce(dist.group.WORLD, torch.device("cuda", rank), max_bytes=max(sizes))
    results = {}
    for size in sizes:
        x = torch.randn(size // 2, device="cuda", dtype=torch.bfloat16).view(1, -1)
        for path in ("nccl", "symm_mem"):
            if path == "symm_mem" and not one_shot.applies(x):
                continue
            saved = ops._groups[TP_GROUP].one_shot
            ops._groups[TP_GROUP].one_shot = one_shot if path == "symm_mem" else None
            try:
                expected = x.float() * ranks
                got = ops.all_reduce(x, TP_GROUP)                         # warm-up, outside the graph
                assert torch.allclose(got.float(), expected, rtol=2e-2, atol=2e-2), path
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    ops.all_reduce(x, TP_GROUP)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(calls):
                        ops.all_reduce(x, TP_GROUP)
                times = []
                for _ in range(reps):
                    dist.barrier()
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    times.append(1e3 * start.elapsed_time(end) / calls)
                results[(size, path)] = statistics.median(times)
                del graph
            finally:
                ops._groups[TP_GROUP].one_shot = saved
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="message sizes in bytes (bfloat16)")
    p.add_argument("--calls", type=int, default=200, help="all-reduces captured in one graph")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    import multiprocessing as mp
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args.sizes, args.calls, args.reps, out))
             for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    results = out.get()
    for proc in procs:
        proc.join()
    print(f"{torch.cuda.get_device_name(0)}, {args.ranks} ranks, {args.calls} all-reduces a graph, median of "
          f"{args.reps} replays (us per all-reduce)")
    print(f"{'bytes':>9} {'NCCL':>8} {'one-shot':>9}")
    for size in args.sizes:
        symm = results.get((size, "symm_mem"))
        print(f"{size:>9} {results[(size, 'nccl')]:>8.2f} {symm if symm is None else f'{symm:9.2f}'}")


if __name__ == "__main__":
    main()
