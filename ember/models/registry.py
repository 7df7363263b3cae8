"""HF `architectures` name -> ember model class, imported on first use."""

from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module, class name); modules import lazily so that looking one up stays cheap
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("ember.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("ember.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("ember.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("ember.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("ember.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("ember.models.mixtral", "MixtralForCausalLM"),
    "GemmaForCausalLM": ("ember.models.gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("ember.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("ember.models.gemma3", "Gemma3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    """Every HF architecture name ember can run."""
    return sorted(_MODELS)


def get_model_class(config) -> type[nn.Module]:
    """The ember class for the first supported name in `config.architectures`; ValueError naming it otherwise."""
    architectures = list(getattr(config, "architectures", None) or [])
    for name in architectures:
        if name in _MODELS:
            module, cls = _MODELS[name]
            return getattr(importlib.import_module(module), cls)
    raise ValueError(f"model architecture {architectures or None} is not supported; "
                     f"supported: {', '.join(supported_architectures())}")
