"""The MoE decode path: a few tokens read only their chosen experts' weights, once per token-slot, with no
alignment, in three launches (`routed_moe_gemv`): the routing (ember.kernels.moe_router), then the two below.

    gate_up: grid (slot, block of I columns): act[slot] = silu(x[token] @ w13[e, :I]^T) * (x[token] @ w13[e, I:]^T)
    down:    grid (token, block of H columns): out[token] = sum over k of weight[k] * (act[slot k] @ w2[e_k]^T)

Decode is bound by the weight reads, so both kernels are GEMVs on CUDA cores that stream W tiles contiguous along
K (16-byte loads) and keep float32 products in a register tile summed once after the K loop (as ember's dense GEMV
does). The expert comes from `topk_ids` on the device; the grid depends on the token count alone. The down kernel
loads the tiles of all top_k experts of its token at once ([top_k, BLOCK_N, BLOCK_K]): more bytes in flight per
program, and the weighted top_k sum happens in registers, so nothing is written between the expert outputs and
the layer's output. Roundings are those of ember.kernels.moe_gemm, and so are the experts' biases and the clamped
SwiGLU (gpt-oss): the gate_up kernel adds b13 [E, 2I] and applies the activation in its epilogue, the down kernel
adds each lane's b2 [E, H] row before the routing weight (constexpr switches: without them the kernels are as before).

Under expert parallelism (`expert_map` [E] int32, global id -> local id or -1) the routing stays global, over all E
router logits; a slot whose expert is held elsewhere reads no weights (its gate_up program returns, the down kernel
masks its lane), so its contribution to the token's sum is zero, and each rank's output is its share of the sum.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ember.kernels.interpret import interpreted
from ember.kernels.moe_gemm import gated_activation
from ember.kernels.moe_router import route
from ember.kernels.pdl import gdc_launch_dependents, gdc_wait

__all__ = ["moe_gemv", "routed_moe_gemv", "set_route_first"]

# the routing in a launch of its own (ember.kernels.moe_router) before the gate_up kernel, or in every gate_up
# program (EMBER_MOE_ROUTE=fold, an A/B switch): folded, each of a Qwen3-30B-A3B step's 1,536 programs ran the
# softmax and 8 rounds of top-1 (43 barriers) before its first weight load; on an H200 batch-1 decode went from
# 331-342 to 352 tok/s with the launch of its own
_route_first = os.environ.get("EMBER_MOE_ROUTE", "kernel") != "fold"


def set_route_first(on: bool) -> None:
    """Route in a launch of its own before the gate_up kernel (True, the default) or inside it (False)."""
    global _route_first
    _route_first = bool(on)


@triton.jit
def _gate_up_gemv_kernel(x_ptr, w_ptr, bias_ptr, logits_ptr, ids_ptr, weights_ptr, expert_map_ptr, out_ptr, N, K,
                         num_experts, stride_xm, stride_lm, stride_we, stride_wn, stride_be, stride_om, swiglu_limit,
                         TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                         ROUTE: tl.constexpr, E_P2: tl.constexpr, RENORMALIZE: tl.constexpr,
                         HAS_MAP: tl.constexpr = False, PDL: tl.constexpr = False, HAS_BIAS13: tl.constexpr = False,
                         SWIGLU: tl.constexpr = False):
    """out[slot, n block] = silu(gate) * up for one token-slot; N is the expert's intermediate size.
    HAS_BIAS13: the expert's gate and up biases added to the sums; SWIGLU: the clamped SwiGLU instead of SiLU.

    ROUTE: the slot's expert comes from the token's router logits (softmax, top-k, renormalise: the arithmetic of
    ember.kernels.moe_router, redone by every program of the token, which costs a few reductions over E values),
    and the programs of column block 0 store each slot's expert and weight for the down kernel. Else from ids.
    HAS_MAP: the (global) expert through the expert map; a slot of an expert held elsewhere stores nothing.
    PDL: launched as a programmatic dependent; every input but the weights comes from the kernels before, and the
    weights to read depend on the routing, so it waits first, then lets the next kernel's programs start."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    slot = tl.program_id(0)
    token = slot // TOP_K
    if ROUTE:
        experts = tl.arange(0, E_P2)
        expert_ok = experts < num_experts
        raw = tl.load(logits_ptr + token.to(tl.int64) * stride_lm + experts, mask=expert_ok, other=0.0)
        logits = tl.where(expert_ok, raw.to(tl.float32), -1e30)
        exps = tl.exp(logits - tl.reduce(logits, 0, tl.standard._elementwise_max))
        probs = tl.where(expert_ok, exps / tl.reduce(exps, 0, tl.standard._sum_combine), -1.0)
        picked = 0.0
        mine = 0.0
        expert = 0
        for k in tl.static_range(TOP_K):
            best = tl.reduce(probs, 0, tl.standard._elementwise_max)
            index = tl.reduce(tl.where(probs == best, experts, E_P2), 0, tl.standard._elementwise_min)
            index = tl.minimum(index, num_experts - 1)
            picked += best
            mine = tl.where(slot % TOP_K == k, best, mine)
            expert = tl.where(slot % TOP_K == k, index, expert)
            probs = tl.where(experts == index, -1.0, probs)
        if RENORMALIZE:
            mine = mine / picked
        if tl.program_id(1) == 0:
            tl.store(ids_ptr + slot, expert.to(tl.int32))
            tl.store(weights_ptr + slot, mine.to(raw.dtype).to(tl.float32))
        expert = expert.to(tl.int64)
    else:
        expert = tl.load(ids_ptr + slot).to(tl.int64)
    if HAS_MAP:
        expert = tl.load(expert_map_ptr + expert).to(tl.int64)
        if expert < 0:
            return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # columns past N re-read row N - 1 instead of masking (unpredicated, vectorised loads); never stored
    w_ptrs = w_ptr + expert * stride_we + tl.minimum(cols, N - 1)[:, None] * stride_wn + ks[None, :]   # [BN, BK]
    up_offset = N * stride_wn
    x_ptrs = x_ptr + token.to(tl.int64) * stride_xm + ks                                            # [BK]
    acc_gate = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
    acc_up = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs).to(tl.float32)
            w_gate = tl.load(w_ptrs)
            w_up = tl.load(w_ptrs + up_offset)
        else:
            k_ok = k + ks < K
            x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            w_gate = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            w_up = tl.load(w_ptrs + up_offset, mask=k_ok[None, :], other=0.0)
        acc_gate += w_gate.to(tl.float32) * x[None, :]
        acc_up += w_up.to(tl.float32) * x[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    gate = tl.reduce(acc_gate, 1, tl.standard._sum_combine)
    up = tl.reduce(acc_up, 1, tl.standard._sum_combine)
    if HAS_BIAS13:
        bias_ptrs = bias_ptr + expert * stride_be + tl.minimum(cols, N - 1)
        gate += tl.load(bias_ptrs).to(tl.float32)
        up += tl.load(bias_ptrs + N).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = gated_activation(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype, SWIGLU, swiglu_limit)
    tl.store(out_ptr + slot.to(tl.int64) * stride_om + cols, act, mask=cols < N)


@triton.jit
def _down_gemv_kernel(a_ptr, w_ptr, bias_ptr, ids_ptr, weights_ptr, expert_map_ptr, residual_ptr, out_ptr, N, K,
                      stride_am, stride_we, stride_wn, stride_be, stride_rm, stride_om, TOP_K: tl.constexpr,
                      K_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      HAS_RESIDUAL: tl.constexpr, HAS_MAP: tl.constexpr = False, PDL: tl.constexpr = False,
                      HAS_BIAS2: tl.constexpr = False):
    """out[token, n block] = the weighted sum over the token's TOP_K slots (+ the residual, added to the rounded
    sum and rounded again, as the unfused add); N is the hidden size. HAS_MAP: over the slots whose expert this
    rank holds (the others' lanes load nothing and add zero). PDL: as the gate_up kernel. HAS_BIAS2: each lane's
    expert output plus its expert's bias, before the routing weight."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    lanes = tl.arange(0, K_P2)
    lane_ok = lanes < TOP_K
    slots = token * TOP_K + tl.minimum(lanes, TOP_K - 1)                                           # [K_P2]
    experts = tl.load(ids_ptr + slots).to(tl.int64)
    if HAS_MAP:
        experts = tl.load(expert_map_ptr + experts).to(tl.int64)
        lane_ok = lane_ok & (experts >= 0)
        experts = tl.where(lane_ok, experts, 0)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = (w_ptr + experts[:, None, None] * stride_we + tl.minimum(cols, N - 1)[None, :, None] * stride_wn
              + ks[None, None, :])                                                                 # [K_P2, BN, BK]
    a_ptrs = a_ptr + slots[:, None, None].to(tl.int64) * stride_am + ks[None, None, :]              # [K_P2, 1, BK]
    acc = tl.full((K_P2, BLOCK_N, BLOCK_K), 0.0, tl.float32)
    for k in range(0, K, BLOCK_K):
        if HAS_MAP:          # a lane of an expert held elsewhere reads nothing (its act row was never written)
            k_ok = lane_ok[:, None, None]
            if not EVEN_K:
                k_ok = k_ok & (k + ks < K)[None, None, :]
            a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=k_ok, other=0.0)
        elif EVEN_K:
            a = tl.load(a_ptrs).to(tl.float32)
            w = tl.load(w_ptrs)
        else:
            k_ok = (k + ks < K)[None, None, :]
            a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * a
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = tl.reduce(acc, 2, tl.standard._sum_combine)                                                # [K_P2, BN]
    if HAS_BIAS2:        # a lane held elsewhere reads expert 0's row (a valid address) and is masked in the sum
        y += tl.load(bias_ptr + experts[:, None] * stride_be + tl.minimum(cols, N - 1)[None, :]).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    y = y.to(dtype).to(tl.float32)
    routing = tl.load(weights_ptr + slots, mask=lane_ok, other=0.0)                                # [K_P2]
    weighted = (y * routing[:, None]).to(dtype).to(tl.float32)
    total = tl.reduce(tl.where(lane_ok[:, None], weighted, 0.0), 0, tl.standard._sum_combine)      # [BN]
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + token.to(tl.int64) * stride_rm + cols, mask=cols < N, other=0.0)
        total = total.to(dtype).to(tl.float32) + residual.to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * stride_om + cols, total.to(dtype), mask=cols < N)


def _kernel(kernel, device: torch.device):
    return interpreted(kernel) if device.type == "cpu" else kernel


def _launch_gate_up(x, w13, logits, ids, weights, expert_map, act, config, top_k, renormalize, options, b13,
                    swiglu_limit) -> None:
    num_slots, intermediate = act.shape
    hidden = w13.shape[2]
    route = logits is not None
    num_experts = logits.shape[1] if route else w13.shape[0]      # the routing's: every expert of the model
    _kernel(_gate_up_gemv_kernel, x.device)[(num_slots, triton.cdiv(intermediate, config["BLOCK_N"]))](
        x, w13, w13 if b13 is None else b13, logits if route else x, ids, weights,
        expert_map if expert_map is not None else ids, act, intermediate, hidden, num_experts, x.stride(0),
        logits.stride(0) if route else 0, w13.stride(0), w13.stride(1), 0 if b13 is None else b13.stride(0),
        act.stride(0), float(swiglu_limit), TOP_K=top_k, BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
        EVEN_K=hidden % config["BLOCK_K"] == 0, ROUTE=route, E_P2=triton.next_power_of_2(num_experts),
        RENORMALIZE=renormalize, HAS_MAP=expert_map is not None, HAS_BIAS13=b13 is not None,
        SWIGLU=swiglu_limit > 0, num_warps=config["num_warps"], **options)


def _launch_down(act, w2, ids, weights, expert_map, out, config, top_k, residual, options, b2) -> None:
    num_tokens, hidden = out.shape
    intermediate = w2.shape[2]
    _kernel(_down_gemv_kernel, act.device)[(num_tokens, triton.cdiv(hidden, config["BLOCK_N"]))](
        act, w2, w2 if b2 is None else b2, ids, weights, expert_map if expert_map is not None else ids,
        residual if residual is not None else out, out, hidden, intermediate, act.stride(0), w2.stride(0),
        w2.stride(1), 0 if b2 is None else b2.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0), TOP_K=top_k,
        K_P2=triton.next_power_of_2(top_k), BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
        EVEN_K=intermediate % config["BLOCK_K"] == 0, HAS_RESIDUAL=residual is not None,
        HAS_MAP=expert_map is not None, HAS_BIAS2=b2 is not None, num_warps=config["num_warps"], **options)


def moe_gemv(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
             w2: torch.Tensor, gate_up_config: dict, down_config: dict, launch_options: dict | None = None,
             expert_map: torch.Tensor | None = None, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
             swiglu_limit: float = 0.0) -> torch.Tensor:
    """x [T, H] through each token's top_k experts (w13 [E, 2I, H], w2 [E, H, I]), weighted and summed -> [T, H];
    configs: BLOCK_N, BLOCK_K, num_warps (each kernel its own); launch_options: e.g. PDL=True, launch_pdl=True.
    With `expert_map` [E_global] int32 (global id -> local id or -1) only the slots of local experts are summed;
    b13 [E, 2I], b2 [E, H] and `swiglu_limit` > 0 as in ember.kernels.moe_gemm."""
    num_tokens, top_k = topk_ids.shape
    act = torch.empty(num_tokens * top_k, w13.shape[1] // 2, dtype=x.dtype, device=x.device)     # [T * top_k, I]
    out = torch.empty(num_tokens, w13.shape[2], dtype=x.dtype, device=x.device)                  # [T, H]
    options = launch_options or {}
    _launch_gate_up(x, w13, None, topk_ids, topk_weights, expert_map, act, gate_up_config, top_k, False, options,
                    b13, swiglu_limit)
    _launch_down(act, w2, topk_ids, topk_weights, expert_map, out, down_config, top_k, None, options, b2)
    return out


def routed_moe_gemv(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                    renormalize: bool, gate_up_config: dict, down_config: dict,
                    residual: torch.Tensor | None = None, launch_options: dict | None = None,
                    expert_map: torch.Tensor | None = None, b13: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None, swiglu_limit: float = 0.0) -> torch.Tensor:
    """`moe_gemv` from the router logits: the routing kernel first (ember.kernels.moe_router), or the same
    arithmetic inside the gate_up kernel (`set_route_first(False)`). router_logits [T, E] -> [T, H], plus
    `residual` [T, H] when given; with `expert_map`, this rank's share (router_logits cover every expert, w13 / w2
    the local ones); biases and `swiglu_limit` as `moe_gemv`."""
    num_tokens = x.shape[0]
    act = torch.empty(num_tokens * top_k, w13.shape[1] // 2, dtype=x.dtype, device=x.device)     # [T * top_k, I]
    out = torch.empty(num_tokens, w13.shape[2], dtype=x.dtype, device=x.device)                  # [T, H]
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    options = launch_options or {}
    if _route_first:
        weights, ids = route(logits, top_k, renormalize, options)
        _launch_gate_up(x, w13, None, ids, weights, expert_map, act, gate_up_config, top_k, False, options, b13,
                        swiglu_limit)
    else:       # the gate_up kernel's programs of column block 0 store each slot's expert and weight
        ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)                 # [T, top_k]
        weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)           # [T, top_k]
        _launch_gate_up(x, w13, logits, ids, weights, expert_map, act, gate_up_config, top_k, renormalize, options,
                        b13, swiglu_limit)
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    _launch_down(act, w2, ids, weights, expert_map, out, down_config, top_k, residual, options, b2)
    return out
