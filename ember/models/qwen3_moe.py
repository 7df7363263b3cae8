"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm) with a sparse MoE MLP on the layers `decoder_sparse_step` picks,
less those in `mlp_only_layers`, which keep a dense MLP of `intermediate_size`."""

from __future__ import annotations

from torch import nn

from ember.models.layers.moe import SparseMoeBlock, expert_checkpoint_target, num_experts_of
from ember.models.llama import BlockOptions, LlamaDecoderLayer, LlamaMLP, LlamaModel
from ember.models.qwen3 import Qwen3ForCausalLM

_EXPERT_PROJECTIONS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Whether layer `layer_idx` has experts (as transformers' Qwen3-MoE decides it)."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return layer_idx not in mlp_only and num_experts_of(config) > 0 and (layer_idx + 1) % step == 0


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    """A Qwen3 block whose MLP is sparse or dense by layer index."""

    def make_mlp(self, config, layer_idx: int, options: BlockOptions) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config.hidden_size, config.intermediate_size, options)
        return SparseMoeBlock(config.hidden_size, num_experts_of(config), config.num_experts_per_tok,
                              config.moe_intermediate_size, bool(getattr(config, "norm_topk_prob", False)),
                              config.hidden_act)


class Qwen3MoeModel(LlamaModel):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE causal LM (Qwen3-30B-A3B, Qwen3-235B-A22B)."""
    model_cls = Qwen3MoeModel

    def __init__(self, config, prefix: str = ""):
        if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
            raise ValueError(f"Qwen3-MoE with use_sliding_window=True (window {config.sliding_window}) is not "
                             f"supported: released Qwen3-MoE checkpoints attend over the full context; set "
                             f"use_sliding_window to false in config.json")
        super().__init__(config, prefix)

    @staticmethod
    def expert_module_name(experts: str) -> str:
        """The checkpoint module of the first expert's first projection under the experts module `experts`."""
        return f"{experts}.0.gate_proj"

    @staticmethod
    def checkpoint_target(name: str):
        """An expert tensor's (parameter, shard id); None for the tensors `packed_modules` maps."""
        return expert_checkpoint_target(name, _EXPERT_PROJECTIONS)
