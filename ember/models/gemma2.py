"""Gemma 2: Gemma blocks with sandwich norms (a norm after attention and around the MLP), interleaved sliding-window
and global layers, attention-score and final-logit soft-capping, and a query scale from `query_pre_attn_scalar`.

The decoder stack here also serves Gemma 3, which adds q/k norms and a rope table per layer type."""

from __future__ import annotations

import torch
from torch import nn

from ember.models.gemma import gemma_activation
from ember.models.layers.embedding import VocabEmbedding
from ember.models.layers.norm import GemmaRMSNorm
from ember.models.layers.rotary import RotaryEmbedding, has_rope_per_layer_type, rope_parameters_from_config
from ember.models.llama import BlockOptions, LlamaAttention, LlamaForCausalLM, LlamaMLP, head_size_of


def check_causal(config) -> None:
    """ember runs causal decoders only; Gemma's bidirectional (embedding) variant is refused by name."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"use_bidirectional_attention=True ({config.model_type}) is not supported: ember runs "
                         "causal decoders only")


class Gemma2DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each output normed again before it joins the residual (sandwich norms)."""

    def __init__(self, config, layer_idx: int, options: BlockOptions, prefix: str = ""):
        super().__init__()
        norm, eps = options.norm_cls, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_idx, options, prefix)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, options)
        self.input_layernorm = norm(config.hidden_size, eps)
        self.post_attention_layernorm = norm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = norm(config.hidden_size, eps)
        self.post_feedforward_layernorm = norm(config.hidden_size, eps)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # `residual` is the stream before this layer's input norm; the previous layer's (post-normed) output is
        # added to it here, so each add can fuse with the norm that follows it
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(cos, sin, hidden))
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2Model(nn.Module):
    """Scaled embedding, sandwich-norm layers and the final norm. One rotary table per distinct rope setting: a
    single one (Gemma 2), or one per layer type (Gemma 3's local and global bases)."""

    def __init__(self, config, options: BlockOptions, prefix: str = ""):
        super().__init__()
        check_causal(config)
        head_size = head_size_of(config)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, scale=options.embed_scale)
        layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        if has_rope_per_layer_type(config):
            self.rope_keys = layer_types
            self.rotary_embs = nn.ModuleDict({t: RotaryEmbedding(rope_parameters_from_config(config, head_size, t))
                                              for t in dict.fromkeys(layer_types)})
        else:
            self.rope_keys = ["default"] * config.num_hidden_layers
            self.rotary_embs = nn.ModuleDict({"default": RotaryEmbedding(rope_parameters_from_config(config,
                                                                                                     head_size))})
        self.layers = nn.ModuleList(Gemma2DecoderLayer(config, i, options, prefix)
                                    for i in range(config.num_hidden_layers))
        self.norm = options.norm_cls(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)     # [T, hidden]
        tables = {key: rotary(positions) for key, rotary in self.rotary_embs.items()}   # each ([T, R/2], [T, R/2])
        residual = None
        for key, layer in zip(self.rope_keys, self.layers):
            cos, sin = tables[key]
            hidden, residual = layer(cos, sin, hidden, residual)
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap), in the reference's order of operations; identity when `cap` is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 causal LM: tied embeddings, logits soft-capped at `final_logit_softcapping`."""
    model_cls = Gemma2Model

    @classmethod
    def block_options(cls, config) -> BlockOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return BlockOptions(hidden_act=gemma_activation(config), qkv_bias=bias, o_bias=bias, norm_cls=GemmaRMSNorm,
                            embed_scale=config.hidden_size ** 0.5,
                            query_pre_attn_scalar=getattr(config, "query_pre_attn_scalar", None),
                            attn_logit_softcap=getattr(config, "attn_logit_softcapping", None))

    def stamp_layers_path(self) -> None:
        """Traced whole: a layer's rotary table depends on its type (Gemma 3's local and global layers), which the
        model picks outside the layer, so one layer's graph does not stand for another's."""
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> soft-capped logits [N, vocab] float32."""
        return soft_cap(self.lm_head(hidden), getattr(self.config, "final_logit_softcapping", None))

    def compute_shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary range of the soft-capped logits, [N, R] float32 (the cap is per token)."""
        return soft_cap(self.lm_head.shard_logits(hidden), getattr(self.config, "final_logit_softcapping", None))
