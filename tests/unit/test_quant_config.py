"""ember.quant: the QuantConfig each checkpoint layout and `quantization=` resolve to, what is refused and why, and
which modules a config leaves unquantized."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ember.quant import QuantConfig, QuantConfigError, resolve_quant_config
from tests.helpers.fp8_checkpoint import LAYOUTS, quantization_config


def _resolve(raw: dict | None, quantization: str | None = None, dtype=torch.bfloat16) -> QuantConfig | None:
    return resolve_quant_config(SimpleNamespace(quantization_config=raw), quantization, dtype, "cpu")


EXPECTED = {
    "fp8-tensor": ("fp8", "tensor", "static", None, "weight_scale"),
    "fp8-block": ("fp8", "block", "dynamic", (128, 128), "weight_scale_inv"),
    "ct-channel": ("compressed-tensors", "channel", "dynamic", None, "weight_scale"),
    "ct-tensor": ("compressed-tensors", "tensor", "static", None, "weight_scale"),
    "ct-block": ("compressed-tensors", "block", "dynamic", (128, 128), "weight_scale"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_checkpoint_layout_resolves(layout):
    config = _resolve(quantization_config(layout))
    assert (config.source, config.weight_strategy, config.activation, config.weight_block,
            config.scale_name) == EXPECTED[layout]
    # quantization="fp8" beside an fp8 checkpoint names what it already is
    assert _resolve(quantization_config(layout), "fp8") == config


def test_online_and_none():
    assert _resolve(None) is None
    online = _resolve(None, "fp8")
    assert (online.source, online.weight_strategy, online.activation, online.online) == ("online", "channel",
                                                                                         "dynamic", True)
    assert "quantized at load" in online.describe() and "per channel" in online.describe()


def _ct(weights=None, acts="default", **top):
    raw = quantization_config("ct-channel")
    group = raw["config_groups"]["group_0"]
    if weights:
        group["weights"].update(weights)
    if acts is None:
        group["input_activations"] = None
    elif acts != "default":
        group["input_activations"].update(acts)
    raw.update(top)
    return raw


@pytest.mark.parametrize("raw, quantization, match", [
    (None, "awq", r"quantization 'awq' is not supported; use 'fp8'"),
    (dict(quant_method="awq", bits=4), None, r"quant_method 'awq'.*'fp8' and 'compressed-tensors'"),
    (dict(quant_method="fp8", fmt="e5m2"), None, r"fp8 format is 'e5m2'; ember runs e4m3"),
    (dict(quant_method="fp8", activation_scheme="static", weight_block_size=[128, 128]), None,
     r"block-quantized .* static activation scales is not supported"),
    (dict(quant_method="fp8", weight_block_size=[64, 64]), None, r"weight_block_size \[64, 64\].*128x128"),
    (_ct(weights=dict(type="int")), None, r"8-bit int .*symmetric 8-bit float"),
    (_ct(acts=None), None, r"weights only \(no input_activations\)"),
    (_ct(acts=dict(strategy="tensor", dynamic=True)), None, r"strategy 'tensor' and dynamic=True are not supported"),
    (_ct(weights=dict(strategy="group", group_size=128)), None, r"weight strategy 'group'"),
    (_ct(format="pack-quantized"), None, r"format 'pack-quantized'"),
    ({**_ct(), "config_groups": {"a": {}, "b": {}}}, None, r"2 compressed-tensors config groups"),
])
def test_refusals_name_the_reason(raw, quantization, match):
    with pytest.raises(QuantConfigError, match=match):
        _resolve(raw, quantization)


def test_compute_dtype_is_checked():
    with pytest.raises(QuantConfigError, match=r"bfloat16, float16 or float32 compute dtype"):
        _resolve(None, "fp8", dtype=torch.float64)


def test_ignored_modules():
    config = _resolve({**quantization_config("ct-channel"), "ignore": ["lm_head", "re:.*mlp\\.down_proj$",
                                                                       "model.layers.1.self_attn.o_proj"]})
    assert not config.quantizes("lm_head")
    assert not config.quantizes("model.layers.0.mlp.down_proj")
    assert config.quantizes("model.layers.0.mlp.up_proj")
    assert not config.quantizes("model.layers.1.self_attn.o_proj")
    assert config.quantizes("model.layers.11.self_attn.o_proj")      # a name that merely starts alike
    # online quantization leaves the LM head in the model's dtype
    assert not _resolve(None, "fp8").quantizes("lm_head") and _resolve(None, "fp8").quantizes("model.layers.0.mlp")
