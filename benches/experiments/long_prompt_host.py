"""The host's work before a long prompt's first kernel, on any machine: `Engine.add_request` (the prompt's checks),
the scheduler's step (prefix hashes, block allocation, the runner's first view of the request) and the runner's
`prepare_step` (the request table's writes, the packed upload, the batch), each timed alone; and `prepare_step` of a
decode step of many requests for comparison. The Qwen3-0.6B bundled config with one layer and random weights; the
model's forward returns zeros, and `--stub-prepare` stubs the prepare-inputs CPU fallback (on CUDA it is one
asynchronous kernel launch), so what remains is Python, numpy and (on the CPU) the table's scatters.

    PYTHONPATH=. python benches/experiments/long_prompt_host.py --input-len 16384 --decode-batch 256 --stub-prepare
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def build(input_len: int, decode_batch: int, stub_prepare: bool):
    import torch
    import ember.runner.input_batch as input_batch
    from ember.config import CacheConfig, CompileConfig, EngineConfig, ModelConfig, SchedulerConfig
    from ember.engine.engine import Engine
    from ember.models.bundled import bundled_config
    from ember.runner.model_runner import ModelRunner

    if stub_prepare:
        input_batch.prepare_inputs = lambda *args, **kwargs: None
    ModelRunner._run = lambda self, batch, mode=None, desc=None, skip=None: (
        torch.zeros(batch.input_ids.shape[0], self.hf_config.hidden_size, dtype=self.dtype), None)
    blocks = -(-input_len // 16) + 8 * decode_batch + 64
    config = EngineConfig(model=ModelConfig("qwen3-0.6b", dtype="bfloat16", max_model_len=input_len + 64),
                          cache=CacheConfig(block_size=16, num_kv_blocks=blocks),
                          scheduler=SchedulerConfig(max_num_seqs=decode_batch, max_num_batched_tokens=input_len),
                          compile=CompileConfig(compile_mode="none", cudagraph_mode="none", jit_warmup=False),
                          device="cpu").resolve()
    hf = bundled_config("qwen3-0.6b", num_hidden_layers=1).to_transformers()
    return Engine(config, "qwen3-0.6b", hf_config=hf, load_format="dummy")


def timed(obj, name: str, times: list):
    """Wrap `obj.name` so that each call's seconds are appended to `times`."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        times.append(time.perf_counter() - start)
        return out
    setattr(obj, name, wrapper)


def main() -> None:
    import numpy as np
    from ember import SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-len", type=int, default=16384)
    p.add_argument("--decode-batch", type=int, default=256)
    p.add_argument("--prompts", type=int, default=10, help="long prompts, one after another (the first 2 warm up)")
    p.add_argument("--decode-steps", type=int, default=12,
                   help="few: the CPU samples 256 rows of 151,936 logits a step, slowly")
    p.add_argument("--stub-prepare", action="store_true")
    args = p.parse_args()

    engine = build(args.input_len, args.decode_batch, args.stub_prepare)
    core = engine.client.core
    runner = engine.runner
    add, schedule, prepare = [], [], []
    timed(engine, "add_request", add)
    timed(core.scheduler, "schedule", schedule)
    timed(runner, "prepare_step", prepare)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2)
    first = []
    for _ in range(args.prompts):
        schedule.clear(), prepare.clear()
        engine.add_request(rng.integers(0, 150000, args.input_len).tolist(), params)
        engine.step()
        first.append((schedule[0], prepare[0]))
        while engine.has_unfinished():
            engine.step()
    decode = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.decode_steps + 2)
    for _ in range(args.decode_batch):
        engine.add_request(rng.integers(0, 150000, 40).tolist(), decode)
    prepare.clear()
    while engine.has_unfinished():
        engine.step()
    ms = lambda xs: round(statistics.median(xs) * 1e3, 3)   # noqa: E731
    print(json.dumps({"input_len": args.input_len, "add_request_ms": ms(add[2:args.prompts]),
                      "schedule_ms": ms([s for s, _ in first[2:]]), "prepare_ms": ms([p for _, p in first[2:]]),
                      "decode_batch": args.decode_batch, "decode_prepare_ms": ms(prepare[3:]),
                      "stub_prepare": args.stub_prepare}))


if __name__ == "__main__":
    main()
