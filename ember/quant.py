"""How a model's linear weights are stored and run: a frozen `QuantConfig`, resolved once at start-up from the
checkpoint's `quantization_config` or from `LLM(..., quantization="fp8")`.

FP8 (e4m3) layouts ember runs:

    source               weights                          activations at run time
    online (fp8)         per output channel, at load      dynamic, per token
    "fp8" checkpoint     per tensor (weight_scale)        static per tensor (input_scale) or dynamic per token
                         128x128 blocks (weight_scale_inv)  dynamic, per token and 128 columns
    compressed-tensors   per tensor or per channel        static per tensor or dynamic per token
                         blocks (block_structure)         dynamic, per token and block column group

Whatever the checkpoint's granularity, a layer keeps per-tensor and per-channel scales as one float32 scale per
output row (so q/k/v or gate/up parts with scales of their own pack without requantizing), and block scales as
their [rows / block, columns / block] grid. Anything else is refused here, before a weight is read, with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
QUANTIZATION_METHODS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


class QuantConfigError(ValueError):
    """A quantization request or a checkpoint's quantization_config that ember cannot run; says why."""


@dataclass(frozen=True)
class QuantConfig:
    """FP8 linear weights: where they come from, their scales' granularity and how activations are scaled."""
    source: str                                 # "online" | "fp8" | "compressed-tensors"
    weight_strategy: str                        # "tensor" | "channel" | "block"
    activation: str                             # "dynamic" (per token, or per token and block) | "static"
    weight_block: tuple[int, int] | None = None  # (rows, columns) of a weight block when weight_strategy is "block"
    ignored: tuple[str, ...] = ()               # module names or "re:" patterns left in the checkpoint's dtype
    scale_name: str = "weight_scale"            # the checkpoint's name of the weight scales

    @property
    def online(self) -> bool:
        """Whether the weights are quantized at load time from a higher-precision checkpoint."""
        return self.source == "online"

    @property
    def block(self) -> bool:
        return self.weight_strategy == "block"

    def quantizes(self, hf_module_name: str) -> bool:
        """Whether the checkpoint module `hf_module_name` (e.g. "model.layers.0.self_attn.q_proj") holds fp8
        weights; "lm_head" only when the checkpoint quantizes it (online quantization never does)."""
        if self.online and hf_module_name.split(".")[-1] == "lm_head":
            return False
        return not any(_matches(entry, hf_module_name) for entry in self.ignored)

    def describe(self) -> str:
        """One line for the start-up log."""
        weights = (f"{self.weight_block[0]}x{self.weight_block[1]} blocks" if self.block
                   else f"per {self.weight_strategy}")
        acts = {"dynamic": "dynamic per-token", "static": "static per-tensor"}[self.activation]
        if self.block:
            acts = f"dynamic per-token x {self.weight_block[1]}-column"
        origin = "quantized at load" if self.online else f"{self.source} checkpoint"
        return f"fp8 e4m3 weights ({origin}), {weights} scales; {acts} activation scales"


def _matches(entry: str, name: str) -> bool:
    """A quantization_config ignore entry against a module name: "re:<pattern>" matches by regex (from the start),
    a plain entry when it is the name or a run of its dotted parts ("lm_head", "mlp.gate", a full name)."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return f".{entry}." in f".{name}."


# ---- resolution ---------------------------------------------------------------------------------------------------

def check_quantization(quantization: str | None) -> None:
    """Refuse a `quantization=` value ember does not know, before anything loads."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise QuantConfigError(f"quantization {quantization!r} is not supported; use 'fp8' (e4m3 weights, quantized "
                               f"at load time or read from an fp8 checkpoint) or leave it out")


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """Refuse a `kv_cache_dtype=` value ember does not know, before anything loads."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise QuantConfigError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use 'auto' (the model's dtype) "
                               f"or 'fp8' (e4m3 with a scale per layer)")


def resolve_quant_config(hf_config, quantization: str | None, model_dtype: torch.dtype,
                         device: torch.device | str) -> QuantConfig | None:
    """The QuantConfig for this model and request, None for unquantized weights, or QuantConfigError with the reason.

    A checkpoint's quantization_config wins; `quantization="fp8"` beside it must agree with it. Without one,
    `quantization="fp8"` quantizes the float16/bfloat16/float32 checkpoint per output channel at load time."""
    check_quantization(quantization)
    raw = getattr(hf_config, "quantization_config", None)
    if raw is not None and not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
    if raw:
        method = raw.get("quant_method")
        if method == "fp8":
            config = _from_fp8_config(raw)
        elif method == "compressed-tensors":
            config = _from_compressed_tensors(raw)
        elif method == "mxfp4":
            # gpt-oss's experts in MXFP4, the rest unquantized: dequantized at load (ember.models.gpt_oss)
            if "GptOssForCausalLM" not in list(getattr(hf_config, "architectures", None) or []):
                raise QuantConfigError(f"the checkpoint's quantization_config has quant_method 'mxfp4', which ember "
                                       f"loads for gpt-oss's experts only (architectures "
                                       f"{getattr(hf_config, 'architectures', None)})")
            if quantization is not None:
                raise QuantConfigError(f"quantization={quantization!r} cannot be applied over an MXFP4 checkpoint; "
                                       f"leave quantization unset (its experts load dequantized to the model dtype)")
            return None
        else:
            raise QuantConfigError(f"the checkpoint's quantization_config has quant_method {method!r}; ember runs "
                                   f"'fp8' and 'compressed-tensors' (fp8 e4m3) checkpoints only")
    elif quantization == "fp8":
        config = QuantConfig(source="online", weight_strategy="channel", activation="dynamic")
    else:
        return None
    _check_runtime(config, model_dtype, torch.device(device))
    return config


def _from_fp8_config(raw: dict) -> QuantConfig:
    """transformers' / vLLM's "fp8" quant_method: e4m3 weights with `weight_scale` per tensor and an optional static
    `input_scale`, or `weight_block_size` [128, 128] with `weight_scale_inv` per block and dynamic activations."""
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantConfigError(f"the checkpoint's fp8 format is {fmt!r}; ember runs e4m3 weights only")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise QuantConfigError(f"activation_scheme {scheme!r} is not known; ember runs 'dynamic' or 'static'")
    ignored = tuple(raw.get("ignored_layers") or raw.get("modules_to_not_convert") or ())
    block = raw.get("weight_block_size")
    if block is None:
        return QuantConfig("fp8", "tensor", scheme, ignored=ignored)
    block = _check_block(block, "weight_block_size")
    if scheme != "dynamic":
        raise QuantConfigError("a block-quantized fp8 checkpoint with static activation scales is not supported; "
                               "block scales run with dynamic per-token activation scales only")
    return QuantConfig("fp8", "block", "dynamic", block, ignored, scale_name="weight_scale_inv")


def _check_block(block, what: str) -> tuple[int, int]:
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantConfigError(f"{what} {block!r} must be two positive integers [rows, columns]")
    if tuple(block) != (128, 128):
        raise QuantConfigError(f"{what} {list(block)} is not supported; ember runs 128x128 weight blocks only")
    return 128, 128


def _from_compressed_tensors(raw: dict) -> QuantConfig:
    """compressed-tensors: one config group targeting every Linear, fp8 (8-bit float, symmetric) weights per tensor,
    per channel or per block, and fp8 input activations static per tensor or dynamic per token (per token and
    block column group with block weights)."""
    fmt = raw.get("format")
    if fmt not in ("float-quantized", "naive-quantized", None):
        raise QuantConfigError(f"compressed-tensors format {fmt!r} is not supported; ember runs 'float-quantized' "
                               f"(fp8 e4m3) checkpoints")
    groups = raw.get("config_groups") or {}
    if len(groups) != 1:
        raise QuantConfigError(f"the checkpoint has {len(groups)} compressed-tensors config groups; ember runs one "
                               f"group that targets every Linear")
    (name, group), = groups.items()
    if list(group.get("targets") or []) != ["Linear"]:
        raise QuantConfigError(f"config group {name!r} targets {group.get('targets')}; ember runs a group that "
                               f"targets ['Linear']")
    if group.get("output_activations"):
        raise QuantConfigError(f"config group {name!r} quantizes output activations; ember does not")
    weights = group.get("weights") or {}
    _check_fp8_args(weights, f"config group {name!r} weights")
    strategy = weights.get("strategy")
    if weights.get("dynamic"):
        raise QuantConfigError(f"config group {name!r} has dynamic weight scales; ember runs stored weight scales")
    if strategy not in ("tensor", "channel", "block"):
        raise QuantConfigError(f"weight strategy {strategy!r} of config group {name!r} is not supported; ember runs "
                               f"'tensor', 'channel' or 'block'")
    acts = group.get("input_activations")
    if not acts:
        raise QuantConfigError(f"config group {name!r} quantizes weights only (no input_activations); ember runs "
                               f"fp8 weights with fp8 activations (W8A8)")
    _check_fp8_args(acts, f"config group {name!r} input_activations")
    act_strategy, dynamic = acts.get("strategy"), acts.get("dynamic")
    ignored = tuple(raw.get("ignore") or ())
    if strategy == "block":
        block = _check_block(weights.get("block_structure"), "block_structure")
        if act_strategy != "group" or dynamic is not True or acts.get("group_size") != block[1]:
            raise QuantConfigError(f"block weights with {act_strategy!r} activations (dynamic={dynamic}) are not "
                                   f"supported; ember runs block weights with dynamic per-token activation groups "
                                   f"of {block[1]} columns")
        return QuantConfig("compressed-tensors", "block", "dynamic", block, ignored)
    if act_strategy == "token" and dynamic is True:
        activation = "dynamic"
    elif act_strategy == "tensor" and dynamic is False:
        activation = "static"
    else:
        raise QuantConfigError(f"input activations with strategy {act_strategy!r} and dynamic={dynamic} are not "
                               f"supported; ember runs static per-tensor ('tensor', dynamic false) or dynamic "
                               f"per-token ('token', dynamic true) activation scales")
    return QuantConfig("compressed-tensors", strategy, activation, ignored=ignored)


def _check_fp8_args(args: dict, what: str) -> None:
    if args.get("num_bits") != 8 or args.get("type") != "float" or args.get("symmetric") is False:
        raise QuantConfigError(f"{what} are {args.get('num_bits')}-bit {args.get('type')} "
                               f"(symmetric={args.get('symmetric')}); ember runs symmetric 8-bit float (fp8 e4m3)")


def _check_runtime(config: QuantConfig, model_dtype: torch.dtype, device: torch.device) -> None:
    """Refuse what this device and compute dtype cannot run."""
    if model_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise QuantConfigError(f"fp8 weights need a bfloat16, float16 or float32 compute dtype, got {model_dtype}")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise QuantConfigError(f"fp8 weights need a GPU of compute capability 8.9 or newer (Ada, Hopper); this "
                                   f"one is {major}.{minor}. Run an unquantized checkpoint instead")

