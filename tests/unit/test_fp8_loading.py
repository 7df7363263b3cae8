"""FP8 checkpoints of every layout (written by tests.helpers.fp8_checkpoint with ember's quantization code) load
through the loader's per-parameter weight loaders, q/k/v and gate/up parts with scales of their own included, and
give the logits of the same weights dequantized by hand, their inputs rounded to e4m3 by hand as the layout's
activations are (float32, CPU: the scaled layers round x, dequantize the weight, then matmul).
Online quantization, random fp8 weights and the start-up refusals too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ember.kernels.fp8 import FP8
from ember.models.layers.scaled_linear import ScaledLinear
from ember.models.loader import load_config, load_model, random_model
from ember.quant import QuantConfigError, resolve_quant_config
from tests.helpers.fp8_checkpoint import (INPUT_SCALE, LAYOUTS, round_inputs_by_hand, save_dequantized,
                                          save_fp8_checkpoint)
from tests.helpers.model_harness import ModelHarness, random_hf_model, tiny_config

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [12, 300, 8]]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny untied Llama whose packed parts are whole 128-row blocks (q, k, v 128 rows each; gate, up 256)."""
    path = tmp_path_factory.mktemp("float")
    config = tiny_config("llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=4)
    random_hf_model(config, seed=3).save_pretrained(path)
    return path


def _load(path: Path, quantization: str | None = None):
    config = load_config(path)
    quant = resolve_quant_config(config, quantization, torch.float32, "cpu")
    return load_model(path, config, torch.float32, "cpu", progress=False, quant=quant), quant


def _logits(model) -> torch.Tensor:
    harness = ModelHarness(model, len(PROMPTS), max_seq_len=16)
    return harness.last_logits(list(enumerate(PROMPTS)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpoint_gives_the_logits_of_its_weights_dequantized_by_hand(source, tmp_path, layout):
    fp8 = save_fp8_checkpoint(source, tmp_path / "fp8", layout)
    model, quant = _load(fp8)
    reference = round_inputs_by_hand(_load(save_dequantized(fp8, tmp_path / "reference"))[0], layout)
    layers = [m for m in model.modules() if isinstance(m, ScaledLinear)]
    assert len(layers) == 4 * 2 and all(m.weight.dtype == FP8 and m.scale.dtype == torch.float32 for m in layers)
    assert model.lm_head.weight.dtype == torch.float32          # the LM head stays in the checkpoint's dtype
    qkv = model.model.layers[0].self_attn.qkv_proj
    if quant.weight_strategy == "tensor":
        # q, k and v keep their own scales, one per row of their part, without requantizing
        tensors = load_file(fp8 / "model.safetensors")
        parts = [tensors[f"model.layers.0.self_attn.{p}_proj.weight_scale"].item() for p in "qkv"]
        assert len(set(parts)) == 3
        assert torch.equal(qkv.scale, torch.tensor(parts).repeat_interleave(128))
        assert torch.equal(qkv.weight[128:256].view(torch.uint8),
                           tensors["model.layers.0.self_attn.k_proj.weight"].view(torch.uint8))
    if quant.activation == "static":
        assert qkv.input_scale.item() == pytest.approx(INPUT_SCALE)
    else:
        assert qkv.input_scale is None
    with torch.inference_mode():
        got, want = _logits(model), _logits(reference)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_online_quantization_is_per_channel_and_matches_by_hand(source, tmp_path):
    model, quant = _load(source, "fp8")
    assert quant.online and model.lm_head.weight.dtype == torch.float32
    original = load_file(source / "model.safetensors")["model.layers.1.mlp.up_proj.weight"]
    gate_up = model.model.layers[1].mlp.gate_up_proj
    up = gate_up.weight[256:].float() * gate_up.scale[256:, None]
    # e4m3 keeps 3 mantissa bits: each weight within 2**-4 of itself, the row's largest exactly (amax -> 448)
    assert ((up - original).abs() <= 2 ** -4 * original.abs() + 1e-6).all()
    torch.testing.assert_close(up.abs().amax(1), original.abs().amax(1), rtol=1e-6, atol=0)
    # the same weights quantized per channel into a checkpoint by ember's code, dequantized by hand
    reference, _ = _load(save_dequantized(save_fp8_checkpoint(source, tmp_path / "fp8", "ct-channel"),
                                          tmp_path / "reference"))
    reference = round_inputs_by_hand(reference, "ct-channel")
    with torch.inference_mode():
        torch.testing.assert_close(_logits(model), _logits(reference), rtol=0, atol=1e-5)


def test_random_fp8_weights_for_benchmarks():
    config = tiny_config("qwen3")
    quant = resolve_quant_config(config, "fp8", torch.float32, "cpu")
    model = random_model(config, torch.float32, "cpu", seed=1, quant=quant)
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, ScaledLinear) and down.weight.dtype == FP8
    # normal weights of std initializer_range (0.02), quantized: the dequantized std within 10%
    assert abs(down.dequantized_weight().std().item() - 0.02) < 0.002
    assert torch.isfinite(_logits(model)).all()


def _rewrite(folder: Path, edit_tensors=None, edit_config=None) -> Path:
    if edit_tensors is not None:
        tensors = load_file(folder / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((folder / "config.json").read_text())
        edit_config(config)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_refusals_at_start_up(source, tmp_path):
    # a quantized LM head
    folder = _rewrite(save_fp8_checkpoint(source, tmp_path / "head", "ct-channel"),
                      lambda t: t.update({"lm_head.weight_scale": torch.ones(320, 1)}))
    with pytest.raises(QuantConfigError, match=r"fp8 scales \['lm_head.weight_scale'\].*runs unquantized"):
        _load(folder)
    # k ignored, q and v quantized: one packed layer in two formats
    folder = _rewrite(save_fp8_checkpoint(source, tmp_path / "mixed", "ct-channel"),
                      edit_config=lambda c: c["quantization_config"].update(ignore=["lm_head", "k_proj"]))
    with pytest.raises(QuantConfigError, match=r"packs .*q_proj \(fp8\), .*k_proj \(not quantized\)"):
        _load(folder)
    # block checkpoints whose packed parts are not whole blocks
    small = tmp_path / "small"
    random_hf_model(tiny_config("llama"), seed=1).save_pretrained(small)
    with pytest.raises(QuantConfigError, match=r"packed parts of \[64, 32, 32\] rows .* whole 128-row"):
        _load(save_fp8_checkpoint(small, tmp_path / "small-block", "fp8-block"))
    # float weights under an fp8 quantization_config
    folder = _rewrite(save_fp8_checkpoint(source, tmp_path / "float", "ct-channel"),
                      lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(128, 256)}))
    with pytest.raises(ValueError, match=r"down_proj.weight.*is torch.float32, but .* says float8_e4m3fn"):
        _load(folder)
