"""Gemma (1): Llama blocks with (1 + w) RMSNorm, embeddings scaled by sqrt(hidden) and a gelu-tanh gated MLP."""

from __future__ import annotations

from ember.models.layers.norm import GemmaRMSNorm
from ember.models.llama import BlockOptions, LlamaForCausalLM


def gemma_activation(config) -> str:
    """Gemma checkpoints name plain "gelu" but were trained with the tanh approximation (as transformers notes)."""
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "gelu_pytorch_tanh"
    return "gelu_pytorch_tanh" if act == "gelu" else act


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma causal LM; head_dim comes from the config (256 for the released models), embeddings are tied."""

    @classmethod
    def block_options(cls, config) -> BlockOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return BlockOptions(hidden_act=gemma_activation(config), qkv_bias=bias, o_bias=bias, norm_cls=GemmaRMSNorm,
                            embed_scale=config.hidden_size ** 0.5)
