"""The fp8 kernels on the CPU, interpreted: the GEMV on e4m3 weights (row and block scales) with each fusion,
weight-only and quantizing x as the many-row path does, the activation quantization (with the norm folded in), the
block-scaled GEMM, and `ember::scaled_linear`'s CPU path and fake.

Weight-only, the GEMV's reference is the unfused layer over the weight dequantized to x's dtype (tolerances as the
bf16 GEMV's fused tests, relative to the output scale: float32 1e-5; float16 2**-9, plus the dequantized weight's
own rounding to float16, 2**-11 relative, which the kernel skips). Quantizing x, its reference is the product of
`quantize_rows_fp8`'s e4m3 rows (the many-row path's) and the dequantized weight in float64: one e4m3 value rounded
differently would move the output by about 2**-4 / sqrt(K) of its scale, far above float32's 1e-5. The GEMM
quantizes x per token and 128 columns; its reference quantizes the same way in torch."""

import pytest
import torch

pytest.importorskip("triton")

import ember.kernels.gemv as G  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from ember.kernels.gemv_fp8 import gemv_fp8  # noqa: E402
from ember.kernels.fp8 import (FP8, dequantize, quantize_blocks, quantize_rows, quantize_token_groups,  # noqa: E402
                               quantize_tokens, quantize_with_scale)
from ember.kernels.fp8_gemm import block_fp8_gemm, quantize_rows_fp8  # noqa: E402
from ember.kernels.scaled_linear_op import scaled_linear_reference  # noqa: E402
from tests.unit.test_gemv_fused import EPS, _check, rms_norm_reference, unfused  # noqa: E402

BLOCK = (128, 128)


def _config(path: str, M: int, N: int, K: int, gated: bool, block, split_k: int) -> dict:
    """The heuristic's config for an e4m3 weight, or one forced onto a path; split_k > 1 cuts K into splits."""
    config = dict(G.gemv_config(M, N, K, G.CPU_SMS, 1, use_dot=None if path == "heuristic" else path == "dot",
                                gated=gated, max_block_k=block[1] if block else None))
    if path == "cuda_cores_per_step":
        config["ACC_3D"] = False
    if split_k > 1:
        block_k = 16 if config["USE_DOT"] else 32
        per_split = -(-(-(-K // block_k)) // split_k)
        config.update(BLOCK_K=block_k, K_PER_SPLIT=per_split * block_k, SPLIT_K=-(-(-(-K // block_k)) // per_split))
        assert config["SPLIT_K"] > 1
    return config


def _weights(N: int, K: int, gated: bool, block, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * N if gated else N
    # rows of different magnitudes, so a scale applied to the wrong row shows
    w = torch.randn(rows, K, generator=g) / K ** 0.5 * torch.linspace(0.2, 3.0, rows)[:, None]
    return quantize_blocks(w, block) if block else quantize_rows(w)


def _inputs(M, N, K, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 3).to(dtype)
    return (x, torch.randn(2 * N, generator=g).to(dtype), torch.randn(M, N, generator=g).to(dtype),
            (1 + 0.3 * torch.randn(K, generator=g)).to(dtype))


# (path, rows, dtype, K splits, scales)
CASES = [("heuristic", 1, torch.float32, 1, "rows"), ("cuda_cores_per_step", 3, torch.float16, 3, "rows"),
         ("dot", 8, torch.float16, 1, "rows"), ("dot", 5, torch.float32, 3, "rows"),
         ("heuristic", 1, torch.float16, 1, "blocks"), ("cuda_cores_per_step", 2, torch.float32, 3, "blocks"),
         ("dot", 8, torch.float16, 3, "blocks")]
FUSIONS = ["plain_bias", "norm", "gated", "norm_gated_residual"]
# the default run: every fusion and every path with each kind of scales (the whole grid is `slow`)
QUICK = {("norm_gated_residual", 0), ("norm_gated_residual", 1), ("plain_bias", 2), ("gated", 3),
         ("norm_gated_residual", 4), ("norm", 5), ("plain_bias", 6), ("gated", 6)}


@pytest.mark.parametrize("fusion,case", [
    pytest.param(f, c, marks=() if (f, c) in QUICK else pytest.mark.slow,
                 id=f"{f}-{p}-m{m}-{str(d)[6:]}-split{s}-{sc}")
    for f in FUSIONS for c, (p, m, d, s, sc) in enumerate(CASES)])
def test_fp8_gemv_matches_the_dequantized_layer(fusion, case):
    path, M, dtype, split_k, scales = CASES[case]
    block = BLOCK if scales == "blocks" else None
    N, K = (128, 200) if block else (40, 80)       # a partial last block column / neither a multiple of the tiles
    gated = "gated" in fusion
    weight, scale = _weights(N, K, gated, block)
    x, bias, residual, norm_weight = _inputs(M, N, K, dtype)
    kwargs = dict(norm_weight=norm_weight if "norm" in fusion else None, gated=gated,
                  bias=bias[:weight.shape[0]] if "bias" in fusion else None,
                  residual=residual if "residual" in fusion else None)
    config = _config(path, M, N, K, gated, block, split_k)
    out = gemv_fp8(x, weight, scale, kwargs["bias"], kwargs["residual"], config=config, scale_block=block,
                   norm_weight=kwargs["norm_weight"], eps=EPS, gated=gated)
    reference = unfused(x, dequantize(weight, scale, dtype, block), **kwargs)
    _check(out, reference, dtype)


def test_fp8_gemv_config_keeps_a_step_in_one_block_column():
    for gated in (False, True):
        config = G.gemv_config(1, 4096, 4096, 132, 1, gated=gated, max_block_k=128)
        assert 128 % config["BLOCK_K"] == 0 and config["K_PER_SPLIT"] % config["BLOCK_K"] == 0


def test_fp8_gemv_rejects_bad_scales_with_the_values():
    weight, scale = _weights(16, 32, False, None)
    x = torch.randn(1, 32)
    with pytest.raises(ValueError, match=r"weight_scale must be a contiguous float32 \[16\], got torch.float16"):
        gemv_fp8(x, weight, scale.half())
    with pytest.raises(ValueError, match=r"one dtype \(e4m3 weights: ember.kernels.gemv_fp8\); got x torch.float32"):
        G.gemv(x, weight)
    with pytest.raises(ValueError, match="activations 'static' takes input_scale"):
        gemv_fp8(x, weight, scale, activations="static")
    block_weight, block_scale = _weights(128, 128, False, BLOCK)
    with pytest.raises(ValueError, match="a block-scaled gemv keeps x in its dtype"):
        gemv_fp8(torch.randn(1, 128), block_weight, block_scale, scale_block=BLOCK, activations="dynamic")


# (path, rows, dtype, K splits, activations, fusion)
ACT_CASES = [("heuristic", 1, torch.float32, 1, "dynamic", "norm_gated_residual"),
             ("cuda_cores_per_step", 3, torch.float32, 3, "dynamic", "norm"),
             ("dot", 8, torch.float32, 1, "static", "norm_gated_residual"),
             ("dot", 5, torch.float32, 3, "dynamic", "gated"),
             ("heuristic", 2, torch.float16, 1, "static", "plain_bias")]


@pytest.mark.parametrize("case", range(len(ACT_CASES)),
                         ids=[f"{f}-{p}-m{m}-{str(d)[6:]}-split{s}-{a}" for p, m, d, s, a, f in ACT_CASES])
def test_fp8_gemv_quantizes_x_as_the_many_row_path_does(case):
    path, M, dtype, split_k, activations, fusion = ACT_CASES[case]
    N, K = 40, 80
    gated = "gated" in fusion
    weight, scale = _weights(N, K, gated, None)
    x, bias, residual, norm_weight = _inputs(M, N, K, dtype)
    norm_weight = norm_weight if "norm" in fusion else None
    bias = bias[:weight.shape[0]] if "bias" in fusion else None
    residual = residual if "residual" in fusion else None
    static = torch.tensor([0.02]) if activations == "static" else None      # some of 3 * randn saturate at 448
    out = gemv_fp8(x, weight, scale, bias, residual, config=_config(path, M, N, K, gated, None, split_k),
                   activations=activations, input_scale=static, norm_weight=norm_weight, eps=EPS, gated=gated)
    xq, x_scale = quantize_rows_fp8(x, norm_weight, EPS, static)
    reference = F.linear(xq.double() * x_scale.double(), dequantize(weight, scale, torch.float64),
                         None if bias is None else bias.double())
    if gated:
        gate, up = reference.chunk(2, dim=-1)
        reference = F.silu(gate) * up
    if residual is not None:
        reference = reference + residual.double()
    tolerance = 1e-5 if dtype == torch.float32 else 2.0 ** -9
    err = (out.double() - reference).abs().max().item()
    assert out.dtype == dtype and err <= tolerance * reference.abs().max().item(), err


# ---- activation quantization ------------------------------------------------------------------------------------

@pytest.mark.parametrize("K", [80, 2500], ids=["k80", "k2500_three_blocks"])
def test_row_quantization_equals_the_torch_reference(K):
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(2)) * torch.tensor([1e-3, 1, 10, 300, 0])[:, None]
    q, scale = quantize_rows_fp8(x)
    want_q, want_scale = quantize_tokens(x)
    assert q.dtype == FP8 and torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    static = torch.tensor([0.02])
    q, scale = quantize_rows_fp8(x, static_scale=static)
    assert torch.equal(scale, static.expand(5, 1))
    assert torch.equal(q.view(torch.uint8), quantize_with_scale(x, static).view(torch.uint8))   # saturates at 448


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_row_quantization_folds_in_the_norm(dtype):
    """Dynamic: x * norm weight quantized by its own amax, the row's 1/rms carried by its scale (so the GEMV, which
    learns 1/rms last, rounds to the same values); the product is the normed row quantized per token."""
    x, _, _, norm_weight = _inputs(4, 8, 1100, dtype)
    q, scale = quantize_rows_fp8(x, norm_weight, EPS)
    x32 = x.float()
    want_q, want_scale = quantize_tokens(x32 * norm_weight.float())
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    torch.testing.assert_close(scale, want_scale * rstd, rtol=1e-6, atol=0)
    normed = rms_norm_reference(x32, norm_weight.float(), EPS)
    assert ((q.float() * scale - normed).abs() <= 2 ** -4 * normed.abs() + 2 ** -10 * scale).all()


# ---- block-scaled GEMM ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("M,N,K,bias", [(18, 64, 200, True), (3, 160, 128, False)],
                         ids=["two_row_tiles_partial_k_block_bias", "partial_n_tile"])
def test_block_gemm_matches_per_group_quantization_in_torch(M, N, K, bias):
    weight, scale = _weights(N, K, False, BLOCK)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(4)).half() * 4
    b = torch.randn(N, generator=torch.Generator().manual_seed(5)).half() if bias else None
    out = block_fp8_gemm(x, weight, scale, BLOCK, b, out_dtype=torch.float32)
    xq, x_scale = quantize_token_groups(x, 128)
    x_deq = xq.double() * x_scale.double().repeat_interleave(128, 1)[:, :K]
    reference = x_deq @ dequantize(weight, scale, torch.float64, BLOCK).T
    if bias:
        reference += b.double()
    err = (out.double() - reference).abs().max().item()
    assert err <= 1e-5 * reference.abs().max().item(), err
    # and the quantization of x costs what e4m3 costs: within a few percent of the unquantized product
    exact = x.double() @ dequantize(weight, scale, torch.float64, BLOCK).T + (b.double() if bias else 0)
    assert (out.double() - exact).abs().max().item() <= 0.05 * exact.abs().max().item()


# ---- the op ---------------------------------------------------------------------------------------------------

def test_op_on_cpu_rounds_x_dequantizes_then_runs_the_unfused_layer():
    """The CPU path: the normed x rounded to e4m3 per token (or by the static scale), the weight dequantized, then
    the unfused layer; the same as the many-row path's quantization in torch."""
    weight, scale = _weights(24, 64, True, None)
    x, bias, residual, norm_weight = _inputs(6, 24, 64, torch.float32)
    args = (x, weight, scale, None, bias, 0, 0, norm_weight, EPS, True, residual[:, :24])
    out = torch.ops.ember.scaled_linear(*args)
    w = weight.float() * scale[:, None]
    xq, x_scale = quantize_tokens(rms_norm_reference(x, norm_weight, EPS))
    assert torch.equal(out, unfused(xq.float() * x_scale, w, bias, residual[:, :24], None, True))
    assert torch.equal(out, scaled_linear_reference(x, weight, scale, bias, 0, 0, norm_weight, EPS, True,
                                                    residual[:, :24]))
    static = torch.tensor([0.01])
    out = torch.ops.ember.scaled_linear(x, weight, scale, static, None, 0, 0, None, EPS, False, None)
    assert torch.equal(out, F.linear(quantize_with_scale(x, static).float() * static, w))
    assert not torch.equal(out, F.linear(x, w))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = torch.ops.ember.scaled_linear(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                               for a in args])
    assert fake.shape == (6, 24) and fake.dtype == torch.float32


# ---- compiled code (no GPU needed: Triton compiles for sm_90 on the CPU) ------------------------------------------

def _compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name.endswith("_ptr")}
    kernel = triton.runtime.jit.JITFunction(fn.fn)           # compiled even where TRITON_INTERPRET=1
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))


@pytest.mark.slow      # 5-15 s of Triton's compile on a 2-core CPU
def test_sm90_block_gemm_multiplies_e4m3_on_tensor_cores():
    import ember.kernels.fp8_gemm as K
    c = K._block_config(256, BLOCK, torch.device("cuda"))
    signature = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", w_scale_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16",
                     M="i32", N="i32", K="i32", stride_xm="i32", stride_wn="i32", stride_sn="i32", stride_om="i32")
    constexprs = dict(FP8_LIMIT=448.0, AMAX_FLOOR=1e-12, SCALE_BN=128, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"],
                      BLOCK_K=128, HAS_BIAS=False, DOT_IN_FP32=False)
    ptx = _compile_sm90(K._block_gemm_kernel, signature, constexprs, c["num_warps"], c["num_stages"]).asm["ptx"]
    assert "wgmma.mma_async" in ptx and ".e4m3.e4m3" in ptx      # Hopper's fp8 warpgroup MMA


def test_sm90_row_quantization_converts_with_the_hardware():
    import ember.kernels.fp8_gemm as K
    signature = dict(x_ptr="*bf16", norm_weight_ptr="*bf16", static_scale_ptr="*fp32", out_ptr="*fp8e4nv",
                     scale_ptr="*fp32", K="i32", stride_xm="i32", stride_om="i32", eps="fp32")
    constexprs = dict(FP8_LIMIT=448.0, AMAX_FLOOR=1e-12, BLOCK=1024, NORM=True, STATIC=False, EXACT_E4M3=False)
    ptx = _compile_sm90(K._quantize_rows_kernel, signature, constexprs, 4, 1).asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
