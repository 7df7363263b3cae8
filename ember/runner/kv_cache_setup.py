"""From a built model to KV-cache groups, backends, cache tensors and metadata builders."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from ember.attention_backends.base import AttentionBackend, AttentionLayerOptions, BuilderContext, MetadataBuilder
from ember.attention_backends.op import AttentionLayerState
from ember.attention_backends.registry import select_backend
from ember.models.layers.attention import Attention
from ember.kv_spec import KVCacheGroup, KVCacheSpec

logger = logging.getLogger("ember")


@dataclass
class AttentionSetup:
    """The model's attention layers grouped by KV-cache spec, each group with its chosen backend."""
    layers: dict[str, Attention]
    groups: list[KVCacheGroup]
    backends: list[type[AttentionBackend]]
    refused: list[dict[str, list[str]]]

    @property
    def num_cache_layers(self) -> int:
        """Layers that own a cache tensor (KV-sharing layers read another's)."""
        return sum(len(g.layer_names) - len(g.kv_sharing) for g in self.groups)

    def bytes_per_block(self) -> int:
        """Bytes one block costs across every layer that owns a cache."""
        return sum(g.spec.page_size_bytes * (len(g.layer_names) - len(g.kv_sharing)) for g in self.groups)


def find_attention_layers(model: nn.Module) -> dict[str, Attention]:
    layers = {m.layer_name: m for m in model.modules() if isinstance(m, Attention)}
    if not layers:
        raise ValueError(f"model {type(model).__name__} has no ember Attention layers")
    return layers


def group_layers(layers: dict[str, Attention], block_size: int, dtype: torch.dtype) -> list[KVCacheGroup]:
    """One group per distinct spec, in layer order."""
    by_spec: dict[KVCacheSpec, list[str]] = {}
    sharing: dict[KVCacheSpec, list[tuple[str, str]]] = {}
    for name, layer in layers.items():
        o = layer.options
        spec = KVCacheSpec(block_size, o.num_kv_heads, o.head_size, dtype, o.sliding_window)
        by_spec.setdefault(spec, []).append(name)
        if o.kv_sharing_target is not None:
            sharing.setdefault(spec, []).append((name, o.kv_sharing_target))
    return [KVCacheGroup(tuple(names), spec, tuple(sharing.get(spec, ()))) for spec, names in by_spec.items()]


def select_backends(model: nn.Module, block_size: int, dtype: torch.dtype, device: torch.device,
                    requested: str) -> AttentionSetup:
    """Group the model's layers and pick a backend per group, logging every refused backend's reasons."""
    layers = find_attention_layers(model)
    groups = group_layers(layers, block_size, dtype)
    backends, refused = [], []
    for g in groups:
        options: list[AttentionLayerOptions] = list({layers[n].options for n in g.layer_names})
        sel = select_backend(g.spec, dtype, device, options, requested)
        for name, reasons in sel.refused.items():
            logger.info("attention backend %s not used for %s layers: %s", name, g.spec.kind, "; ".join(reasons))
        logger.info("attention backend %s for %d %s layers", sel.backend.name, len(g.layer_names), g.spec.kind)
        backends.append(sel.backend)
        refused.append(sel.refused)
    return AttentionSetup(layers, groups, backends, refused)


def allocate_kv_caches(setup: AttentionSetup, num_blocks: int, device: torch.device
                       ) -> dict[str, AttentionLayerState]:
    """Allocate each owning layer's cache in its backend's layout and bind every layer to an impl."""
    states: dict[str, AttentionLayerState] = {}
    caches: dict[str, torch.Tensor] = {}
    for gi, (g, backend) in enumerate(zip(setup.groups, setup.backends)):
        s = g.spec
        shape = backend.kv_cache_shape(num_blocks, s.block_size, s.num_kv_heads, s.head_size)
        shared = dict(g.kv_sharing)
        for name in g.layer_names:
            if name not in shared:
                caches[name] = torch.zeros(shape, dtype=s.dtype, device=device)
        for name in g.layer_names:
            layer = setup.layers[name]
            cache = caches[shared.get(name, name)]
            states[name] = AttentionLayerState(backend.impl_cls(layer.options), cache, gi)
    return states


def make_builders(setup: AttentionSetup, dtype: torch.dtype, device: torch.device, max_num_reqs: int,
                  max_num_tokens: int, max_model_len: int, capture_sizes: tuple[int, ...],
                  backend_options: tuple = ()) -> list[MetadataBuilder]:
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
    return [backend.builder_cls(BuilderContext(g, gi, dtype, device, max_num_reqs, max_num_tokens, max_model_len,
                                               capture_sizes, num_sms, backend_options))
            for gi, (g, backend) in enumerate(zip(setup.groups, setup.backends))]
