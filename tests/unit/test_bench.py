"""`ember bench`: the standard workload draw, the roofline arithmetic, and both sub-commands end to end on CPU."""

import json

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from ember.bench.workloads import parse_range, percentiles, random_workload
from ember.bench.roofline import (Roofline, context_tokens_read, decode_roofline, decode_weight_bytes,
                                  kv_bytes_per_token, run_roofline, step_bytes)
from ember.cli import main
from ember.models.bundled import bundled_config
from ember.models.loader import build_on_meta


def test_standard_workload_matches_nano_vllm():
    w = random_workload(256, (100, 1024), (100, 1024), seed=0)
    assert w.output_tokens == 133_966
    assert w.input_tokens == 142_827
    assert all(100 <= len(p) <= 1024 for p in w.prompts) and all(0 <= t <= 10_000 for p in w.prompts for t in p)
    assert random_workload(256, (100, 1024), (100, 1024), seed=1).output_tokens != 133_966


def test_parse_range_and_percentiles():
    assert parse_range("100:1024") == (100, 1024) and parse_range("32") == (32, 32)
    for bad in ("0:4", "9:3", "a:b"):
        with pytest.raises(ValueError, match="range"):
            parse_range(bad)
    assert percentiles([1.0, 2.0, 3.0, 4.0, 5.0]) == {"p50": 3.0, "p90": 4.6, "p99": pytest.approx(4.96)}


def test_qwen3_roofline_arithmetic():
    cfg = bundled_config("qwen3-0.6b")
    # 28 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 114_688
    assert kv_bytes_per_token(cfg, torch.float32) == 229_376
    # 596,049,920 parameters, the tied embedding counted once (it is read as the LM head)
    weight_bytes = decode_weight_bytes(build_on_meta(cfg, torch.bfloat16), cfg)
    assert weight_bytes == 2 * 596_049_920
    # untied: 2 layers x (q 4096 + k 2048 + v 2048 + o 4096 + MLP 24,576 + norms 128) + final norm 64 + LM head
    # 20,480 = 94,528 parameters read; the 20,480-entry input embedding is only gathered from
    untied = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"])
    assert decode_weight_bytes(build_on_meta(untied, torch.float32), untied) == 4 * 94_528

    # one request, prompt 100, output 3: contexts 100, 101, 102
    assert context_tokens_read(100, 3) == 303
    run = run_roofline(weight_bytes, 114_688, num_steps=3, prompt_lens=[100], output_lens=[3], bandwidth=2e12,
                       measured_s=0.01)
    assert run.bytes_moved == 3 * weight_bytes + 303 * 114_688
    assert run.time_s == pytest.approx(run.bytes_moved / 2e12)
    assert run.tok_s == pytest.approx(3 / run.time_s)
    assert run.pct == pytest.approx(100 * run.time_s / 0.01)
    step = decode_roofline(weight_bytes, 114_688, batch_size=4, prompt_len=32, output_len=256, bandwidth=3e12,
                           measured_step_s=1e-3)
    assert step.bytes_moved == step_bytes(weight_bytes, 114_688, [160] * 4) == weight_bytes + 640 * 114_688
    assert step.tok_s == pytest.approx(4 * 3e12 / step.bytes_moved)
    assert Roofline(10, None, 1, 1.0).tok_s is None and "n/a" in Roofline(10, None, 1, 1.0).describe()


def test_fp8_roofline_counts_the_stored_bytes():
    """fp8 weights at one byte each plus their float32 row scales; the LM head (tied, the embedding) and the norms
    stay in the model's dtype; an fp8 KV cache at one byte an element."""
    from ember.quant import resolve_quant_config
    cfg = bundled_config("qwen3-0.6b")
    model = build_on_meta(cfg, torch.bfloat16, resolve_quant_config(cfg, "fp8", torch.bfloat16, "cpu"))
    # per layer: qkv (2048 + 2 x 1024 rows) x 1024, o 1024 x 2048, gate_up 2 x 3072 x 1024, down 1024 x 3072
    linear = 4096 * 1024 + 1024 * 2048 + 6144 * 1024 + 1024 * 3072
    rows = 4096 + 1024 + 6144 + 1024
    other = 596_049_920 - 28 * linear           # embedding (= LM head), norms
    assert decode_weight_bytes(model, cfg) == 28 * (linear + 4 * rows) + 2 * other
    assert kv_bytes_per_token(cfg, torch.float8_e4m3fn) == 114_688 // 2


def test_moe_roofline_counts_only_the_chosen_experts():
    """Qwen3-30B-A3B: at one token a layer reads 8 of its 128 experts; at many, every expert."""
    cfg = bundled_config("qwen3-30b-a3b")
    model = build_on_meta(cfg, torch.bfloat16)
    # a layer: q 4096 + k 512 + v 512 rows and o 2048 rows of K 2048 / 4096, q/k norms, two norms, the router
    # 128 x 2048; each expert 3 x 768 x 2048; then the LM head and the final norm (the untied embedding is gathered)
    dense = 48 * (2048 * 5120 + 4096 * 2048 + 2 * 128 + 2 * 2048 + 128 * 2048) + 151936 * 2048 + 2048
    expert = 3 * 768 * 2048
    assert decode_weight_bytes(model, cfg, tokens_per_step=1) == 2 * (dense + 48 * 8 * expert) == 6_083_735_552
    assert decode_weight_bytes(model, cfg) == 2 * (dense + 48 * 128 * expert)
    # 64 tokens: 128 * (1 - (1 - 8/128) ** 64) = 126.3 experts a layer expected under uniform routing
    touched = decode_weight_bytes(model, cfg, tokens_per_step=64) - 2 * dense
    assert touched / (2 * 48 * expert) == pytest.approx(128 * (1 - (120 / 128) ** 64), rel=1e-6)
    dense_cfg = bundled_config("qwen3-0.6b")
    dense_model = build_on_meta(dense_cfg, torch.bfloat16)
    assert decode_weight_bytes(dense_model, dense_cfg, tokens_per_step=1) == decode_weight_bytes(dense_model, dense_cfg)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_bench")
    Qwen3Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"]).save_pretrained(path)
    return str(path)


ENGINE = ["--device", "cpu", "--load-format", "dummy", "--max-model-len", "128", "--max-num-seqs", "8"]


def test_cli_throughput_writes_json(tiny_model, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    rc = main(["bench", "throughput", "--model", tiny_model, *ENGINE, "--num-prompts", "6", "--input-len", "4:20",
               "--output-len", "3:9", "--seed", "0", "--json", str(out), "--compare-hf", "--hf-num-prompts", "4",
               "--hf-batch-size", "2"])
    assert rc == 0
    result = json.loads(out.read_text())
    expected = random_workload(6, (4, 20), (3, 9), seed=0, max_token_id=511)
    assert result["num_prompts"] == 6
    assert result["input_tokens"] == expected.input_tokens
    assert result["output_tokens"] == expected.output_tokens
    # at most 8 running at once: at least one step per output token of the longest request
    assert max(expected.output_lens) <= result["num_steps"] <= expected.output_tokens
    for key in ("elapsed_s", "output_tok_s", "total_tok_s", "requests_s", "host_ms_per_step"):
        assert result[key] > 0
    assert result["total_tok_s"] == pytest.approx(result["output_tok_s"] * (expected.input_tokens +
                                                                             expected.output_tokens)
                                                  / expected.output_tokens)
    assert set(result["startup"]) == {"load_s", "compile_s", "capture_s", "warmup_s", "precompile_s",
                                      "triton_compiles"}
    assert result["startup"]["load_s"] > 0
    # the CPU runs no Triton warm-up (off by default there) and compiles no kernel: the interpreter never does
    assert result["startup"]["warmup_s"] == 0.0 and result["triton_compiles"] == 0
    assert result["triton_compiled_kernels"] == {}
    assert result["roofline"]["bandwidth_bytes_s"] is None and result["roofline"]["bytes_moved"] > 0
    assert result["hf_error"] is None and result["hf"]["output_tok_s"] > 0 and result["ember_vs_hf"] > 0
    printed = capsys.readouterr().out
    assert "roofline n/a" in printed and "ember/transformers" in printed
    assert "Triton compiles during the run: 0" in printed


def test_cli_throughput_repeats_the_same_work(tiny_model, tmp_path, capsys):
    """--repeat times the same workload again: the prefix cache is emptied in between, so every run computes
    the same prompt tokens in the same number of steps."""
    out = tmp_path / "repeat.json"
    rc = main(["bench", "throughput", "--model", tiny_model, *ENGINE, "--num-prompts", "4", "--input-len", "20:40",
               "--output-len", "3", "--repeat", "2", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    first, second = result["runs"]
    assert first["num_steps"] == second["num_steps"] == result["num_steps"]
    # every prompt holds a full block: without the reset the second run would find it cached
    assert first["prefix_cache_hit_tokens"] == second["prefix_cache_hit_tokens"] == 0
    assert first["output_tok_s"] == result["output_tok_s"]
    assert first["triton_compiles"] == second["triton_compiles"] == 0
    assert "run 1 / run 2" in capsys.readouterr().out


def test_cli_latency_writes_json(tiny_model, tmp_path, capsys):
    out = tmp_path / "latency.json"
    rc = main(["bench", "latency", "--model", tiny_model, *ENGINE, "--batch-size", "2", "--input-len", "8",
               "--output-len", "5", "--num-iters", "2", "--json", str(out), "--compare-hf", "--hf-num-iters", "1",
               "--attention-backend-option", "fused_decode_kv_write=off"])
    assert rc == 0
    result = json.loads(out.read_text())
    # the backend and its switches, for A/B runs
    assert result["attention"] == {"backends": ["cpu_sdpa"], "options": {"fused_decode_kv_write": False}}
    assert "cpu_sdpa fused_decode_kv_write=False" in capsys.readouterr().out.splitlines()[0]
    assert (result["batch_size"], result["input_len"], result["output_len"]) == (2, 8, 5)
    for key in ("ttft_ms", "tpot_ms"):
        p = result[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"]
    assert result["decode_tok_s"] == pytest.approx(2 / result["mean_tpot_s"])
    # on the CPU the device work runs inside the launch, so the host is busy and waits for nothing
    assert result["host_ms_per_step"] > 0 and 0 <= result["device_wait_ms_per_step"] < result["host_ms_per_step"]
    assert result["roofline"]["tokens"] == 2 and result["roofline"]["tok_s"] is None
    assert result["hf_error"] is None and result["hf"]["decode_tok_s"] > 0 and result["hf"]["cache"] == "dynamic"
    assert result["triton_compiles"] == 0 and result["triton_compiles_first_batch"] == 0


def test_cli_throughput_with_fp8_weights_and_kv_cache(tiny_model, tmp_path, capsys):
    out = tmp_path / "fp8_throughput.json"
    rc = main(["bench", "throughput", "--model", tiny_model, *ENGINE, "--num-prompts", "4", "--input-len", "4:12",
               "--output-len", "3:6", "--seed", "0", "--quantization", "fp8", "--kv-cache-dtype", "fp8",
               "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    expected = random_workload(4, (4, 12), (3, 6), seed=0, max_token_id=511)
    assert result["output_tokens"] == expected.output_tokens and result["output_tok_s"] > 0
    assert result["quantization"].startswith("fp8 e4m3 weights") and result["kv_cache_dtype"] == "torch.float8_e4m3fn"
    printed = capsys.readouterr().out
    assert "formats       fp8 e4m3 weights (quantized at load), per channel scales" in printed
    assert "; KV cache float8_e4m3fn" in printed


def test_cli_latency_with_fp8_weights_and_kv_cache(tiny_model, tmp_path):
    out = tmp_path / "fp8.json"
    rc = main(["bench", "latency", "--model", tiny_model, *ENGINE, "--batch-size", "1", "--input-len", "8",
               "--output-len", "4", "--num-iters", "1", "--quantization", "fp8", "--kv-cache-dtype", "fp8",
               "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["quantization"].startswith("fp8 e4m3 weights (quantized at load)")
    assert result["kv_cache_dtype"] == "torch.float8_e4m3fn"
    # a layer's linear weights at one byte (qkv 64 + o 32 + gate_up 128 rows of 32, down 32 rows of 64) and their
    # 256 float32 row scales; the tied embedding (512 x 32) and the norms (2 x (32 + 32 + 8 + 8) + 32) in float32;
    # KV: 2 layers x 2 heads x 8 x (K, V) at one byte, over the mean context of 8 + 4 // 2 tokens
    weights = 2 * (9216 + 4 * 256) + 4 * (512 * 32 + 2 * 80 + 32)
    assert result["roofline"]["bytes_moved"] == weights + 10 * 64


def test_cli_rejects_model_and_config_together(tiny_model, capsys):
    rc = main(["bench", "latency", "--model", tiny_model, "--config", "qwen3-0.6b", "--device", "cpu"])
    assert rc == 2 and "not both" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_latency_on_bundled_config(tmp_path):
    out = tmp_path / "latency.json"
    rc = main(["bench", "latency", "--config", "qwen3-0.6b", "--device", "cpu", "--batch-size", "1", "--input-len",
               "8", "--output-len", "3", "--num-iters", "1", "--max-model-len", "128", "--max-num-seqs", "4",
               "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["model"] == "qwen3-0.6b" and result["dtype"] == "torch.float32"
    # float32 on CPU: 596,049,920 parameters x 4 bytes, plus the mean context (8 + 3 // 2 = 9) x 229,376 bytes
    assert result["roofline"]["bytes_moved"] == 4 * 596_049_920 + 9 * 229_376


def test_cli_profile_reports_phases_and_leaves_engine_idle(tiny_model, tmp_path, capsys):
    out = tmp_path / "profile.json"
    rc = main(["bench", "latency", "--model", tiny_model, *ENGINE, "--batch-size", "2", "--input-len", "8",
               "--output-len", "3", "--num-iters", "1", "--profile", "5", "--json", str(out)])
    assert rc == 0
    prof = json.loads(out.read_text())["profile"]
    assert prof["num_steps"] == 5 and prof["wall_ms"] > 0
    # every phase of a step is marked, and on the CPU there are no device kernels
    assert {"ember.schedule", "ember.prepare", "ember.forward", "ember.sample", "ember.to_host",
            "ember.update"} <= set(prof["phases_ms"])
    assert prof["device_ms"] == 0 and prof["kernels"] == []
    assert "ember.forward" in capsys.readouterr().out


def test_profile_steps_needs_queued_requests(tiny_model):
    from ember import LLM
    from ember.bench.profiler import profile_steps
    llm = LLM(tiny_model, load_format="dummy", device="cpu", max_model_len=128, max_num_seqs=8)
    with pytest.raises(ValueError, match="no request was in flight"):
        profile_steps(llm.engine, 3)
    with pytest.raises(ValueError, match="num_steps 0"):
        profile_steps(llm.engine, 0)


def test_critical_path_charges_overlap_once_and_gaps_to_idle():
    from ember.bench.profiler import critical_path
    # b starts inside a (a programmatic dependent) and ends 3 later; c starts after a gap of 2; d sits inside c
    charged, idle = critical_path([("c", 12.0, 15.0), ("a", 0.0, 5.0), ("b", 1.0, 8.0), ("d", 13.0, 14.0),
                                   ("a", 15.0, 16.0)])
    assert charged == {"a": 6.0, "b": 3.0, "c": 3.0, "d": 0.0}
    assert idle == 4.0
    assert sum(charged.values()) + idle == 16.0      # the span from the first start to the last end
    assert critical_path([]) == ({}, 0.0)
