"""`ember::all_reduce` through NCCL against the symmetric-memory one-shot and two-shot kernels
(ember.distributed.symm_mem), per message size, eagerly and inside a CUDA graph (as a decode step replays it), on this host's GPUs. NVLink multicast
stays off (parallel_state.COLLECTIVE_ENV).

Each rank reduces `--calls` messages in a row over 4 input buffers in turn; the figure is the median over `--reps`
rounds of the time a round takes divided by its calls, in microseconds per all-reduce. Every result is checked:
rank r's input is (r + 1) times a tensor that all ranks draw alike, so the sum is known on every rank; in a graph, the
inputs are filled anew before the checked replay (a graph that read stale inputs, or a kernel that overwrote a buffer
a peer was still reading, fails it).

    PYTHONPATH=. python benches/all_reduce_graph.py                       # 2 GPUs, 8 KiB to 8 MiB
    PYTHONPATH=. python benches/all_reduce_graph.py --ranks 4 --sizes 8192 65536

The largest size at which the one-shot kernel wins inside a graph is what `symm_mem.MAX_BYTES` should be; the
two-shot column says whether the sizes past it (a large batch's messages) would gain from that kernel.
"""

from __future__ import annotations

import argparse
import os

import torch

from benches.ranks import captured, median_us_per_call, spawn_ranks

SIZES = [8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576, 2097152, 4194304, 8388608]
BUFFERS = 4         # distinct inputs a round cycles through
PATHS = ("nccl", "one-shot", "two-shot")


def _inputs(size: int, rank: int, ranks: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This rank's BUFFERS inputs of `size` bytes (bf16, one row) and their sums over the ranks (fp32, exact up to
    bf16 rounding of the sum): rank r holds (r + 1) * base, every rank draws the same bases."""
    g = torch.Generator().manual_seed(seed)
    bases = [torch.randn(1, size // 2, generator=g) for _ in range(BUFFERS)]
    mine = [(b * (rank + 1)).to(torch.bfloat16).cuda() for b in bases]
    sums = [sum((b * (r + 1)).to(torch.bfloat16).float() for r in range(ranks)).cuda() for b in bases]
    return mine, sums


def _check(got: list[torch.Tensor], sums: list[torch.Tensor], what: str) -> list[str]:
    """What is wrong with `got` (nothing: []). Reported, not raised: every rank must go on to the same collectives."""
    errors = []
    for i, (g, s) in enumerate(zip(got, sums)):
        err = ((g.float() - s).abs() / (s.abs() + 1e-2)).max().item()
        if err > 1e-2:
            errors.append(f"{what}: buffer {i} is off by {err:.3g} (relative) from the sum over the ranks")
    return errors


def _measure(size: int, rank: int, ranks: int, calls: int, reps: int) -> dict[str, float]:
    from ember.distributed import ops
    from ember.distributed.parallel_state import TP_GROUP
    inputs, sums = _inputs(size, rank, ranks, seed=size)
    result, errors = {}, []

    def round_():
        return [ops.all_reduce(inputs[i % BUFFERS], TP_GROUP) for i in range(calls)][-BUFFERS:]
    errors += _check(round_(), sums, "eager")
    result["eager"] = median_us_per_call(round_, calls, reps, torch.device("cuda"))
    graph, outputs = captured(round_)   # the last BUFFERS results, one a buffer (calls is a multiple of BUFFERS)
    result["graph"] = median_us_per_call(graph.replay, calls, reps, torch.device("cuda"))
    fresh, fresh_sums = _inputs(size, rank, ranks, seed=size + 1)
    for static, new in zip(inputs, fresh):
        static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    errors += _check(outputs, fresh_sums, "graph replay with new inputs")
    del graph
    if errors:
        result["error"] = f"rank {rank}: " + "; ".join(errors)
    return result


def _rank(rank: int, ranks: int, port: int, sizes: list[int], calls: int, reps: int, out) -> None:
    import datetime
    import torch.distributed as dist
    from ember.distributed import ops
    from ember.distributed.parallel_state import COLLECTIVE_ENV, TP_GROUP, init_tensor_parallel
    from ember.distributed.symm_mem import OneShotAllReduce
    for name, value in COLLECTIVE_ENV.items():
        os.environ.setdefault(name, value)
    store = dist.TCPStore("127.0.0.1", port, ranks, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    init_tensor_parallel(rank, ranks, rank, "cuda", store, 120.0)
    # a buffer for the largest size of the sweep (the engine's holds symm_mem.MAX_BYTES)
    device = torch.device("cuda", rank)
    one_shot = OneShotAllReduce(dist.group.WORLD, device, max_bytes=max(sizes), two_shot_max_bytes=0)
    # one-shot up to 16 bytes: every message of the sweep takes the two-shot kernel
    two_shot = OneShotAllReduce(dist.group.WORLD, device, max_bytes=16, two_shot_max_bytes=max(sizes))
    group = ops._groups[TP_GROUP]
    results = {}
    for size in sizes:
        for path in PATHS:
            group.one_shot = {"one-shot": one_shot, "two-shot": two_shot}.get(path)
            try:
                for mode, value in _measure(size, rank, ranks, calls, reps).items():
                    results[(size, path, mode)] = value
            except Exception as e:      # noqa: BLE001 - reported in the table (every rank fails alike: the op)
                results[(size, path, "error")] = f"{type(e).__name__}: {e}"
            finally:
                group.one_shot = None
    gathered = [None] * ranks
    dist.all_gather_object(gathered, {k: v for k, v in results.items() if k[2] == "error"})
    for other in gathered:
        for key, error in other.items():
            results[key] = results[key] + " | " + error if key in results and results[key] != error else error
    if rank == 0:
        out.put(results)
    dist.barrier()
    from ember.distributed.parallel_state import leave_tensor_parallel
    leave_tensor_parallel()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="message sizes in bytes (bfloat16)")
    p.add_argument("--calls", type=int, default=200, help="all-reduces a round (a multiple of 4)")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    if args.calls % BUFFERS:
        p.error(f"--calls {args.calls} must be a multiple of {BUFFERS}")
    results = spawn_ranks(_rank, args.ranks, args.sizes, args.calls, args.reps)
    print(f"{torch.cuda.get_device_name(0)}, {args.ranks} ranks, {args.calls} all-reduces a round, median of "
          f"{args.reps} rounds (us per all-reduce; each result checked against the sum over the ranks)")
    print(f"{'bytes':>9} " + " ".join(f"{f'{path} {mode}':>15}" for mode in ("eager", "graph") for path in PATHS))
    errors = []
    for size in args.sizes:
        cells = []
        for mode in ("eager", "graph"):
            for path in PATHS:
                us = results.get((size, path, mode))
                cells.append(f"{us:.2f}" if us is not None else "failed")
        print(f"{size:>9} " + " ".join(f"{c:>15}" for c in cells))
        errors += [f"{size} B {path}: {results[(size, path, 'error')]}" for path in PATHS
                   if (size, path, "error") in results]
    for error in errors:
        print("  " + error)
    graph_wins = [size for size in args.sizes
                  if results.get((size, "one-shot", "graph"), float("inf")) < results.get((size, "nccl", "graph"),
                                                                                          float("inf"))]
    print(f"one-shot faster inside a graph at: {graph_wins or 'no size'}")
    best = {size: min(PATHS, key=lambda path: results.get((size, path, "graph"), float("inf"))) for size in args.sizes}
    print("fastest inside a graph: " + ", ".join(f"{size} {path}" for size, path in best.items()))
    raise SystemExit(1 if errors else 0)


if __name__ == "__main__":
    main()
