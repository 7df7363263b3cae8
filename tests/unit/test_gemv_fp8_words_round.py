"""The word-wise fp8 GEMV rounding the raw row itself (ember.kernels.gemv_fp8_words with `set_rounding(True)`),
interpreted on the CPU: bit for bit the outputs of `round_rows` followed by the word-wise kernel on the rounded row,
dynamic (with and without the RMSNorm folded in) and static (with it), with the bias, SiLU·mul and residual
epilogues, K past a multiple of `round_rows`' step, and all-zero rows (the amax floor); and the routing: switched
on, a one-row call launches no `round_rows`, and calls the kernel cannot take still do."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import ember.kernels.gemv_fp8 as F8  # noqa: E402
from ember.kernels import gemv_fp8_words as words  # noqa: E402
from ember.kernels.fp8 import quantize_rows  # noqa: E402
from ember.kernels.gemv_config import CPU_SMS, gemv_config  # noqa: E402
from ember.kernels.gemv_fp8 import gemv_fp8, round_rows  # noqa: E402

EPS = 1e-5
N = 32
K = 1536 + 1024     # three of `round_rows`' 1024-value steps, the last one half masked; a multiple of the K step
STATIC_SCALE = 0.004


def _case(gated: bool, zero_x: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * N if gated else N
    w = torch.randn(rows, K, generator=g) / K ** 0.5 * torch.linspace(0.2, 3.0, rows)[:, None]
    weight, scale = quantize_rows(w)
    # a few large values: the dynamic scale's amax, and saturation at 448 under the static scale
    x = torch.randn(1, K, generator=g) * torch.where(torch.rand(1, K, generator=g) < 0.01, 30.0, 2.0)
    x = torch.zeros(1, K) if zero_x else x
    norm_weight = (1 + 0.3 * torch.randn(K, generator=g)).to(torch.bfloat16)
    bias = torch.randn(rows, generator=g).to(torch.bfloat16)
    residual = torch.randn(1, N, generator=g).to(torch.bfloat16)
    return weight, scale.reshape(-1).float().contiguous(), x.to(torch.bfloat16), norm_weight, bias, residual


@pytest.fixture
def rounding():
    before = words.enabled(), words.rounding()
    words.set_enabled(True)
    words.set_rounding(True)
    yield
    words.set_enabled(before[0])
    words.set_rounding(before[1])


@pytest.fixture
def no_round_rows(monkeypatch):
    """`round_rows` replaced by a refusal: a test that passes with it launched none."""
    def refuse(*args, **kwargs):
        raise AssertionError("round_rows was launched")
    monkeypatch.setattr(F8, "round_rows", refuse)


# (activations, norm, epilogue, all-zero x): every epilogue, the norm with both activation modes, the amax floor with
# the norm and without
CASES = [("dynamic", True, "gated", False), ("dynamic", False, "bias_residual", False),
         ("static", True, "bias_gated_residual", False), ("static", False, "gated", False),
         ("dynamic", True, "bias_residual", True), ("dynamic", False, "bias_residual", True)]


@pytest.mark.parametrize("activations,norm,epilogue,zero_x", CASES,
                         ids=[f"{a}-norm{int(n)}-{e}{'-zero_x' if z else ''}" for a, n, e, z in CASES])
def test_rounding_in_the_kernel_equals_round_rows_then_the_kernel(rounding, no_round_rows, monkeypatch, activations,
                                                                   norm, epilogue, zero_x):
    gated = "gated" in epilogue
    weight, scale, x, norm_weight, bias, residual = _case(gated, zero_x)
    norm_weight = norm_weight if norm else None
    bias = bias if "bias" in epilogue else None
    residual = residual if "residual" in epilogue else None
    input_scale = torch.tensor([STATIC_SCALE]) if activations == "static" else None
    config = gemv_config(1, N, K, CPU_SMS, 1, gated=gated)
    assert K % config["BLOCK_K"] == 0 and K % 1024 and config["num_warps"] == 4
    calls, launch = [], words.gemv_fp8_words
    monkeypatch.setattr(words, "gemv_fp8_words", lambda *a, **k: calls.append(k["act_quant"]) or launch(*a, **k))
    out = gemv_fp8(x, weight, scale, bias, residual, config=config, activations=activations,
                   input_scale=input_scale, norm_weight=norm_weight, eps=EPS, gated=gated)
    assert calls == [F8.ACTIVATIONS[activations]]          # the raw row went to the word-wise kernel

    rounded, row_scale = round_rows(x, norm_weight, EPS, input_scale)
    reference = launch(rounded, weight, scale, config, row_scale, bias, residual, gated)
    assert out.dtype == reference.dtype == torch.bfloat16 and out.shape == reference.shape == (1, N)
    assert torch.equal(out, reference)
    if zero_x:
        assert row_scale.item() == pytest.approx(1e-12 / 448 * (EPS ** -0.5 if norm else 1.0), rel=1e-6)
        assert torch.equal(rounded, torch.zeros_like(rounded))
        # the products are zeros (not 0 / 0): bias + residual, rounded to bfloat16 (the interpreter truncates)
        torch.testing.assert_close(out.float(), bias.float() + residual.float(), rtol=2 ** -7, atol=0)
    else:
        assert not torch.equal(out, torch.zeros_like(out))
        if activations == "static":
            assert rounded.abs().max().item() == 448.0       # saturated values took part


def test_switched_on_a_one_row_call_launches_no_round_rows(rounding, monkeypatch):
    weight, scale, x, norm_weight, _, _ = _case(False)
    launched = []
    real = F8.round_rows
    monkeypatch.setattr(F8, "round_rows", lambda *a, **k: launched.append(1) or real(*a, **k))
    kwargs = dict(activations="dynamic", norm_weight=norm_weight, eps=EPS)
    on = gemv_fp8(x, weight, scale, **kwargs)
    assert launched == []
    words.set_rounding(False)
    off = gemv_fp8(x, weight, scale, **kwargs)
    assert launched == [1]
    assert torch.equal(on, off)
    # two rows, or a K that is no multiple of the K step: `round_rows` as before
    words.set_rounding(True)
    gemv_fp8(torch.cat([x, x]), weight, scale, **kwargs)
    assert launched == [1, 1]
    odd = dict(gemv_config(1, N, K, CPU_SMS, 1), BLOCK_K=2048)
    gemv_fp8(x, weight, scale, config=odd, **kwargs)
    assert launched == [1, 1, 1]


def test_the_switch_is_read_from_the_environment():
    """EMBER_FP8_WORDS_ROUND=1 turns it on in a fresh process (off by default: the fixture above restores it)."""
    env = dict(os.environ, EMBER_FP8_WORDS_ROUND="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    code = "import ember.kernels.gemv_fp8_words as w; print(w.rounding())"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["True"]


def test_sm90_loop_rounds_each_value_once_a_thread_without_shared_memory():
    """Compiled for an H100 (no GPU needed) at Llama-3.1-8B's o_proj (4 W rows a thread) and qkv (2, the norm
    folded in) under the stored launch shapes: the K loop moves nothing through shared memory (x reaches W's
    register layout by its broadcast load) and saturates each of a thread's 16 values a step once (two FMNMX), not
    once for every W row it holds."""
    from benches.experiments.gemv_sass import words as loop_of
    for n, k, norm in ((4096, 4096, False), (6144, 4096, True)):
        ops, _ = loop_of(n, k, False, 1, norm)
        assert ops["BAR"] == ops["LDS"] == ops["STS"] == 0
        assert ops["FMNMX"] == 2 * 16
        assert ops["FFMA"] == (64 if n == 4096 else 32)       # the products: a thread's W bytes a step
