"""The small-M linear kernel (ember/kernels/gemv.py) on a GPU, bf16, on real projection shapes (Qwen3-0.6B,
Llama-3.1-8B, a 151936-row lm_head) at 1..16 rows: against the float32 reference and cuBLAS (F.linear), through
the `ember::linear` op, and captured in a CUDA graph.

Tolerances, relative to the output scale s = max |float32 reference|: within (2**-8 + 1e-4) s of the reference, i.e.
half a bfloat16 ulp of the largest output (the one rounding, the final cast) plus float32 summation (tensor cores
may truncate their float32 sums: at K = 14336 that drifts by ~3e-5 s); and within (2**-7 + 2e-4) s of F.linear,
whose own result is within the same bound of the reference. Not bitwise: cuBLAS sums in another order, so outputs
near a rounding boundary may round the other way. One bfloat16 ulp too many (2**-7 s) fails the first bound."""

import pytest
import torch
import torch.nn.functional as F

import ember.kernels.gemv as G
import ember.kernels.linear_op as LO

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("gemv_unrouted")]   # the kernel at every row count


SHAPES = {   # name: (N, K) of W [N, K]
    "qwen3-0.6b qkv": (4096, 1024), "qwen3-0.6b gate_up": (6144, 1024), "qwen3-0.6b o_proj": (1024, 2048),
    "qwen3-0.6b down": (1024, 3072), "llama-3.1-8b qkv": (6144, 4096), "llama-3.1-8b o_proj": (4096, 4096),
    "llama-3.1-8b gate_up": (28672, 4096), "llama-3.1-8b down": (4096, 14336), "lm_head": (151936, 1024),
}
ROWS = [1, 2, 4, 8, 16]
DTYPE = torch.bfloat16


def _tolerances(reference: torch.Tensor) -> tuple[float, float]:
    """(against the float32 reference, against F.linear)."""
    scale = reference.abs().max().item()
    return (2.0 ** -8 + 1e-4) * scale, (2.0 ** -7 + 2e-4) * scale


@pytest.fixture(scope="module")
def weights():
    """W [N, K] and bias [N] per shape, made once for the module."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return {name: (torch.randn(N, K, generator=g, device="cuda", dtype=DTYPE),
                   torch.randn(N, generator=g, device="cuda", dtype=DTYPE)) for name, (N, K) in SHAPES.items()}


def _x(M, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(M, K, generator=g, device="cuda", dtype=DTYPE)     # [M, K]


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_matches_reference_and_cublas(weights, name, M):
    weight, bias = weights[name]
    x = _x(M, weight.shape[1], seed=M)
    assert LO.gemv_applies(x, weight, bias)
    out = torch.ops.ember.linear(x, weight, bias)
    reference = x.float() @ weight.float().T + bias.float()
    cublas = F.linear(x, weight, bias)
    to_reference, to_cublas = _tolerances(reference)
    config = G.gemv_config(M, *weight.shape, torch.cuda.get_device_properties(0).multi_processor_count)
    err = (out.float() - reference).abs().max().item()
    assert err <= to_reference, f"{name} M={M} {config}: max abs error {err:.3g} > {to_reference:.3g}"
    err = (out.float() - cublas.float()).abs().max().item()
    assert err <= to_cublas, f"{name} M={M} {config}: {err:.3g} from F.linear > {to_cublas:.3g}"
    # the op ran the kernel: the same bits as calling it directly (fixed summation order, no atomics)
    assert torch.equal(out, G.gemv(x, weight, bias))


@pytest.mark.parametrize("M", [1, 8, 16])
@pytest.mark.parametrize("use_dot", [False, True], ids=["cuda_cores", "tensor_cores"])
def test_both_paths_and_residual(weights, M, use_dot):
    weight, bias = weights["qwen3-0.6b down"]        # N = 1024: tensor cores split K over 6 programs
    x = _x(M, weight.shape[1], seed=100 + M)
    residual = _x(M, weight.shape[0], seed=200 + M)
    config = G.gemv_config(M, *weight.shape, torch.cuda.get_device_properties(0).multi_processor_count,
                           use_dot=use_dot)
    out = G.gemv(x, weight, bias, residual, config=config)
    reference = x.float() @ weight.float().T + bias.float() + residual.float()
    err = (out.float() - reference).abs().max().item()
    assert err <= _tolerances(reference)[0], f"M={M} {config}: max abs error {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(dtype):
    g = torch.Generator(device="cuda").manual_seed(3)
    weight = torch.randn(4096, 1024, generator=g, device="cuda").to(dtype)
    for M in (1, 8):
        x = torch.randn(M, 1024, generator=g, device="cuda").to(dtype)
        reference = x.double() @ weight.double().T
        scale = reference.abs().max().item()
        # float16: half an ulp (2**-11); float32 (tl.dot in IEEE precision, never TF32): summation order only
        tol = {torch.float16: 2.0 ** -11 + 1e-4, torch.float32: 1e-5}[dtype] * scale
        err = (torch.ops.ember.linear(x, weight, None).double() - reference).abs().max().item()
        assert err <= tol, f"{dtype} M={M}: max abs error {err:.3g} > {tol:.3g}"


def test_switch_off_gives_cublas_bits(weights):
    weight, bias = weights["qwen3-0.6b qkv"]
    x = _x(4, weight.shape[1], seed=7)
    LO.set_gemv_enabled(False)
    try:
        assert torch.equal(torch.ops.ember.linear(x, weight, bias), F.linear(x, weight, bias))
    finally:
        LO.set_gemv_enabled(True)
    assert not LO.gemv_applies(_x(17, weight.shape[1], seed=7), weight, bias)   # prefill rows go to cuBLAS


@pytest.mark.parametrize("name,M", [("qwen3-0.6b qkv", 1), ("qwen3-0.6b o_proj", 16), ("lm_head", 8),
                                    ("llama-3.1-8b down", 4)])
def test_cuda_graph_capture_and_replay(weights, name, M):
    """Captured after one warm-up call (compiles the kernel); replays read new contents of the static input."""
    weight, bias = weights[name]
    static_x = _x(M, weight.shape[1], seed=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.ops.ember.linear(static_x, weight, bias)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = torch.ops.ember.linear(static_x, weight, bias)
    for seed in (1, 2, 3):
        x = _x(M, weight.shape[1], seed=seed)
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, G.gemv(x, weight, bias)), f"replay {seed} differs from an eager call"
        reference = x.float() @ weight.float().T + bias.float()
        err = (static_out.float() - F.linear(x, weight, bias).float()).abs().max().item()
        assert err <= _tolerances(reference)[1], f"replay {seed}: {err:.3g} from F.linear"


@pytest.mark.parametrize("M", [1, 2, 16])
def test_logits_are_the_bf16_products_in_float32(weights, M):
    """`ember::logits` (the LM head): float32 out, each value a bfloat16 (the product rounded once, as cuBLAS's
    bfloat16 output then `.float()`), within the bounds above of the reference and of F.linear(x, w).float()."""
    weight, _ = weights["lm_head"]
    x = _x(M, weight.shape[1], seed=10 + M)
    out = torch.ops.ember.logits(x, weight)
    assert out.dtype == torch.float32 and out.shape == (M, weight.shape[0])
    assert torch.equal(out, out.to(DTYPE).float()), "a logit is not a bfloat16 value"
    reference = x.float() @ weight.float().T
    to_reference, to_cublas = _tolerances(reference)
    assert (out - reference).abs().max().item() <= to_reference
    assert (out - F.linear(x, weight).float()).abs().max().item() <= to_cublas


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "norm_gated"])
def test_tma_kernel_matches_the_register_kernel(weights, monkeypatch, fused):
    """The TMA kernel (ember.kernels.gemv_tma) at one row of Llama-3.1-8B's gate_up shape, plain and with the RMSNorm
    prologue and SiLU·mul epilogue: within one bfloat16 ulp of the output scale of the register-streaming kernel
    (both sum in float32, in different orders), and plain within the bound above of the reference."""
    weight, _ = weights["llama-3.1-8b gate_up"]
    x = _x(1, weight.shape[1], seed=21)
    norm_weight = torch.rand(weight.shape[1], device="cuda", dtype=DTYPE) + 0.5 if fused else None
    kwargs = dict(norm_weight=norm_weight, gated=fused)
    monkeypatch.setattr(G, "tma_shape", lambda *args: None)
    expected = G.gemv(x, weight, **kwargs)
    used = []
    monkeypatch.setattr(G, "tma_shape", lambda *args: used.append(args) or (16, 256, 3))
    out = G.gemv(x, weight, **kwargs)
    assert used, "the TMA shape was not asked for"
    scale = expected.float().abs().max().item()
    assert (out.float() - expected.float()).abs().max().item() <= 2.0 ** -7 * scale
    if not fused:
        reference = x.float() @ weight.float().T
        assert (out.float() - reference).abs().max().item() <= _tolerances(reference)[0]
