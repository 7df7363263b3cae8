"""Host time of a call of an ember op, registered as `torch.library.custom_op` against `torch.library.Library` with
the body on CompositeExplicitAutograd (ember.kernels.library), under inference_mode as the runner calls them.

    PYTHONPATH=. python benches/experiments/op_dispatch.py [--rounds 5] [--calls 2000]

Two bodies, each registered both ways under a namespace of its own: an empty one (`x.new_empty(0)`: the dispatch
alone) and, on CUDA, ember's fused_linear of a decode-sized gate_up (512 rows, RMSNorm prologue, SiLU·mul
epilogue; the composed path: a Triton RMSNorm, cuBLAS, a Triton SiLU·mul). The floor beside them is the body called
as a Python function (no dispatch). Rounds alternate the variants; the first round is printed apart.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ember.kernels.library import define, register_fake


def empty_body(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


def _register_both(name: str, body, fake) -> tuple[dict, torch.library.Library]:
    """`name` as a custom_op (namespace ember_bench_custom) and through ember.kernels.library (ember_bench_lib):
    the three callables by label, and the library (kept alive by the caller, or its registrations go)."""
    custom = torch.library.custom_op(f"ember_bench_custom::{name}", body, mutates_args=())
    custom.register_fake(fake)
    lib = torch.library.Library("ember_bench_lib", "FRAGMENT")
    define(name, library=lib)(body)
    register_fake(name, library=lib)(fake)
    return {"custom_op": getattr(torch.ops.ember_bench_custom, name).default,
            "Library (ember)": getattr(torch.ops.ember_bench_lib, name).default, "body (no dispatch)": body}, lib


def _per_call_us(fn, args, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    us = (time.perf_counter() - start) / calls * 1e6
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    keep = []
    cases = []
    variants, lib = _register_both("empty", empty_body, empty_body)
    keep.append(lib)
    cases.append(("empty body", variants, (torch.zeros(4),), args.calls))
    if torch.cuda.is_available():
        from ember.kernels.fused_linear import _composed

        def gate_up(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
            return _composed(x, weight, None, norm_weight, 1e-6, True, None)

        def gate_up_fake(x, weight, norm_weight):
            return x.new_empty(x.shape[0], weight.shape[0] // 2)
        variants, lib = _register_both("gate_up", gate_up, gate_up_fake)
        keep.append(lib)
        dev, dt = "cuda", torch.bfloat16
        x = torch.randn(512, 1024, device=dev, dtype=dt)
        cases.append(("fused_linear gate_up, 512 rows", variants,
                      (x, torch.randn(6144, 1024, device=dev, dtype=dt), torch.ones(1024, device=dev, dtype=dt)),
                      args.calls // 10))
    with torch.inference_mode():
        for title, variants, inputs, calls in cases:
            times = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, fn in variants.items():
                    fn(*inputs)     # a warm call, then the timed ones
                    times[name].append(_per_call_us(fn, inputs, calls))
            print(f"{title} ({calls} calls a round, {args.rounds} rounds), host us per call:")
            for name, us in times.items():
                print(f"  {name:20s} median {statistics.median(us):7.2f}   first round {us[0]:7.2f}   "
                      f"all {' '.join(f'{u:.1f}' for u in us)}")


if __name__ == "__main__":
    main()
