"""Mixtral: Mistral's attention (a sliding window on every layer where the config sets one) with a sparse MoE MLP
on every layer, its top-k routing weights always renormalised."""

from __future__ import annotations

from torch import nn

from ember.models.layers.moe import SparseMoeBlock, expert_checkpoint_target, num_experts_of
from ember.models.llama import BlockOptions, LlamaDecoderLayer, LlamaModel, MistralForCausalLM

_EXPERT_PROJECTIONS = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}


class MixtralDecoderLayer(LlamaDecoderLayer):
    """A Mistral block whose MLP is the sparse MoE block (`mlp` here, `block_sparse_moe` in checkpoints)."""

    def make_mlp(self, config, layer_idx: int, options: BlockOptions) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, num_experts_of(config), config.num_experts_per_tok,
                              config.intermediate_size, renormalize=True, hidden_act=config.hidden_act)


class MixtralModel(LlamaModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(MistralForCausalLM):
    """Mixtral causal LM (Mixtral-8x7B, 8x22B)."""
    model_cls = MixtralModel

    @staticmethod
    def expert_module_name(experts: str) -> str:
        """The checkpoint module of the first expert's first projection under the experts module `experts`."""
        return f"{experts.replace('.mlp.', '.block_sparse_moe.')}.0.w1"

    @staticmethod
    def checkpoint_target(name: str):
        """A tensor of the MoE block as (parameter, shard id), the block named `mlp` as transformers 5 names it;
        None for the tensors `packed_modules` maps."""
        renamed = name.replace(".block_sparse_moe.", ".mlp.")
        target = expert_checkpoint_target(renamed, _EXPERT_PROJECTIONS)
        return (renamed, None) if target is None and renamed != name else target
