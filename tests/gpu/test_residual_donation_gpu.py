"""Residual donation on a GPU. `ember::fused_linear_into_residual` equals `ember::fused_linear` bit for bit at every
row count (the GEMV writing over the residual; cuBLAS's beta=1 GEMM in place), and issues no device-to-device copy
where `ember::fused_linear` issues one (`torch.addmm(residual, ...)` copies the residual into its output first).
A compiled model's prefill step then copies nothing per decoder layer: a Qwen3-0.6B-shaped model with 4 and with 2
layers, a 2,048-token prefill (beyond the CUDA-graph buckets: the pieces run eagerly), counts the same
"Memcpy DtoD" calls per step."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import ember.kernels.fused_linear  # noqa: F401  (registers the ops)
from tests.helpers.model_harness import tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ember = torch.ops.ember
SHAPES = {"qwen3-0.6b o_proj": (1024, 2048, False), "qwen3-0.6b down": (1024, 3072, False),
          "llama-3.1-8b o_proj": (4096, 4096, False), "qwen3-0.6b gate_up": (3072, 1024, True)}


def _copies(fn) -> int:
    """Device-to-device copies `fn` issues (one warm-up call first)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "Memcpy DtoD" in e.name)


@pytest.mark.parametrize("routed", [True, False], ids=["routed", "gemv_to_16"])
@pytest.mark.parametrize("M", [1, 4, 16, 64, 4096])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_written_over_the_residual_equals_a_new_output_bit_for_bit(shape, norm, M, routed):
    """Routed: the GEMV or cuBLAS by the measured crossover; unrouted: the GEMV at every row count up to 16."""
    from ember.kernels.linear_op import set_gemv_routing
    set_gemv_routing(routed)
    try:
        _compare(shape, norm, M)
    finally:
        set_gemv_routing(True)


def _compare(shape: str, norm: bool, M: int) -> None:
    N, K, gated = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    weight = (torch.randn(2 * N if gated else N, K, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
    norm_weight = torch.randn(K, device="cuda", generator=g).to(torch.bfloat16) if norm else None
    residual = torch.randn(M, N, device="cuda", generator=g).to(torch.bfloat16)
    expected = ember.fused_linear(x, weight, None, norm_weight, 1e-6, gated, residual)
    written = residual.clone()
    ember.fused_linear_into_residual(x, weight, None, norm_weight, 1e-6, gated, written)
    assert torch.equal(written, expected)


def test_a_prefill_sized_residual_add_copies_nothing_in_place():
    N, K, _ = SHAPES["qwen3-0.6b o_proj"]
    x = torch.randn(4096, K, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(4096, N, device="cuda", dtype=torch.bfloat16)
    # the cause: addmm copies its accumulator into the new output
    assert _copies(lambda: ember.fused_linear(x, weight, None, None, 1e-6, False, residual)) == 1
    assert _copies(lambda: ember.fused_linear_into_residual(x, weight, None, None, 1e-6, False, residual)) == 0


def _copies_per_prefill(tmp_path, num_layers: int) -> float:
    from transformers import AutoModelForCausalLM
    from ember import LLM
    from ember.bench.commands import release_engine
    from ember.bench.profiler import profile_steps
    from ember.sampling_params import SamplingParams
    config = tiny_config("qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=num_layers,
                         vocab_size=4096, max_position_embeddings=4096, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128)
    folder = tmp_path / f"qwen3-{num_layers}"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    llm = LLM(str(folder), dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=2100,
              gpu_memory_utilization=0.3)
    engine = llm.engine
    rid = engine.add_request(list(range(10, 2058)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    try:
        step = profile_steps(engine, 1, top=10_000)     # the prefill
    finally:
        engine.abort(rid)
    release_engine(llm)
    return sum(calls for name, calls, _ in step.kernels if "Memcpy DtoD" in name)


def test_a_compiled_prefill_copies_no_hidden_state_per_layer(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "cache"))
    two, four = (_copies_per_prefill(tmp_path, n) for n in (2, 4))
    print(f"Memcpy DtoD per prefill step: {two} (2 layers), {four} (4 layers)")
    assert (four - two) / 2 == 0
