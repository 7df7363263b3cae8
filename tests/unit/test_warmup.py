"""The start-up Triton warm-up (ember.runner.warmup) on a tiny random-weight model on the CPU, where it is off by
default and switched on here: its plan fits the limits and covers the shapes, it runs through the real step, leaves
the request table as it found it, writes only the null KV block, and changes no later token."""

import pytest
import torch
from transformers import Qwen3Config

from ember.config import CacheConfig, CompileConfig, EngineConfig, ModelConfig, SchedulerConfig
from ember.graphs.buckets import default_capture_sizes
from ember.runner.model_runner import ModelRunner
from ember.runner.step_input import NewRequest, StepInput
from ember.runner.warmup import (FILTERED, GREEDY, HOT, LOGPROBS, RANDOM, _penalised, run_warmup,
                                 warmup_plan)
from ember.sampling_params import SamplingParams

MAX_SEQS, MAX_TOKENS, MAX_LEN = 6, 48, 64


def _config(jit_warmup):
    return EngineConfig(model=ModelConfig("tiny-qwen3", dtype="float32", max_model_len=MAX_LEN),
                        cache=CacheConfig(block_size=16, num_kv_blocks=24),
                        scheduler=SchedulerConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_TOKENS),
                        compile=CompileConfig(jit_warmup=jit_warmup), device="cpu").resolve()


HF_CONFIG = Qwen3Config(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                        tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])


def _runner(jit_warmup, monkeypatch=None, calls=None):
    if monkeypatch is not None:
        execute = ModelRunner.execute

        def counted(self, step):
            calls.append(step)
            return execute(self, step)

        monkeypatch.setattr(ModelRunner, "execute", counted)
    return ModelRunner(_config(jit_warmup), "tiny-qwen3", hf_config=HF_CONFIG, load_format="dummy")


def test_plan_fits_the_limits_and_covers_each_shape_and_sampler_setting():
    plan = warmup_plan(MAX_TOKENS, MAX_SEQS, MAX_LEN)
    for step in plan:
        assert 1 <= len(step.query_lens) <= MAX_SEQS and step.num_tokens <= MAX_TOKENS
        assert all(1 <= n <= MAX_LEN for n in step.query_lens) and len(step.params) == len(step.query_lens)
        decodes = [n == 1 for n in step.query_lens]
        assert decodes == sorted(decodes, reverse=True), "decodes must lead the batch"
    greedy_decodes = {len(s.query_lens) for s in plan if set(s.query_lens) == {1} and set(s.params) == {GREEDY}}
    assert set(range(1, MAX_SEQS + 1)) <= greedy_decodes
    mixed = [s for s in plan if s.query_lens[0] == 1 and max(s.query_lens) > 1]
    assert len({max(s.query_lens) for s in mixed}) >= 4
    assert any(len(s.query_lens) == 1 and s.num_tokens % 2 == 1 and s.num_tokens > 1 for s in plan)
    assert any(s.num_tokens == MAX_TOKENS for s in plan)
    mixes = {tuple(dict.fromkeys(s.params)) for s in plan}
    for mix in ((RANDOM,), (HOT,), (GREEDY, RANDOM), (GREEDY, HOT)):
        assert mix in mixes and tuple(_penalised(p) for p in mix) in mixes
    assert (FILTERED, GREEDY) in mixes and (LOGPROBS,) in mixes


def test_plan_for_default_limits_reaches_past_the_graph_buckets():
    sizes = default_capture_sizes(8192)
    plan = warmup_plan(8192, 256, 40960, sizes)
    decodes = {len(s.query_lens) for s in plan if set(s.query_lens) == {1}}
    assert set(range(1, 17)) | {17, 32, 33, 256} <= decodes
    eager_mixed = [s for s in plan if s.query_lens[0] == 1 and s.num_tokens > max(sizes)]
    assert len(eager_mixed) >= 8
    assert max(s.num_tokens for s in plan) == 8192
    assert all(len(s.query_lens) <= 256 and s.num_tokens <= 8192 for s in plan)


def test_jit_warmup_defaults_off_on_the_cpu():
    assert _config(None).compile.jit_warmup is False


def test_warmup_off_runs_no_step(monkeypatch):
    calls = []
    runner = _runner(False, monkeypatch, calls)
    assert calls == [] and runner.times.warmup_s == 0.0


def _block_axis(cache, num_blocks):
    return 1 if cache.shape[0] == 2 and cache.shape[1] == num_blocks else 0


def test_warmup_runs_every_step_and_leaves_table_and_cache_as_found(monkeypatch):
    calls = []
    runner = _runner(True, monkeypatch, calls)
    plan = warmup_plan(runner.max_num_tokens, runner.max_num_reqs, runner.max_model_len, runner.capture_sizes)
    assert len(calls) == len(plan) and runner.times.warmup_s > 0
    assert [step.num_scheduled_tokens for step in calls] == [s.query_lens for s in plan]
    table = runner.table
    assert table.num_rows == 0 and table.rows == {}
    assert sorted(table._free) == list(range(MAX_SEQS))

    # again, with every real block holding a marker: only the null block 0 may change
    caches = [state.kv_cache for state in runner.layer_states.values()]
    for cache in caches:
        cache.narrow(_block_axis(cache, runner.num_blocks), 1, runner.num_blocks - 1).fill_(7.0)
        cache.narrow(_block_axis(cache, runner.num_blocks), 0, 1).zero_()
    run_warmup(runner)
    for cache in caches:
        axis = _block_axis(cache, runner.num_blocks)
        assert bool((cache.narrow(axis, 1, runner.num_blocks - 1) == 7.0).all())
        assert bool((cache.narrow(axis, 0, 1) != 0).any()), "the warm-up wrote no KV at all"
    assert table.num_rows == 0 and sorted(table._free) == list(range(MAX_SEQS))


def _greedy_tokens(runner, prompt, n):
    """A request's first n greedy tokens, stepping the runner as the engine would (blocks 1..)."""
    blocks = tuple(range(1, 1 + -(-(len(prompt) + n) // 16)))
    params = SamplingParams(temperature=0.0, max_tokens=n)
    new = NewRequest("r", tuple(prompt), params, 0, (blocks,), 0)
    out = runner.execute(StepInput(new_requests=(new,), req_ids=("r",), num_scheduled_tokens=(len(prompt),),
                                   num_computed_tokens=(0,)))
    tokens = [out.sampled_token_ids[0]]
    for i in range(n - 1):
        out = runner.execute(StepInput(req_ids=("r",), num_scheduled_tokens=(1,), num_decodes=1,
                                       num_computed_tokens=(len(prompt) + i,)))
        tokens.append(out.sampled_token_ids[0])
    runner.update_table(StepInput(finished_ids=("r",)))
    return tokens


def test_tokens_after_warmup_equal_tokens_without_it():
    torch.manual_seed(0)
    prompt = [5, 17, 250, 3, 99, 41, 7, 12, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert _greedy_tokens(_runner(True), prompt, 6) == _greedy_tokens(_runner(False), prompt, 6)


def test_null_block_step_with_context():
    from ember.runner.step_input import null_block_step
    step = null_block_step("d", [3, 1], [GREEDY, GREEDY], 16, 2, context_len=20)
    assert step.req_ids == ("d_1", "d_0") and step.num_scheduled_tokens == (1, 3) and step.num_decodes == 1
    assert step.num_computed_tokens == (20, 20)
    for new, n in zip(step.new_requests, (3, 1)):
        assert len(new.prompt_token_ids) == 20 + n and new.num_computed_tokens == 20
        assert new.block_ids == ((0, 0), (0, 0))      # 21-23 tokens: two null blocks per group
    with pytest.raises(ValueError, match="context_len -1"):
        null_block_step("d", [1], [GREEDY], 16, 1, context_len=-1)


def test_dummy_forward_with_context_leaves_the_table_as_found(monkeypatch):
    runner = _runner(False, monkeypatch, [])
    hidden = runner._dummy_forward(2, 2, context_len=40)[0]
    assert hidden.shape[0] >= 2 and bool(torch.isfinite(hidden[:2]).all())
    # each request attended 40 tokens of context and its own one
    assert runner.input_batch.seq_lens[:2].tolist() == [41, 41]
    assert runner.input_batch.positions[:2].tolist() == [40, 40]
    assert runner.table.num_rows == 0 and sorted(runner.table._free) == list(range(MAX_SEQS))


@pytest.mark.parametrize("jit_warmup", [False, True])
def test_start_up_pauses_the_cycle_collector_and_ends_with_one_full_pass(jit_warmup, monkeypatch):
    """No automatic pass over the start-up's objects while it runs; one full pass at its end when it warms up, none
    without the warm-up; the collector's state is restored."""
    import gc
    inside, passes = [False], []
    start = ModelRunner._start

    def watched(self, *args):
        inside[0] = True
        try:
            start(self, *args)
        finally:
            inside[0] = False

    def seen(phase, info):
        if phase == "start" and inside[0]:
            passes.append((info["generation"], gc.isenabled()))
    monkeypatch.setattr(ModelRunner, "_start", watched)
    config = _config(jit_warmup)
    assert gc.isenabled()
    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)       # left on, the collector would pass over everything at once and often
    gc.callbacks.append(seen)
    try:
        runner = ModelRunner(config, "tiny-qwen3", hf_config=HF_CONFIG, load_format="dummy")
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*threshold)
    assert gc.isenabled()
    assert runner.times.warmup_s > 0 if jit_warmup else runner.times.warmup_s == 0
    automatic = [g for g, enabled in passes if enabled]
    assert automatic == [], f"automatic passes during the start-up: generations {automatic}"
    if jit_warmup:
        assert passes and passes[-1][0] == 2, f"the start-up did not end with a full pass: {passes}"
    else:
        assert passes == [], f"passes in a start-up without the warm-up: {passes}"


def test_a_failed_start_up_restores_the_cycle_collector(monkeypatch):
    import gc

    def fail(runner):
        raise RuntimeError("capture failed")
    monkeypatch.setattr(ModelRunner, "_log_capacity", fail)
    with pytest.raises(RuntimeError, match="capture failed"):
        _runner(False)
    assert gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(RuntimeError, match="capture failed"):
            _runner(False)
        assert not gc.isenabled(), "a start-up switched on a collector its caller had off"
    finally:
        gc.enable()


def test_llm_start_up_pauses_the_cycle_collector_through_the_tokenizer_load(tmp_path, monkeypatch):
    """`LLM(...)` runs its whole start-up, the tokenizer's load included, with the collector off, and leaves it on."""
    import gc
    import ember.llm
    from ember import LLM
    from tests.helpers.model_harness import random_hf_model, tiny_config
    random_hf_model(tiny_config("llama"), seed=5).save_pretrained(tmp_path)
    seen = []
    load = ember.llm._load_tokenizer

    def recorded(*args, **kwargs):
        seen.append(gc.isenabled())
        return load(*args, **kwargs)
    monkeypatch.setattr(ember.llm, "_load_tokenizer", recorded)
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "cache"))
    assert gc.isenabled()
    LLM(str(tmp_path), device="cpu", compile_mode="none")
    assert seen == [False], f"the collector was on during the tokenizer's load: {seen}"
    assert gc.isenabled()


def test_the_dry_pass_samples_with_every_sampler_kernel_setting_the_warm_up_reaches(monkeypatch):
    """`precompile`'s dry pass runs the step sampler on its own (`_dry_sample`), once for each sampling mix of the
    profile run and the warm-up: every (kernel, logits dtype, flags) the warm-up's real steps reach, it reaches."""
    from ember.kernels import sampling
    from ember.runner.sampler import Sampler
    from ember.runner.warmup import _dry_sample, _dry_sampling_mixes
    runner = _runner(True)
    # the Triton kernels, interpreted on the CPU, in the runner's sampler and the decode tail's (one object)
    runner.sampler = runner.decode_tail.sampler = Sampler(use_triton=True)
    seen = set()

    def one_pass(logits, temperature, seeds, counters, greedy_mask, all_greedy, bitmask=None, mask_index=None):
        seen.add(("one_pass", logits.dtype, temperature is not None and not all_greedy,
                  greedy_mask is not None and not all_greedy, all_greedy, bitmask is not None))
        return sample(logits, temperature, seeds, counters, greedy_mask, all_greedy, bitmask, mask_index)

    def apply_mask(logits, bitmask, mask_index):
        seen.add(("bitmask",))
        return apply(logits, bitmask, mask_index)

    def noise(seeds, counters, vocab_size):
        seen.add(("noise",))
        return gumbel(seeds, counters, vocab_size)

    sample, gumbel, apply = sampling.sample_triton, sampling.gumbel_noise_triton, sampling.apply_token_bitmask_triton
    monkeypatch.setattr(sampling, "sample_triton", one_pass)
    monkeypatch.setattr(sampling, "gumbel_noise_triton", noise)
    monkeypatch.setattr(sampling, "apply_token_bitmask_triton", apply_mask)
    run_warmup(runner)
    warm_up, seen = seen, set()
    mixes = _dry_sampling_mixes(runner)
    assert all(p.logprobs is None for mix in mixes for p in mix)
    assert len(mixes) == len({repr(m) for m in mixes})
    for mix in mixes:
        _dry_sample(runner, mix)
    assert ("noise",) in warm_up and ("bitmask",) in warm_up and len(warm_up) >= 12, warm_up
    assert any(key[-1] for key in warm_up if key[0] == "one_pass")      # the one-pass kernel under a bitmask
    assert warm_up <= seen, warm_up - seen
