"""gpt-oss against transformers (float32, CPU): logits of a ragged batch, chunked prefill beside a decode, greedy
continuations through the engine; the sinks, windows and expert tensors in place; two ranks (tensor and expert
parallel, gloo) give one rank's tokens and logits; MXFP4 checkpoints and another SwiGLU alpha are refused."""

from __future__ import annotations

import json

import pytest
import torch

from ember.models.loader import load_model
from ember.quant import QuantConfigError
from tests.helpers.model_harness import random_hf_model, tiny_config
# the MoE families' parity tests, run here on this module's `pair`: logits of a ragged batch, chunked prefill beside
# a decode, greedy continuations against transformers
from tests.unit.test_moe_models import (LOGITS_ATOL, test_chunked_prefill_with_decodes_matches_transformers,  # noqa: F401
                                        test_greedy_decoding_matches_generate, test_logits_match_transformers)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(family, transformers model, its save_pretrained folder, ember model loaded from it)."""
    hf = random_hf_model(tiny_config("gpt_oss"))
    path = tmp_path_factory.mktemp("gpt_oss")
    hf.save_pretrained(path)
    return "gpt_oss", hf, path, load_model(path, None, torch.float32, "cpu", progress=False)


def test_sinks_windows_and_experts_are_the_checkpoints(pair):
    _, hf, _, model = pair
    layers = model.model.layers
    assert [layer.self_attn.attn.options.sliding_window for layer in layers] == [8, None]
    assert all(layer.self_attn.attn.options.use_sinks for layer in layers)
    hf_layer, layer = hf.model.layers[0], layers[0]
    assert torch.equal(layer.self_attn.attn.sinks, hf_layer.self_attn.sinks)
    experts, ours = hf_layer.mlp.experts, layer.mlp.experts
    inter = experts.intermediate_size
    # w13 [E, 2I, H]: gate rows (the even columns of gate_up_proj [E, H, 2I]), then up rows (the odd ones)
    assert torch.equal(ours.w13[:, :inter], experts.gate_up_proj[..., 0::2].transpose(1, 2))
    assert torch.equal(ours.w13[:, inter:], experts.gate_up_proj[..., 1::2].transpose(1, 2))
    assert torch.equal(ours.b13, torch.cat([experts.gate_up_proj_bias[:, 0::2], experts.gate_up_proj_bias[:, 1::2]],
                                           dim=1))
    assert torch.equal(ours.w2, experts.down_proj.transpose(1, 2))
    assert torch.equal(ours.b2, experts.down_proj_bias)
    assert torch.equal(layer.mlp.router.bias, hf_layer.mlp.router.bias)


def test_two_ranks_give_one_ranks_tokens_and_logits(pair):
    """Over gloo, chunks of 8 tokens with preemption: tensor parallel (heads and their sinks, the experts'
    intermediate dimension split; the down bias on rank 0), then expert parallel (4 whole experts a rank, their
    biases with them), each against one rank: greedy tokens over 32 steps equal, logits within 1e-4."""
    from ember import LLM
    from tests.unit.test_tensor_parallel import SCORED, SMALL, generate

    def _run(path, **kwargs):
        # two KV groups (windowed and full layers) share the pool: 20 blocks of 8 hold 64 tokens in each
        llm = LLM(path, **{**SMALL, "num_kv_blocks": 20}, **kwargs)
        try:
            return generate(llm), llm.engine.score(SCORED)
        finally:
            llm.engine.runner.shutdown()
    _, _, path, _ = pair
    one, one_logits = _run(str(path))
    assert all(len(t) == 32 for t in one) and one_logits.std() > 0.1
    for options in ({}, {"enable_expert_parallel": True}):
        two, two_logits = _run(str(path), tensor_parallel_size=2, **options)
        assert two == one, options
        assert (two_logits - one_logits).abs().max().item() <= LOGITS_ATOL, options


def test_mxfp4_checkpoints_and_another_alpha_are_refused(pair, tmp_path):
    from ember import LLM
    _, _, path, _ = pair
    config = json.loads((path / "config.json").read_text())
    for name in ("config.json",):
        (tmp_path / name).write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(QuantConfigError, match=r"quant_method 'mxfp4'.*bf16 conversion"):
        LLM(str(tmp_path), device="cpu", load_format="dummy")
    (tmp_path / "config.json").write_text(json.dumps({**config, "swiglu_alpha": 1.5}))
    with pytest.raises(ValueError, match=r"swiglu_alpha 1.5 is not supported"):
        LLM(str(tmp_path), device="cpu", load_format="dummy")
