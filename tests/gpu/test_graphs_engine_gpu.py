"""Every CUDA-graph mode against eager, through the whole engine, on random weights of real configs (trimmed to a
few layers): float32 greedy tokens equal; bf16 teacher-forced logits within tolerance with top-1 agreement >= 98%;
a FULL replay bitwise equal to the same compiled forward run without graphs at the same padded size."""

import gc

import pytest
import torch
from tests.helpers.bf16_check import bf16_report
from tests.helpers.engine_checks import add_mixed_requests

from ember import LLM, SamplingParams
from ember.graphs.modes import CUDAGraphMode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CAPTURE = [1, 2, 4, 8, 16, 32, 64, 128, 256]
MODES = {
    "piecewise": dict(cudagraph_mode="piecewise"),
    "full": dict(cudagraph_mode="full"),
    "full_and_piecewise": dict(cudagraph_mode="full_and_piecewise"),
    "full_decode_only": dict(cudagraph_mode="full_decode_only"),
    "full_split": dict(cudagraph_mode="full", attention_backend_options={"split_launch": True}),
    "full_lazy": dict(cudagraph_mode="full", cudagraph_capture="lazy"),
    "piecewise_lazy": dict(cudagraph_mode="piecewise", cudagraph_capture="lazy"),
}
BF16_ERR_RATIO = 1.25   # a mode's bf16 error vs float32 eager, over eager bf16's error vs float32 eager


def workload():
    """Prompts whose lengths put steps on and between buckets, chunked by a 512-token budget."""
    g = torch.Generator().manual_seed(3)
    lens = [3, 7, 8, 9, 31, 33, 64, 100, 300, 700, 5, 17, 1]
    return [torch.randint(0, 10000, (n,), generator=g).tolist() for n in lens]


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def _tokens(llm, prompts, n=24):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def eager_fp32_tokens():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM("qwen3-0.6b", load_format="dummy", dtype="float32", max_model_len=1024, max_num_seqs=64,
              max_num_batched_tokens=512, enforce_eager=True, gpu_memory_utilization=0.4)
    toks = _tokens(llm, workload())
    torch.backends.cuda.matmul.allow_tf32 = saved
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return toks


@pytest.mark.parametrize("mode", list(MODES))
def test_float32_modes_match_eager(mode, eager_fp32_tokens, no_tf32):
    llm = LLM("qwen3-0.6b", load_format="dummy", dtype="float32", max_model_len=1024, max_num_seqs=64,
              max_num_batched_tokens=512, cudagraph_capture_sizes=CAPTURE, gpu_memory_utilization=0.4,
              **MODES[mode])
    runner = llm.engine.runner
    expected = len(runner.dispatcher.capture_list())
    assert expected > 0

    def captured():
        return sum(runner.graphs.num_descriptors(m) for m in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE))
    lazy = MODES[mode].get("cudagraph_capture") == "lazy"
    assert captured() == (0 if lazy else expected)
    assert _tokens(llm, workload()) == eager_fp32_tokens
    # lazy capture: the buckets the workload used twice or more were captured on their second use, no others
    assert (0 < captured() <= expected) if lazy else (captured() == expected)
    print(f"{mode}: {captured()} descriptors captured in {runner.times.capture_s:.1f} s, compile "
          f"{runner.times.compile_s:.1f} s (cache hit {runner.times.compile_cache_hit})")
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _scores(dtype, **kwargs):
    llm = LLM("llama-3.2-1b", load_format="dummy", dtype=dtype, max_model_len=1024, max_num_seqs=64,
              max_num_batched_tokens=1024, gpu_memory_utilization=0.3, **kwargs)
    out = torch.cat([llm.engine.score(s).float() for s in workload() if len(s) >= 64])
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out


@pytest.fixture(scope="module")
def eager_scores():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    fp32 = _scores("float32", enforce_eager=True)
    torch.backends.cuda.matmul.allow_tf32 = saved
    return _scores("bfloat16", enforce_eager=True), fp32


@pytest.mark.parametrize("mode", ["piecewise", "full", "full_split"])
def test_bfloat16_modes_close_to_eager(mode, eager_scores):
    eager16, eager32 = eager_scores
    got = _scores("bfloat16", cudagraph_capture_sizes=CAPTURE, **MODES[mode])
    r = bf16_report(got, eager16, eager32)
    print(f"bf16 {mode} vs eager: {r}")
    assert r["rel_err_vs_fp32"] <= BF16_ERR_RATIO * r["ref_rel_err_vs_fp32"]
    assert r["num_decided"] >= 64 and r["top1_decided"] >= 0.98


def test_full_replay_bitwise_equals_compiled_without_graphs():
    """Per step: the FULL replay's hidden states equal the graph-free forward's at the same padded size, and the
    sampler (reading its parameters from the request table) gives the same tokens from both, greedy and seeded;
    the sampled tokens reach the next step through the table."""
    llm = LLM("qwen3-0.6b", load_format="dummy", dtype="bfloat16", max_model_len=1024, max_num_seqs=64,
              max_num_batched_tokens=512, cudagraph_capture_sizes=CAPTURE, gpu_memory_utilization=0.4,
              cudagraph_mode="full")
    engine, runner = llm.engine, llm.engine.runner
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=11, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=12, max_tokens=4, ignore_eos=True)]
    for i, p in enumerate(workload()[:5]):    # 3 + 7 + 8 + 9 + 31 = 58 prompt tokens: bucket 64
        engine.add_request(p, params[i % len(params)])
    seen = set()
    for _ in range(3):                        # the prefill step (mixed), then decode steps (uniform, 5 of 8)
        out = engine.scheduler.schedule()
        n, t = len(out.scheduled), out.total_num_tokens
        with torch.inference_mode():
            prepared = runner.prepare_step(out.step)
            assert prepared.mode == CUDAGraphMode.FULL and prepared.desc.num_tokens > t   # smaller than its bucket
            batch = prepared.batch
            no_graph, no_tokens = runner._run(batch, CUDAGraphMode.NONE, None)
            no_graph = no_graph.clone()
            assert no_tokens is None
            eager_tokens = runner.sample_step(prepared, no_graph).result().sampled_token_ids
            replay, tokens = runner._run(batch, CUDAGraphMode.FULL, prepared.desc)
            assert torch.equal(no_graph[:t], replay[:t])
            result = runner.sample_step(prepared, replay, tokens).result()
        assert result.sampled_token_ids == eager_tokens
        seen.add(out.num_decodes == n)
        engine.scheduler.update(out, result.sampled_token_ids)
    assert seen == {False, True}
    assert runner.graphs.num_descriptors(CUDAGraphMode.FULL) == len(runner.dispatcher.capture_list())


@pytest.mark.parametrize("temperatures", [(0.0,), (0.8,), (0.0, 0.7, 1.0)], ids=["greedy", "seeded", "mixed"])
def test_sampler_inside_full_decode_graph_equals_outside(temperatures):
    """Uniform-decode FULL graphs record the LM head and the sampler: the tokens a replay samples (and writes into
    the request table) equal those the eager sampler draws from the graph-free forward's hidden states, for
    greedy, seeded and mixed batches, over several steps."""
    llm = LLM("qwen3-0.6b", load_format="dummy", dtype="bfloat16", max_model_len=1024, max_num_seqs=64,
              max_num_batched_tokens=512, cudagraph_capture_sizes=CAPTURE, gpu_memory_utilization=0.4,
              cudagraph_mode="full")
    engine, runner = llm.engine, llm.engine.runner
    add_mixed_requests(engine, workload()[:5], temperatures, seed=20, max_tokens=6)
    in_graph = 0
    for _ in range(5):
        out = engine.scheduler.schedule()
        with torch.inference_mode():
            prepared = runner.prepare_step(out.step)
            hidden, tokens = runner._run(prepared.batch, prepared.mode, prepared.desc)
            got = runner.sample_step(prepared, hidden, tokens).result().sampled_token_ids
            if tokens is not None:
                in_graph += 1
                want = runner.sample_step(prepared, hidden.clone()).result().sampled_token_ids
                assert got == want
                rows = prepared.batch.sample_index[:len(got)]
                assert runner.table.token_ids.view(-1)[rows].tolist() == want
        engine.scheduler.update(out, got)
    assert in_graph >= 3


def test_short_context_decode_graphs_match_split_kv(no_tf32):
    """Small decode buckets of triton_unified have a second graph for short contexts (the one-pass decode kernel);
    steps whose requests fit take it, and the tokens equal those of split-KV graphs alone (`short_decode_len` 0)."""
    prompts = workload()[:6]     # 3 to 64 tokens: every context stays under 100
    tokens = {}
    for short in (512, 0):
        llm = LLM("qwen3-0.6b", load_format="dummy", dtype="float32", max_model_len=1024, max_num_seqs=64,
                  max_num_batched_tokens=512, cudagraph_capture_sizes=CAPTURE, gpu_memory_utilization=0.4,
                  cudagraph_mode="full", attention_backend_options={"short_decode_len": short})
        runner = llm.engine.runner
        seen, dispatch = [], runner.dispatcher.dispatch
        runner.dispatcher.dispatch = lambda *args: seen.append(got := dispatch(*args)) or got
        tokens[short] = _tokens(llm, prompts)
        bounds = {desc.max_seq_len for _, desc in seen if desc.uniform_decode}
        captured = runner.graphs.num_descriptors(CUDAGraphMode.FULL)
        print(f"short_decode_len {short}: {captured} graphs, decode steps' bounds {bounds}")
        assert captured == len(runner.dispatcher.capture_list())
        if short:
            assert runner.dispatcher.short_decode and bounds == {512}
        else:
            assert not runner.dispatcher.short_decode and bounds == {None}
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens[512] == tokens[0]
