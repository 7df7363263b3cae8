"""The word-wise fp8 GEMV rounding the raw row itself (ember.kernels.gemv_fp8_words, `set_rounding(True)`) on a
GPU, at Llama-3.1-8B's four projections (and the 1B's o_proj, whose launch shape runs 8 warps) under the stored
launch shapes: bit for bit `round_rows` followed by the word-wise kernel on its output.

Exact, not within a tolerance: the K loop and its config are the same kernel's; the rounded values are the same
because every step is the same instruction on the same operands (x / scale is `div.full.f32` in both, the e4m3
conversion `cvt.rn.satfinite.e4m3x2.f32`), and the scale is the same value: the amax does not depend on the order
it is taken in, and the sum of squares (with the norm) is reduced in `round_rows`' steps and layout (1024 values a
step over 4 warps; a launch shape of another warp count keeps `round_rows`, `applies`). Also through a CUDA graph."""

import pytest
import torch

import ember.kernels.gemv_fp8 as F8
from ember.kernels import gemv_fp8_words as words
from ember.kernels.fp8 import quantize_rows
from ember.kernels.gemv_config import gemv_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPES = {   # name: (N outputs, K, gated, the RMSNorm folded in)
    "llama-3.1-8b qkv": (6144, 4096, False, True), "llama-3.1-8b o_proj": (4096, 4096, False, False),
    "llama-3.1-8b gate_up": (14336, 4096, True, True), "llama-3.1-8b down": (4096, 14336, False, False),
    "llama-3.2-1b o_proj": (2048, 2048, False, False),
}
X_SCALES = [1e-3, 3.0, 40.0, 0.0]     # small, ordinary, saturating under the static scale, all zero (the amax floor)
EPS = 1e-5


@pytest.fixture
def rounding():
    before = words.enabled(), words.rounding()
    words.set_enabled(True)
    words.set_rounding(True)
    yield
    words.set_enabled(before[0])
    words.set_rounding(before[1])


def _refused(*args, **kwargs):
    raise AssertionError("round_rows was launched")


def _case(name: str):
    N, K, gated, norm = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(N + K)
    w = torch.randn(2 * N if gated else N, K, generator=g, device="cuda") / K ** 0.5
    weight, scale = quantize_rows(w)
    x = torch.randn(1, K, generator=g, device="cuda")
    norm_weight = 1 + 0.2 * torch.randn(K, generator=g, device="cuda", dtype=torch.bfloat16) if norm else None
    residual = None if norm else torch.randn(1, N, generator=g, device="cuda", dtype=torch.bfloat16)
    return weight, scale.reshape(-1).float().contiguous(), x, norm_weight, gated, residual


@pytest.mark.parametrize("activations", ["dynamic", "static"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_rounding_in_the_kernel_equals_round_rows_then_the_kernel(rounding, monkeypatch, name, activations):
    weight, scale, x32, norm_weight, gated, residual = _case(name)
    N, K = weight.shape[0] // (2 if gated else 1), weight.shape[1]
    config = gemv_config(1, N, K, torch.cuda.get_device_properties(0).multi_processor_count, 1, gated=gated)
    # the normed x is about unit-normal: a smaller static scale saturates its tails too
    input_scale = torch.tensor([0.005 if norm_weight is not None else 0.05], device="cuda") \
        if activations == "static" else None
    calls, launch, round_rows = [], words.gemv_fp8_words, F8.round_rows
    monkeypatch.setattr(words, "gemv_fp8_words", lambda *a, **k: calls.append(k["act_quant"]) or launch(*a, **k))
    monkeypatch.setattr(F8, "round_rows", _refused)
    for x_scale in X_SCALES:
        x = (x32 * x_scale).to(torch.bfloat16)
        assert words.applies(x, weight, config, residual, norm_weight)
        out = F8.gemv_fp8(x, weight, scale, None, residual, activations=activations, input_scale=input_scale,
                          norm_weight=norm_weight, eps=EPS, gated=gated)
        rounded, row_scale = round_rows(x, norm_weight, EPS, input_scale)
        reference = launch(rounded, weight, scale, config, row_scale, None, residual, gated)
        assert torch.equal(out, reference), (x_scale, (out.float() - reference.float()).abs().max().item())
        if activations == "static" and x_scale == 40.0:
            assert rounded.abs().max().item() == 448.0
    assert calls == [F8.ACTIVATIONS[activations]] * len(X_SCALES)


def test_rounding_in_the_kernel_replays_in_a_cuda_graph(rounding):
    """Captured with its PDL wait before the row's scale: a replay on new x gives the eager output."""
    weight, scale, x32, norm_weight, gated, _ = _case("llama-3.1-8b gate_up")
    x = x32.to(torch.bfloat16)
    outs = {}

    def run():
        outs["graph"] = F8.gemv_fp8(x, weight, scale, activations="dynamic", norm_weight=norm_weight, eps=EPS,
                                    gated=gated)
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    x.copy_(3 * torch.randn_like(x32))
    graph.replay()
    torch.cuda.synchronize()
    eager = F8.gemv_fp8(x, weight, scale, activations="dynamic", norm_weight=norm_weight, eps=EPS, gated=gated)
    assert torch.equal(outs["graph"], eager)
    words.set_rounding(False)
    assert torch.equal(eager, F8.gemv_fp8(x, weight, scale, activations="dynamic", norm_weight=norm_weight, eps=EPS,
                                          gated=gated))
