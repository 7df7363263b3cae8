"""The MoE kernels (ember/kernels/moe_*.py) on the CPU, interpreted, against their torch references: routing,
token-to-expert alignment, the grouped GEMM and the decode GEMV, with uneven expert loads, an expert with no tokens,
top_k 1, 2 and 8 and padded rows; the `ember::moe` op on either path; the launch table.

CPU tensors run an interpreted copy of the kernels whatever TRITON_INTERPRET says at import time. Tolerances,
relative to the output scale s = max |reference|: float32 within 1e-5 s (the order of float32 sums differs);
float16 within 2e-3 s (a few float16 ulps: the kernels and the reference round the same intermediates, but each
projection's float32 sum can land on either side of a rounding boundary)."""

import json

import pytest
import torch

pytest.importorskip("triton")

from ember.kernels import moe_configs as MC  # noqa: E402
from ember.kernels import moe_op  # noqa: E402
from ember.kernels.moe_align import align_capacity, align_reference, moe_align  # noqa: E402
from ember.kernels.moe_configs import MoeLaunch, MoeShape  # noqa: E402
from ember.kernels.moe_gemm import moe_down, moe_gate_up, moe_reference  # noqa: E402
from ember.kernels.moe_router import route, route_reference  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
SMALL_GROUPED = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2)
SMALL_GEMV = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4)


def _uneven_ids(num_tokens: int, num_experts: int, top_k: int, seed: int) -> torch.Tensor:
    """[T, top_k] int32, distinct experts per token, skewed so loads are uneven, and expert 1 never chosen."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.linspace(4.0, 0.5, num_experts)
    weights[1] = 0.0
    rows = [torch.multinomial(weights, top_k, replacement=False, generator=g) for _ in range(num_tokens)]
    return torch.stack(rows).to(torch.int32)


def _layer(num_tokens, num_experts, top_k, hidden, intermediate, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)                                       # [T, H]
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate ** 0.5).to(dtype)
    ids = _uneven_ids(num_tokens, num_experts, top_k, seed)
    weights = torch.rand(num_tokens, top_k, generator=g)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype).float()
    return x, w13, w2, weights, ids


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    scale = ref.float().abs().max().item()
    assert scale > 0.1
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOLERANCE[dtype] * scale, (err, scale)


# ---- alignment ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m", [
    (1, 128, 8, 16),      # one decode token of Qwen3-30B-A3B's shape
    (7, 8, 2, 16),        # Mixtral's routing, fewer slots than a block
    (70, 16, 8, 16),      # several chunks of 64 slots: chunk bases carry across programs
    (150, 4, 1, 32),      # top_k 1, long runs per expert
])
def test_alignment_equals_the_stable_sort(num_tokens, num_experts, top_k, block_m):
    ids = _uneven_ids(num_tokens, num_experts, top_k, seed=num_tokens)
    sorted_slots, block_experts, num_padded = moe_align(ids, num_experts, block_m)
    ref_slots, ref_blocks, ref_padded = align_reference(ids, num_experts, block_m)
    n = int(num_padded)
    counts = torch.bincount(ids.flatten().long(), minlength=num_experts)
    assert counts[1] == 0                                                  # an expert with no tokens
    assert num_tokens == 1 or counts.max() > counts[counts > 0].min()     # uneven loads
    assert n == int(ref_padded) == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_slots.shape == (align_capacity(ids.numel(), num_experts, block_m),) and n <= sorted_slots.numel()
    assert torch.equal(sorted_slots[:n], ref_slots[:n])
    assert torch.equal(block_experts, ref_blocks)
    # every slot appears once; the padding holds the sentinel T * top_k
    real = sorted_slots[:n][sorted_slots[:n] < ids.numel()]
    assert torch.equal(real.sort().values, torch.arange(ids.numel(), dtype=torch.int32))
    assert int((sorted_slots[:n] == ids.numel()).sum()) == n - ids.numel()


def test_alignment_capacity_is_the_worst_case():
    # every expert non-empty with one slot each: each pads block_m - 1 rows
    ids = torch.arange(8, dtype=torch.int32).view(4, 2)
    _, block_experts, num_padded = moe_align(ids, 8, 16)
    assert int(num_padded) == 8 * 16 == align_capacity(8, 8, 16)
    assert block_experts.tolist() == list(range(8))
    assert align_capacity(3, 128, 16) == 48      # only min(E, slots) experts can be non-empty


# ---- routing -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_tokens, num_experts, top_k, renormalize, dtype", [
    (1, 128, 8, True, torch.float32), (9, 8, 2, True, torch.float16), (6, 60, 6, False, torch.float32),
    (5, 4, 1, False, torch.float32)])
def test_routing_matches_softmax_topk(num_tokens, num_experts, top_k, renormalize, dtype):
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(top_k)).to(dtype)
    weights, ids = route(logits, top_k, renormalize)
    ref_weights, ref_ids = route_reference(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and torch.equal(ids, ref_ids)
    assert (weights - ref_weights).abs().max().item() <= (1e-6 if dtype == torch.float32 else 1e-3)
    if renormalize:
        assert torch.allclose(weights.sum(-1), torch.ones(num_tokens), atol=2e-3)


# ---- grouped GEMM and decode GEMV --------------------------------------------------------------------------------
@pytest.mark.parametrize("num_tokens, num_experts, top_k, hidden, intermediate, dtype", [
    (12, 8, 2, 64, 48, torch.float32),     # 48: the last column block of gate_up is partial
    (6, 16, 8, 64, 32, torch.float16),
    (9, 4, 1, 40, 24, torch.float16),      # 40: K is not a multiple of BLOCK_K (masked tail)
])
def test_grouped_gemm_matches_the_expert_loop(num_tokens, num_experts, top_k, hidden, intermediate, dtype):
    x, w13, w2, weights, ids = _layer(num_tokens, num_experts, top_k, hidden, intermediate, dtype)
    ref = moe_reference(x, weights, ids, w13, w2)
    sorted_slots, block_experts, num_padded = moe_align(ids, num_experts, SMALL_GROUPED["BLOCK_M"])
    assert int(num_padded) > ids.numel()                 # padded rows are in the layout
    act = moe_gate_up(x, w13, sorted_slots, block_experts, top_k, SMALL_GROUPED)
    # each real row holds silu(gate) * up of its token and expert
    row = int((sorted_slots == 0).nonzero()[0])
    gate_up = x[0].float() @ w13[ids[0, 0]].float().t()
    expected = torch.nn.functional.silu(gate_up[:intermediate]) * gate_up[intermediate:]
    assert (act[row].float() - expected).abs().max().item() <= 10 * TOLERANCE[dtype] * expected.abs().max().item()
    out2 = moe_down(act, w2, sorted_slots, block_experts, weights, SMALL_GROUPED)     # [T * top_k, H]
    out = out2 if top_k == 1 else out2.view(num_tokens, top_k, hidden).sum(1)
    _close(out, ref, dtype)
    launch = MoeLaunch("grouped", SMALL_GROUPED, SMALL_GROUPED)
    _close(moe_op.fused_experts(x, weights, ids, w13, w2, launch), ref, dtype)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, dtype", [
    (1, 16, 8, torch.float32), (3, 8, 2, torch.float16), (2, 4, 1, torch.float32)])
def test_decode_gemv_matches_the_expert_loop(num_tokens, num_experts, top_k, dtype):
    x, w13, w2, weights, ids = _layer(num_tokens, num_experts, top_k, 48, 40, dtype, seed=3)
    ref = moe_reference(x, weights, ids, w13, w2)
    out = moe_op.fused_experts(x, weights, ids, w13, w2, MoeLaunch("gemv", SMALL_GEMV, SMALL_GEMV))
    _close(out, ref, dtype)


# ---- the op (compiled with the models in tests/unit/test_moe_models.py) ------------------------------------------
@pytest.fixture
def kernels_on_cpu():
    moe_op.set_moe_kernels("kernels")
    yield
    moe_op.set_moe_kernels("auto")


@pytest.mark.parametrize("num_tokens, path, renormalize", [(3, "gemv", False), (5, "grouped", True)])
def test_op_runs_the_kernels_when_asked(num_tokens, path, renormalize, kernels_on_cpu):
    """Both paths route with the routing kernel, then run their GEMVs or grouped GEMMs."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(num_tokens, 32, generator=g)
    logits = torch.randn(num_tokens, 32, generator=g)
    w13 = torch.randn(32, 48, 32, generator=g) / 32 ** 0.5
    w2 = torch.randn(32, 32, 24, generator=g) / 24 ** 0.5
    weights, ids = route_reference(logits, 2, renormalize)
    ref = moe_reference(x, weights, ids, w13, w2)
    residual = torch.randn(num_tokens, 32, generator=g)
    # 2 of 32 experts a token: the constants take the decode path up to 32 // (4 * 2) tokens
    assert moe_op.launch_for(x, w13, 2).path == path
    _close(moe_op.moe(x, logits, w13, w2, 2, renormalize), ref, torch.float32)
    # the residual the fusion pass folds in: the decode path adds it in its down kernel's epilogue
    _close(moe_op.moe(x, logits, w13, w2, 2, renormalize, residual), ref + residual, torch.float32)
    moe_op.set_moe_kernels("auto")
    assert torch.equal(moe_op.moe(x, logits, w13, w2, 2, renormalize), ref)      # the CPU default: the reference
    with pytest.raises(ValueError, match="'fast'"):
        moe_op.set_moe_kernels("fast")


def test_op_names_shapes_it_cannot_take(kernels_on_cpu):
    x, w13, w2 = torch.randn(2, 32), torch.randn(4, 48, 32), torch.randn(4, 32, 20)
    with pytest.raises(ValueError, match=r"w2 \[E, H, I\].*\(4, 32, 20\)"):
        moe_op.moe(x, torch.randn(2, 4), w13, w2, 2, True)
    with pytest.raises(ValueError, match=r"the residual must be \(2, 32\) torch.float32, got \(2, 16\)"):
        moe_op.moe(x, torch.randn(2, 4), w13, torch.randn(4, 32, 24), 2, True, torch.randn(2, 16))
    with pytest.raises(ValueError, match="top_k must be between 1 and the 4 experts, got 5"):
        moe_op.moe(x, torch.randn(2, 4), w13, torch.randn(4, 32, 24), 5, True)


# ---- launch table ------------------------------------------------------------------------------------------------
QWEN3_30B = dict(num_experts=128, hidden=2048, intermediate=768, top_k=8, element_size=2, num_sms=132)


def test_constants_take_the_decode_path_for_a_few_tokens():
    decode = MC.fallback_launch(MoeShape(num_tokens=1, **QWEN3_30B))
    assert decode.path == "gemv" and decode.gate_up["BLOCK_K"] == 256
    # the down GEMV's grid covers the SMs at least twice over at one token
    assert 2048 // decode.down["BLOCK_N"] >= 2 * 132
    assert MC.fallback_launch(MoeShape(num_tokens=4, **QWEN3_30B)).path == "gemv"
    big = MC.fallback_launch(MoeShape(num_tokens=4096, **QWEN3_30B))
    assert big.path == "grouped" and big.gate_up["BLOCK_M"] == big.down["BLOCK_M"] == 64
    mixtral = dict(QWEN3_30B, num_experts=8, top_k=2, hidden=4096, intermediate=14336)
    assert [MC.fallback_launch(MoeShape(num_tokens=t, **mixtral)).path for t in (1, 2)] == ["gemv", "grouped"]


def test_the_stored_table_overrides_the_constants(tmp_path, monkeypatch):
    gemv = {"gate_up": {"BLOCK_N": 4, "BLOCK_K": 128, "num_warps": 2}, "down": {"BLOCK_N": 8, "BLOCK_K": 64,
                                                                                 "num_warps": 4}}
    grouped = [{"tokens": t, "gate_up": dict(SMALL_GROUPED, BLOCK_M=m), "down": dict(SMALL_GROUPED, BLOCK_M=m)}
               for t, m in ((16, 16), (256, 64))]
    doc = {"num_sms": 132, "element_size": 2, "shapes": [dict(experts=128, hidden=2048, intermediate=768, top_k=8,
                                                              gemv_max_tokens=2, gemv=gemv, grouped=grouped)]}
    path = tmp_path / "moe_configs.json"
    path.write_text(json.dumps(doc))
    monkeypatch.setattr(MC, "_table", lambda: MC.load_table(path))
    MC.moe_launch.cache_clear()
    try:
        launches = {t: MC.moe_launch(MoeShape(num_tokens=t, **QWEN3_30B)) for t in (1, 2, 3, 40, 200, 8192)}
        assert launches[1].path == launches[2].path == "gemv" and launches[1].gate_up["BLOCK_N"] == 4
        assert [launches[t].gate_up["BLOCK_M"] for t in (3, 40, 200, 8192)] == [16, 16, 64, 64]
        # another SM count is not covered by the entry: the constants
        other = MC.moe_launch(MoeShape(num_tokens=3, **dict(QWEN3_30B, num_sms=78)))
        assert other == MC.fallback_launch(MoeShape(num_tokens=3, **dict(QWEN3_30B, num_sms=78)))
    finally:
        MC.moe_launch.cache_clear()
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="MoE launch table"):
        assert MC.load_table(path) == {}


@pytest.mark.parametrize("renormalize", [False, True])
def test_routing_in_its_own_launch_gives_the_folded_routings_output(renormalize, kernels_on_cpu):
    """The decode path with the routing kernel before the gate_up kernel (the default) gives what the routing
    folded into every gate_up program gives (`set_route_first(False)`, an A/B switch), bit for bit: the same
    routing arithmetic."""
    from ember.kernels import moe_gemv
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 32, generator=g).to(torch.float16)
    logits = torch.randn(3, 32, generator=g).to(torch.float16)
    w13 = (torch.randn(32, 48, 32, generator=g) / 32 ** 0.5).to(torch.float16)
    w2 = (torch.randn(32, 32, 24, generator=g) / 24 ** 0.5).to(torch.float16)
    residual = torch.randn(3, 32, generator=g).to(torch.float16)
    assert moe_op.launch_for(x, w13, 2).path == "gemv"
    first = moe_op.moe(x, logits, w13, w2, 2, renormalize, residual)
    moe_gemv.set_route_first(False)
    try:
        folded = moe_op.moe(x, logits, w13, w2, 2, renormalize, residual)
    finally:
        moe_gemv.set_route_first(True)
    assert torch.equal(first, folded)
    weights, ids = route_reference(logits.float(), 2, renormalize)
    _close(first.float(), moe_reference(x.float(), weights, ids, w13.float(), w2.float()) + residual.float(),
           torch.float16)
