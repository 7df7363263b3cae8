"""`ember::fused_linear` on a GPU, bf16, on Qwen3-0.6B and Llama-3.1-8B shapes at 1..16 rows (the fused GEMV) and
at 64 rows (the composed path: Triton RMSNorm, cuBLAS, Triton SiLU·mul): against the unfused ops computed in
float32 from the same bf16 inputs.

Tolerance, relative to the output scale s = max |reference|: 2**-6 s. The fused kernel rounds the normed input as
the unfused model does (bf16) and the output once; the unfused bf16 model also rounds the projection before the
activation and the residual add, so the two differ by up to ~2 bf16 ulps of the largest output (2**-7 s each) —
more than that fails."""

import pytest
import torch
import torch.nn.functional as F

import ember.kernels.fused_linear  # noqa: F401  (registers the op)
import ember.kernels.qk_norm_rope  # noqa: F401  (registers the op)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("gemv_unrouted")]   # the kernel at every row count


SHAPES = {   # name: (N outputs, K, gated)
    "qwen3-0.6b qkv": (4096, 1024, False), "qwen3-0.6b gate_up": (3072, 1024, True),
    "qwen3-0.6b o_proj": (1024, 2048, False), "llama-3.1-8b gate_up": (14336, 4096, True),
    "llama-3.1-8b down": (4096, 14336, False),
}
DTYPE = torch.bfloat16


def _reference(x, weight, norm_weight, gated, residual, eps=1e-6):
    x32 = x.float()
    if norm_weight is not None:
        x32 = (norm_weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(DTYPE)).float()
    out = F.linear(x32, weight.float())
    if gated:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out if residual is None else out + residual.float()


@pytest.mark.parametrize("M", [1, 2, 8, 16, 64])
@pytest.mark.parametrize("name", list(SHAPES))
def test_fused_linear_matches_the_unfused_ops(name, M):
    N, K, gated = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(M)
    weight = torch.randn(2 * N if gated else N, K, generator=g, device="cuda", dtype=DTYPE) / K ** 0.5
    x = 3 * torch.randn(M, K, generator=g, device="cuda", dtype=DTYPE)
    # the fusions the passes make for this projection: norm (+ silu·mul) for qkv and gate_up, residual otherwise
    norm_weight = None if name.endswith(("o_proj", "down")) else \
        1 + 0.2 * torch.randn(K, generator=g, device="cuda", dtype=DTYPE)
    residual = torch.randn(M, N, generator=g, device="cuda", dtype=DTYPE) if norm_weight is None else None
    out = torch.ops.ember.fused_linear(x, weight, None, norm_weight, 1e-6, gated, residual)
    reference = _reference(x, weight, norm_weight, gated, residual)
    assert out.shape == (M, N) and out.dtype == DTYPE
    scale = reference.abs().max().item()
    err = (out.float() - reference).abs().max().item()
    assert err <= 2.0 ** -6 * scale, f"max abs error {err:.3g} at scale {scale:.3g}"


def test_fused_linear_replays_in_a_cuda_graph():
    N, K, _ = SHAPES["qwen3-0.6b gate_up"]
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(2 * N, K, generator=g, device="cuda", dtype=DTYPE) / K ** 0.5
    norm_weight = torch.rand(K, generator=g, device="cuda", dtype=DTYPE) + 0.5
    x = torch.randn(1, K, generator=g, device="cuda", dtype=DTYPE)
    eager = torch.ops.ember.fused_linear(x, weight, None, norm_weight, 1e-6, True, None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.ember.fused_linear(x, weight, None, norm_weight, 1e-6, True, None)
    x.copy_(torch.randn(1, K, generator=g, device="cuda", dtype=DTYPE))
    graph.replay()
    expected = torch.ops.ember.fused_linear(x, weight, None, norm_weight, 1e-6, True, None)
    assert torch.equal(captured, expected) and not torch.equal(captured, eager)


@pytest.mark.parametrize("num_tokens", [1, 16, 300, 1500])
def test_qk_norm_rope_matches_the_model_ops(num_tokens):
    """Qwen3-0.6B heads (16 q, 8 kv, 128 wide), q and k read in place from the qkv output: bitwise where the roundings
    agree; within one bf16 ulp of the scale (2**-7 s) where float32 sums of squares differ in order. 1,500 tokens
    take the many-token kernel (its last block of 32 partly masked)."""
    from ember.kernels.qk_norm_rope import qk_norm_rope_reference
    hq, hkv, d = 16, 8, 128
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    qkv = 2 * torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=g, device="cuda", dtype=DTYPE)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q_weight, k_weight = 1 + 0.2 * torch.randn(2, d, generator=g, device="cuda", dtype=DTYPE)
    angles = 100 * torch.rand(num_tokens, d // 2, generator=g, device="cuda")
    cos, sin = torch.cat([angles.cos(), angles.sin()], dim=-1).chunk(2, dim=-1)
    got = torch.ops.ember.qk_norm_rope(q, k, q_weight, k_weight, cos, sin, 1e-6)
    for out, ref in zip(got, qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, 1e-6)):
        assert out.shape == ref.shape and out.is_contiguous()
        scale = ref.float().abs().max().item()
        assert (out.float() - ref.float()).abs().max().item() <= 2.0 ** -7 * scale
