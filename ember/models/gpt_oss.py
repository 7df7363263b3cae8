"""gpt-oss (`GptOssForCausalLM`): Llama-shaped blocks with biased q/k/v/o projections, a learned attention sink per
query head, a sliding window on the layers `layer_types` marks "sliding_attention", yarn rotary, and a mixture of
experts on every layer:

- the router is a biased linear layer; a token's weights are the softmax of its top-k logits, the same numbers as
  a softmax over every expert renormalised over the top k (so `ember::moe` routes with renormalize=True);
- the experts carry biases on both projections and a clamped SwiGLU,
      act = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),   g = min(gate, limit),
  which `ember::moe` runs with its bias and `swiglu_limit` arguments (alpha fixed at the released 1.702).

Checkpoints hold transformers' layout: the experts stacked as `experts.gate_up_proj` [E, H, 2I] with gate and up
interleaved along the last dim (gate at the even columns), `experts.gate_up_proj_bias` [E, 2I] likewise,
`experts.down_proj` [E, I, H] and `experts.down_proj_bias` [E, H]. The loaders de-interleave and transpose them
into ember's w13 [E, 2I, H] / b13 [E, 2I] (gate rows first) and w2 [E, H, I]. The released checkpoints keep the
two projections in MXFP4 (`quant_method: "mxfp4"`): `gate_up_proj_blocks` [E, 2I, H/32, 16] and `_scales`
[E, 2I, H/32] (`down_proj_*` likewise over I), 32 values a block as e2m1 codes, two a byte (the low nibble first),
scaled by the block's e8m0 exponent. They are dequantized when both halves of a projection have been read, into
the layout above, then loaded as a bf16 checkpoint's tensor would be: the experts run in the model's dtype.

Under tensor parallelism the attention splits its heads (the sinks with them) as Llama's does, and the experts
their intermediate dimension; the down projection's bias is added on rank 0 only, before the all-reduce sums the
ranks' shares. Under expert parallelism each rank holds whole experts and adds the biases of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.distributed.ops import all_reduce
from ember.distributed.parallel_state import TP_GROUP
from ember.distributed.shard import CheckpointSlice, current_shard
from ember.kernels.moe_gemm import SWIGLU_ALPHA
from ember.kernels.moe_op import moe
from ember.models.layers.linear import Linear, check_shape, default_weight_loader, make_param
from ember.models.layers.moe import FusedMoE, SparseMoeBlock, num_experts_of
from ember.models.llama import BlockOptions, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

__all__ = ["GptOssExperts", "GptOssForCausalLM", "GptOssMoeBlock", "dequantize_mxfp4"]

# e2m1 (FP4) by code: sign bit 3, then two exponent bits and one mantissa bit
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_PARTS = ("blocks", "scales")      # the shard ids of an MXFP4 projection's two checkpoint tensors

_EXPERT_TENSORS = {"gate_up_proj": "w13", "gate_up_proj_bias": "b13", "down_proj": "w2", "down_proj_bias": "b2"}


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
                     ) -> torch.Tensor:
    """blocks [E, rows, G, 16] uint8 (32 e2m1 codes a block, two a byte, the low nibble first), scales
    [E, rows, G] uint8 (the block's e8m0 exponent, 2 ** (s - 127)) -> [E, G * 32, rows] in `dtype`: the projection
    as an unquantized gpt-oss checkpoint holds it (its input dim before its rows). An expert at a time, so the
    temporaries stay one expert's size (a 120b projection's codes would take 17 GB at once). The values are exact
    in bfloat16 and float32 (two significant bits times a power of two)."""
    if blocks.dim() != 4 or blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1] != 16 \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks must be uint8 [E, rows, G, 16] and scales uint8 [E, rows, G], got "
                         f"{blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    experts, rows, groups, _ = blocks.shape
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    out = torch.empty(experts, groups * 32, rows, dtype=dtype, device=blocks.device)          # [E, K, rows]
    for e in range(experts):
        codes = torch.stack([blocks[e] & 0x0F, blocks[e] >> 4], dim=-1).long()           # [rows, G, 16, 2]
        values = torch.ldexp(lut[codes].flatten(-2), scales[e].to(torch.int32)[..., None] - 127)   # [rows, G, 32]
        out[e] = values.flatten(-2).t()
    return out


class GptOssExperts(FusedMoE):
    """`FusedMoE` with the experts' biases (b13 [E, 2I] laid out as w13's rows, b2 [E, H]) and loaders for the
    stacked, interleaved checkpoint layout (the module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__(num_experts, hidden_size, intermediate_size)
        experts, local = self.num_local_experts, self.intermediate_size
        self.b13 = make_param((experts, 2 * local), self._load_b13)          # [E/N or E, 2I/N or 2I]
        self.b2 = make_param((experts, hidden_size), self._load_b2)          # [E/N or E, H]
        # MXFP4 checkpoints: each projection in two tensors (MXFP4_PARTS), held until both are read
        self._mxfp4: dict[str, dict[str, torch.Tensor]] = {}
        for param in (self.w13, self.w2):
            param.casts_itself = True               # uint8 blocks and scales arrive as stored; the rest is copied
            param.missing_shards = self._missing_parts
        if self.expert_parallel:
            every = CheckpointSlice(0, self.first_expert, self.num_local_experts, self.num_experts)
            for param in (self.w13, self.w2, self.b13, self.b2):    # stacked, whole or in parts: this rank's experts
                param.checkpoint_slice = lambda shard_id, every=every: every
                param.holds_shard = lambda shard_id: True
        elif current_shard().size > 1:
            # read whole and narrowed after dequantizing, or (down_proj [E, I, H]) this rank's rows I
            self.w13.checkpoint_slice = lambda shard_id: None
            self.w2.checkpoint_slice = lambda shard_id: self._slice(1) if shard_id is None else None

    @staticmethod
    def _missing_parts(got: set) -> list[str]:
        """What a checkpoint left out of a projection it did not hold whole: the MXFP4 parts it lacks, or all."""
        return [f"its MXFP4 {part}" for part in MXFP4_PARTS if part not in got] if got else ["the stacked tensor"]

    def _whole(self, which: str, loaded: torch.Tensor, shard_id) -> torch.Tensor | None:
        """The projection's unquantized tensor: `loaded` itself, or once both MXFP4 parts are in, their
        dequantization (None until then)."""
        if shard_id is None:
            return loaded
        if shard_id not in MXFP4_PARTS:
            raise ValueError(f"gpt-oss checkpoints stack their experts; got expert shard {shard_id}")
        parts = self._mxfp4.setdefault(which, {})
        parts[shard_id] = loaded
        if len(parts) < len(MXFP4_PARTS):
            return None
        del self._mxfp4[which]
        return dequantize_mxfp4(parts["blocks"], parts["scales"], self.w13.dtype)

    def _stacked(self, loaded: torch.Tensor, what: str, dims: int) -> torch.Tensor:
        if loaded.dim() != dims:
            raise ValueError(f"gpt-oss {what} must be stacked over the experts with {dims} dims, got shape "
                             f"{tuple(loaded.shape)}")
        return self._my_experts(loaded)

    def _gate_up(self, loaded: torch.Tensor) -> torch.Tensor:
        """[E, ..., 2I] with gate and up interleaved on the last dim -> [E, ..., 2I/N]: this rank's gate columns,
        then its up columns."""
        if loaded.shape[-1] != 2 * self.full_intermediate_size:
            raise ValueError(f"gpt-oss gate_up tensors end in 2 x {self.full_intermediate_size} (gate and up "
                             f"interleaved), got shape {tuple(loaded.shape)}")
        last = loaded.dim() - 1
        gate, up = loaded[..., 0::2], loaded[..., 1::2]
        return torch.cat([self._mine(gate, last), self._mine(up, last)], dim=last)

    def _load_w13(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        loaded = self._whole("w13", loaded, shard_id)
        if loaded is None:
            return
        loaded = self._gate_up(self._stacked(loaded, "gate_up_proj", 3))          # [E, H, 2I/N]
        default_weight_loader(param, loaded.transpose(1, 2))                       # [E, 2I/N, H]

    def _load_w2(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        loaded = self._whole("w2", loaded, shard_id)
        if loaded is None:
            return
        loaded = self._mine(self._stacked(loaded, "down_proj", 3), 1)              # [E, I/N, H]
        default_weight_loader(param, loaded.transpose(1, 2))                       # [E, H, I/N]

    def _load_b13(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, self._gate_up(self._stacked(loaded, "gate_up_proj_bias", 2)))

    def _load_b2(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        loaded = self._stacked(loaded, "down_proj_bias", 2)
        check_shape(param, loaded, param.shape)
        param.data.copy_(loaded)


class GptOssMoeBlock(nn.Module):
    """router (biased, replicated) -> top_k experts -> their biased, clamped-SwiGLU outputs summed with the softmax
    of the top-k logits; all-reduced once under tensor or expert parallelism."""

    def __init__(self, config):
        super().__init__()
        num_experts, top_k = num_experts_of(config), int(config.num_experts_per_tok)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_local_experts {num_experts}")
        alpha = float(getattr(config, "swiglu_alpha", SWIGLU_ALPHA.value))
        if alpha != SWIGLU_ALPHA.value:
            raise ValueError(f"swiglu_alpha {alpha} is not supported: ember's MoE kernels fix the activation's "
                             f"sigmoid scale at {SWIGLU_ALPHA.value}, the value of every released gpt-oss")
        self.swiglu_limit = float(config.swiglu_limit)
        if not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be positive, got {config.swiglu_limit}")
        self.top_k = top_k
        spec = current_shard()
        self.tp_size = spec.size
        # the down bias once in the ranks' sum: rank 0's share carries it (expert parallelism: every rank its own
        # experts')
        self.adds_down_bias = spec.rank == 0 or (spec.expert_parallel and spec.size > 1)
        self.router = Linear(config.hidden_size, num_experts, bias=True)
        self.experts = GptOssExperts(num_experts, config.hidden_size, config.intermediate_size)

    expected_experts = SparseMoeBlock.expected_experts     # what a step reads, for the bench's roofline

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        e = self.experts
        out = moe(x, self.router(x), e.w13, e.w2, self.top_k, True, None, e.expert_map, e.b13,
                  e.b2 if self.adds_down_bias else None, self.swiglu_limit)
        return out if self.tp_size == 1 else all_reduce(out, TP_GROUP)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, swiglu_limit={self.swiglu_limit}"


class GptOssDecoderLayer(LlamaDecoderLayer):
    """A pre-norm block (sinks in its attention: `BlockOptions.attn_sinks`) with the gpt-oss MoE as its MLP."""

    def make_mlp(self, config, layer_idx: int, options: BlockOptions) -> nn.Module:
        return GptOssMoeBlock(config)


class GptOssModel(LlamaModel):
    layer_cls = GptOssDecoderLayer


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss causal LM (gpt-oss-20b, gpt-oss-120b) from a bf16 checkpoint."""
    model_cls = GptOssModel

    @classmethod
    def block_options(cls, config) -> BlockOptions:
        bias = bool(getattr(config, "attention_bias", True))
        return BlockOptions(hidden_act="silu", qkv_bias=bias, o_bias=bias, attn_sinks=True)

    @staticmethod
    def expert_module_name(experts: str) -> str:
        """The checkpoint module of the experts' first projection under the experts module `experts`."""
        return f"{experts}.gate_up_proj"

    @staticmethod
    def checkpoint_target(name: str):
        """The ember parameter of a sink or an expert tensor (shard id None: stacked); None for the others."""
        prefix, _, leaf = name.rpartition(".")
        if leaf == "sinks" and prefix.endswith(".self_attn"):
            return f"{prefix}.attn.sinks", None
        if prefix.endswith(".experts") and leaf in _EXPERT_TENSORS:
            return f"{prefix}.{_EXPERT_TENSORS[leaf]}", None
        projection, _, part = leaf.rpartition("_")
        if prefix.endswith(".experts") and part in MXFP4_PARTS and projection in ("gate_up_proj", "down_proj"):
            return f"{prefix}.{_EXPERT_TENSORS[projection]}", part
        return None

