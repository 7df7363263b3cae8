"""Every backend fits in what start-up set aside: for each registered backend that runs on CUDA and each bundled
config (random weights) whose weights fit the device, at the default limits (256 requests, 8,192 tokens a step,
the model's whole context), the largest prefill (8,192 tokens at the end of the longest context), a full batch of
decodes at the longest context, and the same decodes sampled with every option that allocates (penalties, which
count each request's 131,072 tokens on the Llama configs, and logprobs) run, and the allocator's peak above what was
allocated before each stays within the profiled activations plus the backend's declared workspace
(docs/memory.md); the step upload keeps the size start-up gave it. Eager and without warm-up, to keep the engine
starts short; one more case starts the default configuration (compiled, CUDA graphs, warm-up) of the Qwen3-0.6B
config. A backend that does not run on CUDA (cpu_sdpa) is checked to be refused at start-up.

In four parts (`bash tests/gpu/run_parts.sh 9`, then 10, 11 and 12), each one device call of under 9 minutes:

    PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_memory_reservation_gpu.py -k "first or default or refused"
    PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_memory_reservation_gpu.py -k second
    PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_memory_reservation_gpu.py -k big
    PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_memory_reservation_gpu.py -k huge
"""

from __future__ import annotations

import gc
import re

import pytest
import torch

from ember.attention_backends.registry import BackendSelectionError, available_backends, get_backend
from ember.kv_spec import KVCacheSpec
from ember.models.bundled import bundled_config_names
from ember.runner.warmup import GREEDY, PROFILE_SAMPLING

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GiB = 2 ** 30
# the cases in four groups, each one device call of under 9 minutes (run_parts.sh 9 to 12), by the id's last word:
# the smallest configs ("first", with the default configuration and the refusals), the 1B configs of long contexts
# ("second": 131,072 tokens for Llama-3.2-1B), Llama-3.1-8B ("big") and the larger ones ("huge", whose weights take
# most of the device or do not fit it); a config not named here goes with the second
GROUPS = {"qwen3-0.6b": "first", "pythia-1b": "first", "gemma-3-1b": "second", "llama-3.2-1b": "second",
          "llama-3.1-8b": "big", "llama-3.1-70b": "huge", "mixtral-8x7b": "huge", "qwen3-30b-a3b": "huge"}

def _block_size(backend: str) -> int:
    """The default 16, or 64 for a backend that serves only pages holding a whole KV tile (flash, per_phase)."""
    for size in (16, 64):
        if not get_backend(backend).supports(KVCacheSpec(size, 8, 128, torch.bfloat16), torch.bfloat16,
                                             torch.device("cuda")):
            return size
    return 16


def _refusal(backend: str) -> list[str]:
    """Why `backend` does not run on CUDA, whatever the model (cpu_sdpa), or [] where it does."""
    spec = KVCacheSpec(_block_size(backend), 8, 128, torch.bfloat16)
    return get_backend(backend).supports(spec, torch.bfloat16, torch.device("cuda"))


CUDA_BACKENDS = [b for b in available_backends() if not _refusal(b)]
REFUSED_BACKENDS = [b for b in available_backends() if _refusal(b)]


def _largest_steps(runner) -> dict[str, int]:
    """{step: device bytes its run allocated at most, above what was allocated before it} for the largest prefill
    and a full batch of decodes at the longest context, sampled greedily and with every option that allocates; the
    context is the null block's (no cache holds 256 contexts of 131,072 tokens), which costs the attention the
    same memory."""
    from ember.runner.step_input import null_block_step
    tokens, reqs, context = runner.max_num_tokens, runner.max_num_reqs, runner.max_model_len
    prefill = min(tokens, context)
    decodes = min(reqs, tokens)
    shapes = {"prefill": ([prefill], context - prefill, GREEDY), "decodes": ([1] * decodes, context - 1, GREEDY),
              "decodes sampled with every option": ([1] * decodes, context - 1, PROFILE_SAMPLING)}
    peaks = {}
    for name, (lens, context_len, params) in shapes.items():
        step = null_block_step("__memory", lens, [params] * len(lens), runner.config.cache.block_size,
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


def _upload_sizes(runner) -> list[int]:
    upload = runner.upload
    return [upload._ring[0][0].numel(), upload._ring[1][0].numel(), upload._device_buf.numel()]


def _check(llm, label: str) -> None:
    runner = llm.engine.runner
    reserved = runner.activation_peak + runner.attention_workspace.nbytes
    sizes = _upload_sizes(runner)
    peaks = _largest_steps(runner)
    print(f"{label}: max_model_len {runner.max_model_len}, {runner.num_blocks} blocks; set aside: activations "
          f"{runner.activation_peak / GiB:.2f} GiB + {runner.attention_workspace.backend} workspace "
          f"{runner.attention_workspace.nbytes / GiB:.2f} GiB; peaks: "
          + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in peaks.items()))
    for name, peak in peaks.items():
        assert peak <= reserved, f"{label} {name}: {peak / GiB:.2f} GiB above the {reserved / GiB:.2f} GiB set aside"
    assert _upload_sizes(runner) == sizes, "the step upload grew past its start-up size"


def _weights_bytes(config: str) -> int:
    from ember.models.bundled import bundled_config
    from ember.models.loader import build_on_meta
    model = build_on_meta(bundled_config(config), torch.bfloat16)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _drop(llm) -> None:
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _config_id(config: str) -> str:
    return f"{config}-{GROUPS.get(config, 'second')}"


@pytest.mark.parametrize("config", bundled_config_names(), ids=_config_id)
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_largest_steps_fit_what_start_up_set_aside(config, backend):
    from ember import LLM
    weights, total = _weights_bytes(config), torch.cuda.get_device_properties(0).total_memory
    if weights > 0.9 * total:       # the default gpu_memory_utilization
        pytest.skip(f"{config}: {weights / GiB:.1f} GiB of weights do not fit in 0.9 of this device's "
                    f"{total / GiB:.1f} GiB")
    llm = LLM(config, load_format="dummy", attention_backend=backend, block_size=_block_size(backend),
              enforce_eager=True, jit_warmup=False, triton_compile_workers=0)
    try:
        _check(llm, f"{config} {backend}")
    finally:
        _drop(llm)


@pytest.mark.parametrize("backend", REFUSED_BACKENDS)
def test_a_backend_that_does_not_run_on_cuda_is_refused_at_start_up(backend):
    """cpu_sdpa: refused with the reason its `supports()` gives, whatever the model (one small config)."""
    from ember import LLM
    with pytest.raises(BackendSelectionError, match=re.escape(_refusal(backend)[0])):
        LLM("qwen3-0.6b", load_format="dummy", attention_backend=backend, enforce_eager=True, jit_warmup=False,
            triton_compile_workers=0)


def test_the_default_configuration_fits_too():
    from ember import LLM
    llm = LLM("qwen3-0.6b", load_format="dummy")
    try:
        _check(llm, "qwen3-0.6b default")
    finally:
        _drop(llm)
