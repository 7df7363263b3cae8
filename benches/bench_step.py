"""One engine step per batch bucket and CUDA-graph mode on the Qwen3-0.6B config (random bf16 weights), each
beside its memory roofline: the step's weights plus the KV it attends to, over the measured copy bandwidth.

Steps are built by hand as `StepInput`s (requests with allocated blocks and a computed context): the requests
enter the runner's table once, then the timed step schedules them as running requests. `ModelRunner.execute`
returns host data, so a call's wall time is the step's time.
"""

from __future__ import annotations

import gc
import inspect

import pytest
import torch

from ember import LLM, SamplingParams
from ember.bench.commands import model_bytes
from ember.bench.roofline import measure_copy_bandwidth, step_bytes
from ember.engine.request import Request, RequestStatus
from ember.runner.step_input import NewRequest, StepInput

try:   # benches/ as a plain folder of files, or as a package
    from workloads import STEP_BATCH_SIZES, STEP_CONTEXT_LEN, STEP_PREFILL_LEN
except ImportError:
    from benches.workloads import STEP_BATCH_SIZES, STEP_CONTEXT_LEN, STEP_PREFILL_LEN

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODEL = "qwen3-0.6b"
BLOCK_SIZE = 16
MAX_SEQS = max(STEP_BATCH_SIZES)
# every decode row holds a context of STEP_CONTEXT_LEN + 1 tokens, plus one prefill chunk, plus slack
NUM_KV_BLOCKS = MAX_SEQS * (STEP_CONTEXT_LEN // BLOCK_SIZE + 2) + STEP_PREFILL_LEN // BLOCK_SIZE + 16
# graphs only for the shapes timed here, so that start-up stays short
CAPTURE_SIZES = tuple(sorted(set(STEP_BATCH_SIZES) | {b + STEP_PREFILL_LEN for b in STEP_BATCH_SIZES}))
SPLIT_LAUNCH_OPTION = "attention_backend_options"


def _mode_kwargs(mode: str) -> dict:
    """LLM keyword arguments of one mode; skips the mode when this build does not expose it."""
    if mode == "eager":
        return {"enforce_eager": True}
    if mode in ("piecewise", "full"):
        return {"cudagraph_mode": mode}
    if SPLIT_LAUNCH_OPTION not in inspect.signature(LLM.__init__).parameters:
        pytest.skip(f"split launch is not exposed: LLM takes no {SPLIT_LAUNCH_OPTION} argument yet")
    return {"cudagraph_mode": "full", SPLIT_LAUNCH_OPTION: (("split_launch", True),)}


@pytest.fixture(scope="module")
def bandwidth() -> float:
    """Measured device copy bandwidth in bytes/s (before any KV cache takes the memory)."""
    return measure_copy_bandwidth("cuda")


@pytest.fixture(scope="module", params=["eager", "piecewise", "full", "full-split"])
def llm(request, bandwidth):
    """One engine per mode; pytest finishes each before building the next, so only one holds memory."""
    try:
        engine = LLM(MODEL, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=MAX_SEQS,
                     num_kv_blocks=NUM_KV_BLOCKS, enable_prefix_caching=False,
                     cudagraph_capture_sizes=CAPTURE_SIZES, **_mode_kwargs(request.param))
    except ValueError as exc:   # a mode this build refuses, with its reason
        pytest.skip(f"mode {request.param} refused: {exc}")
    yield request.param, engine
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def _request(kv, index: int, context_len: int, decode: bool) -> tuple[Request, NewRequest, int]:
    """A running request with `context_len` tokens already cached (decode), or a fresh prompt of that length;
    returns it, its arrival in the runner's table and its query length."""
    prompt = [(index * 7919 + i) % 10_000 for i in range(context_len)]
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1 << 20)
    output = [index % 10_000] if decode else []
    req = Request(f"step-{index}", prompt, params, output_token_ids=output, status=RequestStatus.RUNNING)
    if not kv.try_allocate(req, req.num_tokens):
        raise ValueError(f"{req.num_tokens} tokens do not fit in {NUM_KV_BLOCKS} KV blocks; raise NUM_KV_BLOCKS")
    blocks = tuple(tuple(b) for b in kv.block_ids(req))
    computed = context_len if decode else 0
    new = NewRequest(req.request_id, tuple(prompt), params, index, blocks, computed, tuple(output))
    return req, new, 1 if decode else context_len


def _steps(kv, num_decodes: int, prefill_len: int) -> tuple[list[Request], StepInput, StepInput]:
    """The requests, the step that adds them to the runner's table, and the step that runs them again."""
    made = [_request(kv, i, STEP_CONTEXT_LEN, True) for i in range(num_decodes)]
    if prefill_len:
        made.append(_request(kv, num_decodes, prefill_len, False))
    ids = tuple(n.req_id for _, n, _ in made)
    lens = tuple(q for *_, q in made)
    starts = tuple(n.num_computed_tokens for _, n, _ in made)
    arrive = StepInput(new_requests=tuple(n for _, n, _ in made), req_ids=ids, num_scheduled_tokens=lens,
                       num_decodes=num_decodes, num_computed_tokens=starts)
    again = StepInput(req_ids=ids, num_scheduled_tokens=lens, num_decodes=num_decodes, num_computed_tokens=starts)
    return [r for r, _, _ in made], arrive, again


@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("batch_size", STEP_BATCH_SIZES)
def test_step(benchmark, llm, bandwidth, batch_size, kind, capsys):
    mode, engine = llm
    kv, runner = engine.engine.kv, engine.engine.runner
    prefill_len = STEP_PREFILL_LEN if kind == "mixed" else 0
    reqs, arrive, again = _steps(kv, batch_size, prefill_len)
    try:
        runner.execute(arrive)
        sampled = benchmark.pedantic(runner.execute, args=(again,), rounds=30, iterations=1, warmup_rounds=5)
    finally:
        runner.update_table(StepInput(finished_ids=arrive.req_ids))
        for r in reqs:
            kv.free(r)
    assert len(sampled.sampled_token_ids) == arrive.num_reqs
    assert all(0 <= t < runner.vocab_size for t in sampled.sampled_token_ids)
    if benchmark.stats is None:   # --benchmark-disable: the step ran once, untimed
        return

    weight_bytes, kv_token_bytes = model_bytes(engine, again.total_num_tokens)
    contexts = [STEP_CONTEXT_LEN + 1] * batch_size + ([prefill_len] if prefill_len else [])
    floor_s = step_bytes(weight_bytes, kv_token_bytes, contexts) / bandwidth
    median_s = benchmark.stats.stats.median
    benchmark.extra_info.update(mode=mode, num_tokens=again.total_num_tokens, roofline_s=floor_s,
                                pct_of_roofline=100 * floor_s / median_s, bandwidth_gb_s=bandwidth / 1e9)
    with capsys.disabled():
        print(f"\n  step {mode:10s} {kind:6s} batch {batch_size:3d} ({again.total_num_tokens:4d} tokens): "
              f"{median_s * 1e3:7.3f} ms, roofline {floor_s * 1e3:6.3f} ms ({100 * floor_s / median_s:5.1f}%)")
