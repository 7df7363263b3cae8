"""The engine's own host time per decode step, with the runner stubbed out entirely: scheduling, the engine core's
token bookkeeping and the front end's output processing, and nothing of the runner (no request table, no upload,
no forward). `benches/experiments/host_bookkeeping.py` keeps the runner's host work in; this isolates what the engine adds.

    PYTHONPATH=. python benches/experiments/engine_host_step.py --batch-sizes 1 32 256 --steps 2000 [--stream] [--profile 30]

Each request decodes with greedy sampling and ignore_eos, so every step gives every request a token. With
`--stream` the engine builds an output for every request every step (as `generate_stream` and the server do).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time


class _Done:
    """A launched step whose tokens are already on the host."""

    def __init__(self, output):
        self._output = output

    def result(self):
        return self._output


def measure(folder: str, batch_size: int, steps: int, stream: bool, profile: int, repeats: int
            ) -> list[tuple[float, float]]:
    """(wall, CPU) seconds per decode step of `engine.step()` at this batch size, once per repeat. The CPU time
    (this thread's) is the figure to compare on a shared machine: it leaves out time other processes took."""
    from ember import LLM, SamplingParams
    from ember.runner.output import ModelRunnerOutput

    llm = LLM(folder, device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=max(batch_size, 2),
              max_model_len=8192, max_num_batched_tokens=max(2048, 32 * batch_size), num_kv_blocks=20000)
    engine, runner = llm.engine, llm.engine.runner
    outputs = {n: ModelRunnerOutput([7] * n) for n in range(1, max(batch_size, 2) + 1)}
    runner.execute_async = lambda step: _Done(outputs[len(step.req_ids)])
    runner.update_table = lambda step: None
    results = []
    for _ in range(repeats):
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 64)
        ids = [engine.add_request([(i * 7 + j) % 500 + 1 for j in range(32)], params) for i in range(batch_size)]
        for _ in range(8):          # past the prefill
            engine.step(stream=stream)
        profiler = cProfile.Profile() if profile else None
        start, cpu = time.perf_counter(), time.thread_time()
        if profiler:
            profiler.enable()
        for _ in range(steps):
            engine.step(stream=stream)
        if profiler:
            profiler.disable()
        results.append(((time.perf_counter() - start) / steps, (time.thread_time() - cpu) / steps))
        if profiler:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    return results


def main() -> None:
    from benches.experiments.host_bookkeeping import tiny_folder
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stream", action="store_true", help="build every request's output every step")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile the steps, print the N costliest")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_folder(tmp)
        for batch_size in args.batch_sizes:
            runs = measure(folder, batch_size, args.steps, args.stream, args.profile, args.repeats)
            wall = [w * 1e6 for w, _ in runs]
            cpu = [c * 1e6 for _, c in runs]
            print(f"batch {batch_size}{' stream' if args.stream else ''}: CPU {min(cpu):.1f} us a step at best, "
                  f"median {statistics.median(cpu):.1f} us ({min(cpu) / batch_size:.2f} us a request); wall "
                  f"{min(wall):.1f} us at best", flush=True)


if __name__ == "__main__":
    main()
