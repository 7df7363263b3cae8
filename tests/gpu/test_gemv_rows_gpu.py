"""The GEMV (bf16, with the fused RMSNorm prologue and the gate/up epilogue) on a GPU at 2, 4, 5 and 8 rows under
every launch shape `benches/gemv_sweep.py shapes --rows` can store for Llama-3.1-8B's gate_up and down and
Qwen3-0.6B's qkv (tensor-core ones, 8-warp CUDA-core ones), and under every row entry of the stored shapes table,
against the float32 reference within tests/gpu/test_gemv_gpu.py's bound ((2**-8 + 1e-4) s, s the largest output;
gated outputs pass silu(gate) * up through one more bfloat16 rounding each, hence 2**-7 there)."""

import pytest
import torch
import torch.nn.functional as F

from benches import gemv_row_shapes as RS
import ember.kernels.gemv as G
from ember.kernels import gemv_routing as R

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPES = {"llama-3.1-8b gate_up": (14336, 4096, True), "llama-3.1-8b down": (4096, 14336, False),
          "qwen3-0.6b qkv": (4096, 1024, False)}     # (output columns, K, gated)


def _check(M, N, K, gated, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, generator=g, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(2 * N if gated else N, K, generator=g, device="cuda") * K ** -0.5).to(torch.bfloat16)
    norm = (1 + 0.1 * torch.randn(K, generator=g, device="cuda")).to(torch.bfloat16)
    out = G.gemv(x, weight, norm_weight=norm, gated=gated)
    xf = x.float()
    h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.float()).to(torch.bfloat16).float()
    y = h @ weight.float().T
    reference = F.silu(y[:, :N]) * y[:, N:] if gated else y
    scale = reference.abs().max().item()
    err = (out.float() - reference).abs().max().item()
    assert err <= (2.0 ** (-7 if gated else -8) + 1e-4) * scale, f"M={M} N={N} K={K}: {err:.3g} of {scale:.3g}"


@pytest.mark.parametrize("M", [2, 4, 5, 8])
@pytest.mark.parametrize("name", list(SHAPES))
def test_every_candidate_of_the_sweep_computes_right(name, M):
    N, K, gated = SHAPES[name]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = RS.candidates(M, N, K, gated, sms, 2)
    assert len(grid) >= 3
    for shape in grid:
        with RS.forced_row_shape(shape):
            _check(M, N, K, gated, seed=M)


def test_every_stored_row_entry_computes_right():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    entries = [(key, shape) for key, shape in R.load_row_shapes().items() if key[3] == sms]
    if not entries:
        pytest.skip(f"the stored table has no row shapes for {sms} SMs")
    for (n_rows, k, gated, _, _, rows), shape in entries:
        with RS.forced_row_shape(shape):
            _check(rows, n_rows // 2 if gated else n_rows, k, gated)
