"""The host's own share of a decode step, on any machine: the engine's real step loop (scheduler, request table,
packed upload, batch staging, sampling plan, output processing) with the device work stubbed out, so that what
remains is the Python and numpy a step costs before any kernel launch. The model's forward returns fixed hidden
states and sampled tokens (as a uniform-decode FULL graph that samples inside would), and the prepare-inputs kernel
does nothing. A GPU step's host time beyond this figure is launches, copies and CUDA calls
(`benches/experiments/host_profile.py` profiles those on the GPU).

    PYTHONPATH=. python benches/experiments/host_bookkeeping.py --batch-sizes 1 32 256 --steps 3000 [--profile 30]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time


def tiny_folder(path: str) -> str:
    """A two-layer Qwen3-shaped model folder (the bookkeeping does not depend on the model's size)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config
    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def measure(folder: str, batch_size: int, steps: int, profile: int) -> float:
    """Seconds of host time per decode step at this batch size, with the device work stubbed out."""
    import torch
    import ember.runner.input_batch as input_batch
    import ember.runner.model_runner as model_runner
    from ember import LLM, SamplingParams

    llm = LLM(folder, device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=max(batch_size, 2),
              max_model_len=8192, max_num_batched_tokens=max(2048, 32 * batch_size))
    engine, runner = llm.engine, llm.engine.runner
    hidden = torch.zeros(runner.max_num_tokens, 64)
    tokens = torch.ones(runner.max_num_tokens, dtype=torch.int64)
    saved = input_batch.prepare_inputs, model_runner.fits_graph_tail
    input_batch.prepare_inputs = lambda *args, **kwargs: None
    model_runner.fits_graph_tail = lambda plan: True
    runner._run = lambda batch, mode=None, desc=None, skip=None: (hidden[:batch.input_ids.shape[0]], tokens)
    try:
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 64)
        for i in range(batch_size):
            engine.add_request([(i * 7 + j) % 500 + 1 for j in range(32)], params)
        for _ in range(8):          # past the prefill
            engine.step()
        profiler = cProfile.Profile() if profile else None
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        for _ in range(steps):
            engine.step()
        if profiler:
            profiler.disable()
        seconds = (time.perf_counter() - start) / steps
        if profiler:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
    finally:
        input_batch.prepare_inputs, model_runner.fits_graph_tail = saved
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile the steps, print the N costliest")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_folder(tmp)
        for batch_size in args.batch_sizes:
            us = measure(folder, batch_size, args.steps, args.profile) * 1e6
            print(f"batch {batch_size}: {us:.1f} us of host bookkeeping a decode step "
                  f"({us / batch_size:.2f} us a request)", flush=True)


if __name__ == "__main__":
    main()
