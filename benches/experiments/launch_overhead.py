"""Host time of a launch of ember's Triton kernels through `ember.kernels.launcher` (ember's C launcher) against
Triton's own `JITFunction.run` (as with EMBER_HOOKS=fast_launch=off), on a GPU.

    PYTHONPATH=. python benches/experiments/launch_overhead.py [--rounds 5] [--calls 2000]

Per kernel call site (the GEMV at 1 and 4 rows, its K split and reduce, RMSNorm, SiLU·mul, q/k norm + RoPE): the
wrapper's whole host time per call (its checks, output allocation and launches), both ways, beside the floor: the
4-row GEMV's kernel through ember's C launcher alone, with one call's arguments prepared (no Python launch path goes
under it). Rounds alternate the two ways; the first round is
printed apart. The GPU work is tiny and is synchronized once per batch of calls, so the figures are host time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _cases():
    import ember.kernels.gemv as G
    from ember.kernels.linear_op import set_gemv_routing
    from ember.kernels.qk_norm_rope import qk_norm_rope_triton
    from ember.kernels.rms_norm import rms_norm, silu_mul
    set_gemv_routing(False)
    r = lambda *s, dtype=torch.bfloat16: torch.randn(*s, device="cuda", dtype=dtype)   # noqa: E731
    x1, x4, w, nw, res = r(1, 1024), r(4, 1024), r(3072, 1024), r(1024), r(4, 3072)
    q, k, qw, kw = r(1, 16 * 128), r(1, 8 * 128), r(128), r(128)
    cos, sin = r(1, 64, dtype=torch.float32), r(1, 64, dtype=torch.float32)
    return {
        "gemv 1x1024 @ 3072 (split K + reduce)": lambda: G.gemv(x1, w),
        "gemv 4x1024 @ 3072": lambda: G.gemv(x4, w),
        "gemv 4 rows, norm + residual": lambda: G.gemv(x4, w, residual=res, norm_weight=nw),
        "rms_norm 4x1024": lambda: rms_norm(x4, nw, 1e-6),
        "silu_mul 4x3072": lambda: silu_mul(res),
        "qk_norm_rope 1 token": lambda: qk_norm_rope_triton(q, k, qw, kw, cos, sin, 1e-6),
    }


def _time(call, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def _floor(call, calls: int) -> float:
    """us per call of ember's C launcher alone for the kernel and arguments of one `call` (prepared once)."""
    import ember.kernels.gemv as G
    from ember.kernels.linear_op import set_gemv_routing
    import ember.kernels.launcher as L
    from triton.runtime.driver import driver
    launch = L.launcher(G._gemv_kernel)
    seen = {}           # holds the call's tensors too, so the addresses stay theirs while the floor is timed
    real_launch = launch._launch

    def spy(grid, *args, **kwargs):
        seen.update(grid=grid, args=args, made=launch._key(driver.active.get_current_device(), args, kwargs))
        return real_launch(grid, *args, **kwargs)
    launch._launch = spy
    try:
        call()
    finally:
        del launch._launch
    (key, values), grid = seen["made"], tuple(seen["grid"]) + (1,) * (3 - len(seen["grid"]))
    kept = launch._kept[key]
    stream = driver.active.get_current_stream(driver.active.get_current_device())
    launch_args = kept.pick(values + kept.tail) + kept.extra
    return _time(lambda: kept.module.launch(*grid, kept.num_warps, kept.shared, kept.pdl, stream, kept.function,
                                            kept.codes, launch_args), calls)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()
    cases = _cases()
    for call in cases.values():      # compile outside the timing
        call()
    results: dict[str, dict[str, list[float]]] = {name: {"triton": [], "ember": []} for name in cases}
    import ember.kernels.launcher as L
    ember_launch = L.KernelLauncher._launch

    def triton_launch(self, grid, *args, **kwargs):     # JITFunction.run, as where the fast_launch hook is off
        return self._slow(grid, args, kwargs)

    for _ in range(a.rounds):
        for way, launch in (("triton", triton_launch), ("ember", ember_launch)):
            L.KernelLauncher._launch = launch
            for name, call in cases.items():
                results[name][way].append(_time(call, a.calls))
    L.KernelLauncher._launch = ember_launch
    floor = _floor(cases["gemv 4x1024 @ 3072"], a.calls)
    print(f"{'call site':40s} {'JITFunction.run':>16s} {'ember launcher':>15s}   first round (triton / ember), us")
    for name, r in results.items():
        print(f"{name:40s} {statistics.median(r['triton']):13.1f} us {statistics.median(r['ember']):12.1f} us"
              f"   {r['triton'][0]:.1f} / {r['ember'][0]:.1f}")
    kept = {made.fn.__name__: len(made._kept) for made in L._launchers}
    print("rounds (us):", json.dumps({name: {w: [round(t, 1) for t in v] for w, v in r.items()}
                                      for name, r in results.items()}))
    print("specializations kept per kernel:", json.dumps(kept))
    print(f"floor: the kernel of 'gemv 4x1024 @ 3072' through ember's C launcher alone, arguments prepared: "
          f"{floor:.1f} us")
    print("LAUNCH_OVERHEAD " + json.dumps({name: {w: round(statistics.median(v), 2) for w, v in r.items()}
                                          for name, r in results.items()} | {"floor_us": round(floor, 2)}))


if __name__ == "__main__":
    main()
