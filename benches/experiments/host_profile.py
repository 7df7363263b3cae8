"""Where the host's time goes in a decode step: cProfile over steady decode steps at a given batch size, on random
weights of a bundled config. Speed figures come from `ember bench`; this finds the functions behind them.

    PYTHONPATH=. python benches/experiments/host_profile.py --config qwen3-0.6b --batch-sizes 1 256 --steps 50
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from ember import LLM, SamplingParams
from ember.bench.roofline import device_sync


def profile_batch(llm, batch_size: int, steps: int, top: int, temperature: float, sorts=("tottime",)) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=steps + 64)
    ids = [engine.add_request([(i * 131 + j) % 10_000 + 1 for j in range(64)], params) for i in range(batch_size)]
    try:
        for _ in range(8):          # past the prefill steps
            engine.step()
        device_sync(engine.runner.device)
        host0, wait0 = engine.stats.host_s, engine.stats.device_wait_s
        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.enable()
        for _ in range(steps):
            engine.step()
        profiler.disable()
        device_sync(engine.runner.device)
        wall = (time.perf_counter() - start) / steps
        host = (engine.stats.host_s - host0) / steps
        wait = (engine.stats.device_wait_s - wait0) / steps
        print(f"== batch {batch_size}: {wall * 1e3:.3f} ms/step wall under cProfile, host {host * 1e3:.3f} ms busy, "
              f"{wait * 1e3:.3f} ms waiting")
        for key in sorts:
            pstats.Stats(profiler).sort_stats(key).print_stats(top)
    finally:
        for rid in ids:
            engine.abort(rid)
        engine.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="qwen3-0.6b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 256])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--sort", nargs="+", default=["tottime"], help="pstats keys, one table each (e.g. tottime cumtime)")
    args = p.parse_args()
    llm = LLM(args.config, load_format="dummy", max_num_seqs=max(args.batch_sizes))
    for batch_size in args.batch_sizes:
        profile_batch(llm, batch_size, args.steps, args.top, args.temperature, args.sort)


if __name__ == "__main__":
    main()
