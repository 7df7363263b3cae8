"""MoE routing: softmax over the router's logits, the top_k experts, and their weights renormalised to sum to one
where the model says so (Mixtral always; Qwen3-MoE by `norm_topk_prob`). One program takes BLOCK_T tokens' rows of
logits; the top k come out by k rounds of "largest left, lowest index on a tie", in descending order, as torch.topk
gives them. The weights are rounded through the logits' dtype, as the models' reference code rounds them before it
scales each expert's output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.interpret import interpreted
from ember.kernels.pdl import gdc_launch_dependents, gdc_wait

__all__ = ["route", "route_reference"]

BLOCK_T = 4          # tokens per program


# counts that follow the step's token count stay out of the specialization key (Triton would compile a count
# of 1 or a multiple of 16 apart), so one compile serves every bucket
@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_t, TOP_K: tl.constexpr,
                  K_P2: tl.constexpr, E_P2: tl.constexpr, BLOCK_T: tl.constexpr, RENORMALIZE: tl.constexpr,
                  PDL: tl.constexpr = False):
    """weights [T, TOP_K] float32 and ids [T, TOP_K] int32 of BLOCK_T tokens. PDL: launched as a programmatic
    dependent (the logits come from the kernel before); the next kernel's programs may start at once, as they
    wait for this one's outputs."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, E_P2)
    token_ok = tokens < num_tokens
    mask = token_ok[:, None] & (experts < num_experts)[None, :]
    raw = tl.load(logits_ptr + tokens[:, None].to(tl.int64) * stride_t + experts[None, :], mask=mask,
                  other=0.0)                                                      # [BLOCK_T, E_P2]
    logits = tl.where(mask, raw.to(tl.float32), -1e30)     # finite: a padding row's softmax stays a number
    peak = tl.reduce(logits, 1, tl.standard._elementwise_max)
    exps = tl.exp(logits - peak[:, None])
    probs = exps / tl.reduce(exps, 1, tl.standard._sum_combine)[:, None]
    probs = tl.where(mask, probs, -1.0)                                            # never chosen
    lanes = tl.arange(0, K_P2)
    top_weights = tl.full((BLOCK_T, K_P2), 0.0, tl.float32)
    top_ids = tl.full((BLOCK_T, K_P2), 0, tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.reduce(probs, 1, tl.standard._elementwise_max)                   # [BLOCK_T]
        index = tl.reduce(tl.where(probs == best[:, None], experts[None, :], E_P2), 1,
                          tl.standard._elementwise_min)
        index = tl.minimum(index, num_experts - 1)    # a NaN row matches nothing: keep the id a valid expert
        top_weights = tl.where(lanes[None, :] == k, best[:, None], top_weights)
        top_ids = tl.where(lanes[None, :] == k, index[:, None], top_ids)
        probs = tl.where(experts[None, :] == index[:, None], -1.0, probs)
    if RENORMALIZE:
        top_weights = top_weights / tl.reduce(top_weights, 1, tl.standard._sum_combine)[:, None]
    offsets = tokens[:, None] * TOP_K + lanes[None, :]                             # [BLOCK_T, K_P2]
    kept = token_ok[:, None] & (lanes[None, :] < TOP_K)
    tl.store(weights_ptr + offsets, top_weights.to(raw.dtype).to(tl.float32), mask=kept)
    tl.store(ids_ptr + offsets, top_ids, mask=kept)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, launch_options: dict | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, top_k] float32, expert ids [T, top_k] int32), one launch;
    launch_options: e.g. PDL=True, launch_pdl=True (ember.kernels.pdl)."""
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be between 1 and the {num_experts} experts, got {top_k}")
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)   # [T, top_k]
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)         # [T, top_k]
    kernel = interpreted(_route_kernel) if logits.device.type == "cpu" else _route_kernel
    kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        logits, weights, ids, num_tokens, num_experts, logits.stride(0), TOP_K=top_k,
        K_P2=triton.next_power_of_2(top_k), E_P2=triton.next_power_of_2(num_experts), BLOCK_T=BLOCK_T,
        RENORMALIZE=renormalize, **(launch_options or {}))
    return weights, ids


def route_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same with torch ops: softmax in float32, torch.topk, renormalise, round through the logits' dtype."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype).float(), ids.to(torch.int32)
