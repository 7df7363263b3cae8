"""The fp8 GEMV's activation rounding done once a call (`ember.kernels.gemv_fp8.round_rows`, then ACT_QUANT 3),
interpreted on the CPU: the rows and scales are the many-row path's (`quantize_rows_fp8`) bit for bit, and the GEMV
on them gives the numbers of the GEMV that rounds x inside every program (`set_row_prepass(False)`). Without the norm
both compute the same float32 values in the same order, so they are equal bit for bit; with it, 1/rms is summed in
another order, and the outputs may differ by one rounding of the output dtype. Also compiled for sm_90 (slow): the
GEMV's K loop on rounded rows converts nothing to e4m3."""

import pytest
import torch

pytest.importorskip("triton")

import ember.kernels.gemv as G  # noqa: E402
from ember.kernels.fp8 import FP8, quantize_rows  # noqa: E402
from ember.kernels.fp8_gemm import quantize_rows_fp8  # noqa: E402
from ember.kernels.gemv_fp8 import gemv_fp8, round_rows, set_row_prepass  # noqa: E402
from tests.unit.test_fp8_kernels import _compile_sm90, _config, _inputs, _weights  # noqa: E402
from tests.unit.test_gemv_fused import EPS  # noqa: E402


# (dtype, K, norm, static): K past one 1024-column step and not a multiple of it; a zero row and saturating rows
ROW_CASES = [(torch.float32, 80, False, False), (torch.float16, 2500, True, False),
             (torch.bfloat16, 2500, False, True), (torch.float32, 1100, True, True)]


@pytest.mark.parametrize("dtype,K,norm,static", ROW_CASES,
                         ids=[f"{str(d)[6:]}-k{k}-norm{int(n)}-static{int(s)}" for d, k, n, s in ROW_CASES])
def test_round_rows_gives_the_many_row_paths_values_and_scales(dtype, K, norm, static):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, K, generator=g) * torch.tensor([1e-3, 1.0, 40.0, 0.0])[:, None]).to(dtype)
    norm_weight = (1 + 0.3 * torch.randn(K, generator=g)).to(dtype) if norm else None
    # 40 * randn, and a normed row (about randn), saturate at 448 times the scale
    static_scale = torch.tensor([0.002 if norm else 0.02]) if static else None
    rounded, scale = round_rows(x, norm_weight, EPS, static_scale)
    xq, x_scale = quantize_rows_fp8(x, norm_weight, EPS, static_scale)
    assert rounded.dtype == dtype and scale.shape == (4,) and scale.dtype == torch.float32
    assert torch.equal(rounded, xq.to(dtype))                # e4m3 values: exact in every dtype
    assert torch.equal(scale, x_scale.reshape(4))
    assert torch.equal(rounded.to(FP8).view(torch.uint8), xq.view(torch.uint8))
    if static:
        assert rounded.abs().max().item() == 448.0
    else:
        assert scale[3].item() == pytest.approx(1e-12 / 448, rel=1e-6)    # the zero row: the floor, not 0 / 0


def test_round_rows_refuses_a_norm_weight_of_another_length():
    with pytest.raises(ValueError, match=r"round_rows needs x \[M, K\] and norm_weight \[K\], got \(2, 64\) and "
                                         r"\(32,\)"):
        round_rows(torch.randn(2, 64), torch.ones(32))


# (path, rows, dtype, K splits, activations, fusion), as test_fp8_kernels' cases
GEMV_CASES = [("heuristic", 1, torch.float32, 1, "dynamic", "gated_residual"),
              ("cuda_cores_per_step", 2, torch.float16, 3, "dynamic", "plain_bias"),
              ("heuristic", 2, torch.float32, 1, "static", "plain_bias"),
              ("dot", 8, torch.float32, 1, "dynamic", "gated"),
              ("dot", 5, torch.float32, 3, "static", "gated_residual"),
              ("heuristic", 1, torch.float32, 1, "dynamic", "norm_gated_residual"),
              ("dot", 8, torch.float32, 3, "static", "norm")]


def _gemv(case, prepass: bool) -> torch.Tensor:
    path, M, dtype, split_k, activations, fusion = case
    N, K = 40, 80
    gated = "gated" in fusion
    weight, scale = _weights(N, K, gated, None)
    x, bias, residual, norm_weight = _inputs(M, N, K, dtype)
    set_row_prepass(prepass)
    try:
        return gemv_fp8(x, weight, scale, bias[:weight.shape[0]] if "bias" in fusion else None,
                        residual if "residual" in fusion else None,
                        config=_config(path, M, N, K, gated, None, split_k), activations=activations,
                        input_scale=torch.tensor([0.02]) if activations == "static" else None,
                        norm_weight=norm_weight if "norm" in fusion else None, eps=EPS, gated=gated)
    finally:
        set_row_prepass(True)


@pytest.mark.parametrize("case", range(len(GEMV_CASES)),
                         ids=[f"{f}-{p}-m{m}-{str(d)[6:]}-split{s}-{a}" for p, m, d, s, a, f in GEMV_CASES])
def test_gemv_on_rounded_rows_equals_rounding_in_every_program(case):
    once, in_kernel = _gemv(GEMV_CASES[case], True), _gemv(GEMV_CASES[case], False)
    assert once.dtype == in_kernel.dtype == GEMV_CASES[case][2]
    if "norm" not in GEMV_CASES[case][5]:
        assert torch.equal(once, in_kernel)
    else:
        # 1/rms summed in another order: at most a rounding of the output apart
        torch.testing.assert_close(once, in_kernel, rtol=2e-6, atol=0)


def test_the_default_is_rounding_once_a_call():
    """A GEMV launched on `round_rows`' output is what `gemv_fp8` runs unless switched: the switch's off state
    must change the launch (ACT_QUANT), seen through the kernel's constexprs."""
    seen = []
    launch = G.launch_gemv

    def spy(*args, **kwargs):
        seen.append(kwargs.get("ACT_QUANT"))
        return launch(*args, **kwargs)

    import ember.kernels.gemv_fp8 as F8
    weight, scale = _weights(16, 32, False, None)
    F8.launch_gemv = spy
    try:
        gemv_fp8(torch.randn(1, 32), weight, scale, activations="dynamic")
        set_row_prepass(False)
        gemv_fp8(torch.randn(1, 32), weight, scale, activations="dynamic")
    finally:
        set_row_prepass(True)
        F8.launch_gemv = launch
    assert seen == [3, 1]


# ---- compiled for sm_90 on the CPU ------------------------------------------------------------------------------

_GEMV_SIGNATURE = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", bias_ptr="*bf16", residual_ptr="*bf16",
                       norm_weight_ptr="*bf16", out_ptr="*bf16", M="i32", N="i32", K="i32", stride_xm="i32",
                       stride_wn="i32", stride_rm="i32", stride_om="i32", k_per_split="i32", eps="fp32",
                       w_scale_ptr="*fp32", stride_sn="i32", act_scale_ptr="*fp32")


def _gemv_ptx(act_quant: int, M: int, norm: bool) -> str:
    c = G.gemv_config(M, 28672, 4096, 132, 1)
    constexprs = dict(BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], USE_DOT=c["USE_DOT"],
                      ACC_3D=c["ACC_3D"], EVEN_K=True, PARTIAL=False, HAS_BIAS=False, HAS_RESIDUAL=False, NORM=norm,
                      GATED=False, DOT_IN_FP32=False, IEEE_DOT=False, PDL=False, W_SCALE=1, SCALE_BN=1, SCALE_BK=1,
                      ACT_QUANT=act_quant, EXACT_E4M3=False)
    return _compile_sm90(G._gemv_kernel, _GEMV_SIGNATURE, constexprs, c["num_warps"], c["num_stages"]).asm["ptx"]


@pytest.mark.slow      # Triton's compile of four kernels for sm_90 on a 2-core CPU
def test_sm90_rounded_rows_leave_the_k_loop_weight_only():
    """On rounded rows the GEMV converts nothing to e4m3 (the in-kernel rounding does, at every K step), at one row
    on CUDA cores and at eight on tensor cores; `round_rows` converts with the hardware and waits as a PDL
    dependent."""
    for M in (1, 8):
        assert "e4m3x2.f32" not in _gemv_ptx(3, M, False)
        assert "cvt.rn.satfinite.e4m3x2.f32" in _gemv_ptx(1, M, True)
    import ember.kernels.gemv_fp8 as F8
    signature = dict(x_ptr="*bf16", norm_weight_ptr="*bf16", static_scale_ptr="*fp32", out_ptr="*bf16",
                     scale_ptr="*fp32", K="i32", stride_xm="i32", stride_om="i32", eps="fp32")
    constexprs = dict(BLOCK=1024, STEPS=14, NORM=True, STATIC=False, EXACT_E4M3=False, PDL=True)
    ptx = _compile_sm90(F8._round_rows_kernel, signature, constexprs, 4, 1).asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "griddepcontrol.wait" in ptx
