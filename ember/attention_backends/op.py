"""The `ember::attention` custom op and the forward context it reads its per-step metadata from.

The op is the one place where the compiled model hands control to an attention backend: torch.compile treats
it as opaque (it has a fake implementation), and the piecewise compile splits the FX graph exactly there.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ember.attention_backends.base import AttentionImpl, RopeInputs
from ember.kernels.library import define, register_fake


@dataclass
class AttentionLayerState:
    """What the op needs for one layer: its impl, its cache tensor, and which KV-cache group it belongs to."""
    impl: AttentionImpl
    kv_cache: torch.Tensor
    group_index: int


@dataclass
class ForwardContext:
    """Set around each forward: the static layer table and this step's metadata per KV-cache group."""
    layers: dict[str, AttentionLayerState]
    attn_metadata: tuple[Any, ...] = field(default_factory=tuple)
    # set by the runner for the CUDA-graph machinery in ember.graphs (a BatchDescriptor and a CUDAGraphMode)
    batch_descriptor: Any = None
    cudagraph_runtime_mode: Any = None


_current: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("ember_forward_context", default=None)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make `ctx` visible to `ember::attention` for the duration of a forward (or a graph capture)."""
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError("ember::attention was called outside a forward context; run the model through the engine "
                           "or wrap the call in ember.attention_backends.op.forward_context(...)")
    return ctx


def run_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                  layer_name: str, rope: RopeInputs | None = None) -> None:
    """The body of `ember::attention`: the layer's backend impl over its cache and this step's metadata. Eager CPU
    forwards call it directly; a custom op's dispatch costs more than a small decode's attention there."""
    ctx = get_forward_context()
    layer = ctx.layers[layer_name]
    metadata = ctx.attn_metadata[layer.group_index]
    if rope is None:
        layer.impl.forward(query, key, value, layer.kv_cache, metadata, out)
    else:
        layer.impl.forward_rope(query, key, value, layer.kv_cache, metadata, out, rope)


@define("attention", mutates_args=("out",))
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, layer_name: str,
              cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
              k_norm: torch.Tensor | None = None, norm_eps: float = 0.0) -> None:
    """query [T, Hq, D], key/value [T, Hkv, D]; writes the attention output into out [T, Hq, D]. With cos/sin
    ([T, D/2] float32), query and key have not had the model's rotary yet, nor its per-head RMSNorm where the
    q_norm/k_norm weights ([D]) are given: the backend applies them (`AttentionImpl.forward_rope`)."""
    rope = None if cos is None else RopeInputs(cos, sin, q_norm, k_norm, norm_eps)
    run_attention(query, key, value, out, layer_name, rope)


@register_fake("attention")
def _attention_fake(query, key, value, out, layer_name, cos=None, sin=None, q_norm=None, k_norm=None,
                    norm_eps=0.0) -> None:
    return None
