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
from tests.unit.test_moe_models import (  # noqa: F401
    LOGITS_ATOL, test_chunked_prefill_with_decodes_matches_transformers, test_greedy_decoding_matches_generate,
    test_logits_match_transformers)


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


def test_the_roofline_counts_the_chosen_experts(pair):
    from ember.bench.roofline import expert_bytes
    *_, model = pair
    per_layer = expert_bytes(model, 1)           # one token: top_k = 2 of 8 experts, biases with their experts
    experts = model.model.layers[0].mlp.experts
    every = sum(p.numel() for p in (experts.w13, experts.w2, experts.b13, experts.b2)) * 4
    assert per_layer == [(every, every // 4)] * 2


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


def test_mxfp4_elsewhere_fp8_over_it_and_another_alpha_are_refused(pair, tmp_path):
    from ember import LLM
    _, _, path, _ = pair
    config = json.loads((path / "config.json").read_text())
    mxfp4 = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": mxfp4}))
    with pytest.raises(QuantConfigError, match=r"quantization='fp8' cannot be applied over an MXFP4 checkpoint"):
        LLM(str(tmp_path), device="cpu", load_format="dummy", quantization="fp8")
    llama = tiny_config("llama").to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**llama, "quantization_config": mxfp4}))
    with pytest.raises(QuantConfigError, match=r"'mxfp4', which ember loads for gpt-oss's experts only"):
        LLM(str(tmp_path), device="cpu", load_format="dummy")
    (tmp_path / "config.json").write_text(json.dumps({**config, "swiglu_alpha": 1.5}))
    with pytest.raises(ValueError, match=r"swiglu_alpha 1.5 is not supported"):
        LLM(str(tmp_path), device="cpu", load_format="dummy")


def _to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection as gpt-oss checkpoints hold it unquantized, [E, K, rows], -> (blocks [E, rows, K/32, 16] uint8,
    scales [E, rows, K/32] uint8): each 32 values of a row scaled by a power of two into e2m1's range, rounded to
    the nearest code, two codes a byte (the low nibble first)."""
    from ember.models.gpt_oss import FP4_E2M1
    groups = weight.transpose(1, 2).unflatten(-1, (-1, 32))                            # [E, rows, G, 32]
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(2.0 ** -100) / 6.0))  # [E, rows, G]
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - torch.tensor(FP4_E2M1)).abs().argmin(-1)             # [E, rows, G, 32]
    return (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8), (exponent + 127).to(torch.uint8)


def test_an_mxfp4_checkpoint_loads_its_experts_dequantized(tmp_path):
    """The released layout (experts' projections as MXFP4 blocks and scales, the rest unquantized): ember's
    experts equal transformers' own dequantization of the same tensors, and its logits those of the transformers
    model holding them; two tensor-parallel ranks load their shares of it."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from ember.distributed.shard import ShardSpec
    from tests.unit.test_moe_models import PROMPTS, hf_logits
    from tests.helpers.model_harness import ModelHarness
    hf = random_hf_model(tiny_config("gpt_oss"), seed=3)
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for i, layer in enumerate(hf.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            blocks, scales = _to_mxfp4(tensors.pop(name))
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            dequantized = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)      # transformers' own
            assert (dequantized - getattr(layer.mlp.experts, proj)).abs().max() < 0.5        # a coarse copy
            getattr(layer.mlp.experts, proj).data.copy_(dequantized)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                         "model.layers.*.mlp.router"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(tmp_path, None, torch.float32, "cpu", progress=False)
    experts, ours = hf.model.layers[1].mlp.experts, model.model.layers[1].mlp.experts
    assert torch.equal(ours.w13[:, :32], experts.gate_up_proj[..., 0::2].transpose(1, 2))
    assert torch.equal(ours.w2, experts.down_proj.transpose(1, 2))
    hidden = ModelHarness(model, len(PROMPTS)).step(list(enumerate(PROMPTS)))
    expected = torch.cat([hf_logits(hf, p) for p in PROMPTS])
    assert (model.compute_logits(hidden) - expected).abs().max().item() <= LOGITS_ATOL
    ranks = [load_model(tmp_path, None, torch.float32, "cpu", progress=False, shard=ShardSpec(r, 2)) for r in (0, 1)]
    halves = [r.model.layers[1].mlp.experts for r in ranks]
    assert torch.equal(torch.cat([h.w13[:, :16] for h in halves], dim=1), ours.w13[:, :32])
    assert torch.equal(torch.cat([h.w2 for h in halves], dim=2), ours.w2)
    experts_ranks = [load_model(tmp_path, None, torch.float32, "cpu", progress=False,
                                shard=ShardSpec(r, 2, expert_parallel=True)) for r in (0, 1)]
    assert torch.equal(torch.cat([r.model.layers[1].mlp.experts.w13 for r in experts_ranks]), ours.w13)
