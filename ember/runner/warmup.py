"""Start-up warm-up: run the runner's real step over a set of shapes and sampling settings that reaches every
Triton kernel specialization a run can hit, so no kernel compiles inside the first timed run (`run_warmup`); and
Python's cycle collector, paused for the whole start-up and run once at its end (`cycle_collector_paused`,
`collect_start_up_garbage`).

Triton compiles a @triton.jit kernel once per specialization: its constexpr arguments (tile sizes picked from the
batch shape, feature flags) and, for arguments left in the key, whether an int is 1 or a multiple of 16 and whether
a pointer is 16-byte aligned. Per-step counts are left out of the key in the kernels themselves
(`do_not_specialize`); what is left varies with:

- the decode batch size: GEMV tiles for 1..16 rows, the attention's 2D or 3D (split-KV) decode kernel;
- the query length per request: the attention's query tile (a power of two of the average query length);
- the token count: tiles of long prefills;
- the sampling settings: greedy, random with and without temperature, a mix of both, each on the model's logits
  and on the float32 copy that penalties make; the noise kernel of top-k/top-p (run on a batch with a prefill,
  which samples outside any graph); each again under a grammar bitmask (structured output), which the bitmask
  buffer's start-up content, every token allowed, serves.

Steps inside the CUDA-graph buckets replay graphs whose kernels compiled at capture, so they cost little; steps
past the buckets (or every step without graphs) run eagerly and compile here. Every warm-up request is a prompt
of token 0 whose blocks are all the null block 0, added to the request table and dropped again, as the capture's
dummy steps are: no real KV block is written and the table is left as it was found.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import time
from dataclasses import astuple, dataclass
from pathlib import Path

import torch

from ember.config import usable_cpus
from ember.distributed.parallel_state import agree
from ember.graphs.modes import CUDAGraphMode
from ember.kernels.gemv import GEMV_MAX_M
from ember.runner.sampler import SamplingMetadata
from ember.runner.step_input import null_block_step
from ember.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

logger = logging.getLogger("ember")

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
RANDOM = SamplingParams(temperature=1.0, max_tokens=1)            # no temperature division
HOT = SamplingParams(temperature=0.8, max_tokens=1)
FILTERED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, max_tokens=1)
LOGPROBS = SamplingParams(temperature=0.8, logprobs=2, max_tokens=1)
# the profile run's sampling (`profile_run`): every option that makes the sampler allocate, at once (the filtered
# path; the penalties' [N, V] prompt ids and output counts; logprobs, whose [N, V] are held through the sampling),
# so that no step's sampling needs more than the profile measured
PROFILE_SAMPLING = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, repetition_penalty=1.1,
                                  presence_penalty=0.1, frequency_penalty=0.1, logprobs=MAX_LOGPROBS)

# each batch mix of the one-pass sampling kernel's flags (all greedy, all random with / without temperature,
# greedy and random rows together with / without temperature)
_SAMPLER_MIXES = ((GREEDY,), (RANDOM,), (HOT,), (GREEDY, RANDOM), (GREEDY, HOT))
_SAMPLER_ROWS = 4
# rows whose params carry a grammar sample under the bitmask (no grammar is compiled: the runner only sees rows)
_GRAMMAR = StructuredOutputsParams(json_object=True)


def _constrained(p: SamplingParams) -> SamplingParams:
    return dataclasses.replace(p, structured_outputs=_GRAMMAR)


def _grammar_rows(step) -> tuple[int, ...]:
    """The batch rows of a null-block step whose requests carry a grammar."""
    constrained = {r.req_id for r in step.new_requests if r.sampling_params.structured_outputs is not None}
    return tuple(i for i, req_id in enumerate(step.req_ids) if req_id in constrained)


@dataclass(frozen=True)
class WarmupStep:
    """One warm-up step: each request's query length (single-token decodes first) and sampling parameters."""
    query_lens: tuple[int, ...]
    params: tuple[SamplingParams, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


def _penalised(p: SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=p.temperature, repetition_penalty=1.1, max_tokens=1)


def _decode_sizes(max_num_reqs: int) -> list[int]:
    """Every row count the GEMV tiles distinguish, then each power of two and the size past it, then the most."""
    sizes = set(range(1, min(GEMV_MAX_M, max_num_reqs) + 1))
    p = 2 * GEMV_MAX_M
    while p < max_num_reqs:
        sizes |= {p, p + 1}
        p *= 2
    sizes |= {min(max_num_reqs, GEMV_MAX_M + 1), max_num_reqs}
    return sorted(s for s in sizes if s <= max_num_reqs)


def warmup_plan(max_num_tokens: int, max_num_reqs: int, max_model_len: int,
                capture_sizes: tuple[int, ...] = ()) -> list[WarmupStep]:
    """The warm-up steps for these limits (see the module docstring); every step fits the limits."""
    steps: list[WarmupStep] = []

    def add(query_lens: list[int], params) -> None:
        query_lens = [n for n in query_lens if n > 0]
        if query_lens and len(query_lens) <= max_num_reqs and sum(query_lens) <= max_num_tokens:
            steps.append(WarmupStep(tuple(query_lens), tuple(params[i % len(params)]
                                                             for i in range(len(query_lens)))))

    for n in _decode_sizes(min(max_num_reqs, max_num_tokens)):
        add([1] * n, (GREEDY,))
    # mixed batches: one decode, then prefills whose average length falls in each power-of-two interval; sized
    # past the largest CUDA-graph bucket where the limits allow, as such batches are in a real run
    longest = min(max_model_len, max_num_tokens)
    past_graphs = min(max_num_tokens, max(capture_sizes, default=0) + 1)
    length = 2
    while length <= longest:
        prefills = max(1, min(max_num_reqs - 1, -(-(past_graphs - 1) // length), (max_num_tokens - 1) // length))
        add([1] + [length] * prefills, (GREEDY,))
        length = 2 * length - 1 if length > 2 else 3      # 2, 3, 5, 9, 17, ...: each next power of two
    # pure prefills: an odd token count, and the longest step (a full token budget)
    odd = min(longest, 777)
    add([odd - 1 + odd % 2 if odd > 1 else 1], (GREEDY,))
    add([max_model_len] * (max_num_tokens // max_model_len) + [max_num_tokens % max_model_len], (GREEDY,))
    # the sampler's specializations, on a small batch with a prefill: a uniform decode batch of a FULL-graph bucket
    # samples inside its graph (captured with its own settings), so only such a batch reaches the step's sampler
    # with every setting (the kernels do not tell the two kinds of batch apart)
    rows = [1] * (min(_SAMPLER_ROWS, max_num_reqs, max_num_tokens - 1) - 1) + [2] if max_num_tokens > 1 else [1]
    for mix in _SAMPLER_MIXES:
        add(rows, mix)
        add(rows, tuple(_penalised(p) for p in mix))
    add(rows, (FILTERED, GREEDY))
    add(rows, (LOGPROBS,))
    for mix in _SAMPLER_MIXES + ((FILTERED, GREEDY), (LOGPROBS,)):
        add(rows, tuple(_constrained(p) for p in mix))
    return steps


@torch.inference_mode()
def profile_run(runner) -> int:
    """One dummy step of max_num_batched_tokens tokens spread over max_num_seqs requests, plus sampling a
    full batch; compiles the model (the first call) and returns the peak memory in bytes. On the CPU it only
    compiles, on a small step: nothing measures memory there, and the LM head and sampler over a full batch
    (eager code) took 8 of a 37 s start-up of the Qwen3-0.6B config on two cores."""
    cuda = runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(runner.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(runner.device)
        before = torch.cuda.memory_allocated(runner.device)
    t0 = time.perf_counter()
    # on the CPU there is no memory to measure: a small step suffices to compile
    num_tokens = runner.max_num_tokens if cuda else min(runner.max_num_tokens, 64)
    hidden = runner._dummy_forward(num_tokens, runner.max_num_reqs)[0]
    stats = runner.compile_stats
    if stats is not None:
        runner.times.compile_s = stats.seconds
        runner.times.compile_cache_hit = stats.artifacts_loaded > 0 or stats.fxgraph_cache_hits > 0
    if not cuda:
        return 0
    logits = runner.model.compute_logits(hidden[torch.arange(runner.max_num_reqs, device=runner.device) % len(hidden)])
    n = logits.shape[0]
    meta = SamplingMetadata.build([PROFILE_SAMPLING] * n, [0] * n,
                                  [[]] * n, [[0]] * n, [()] * n, runner.vocab_size, runner.device)
    runner.sampler(logits, meta)
    del hidden, logits
    torch.cuda.synchronize(runner.device)
    logger.info("profile run of %d tokens in %.1f s", runner.max_num_tokens, time.perf_counter() - t0)
    return torch.cuda.max_memory_allocated(runner.device) - before


def run_warmup(runner) -> float:
    """Run every step of the runner's warm-up plan through `runner.execute`; returns the seconds it took."""
    t0 = time.perf_counter()
    plan = warmup_plan(runner.max_num_tokens, runner.max_num_reqs, runner.max_model_len, runner.capture_sizes)
    block_size, num_groups = runner.config.cache.block_size, len(runner.attn.groups)
    for step in plan:
        step_input = null_block_step("__warmup", step.query_lens, step.params, block_size, num_groups)
        step_input = dataclasses.replace(step_input, grammar_rows=_grammar_rows(step_input))
        try:
            runner.execute(step_input)
        finally:
            for new in step_input.new_requests:
                runner.table.remove(new.req_id)
    seconds = time.perf_counter() - t0
    logger.info("warm-up %.1f s: %d steps over the batch shapes and sampling settings that pick Triton kernels",
                seconds, len(plan))
    return seconds


@contextlib.contextmanager
def cycle_collector_paused():
    """Python's cycle collector off while a start-up runs (`LLM.__init__` with its tokenizer's load, and
    `ModelRunner.__init__`, which ends with `collect_start_up_garbage` when it warms up); its earlier state comes back
    on exit, on an error too. Also a decorator.

    A start-up makes hundreds of thousands of lasting objects (Dynamo's and Inductor's state, the compiled forward,
    the graphs) on top of the imports', and every few tens of thousands of them the collector passed over all of
    them again: on an H100 host a warm start of the Qwen3-0.6B config ran three automatic full passes (0.37-0.38 s)
    and 0.10 s of younger ones, a cold start seven full passes (1.6 s). Nothing a start-up needs waits for the
    collector: reference counting frees its tensors, and the KV-cache sizing collects by itself where memory it
    expects free is held. The switch is process-wide: another thread's garbage waits for the start-up too."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def collect_start_up_garbage() -> None:
    """One full pass of the cycle collector at the end of a start-up with the warm-up (the runner makes it where
    the first run's time matters; a full pass costs 0.2-0.3 s there, and more in a process whose heap is larger,
    such as a test run's with its hundreds of engines): it frees the start-up's garbage and moves
    every survivor into the oldest generation, so the first requests do not set off a full pass over the
    start-up's objects (the collector runs one once a burst of new objects follows many not yet passed over: on a
    2-core CPU, after `LLM("qwen3-0.6b", load_format="dummy", device="cpu", compile_mode="default")`, 30,000 new
    lasting objects set off a full pass of 0.19 s; on an H100 the first run of `benches/startup.py` spent 0.23 s
    before its first launch against 0.03 s in the second)."""
    t0 = time.perf_counter()
    collected = gc.collect()
    logger.info("start-up's garbage: one full pass of the cycle collector, %d objects freed, %.2f s", collected,
                time.perf_counter() - t0)


def _marker(runner) -> Path:
    """The file that says an earlier start of this build (model, dtype, device, ember's source, versions, limits,
    settings) had its Triton kernels compiled into this Triton cache."""
    from triton import knobs
    from ember.config import cache_dir
    from ember.graphs.artifacts import compile_cache_key
    from ember.models.loader import compile_identity
    c = runner.config
    settings = {"capture_sizes": list(runner.capture_sizes), "max_num_tokens": runner.max_num_tokens,
                "max_num_reqs": runner.max_num_reqs, "max_model_len": runner.table.max_model_len,
                "cudagraph_mode": runner.modes.cudagraph_mode.name, "compile_mode": runner.modes.compile_mode,
                "capture": c.compile.cudagraph_capture, "jit_warmup": c.compile.jit_warmup,
                "disabled_fusions": list(c.compile.disabled_fusions), "backend": c.attention_backend,
                "backend_options": list(c.attention_backend_options), "block_size": c.cache.block_size,
                "triton_cache": str(knobs.cache.dir), "tensor_parallel": astuple(runner.shard),
                **compile_identity(runner.model)}
    key = compile_cache_key(runner.hf_config.to_dict(), runner.dtype, device=runner.device, settings=settings)
    return cache_dir() / "triton-precompiled" / key


def _dry_steps(runner) -> list[tuple]:
    """(num_tokens, num_reqs, mode, descriptor, query lens or None) of the profile run, the capture (as
    ModelRunner._capture runs them) and the warm-up's forwards that do not replay a captured graph."""
    steps = [(runner.max_num_tokens, runner.max_num_reqs, CUDAGraphMode.NONE, None, None)]
    graphs = runner.graphs
    captured = set()
    if graphs is not None and not graphs.lazy:
        captured = set(runner.dispatcher.capture_list())
        steps += [(d.num_tokens, d.num_reqs if d.uniform_decode else 1, m, d, None) for m, d in captured]
    if runner.config.compile.jit_warmup:
        for step in warmup_plan(runner.max_num_tokens, runner.max_num_reqs, runner.table.max_model_len,
                                runner.capture_sizes):
            lens = list(step.query_lens)
            mode, desc = runner.dispatcher.dispatch(sum(lens), len(lens), all(n == 1 for n in lens))
            if (mode, desc) not in captured:
                steps.append((sum(lens), len(lens), mode, desc, lens))
    return steps


def _dry_sampling_mixes(runner) -> list[tuple[SamplingParams, ...]]:
    """The sampling settings of the profile run and of the warm-up's steps, each once, with no logprobs: the
    dry pass's sampler must not gather at tokens its kernels did not write, and logprobs pick no kernel of their
    own (they are torch ops on the logits)."""
    mixes = {(dataclasses.replace(PROFILE_SAMPLING, logprobs=None),): None}
    if runner.config.compile.jit_warmup:
        for step in warmup_plan(runner.max_num_tokens, runner.max_num_reqs, runner.table.max_model_len,
                                runner.capture_sizes):
            mixes[tuple(dataclasses.replace(p, logprobs=None) for p in step.params)] = None
    return list(mixes)


def _dry_sample(runner, mix: tuple[SamplingParams, ...]) -> None:
    """The step sampler on one row a request of `mix`, its logits from the LM head: the specializations of the
    sampler's kernels for that mix go to the workers. What they return is garbage, and only torch's argmax and
    `where` read it, so nothing indexes with it."""
    n = len(mix)
    hidden = torch.zeros(n, runner.hf_config.hidden_size, dtype=runner.dtype, device=runner.device)
    logits = runner.model.compute_logits(hidden)
    grammar = {}
    if any(p.structured_outputs is not None for p in mix):   # rows under the bitmask buffer (every token allowed)
        rows = [i for i, p in enumerate(mix) if p.structured_outputs is not None]
        mask_index = [rows.index(i) + 1 if i in rows else 0 for i in range(n)]
        grammar = dict(bitmask=runner.grammar.bitmask, mask_index=mask_index)
    meta = SamplingMetadata.build(list(mix), [0] * n, [[]] * n, [[0]] * n, [()] * n, runner.vocab_size,
                                  runner.device, **grammar)
    runner.sampler(logits, meta)


def precompile(runner) -> float:
    """Compile the Triton kernels of the start-up's steps in worker processes (`ember.kernels.precompile`): run
    each step's forward once with ember's kernels handing their specializations to the workers instead of
    launching, plus the LM head where the step's sampler would take logits, then the step sampler on its own with
    each sampling mix of the profile run and the warm-up (`_dry_sample`), then wait for the workers. The real
    steps afterwards load every kernel from Triton's cache. Returns the seconds it took beyond the model's
    compile (which the first dry step triggers). On CUDA it first pins the ptxas Triton runs
    (`triton_key.pin_ptxas`), with workers or not. Nothing runs (0.0) off CUDA, with 0 workers, where the
    `compile_workers` hook is off (ember.kernels.hooks), or when an earlier start of the same build left its marker;
    kernels the dry pass misses compile where they first launch, as without workers. Nothing runs under tensor
    parallel either: its dry steps hung two H100 ranks in a collective."""
    from ember.kernels import hooks
    from ember.kernels import precompile as P
    from ember.kernels import triton_key
    workers = runner.config.compile.triton_compile_workers
    if runner.device.type != "cuda":
        return 0.0
    triton_key.pin_ptxas()      # every CUDA start, workers or not: all starts key Triton's cache alike
    if not workers or not hooks.enabled("compile_workers"):
        return 0.0
    if runner.tp.size > 1:
        # two H100s hung in the dry steps (a rank blocked behind a collective its peer never joined); kernels
        # compile at their first launch instead, as with the hook off
        logger.info("tensor parallel: no Triton compile workers (their dry steps hang the ranks' collectives)")
        return 0.0
    marker = _marker(runner)
    if not agree([int(not marker.exists())], "max")[0]:
        logger.info("Triton kernels compiled by an earlier start of this build: no worker compiles (%s)", marker)
        return 0.0
    t0 = time.perf_counter()
    stats = runner.compile_stats
    compile_before = stats.seconds if stats is not None else 0.0

    def elapsed() -> float:   # since t0, less the model's compile inside the first dry step
        return time.perf_counter() - t0 - ((stats.seconds if stats is not None else 0.0) - compile_before)

    target = P.current_target()
    if not agree([int(target[0] != "cuda" or P.keys_name_current_ptxas(target[1]))], "min")[0]:
        logger.warning("Triton's cache keys in this process (or another rank's) name another ptxas than it runs now "
                       "(TRITON_PTXAS_PATH changed after its first compile): no worker compiles, each kernel "
                       "compiles at its first launch")
        return 0.0
    cpus = usable_cpus()
    if workers > cpus:
        logger.warning("triton_compile_workers %d is more than the %d CPUs this process may use: %d workers start",
                       workers, cpus, cpus)
        workers = cpus
    steps = _dry_steps(runner)
    pool = P.CompilePool(workers, target)
    try:
        graphs = runner.graphs
        with P.compile_only(pool) as handed, torch.inference_mode(), \
                graphs.pause() if graphs is not None else contextlib.nullcontext():
            for num_tokens, num_reqs, mode, desc, lens in steps:
                hidden, sampled = runner._dummy_forward(num_tokens, num_reqs, mode, desc, lens=lens)
                if sampled is None:    # the step's sampler takes the logits of one row a request
                    runner.model.compute_logits(hidden[:min(num_reqs, hidden.shape[0])].contiguous())
            for mix in _dry_sampling_mixes(runner):
                _dry_sample(runner, mix)
        dry_s = elapsed()
        compiled, failed = pool.wait(P.WAIT_S)
    finally:
        pool.close()
    for error in pool.errors:
        logger.warning("a Triton compile worker failed; the kernel compiles at its launch instead: %s", error)
    if not failed:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"specializations": len(handed)}))
    seconds = elapsed()
    logger.info("Triton: %d specializations from %d dry steps compiled in %d worker processes in %.1f s (dry steps "
                "%.1f s; the model's compile not counted), %d failed", compiled, len(steps), pool.workers, seconds,
                dry_s, failed)
    return seconds
