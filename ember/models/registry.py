"""HF `architectures` name -> ember model class, imported on first use; `model_impl` chooses between ember's own
implementation of a family and the transformers fallback (ember.models.transformers_fallback)."""

from __future__ import annotations

import importlib

from torch import nn

from ember.config import MODEL_IMPLS, check_model_impl  # noqa: F401  (part of this module's API)

# architecture -> (module, class name); modules import lazily so that looking one up stays cheap
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("ember.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("ember.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("ember.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("ember.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("ember.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("ember.models.mixtral", "MixtralForCausalLM"),
    "GptOssForCausalLM": ("ember.models.gpt_oss", "GptOssForCausalLM"),
    "GemmaForCausalLM": ("ember.models.gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("ember.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("ember.models.gemma3", "Gemma3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    """Every HF architecture name ember implements natively."""
    return sorted(_MODELS)


def native_architecture(config) -> str | None:
    """The first name in `config.architectures` that ember implements, or None."""
    return next((a for a in list(getattr(config, "architectures", None) or []) if a in _MODELS), None)


def get_model_class(config) -> type[nn.Module]:
    """The ember class for the first supported name in `config.architectures`; ValueError naming it otherwise."""
    name = native_architecture(config)
    if name is None:
        architectures = list(getattr(config, "architectures", None) or [])
        raise ValueError(f"model architecture {architectures or None} is not implemented in ember; "
                         f"supported: {', '.join(supported_architectures())}; model_impl='transformers' (or "
                         f"'auto') runs other decoders through transformers")
    module, cls = _MODELS[name]
    return getattr(importlib.import_module(module), cls)


def uses_fallback(config, model_impl: str = "auto") -> bool:
    """Whether `model_impl` runs this config through the transformers fallback."""
    return check_model_impl(model_impl) == "transformers" or (model_impl == "auto"
                                                               and native_architecture(config) is None)


def resolve_model_class(config, model_impl: str = "auto") -> type[nn.Module]:
    """The class that runs `config` under `model_impl`: ember's own ("ember"; "auto" where it has one) or the
    transformers fallback, whose support is checked here from the config (ValueError with the reason)."""
    if not uses_fallback(config, model_impl):
        return get_model_class(config)
    from ember.models.fallback_check import fallback_refusal
    reason = fallback_refusal(config)
    if reason is not None:
        named = f"model architecture {list(getattr(config, 'architectures', None) or []) or None}"
        if native_architecture(config) is not None:
            raise ValueError(f"{named} cannot run through the transformers fallback: {reason}; model_impl='ember' "
                             f"runs ember's own implementation")
        if model_impl == "auto":
            named += f" is not implemented in ember (supported: {', '.join(supported_architectures())}) and"
        raise ValueError(f"{named} cannot run through the transformers fallback: {reason}")
    from ember.models.transformers_fallback import TransformersForCausalLM
    return TransformersForCausalLM
