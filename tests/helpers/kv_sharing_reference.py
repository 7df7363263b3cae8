"""A transformers Llama whose last layers attend with an earlier layer's keys and values, as Gemma 3n's KV-sharing
layers do: the reference for ember's `num_kv_shared_layers` on Llama-family configs."""

from __future__ import annotations

import types


def share_kv_in_hf(model, targets: dict[int, int]) -> None:
    """Patch each attention of `model` (a transformers LlamaForCausalLM, eager attention) so that layer i in
    `targets` computes only its queries and attends over layer targets[i]'s keys and values of the same forward
    (after that layer's cache update, so generation with a cache works too)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

    shared: dict[int, tuple] = {}
    sources = set(targets.values())

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        cos, sin = position_embeddings
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if self.layer_idx in targets:
            query, _ = apply_rotary_pos_emb(query, query, cos, sin)
            key, value = shared[targets[self.layer_idx]]
        else:
            key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
            if past_key_values is not None:
                key, value = past_key_values.update(key, value, self.layer_idx)
            if self.layer_idx in sources:
                shared[self.layer_idx] = (key, value)
        out, weights = eager_attention_forward(self, query, key, value, attention_mask, dropout=0.0,
                                               scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights

    for layer in model.model.layers:
        layer.self_attn.forward = types.MethodType(forward, layer.self_attn)
