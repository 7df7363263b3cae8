"""The one-row fp8 GEMV that reads W and x a word at a time (ember.kernels.gemv_fp8_words), interpreted on the CPU
(its word layout and epilogues; the inline-PTX widening runs on GPUs only, and compiles for sm_90 here): the same
outputs as the general GEMV up to float32 summation order, weight-only and on `round_rows`' output, with each
epilogue; and where it does not apply, the general kernel runs."""

import pytest
import torch

pytest.importorskip("triton")

from ember.kernels import gemv_fp8_words as words  # noqa: E402
from ember.kernels.fp8 import quantize_rows  # noqa: E402
from ember.kernels.gemv_config import CPU_SMS, gemv_config  # noqa: E402
from ember.kernels.gemv_fp8 import gemv_fp8  # noqa: E402


def _case(N, K, gated, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * N if gated else N
    w = torch.randn(rows, K, generator=g) / K ** 0.5 * torch.linspace(0.2, 3.0, rows)[:, None]
    weight, scale = quantize_rows(w)
    x = (torch.randn(1, K, generator=g) * 3).to(torch.bfloat16)
    bias = torch.randn(rows, generator=g).to(torch.bfloat16)
    residual = torch.randn(1, N, generator=g).to(torch.bfloat16)
    return weight, scale.reshape(-1).float().contiguous(), x, bias, residual


@pytest.fixture
def on():
    before = words.enabled()
    words.set_enabled(True)
    yield
    words.set_enabled(before)


@pytest.mark.parametrize("activations", ["none", "dynamic"])
@pytest.mark.parametrize("epilogue", ["plain", "bias_gated", "gated_residual"])
def test_words_give_the_general_kernels_outputs(on, monkeypatch, activations, epilogue):
    N, K = 40, 512
    gated = "gated" in epilogue
    weight, scale, x, bias, residual = _case(N, K, gated)
    kwargs = dict(bias=bias if "bias" in epilogue else None, residual=residual if "residual" in epilogue else None,
                  gated=gated, activations=activations)
    config = gemv_config(1, N, K, CPU_SMS, 1, gated=gated)
    assert words.applies(x, weight, config, kwargs["residual"])
    calls, real = [], words.gemv_fp8_words
    monkeypatch.setattr(words, "gemv_fp8_words", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = gemv_fp8(x, weight, scale, **kwargs)
    assert calls == [1]
    words.set_enabled(False)
    reference = gemv_fp8(x, weight, scale, **kwargs)
    assert len(calls) == 1
    assert out.dtype == reference.dtype == torch.bfloat16 and out.shape == reference.shape == (1, N)
    # float32 sums in another order, then one rounding to bfloat16: at most one bfloat16 step apart
    step = reference.float().abs().clamp_min(2 ** -8) * 2 ** -7
    assert ((out.float() - reference.float()).abs() <= step).all()
    assert not torch.equal(out, torch.zeros_like(out))


def test_sm90_code_widens_whole_words_and_streams_w_in_16_byte_loads():
    """Compiled for an H100 (no GPU needed): e4m3 pairs go to `cvt.rn.f16x2.e4m3x2` straight from the loaded words
    (no byte taken apart: no `cvt.u16.u32`), and W arrives in 16-byte loads."""
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    c = gemv_config(1, 4096, 14336, 132, 1)
    signature = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "act_scale_ptr": "*fp32",
                 "bias_ptr": "*bf16", "residual_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "K": "i32"}
    constexprs = dict(BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], GATED=False, HAS_BIAS=False, HAS_RESIDUAL=True,
                      ACT_SCALE=True, ASM=True, PDL=False)
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(signature))}
    compiled = triton.compile(ASTSource(fn=triton.runtime.jit.JITFunction(words._words_kernel.fn),
                                        signature={**signature, **{n: "constexpr" for n in constexprs}},
                                        constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=c["num_warps"]))
    ptx = compiled.asm["ptx"]
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.u16.u32" not in ptx
    assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx)
