"""Mixture-of-experts MLP: a router (a linear layer to one logit per expert) and SiLU-gated experts stored as two
stacked tensors, run together by the `ember::moe` op (ember.kernels.moe_op).

    w13 [E, 2I, H]: expert e's gate rows [0, I) then its up rows [I, 2I)
    w2  [E, H, I]:  expert e's down projection

Checkpoints hold one tensor per expert and projection (`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` in
Qwen3-MoE, `block_sparse_moe.experts.{e}.w1/w3/w2.weight` in Mixtral), or, as transformers 5 holds them in memory,
the stacked `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]. `expert_checkpoint_target` maps
either onto w13 / w2 with a shard id, (expert, 0 | 1) for gate / up and expert for down, which the parameters'
weight loaders place; the loader asks each parameter which of its shards a checkpoint left out.

Under tensor parallelism each rank holds every expert's share of the intermediate dimension, [r I/N, (r+1) I/N):
those rows of each expert's gate and of its up projection in w13 [E, 2I/N, H], the same columns of its down
projection in w2 [E, H, I/N]. The router is replicated, so every rank routes alike; the op runs unchanged on the
slices, and its output, a partial sum on each rank, is all-reduced once, as after a row-parallel linear. Each
parameter's `checkpoint_slice` names the rows (gate / up) or columns (down) a rank reads of an expert's tensor.

Under expert parallelism (`ShardSpec.expert_parallel`) rank r holds whole experts instead, [r E/N, (r+1) E/N), at
full width: w13 [E/N, 2I, H], w2 [E/N, H, I]. The router is replicated and routes over all E experts; the op runs
only the token-slots of the rank's experts (its `expert_map`, global id -> local id or -1) and its output, the
rank's share of the weighted sum, is all-reduced once as under TP. Each parameter's `holds_shard` tells the loader
which per-expert tensors it reads at all (the rank's experts'); a stacked tensor is read by its expert range.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ember.distributed.ops import all_reduce
from ember.distributed.parallel_state import TP_GROUP
from ember.distributed.shard import CheckpointSlice, current_shard, split
from ember.kernels.moe_op import moe
from ember.models.layers.linear import Linear, check_shape, default_weight_loader, make_param
from ember.quant import QuantConfig, QuantConfigError

__all__ = ["FusedMoE", "SparseMoeBlock", "expert_checkpoint_target", "num_experts_of", "refuse_quantized_experts"]

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_STACKED = {"gate_up_proj": "w13", "down_proj": "w2"}


def num_experts_of(config) -> int:
    """The expert count: `num_local_experts` (Mixtral, and Qwen3-MoE as transformers 5 stores it) or
    `num_experts` (Qwen3-MoE's config.json and transformers 4)."""
    count = getattr(config, "num_local_experts", None)
    return int(count if count is not None else getattr(config, "num_experts", 0) or 0)


def expert_checkpoint_target(name: str, projections: dict[str, tuple[str, int | None]]
                             ) -> tuple[str, object] | None:
    """An expert tensor's (parameter name, shard id), or None for any other tensor. `projections` maps a per-expert
    checkpoint name to (w13 or w2, 0 for gate / 1 for up / None for down), e.g. {"w1": ("w13", 0), ...}."""
    match = _PER_EXPERT.match(name)
    if match is not None and match["proj"] in projections:
        param, half = projections[match["proj"]]
        expert = int(match["expert"])
        return f"{match['prefix']}.{param}", expert if half is None else (expert, half)
    prefix, _, leaf = name.rpartition(".")
    if prefix.endswith(".experts") and leaf in _STACKED:
        return f"{prefix}.{_STACKED[leaf]}", None
    return None


class FusedMoE(nn.Module):
    """The experts' weights as two stacked parameters (see the module docstring): this rank's share of each
    expert's intermediate dimension, the whole of it on one rank; or, under expert parallelism, this rank's whole
    experts. `num_experts` and `intermediate_size` are the model's; `self.num_local_experts` (from
    `self.first_expert`) and `self.intermediate_size` this rank's."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        spec = current_shard()
        self.expert_parallel = spec.expert_parallel and spec.size > 1
        if self.expert_parallel:
            if num_experts % spec.size:
                raise ValueError(f"the MoE layer's {num_experts} experts cannot be split evenly over "
                                 f"tensor_parallel_size {spec.size} ranks (enable_expert_parallel); choose a "
                                 f"tensor_parallel_size that divides {num_experts}, or leave expert parallelism off")
            local, experts = intermediate_size, num_experts // spec.size
        else:
            local, experts = split(intermediate_size, spec, "the MoE experts' intermediate size"), num_experts
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, local
        self.num_local_experts, self.first_expert = experts, spec.rank * experts if self.expert_parallel else 0
        self.full_intermediate_size = intermediate_size
        self.first_column = 0 if self.expert_parallel else spec.rank * local
        self.w13 = make_param((experts, 2 * local, hidden_size), self._load_w13)           # [E/N or E, 2I/N or 2I, H]
        self.w2 = make_param((experts, hidden_size, local), self._load_w2)                 # [E/N or E, H, I/N or I]
        mine = range(self.first_expert, self.first_expert + experts)
        self.w13.missing_shards = lambda got: self._missing(got, [(e, h) for e in mine for h in (0, 1)])
        self.w2.missing_shards = lambda got: self._missing(got, list(mine))
        self.register_buffer("expert_map", None, persistent=False)     # [E] int32 under expert parallelism
        if self.expert_parallel:
            self.w13.holds_shard = lambda shard_id: shard_id is None or shard_id[0] in mine
            self.w2.holds_shard = lambda shard_id: shard_id is None or shard_id in mine
            self.w13.checkpoint_slice = self.w2.checkpoint_slice = self._experts_slice
        elif spec.size > 1:
            self.w13.checkpoint_slice = self._w13_slice
            self.w2.checkpoint_slice = self._w2_slice

    def init_buffers(self, device: torch.device) -> None:
        """Under expert parallelism, the map from the model's expert ids to this rank's (-1: held elsewhere)."""
        if self.expert_parallel:
            ids = torch.arange(self.num_experts, dtype=torch.int32) - self.first_expert                 # [E]
            held = (ids >= 0) & (ids < self.num_local_experts)
            self.expert_map = torch.where(held, ids, -1).to(device=device, dtype=torch.int32)

    def _experts_slice(self, shard_id) -> CheckpointSlice | None:
        """Under expert parallelism: an expert's own tensor is read whole; a stacked one by this rank's experts."""
        if shard_id is not None:
            return None
        return CheckpointSlice(0, self.first_expert, self.num_local_experts, self.num_experts)

    def _slice(self, dim: int) -> CheckpointSlice:
        return CheckpointSlice(dim, self.first_column, self.intermediate_size, self.full_intermediate_size)

    def _w13_slice(self, shard_id) -> CheckpointSlice | None:
        """An expert's gate or up projection [I, H]: this rank's rows. A stacked gate_up [E, 2I, H] is read whole
        (this rank's rows of both halves are two ranges) and narrowed by the loader."""
        return None if shard_id is None else self._slice(0)

    def _w2_slice(self, shard_id) -> CheckpointSlice:
        """An expert's down projection [H, I], or the stacked [E, H, I]: this rank's columns."""
        return self._slice(1 if shard_id is not None else 2)

    def _expert(self, expert: int) -> int:
        """The local index of the model's expert `expert`."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range for {self.num_experts} experts")
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            raise ValueError(f"expert {expert} is not one of this rank's experts [{self.first_expert}, "
                             f"{self.first_expert + self.num_local_experts})")
        return local

    def _my_experts(self, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a stacked tensor handed whole (as it is otherwise)."""
        if self.num_local_experts == self.num_experts or loaded.shape[0] != self.num_experts:
            return loaded
        return loaded.narrow(0, self.first_expert, self.num_local_experts)

    def _mine(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's range of the intermediate dimension `dim` of a tensor handed whole (as it is)."""
        full, size = self.full_intermediate_size, self.intermediate_size
        if full == size or loaded.dim() <= dim or loaded.shape[dim] != full:
            return loaded
        return loaded.narrow(dim, self.first_column, size)

    def _load_w13(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            loaded, full = self._my_experts(loaded), self.full_intermediate_size
            if full != self.intermediate_size and loaded.dim() == 3 and loaded.shape[1] == 2 * full:
                loaded = torch.cat([self._mine(loaded[:, :full], 1), self._mine(loaded[:, full:], 1)], dim=1)
            default_weight_loader(param, loaded)
            return
        expert, half = shard_id
        size = self.intermediate_size
        target = param.data[self._expert(expert)].narrow(0, half * size, size)                       # [I/N or I, H]
        loaded = self._mine(loaded, 0)
        check_shape(param, loaded, target.shape)
        target.copy_(loaded)

    def _load_w2(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            default_weight_loader(param, self._mine(self._my_experts(loaded), 2))
            return
        target = param.data[self._expert(shard_id)]                                                  # [H, I/N or I]
        loaded = self._mine(loaded, 1)
        check_shape(param, loaded, target.shape)
        target.copy_(loaded)

    @staticmethod
    def _missing(got: set, expected: list) -> list[str]:
        names = {0: "gate", 1: "up"}
        return [f"expert {s[0]}'s {names[s[1]]} projection" if isinstance(s, tuple) else f"expert {s}"
                for s in expected if s not in got]

    def extra_repr(self) -> str:
        shard = "" if self.intermediate_size == self.full_intermediate_size else f" of {self.full_intermediate_size}"
        experts = (f"{self.num_experts}" if not self.expert_parallel else
                   f"[{self.first_expert}, {self.first_expert + self.num_local_experts}) of {self.num_experts}")
        return f"experts={experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}{shard}"


class SparseMoeBlock(nn.Module):
    """router -> top_k experts per token -> their outputs summed with the routing weights (renormalised to sum to
    one where `renormalize`). Under tensor parallelism the router is replicated and the experts hold this rank's
    share of the intermediate dimension, or under expert parallelism this rank's whole experts: either way the op's
    output is a partial sum, all-reduced once here, before the residual add (which then stays outside the op: the
    residual_epilogue pass folds it only into an op it directly follows)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 hidden_act: str = "silu"):
        super().__init__()
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"MoE experts with hidden_act {hidden_act!r} are not supported; ember's MoE kernels "
                             f"fuse SiLU (silu / swish)")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {num_experts}")
        self.top_k, self.renormalize = int(top_k), bool(renormalize)
        self.tp_size = current_shard().size
        self.gate = Linear(hidden_size, num_experts)           # a plain Linear: whole on every rank
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size)

    def expected_experts(self, num_tokens: int) -> float:
        """Distinct experts `num_tokens` tokens choose: top_k for one token; for more, the expectation under
        uniform routing (each expert is missed by a token with probability 1 - top_k / E)."""
        num_experts = self.experts.num_experts
        if num_tokens <= 1:
            return float(self.top_k * num_tokens)
        return num_experts * (1.0 - (1.0 - self.top_k / num_experts) ** num_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        experts = self.experts
        out = moe(x, self.gate(x), experts.w13, experts.w2, self.top_k, self.renormalize, None, experts.expert_map)
        return out if self.tp_size == 1 else all_reduce(out, TP_GROUP)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, renormalize={self.renormalize}"


def refuse_quantized_experts(model: nn.Module, quant: QuantConfig) -> None:
    """The MoE kernels take bf16 / fp16 / fp32 experts: refuse fp8 experts (a checkpoint's, or quantization="fp8"
    at load) before any weight is read, rather than leave them in another format than asked. The model names its
    experts' checkpoint modules (`expert_module_name`)."""
    for name, module in model.named_modules():
        if not isinstance(module, FusedMoE):
            continue
        if quant.quantizes(model.expert_module_name(name)):
            how = ("quantization='fp8' would quantize them at load" if quant.online
                   else f"the checkpoint's {quant.source} quantization_config covers them")
            raise QuantConfigError(f"fp8 MoE experts are not supported yet ({how}); run the experts in bf16: a "
                                   f"checkpoint without fp8 experts, and no quantization='fp8'")

