"""FP8 weights in a whole model on the CPU: the fusion passes extend `ember::scaled_linear` as they extend
`ember::linear`, and an engine's greedy output does not depend on what else is in the batch."""

from __future__ import annotations

import pytest
import torch

from ember.attention_backends.op import forward_context
from ember.graphs.passes.pipeline import FusionPipeline
from ember.models.loader import random_model
from ember.quant import resolve_quant_config
from tests.helpers.model_harness import ModelHarness, random_hf_model, tiny_config
from tests.helpers.post_grad import count_calls, post_grad_graph

SCALED = torch.ops.ember.scaled_linear.default


@pytest.mark.parametrize("family,strategy", [("qwen3", "online"), ("llama", "ct-block")])
def test_fusion_passes_extend_the_scaled_linear(family, strategy):
    """Every projection of a tiny fp8 model becomes one `ember::scaled_linear` carrying its norm, SiLU·mul or
    residual, as the bf16 model's become `ember::fused_linear`; the fused graph computes what the unfused one does."""
    overrides = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                     head_dim=32) if strategy == "ct-block" else {}
    config = tiny_config(family, **overrides)
    if strategy == "online":
        quant = resolve_quant_config(config, "fp8", torch.float32, "cpu")
    else:
        from tests.helpers.fp8_checkpoint import quantization_config
        config.quantization_config = quantization_config(strategy)
        quant = resolve_quant_config(config, None, torch.float32, "cpu")
    torch.manual_seed(0)
    model = random_model(config, torch.float32, "cpu", seed=2, quant=quant)
    harness = ModelHarness(model, 2)
    common, positions = harness._metadata([(0, [1, 2, 3]), (1, [4, 5])])
    from ember.attention_backends.op import ForwardContext
    context = ForwardContext(layers=harness.layers, attn_metadata=(harness.builder.build(common),))
    ids = torch.tensor([1, 2, 3, 4, 5])
    layers = config.num_hidden_layers
    with torch.inference_mode(), forward_context(context):
        gm = post_grad_graph(model, ids, positions)
        assert count_calls(gm, SCALED) == 4 * layers
        reference = gm(ids, positions)
        pipeline = FusionPipeline()
        pipeline(gm.graph)
        gm.recompile()
        out = gm(ids, positions)
    assert pipeline.counts == {"sibling_linears": 0, "rms_norm_prologue": 2 * layers, "silu_mul_epilogue": layers,
                               "residual_epilogue": 2 * layers, "residual_all_reduce": 0,
                               "qk_norm_rope": layers if family == "qwen3" else 0}
    assert count_calls(gm, SCALED) == 4 * layers
    assert count_calls(gm, torch.ops.ember.fused_linear.default) == 0
    assert count_calls(gm, torch.ops.ember.linear.default) == 0
    fused = [n for n in gm.graph.nodes if n.target is SCALED]
    # gate_up carries the norm and the activation, o_proj and down the residual, qkv the norm
    assert sorted((n.args[7] is not None, n.args[9], n.args[10] is not None) for n in fused) == \
        sorted([(True, False, False), (False, False, True), (True, True, False), (False, False, True)] * layers)
    scale = reference.abs().max().item()
    assert (out - reference).abs().max().item() <= 1e-5 * scale


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    random_hf_model(tiny_config("llama"), seed=4).save_pretrained(path)
    return path


def test_greedy_output_does_not_depend_on_the_batch(folder):
    from ember import LLM, SamplingParams
    # both fp8 paths: e4m3 weights and an e4m3 KV cache
    llm = LLM(str(folder), device="cpu", quantization="fp8", kv_cache_dtype="fp8", num_kv_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 17, 99, 3, 250, 41, 7], [12, 300, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    alone = [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    reversed_order = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], greedy, use_tqdm=False)][::-1]
    assert alone == together == reversed_order
    assert len(set(map(tuple, alone))) == 3       # three prompts, three different continuations
