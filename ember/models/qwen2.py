"""Qwen2: Llama blocks with biases on q/k/v (not on o_proj); sliding-window layers chosen by the config."""

from __future__ import annotations

from ember.models.llama import BlockOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 causal LM."""

    @classmethod
    def block_options(cls, config) -> BlockOptions:
        return BlockOptions(hidden_act=config.hidden_act, qkv_bias=True, o_bias=False)
