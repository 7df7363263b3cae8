"""The attention function the transformers fallback registers in transformers' attention interface ("ember"):
each call hands a layer's q, k and v to `ember::attention` through the ember `Attention` module attached to that
layer (ember.models.transformers_fallback), checking that the call asks for nothing ember's attention does not
compute. At build time, calls on the meta device are recorded instead (`probing`), to learn each layer's options."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from ember.attention_backends.base import AttentionLayerOptions

ATTN_IMPLEMENTATION = "ember"
ATTENTION_CHILD = "ember_attention"   # the ember Attention module attached to each transformers attention module

# arguments a transformers attention function may be handed that do not change what it computes here
_HARMLESS_ARGS = frozenset({"position_ids", "cache_position", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                            "max_length_k", "output_attentions", "use_cache", "layer_idx", "dropout", "is_causal"})

# a window argument the modeling code did not pass (None passed means: no window for this layer)
NOT_HANDED = object()


class FallbackUnsupported(ValueError):
    """A model the transformers fallback cannot run; the message names the model and the reason."""


@dataclass(frozen=True)
class CallOptions:
    """What one call asks of the attention beyond its tensors: scale (None: head_size ** -0.5), window, soft cap."""
    scale: float | None
    sliding_window: int | None
    soft_cap: float | None


def _where(module: nn.Module) -> str:
    return f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"


def call_options(module: nn.Module, attention_mask: Any, scaling: float | None, sliding_window: Any,
                 softcap: float | None, extra: dict[str, Any]) -> CallOptions:
    """The options of one call of the attention function; FallbackUnsupported naming the first thing it asks that
    ember's attention does not compute (a mask or bias of its own, sinks, dropout, a non-causal layer)."""
    where = _where(module)
    if attention_mask is not None:
        raise FallbackUnsupported(f"{where} adds its own mask or bias to the attention scores (ALiBi, a prefix or "
                                  f"bidirectional mask, ...); ember's attention is causal over the K/V cache")
    if getattr(module, "is_causal", True) is False or extra.get("is_causal", True) is False:
        raise FallbackUnsupported(f"{where} is not causal attention")
    if extra.get("dropout"):
        raise FallbackUnsupported(f"{where} applies attention dropout {extra['dropout']}")
    for name, arg in extra.items():
        if name not in _HARMLESS_ARGS and arg is not None:
            raise FallbackUnsupported(f"{where} hands its attention function {name!r} (e.g. attention sinks or a "
                                      f"position bias), which ember's attention does not take")
    if sliding_window is NOT_HANDED:      # some modules keep their window without handing it over
        sliding_window = getattr(module, "sliding_window", None)
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
        raise FallbackUnsupported(f"{where} has sliding window {sliding_window!r}; ember needs a positive int")
    return CallOptions(float(scaling) if scaling is not None else None, sliding_window or None,
                       float(softcap) if softcap else None)


def layer_options(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  call: CallOptions) -> AttentionLayerOptions:
    """The ember attention options of a layer from one call (query [1, Hq, T, D], key/value [1, Hkv, T, D])."""
    where = _where(module)
    if query.shape[0] != 1:
        raise FallbackUnsupported(f"{where} was called with batch {query.shape[0]}; the fallback packs a step "
                                  f"into one sequence")
    num_heads, head_size = query.shape[1], query.shape[-1]
    num_kv_heads = key.shape[1]
    if key.shape[-1] != head_size or value.shape[-1] != head_size:
        raise FallbackUnsupported(f"{where} has query/key/value head sizes {head_size}/{key.shape[-1]}/"
                                  f"{value.shape[-1]}; ember's KV cache holds one head size for all three")
    if value.shape[1] != num_kv_heads or num_heads % num_kv_heads:
        raise FallbackUnsupported(f"{where} has {num_heads} query heads, {num_kv_heads} key heads and "
                                  f"{value.shape[1]} value heads; ember needs as many value heads as key heads, "
                                  f"dividing the query heads")
    return AttentionLayerOptions(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                                 scale=call.scale if call.scale is not None else head_size ** -0.5,
                                 sliding_window=call.sliding_window, logits_soft_cap=call.soft_cap)


_probe: contextvars.ContextVar[list | None] = contextvars.ContextVar("ember_fallback_probe", default=None)


@contextlib.contextmanager
def probing() -> Iterator[list]:
    """Record (module, AttentionLayerOptions) of every attention call inside, answering each with an empty output
    (the build-time forward on the meta device)."""
    calls: list = []
    token = _probe.set(calls)
    try:
        yield calls
    finally:
        _probe.reset(token)


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, scaling: float | None = None, sliding_window: Any = NOT_HANDED,
                      softcap: float | None = None, **extra) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over ember's paged cache: query [1, Hq, T, D], key/value
    [1, Hkv, T, D] -> (output [1, T, Hq, D], no weights)."""
    call = call_options(module, attention_mask, scaling, sliding_window, softcap, extra)
    attn = module._modules.get(ATTENTION_CHILD)
    if attn is None:
        calls = _probe.get()
        if calls is None:
            raise RuntimeError(f"{type(module).__name__} uses attn_implementation={ATTN_IMPLEMENTATION!r} outside an "
                               f"ember model; build it through ember.models.transformers_fallback")
        calls.append((module, layer_options(module, query, key, value, call)))
        return query.new_empty(1, query.shape[2], query.shape[1], value.shape[-1]), None
    o = attn.options
    if (call.scale if call.scale is not None else o.head_size ** -0.5, call.sliding_window, call.soft_cap) != \
            (o.scale, o.sliding_window, o.logits_soft_cap):
        raise FallbackUnsupported(f"{_where(module)} called its attention with {call}, not as at build time "
                                  f"(scale {o.scale}, window {o.sliding_window}, soft cap {o.logits_soft_cap})")
    num_tokens = query.shape[2]
    q = query[0].transpose(0, 1).reshape(num_tokens, o.num_heads * o.head_size)        # [T, Hq*D]
    k = key[0].transpose(0, 1).reshape(num_tokens, o.num_kv_heads * o.head_size)       # [T, Hkv*D]
    v = value[0].transpose(0, 1).reshape(num_tokens, o.num_kv_heads * o.head_size)     # [T, Hkv*D]
    out = attn(q, k, v)                                                                # [T, Hq*D]
    return out.view(1, num_tokens, o.num_heads, o.head_size), None


def register_attention() -> None:
    """Register `attention_forward` in transformers' attention interface as "ember" (idempotent)."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
