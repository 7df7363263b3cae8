"""The fusion passes (ember/graphs/passes) on the CPU: each on a toy aten graph (matches counted, output equal to
the unfused graph, the pass can be turned off), the whole pipeline on tiny models, and the hook in the compile.

On a CPU `ember::fused_linear` runs its torch reference, which rounds as the unfused ops do, so fused and unfused
outputs agree to 1e-6 of their scale in float32 and to one bfloat16 ulp (2**-8 relative) in bfloat16 (Inductor's
C++ kernels may round the unfused norm differently from eager torch; the graphs here run eagerly)."""

import pytest
import torch
from torch import nn

from ember.attention_backends.op import forward_context
from ember.graphs.passes.pipeline import PASSES, FusionPipeline, check_pass_names
from ember.kernels.linear_op import linear
from ember.models.layers.activation import SiluAndMul
from ember.models.layers.norm import RMSNorm
from tests.helpers.model_harness import tiny_model_step
from tests.helpers.post_grad import count_calls, fused_and_reference, post_grad_graph

FUSED = torch.ops.ember.fused_linear.default
QK = torch.ops.ember.qk_norm_rope.default
LINEAR = torch.ops.ember.linear.default
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2.0 ** -8}


class ToyMLPBlock(nn.Module):
    """o_proj + residual, RMSNorm, gate/up + SiLU·mul, down + residual: one match of each pass but the norm's
    (which also has one), written as a model file writes them."""

    def __init__(self, hidden: int = 32, intermediate: int = 48, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.o = nn.Parameter(torch.randn(hidden, hidden, generator=g).to(dtype) / hidden ** 0.5)
        self.gate_up = nn.Parameter(torch.randn(2 * intermediate, hidden, generator=g).to(dtype) / hidden ** 0.5)
        self.down = nn.Parameter(torch.randn(hidden, intermediate, generator=g).to(dtype) / intermediate ** 0.5)
        self.norm = RMSNorm(hidden, eps=1e-5).to(dtype)
        self.norm.weight = nn.Parameter((1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype))
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = linear(x, self.o) + residual
        return linear(self.act(linear(self.norm(h), self.gate_up)), self.down) + h


def _inputs(dtype, num_tokens=5, hidden=32):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(num_tokens, hidden, generator=g).to(dtype),
            (3 * torch.randn(num_tokens, hidden, generator=g)).to(dtype))


def _assert_close(out, ref, dtype):
    scale = ref.float().abs().max().item()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOLERANCE[dtype] * scale, f"max abs error {err:.3g} at scale {scale:.3g}"


EXPECTED = {"sibling_linears": 0, "rms_norm_prologue": 1, "silu_mul_epilogue": 1, "residual_epilogue": 2,
            "residual_all_reduce": 0, "qk_norm_rope": 0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("disabled", [(), *[(name,) for name in PASSES], ("all",)],
                         ids=["all_on", *[f"{n}_off" for n in PASSES], "all_off"])
def test_passes_on_a_toy_block(dtype, disabled):
    block = ToyMLPBlock(dtype=dtype)
    x, residual = _inputs(dtype)
    with torch.inference_mode():
        gm = post_grad_graph(block, x, residual)
        reference = gm(x, residual)
        assert count_calls(gm, LINEAR) == 3 and count_calls(gm, FUSED) == 0
        pipeline = FusionPipeline(disabled)
        pipeline(gm.graph)
        gm.recompile()
        out = gm(x, residual)
    off = set(check_pass_names(disabled))
    assert pipeline.counts == {n: c for n, c in EXPECTED.items() if n not in off}
    # o_proj and down take the residual; gate_up takes the norm and/or the activation
    on = set(PASSES) - off
    fused = 2 * ("residual_epilogue" in on) + bool(on & {"rms_norm_prologue", "silu_mul_epilogue"})
    assert count_calls(gm, FUSED) == fused and count_calls(gm, LINEAR) == 3 - fused
    _assert_close(out, reference, dtype)
    assert out.dtype == dtype


def test_pass_names_are_checked_and_part_of_the_cache_key():
    with pytest.raises(ValueError, match="fusion pass 'rms_norm' is not known"):
        FusionPipeline(("rms_norm",))
    keys = {FusionPipeline(d).uuid() for d in [(), ("residual_epilogue",), ("all",)]}
    assert len(keys) == 3
    assert FusionPipeline(()).uuid() == FusionPipeline(()).uuid()


def test_summary_lists_matches_and_disabled_passes():
    pipeline = FusionPipeline(("silu_mul_epilogue",))
    pipeline.counts["rms_norm_prologue"] = 4
    pipeline.num_graphs = 3
    assert pipeline.summary(26) == ("fusion passes over 3 compiled graphs, 26 more from the cache: "
                                    "sibling_linears 0, rms_norm_prologue 4, residual_epilogue 0, residual_all_reduce 0, qk_norm_rope 0; "
                                    "off: silu_mul_epilogue")


def test_norm_feeding_two_users_stays_for_the_other_one():
    """A normed tensor that something besides the linear reads is still computed for it; the linear fuses."""
    norm = RMSNorm(16).to(torch.float32)
    norm.weight = nn.Parameter(torch.linspace(0.5, 1.5, 16))
    weight = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))

    def fn(x):
        normed = norm(x)
        return linear(normed, weight), normed * 2

    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        gm = post_grad_graph(fn, x)
        reference = gm(x)
        pipeline = FusionPipeline()
        pipeline(gm.graph)
        gm.recompile()
        out = gm(x)
    assert pipeline.counts["rms_norm_prologue"] == 1 and count_calls(gm, torch.ops.aten.rsqrt.default) == 1
    for got, ref in zip(out, reference):
        _assert_close(got, ref, torch.float32)


def _model_graph(family: str, dtype):
    return tiny_model_step(family, dtype)


@pytest.mark.parametrize("family,dtype", [("qwen3", torch.bfloat16), ("llama", torch.float32)],
                         ids=["qwen3-bf16", "llama-fp32"])
def test_fused_model_equals_unfused_model(family, dtype):
    """The whole forward of a tiny model as one aten graph: every projection fuses, the hidden states agree."""
    model, ids, positions, context = _model_graph(family, dtype)
    layers = model.config.num_hidden_layers
    pipeline, gm, out, reference = fused_and_reference(model, ids, positions, context)
    qk = layers if family == "qwen3" else 0
    assert pipeline.counts == {"sibling_linears": 0, "rms_norm_prologue": 2 * layers, "silu_mul_epilogue": layers,
                               "residual_epilogue": 2 * layers, "residual_all_reduce": 0, "qk_norm_rope": qk}
    assert count_calls(gm, LINEAR) == 0 and count_calls(gm, FUSED) == 4 * layers
    assert count_calls(gm, QK) == qk and count_calls(gm, torch.ops.aten.rsqrt.default) == 1   # the final norm
    _assert_close(out, reference, dtype)


@pytest.mark.slow
def test_compiled_model_runs_the_passes(tmp_path):
    """Through the piecewise compile (Inductor's C++ build on the CPU; a fresh cache, so every piece is traced and
    passed through): counts in `.fusion`, output equal to the compile without passes."""
    from ember.graphs.compile import CompiledModel
    outputs, counts = [], []
    for disabled in [(), ("all",)]:
        model, ids, positions, context = _model_graph("qwen3", torch.bfloat16)
        compiled = CompiledModel(model, cache_root=tmp_path, disabled_fusions=disabled)
        with torch.inference_mode(), forward_context(context):
            outputs.append(compiled(ids, positions))
        counts.append(dict(compiled.fusion.counts))
    layers = 2
    assert counts == [{"sibling_linears": 0, "rms_norm_prologue": 2 * layers, "silu_mul_epilogue": layers,
                       "residual_epilogue": 2 * layers, "residual_all_reduce": 0, "qk_norm_rope": layers}, {}]
    # Inductor's C++ kernels round the unfused norm and residual adds their own way: one bf16 ulp of the largest
    # output (at most 2**-6 of the scale) apart
    scale = outputs[1].float().abs().max().item()
    assert (outputs[0].float() - outputs[1].float()).abs().max().item() <= 2.0 ** -6 * scale


@pytest.mark.parametrize("disabled", [(), ("qk_norm_rope",)], ids=["on", "off"])
def test_qk_norm_rope_pass_on_one_attention_layer(disabled):
    """Qwen3's attention up to the attention op: the q/k norm and rotary become one op (or stay, when off)."""
    model, ids, positions, context = _model_graph("qwen3", torch.bfloat16)
    attn = model.model.layers[0].self_attn
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    cos, sin = model.model.rotary_emb(positions)

    def fn(hidden, cos, sin):
        q, k, v = attn.qkv_proj.forward_split(hidden)
        return attn._norm_rotate_qk(cos, sin, q, k)

    with torch.inference_mode():
        gm = post_grad_graph(fn, hidden, cos, sin)
        reference = gm(hidden, cos, sin)
        pipeline = FusionPipeline(disabled)
        pipeline(gm.graph)
        gm.recompile()
        out = gm(hidden, cos, sin)
    on = not disabled
    assert pipeline.counts.get("qk_norm_rope", 0) == int(on) and count_calls(gm, QK) == int(on)
    assert count_calls(gm, torch.ops.aten.clone.default) == (0 if on else 2)
    for got, ref in zip(out, reference):
        assert got.is_contiguous() and got.shape == ref.shape
        _assert_close(got, ref, torch.bfloat16)
