"""The MoE kernels with expert biases and gpt-oss's clamped SwiGLU, interpreted on the CPU: `moe_reference` against a
plain loop over token-slots written here from gpt-oss's formula, then the decode GEMV and the grouped GEMM against
`moe_reference` (b13 only, b2 only, both; SiLU and the clamp at 7; top_k 1 and 2; uneven loads, an expert with no
tokens, an expert map with experts held elsewhere); the `ember::moe` op on either path with the routing, the
residual and an expert map; a call without the new arguments is unchanged, bit for bit.

Tolerances as in tests/unit/test_moe_kernels.py: float32 within 1e-5 s, float16 within 2e-3 s (s = max |ref|)."""

import pytest
import torch

pytest.importorskip("triton")

from ember.kernels import moe_gemv, moe_op  # noqa: E402
from ember.kernels.moe_configs import MoeLaunch  # noqa: E402
from ember.kernels.moe_gemm import moe_reference  # noqa: E402
from ember.kernels.moe_router import route_reference  # noqa: E402
from tests.unit.test_moe_expert_map import rank_map  # noqa: E402
from tests.unit.test_moe_kernels import SMALL_GEMV, SMALL_GROUPED, _close, _layer  # noqa: E402

LIMIT = 7.0
BIASES = {"b13": (True, False), "b2": (False, True), "both": (True, True)}


def _biases(num_experts, intermediate, hidden, dtype, which, seed=1):
    """(b13 [E, 2I], b2 [E, H]) or None each; b13 is large enough that the clamp at LIMIT bites."""
    g = torch.Generator().manual_seed(seed)
    b13 = (4 * torch.randn(num_experts, 2 * intermediate, generator=g)).to(dtype)
    b2 = torch.randn(num_experts, hidden, generator=g).to(dtype)
    with_b13, with_b2 = BIASES[which]
    return (b13 if with_b13 else None), (b2 if with_b2 else None)


def _slot_loop(x, weights, ids, w13, w2, b13, b2, limit, expert_map=None):
    """gpt-oss's experts, one token-slot at a time, in float32."""
    out = torch.zeros(x.shape[0], w2.shape[1])
    intermediate = w13.shape[1] // 2
    for token in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            expert = int(ids[token, k]) if expert_map is None else int(expert_map[ids[token, k]])
            if expert < 0:
                continue
            gate_up = w13[expert] @ x[token] + (0 if b13 is None else b13[expert])
            g, u = gate_up[:intermediate], gate_up[intermediate:]
            if limit > 0:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
                act = (u + 1) * g * torch.sigmoid(1.702 * g)
            else:
                act = torch.nn.functional.silu(g) * u
            y = w2[expert] @ act + (0 if b2 is None else b2[expert])
            out[token] += weights[token, k] * y
    return out


@pytest.mark.parametrize("which", list(BIASES))
@pytest.mark.parametrize("limit", [0.0, LIMIT])
@pytest.mark.parametrize("top_k, expert_map", [(1, None), (2, None), (2, rank_map(8, 0, 2))])
def test_the_reference_is_gpt_oss_formula(which, limit, top_k, expert_map):
    local = 8 if expert_map is None else 4
    x, w13, w2, weights, ids = _layer(12, 8, top_k, 32, 24, torch.float32)
    w13, w2 = w13[:local], w2[:local]
    b13, b2 = _biases(local, 24, 32, torch.float32, which)
    if b13 is not None and limit > 0:       # the clamp changes some values
        assert (torch.einsum("th,eih->tei", x, w13) + b13).abs().max() > limit
    ref = moe_reference(x, weights, ids, w13, w2, expert_map, b13, b2, limit)
    _close(ref, _slot_loop(x, weights, ids, w13, w2, b13, b2, limit, expert_map), torch.float32)


CASES = [   # (path, top_k, which biases, swiglu_limit, dtype)
    ("gemv", 1, "b13", 0.0, torch.float32), ("gemv", 2, "b2", LIMIT, torch.float32),
    ("gemv", 2, "both", 0.0, torch.float32), ("gemv", 2, "both", LIMIT, torch.float16),
    ("grouped", 2, "b13", LIMIT, torch.float32), ("grouped", 1, "b2", 0.0, torch.float32),
    ("grouped", 2, "both", LIMIT, torch.float32), ("grouped", 2, "both", 0.0, torch.float16),
]
CONFIGS = {"gemv": SMALL_GEMV, "grouped": SMALL_GROUPED}


@pytest.mark.parametrize("path, top_k, which, limit, dtype", CASES)
def test_kernels_match_the_reference(path, top_k, which, limit, dtype):
    """12 tokens over 8 experts, skewed, expert 1 with none; I = 40 leaves the last column block partial."""
    x, w13, w2, weights, ids = _layer(12, 8, top_k, 64, 40, dtype, seed=top_k)
    b13, b2 = _biases(8, 40, 64, dtype, which)
    ref = moe_reference(x, weights, ids, w13, w2, None, b13, b2, limit)
    config = CONFIGS[path]
    out = moe_op.fused_experts(x, weights, ids, w13, w2, MoeLaunch(path, config, config), None, b13, b2, limit)
    _close(out, ref, dtype)


@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_kernels_with_an_expert_map_give_the_ranks_share(path):
    """Rank 1 of 2 holds experts 4-7: the slots of experts 0-3 add nothing, not even their biases."""
    x, w13, w2, weights, ids = _layer(12, 8, 2, 64, 40, torch.float32)
    b13, b2 = _biases(8, 40, 64, torch.float32, "both")
    expert_map = rank_map(8, 1, 2)
    held = expert_map[ids.long()] >= 0
    assert held.any() and not held.all()
    config = CONFIGS[path]
    out = moe_op.fused_experts(x, weights, ids, w13[4:], w2[4:], MoeLaunch(path, config, config), expert_map,
                               b13[4:], b2[4:], LIMIT)
    ref = moe_reference(x, weights, ids, w13[4:], w2[4:], expert_map, b13[4:], b2[4:], LIMIT)
    _close(out, ref, torch.float32)
    assert torch.equal(out[~held.any(1)], torch.zeros_like(out[~held.any(1)]))   # tokens with no local expert
    _close(ref, _slot_loop(x, weights, ids, w13[4:], w2[4:], b13[4:], b2[4:], LIMIT, expert_map), torch.float32)


@pytest.fixture
def kernels_on_cpu():
    moe_op.set_moe_kernels("kernels")
    yield
    moe_op.set_moe_kernels("auto")


def _op_layer(num_tokens, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 32, generator=g)
    logits = torch.randn(num_tokens, 32, generator=g)
    w13 = torch.randn(32, 48, 32, generator=g) / 32 ** 0.5
    w2 = torch.randn(32, 32, 24, generator=g) / 24 ** 0.5
    b13, b2 = 4 * torch.randn(32, 48, generator=g), torch.randn(32, 32, generator=g)
    return x, logits, w13, w2, b13, b2, torch.randn(num_tokens, 32, generator=g)


@pytest.mark.parametrize("num_tokens, path", [(3, "gemv"), (5, "grouped")])
def test_the_op_routes_then_runs_the_biased_experts(num_tokens, path, kernels_on_cpu):
    x, logits, w13, w2, b13, b2, residual = _op_layer(num_tokens)
    assert moe_op.launch_for(x, w13, 2).path == path
    weights, ids = route_reference(logits, 2, True)
    ref = moe_reference(x, weights, ids, w13, w2, None, b13, b2, LIMIT)
    out = moe_op.moe(x, logits, w13, w2, 2, True, residual, None, b13, b2, LIMIT)
    _close(out, ref + residual, torch.float32)
    if path == "gemv":      # the routing folded into the gate_up kernel gives the same, bit for bit
        moe_gemv.set_route_first(False)
        try:
            assert torch.equal(moe_op.moe(x, logits, w13, w2, 2, True, residual, None, b13, b2, LIMIT), out)
        finally:
            moe_gemv.set_route_first(True)
    # an expert map: rank 1 of 2, the routing over all 32 experts
    expert_map = rank_map(32, 1, 2)
    share = moe_op.moe(x, logits, w13[16:], w2[16:], 2, True, None, expert_map, b13[16:], b2[16:], LIMIT)
    _close(share, moe_reference(x, weights, ids, w13[16:], w2[16:], expert_map, b13[16:], b2[16:], LIMIT),
           torch.float32)
    moe_op.set_moe_kernels("auto")        # the CPU default: the reference, the same arguments
    assert torch.equal(moe_op.moe(x, logits, w13, w2, 2, True, None, None, b13, b2, LIMIT), ref)


@pytest.mark.parametrize("mode, num_tokens", [("kernels", 3), ("kernels", 5), ("auto", 5)])
def test_without_biases_the_op_is_unchanged(mode, num_tokens):
    x, logits, w13, w2, _, _, residual = _op_layer(num_tokens, seed=7)
    moe_op.set_moe_kernels(mode)
    try:
        before = moe_op.moe(x, logits, w13, w2, 2, True, residual)
        assert torch.equal(moe_op.moe(x, logits, w13, w2, 2, True, residual, None, None, None, 0.0), before)
        # every argument spelled out reaches the op's body with the new switches off
        assert torch.equal(torch.ops.ember.moe(x, logits, w13, w2, 2, True, residual, None, None, None, 0.0), before)
    finally:
        moe_op.set_moe_kernels("auto")


def test_the_op_names_bad_biases_and_limits():
    x, logits, w13, w2, b13, b2, _ = _op_layer(2)
    with pytest.raises(ValueError, match=r"b13 must be \[32, 48\] torch.float32.*got \(32, 24\) torch.float32"):
        moe_op.moe(x, logits, w13, w2, 2, True, b13=b13[:, :24])
    with pytest.raises(ValueError, match=r"b2 must be \[32, 32\] torch.float32.*got \(32, 32\) torch.float16"):
        moe_op.moe(x, logits, w13, w2, 2, True, b2=b2.half())
    with pytest.raises(ValueError, match="swiglu_limit must be 0 .* got -1.0"):
        moe_op.moe(x, logits, w13, w2, 2, True, swiglu_limit=-1.0)


def test_the_fake_takes_the_new_arguments():
    """Tracing sees the op's output shape from its fake with every argument given (no kernel runs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        x, logits, w13, w2, b13, b2, residual = (mode.from_tensor(t) for t in _op_layer(4))
        out = torch.ops.ember.moe(x, logits, w13, w2, 2, True, residual, None, b13, b2, LIMIT)
    assert out.shape == (4, 32) and out.dtype == torch.float32
