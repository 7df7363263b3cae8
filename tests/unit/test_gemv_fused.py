"""The GEMV's fused prologue (RMSNorm) and epilogues (SiLU·mul, residual) on the CPU, interpreted, against the
unfused torch ops on the same inputs.

Tolerances, relative to the output scale s = max |reference|: float32 within 1e-5 s (only the order of float32
sums differs); float16 within 2**-9 s: the normed input is rounded exactly as the unfused RMSNorm rounds it, the
products are exact and the sums float32; the one extra difference is the fused epilogue rounding once where the
unfused ops round after the matmul and again after the activation (about one float16 ulp of the output)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import ember.kernels.fused_linear  # noqa: E402,F401  (registers the op)
import ember.kernels.gemv as G   # noqa: E402
from tests.unit.test_gemv import _config   # noqa: E402

EPS = 1e-5
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2.0 ** -9}


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ember's Llama-form RMSNorm: normalise in float32, round to x's dtype, scale by the weight in x's dtype."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def unfused(x, weight, bias=None, residual=None, norm_weight=None, gated=False, eps=EPS):
    if norm_weight is not None:
        x = rms_norm_reference(x, norm_weight, eps)
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate.float()).to(x.dtype) * up
    if residual is not None:
        y = y + residual
    return y


def _inputs(M, N, K, dtype, gated, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * N if gated else N
    x = (torch.randn(M, K, generator=g) * 3).to(dtype)            # [M, K]: not unit RMS, so the norm matters
    weight = (torch.randn(rows, K, generator=g) / K ** 0.5).to(dtype)   # [rows, K]
    bias = torch.randn(rows, generator=g).to(dtype)                # [rows]
    residual = torch.randn(M, N, generator=g).to(dtype)            # [M, N]
    norm_weight = (1 + 0.3 * torch.randn(K, generator=g)).to(dtype)   # [K]
    return x, weight, bias, residual, norm_weight


def _check(out, reference, dtype):
    scale = reference.abs().max().item()
    err = (out.float() - reference.float()).abs().max().item()
    assert out.shape == reference.shape and out.dtype == reference.dtype
    assert err <= TOLERANCE[dtype] * scale, f"max abs error {err:.3g} at scale {scale:.3g}"


# (path, rows, dtype, K splits): each kernel path with and without split K, in both dtypes
CASES = [("heuristic", 1, torch.float32, 1), ("cuda_cores_per_step", 3, torch.float16, 3),
         ("tensor_cores", 8, torch.float16, 1), ("tensor_cores", 3, torch.float32, 3),
         ("heuristic", 1, torch.float16, 3)]


@pytest.mark.parametrize("path,M,dtype,split_k", CASES, ids=[f"{p}-m{m}-{str(d)[6:]}-split{s}" for p, m, d, s in CASES])
@pytest.mark.parametrize("fusion", ["norm", "gated", "norm_gated_bias", "norm_residual"])
def test_fused_kernel_matches_unfused_ops(fusion, path, M, dtype, split_k):
    N, K = 40, 72                       # neither a multiple of the blocks; 72 leaves a masked K tail
    gated = "gated" in fusion
    x, weight, bias, residual, norm_weight = _inputs(M, N, K, dtype, gated)
    kwargs = dict(norm_weight=norm_weight if "norm" in fusion else None, gated=gated,
                  bias=bias if "bias" in fusion else None, residual=residual if "residual" in fusion else None)
    config = _config(path, M, N, K, x.element_size(), split_k)
    out = G.gemv(x, weight, kwargs["bias"], kwargs["residual"], config=config, norm_weight=kwargs["norm_weight"],
                 eps=EPS, gated=gated)
    _check(out, unfused(x, weight, **kwargs), dtype)


def test_gated_config_halves_the_k_step_only():
    plain = G.gemv_config(1, 3072, 1024, 132)
    gated = G.gemv_config(1, 3072, 1024, 132, gated=True)
    assert gated["BLOCK_N"] == plain["BLOCK_N"] and gated["BLOCK_K"] == plain["BLOCK_K"] // 2


def test_fused_gemv_rejects_bad_shapes_with_the_values():
    x, weight, _, _, norm_weight = _inputs(2, 8, 16, torch.float32, gated=False)
    with pytest.raises(ValueError, match=r"norm_weight must be \[16\], got \(8,\)"):
        G.gemv(x, weight, norm_weight=norm_weight[:8])
    with pytest.raises(ValueError, match="even number of weight rows.*got 7"):
        G.gemv(x, weight[:7], gated=True)


# ---- the composed path's kernels (prefill-sized batches) ---------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("K", [72, 5000], ids=["k72", "k5000_two_blocks"])
def test_rms_norm_kernel_matches_the_torch_ops(dtype, K):
    from ember.kernels.rms_norm import rms_norm
    x, _, _, _, _ = _inputs(3, 8, K, dtype, gated=False)
    weight = (1 + 0.3 * torch.randn(K, generator=torch.Generator().manual_seed(5))).to(dtype)
    _check(rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_silu_mul_kernel_matches_the_torch_ops(dtype):
    from ember.kernels.rms_norm import silu_mul
    x = torch.randn(3, 2 * 1100, generator=torch.Generator().manual_seed(6)).to(dtype)   # two column blocks
    gate, up = x.chunk(2, dim=-1)
    _check(silu_mul(x), F.silu(gate.float()).to(dtype) * up, dtype)


@pytest.mark.parametrize("parts", ["norm_gated_bias", "residual", "residual_bias"])
def test_composed_path_matches_the_reference(parts):
    """What `ember::fused_linear` runs for batches the GEMV does not take (here on CPU tensors, interpreted)."""
    from ember.kernels.fused_linear import _composed, fused_linear_reference
    gated = "gated" in parts
    x, weight, bias, residual, norm_weight = _inputs(20, 40, 72, torch.float32, gated)
    args = (x, weight, bias if "bias" in parts else None, norm_weight if "norm" in parts else None, EPS, gated,
            residual if "residual" in parts else None)
    _check(_composed(*args), fused_linear_reference(*args), torch.float32)


def test_op_shape_on_cpu_and_under_fake_tensors():
    x, weight, _, _, norm_weight = _inputs(4, 8, 16, torch.float32, gated=True)
    out = torch.ops.ember.fused_linear(x, weight, None, norm_weight, EPS, True, None)
    assert out.shape == (4, 8)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = torch.ops.ember.fused_linear(mode.from_tensor(x), mode.from_tensor(weight), None, None, EPS, True,
                                            None)
    assert fake.shape == (4, 8)


@pytest.mark.parametrize("layout", ["qkv", "separate", "one_token", "qkv_rows", "separate_rows"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_qk_norm_rope_kernel_matches_the_torch_ops(dtype, norm, layout, monkeypatch):
    """q and k read in place from a qkv buffer (strided rows), from buffers of their own, or as one token's views
    (whose row strides torch may rewrite); cos/sin as strided halves of one table; with and without the norm. The
    *_rows layouts take the many-token kernel (blocks of 32 tokens, the last one partly masked)."""
    import ember.kernels.qk_norm_rope as mod
    from ember.kernels.qk_norm_rope import _kernel_applies, qk_norm_rope_reference, qk_norm_rope_triton
    rows = layout.endswith("_rows")
    layout = layout.removesuffix("_rows")
    monkeypatch.setattr(mod, "ROWS_MIN_TOKENS", 2 if rows else 10 ** 9)
    num_tokens, hq, hkv, d = (1 if layout == "one_token" else 37 if rows else 3), 4, 2, 16
    g = torch.Generator().manual_seed(7)
    qkv = (2 * torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=g)).to(dtype)    # [T, (Hq + 2 Hkv) D]
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    if layout == "separate":
        q, k = q.clone(), k.clone()
    elif layout == "one_token":
        q, k = q.unflatten(-1, (hq, d)).flatten(1), k.unflatten(-1, (hkv, d)).flatten(1)
    weights = tuple((1 + 0.2 * torch.randn(2, d, generator=g)).to(dtype)) if norm else (None, None)
    angles = 6 * torch.rand(num_tokens, d // 2, generator=g)
    cos, sin = torch.cat([angles.cos(), angles.sin()], dim=-1).chunk(2, dim=-1)          # [T, D/2] each, strided
    assert _kernel_applies(q, k, d, cos, sin)
    got = qk_norm_rope_triton(q, k, *weights, cos, sin, EPS, d)
    for out, ref in zip(got, qk_norm_rope_reference(q, k, *weights, cos, sin, EPS, d)):
        _check(out, ref, dtype)
        assert out.is_contiguous()
