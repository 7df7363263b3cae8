"""Where a tensor-parallel rank's join goes, on N local GPUs: each phase timed on every rank, in the order
`init_tensor_parallel` takes them (CUDA context, NCCL's eager connect, the first NCCL all-reduce, the gloo check,
the symmetric buffer's allocation and rendezvous), then a second buffer's allocation and rendezvous (the cost
without first-use set-up).

    PYTHONPATH=. python benches/experiments/tp_join.py [--size 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import time

import torch
import torch.multiprocessing as mp


def _rank(rank: int, size: int, port: int, queue) -> None:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm
    times: list[tuple[str, float]] = []
    t = time.perf_counter()

    def mark(name: str) -> None:
        nonlocal t
        torch.cuda.synchronize()
        now = time.perf_counter()
        times.append((name, now - t))
        t = now

    torch.cuda.set_device(rank)
    torch.empty(1, device="cuda")
    mark("cuda context")
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=120))
    mark("store")
    dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=rank, world_size=size,
                            device_id=torch.device("cuda", rank))
    mark("init_process_group (eager NCCL)")
    x = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    dist.all_reduce(x)
    mark("first NCCL all-reduce")
    flags = torch.ones(2, dtype=torch.int64)
    dist.all_reduce(flags)
    mark("gloo all-reduce")
    if symm.get_backend(torch.device("cuda", rank)) is None:
        symm.set_backend("CUDA")
    buf = symm.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
    mark("symm.empty (first)")
    group = dist.group.WORLD.group_name
    symm.rendezvous(buf, group)
    mark("rendezvous (first)")
    y = torch.ops.symm_mem.one_shot_all_reduce_copy(buf.narrow(0, 0, 4096), x, "sum", group)
    mark("first one-shot all-reduce")
    buf2 = symm.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
    mark("symm.empty (second)")
    symm.rendezvous(buf2, group)
    mark("rendezvous (second)")
    assert float(y[0]) == size * size, float(y[0])
    queue.put((rank, times))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.size, port, queue)) for r in range(args.size)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    print(f"{args.size} ranks, {torch.cuda.get_device_name(0)}, wall {time.perf_counter() - t0:.2f} s "
          f"(with interpreter start)")
    for i, (name, _) in enumerate(results[0]):
        print(f"  {name:36s} " + "  ".join(f"rank {r}: {results[r][i][1]:6.3f} s" for r in sorted(results)))


if __name__ == "__main__":
    main()
