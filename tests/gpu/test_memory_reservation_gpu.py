"""Every backend fits in what start-up set aside: for each registered backend and each bundled config (random
weights) whose weights fit the device, at the default limits (256 requests, 8,192 tokens a step, the model's whole
context), the largest prefill (8,192 tokens at the end of the longest context) and a full batch of decodes at the
longest context run, and the allocator's peak above what was allocated before each stays within the profiled
activations plus the backend's declared workspace (docs/memory.md). Eager and without warm-up, to keep the engine
starts short; one more case starts the default configuration (compiled, CUDA graphs, warm-up) of the Qwen3-0.6B
config. A backend that does not run on CUDA (cpu_sdpa) is checked to be refused at start-up.

    PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_memory_reservation_gpu.py
"""

from __future__ import annotations

import gc
import re

import pytest
import torch

from ember.attention_backends.registry import BackendSelectionError, available_backends, get_backend
from ember.kv_spec import KVCacheSpec
from ember.models.bundled import bundled_config_names

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GiB = 2 ** 30


def _largest_steps(runner) -> dict[str, int]:
    """{step: device bytes its run allocated at most, above what was allocated before it} for the largest prefill
    and a full batch of decodes at the longest context; the context is the null block's (no cache holds 256 contexts
    of 131,072 tokens), which costs the attention the same memory."""
    from ember.runner.step_input import null_block_step
    from ember.runner.warmup import GREEDY
    tokens, reqs, context = runner.max_num_tokens, runner.max_num_reqs, runner.max_model_len
    prefill = min(tokens, context)
    decodes = min(reqs, tokens)
    shapes = {"prefill": ([prefill], context - prefill), "decodes": ([1] * decodes, context - 1)}
    peaks = {}
    for name, (lens, context_len) in shapes.items():
        step = null_block_step("__memory", lens, [GREEDY] * len(lens), runner.config.cache.block_size,
                               len(runner.attn.groups), context_len)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        try:
            out = runner.execute(step)
            assert len(out.sampled_token_ids) == len(lens)
        finally:
            for new in step.new_requests:
                runner.table.remove(new.req_id)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
    return peaks


def _check(llm, label: str) -> None:
    runner = llm.engine.runner
    reserved = runner.activation_peak + runner.attention_workspace.nbytes
    peaks = _largest_steps(runner)
    print(f"{label}: max_model_len {runner.max_model_len}, {runner.num_blocks} blocks; set aside: activations "
          f"{runner.activation_peak / GiB:.2f} GiB + {runner.attention_workspace.backend} workspace "
          f"{runner.attention_workspace.nbytes / GiB:.2f} GiB; peaks: "
          + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in peaks.items()))
    for name, peak in peaks.items():
        assert peak <= reserved, f"{label} {name}: {peak / GiB:.2f} GiB above the {reserved / GiB:.2f} GiB set aside"


def _weights_bytes(config: str) -> int:
    from ember.models.bundled import bundled_config
    from ember.models.loader import build_on_meta
    model = build_on_meta(bundled_config(config), torch.bfloat16)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _drop(llm) -> None:
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("config", bundled_config_names())
@pytest.mark.parametrize("backend", available_backends())
def test_largest_steps_fit_what_start_up_set_aside(config, backend):
    from ember import LLM
    weights, total = _weights_bytes(config), torch.cuda.get_device_properties(0).total_memory
    if weights > 0.9 * total:       # the default gpu_memory_utilization
        pytest.skip(f"{config}: {weights / GiB:.1f} GiB of weights do not fit in 0.9 of this device's "
                    f"{total / GiB:.1f} GiB")
    # flash serves only pages that hold a whole KV tile; everything else at its default
    block_size = 64 if backend == "flash" else 16
    kwargs = dict(load_format="dummy", attention_backend=backend, block_size=block_size, enforce_eager=True,
                  jit_warmup=False, triton_compile_workers=0)
    reasons = get_backend(backend).supports(KVCacheSpec(block_size, 8, 128, torch.bfloat16), torch.bfloat16,
                                            torch.device("cuda"))
    if reasons:     # a backend that does not run on CUDA (cpu_sdpa) is refused at start-up, with the reason
        with pytest.raises(BackendSelectionError, match=re.escape(reasons[0])):
            LLM(config, **kwargs)
        return
    llm = LLM(config, **kwargs)
    try:
        _check(llm, f"{config} {backend}")
    finally:
        _drop(llm)


def test_the_default_configuration_fits_too():
    from ember import LLM
    llm = LLM("qwen3-0.6b", load_format="dummy")
    try:
        _check(llm, "qwen3-0.6b default")
    finally:
        _drop(llm)
