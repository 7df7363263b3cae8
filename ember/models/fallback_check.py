"""Which Hugging Face decoders the transformers fallback can run, decided from the config before anything is built.

The fallback runs a model's own transformers code with ember's paged attention in place of its attention function,
so a model qualifies when every layer is standard softmax attention over a K/V cache and its modeling class routes
that attention through transformers' attention interface. What the config alone shows is checked here; what only
the modeling code shows (the arguments each layer hands its attention function) is checked when the model is built
on the meta device (`ember.models.transformers_fallback`), still before any weight loads.
"""

from __future__ import annotations

MIN_TRANSFORMERS = (5, 0)

# layer types that are softmax attention over a K/V cache (what ember's backends compute)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")

# config keys that mark attention ember's K/V cache does not hold, with the name of what they mark
_UNSUPPORTED_KEYS = {
    "kv_lora_rank": "multi-head latent attention (MLA)",
    "attention_chunk_size": "chunked local attention",
    "layers_block_type": "state-space / recurrent layers",
    "hybrid_override_pattern": "state-space / recurrent layers",
    "attn_layer_indices": "state-space / recurrent layers",
    "mamba_d_state": "state-space (Mamba) layers",
    "ssm_state_size": "state-space layers",
    "linear_attn_config": "linear attention",
}


def _transformers_version() -> tuple[int, ...]:
    import transformers
    parts = []
    for piece in transformers.__version__.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def causal_lm_class(config):
    """The transformers causal-LM class the config's `architectures` names (or its model type maps to), or a
    ValueError saying why there is none."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    architectures = list(getattr(config, "architectures", None) or [])
    for name in architectures:
        if name in causal and hasattr(transformers, name):
            return getattr(transformers, name)
    by_type = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None))
    if by_type is not None and not architectures and hasattr(transformers, by_type):
        return getattr(transformers, by_type)
    raise ValueError(f"architecture {architectures or None} (model_type {getattr(config, 'model_type', None)!r}) is "
                     f"not a causal language model class of transformers {transformers.__version__}; the fallback "
                     f"runs transformers' own decoder classes only, never code shipped with a checkpoint")


def fallback_refusal(config) -> str | None:
    """Why the transformers fallback cannot run this config, or None when the config shows no reason (the build
    on the meta device checks the rest)."""
    version = _transformers_version()
    if version < MIN_TRANSFORMERS:
        import transformers
        return (f"it needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))} (installed: "
                f"{transformers.__version__}); pip install -U transformers")
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model; ember runs decoder-only models"
    for key, what in _UNSUPPORTED_KEYS.items():
        if getattr(config, key, None):
            return f"its config sets {key} ({what}); ember's attention is softmax attention over a K/V cache"
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    if other:
        return (f"its layer_types include {other}: layers that are not softmax attention over a K/V cache "
                f"(ember runs {list(ATTENTION_LAYER_TYPES)})")
    if getattr(config, "use_bidirectional_attention", False):
        return "it sets use_bidirectional_attention; ember runs causal decoders only"
    if int(getattr(config, "num_kv_shared_layers", 0) or 0):
        return "its layers share K/V caches across layers (num_kv_shared_layers), which the fallback does not map"
    try:
        cls = causal_lm_class(config)
    except ValueError as exc:
        return str(exc)
    if not getattr(cls, "_supports_attention_backend", False):
        return (f"{cls.__name__} does not route its attention through transformers' attention interface "
                f"(_supports_attention_backend is False), so ember cannot put its paged attention in")
    unsupported = sorted({type(c).__name__ for c in checkpoint_conversions(cls, config)
                          if not _is_renaming(c)})
    if unsupported:
        return (f"transformers converts its checkpoint tensors at load ({unsupported}, e.g. experts stacked into "
                f"one tensor); ember's loader reads checkpoint tensors as they are, renamed at most")
    return None


def checkpoint_conversions(cls, config) -> list:
    """The checkpoint transforms transformers registers for this class (or, failing that, its model type)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    return list(get_checkpoint_conversion_mapping(cls.__name__)
                or get_checkpoint_conversion_mapping(getattr(config, "model_type", None)) or [])


def _is_renaming(transform) -> bool:
    from transformers.core_model_loading import WeightRenaming
    return isinstance(transform, WeightRenaming)


def transformers_support_table() -> list[tuple[str, str, str | None]]:
    """(class name, model type, why the fallback refuses it or None) for every causal-LM class of the installed
    transformers, judged from its default config: a checkpoint's own config may still be refused for what it sets
    (e.g. layer types), and the build checks what the modeling code hands its attention function. Imports every
    modeling module: tens of seconds."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rows, seen = [], set()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()        # default configs warn about their own token ids
    try:
        for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items(), key=lambda kv: kv[1]):
            if class_name in seen:
                continue
            seen.add(class_name)
            try:
                reason = fallback_refusal(AutoConfig.for_model(model_type, architectures=[class_name]))
            except Exception as exc:   # noqa: BLE001 - a class that cannot even be looked at is listed with why
                reason = f"its default config cannot be built ({type(exc).__name__}: {str(exc).splitlines()[0]})"
            rows.append((class_name, model_type, reason))
    finally:
        hf_logging.set_verbosity(verbosity)
    return rows
