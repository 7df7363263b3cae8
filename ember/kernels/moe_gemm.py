"""The grouped MoE GEMM: every expert's tokens in one launch per projection, over the aligned layout of
ember.kernels.moe_align (slots sorted by expert, each expert's run padded to BLOCK_M rows).

    gate_up: act[row] = silu(x[token] @ w13[e, :I]^T) * (x[token] @ w13[e, I:]^T)    row of the aligned layout
    down:    out2[slot] = topk_weight[slot] * (act[row] @ w2[e]^T)                    back in slot order
    sum:     out[token] = sum over k of out2[token * top_k + k]

Each program owns a BLOCK_M x BLOCK_N tile of one expert (the block's expert from `block_experts`; a block past the
rows in use returns at once, so the grid is fixed by the token count and CUDA graphs capture it). The gate_up
program keeps two accumulators, the gate columns and the matching up columns, and writes SiLU(gate) * up: the
[rows, 2I] projection is never stored. The down program gathers nothing (its rows are the layout's), scales by the
routing weight and scatters each row to its slot; padding rows (the sentinel slot) are neither read nor stored.
Row blocks go in groups of GROUP_M over the same column blocks, so an expert's weight tiles are reused from L2.

Under expert parallelism the layout holds only the slots of the rank's experts (`moe_align`'s expert map) and
`block_experts` indexes the local w13 / w2; the down GEMM then writes only those slots' rows, and the rows of slots
held elsewhere are zeros (`moe_down(..., zero_rows=True)`), so the top_k sum is the rank's share.

Experts with biases (gpt-oss): `b13` [E, 2I] (gate biases, then up biases) and `b2` [E, H] are added to the float32
sums of their projections, before the projection's rounding; the down bias of a row's expert comes before the
routing weight. `swiglu_limit` > 0 swaps SiLU(gate) * up for gpt-oss's clamped SwiGLU, in float32 and rounded once:
g = min(gate, limit), u = clamp(up, -limit, limit), act = (u + 1) * g * sigmoid(SWIGLU_ALPHA * g). Each is a
constexpr switch (HAS_BIAS13, HAS_BIAS2, SWIGLU), so the kernels without them compile as before.

Roundings follow the model's ops: each projection rounds once to the activation dtype, SiLU and the product round
as torch's ops do, the weighted output rounds once, and the top_k sum runs in float32 and rounds once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.interpret import interpreted
from ember.kernels.moe_align import local_expert_ids

__all__ = ["SWIGLU_ALPHA", "moe_down", "moe_gate_up", "moe_reference"]

SWIGLU_ALPHA = tl.constexpr(1.702)      # gpt-oss's clamped SwiGLU: the slope inside its sigmoid


@triton.jit
def gated_activation(gate, up, dtype: tl.constexpr, SWIGLU: tl.constexpr, swiglu_limit):
    """The stored activation (in `dtype`) of float32 gate and up tiles, each rounded as its projection is:
    silu(gate) * up with torch's roundings, or (SWIGLU) gpt-oss's clamped SwiGLU in float32, rounded once."""
    if SWIGLU:
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
        return ((up + 1.0) * gate / (1.0 + tl.exp(gate * -SWIGLU_ALPHA))).to(dtype)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@triton.jit
def _expert_block(pid, N, num_blocks, block_experts_ptr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block, its expert or -1) of program `pid`: GROUP_M row blocks take each column block in
    turn, so programs that run together share weight tiles."""
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    in_group = GROUP_M * num_n
    first_m = pid // in_group * GROUP_M
    group_rows = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    return pid_m, pid_n, tl.load(block_experts_ptr + pid_m).to(tl.int64)


@triton.jit
def _block_rows(pid_m, sorted_ptr, num_slots, BLOCK_M: tl.constexpr):
    """(rows [BLOCK_M], their slots, which slots are real) of row block `pid_m`."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + rows)
    return rows, slots, slots < num_slots


# counts that follow the step's token count stay out of the specialization key (Triton would compile a count
# of 1 or a multiple of 16 apart), so one compile serves every bucket
@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def _gate_up_kernel(x_ptr, w_ptr, bias_ptr, sorted_ptr, block_experts_ptr, out_ptr,
                    num_slots, N, K, num_blocks, stride_xm, stride_we, stride_wn, stride_be, stride_om,
                    swiglu_limit, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                    IEEE_DOT: tl.constexpr, HAS_BIAS13: tl.constexpr = False, SWIGLU: tl.constexpr = False):
    """out[row, n block] = silu(gate) * up of one expert's BLOCK_M rows; N is the expert's intermediate size.
    HAS_BIAS13: the expert's gate and up biases added to the sums; SWIGLU: the clamped SwiGLU instead."""
    pid_m, pid_n, expert = _expert_block(tl.program_id(0), N, num_blocks, block_experts_ptr, BLOCK_N, GROUP_M)
    if expert < 0:
        return
    rows, slots, row_ok = _block_rows(pid_m, sorted_ptr, num_slots, BLOCK_M)
    tokens = tl.where(row_ok, slots // TOP_K, 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None].to(tl.int64) * stride_xm + ks[None, :]                      # [BM, BK]
    w_ptrs = w_ptr + expert * stride_we + tl.where(col_ok, cols, 0)[None, :] * stride_wn + ks[:, None]   # [BK, BN]
    up_offset = N * stride_wn
    acc_gate = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            w_gate = tl.load(w_ptrs)
            w_up = tl.load(w_ptrs + up_offset)
        else:
            k_ok = k + ks < K
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_gate = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            w_up = tl.load(w_ptrs + up_offset, mask=k_ok[:, None], other=0.0)
        if DOT_IN_FP32:   # the interpreter's tl.dot multiplies bfloat16 bit patterns as integers
            x, w_gate, w_up = x.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
        if IEEE_DOT:
            acc_gate = tl.dot(x, w_gate, acc_gate, input_precision="ieee")
            acc_up = tl.dot(x, w_up, acc_up, input_precision="ieee")
        else:
            acc_gate = tl.dot(x, w_gate, acc_gate)
            acc_up = tl.dot(x, w_up, acc_up)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS13:
        bias_ptrs = bias_ptr + expert * stride_be + cols
        acc_gate += tl.load(bias_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias_ptrs + N, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    act = gated_activation(acc_gate.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32), dtype, SWIGLU,
                           swiglu_limit)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], act,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def _down_kernel(a_ptr, w_ptr, bias_ptr, sorted_ptr, block_experts_ptr, weights_ptr, out_ptr,
                 num_slots, N, K, num_blocks, stride_am, stride_we, stride_wn, stride_be, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 EVEN_K: tl.constexpr, DOT_IN_FP32: tl.constexpr, IEEE_DOT: tl.constexpr,
                 HAS_BIAS2: tl.constexpr = False):
    """out[slot, n block] = weight[slot] * (a[row] @ w[e]^T (+ bias[e], HAS_BIAS2)) for one expert's BLOCK_M rows;
    N is the hidden size."""
    pid_m, pid_n, expert = _expert_block(tl.program_id(0), N, num_blocks, block_experts_ptr, BLOCK_N, GROUP_M)
    if expert < 0:
        return
    rows, slots, row_ok = _block_rows(pid_m, sorted_ptr, num_slots, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]                       # [BM, BK]
    w_ptrs = w_ptr + expert * stride_we + tl.where(col_ok, cols, 0)[None, :] * stride_wn + ks[:, None]   # [BK, BN]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = k + ks < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if DOT_IN_FP32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        if IEEE_DOT:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS2:
        acc += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    routing = tl.load(weights_ptr + slots, mask=row_ok, other=0.0)
    out = (acc.to(dtype).to(tl.float32) * routing[:, None]).to(dtype)
    tl.store(out_ptr + tl.where(row_ok, slots, 0)[:, None].to(tl.int64) * stride_om + cols[None, :], out,
             mask=row_ok[:, None] & col_ok[None, :])


def _kernel(kernel, device: torch.device):
    return interpreted(kernel) if device.type == "cpu" else kernel


def _dot_flags(x: torch.Tensor) -> dict:
    cpu = x.device.type == "cpu"
    return dict(DOT_IN_FP32=cpu, IEEE_DOT=cpu or x.dtype == torch.float32)


def moe_gate_up(x: torch.Tensor, w13: torch.Tensor, sorted_slots: torch.Tensor, block_experts: torch.Tensor,
                top_k: int, config: dict, b13: torch.Tensor | None = None, swiglu_limit: float = 0.0
                ) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] -> act [capacity, I]: silu(gate) * up of each aligned row (padding rows unset);
    with `b13` [E, 2I] the projection's biases, with `swiglu_limit` > 0 the clamped SwiGLU."""
    num_experts, two_i, hidden = w13.shape
    intermediate = two_i // 2
    act = torch.empty(sorted_slots.shape[0], intermediate, dtype=x.dtype, device=x.device)   # [capacity, I]
    num_blocks = block_experts.shape[0]
    grid = (num_blocks * triton.cdiv(intermediate, config["BLOCK_N"]),)
    _kernel(_gate_up_kernel, x.device)[grid](
        x, w13, w13 if b13 is None else b13, sorted_slots, block_experts, act, x.shape[0] * top_k, intermediate,
        hidden, num_blocks, x.stride(0), w13.stride(0), w13.stride(1), 0 if b13 is None else b13.stride(0),
        act.stride(0), float(swiglu_limit), TOP_K=top_k,
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], GROUP_M=config["GROUP_M"],
        EVEN_K=hidden % config["BLOCK_K"] == 0, **_dot_flags(x), HAS_BIAS13=b13 is not None,
        SWIGLU=swiglu_limit > 0, num_warps=config["num_warps"], num_stages=config["num_stages"])
    return act


def moe_down(act: torch.Tensor, w2: torch.Tensor, sorted_slots: torch.Tensor, block_experts: torch.Tensor,
             topk_weights: torch.Tensor, config: dict, zero_rows: bool = False, b2: torch.Tensor | None = None
             ) -> torch.Tensor:
    """act [capacity, I], w2 [E, H, I] -> out2 [T * top_k, H]: each slot's expert output (plus its expert's bias
    `b2` [E, H]) times its weight; `zero_rows`: the rows of slots the layout leaves out (experts held elsewhere)
    are zeros, not unset."""
    num_experts, hidden, intermediate = w2.shape
    num_slots = topk_weights.numel()
    alloc = torch.zeros if zero_rows else torch.empty
    out = alloc(num_slots, hidden, dtype=act.dtype, device=act.device)                          # [T * top_k, H]
    num_blocks = block_experts.shape[0]
    grid = (num_blocks * triton.cdiv(hidden, config["BLOCK_N"]),)
    _kernel(_down_kernel, act.device)[grid](
        act, w2, w2 if b2 is None else b2, sorted_slots, block_experts, topk_weights, out, num_slots, hidden,
        intermediate, num_blocks, act.stride(0), w2.stride(0), w2.stride(1), 0 if b2 is None else b2.stride(0),
        out.stride(0), BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
        GROUP_M=config["GROUP_M"], EVEN_K=intermediate % config["BLOCK_K"] == 0, **_dot_flags(act),
        HAS_BIAS2=b2 is not None,
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    return out


def moe_reference(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, expert_map: torch.Tensor | None = None, b13: torch.Tensor | None = None,
                  b2: torch.Tensor | None = None, swiglu_limit: float = 0.0) -> torch.Tensor:
    """The same with torch ops, a loop over the experts that were chosen, with the kernels' roundings; with
    `expert_map` (global id -> local id of w13 / w2, or -1), over the slots of local experts only; biases and the
    clamped SwiGLU as the module docstring says."""
    num_tokens, top_k = topk_ids.shape
    intermediate = w13.shape[1] // 2
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)            # [T, H]
    flat_ids = local_expert_ids(topk_ids, expert_map)
    placed = flat_ids >= 0
    order = torch.argsort(torch.where(placed, flat_ids, w13.shape[0]), stable=True)            # held elsewhere: last
    counts = torch.bincount(flat_ids[placed], minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start:start + count]
        start += count
        tokens = slots // top_k
        gate_up = _projection(x[tokens], w13[expert], None if b13 is None else b13[expert])     # [n, 2I]
        gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
        if swiglu_limit > 0:
            act = swiglu_reference(gate.float(), up.float(), swiglu_limit).to(x.dtype)
        else:
            act = torch.nn.functional.silu(gate) * up
        y = _projection(act, w2[expert], None if b2 is None else b2[expert])                   # [n, H]
        weighted = (y.float() * topk_weights.flatten()[slots, None]).to(x.dtype)
        out.index_add_(0, tokens, weighted.float())
    return out.to(x.dtype)


def _projection(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w^T rounded once to x's dtype, the bias added in float32 before the rounding."""
    if bias is None:
        return x @ w.t()
    return torch.addmm(bias.float(), x.float(), w.float().t()).to(x.dtype)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of float32 gate and up."""
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(SWIGLU_ALPHA.value * gate)
