"""The one-row TMA GEMV (ember/kernels/gemv_tma.py), interpreted on the CPU (the interpreter emulates the tensor
descriptors), against the register-streaming kernel with every fusion; when a stored TMA shape applies; and its
H100 code (compiled on the CPU): the weight tiles arrive by bulk copies, in a pipelined loop.

Tolerance: both kernels sum in float32 in different orders; 1e-5 of the output scale in float32, and in float16 one
ulp of the largest output (2**-10), as the final rounding may fall either way."""

import pytest
import torch

triton = pytest.importorskip("triton")

import ember.kernels.gemv as G   # noqa: E402
import ember.kernels.gemv_tma as T   # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2.0 ** -10}


def _inputs(n, k, dtype, gated, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * n if gated else n
    return (torch.randn(1, k, generator=g).to(dtype), (torch.randn(rows, k, generator=g) * k ** -0.5).to(dtype),
            torch.randn(rows, generator=g).to(dtype), torch.randn(1, n, generator=g).to(dtype),
            (torch.rand(k, generator=g) + 0.5).to(dtype))


FUSIONS = {"plain": (False, False, False, False), "bias_residual": (True, True, False, False),
           "norm": (False, False, True, False), "norm_gated": (False, False, True, True),
           "all": (True, True, True, True)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("fusion", list(FUSIONS))
def test_tma_kernel_matches_the_register_kernel(monkeypatch, fusion, dtype):
    has_bias, has_residual, norm, gated = FUSIONS[fusion]
    n, k, shape = 48, 128, (16, 32, 3)
    x, weight, bias, residual, norm_weight = _inputs(n, k, dtype, gated)
    kwargs = dict(bias=bias if has_bias else None, residual=residual if has_residual else None,
                  norm_weight=norm_weight if norm else None, gated=gated)
    monkeypatch.setattr(G, "tma_shape", lambda *args: None)
    expected = G.gemv(x, weight, **kwargs)
    used = []
    monkeypatch.setattr(G, "tma_shape", lambda *args: used.append(args) or shape)
    out = G.gemv(x, weight, **kwargs)
    assert used == [(weight.shape[0], k, gated, G.CPU_SMS, x.element_size())]
    assert out.shape == (1, n) and out.dtype == dtype
    scale = expected.float().abs().max().item()
    assert (out.float() - expected.float()).abs().max().item() <= TOLERANCE[dtype] * scale


def test_float32_out_and_shapes_it_does_not_take(monkeypatch):
    """out_dtype float32 holds the rounded values; more than one row, or N / K not whole blocks, take the register
    kernel (the stored shape is not used)."""
    x, weight, _, _, _ = _inputs(48, 128, torch.float16, False)
    monkeypatch.setattr(G, "tma_shape", lambda *args: (16, 32, 3))
    out = G.gemv(x, weight, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, out.half().float())
    assert T.tma_applies(x, weight, 48, (16, 32, 3))
    assert not T.tma_applies(x, weight, 48, (32, 32, 3))           # 48 columns: not whole 32-column blocks
    assert not T.tma_applies(x, weight, 48, (16, 96, 3))           # K 128: not whole 96-element steps
    assert not T.tma_applies(torch.cat([x, x]), weight, 48, (16, 32, 3))
    assert not T.tma_applies(x, weight.t().contiguous().t(), 48, (16, 32, 3))


def test_sm90_code_copies_weight_tiles_in_bulk():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = triton.runtime.jit.JITFunction(T._gemv_tma_kernel.fn)    # compiled even where TRITON_INTERPRET=1
    signature = {"x_ptr": "*bf16", "w_desc": "tensordesc<bf16[16, 256]>", "bias_ptr": "*bf16",
                 "residual_ptr": "*bf16", "norm_weight_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "K": "i32",
                 "eps": "fp32"}
    constexprs = dict(BLOCK_N=16, BLOCK_K=256, STAGES=4, HAS_BIAS=False, HAS_RESIDUAL=False, NORM=True, GATED=True,
                      PDL=True)
    signature.update({name: "constexpr" for name in constexprs})
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ttgir = compiled.asm["ttgir"]
    # gate and up tiles, each in the pipeline's prologue and in its loop
    assert ttgir.count("async_tma_copy_global_to_local") >= 4
    assert "ttng.wait_barrier" in ttgir
    assert compiled.metadata.shared >= 3 * 2 * 16 * 256 * 2 // 2     # several stages of gate and up tiles
