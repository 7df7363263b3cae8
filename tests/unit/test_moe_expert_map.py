"""The MoE kernels with an expert map (expert parallelism: a rank holds some of the experts, global id -> local id
or -1), interpreted on the CPU, against their torch references: the alignment places only the local experts'
slots (uneven loads, a local expert with no tokens, no slot local at all, top_k 1 and 2, a map that is not a
contiguous range); the grouped GEMM and the decode GEMV give each rank's share, and the ranks' shares sum to the
whole layer's output; the `ember::moe` op routes over every expert and runs the local ones on either path.

Tolerances as in tests/unit/test_moe_kernels.py: float32 within 1e-5 s, float16 within 2e-3 s (s = max |ref|)."""

import pytest
import torch

pytest.importorskip("triton")

from ember.kernels import moe_op  # noqa: E402
from ember.kernels.moe_align import align_capacity, align_reference, moe_align  # noqa: E402
from ember.kernels.moe_configs import MoeLaunch  # noqa: E402
from ember.kernels.moe_gemm import moe_reference  # noqa: E402
from ember.kernels.moe_router import route_reference  # noqa: E402
from tests.unit.test_moe_kernels import SMALL_GEMV, SMALL_GROUPED, TOLERANCE, _close, _layer, _uneven_ids  # noqa: E402


def rank_map(num_experts: int, rank: int, ranks: int) -> torch.Tensor:
    """The expert map of rank `rank` of `ranks` holding experts [rank E/N, (rank + 1) E/N)."""
    local = num_experts // ranks
    ids = torch.arange(num_experts, dtype=torch.int32) - rank * local
    return torch.where((ids >= 0) & (ids < local), ids, -1).to(torch.int32)


# ---- alignment ---------------------------------------------------------------------------------------------------
SCATTERED = torch.tensor([-1, 2, -1, 0, 1, -1, -1, -1], dtype=torch.int32)    # experts 3, 4, 1 as local 0, 1, 2


@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m, expert_map", [
    (7, 8, 2, 16, rank_map(8, 0, 2)),      # experts 0-3; expert 1 gets no token: a local expert with none
    (9, 8, 2, 16, rank_map(8, 1, 2)),      # experts 4-7, fewer slots than a block
    (70, 16, 1, 16, rank_map(16, 0, 4)),   # top_k 1, several chunks of 64 slots, a quarter of the experts
    (40, 8, 2, 16, SCATTERED),             # any map, not only a range: local ids in another order
])
def test_alignment_places_only_the_local_experts_slots(num_tokens, num_experts, top_k, block_m, expert_map):
    ids = _uneven_ids(num_tokens, num_experts, top_k, seed=num_tokens)
    local_count = int((expert_map >= 0).sum())
    sorted_slots, block_experts, num_padded = moe_align(ids, local_count, block_m, expert_map)
    ref_slots, ref_blocks, ref_padded = align_reference(ids, local_count, block_m, expert_map)
    local = expert_map[ids.flatten().long()].long()                       # [T * top_k], -1 held elsewhere
    counts = torch.bincount(local[local >= 0], minlength=local_count)
    assert 0 < int((local >= 0).sum()) < ids.numel()                      # some slots here, some elsewhere
    if num_experts == 8 and expert_map[1] == 1:
        assert counts[1] == 0                                             # a local expert with no tokens
    n = int(num_padded)
    assert n == int(ref_padded) == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_slots.shape == (align_capacity(ids.numel(), local_count, block_m),)
    assert torch.equal(sorted_slots[:n], ref_slots[:n]) and torch.equal(block_experts, ref_blocks)
    # exactly the local slots appear, each once, in its local expert's blocks; the padding is the sentinel
    real = sorted_slots[:n][sorted_slots[:n] < ids.numel()].long()
    assert torch.equal(real.sort().values, (local >= 0).nonzero().flatten())
    rows = torch.cat([(sorted_slots[:n] == s).nonzero().flatten() for s in real.tolist()])
    assert torch.equal(block_experts[rows // block_m].long(), local[real])


def test_alignment_of_a_step_whose_slots_are_all_held_elsewhere():
    ids = torch.tensor([[0, 3], [2, 1], [3, 0]], dtype=torch.int32)       # experts 0-3 only
    sorted_slots, block_experts, num_padded = moe_align(ids, 4, 16, rank_map(8, 1, 2))
    assert int(num_padded) == 0 and (block_experts == -1).all()
    assert block_experts.numel() == align_capacity(6, 4, 16) // 16 == 5


# ---- grouped GEMM and decode GEMV --------------------------------------------------------------------------------
def _shares(x, weights, ids, w13, w2, ranks, launch):
    """Each rank's output through the kernels, on its experts [r E/N, (r+1) E/N) and its map."""
    local = w13.shape[0] // ranks
    return [moe_op.fused_experts(x, weights, ids, w13[r * local:(r + 1) * local], w2[r * local:(r + 1) * local],
                                 launch, rank_map(w13.shape[0], r, ranks)) for r in range(ranks)]


@pytest.mark.parametrize("path", ["grouped", "gemv"])
@pytest.mark.parametrize("num_tokens, num_experts, top_k, ranks, dtype", [
    (10, 8, 2, 2, torch.float32),          # uneven loads; expert 1 (rank 0's) gets no token
    (6, 8, 1, 4, torch.float16),           # top_k 1: a token's one slot is on one rank, zero on the others
])
def test_each_ranks_share_matches_the_reference_and_the_shares_sum_to_the_layer(path, num_tokens, num_experts,
                                                                               top_k, ranks, dtype):
    x, w13, w2, weights, ids = _layer(num_tokens, num_experts, top_k, 48, 40, dtype, seed=num_tokens)
    config = SMALL_GROUPED if path == "grouped" else SMALL_GEMV
    shares = _shares(x, weights, ids, w13, w2, ranks, MoeLaunch(path, config, config))
    local = num_experts // ranks
    zero_rows = 0
    for r, share in enumerate(shares):
        expert_map = rank_map(num_experts, r, ranks)
        ref = moe_reference(x, weights, ids, w13[r * local:(r + 1) * local], w2[r * local:(r + 1) * local],
                            expert_map)
        if (expert_map[ids.long()] < 0).all():          # a rank none of whose experts any token chose
            assert torch.equal(share, torch.zeros_like(share)) and torch.equal(ref, share)
        else:
            _close(share, ref, dtype)
        # a token none of whose experts this rank holds gets exactly zero
        none_here = (expert_map[ids.long()] < 0).all(dim=1)
        assert (share[none_here] == 0).all()
        zero_rows += int(none_here.sum())
    assert zero_rows > 0
    whole = moe_reference(x, weights, ids, w13, w2)
    _close(torch.stack([s.float() for s in shares]).sum(0), whole, dtype)    # each rank rounds its share once


@pytest.mark.parametrize("path", ["grouped", "gemv"])
def test_a_rank_that_holds_none_of_the_chosen_experts_outputs_zeros(path):
    x, w13, w2, weights, _ = _layer(3, 8, 2, 48, 40, torch.float32)
    ids = torch.tensor([[0, 3], [2, 1], [3, 0]], dtype=torch.int32)
    config = SMALL_GROUPED if path == "grouped" else SMALL_GEMV
    out = moe_op.fused_experts(x, weights, ids, w13[4:], w2[4:], MoeLaunch(path, config, config), rank_map(8, 1, 2))
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(moe_reference(x, weights, ids, w13[4:], w2[4:], rank_map(8, 1, 2)), out)


# ---- the op ------------------------------------------------------------------------------------------------------
@pytest.fixture
def kernels_on_cpu():
    moe_op.set_moe_kernels("kernels")
    yield
    moe_op.set_moe_kernels("auto")


@pytest.mark.parametrize("num_tokens, path", [(2, "gemv"), (5, "grouped")])
def test_op_routes_over_every_expert_and_runs_the_local_ones(num_tokens, path, kernels_on_cpu):
    """Rank 1 of 2 of a 32-expert layer (16 local): the decode path routes inside its first kernel over all 32
    logits; the grouped path routes with the routing kernel; the residual goes into the decode path's epilogue."""
    g = torch.Generator().manual_seed(7)
    x, logits = torch.randn(num_tokens, 32, generator=g), torch.randn(num_tokens, 32, generator=g)
    w13 = torch.randn(32, 48, 32, generator=g) / 32 ** 0.5
    w2 = torch.randn(32, 32, 24, generator=g) / 24 ** 0.5
    expert_map = rank_map(32, 1, 2)
    weights, ids = route_reference(logits, 2, True)
    ref = moe_reference(x, weights, ids, w13[16:], w2[16:], expert_map)
    residual = torch.randn(num_tokens, 32, generator=g)
    assert moe_op.launch_for(x, w13[16:], 2).path == path     # the constants: decode up to 16 // (4 * 2) tokens
    _close(moe_op.moe(x, logits, w13[16:], w2[16:], 2, True, None, expert_map), ref, torch.float32)
    _close(moe_op.moe(x, logits, w13[16:], w2[16:], 2, True, residual, expert_map), ref + residual, torch.float32)
    moe_op.set_moe_kernels("auto")                            # the CPU default: the reference, with the map
    assert torch.equal(moe_op.moe(x, logits, w13[16:], w2[16:], 2, True, None, expert_map), ref)
    with pytest.raises(ValueError, match=r"the expert map must be \[32\] int32.*got \(16,\) torch.int64"):
        moe_op.set_moe_kernels("kernels")
        moe_op.moe(x, logits, w13[16:], w2[16:], 2, True, None, expert_map[16:].long())


# ---- the code an H100 runs (compiled on the CPU: the interpreter does not check it) ------------------------------
def _sm90_ptx(kernel, dtypes: dict, constexprs: dict) -> str:
    """PTX of `kernel` for an H100 as a launch specialises it: pointers (typed by `dtypes`, else bf16) and the
    integer arguments (sizes and strides, all multiples of 16 in a real layer's shape) marked divisible by 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = kernel.fn
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    constexprs = {**{name: False for name in ("PDL",) if name in names}, **constexprs}
    signature = {name: "constexpr" if name in constexprs else dtypes.get(name, "*bf16") if name.endswith("_ptr")
                 else "i32" for name in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name not in constexprs}
    compiled = triton.compile(ASTSource(fn=triton.runtime.jit.JITFunction(fn), signature=signature,
                                        constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=1))
    return compiled.asm["ptx"]


def test_sm90_decode_gemvs_keep_16_byte_weight_loads_with_the_map():
    """The down GEMV masks the lanes of experts held elsewhere: the mask is uniform along K, so the weight tiles
    still stream as 16-byte loads, as many as without the map (a narrower load would cut the decode path's
    bandwidth); the map itself is a few 4-byte reads a program, in both GEMVs."""
    import re

    from ember.kernels.moe_gemv import _down_gemv_kernel, _gate_up_gemv_kernel
    ints = {"ids_ptr": "*i32", "expert_map_ptr": "*i32", "weights_ptr": "*fp32", "logits_ptr": "*bf16"}
    loads = {}
    for has_map in (False, True):
        down = _sm90_ptx(_down_gemv_kernel, ints, dict(TOP_K=2, K_P2=2, BLOCK_N=16, BLOCK_K=256, EVEN_K=True,
                                                       HAS_RESIDUAL=True, HAS_MAP=has_map))
        gate_up = _sm90_ptx(_gate_up_gemv_kernel, ints, dict(TOP_K=2, BLOCK_N=8, BLOCK_K=256, EVEN_K=True,
                                                             ROUTE=True, E_P2=8, RENORMALIZE=True, HAS_MAP=has_map))
        for name, ptx in (("down", down), ("gate_up", gate_up)):
            found = re.findall(r"ld\.global[^\n;]*", ptx)
            loads[name, has_map] = (sum(".v4." in line for line in found), sum(".v4." not in line for line in found))
    # a K step's weight tiles over 128 threads at 16 bytes a load: down [2, 16, 256] bf16, gate_up 2 x [8, 256]
    assert loads["down", False][0] == loads["down", True][0] == 2 * 16 * 256 * 2 // (128 * 16)
    assert loads["gate_up", False][0] == loads["gate_up", True][0] == 2 * 8 * 256 * 2 // (128 * 16)
    assert loads["down", True][1] > loads["down", False][1] and loads["gate_up", True][1] > loads["gate_up", False][1]


def test_sm90_alignment_compiles_with_the_map():
    from ember.kernels.moe_align import _count_kernel, _scatter_kernel
    ints = {name: "*i32" for name in ("topk_ids_ptr", "expert_map_ptr", "chunk_counts_ptr", "chunk_base_ptr",
                                      "totals_ptr", "sorted_ptr", "block_experts_ptr", "num_padded_ptr")}
    count = _sm90_ptx(_count_kernel, ints, dict(CHUNK=64, E_P2=8, HAS_MAP=True))
    scatter = _sm90_ptx(_scatter_kernel, ints, dict(CHUNK=64, E_P2=8, BLOCK_M=16, BLOCK_TILE=64, HAS_MAP=True))
    # each reads a slot's expert, then the map at it (a gather the unmapped kernels do not have)
    for ptx in (count, scatter):
        assert ptx.count("ld.global") > _sm90_ptx(_count_kernel if ptx is count else _scatter_kernel, ints,
                                                  dict(CHUNK=64, E_P2=8, HAS_MAP=False,
                                                       **({} if ptx is count else dict(BLOCK_M=16, BLOCK_TILE=64)))
                                                  ).count("ld.global")
