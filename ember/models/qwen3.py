"""Qwen3: Llama blocks with an RMSNorm over each head of q and k before rotary."""

from __future__ import annotations

from ember.models.llama import BlockOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense) causal LM."""

    @classmethod
    def block_options(cls, config) -> BlockOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return BlockOptions(hidden_act=config.hidden_act, qkv_bias=bias, o_bias=bias, qk_norm=True)
