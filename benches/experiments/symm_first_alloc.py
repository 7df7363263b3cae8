"""Where the first symmetric-memory allocation's time goes, on one GPU (no process group needed). torch's CUDA
allocator asks, before its first `cuMemCreate`, whether the GPU can share memory over a fabric, which starts NVML
(`nvmlInit_v2`) and queries the GPU's fabric state. This times CUDA context creation and the first
`symm_mem.empty` with NVML started before them (serial), on a thread beside the context (thread), or not (none).

On an H200 (2026-11-28) NVML took 0.01 s and the first allocation 2.1-2.4 s in every mode: the time is Python's,
torch's first import of its symbolic shapes (and sympy) inside `symm_mem.empty`, slow where no bytecode is kept.

    PYTHONPATH=. python benches/experiments/symm_first_alloc.py none serial thread
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import threading
import time


def _nvml_init() -> None:
    t = time.perf_counter()
    rc = ctypes.CDLL("libnvidia-ml.so.1").nvmlInit_v2()
    print(f"  nvmlInit_v2 rc={rc}: {time.perf_counter() - t:.3f} s", flush=True)


def _one(mode: str) -> None:
    t0 = time.perf_counter()
    thread = None
    if mode == "serial":
        _nvml_init()
    elif mode == "thread":
        thread = threading.Thread(target=_nvml_init)
        thread.start()
    import torch
    import torch.distributed._symmetric_memory as symm
    t = time.perf_counter()
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    print(f"  CUDA context: {time.perf_counter() - t:.3f} s", flush=True)
    if thread is not None:
        t = time.perf_counter()
        thread.join()
        print(f"  waited for the NVML thread: {time.perf_counter() - t:.3f} s")
    device = torch.device("cuda", 0)
    if symm.get_backend(device) is None:
        symm.set_backend("CUDA")
    for label in ("first", "second"):
        t = time.perf_counter()
        symm.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        print(f"  {label} symm_mem.empty: {time.perf_counter() - t:.3f} s", flush=True)
    print(f"  {mode}: {time.perf_counter() - t0:.3f} s in all", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modes", nargs="*", choices=["none", "serial", "thread"],
                        help="default: all three")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        _one(args.one)
        return
    # each in a fresh process: NVML and the allocator start once a process
    for mode in args.modes or ["none", "serial", "thread"]:
        print(f"== {mode}", flush=True)
        subprocess.run([sys.executable, __file__, "--one", mode], check=False)


if __name__ == "__main__":
    main()
