"""The fusion passes on a GPU: tiny Qwen3 and Llama models in bf16, piecewise-compiled with the passes and without,
over a prefill step (the fused op's composed path: Triton RMSNorm, cuBLAS, Triton SiLU·mul) and a decode step (the
fused GEMV). Hidden states agree within 2**-5 of their scale: a few bf16 ulps of the largest value after two layers
of differently rounded sums; a fusion wired to the wrong weight, eps or operand moves them by about the scale."""

import pytest
import torch

from ember.graphs.compile import CompiledModel
from ember.models.loader import random_model
from tests.helpers.model_harness import ModelHarness, tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _run(family: str, disabled, cache_root):
    model = random_model(tiny_config(family, hidden_size=256, intermediate_size=512), torch.bfloat16, "cuda")
    harness = ModelHarness(model, 2, dtype=torch.bfloat16, device="cuda")
    compiled = CompiledModel(model, cache_root=cache_root, disabled_fusions=disabled)
    harness.model = compiled
    with torch.inference_mode():
        prefill = harness.step([(0, [5, 17, 300, 2]), (1, [40, 41, 42])])
        decode = harness.step([(0, [9]), (1, [11])])
    return prefill, decode, dict(compiled.fusion.counts)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fused_model_equals_unfused_on_gpu(family, tmp_path):
    fused = _run(family, (), tmp_path)
    unfused = _run(family, ("all",), tmp_path)
    assert fused[2] == {"sibling_linears": 0, "rms_norm_prologue": 4, "silu_mul_epilogue": 2, "residual_epilogue": 4,
                        "residual_all_reduce": 0, "qk_norm_rope": 2 if family == "qwen3" else 0}
    for got, ref in zip(fused[:2], unfused[:2]):
        scale = ref.float().abs().max().item()
        err = (got.float() - ref.float()).abs().max().item()
        assert err <= 2.0 ** -5 * scale, f"max abs error {err:.3g} at scale {scale:.3g}"
