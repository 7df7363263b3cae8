"""FP8 checkpoints in the layouts found on the hub, written from a float HF folder with ember's quantization code
(ember.kernels.fp8), and the same weights dequantized by hand into a float folder: the reference that a loaded fp8
checkpoint must reproduce.

    layout           quantization_config                                   tensors beside each linear's `weight`
    fp8-tensor       quant_method fp8, static activations                  weight_scale [], input_scale []
    fp8-block        quant_method fp8, weight_block_size [128, 128]        weight_scale_inv [N/128, K/128]
    ct-channel       compressed-tensors, channel weights, token dynamic    weight_scale [N, 1]
    ct-tensor        compressed-tensors, tensor weights, tensor static     weight_scale [1], input_scale [1]
    ct-block         compressed-tensors, block weights, group dynamic      weight_scale [N/128, K/128]
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ember.kernels.fp8 import quantize_blocks, quantize_rows, quantize_tensor, round_activations

LAYOUTS = ("fp8-tensor", "fp8-block", "ct-channel", "ct-tensor", "ct-block")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUT_SCALE = 0.05          # a static activation scale: |x| up to 22 before it saturates


def _ct_args(strategy: str, dynamic: bool, **extra) -> dict:
    return dict(num_bits=8, type="float", symmetric=True, strategy=strategy, dynamic=dynamic, group_size=None,
                block_structure=None, **extra)


def quantization_config(layout: str) -> dict:
    """The config.json `quantization_config` of a layout."""
    if layout == "fp8-tensor":
        return dict(quant_method="fp8", activation_scheme="static", ignored_layers=["lm_head"])
    if layout == "fp8-block":
        return dict(quant_method="fp8", activation_scheme="dynamic", fmt="e4m3", weight_block_size=[128, 128])
    weights, acts = {
        "ct-channel": (_ct_args("channel", False), _ct_args("token", True)),
        "ct-tensor": (_ct_args("tensor", False), _ct_args("tensor", False)),
        "ct-block": ({**_ct_args("block", False), "block_structure": [128, 128]},
                     {**_ct_args("group", True), "group_size": 128}),
    }[layout]
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None}}}


def _quantize(weight: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    """The tensors of one linear layer in `layout`, keyed by their suffix."""
    if layout in ("fp8-block", "ct-block"):
        q, scale = quantize_blocks(weight, (128, 128))
        return {"weight": q, "weight_scale_inv" if layout == "fp8-block" else "weight_scale": scale}
    if layout == "ct-channel":
        q, scale = quantize_rows(weight)
        return {"weight": q, "weight_scale": scale[:, None]}                    # [N, 1]
    q, scale = quantize_tensor(weight)
    scale = scale.reshape(()) if layout == "fp8-tensor" else scale.reshape(1)
    return {"weight": q, "weight_scale": scale, "input_scale": torch.full_like(scale, INPUT_SCALE)}


def save_fp8_checkpoint(source: Path, target: Path, layout: str) -> Path:
    """`source` (a float HF folder, one safetensors file) quantized into `layout` at `target`."""
    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, target / f.name)
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in LINEARS:
            tensors.update({f"{module}.{suffix}": t.contiguous() for suffix, t in _quantize(tensor, layout).items()})
        else:
            tensors[name] = tensor
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(layout)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def save_dequantized(fp8_folder: Path, target: Path) -> Path:
    """An fp8 folder's weights times their scales, by hand, as a float32 folder without quantization_config."""
    fp8_folder, target = Path(fp8_folder), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for f in fp8_folder.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, target / f.name)
    loaded = load_file(fp8_folder / "model.safetensors")
    tensors = {}
    for name, tensor in loaded.items():
        module, _, leaf = name.rpartition(".")
        if leaf in ("weight_scale", "weight_scale_inv", "input_scale"):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scale = loaded.get(f"{module}.weight_scale", loaded.get(f"{module}.weight_scale_inv")).float()
            n, k = tensor.shape
            if scale.numel() == 1:                                    # per tensor
                full = scale.reshape(())
            elif scale.numel() == n:                                  # per output channel
                full = scale.reshape(n, 1)
            else:                                                     # per 128 x 128 block
                full = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            tensor = tensor.float() * full
        tensors[name] = tensor.float() if tensor.is_floating_point() else tensor
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8_folder / "config.json").read_text())
    config.pop("quantization_config")
    config["torch_dtype"] = "float32"
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def round_inputs_by_hand(model: torch.nn.Module, layout: str) -> torch.nn.Module:
    """An unquantized ember model whose linear layers (the LM head aside) see their inputs rounded to e4m3 as the
    layout's fp8 activations are: by the static input scale (per-tensor layouts), per token and 128 columns
    (block layouts), or per token. With `save_dequantized`'s weights, the fp8 model's computation by hand."""
    from ember.models.layers.linear import Linear
    static = torch.tensor([INPUT_SCALE]) if layout in ("fp8-tensor", "ct-tensor") else None
    group = 128 if layout.endswith("block") else None
    for name, module in model.named_modules():
        if isinstance(module, Linear) and not name.endswith("lm_head"):
            # every projection (forward, forward_split) goes through _project
            module._project = lambda x, bias, _project=module._project: _project(
                round_activations(x, static, group), bias)
    return model
