"""ember's ops as `ember.kernels.library` defines them: the schemas the compiled graphs and saved artifacts name,
and a call through the dispatcher reaching the body."""

import torch

import ember.attention_backends.op  # noqa: F401  (registers ember::attention)
import ember.kernels.fused_linear  # noqa: F401  (registers ember::fused_linear and ember::linear)
import ember.kernels.qk_norm_rope  # noqa: F401  (registers ember::qk_norm_rope)
from ember.kernels.library import define, register_fake

SCHEMAS = {
    "linear": "ember::linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    "fused_linear": "ember::fused_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? norm_weight, float eps, "
                    "bool gated, Tensor? residual) -> Tensor",
    "qk_norm_rope": "ember::qk_norm_rope(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor cos, "
                    "Tensor sin, float eps) -> (Tensor, Tensor)",
    "attention": "ember::attention(Tensor query, Tensor key, Tensor value, Tensor(a3!) out, str layer_name, "
                 "Tensor? cos=None, Tensor? sin=None, Tensor? q_norm=None, Tensor? k_norm=None, "
                 "float norm_eps=0.) -> ()",
}


def test_the_ops_keep_their_schemas():
    for name, schema in SCHEMAS.items():
        assert str(getattr(torch.ops.ember, name).default._schema) == schema


def test_a_defined_op_calls_its_body_and_traces_through_its_fake():
    lib = torch.library.Library("ember_library_test", "FRAGMENT")
    calls = []

    @define("scale", library=lib)
    def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
        calls.append(factor)
        return x * factor

    @register_fake("scale", library=lib)
    def _scale_fake(x, factor):
        return torch.empty_like(x)

    x = torch.arange(4.0)
    with torch.inference_mode():
        torch.testing.assert_close(torch.ops.ember_library_test.scale(x, 3.0), x * 3.0)
    assert calls == [3.0]
    from torch._subclasses import FakeTensorMode
    with FakeTensorMode() as mode:
        out = torch.ops.ember_library_test.scale(mode.from_tensor(x), 2.0)
    assert out.shape == (4,) and calls == [3.0]     # the fake ran, not the body
