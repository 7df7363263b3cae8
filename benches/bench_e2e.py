"""End to end on bundled configs with random weights: batch-1 decode latency (Qwen3-0.6B, Llama-3.1-8B) and the
nano-vllm throughput workload (scaled unless EMBER_BENCH_FULL=1), each beside its memory roofline and beside
transformers on the same shapes (a bounded run: fewer iterations, a subset of prompts)."""

from __future__ import annotations

import pytest
import torch

from ember import LLM
from ember.bench.commands import model_bytes, release_engine, run_latency, run_throughput, startup_times, try_peer
from ember.bench.hf_peer import hf_latency, hf_throughput
from ember.bench.workloads import Workload
from ember.bench.roofline import decode_roofline, measure_copy_bandwidth, run_roofline

try:   # benches/ as a plain folder of files, or as a package
    from workloads import DECODE_LATENCY, throughput_spec
except ImportError:
    from benches.workloads import DECODE_LATENCY, throughput_spec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HF_THROUGHPUT_PROMPTS = 16     # transformers pads every batch to its longest prompt and output: keep it small
HF_LATENCY_ITERS = 1


@pytest.fixture(scope="module")
def bandwidth() -> float:
    """Measured device copy bandwidth in bytes/s (before any KV cache takes the memory)."""
    return measure_copy_bandwidth("cuda")


def _show(capsys, lines: list[str]) -> None:
    with capsys.disabled():
        print("\n" + "\n".join("  " + line for line in lines))


@pytest.mark.parametrize("model", ["qwen3-0.6b", "llama-3.1-8b"])
def test_decode_latency(benchmark, bandwidth, model, capsys):
    spec = DECODE_LATENCY
    llm = LLM(model, load_format="dummy", dtype="bfloat16", max_model_len=1024, num_kv_blocks=512,
              max_num_seqs=max(8, spec.batch_size))
    lat = benchmark.pedantic(run_latency, args=(llm, spec.batch_size, spec.input_len, spec.output_len),
                             kwargs={"num_iters": 3}, rounds=1, iterations=1)
    weight_bytes, kv_token_bytes = model_bytes(llm, spec.batch_size)
    roof = decode_roofline(weight_bytes, kv_token_bytes, spec.batch_size, spec.input_len, spec.output_len,
                           bandwidth, lat["mean_tpot_s"])
    startup = startup_times(llm)
    hf_config, dtype, device = llm.engine.runner.hf_config, llm.engine.runner.dtype, llm.engine.runner.device
    release_engine(llm)
    hf, error = try_peer(hf_latency, hf_config, dtype, device, spec.batch_size, spec.input_len, spec.output_len,
                      HF_LATENCY_ITERS)
    benchmark.extra_info.update(model=model, **{k: lat[k] for k in ("ttft_ms", "tpot_ms", "decode_tok_s")},
                                roofline=roof.as_dict(), startup=startup, hf=hf, hf_error=error)
    lines = [f"{model} batch {spec.batch_size}, {spec.input_len} in / {spec.output_len} out: "
             f"{lat['decode_tok_s']:,.1f} tok/s, TPOT p50 {lat['tpot_ms']['p50']:.3f} ms, "
             f"TTFT p50 {lat['ttft_ms']['p50']:.2f} ms; {roof.describe()}"]
    lines.append(f"transformers ({hf['cache']} cache): {hf['decode_tok_s']:,.1f} tok/s, ember/transformers "
                 f"{lat['decode_tok_s'] / hf['decode_tok_s']:.2f}x" if hf else f"transformers failed: {error}")
    _show(capsys, lines)
    assert 0 < lat["tpot_ms"]["p50"] <= lat["tpot_ms"]["p99"]
    assert roof.pct is not None and 0 < roof.pct < 120   # well above 100% the byte count or the bandwidth is wrong


def test_throughput(benchmark, bandwidth, capsys):
    spec = throughput_spec()
    workload = spec.build()
    llm = LLM("qwen3-0.6b", load_format="dummy", dtype="bfloat16", max_model_len=4096)
    result = benchmark.pedantic(run_throughput, args=(llm, workload), rounds=1, iterations=1)
    weight_bytes, kv_token_bytes = model_bytes(llm)
    roof = run_roofline(weight_bytes, kv_token_bytes, result["num_steps"], [len(p) for p in workload.prompts],
                        workload.output_lens, bandwidth, result["elapsed_s"])
    hf_config, dtype, device = llm.engine.runner.hf_config, llm.engine.runner.dtype, llm.engine.runner.device
    release_engine(llm)
    subset = Workload(workload.prompts[:HF_THROUGHPUT_PROMPTS], workload.output_lens[:HF_THROUGHPUT_PROMPTS])
    hf, error = try_peer(hf_throughput, hf_config, dtype, device, subset, HF_THROUGHPUT_PROMPTS)
    benchmark.extra_info.update(workload=spec.name, **result, roofline=roof.as_dict(), hf=hf, hf_error=error)
    lines = [f"{spec.name}: {result['output_tokens']:,} output tokens in {result['elapsed_s']:.2f} s: "
             f"{result['output_tok_s']:,.0f} output tok/s, {result['total_tok_s']:,.0f} total tok/s; "
             f"{roof.describe()}"]
    lines.append(f"transformers ({len(subset.prompts)} prompts, one padded batch): {hf['output_tok_s']:,.0f} "
                 f"output tok/s, ember/transformers {result['output_tok_s'] / hf['output_tok_s']:.2f}x"
                 if hf else f"transformers failed: {error}")
    _show(capsys, lines)
    assert result["output_tokens"] == workload.output_tokens
    assert roof.pct is not None and 0 < roof.pct < 120
