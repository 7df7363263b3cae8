"""Gemma 3 (text): the Gemma 2 stack with an RMSNorm over each head of q and k, a rope base per layer type (local
layers 10k, global layers 1M, scaling on the global ones) and, by default, five local layers to one global."""

from __future__ import annotations

from ember.models.gemma import gemma_activation
from ember.models.gemma2 import Gemma2ForCausalLM
from ember.models.layers.norm import GemmaRMSNorm
from ember.models.llama import BlockOptions


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text causal LM. Attention scores are not soft-capped, whatever `attn_logit_softcapping` says: the
    reference implementation does not apply it to this family either."""

    @classmethod
    def block_options(cls, config) -> BlockOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return BlockOptions(hidden_act=gemma_activation(config), qkv_bias=bias, o_bias=bias, norm_cls=GemmaRMSNorm,
                            qk_norm=True, embed_scale=config.hidden_size ** 0.5,
                            query_pre_attn_scalar=getattr(config, "query_pre_attn_scalar", None))
