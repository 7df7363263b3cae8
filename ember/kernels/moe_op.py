"""`ember::moe`: a mixture-of-experts MLP as one op that dynamo traces (a fake gives its output's shape), so the
pieces around it compile with fullgraph=True and FULL CUDA graphs capture it in decode buckets.

    moe(hidden [T, H], router_logits [T, E], w13 [E, 2I, H], w2 [E, H, I], top_k, renormalize, residual,
        expert_map, b13 [E, 2I], b2 [E, H], swiglu_limit) -> [T, H]

Experts with biases (gpt-oss) pass b13 (the gate_up projection's, gate biases then up biases) and / or b2 (the down
projection's, added before the routing weight); `swiglu_limit` > 0 runs gpt-oss's clamped SwiGLU instead of SiLU
(ember.kernels.moe_gemm says how). Under tensor parallelism the caller passes b2 on one rank only.

Under expert parallelism w13 / w2 hold the rank's E_local experts and `expert_map` [E] int32 maps each of the
model's experts to its local id or -1: the routing is over all E logits, only the local experts' slots run, and
the output is the rank's share of the weighted sum (zero for a token none of whose experts are local).

On CUDA, by the launch table (ember.kernels.moe_configs) for the token count, either the decode path that reads
only the chosen experts (ember.kernels.moe_gemv: the routing (softmax, top-k, renormalise), then two GEMV launches),
or the routing kernel (ember.kernels.moe_router), the alignment and the grouped GEMM (ember.kernels.moe_align
and moe_gemm: one, three and two launches) and the top_k sum. The token count is fixed in a graph bucket, so capture
and replay choose alike. Elsewhere the op runs the torch reference (a loop over the chosen experts), unless
`set_moe_kernels("kernels")` sends CPU tensors through the interpreted kernels (tests).
"""

from __future__ import annotations

import torch

from ember.kernels.library import define, register_fake
from ember.kernels.moe_align import moe_align
from ember.kernels.moe_configs import MoeLaunch, MoeShape, moe_launch
from ember.kernels.moe_gemm import moe_down, moe_gate_up, moe_reference
from ember.kernels.moe_gemv import moe_gemv, routed_moe_gemv
from ember.kernels.moe_router import route, route_reference
from ember.kernels.pdl import pdl_options

__all__ = ["DTYPES", "fused_experts", "moe", "moe_kernels", "set_moe_kernels"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CPU_SMS = 4          # "SMs" under the interpreter, for the launch shapes

_mode = "auto"


def set_moe_kernels(mode: str) -> None:
    """"auto" (the default): the Triton kernels on CUDA, the torch reference elsewhere; "kernels": the kernels on
    every device (interpreted for CPU tensors); "reference": the torch reference everywhere (A/B runs; it reads the
    expert counts back to the host, so not under CUDA graphs: run eager)."""
    global _mode
    if mode not in ("auto", "kernels", "reference"):
        raise ValueError(f"MoE kernel mode {mode!r} is not one of 'auto', 'kernels', 'reference'")
    _mode = mode


def moe_kernels(device: torch.device) -> bool:
    """Whether `ember::moe` runs the Triton kernels for tensors on `device` (see set_moe_kernels)."""
    return _mode == "kernels" or (_mode == "auto" and device.type == "cuda")


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_for(x: torch.Tensor, w13: torch.Tensor, top_k: int) -> MoeLaunch:
    """The path and launch shapes the op takes for these tensors."""
    num_experts, two_i, hidden = w13.shape
    return moe_launch(MoeShape(x.shape[0], num_experts, hidden, two_i // 2, top_k, x.element_size(),
                               _num_sms(x.device)))


def fused_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, launch: MoeLaunch | None = None, expert_map: torch.Tensor | None = None,
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, swiglu_limit: float = 0.0
                  ) -> torch.Tensor:
    """x [T, H] through each token's chosen experts (topk_ids [T, top_k] int32, topk_weights [T, top_k] float32),
    weighted and summed -> [T, H], with the kernels (interpreted for CPU tensors). `launch` overrides the table;
    `expert_map` (global id -> local id or -1): the slots of local experts only; biases and `swiglu_limit` as
    the op takes them."""
    num_tokens, top_k = topk_ids.shape
    launch = launch or launch_for(x, w13, top_k)
    if launch.path == "gemv":
        return moe_gemv(x, topk_weights, topk_ids, w13, w2, launch.gate_up, launch.down, pdl_options(x.device),
                        expert_map, b13, b2, swiglu_limit)
    if launch.gate_up["BLOCK_M"] != launch.down["BLOCK_M"]:
        raise ValueError(f"the two grouped GEMMs must share BLOCK_M (the alignment's block), got "
                         f"{launch.gate_up['BLOCK_M']} and {launch.down['BLOCK_M']}")
    sorted_slots, block_experts, _ = moe_align(topk_ids, w13.shape[0], launch.gate_up["BLOCK_M"], expert_map)
    act = moe_gate_up(x, w13, sorted_slots, block_experts, top_k, launch.gate_up, b13, swiglu_limit)  # [cap, I]
    out = moe_down(act, w2, sorted_slots, block_experts, topk_weights, launch.down,       # [T * top_k, H]
                   zero_rows=expert_map is not None, b2=b2)
    return out if top_k == 1 else out.view(num_tokens, top_k, -1).sum(dim=1)


def _check_bias(w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None, b2: torch.Tensor | None,
                swiglu_limit: float) -> None:
    local, two_i, _ = w13.shape
    if b13 is not None and (b13.shape != (local, two_i) or b13.dtype != w13.dtype):
        raise ValueError(f"the gate_up bias b13 must be [{local}, {two_i}] {w13.dtype} (one row per expert of w13, "
                         f"gate biases then up biases), got {tuple(b13.shape)} {b13.dtype}")
    if b2 is not None and (b2.shape != (local, w2.shape[1]) or b2.dtype != w2.dtype):
        raise ValueError(f"the down bias b2 must be [{local}, {w2.shape[1]}] {w2.dtype} (one row per expert of w2), "
                         f"got {tuple(b2.shape)} {b2.dtype}")
    if not swiglu_limit >= 0:
        raise ValueError(f"swiglu_limit must be 0 (SiLU) or the positive clamp of gpt-oss's SwiGLU, got "
                         f"{swiglu_limit}")


def _check(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
           residual: torch.Tensor | None, expert_map: torch.Tensor | None) -> None:
    num_tokens, size = hidden.shape
    local, two_i, h = w13.shape
    num_experts = router_logits.shape[-1] if expert_map is not None else local
    if (h != size or w2.shape != (local, size, two_i // 2) or router_logits.shape != (num_tokens, num_experts)
            or two_i % 2):
        raise ValueError(f"moe needs hidden [T, H], router_logits [T, E], w13 [E, 2I, H] and w2 [E, H, I]; got "
                         f"{tuple(hidden.shape)}, {tuple(router_logits.shape)}, {tuple(w13.shape)}, "
                         f"{tuple(w2.shape)}")
    if expert_map is not None and (expert_map.shape != (num_experts,) or expert_map.dtype != torch.int32):
        raise ValueError(f"the expert map must be [{num_experts}] int32 (one local id or -1 for each of the router's "
                         f"experts), got {tuple(expert_map.shape)} {expert_map.dtype}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be between 1 and the {num_experts} experts, got {top_k}")
    if residual is not None and (residual.shape != hidden.shape or residual.dtype != hidden.dtype):
        raise ValueError(f"the residual must be {tuple(hidden.shape)} {hidden.dtype}, got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    if hidden.dtype not in DTYPES or w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(f"the MoE kernels take bfloat16, float16 or float32 activations and weights of one dtype, "
                         f"got {hidden.dtype}, {w13.dtype} and {w2.dtype}")


@define("moe")
def _moe_op(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
            renormalize: bool, residual: torch.Tensor | None = None, expert_map: torch.Tensor | None = None,
            b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, swiglu_limit: float = 0.0
            ) -> torch.Tensor:
    """A sparse MoE MLP with SiLU-gated experts (or gpt-oss's, with biases): the kernels or the torch reference
    (see set_moe_kernels); with `residual` [T, H], the output plus it, rounded as the unfused add rounds; with
    `expert_map`, this rank's share (the module docstring)."""
    _check_bias(w13, w2, b13, b2, swiglu_limit)
    if not moe_kernels(hidden.device):
        topk_weights, topk_ids = route_reference(router_logits, top_k, renormalize)
        out = moe_reference(hidden, topk_weights, topk_ids, w13, w2, expert_map, b13, b2, swiglu_limit)
        return out if residual is None else out + residual
    _check(hidden, router_logits, w13, w2, top_k, residual, expert_map)
    if hidden.shape[0] == 0:
        return hidden.new_empty(hidden.shape)
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    b13 = b13 if b13 is None or b13.stride(1) == 1 else b13.contiguous()
    b2 = b2 if b2 is None or b2.stride(1) == 1 else b2.contiguous()
    launch = launch_for(hidden, w13, top_k)
    if launch.path == "gemv":          # routing, then two GEMVs, the residual in the second's epilogue
        return routed_moe_gemv(hidden, router_logits, w13, w2, top_k, renormalize, launch.gate_up, launch.down,
                               residual, pdl_options(hidden.device), expert_map, b13, b2, swiglu_limit)
    topk_weights, topk_ids = route(router_logits, top_k, renormalize)
    out = fused_experts(hidden, topk_weights, topk_ids, w13, w2, launch, expert_map, b13, b2, swiglu_limit)
    return out if residual is None else out + residual


@register_fake("moe")
def _moe_fake(hidden, router_logits, w13, w2, top_k, renormalize, residual=None, expert_map=None, b13=None, b2=None,
              swiglu_limit=0.0):
    return hidden.new_empty(hidden.shape)


def moe(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
        renormalize: bool, residual: torch.Tensor | None = None, expert_map: torch.Tensor | None = None,
        b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, swiglu_limit: float = 0.0
        ) -> torch.Tensor:
    """hidden [T, H] -> [T, H] (plus `residual`) through `ember::moe` (the module docstring). Models call it
    without a residual; the residual_epilogue pass folds the add after it in. `expert_map` only where a rank holds
    a share of the experts (the call is then as without it, plus the map); the biases and `swiglu_limit` only
    where the experts have them (the call is then as without them, plus every argument)."""
    if b13 is not None or b2 is not None or swiglu_limit != 0.0:
        return torch.ops.ember.moe(hidden, router_logits, w13, w2, top_k, renormalize, residual, expert_map, b13, b2,
                                   float(swiglu_limit))
    if expert_map is None:
        return torch.ops.ember.moe(hidden, router_logits, w13, w2, top_k, renormalize, residual)
    return torch.ops.ember.moe(hidden, router_logits, w13, w2, top_k, renormalize, residual, expert_map)
