"""Build a model on the meta device and fill it from safetensors shards: no random init, no second copy.

HF tensor names map onto ember parameters through the model's `checkpoint_target(name)` where it has one and names
the tensor (experts' tensors into stacked parameters), else its `packed_modules` (q/k/v -> qkv_proj, gate/up ->
gate_up_proj); each parameter's `weight_loader` places its tensor. A plain tensor is assigned (the parameter takes
the checkpoint tensor's storage); a packed parameter is allocated once and its shards copied in. Non-persistent
buffers (rotary tables) are created on the real device afterwards.

A tensor-parallel rank builds its shard of the model (`shard=`, see ember.distributed.shard) and reads only its
slice of each sharded tensor: a parameter's `checkpoint_slice(shard_id)` names the range, and safetensors'
`get_slice` reads just those bytes.
"""

from __future__ import annotations

import contextlib
import logging
import json
import sys
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from ember.distributed.shard import CheckpointSlice, ShardSpec, building
from ember.models.config_snapshot import snapshot_config
from ember.models.layers.attention import Attention
from ember.models.layers.linear import check_shape, default_weight_loader
from ember.models.layers.scaled_linear import quantize_linear_layers
from ember.models.registry import resolve_model_class
from ember.quant import QuantConfig, QuantConfigError

logger = logging.getLogger("ember")

# Checkpoint tensors that carry nothing ember needs: precomputed rotary tables of older exports.
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_SCALE_NAMES = ("weight_scale", "weight_scale_inv", "input_scale")
# an fp8 KV cache's scales as checkpoints name them (compressed-tensors' kv_cache_scheme, vLLM's fp8 exports, and
# older exports' k_proj/v_proj output scales): suffix -> which scale
_KV_SCALE_SUFFIXES = {"self_attn.k_scale": "k", "self_attn.v_scale": "v", "self_attn.attn.k_scale": "k",
                      "self_attn.attn.v_scale": "v", "self_attn.k_proj.output_scale": "k",
                      "self_attn.v_proj.output_scale": "v"}


def _kv_scale_target(name: str, attention_paths: set[str]) -> str | None:
    """"<Attention module path>:k" or ":v" for a checkpoint's KV-cache scale tensor, else None."""
    for suffix, which in _KV_SCALE_SUFFIXES.items():
        if name.endswith("." + suffix):
            path = name[:-len(suffix)] + "self_attn.attn"
            return f"{path}:{which}" if path in attention_paths else None
    return None


class CheckpointError(ValueError):
    """A model folder that cannot be loaded: no config, no weights, a missing, extra or mis-shaped tensor."""


def load_config(path: str | Path, cache_root: Path | str | None = None):
    """The resolved config of a local model folder: its transformers `PretrainedConfig` (via AutoConfig) as a
    `ConfigSnapshot`, which a later load of the same config.json reads without importing transformers."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"model folder {str(path)!r} has no config.json; point to a folder saved with "
                              f"save_pretrained (or downloaded from the Hub)")
    try:
        source = json.dumps(json.loads(config_file.read_text()), sort_keys=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(config_file)!r} cannot be read as a model config: {e}") from None

    def build():
        from transformers import AutoConfig
        try:
            return AutoConfig.from_pretrained(path)
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{str(config_file)!r} cannot be read as a model config: {e}") from None

    return snapshot_config(source, build, cache_root)


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a folder: those named by model.safetensors.index.json, else every *.safetensors."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} names shard(s) {absent} that are not in {str(path)!r}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"model folder {str(path)!r} has no *.safetensors weights; ember loads safetensors only")
    return files


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_on_meta(config, dtype: torch.dtype, quant: QuantConfig | None = None,
                  shard: ShardSpec = ShardSpec(), model_impl: str = "auto") -> nn.Module:
    """Construct the config's model (the class `model_impl` picks: ember's own or the transformers fallback; or its
    tensor-parallel `shard`, whose experts are whole under expert parallelism: refused for a model without any)
    with every parameter on the meta device in `dtype` (no memory, no init); with `quant`,
    the linear layers it quantizes are fp8 layers (ember.models.layers.scaled_linear), sharded as the layers they
    replace."""
    model_cls = resolve_model_class(config, model_impl)
    if shard.size > 1 and getattr(model_cls, "runs_transformers_code", False):
        raise ValueError(f"the transformers fallback does not split a model over tensor-parallel ranks "
                         f"(tensor_parallel_size {shard.size}); run it with tensor_parallel_size=1")
    with torch.device("meta"), _default_dtype(dtype), building(shard):
        model = model_cls(config)
        if quant is not None:
            from ember.models.layers.moe import refuse_quantized_experts   # its kernels only where a model has MoE
            refuse_quantized_experts(model, quant)
            quantize_linear_layers(model, quant)
    if shard.expert_parallel and shard.size > 1 and not any(getattr(m, "expert_parallel", False)
                                                            for m in model.modules()):
        raise ValueError(f"enable_expert_parallel places a mixture-of-experts model's experts on the ranks, and "
                         f"{type(model).__name__} has no experts; leave expert parallelism off (tensor parallelism "
                         f"shards it)")
    return model


def _replace_param(model: nn.Module, name: str, tensor: torch.Tensor) -> nn.Parameter:
    """Put `tensor` in place of parameter `name`, keeping the old parameter's attributes (its weight_loader)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    old = module._parameters[leaf]
    new = nn.Parameter(tensor, requires_grad=False)
    new.__dict__.update(old.__dict__)
    module._parameters[leaf] = new
    return new


def _empty_for(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Uninitialised storage on `device` of a meta parameter's shape and dtype. Not `empty_like`: on a meta tensor
    it runs torch's Python reference, whose import of the symbolic-shapes module and sympy took 0.76 s of a CPU
    start that imports neither otherwise."""
    return torch.empty(param.shape, dtype=param.dtype, device=device)


def materialise(model: nn.Module, device: torch.device) -> None:
    """Give every parameter still on meta uninitialised storage on `device`."""
    for name, param in list(model.named_parameters()):
        if param.is_meta:
            _replace_param(model, name, _empty_for(param, device))


def init_buffers(model: nn.Module, device: torch.device) -> None:
    """Create non-persistent buffers (rotary tables, ...) on `device`; then nothing may be left on meta."""
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"tensors {left[:8]} were never materialised")


def _target_of(name: str, packed_modules: dict[str, list[str]], mapper=None) -> tuple[str, object]:
    """HF tensor name -> (ember parameter name, shard id or None): the model's `checkpoint_target` where it names
    the tensor, else by `packed_modules` (shard index)."""
    target = mapper(name) if mapper is not None else None
    if target is not None:
        return target
    parts = name.split(".")
    for packed, shards in packed_modules.items():
        for shard_id, shard in enumerate(shards):
            if shard in parts:
                parts[parts.index(shard)] = packed
                return ".".join(parts), shard_id
    return name, None


def _plan(model: nn.Module, config, files: list[Path]) -> dict[str, tuple[Path, str, object]]:
    """Read only the headers: map every needed checkpoint tensor to its destination, or raise naming what is
    missing or unexpected before any data is read."""

    packed = getattr(model, "packed_modules", {})
    mapper = getattr(model, "checkpoint_target", None)
    params = dict(model.named_parameters())
    attention_paths = {path for path, m in model.named_modules() if isinstance(m, Attention)}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    folder = str(files[0].parent)
    plan: dict[str, tuple[Path, str, object]] = {}
    unexpected: list[str] = []
    for file in files:
        with _open_safetensors(file) as f:
            for name in f.keys():
                target, shard_id = _target_of(name, packed, mapper)
                kv_scale = None if target in params else _kv_scale_target(name, attention_paths)
                holds = getattr(params.get(target), "holds_shard", None)
                if holds is not None and not holds(shard_id):     # another rank's (its experts): never read here
                    continue
                if target in params:
                    plan.setdefault(name, (file, target, shard_id))
                elif kv_scale is not None:
                    plan.setdefault(name, (file, kv_scale, None))
                elif name.endswith(_HARMLESS_SUFFIXES) or (tied and name.startswith("lm_head.")):
                    continue
                else:
                    unexpected.append(name)
    scaled = [n for n in unexpected if n.rpartition(".")[2] in _SCALE_NAMES]
    if scaled:
        raise QuantConfigError(f"checkpoint in {folder!r} has fp8 scales {scaled[:4]} for layers ember runs "
                               f"unquantized (the LM head, the embedding, or layers the quantization_config "
                               f"ignores); ember cannot run those layers in fp8")
    if unexpected:
        raise CheckpointError(f"checkpoint in {folder!r} has tensor(s) {unexpected[:8]} that {type(model).__name__} "
                              f"has no parameter for ({len(unexpected)} in all); does config.json match the weights?")
    loaded: dict[str, set] = {}
    for _, target, shard_id in plan.values():
        loaded.setdefault(target, set()).add(shard_id)
    missing = []
    for name, param in params.items():
        if getattr(param, "loaded_by", None):      # filled by another parameter's loader
            continue
        got = loaded.get(name, set())
        if None in got:      # present whole (an already packed checkpoint tensor, or a plain one)
            continue
        describe = getattr(params[name], "missing_shards", None)
        if describe is not None:     # a parameter that knows its shards (stacked experts)
            missing += [f"{name} ({what})" for what in describe(got)]
            continue
        parts = name.split(".")
        packed_name = next((p for p in packed if p in parts), None)
        if packed_name is None:
            missing.append(name)
            continue
        for shard_id, shard in enumerate(packed[packed_name]):
            if shard_id not in got:
                missing.append(".".join(shard if p == packed_name else p for p in parts))
    if missing:
        raise CheckpointError(f"checkpoint in {folder!r} is missing tensor(s) {missing[:8]} ({len(missing)} in all); "
                              f"is it a complete {type(model).__name__} checkpoint?")
    return plan


def load_weights(model: nn.Module, config, files: list[Path], device: torch.device, progress: bool = True) -> None:
    """Fill a meta-built model from safetensors files, shard by shard, with a progress bar."""
    from tqdm.auto import tqdm

    plan = _plan(model, config, files)
    by_file: dict[Path, list[str]] = {}
    for name, (file, _, _) in plan.items():
        by_file.setdefault(file, []).append(name)
    # on stderr, and only on a terminal: logs and pipes get no carriage-return noise
    for file in tqdm(files, desc="Loading safetensors shards", unit="shard", file=sys.stderr,
                     disable=not (progress and sys.stderr.isatty())):
        with _open_safetensors(file) as f:
            for name in by_file.get(file, []):
                _, target, shard_id = plan[name]
                # a KV-cache scale ("<attention path>:k") has no parameter, and is read whole
                rule = None if ":" in target else getattr(model.get_parameter(target), "checkpoint_slice", None)
                piece = rule(shard_id) if rule is not None else None
                try:
                    loaded = f.get_tensor(name) if piece is None else _read_slice(f, name, piece)
                except ValueError as e:      # the tensor is not of the size this rank's slice was cut from
                    raise CheckpointError(f"tensor {name!r}: {e}") from None
                except Exception as e:
                    raise CheckpointError(f"tensor {name!r} of {str(file)!r} cannot be read ({e}); the file is "
                                          f"truncated or corrupt") from None
                _load_tensor(model, name, target, shard_id, loaded, device)
    _check_kv_scales(model)


def _read_slice(f, name: str, piece: CheckpointSlice) -> torch.Tensor:
    """Only the bytes of `piece` of tensor `name` (safetensors reads a slice without the rest)."""
    view = f.get_slice(name)
    piece.check(tuple(view.get_shape()))
    return view[(slice(None),) * piece.dim + (slice(piece.start, piece.start + piece.length),)]


def _open_safetensors(file: Path):
    """`safe_open` of one file; a file that is empty, truncated or not safetensors is an error naming it."""
    from safetensors import safe_open
    try:
        return safe_open(file, framework="pt")
    except Exception as e:
        raise CheckpointError(f"{str(file)!r} cannot be read as safetensors ({e}); the file is empty, truncated "
                              f"or corrupt") from None


def _load_kv_scale(model: nn.Module, name: str, target: str, loaded: torch.Tensor, device: torch.device) -> None:
    """A checkpoint's KV-cache scale (one value, or one per KV head) onto its Attention layer's `kv_scales`."""
    path, _, which = target.rpartition(":")
    layer = model.get_submodule(path)
    heads = layer.options.num_kv_heads
    first, model_heads = layer.kv_heads_in_model
    if loaded.numel() == model_heads != heads:      # per head, and this rank holds a range of the heads
        loaded = loaded.reshape(-1)[first:first + heads]
    if loaded.numel() not in (1, heads):
        raise CheckpointError(f"KV-cache scale {name!r} has shape {tuple(loaded.shape)}; expected one value or one "
                              f"per KV head ({model_heads})")
    scale = loaded.to(device=device, dtype=torch.float32).reshape(-1).expand(heads).contiguous()
    k, v = layer.kv_scales or (None, None)
    layer.kv_scales = (scale, v) if which == "k" else (k, scale)


def _check_kv_scales(model: nn.Module) -> None:
    """Every layer whose checkpoint gave one KV-cache scale gave both."""
    half = [path for path, m in model.named_modules()
            if isinstance(m, Attention) and m.kv_scales is not None and None in m.kv_scales]
    if half:
        raise CheckpointError(f"checkpoint gives a key or a value KV-cache scale without the other for {half[:4]}")


def _load_tensor(model: nn.Module, name: str, target: str, shard_id, loaded: torch.Tensor,
                 device: torch.device) -> None:
    if ":" in target:
        _load_kv_scale(model, name, target, loaded, device)
        return
    param = model.get_parameter(target)
    loaded = loaded.to(device=device)
    if not getattr(param, "casts_itself", False):      # fp8 layers take the checkpoint's dtype as it is
        loaded = loaded.to(dtype=param.dtype)
    loader = getattr(param, "weight_loader", default_weight_loader)
    try:
        if param.is_meta and shard_id is None and loader is default_weight_loader:
            check_shape(param, loaded, param.shape)
            _replace_param(model, target, loaded.contiguous())    # assign: no second allocation
            return
        if param.is_meta:
            param = _replace_param(model, target, _empty_for(param, device))
        loader(param, loaded, shard_id)
    except ValueError as exc:
        into = "" if target == name else f" (packed into {target!r})"
        raise CheckpointError(f"tensor {name!r}{into}: {exc}") from None


def load_model(path: str | Path, config=None, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cpu", progress: bool = True, quant: QuantConfig | None = None,
               shard: ShardSpec = ShardSpec(), model_impl: str = "auto") -> nn.Module:
    """Load a local HF model folder into the model class `model_impl` picks (or this rank's `shard` of it), in
    `dtype` on `device`, in eval mode; `quant`: its fp8 layers (ember.quant)."""
    path = Path(path)
    if config is None:
        config = load_config(path)
    elif not (path / "config.json").is_file():
        raise CheckpointError(f"model folder {str(path)!r} has no config.json")
    device = torch.device(device)
    files = checkpoint_files(path)
    model = build_on_meta(config, dtype, quant, shard, model_impl)
    load_weights(model, config, files, device, progress)
    init_buffers(model, device)
    return model.eval()


def build_model(path: str | Path, config, dtype: torch.dtype, device: torch.device | str, load_format: str = "auto",
                seed: int = 0, quant: QuantConfig | None = None, shard: ShardSpec = ShardSpec(),
                model_impl: str = "auto") -> nn.Module:
    """The model of a runner: `load_model` of the folder, or for load_format "dummy" `random_model` (random weights
    of the config's shapes, no checkpoint read); logs its fp8 layers."""
    if load_format == "dummy":
        model = random_model(config, dtype, device, seed, quant, shard, model_impl)
    else:
        model = load_model(path, config, dtype, device, quant=quant, shard=shard, model_impl=model_impl)
    if quant is not None:
        logger.info("linear layers: %s", quant.describe())
    return model


def compile_identity(model: nn.Module) -> dict[str, str]:
    """What besides the config decides a model's traced code, for compile cache keys: nothing for ember's own
    models; the implementation and its library's version for the transformers fallback."""
    identity = getattr(model, "compile_identity", None)
    return identity() if identity is not None else {}


@torch.no_grad()
def random_model(config, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 seed: int = 0, quant: QuantConfig | None = None, shard: ShardSpec = ShardSpec(),
                 model_impl: str = "auto") -> nn.Module:
    """The config's model with random weights (normal, std `initializer_range`; norms at identity), for benchmarks.
    Each parameter draws from a generator of its own, seeded by `seed` and its place in the model, so that on a CPU
    the parameters fill in parallel (one thread a core: the Qwen3-0.6B config in bf16 in 2.8-2.9 s instead of
    4.7-5.2 s on two cores) and the weights do not depend on the thread count. An fp8 layer (`quant`) draws its
    weights in `dtype` and quantizes them. A tensor-parallel `shard` draws its own shapes from the same seeds:
    replicated parameters (norms, rotary) are alike on every rank."""
    device = torch.device(device)
    model = build_on_meta(config, dtype, quant, shard, model_impl)
    materialise(model, device)
    std = float(getattr(config, "initializer_range", 0.02))
    params = []
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
            continue
        if hasattr(module, "fill_random"):
            params.append(module)
            continue
        params += module.parameters(recurse=False)

    def fill(index: int) -> None:
        generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)
        with torch.no_grad():                             # grad mode is per thread
            if isinstance(params[index], nn.Module):
                params[index].fill_random(std, dtype, generator)
            else:
                params[index].normal_(0.0, std, generator=generator)

    workers = torch.get_num_threads() if device.type == "cpu" else 1
    if workers > 1 and len(params) > 1:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(workers) as pool:       # normal_ releases the GIL
            list(pool.map(fill, range(len(params))))
    else:
        for index in range(len(params)):
            fill(index)
    init_buffers(model, device)
    return model.eval()
