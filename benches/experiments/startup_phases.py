"""Where `LLM(...)`'s start-up spends host time, by phase (the weights, building the compiled forward, the profile run
with the artifact load, the capture, the warm-up): inside each, the composed path's cuBLAS calls, Triton module
loads, the capture's begin / end / replay and the dummy steps' staging, each counted and summed; on a cold start
also the compiles of ember's @triton.jit kernels (per kernel, last) and the C launchers Triton builds for them with
the system's C compiler; then the profile run again, in the same process, for its cost without first uses.

    PYTHONPATH=. python benches/experiments/startup_phases.py qwen3-0.6b

Random weights of a bundled config, on CUDA. Cold or warm is the caller's: point EMBER_CACHE and TRITON_CACHE_DIR
at empty or filled folders. The wrappers cost a few microseconds a call; compare phases, not totals, with other
benches.
"""

from __future__ import annotations

import collections
import sys
import time

import torch

PHASE = ["init"]
SPENT: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
KERNEL_COMPILES: dict = collections.defaultdict(lambda: [0, 0.0])     # @triton.jit kernel name: [compiles, s]


def timed(name: str, fn):
    """`fn`, its calls counted and timed under the phase they run in."""
    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = SPENT[PHASE[0]][name]
            entry[0] += 1
            entry[1] += time.perf_counter() - start
    return wrapped


def phase(name: str, fn):
    """`fn`, run as the phase `name` (its total recorded as TOTAL)."""
    def wrapped(*args, **kwargs):
        previous, PHASE[0] = PHASE[0], name
        try:
            return timed("TOTAL", fn)(*args, **kwargs)
        finally:
            PHASE[0] = previous
    return wrapped


def install() -> None:
    import triton.compiler.compiler as triton_compiler

    import ember.kernels.fused_linear as fused_linear
    import ember.runner.model_runner as model_runner
    from ember.graphs.cuda_graph import CUDAGraphManager

    kernel = triton_compiler.CompiledKernel
    kernel._init_handles = timed("Triton _init_handles (module load)", kernel._init_handles)
    from triton.runtime import build, jit
    real_compile = jit.JITFunction._do_compile

    def compile_by_kernel(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return real_compile(self, *args, **kwargs)
        finally:
            entry = KERNEL_COMPILES[getattr(self, "__name__", None) or self.fn.__name__]
            entry[0] += 1
            entry[1] += time.perf_counter() - start
    jit.JITFunction._do_compile = timed("Triton compile of a @triton.jit kernel", compile_by_kernel)
    # the C launcher of a kernel signature (Triton 3.5 on), built with the system's C compiler where not cached
    import triton.backends.nvidia.driver as nvidia_driver
    module_build = timed("Triton C module build", build.compile_module_from_src)
    for module in (build, nvidia_driver):        # the driver imports it by name: one wrapper for both
        if hasattr(module, "compile_module_from_src"):
            module.compile_module_from_src = module_build
    fused_linear._composed = timed("fused_linear composed path (cuBLAS)", fused_linear._composed)
    graph = torch.cuda.CUDAGraph
    for method in ("capture_begin", "capture_end", "replay"):
        setattr(graph, method, timed(f"graph {method}", getattr(graph, method)))
    runner = model_runner.ModelRunner
    for method in ("_dummy_forward", "_stage", "_run"):
        setattr(runner, method, timed(method, getattr(runner, method)))
    runner._profile_run = phase("profile run", runner._profile_run)
    runner._build_forward = phase("build forward", runner._build_forward)
    CUDAGraphManager.capture_all = phase("capture", CUDAGraphManager.capture_all)
    model_runner.run_warmup = phase("warm-up", model_runner.run_warmup)
    model_runner.random_model = phase("weights", model_runner.random_model)


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
    install()
    from ember import LLM
    start = time.perf_counter()
    llm = LLM(model, load_format="dummy")
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    runner = llm.engine.runner
    print(f"start-up {runner.times.summary(total)}")
    for name, entries in SPENT.items():
        parts = sorted(entries.items(), key=lambda kv: -kv[1][1])
        print(f"  [{name}] " + "; ".join(f"{k} {n}x {s * 1e3:.0f} ms" for k, (n, s) in parts))
    if KERNEL_COMPILES:
        parts = sorted(KERNEL_COMPILES.items(), key=lambda kv: -kv[1][1])
        print(f"  @triton.jit compiles: {sum(n for n, _ in KERNEL_COMPILES.values())}, "
              f"{sum(s for _, s in KERNEL_COMPILES.values()):.2f} s: "
              + "; ".join(f"{k} {n}x {s:.2f} s" for k, (n, s) in parts))
    for _ in range(2):
        torch.cuda.synchronize()
        again = time.perf_counter()
        runner._profile_run()
        torch.cuda.synchronize()
        print(f"  the profile run again: {time.perf_counter() - again:.3f} s")


if __name__ == "__main__":
    main()
