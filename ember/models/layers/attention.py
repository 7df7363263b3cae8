"""The model-side attention layer: reshapes q/k/v and calls the `ember::attention` op by layer name."""

from __future__ import annotations

import torch
from torch import nn

from ember.attention_backends.op import run_attention   # the import also registers torch.ops.ember.attention
from ember.attention_backends.base import AttentionLayerOptions, RopeInputs
from ember.distributed.shard import CheckpointSlice
from ember.models.layers.linear import make_param


class Attention(nn.Module):
    """Holds no weights but a layer's attention sinks; the runner finds every `Attention` by its `layer_name` and
    binds it to a backend impl, handing it the sinks.

    sinks: one learned logit per query head (gpt-oss) that joins every query's softmax as a column of its own and
    takes its share of the weight without a value: `self.sinks` [this rank's heads], read from a checkpoint tensor of
    the model's `num_heads_in_model` heads at `first_head`."""

    def __init__(self, layer_name: str, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 kv_sharing_target: str | None = None, sinks: bool = False, first_head: int = 0,
                 num_heads_in_model: int | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.layer_name = layer_name
        self.options = AttentionLayerOptions(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, scale=scale,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, kv_sharing_target=kv_sharing_target,
            use_sinks=sinks)
        self.sinks = make_param((num_heads,)) if sinks else None                # [Hq of this rank]
        heads_in_model = num_heads_in_model or num_heads
        if sinks and heads_in_model != num_heads:
            self.sinks.checkpoint_slice = lambda shard_id: CheckpointSlice(0, first_head, num_heads, heads_in_model)
        # set by the runner before the model is traced, from the layer's backend (`AttentionBackend.takes_rope`):
        # the model then hands q and k over before its rotary and q/k norm
        self.fuse_rope = False
        # the checkpoint's fp8 KV-cache scales (k_scale, v_scale: float32 [num_kv_heads]), set by the loader where
        # it has them; an fp8 cache uses them (ember.runner.kv_cache_setup.kv_scales_of)
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        # (the first of this layer's KV heads, the model's KV-head count): a tensor-parallel rank holds a range of
        # them, and reads its range of a checkpoint's per-head scales
        self.kv_heads_in_model = (0, num_kv_heads)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: tuple | None = None) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D]. rope: (cos, sin [T, D/2], q_norm, k_norm [D] or None, eps)
        when q and k still need the model's per-head RMSNorm and rotary (only where `fuse_rope` is set: the layer's
        backend applies them, folded into its attention kernels where it can)."""
        o = self.options
        num_tokens = q.shape[0]
        q = q.view(num_tokens, o.num_heads, o.head_size)
        k = k.view(num_tokens, o.num_kv_heads, o.head_size)
        v = v.view(num_tokens, o.num_kv_heads, o.head_size)
        out = torch.empty_like(q)
        if q.device.type == "cpu" and not torch.compiler.is_compiling():
            # eager on the CPU: no graph needs the op boundary
            run_attention(q, k, v, out, self.layer_name, None if rope is None else RopeInputs(*rope))
        elif rope is None:
            torch.ops.ember.attention(q, k, v, out, self.layer_name)
        else:
            torch.ops.ember.attention(q, k, v, out, self.layer_name, *rope)
        return out.view(num_tokens, o.num_heads * o.head_size)
