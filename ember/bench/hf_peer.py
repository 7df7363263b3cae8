"""transformers on the same workloads as `ember bench`, as the peer printed beside ember's figures: random weights
of the same config, `generate` with its own caches."""

from __future__ import annotations

import random
import time

import torch

from ember.bench.roofline import device_sync
from ember.bench.workloads import MAX_PROMPT_TOKEN_ID, Workload, percentiles


def _hf_model(hf_config, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM
    if hasattr(hf_config, "to_transformers"):     # ember's resolved snapshot of the config
        hf_config = hf_config.to_transformers()
    torch.manual_seed(0)
    with torch.device(device):   # random init straight on the device: no host copy of an 8B model
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()


class _TokenTimes:
    """A generate() streamer that records when each step's tokens reach the host (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _hf_generate(model, prompts: list[list[int]], num_new: int, temperature: float, streamer=None,
                 cache_implementation: str | None = None):
    """Left-padded batched generate of exactly `num_new` tokens per row."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)                 # [batch, width], 0 as padding
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    extra = {"cache_implementation": cache_implementation} if cache_implementation else {}
    with torch.inference_mode():
        return model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=num_new,
                              min_new_tokens=num_new, pad_token_id=0, streamer=streamer, **sampling, **extra)


def hf_throughput(hf_config, dtype: torch.dtype, device: torch.device, workload: Workload, batch_size: int,
                  temperature: float = 0.6) -> dict:
    """transformers `generate` over the workload in padded batches; rates count only the asked-for tokens."""
    model = _hf_model(hf_config, dtype, device)
    _hf_generate(model, [workload.prompts[0][:8]], 4, temperature)   # warm-up
    device_sync(device)
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), batch_size):
        _hf_generate(model, workload.prompts[i:i + batch_size], max(workload.output_lens[i:i + batch_size]),
                     temperature)
    device_sync(device)
    elapsed = time.perf_counter() - start
    del model
    return {"num_prompts": len(workload.prompts), "batch_size": batch_size, "elapsed_s": elapsed,
            "output_tok_s": workload.output_tokens / elapsed,
            "total_tok_s": (workload.input_tokens + workload.output_tokens) / elapsed}


def hf_latency(hf_config, dtype: torch.dtype, device: torch.device, batch_size: int, input_len: int,
               output_len: int, num_iters: int = 3, seed: int = 0, max_token_id: int = MAX_PROMPT_TOKEN_ID) -> dict:
    """transformers greedy generate, timed per token through a streamer; on CUDA with a static cache, which
    transformers compiles (gpt-fast style)."""
    model = _hf_model(hf_config, dtype, device)
    cache = "static" if device.type == "cuda" else None
    rng = random.Random(seed)
    ttfts, tpots = [], []
    for it in range(num_iters + 2):      # two warm-ups: the first compiles, the second records graphs
        prompts = [[rng.randint(0, max_token_id) for _ in range(input_len)] for _ in range(batch_size)]
        timer = _TokenTimes()
        device_sync(device)
        start = time.perf_counter()
        _hf_generate(model, prompts, output_len, 0.0, timer, cache)
        if it >= 2:
            stamps = timer.times[1:]     # drop the prompt's put
            ttfts.append(stamps[0] - start)
            tpots += [b - a for a, b in zip(stamps, stamps[1:])]
    del model
    return {"cache": cache or "dynamic", "ttft_ms": {k: v * 1e3 for k, v in percentiles(ttfts).items()},
            "tpot_ms": {k: v * 1e3 for k, v in percentiles(tpots).items()},
            "decode_tok_s": batch_size * len(tpots) / sum(tpots)}
