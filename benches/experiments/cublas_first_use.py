"""What cuBLAS's first GEMM of each shape costs in a fresh process, and whether a thread making those GEMMs overlaps
Python work in the main thread (an import of Inductor): the start-up question of whether to warm cuBLAS.

    PYTHONPATH=. python benches/experiments/cublas_first_use.py serial | thread | import-only | shapes

The shapes are the Qwen3-0.6B config's projections (qkv, o, gate_up, down) at its capture sizes and the profile
run's 8192 rows, in bfloat16. Run each mode in a fresh process: the costs are first-use costs. `shapes` tells a new
shape from a new kernel: the capture sizes, then each size plus one (new shapes, mostly the kernels just loaded),
then the capture sizes again, then 200 row counts of 600-7,999 (a prefill step's) twice, then those plus one.
"""

from __future__ import annotations

import argparse
import importlib
import threading
import time

import torch
import torch.nn.functional as F

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]
ROWS = [8192, 512, 448, 384, 320, 256, 224, 192, 160, 128, 120, 112, 104, 96, 88, 80, 72, 64, 56, 48, 40, 32, 24,
        16, 8, 4, 2]


def gemms(weights, inputs, record=None) -> None:
    for m in ROWS:
        for w in weights:
            start = time.perf_counter()
            F.linear(inputs[m][:, :w.shape[1]], w)
            torch.cuda.synchronize()
            if record is not None:
                record.append((m, tuple(w.shape), time.perf_counter() - start))


def import_inductor() -> None:
    """The Python-heavy import a start-up makes (Dynamo and Inductor's compiler)."""
    importlib.import_module("torch._dynamo")
    importlib.import_module("torch._inductor.compile_fx")


def shapes_passes(weights) -> None:
    """Per pass: the GEMMs' total time and median (first use included), each timed alone."""
    x = torch.randn(8200, max(k for _, k in SHAPES), device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    F.linear(x[:1, :weights[0].shape[1]], weights[0])     # the handle's set-up, apart from the passes
    torch.cuda.synchronize()
    print(f"first GEMM {1e3 * (time.perf_counter() - start):.1f} ms")
    large = list(range(600, 8000, 37))
    for label, rows in (("capture sizes", ROWS), ("capture sizes + 1", [m + 1 for m in ROWS]),
                        ("capture sizes again", ROWS), ("prefill sizes", large),
                        ("prefill sizes + 1", [m + 1 for m in large]), ("prefill sizes again", large)):
        times = []
        for m in rows:
            for w in weights:
                start = time.perf_counter()
                F.linear(x[:m, :w.shape[1]], w)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        times.sort()
        median_us = times[len(times) // 2] * 1e6
        print(f"{label:22s} {len(times):4d} GEMMs: {sum(times) * 1e3:7.1f} ms, median {median_us:7.1f} us, "
              f"slowest {times[-1] * 1e3:6.2f} ms", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["serial", "thread", "import-only", "shapes"])
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)
    torch.cuda.synchronize()
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for n, k in SHAPES]
    inputs = {m: torch.randn(m, max(k for _, k in SHAPES), device=dev, dtype=torch.bfloat16) for m in ROWS}
    if args.mode == "shapes":
        shapes_passes(weights)
    elif args.mode == "serial":
        record = []
        start = time.perf_counter()
        gemms(weights, inputs, record)
        first = time.perf_counter() - start
        start = time.perf_counter()
        gemms(weights, inputs)
        second = time.perf_counter() - start
        slowest = sorted(record, key=lambda r: -r[2])[:8]
        print(f"{len(record)} GEMMs: first pass {first:.3f} s, second {second:.3f} s; slowest first uses (rows, "
              f"weight, ms): {[(m, s, round(t * 1e3, 1)) for m, s, t in slowest]}")
    elif args.mode == "thread":
        start = time.perf_counter()
        thread = threading.Thread(target=gemms, args=(weights, inputs))
        thread.start()
        t0 = time.perf_counter()
        import_inductor()
        imported = time.perf_counter() - t0
        thread.join()
        print(f"import beside the GEMM thread {imported:.3f} s; both done after {time.perf_counter() - start:.3f} s")
    else:
        t0 = time.perf_counter()
        import_inductor()
        print(f"import alone {time.perf_counter() - t0:.3f} s")


if __name__ == "__main__":
    main()
