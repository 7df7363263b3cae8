"""Llama (incl. SmolLM2 and Llama 3 rope scaling) and Mistral; the decoder blocks here are shared by the
Llama-shaped families (Qwen2, Qwen3, Gemma), which differ only in the switches of `BlockOptions`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ember.distributed.shard import current_shard
from ember.models.layers.activation import get_act_and_mul
from ember.models.layers.attention import Attention
from ember.models.layers.embedding import LMHead, VocabEmbedding
from ember.models.layers.linear import GateUpLinear, QKVLinear, RowParallelLinear
from ember.models.layers.norm import RMSNorm
from ember.models.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters_from_config


@dataclass(frozen=True)
class BlockOptions:
    """What differs between the Llama-shaped families; each model class derives it from the HF config."""
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False                       # RMSNorm over each head of q and k before rotary (Qwen3)
    norm_cls: type[RMSNorm] = RMSNorm
    embed_scale: float | None = None            # multiply embeddings by this (Gemma: sqrt(hidden))
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 instead of head_size ** -0.5
    attn_logit_softcap: float | None = None     # scores become cap * tanh(scores / cap) (Gemma 2)
    attn_sinks: bool = False                    # one learned sink logit per query head (gpt-oss)


def head_size_of(config) -> int:
    """`head_dim` when the config sets it, else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config, layer_idx: int) -> int | None:
    """The layer's attention window, or None for full attention (Mistral: every layer; Qwen2/3: by layer type)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    max_window_layers = getattr(config, "max_window_layers", None)
    if max_window_layers is not None and layer_idx < max_window_layers:
        return None
    return window


def kv_sharing_targets(config) -> dict[int, int]:
    """Layer index -> the earlier layer whose KV cache it reads. With `num_kv_shared_layers` N in the config (the
    key Gemma 3n uses), each of the last N layers reads the cache of the last non-sharing layer of its attention
    type (same sliding window), and computes no K/V of its own."""
    n = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    num_layers = config.num_hidden_layers
    if n == 0:
        return {}
    if not 0 < n < num_layers:
        raise ValueError(f"num_kv_shared_layers {n} must be between 0 and num_hidden_layers - 1 ({num_layers - 1})")
    first = num_layers - n
    targets = {}
    for i in range(first, num_layers):
        window = sliding_window_of(config, i)
        same = [j for j in range(first) if sliding_window_of(config, j) == window]
        if not same:
            raise ValueError(f"layer {i} shares the KV cache of an earlier layer with sliding window {window}, but "
                             f"no layer before {first} has that window")
        targets[i] = same[-1]
    return targets


def _attn_layer_name(prefix: str, layer_idx: int) -> str:
    return f"{prefix}model.layers.{layer_idx}.self_attn.attn"


class LlamaAttention(nn.Module):
    """Packed q/k/v projection, optional per-head q/k norm, rotary, paged attention through `ember::attention`.
    Under tensor parallelism it holds this rank's heads (`num_heads`, `num_kv_heads`) and o_proj reduces."""

    def __init__(self, config, layer_idx: int, options: BlockOptions, prefix: str = ""):
        super().__init__()
        num_heads = config.num_attention_heads
        self.head_size = head_size_of(config)
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_size, num_heads,
                                  getattr(config, "num_key_value_heads", None) or num_heads, bias=options.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads   # this rank's
        self.o_proj = RowParallelLinear(num_heads * self.head_size, config.hidden_size, bias=options.o_bias)
        self.q_norm = options.norm_cls(self.head_size, config.rms_norm_eps) if options.qk_norm else None
        self.k_norm = options.norm_cls(self.head_size, config.rms_norm_eps) if options.qk_norm else None
        # the plain (Llama-form) RMSNorm on q and k can run as one joint norm; other forms run per projection
        self._joint_qk = options.qk_norm and options.norm_cls is RMSNorm
        scale = (options.query_pre_attn_scalar or self.head_size) ** -0.5
        # a KV-sharing layer keeps its k/v weights (checkpoints carry them) but computes q only
        self.kv_source = kv_sharing_targets(config).get(layer_idx)
        source = None if self.kv_source is None else _attn_layer_name(prefix, self.kv_source)
        self.attn = Attention(layer_name=_attn_layer_name(prefix, layer_idx),
                              num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                              scale=scale, sliding_window=sliding_window_of(config, layer_idx),
                              logits_soft_cap=options.attn_logit_softcap, kv_sharing_target=source,
                              sinks=options.attn_sinks, first_head=current_shard().rank * self.num_heads,
                              num_heads_in_model=num_heads)
        self.attn.kv_heads_in_model = (self.qkv_proj.first_kv_head, self.qkv_proj.num_kv_heads_in_model)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]; cos/sin [T, rotary_dim / 2] for the tokens' positions."""
        if self.kv_source is not None:
            return self._forward_shared_kv(cos, sin, hidden)
        q, k, v = self.qkv_proj.forward_split(hidden)
        if self.attn.fuse_rope and (self.q_norm is None or self._joint_qk) and cos.shape[-1] * 2 == self.head_size:
            # the attention backend norms and rotates q and k (in its decode kernel: no kernel of their own)
            norm = (None, None, 0.0) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight,
                                                                 self.q_norm.eps)
            return self.o_proj(self.attn(q, k, v, rope=(cos, sin, *norm)))
        if self._joint_qk:
            q, k = self._norm_rotate_qk(cos, sin, q, k)
        else:
            q = q.unflatten(-1, (self.num_heads, self.head_size))      # [T, Hq, D]
            k = k.unflatten(-1, (self.num_kv_heads, self.head_size))   # [T, Hkv, D]
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attn(q.flatten(1), k.flatten(1), v)
        return self.o_proj(out)

    def _forward_shared_kv(self, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Attention over the source layer's cache: q only; the k/v handed to the op are never read."""
        q = self.qkv_proj.forward_q(hidden).unflatten(-1, (self.num_heads, self.head_size))   # [T, Hq, D]
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rotary(q, cos, sin)
        unused = q.new_empty(q.shape[0], self.num_kv_heads * self.head_size)                # [T, Hkv*D]
        return self.o_proj(self.attn(q.flatten(1), unused, unused))

    def _norm_rotate_qk(self, cos: torch.Tensor, sin: torch.Tensor, q: torch.Tensor,
                        k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm and rotary over q's and k's heads as one [T, Hq + Hkv, D] tensor: the same arithmetic
        as norming and rotating each, in half the kernels once compiled."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        qk = torch.cat([q, k], dim=-1).unflatten(-1, (hq + hkv, d))           # [T, Hq + Hkv, D]
        weight = torch.cat([self.q_norm.weight.expand(hq, d), self.k_norm.weight.expand(hkv, d)])   # [Hq+Hkv, D]
        qk = apply_rotary(weight * self.q_norm._normalise(qk).to(qk.dtype), cos, sin)
        return qk[:, :hq].contiguous(), qk[:, hq:].contiguous()


class LlamaMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up packed into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, options: BlockOptions):
        super().__init__()
        self.gate_up_proj = GateUpLinear(hidden_size, intermediate_size, bias=options.mlp_bias)
        self.act_fn = get_act_and_mul(options.hidden_act)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=options.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual travels beside the hidden state so each norm can fuse the add."""

    def __init__(self, config, layer_idx: int, options: BlockOptions, prefix: str = ""):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, options, prefix)
        self.mlp = self.make_mlp(config, layer_idx, options)
        self.input_layernorm = options.norm_cls(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = options.norm_cls(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config, layer_idx: int, options: BlockOptions) -> nn.Module:
        """The layer's MLP: dense here; mixture-of-experts families override it."""
        return LlamaMLP(config.hidden_size, config.intermediate_size, options)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(cos, sin, hidden)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm; one rotary table shared by every layer."""
    layer_cls: type[nn.Module] = LlamaDecoderLayer    # families with other MLPs swap it

    def __init__(self, config, options: BlockOptions, prefix: str = ""):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, scale=options.embed_scale)
        self.rotary_emb = RotaryEmbedding(rope_parameters_from_config(config, head_size_of(config)))
        self.layers = nn.ModuleList(self.layer_cls(config, i, options, prefix)
                                    for i in range(config.num_hidden_layers))
        self.norm = options.norm_cls(config.hidden_size, config.rms_norm_eps)
        self.skip_start = prefill_skip_start(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """-> hidden [T, hidden]; with `logits_indices` [N] and a tail of KV-sharing layers, hidden [N, hidden] of
        those tokens only (see `prefill_skip_start`)."""
        hidden = self.embed_tokens(input_ids)     # [T, hidden]
        cos, sin = self.rotary_emb(positions)     # gathered once per step, used by every layer
        residual = None
        for i, layer in enumerate(self.layers):
            if i == self.skip_start and logits_indices is not None:
                hidden, residual = hidden[logits_indices], residual[logits_indices]     # [N, hidden]
                cos, sin = cos[logits_indices], sin[logits_indices]
            hidden, residual = layer(cos, sin, hidden, residual)
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden


def prefill_skip_start(config) -> int | None:
    """The first layer of a tail in which every layer reads another's KV cache, or None. Such layers write no
    cache, so only the tokens whose logits are wanted need them: the model runs that tail on those tokens alone."""
    targets = kv_sharing_targets(config)
    if not targets:
        return None
    start = min(targets)
    return start if all(i in targets for i in range(start, config.num_hidden_layers)) else None


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a flat token batch: forward(ids [T], positions [T]) -> hidden [T, H]."""
    packed_modules = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    model_cls: type[nn.Module] = LlamaModel    # the decoder stack; families with other blocks swap it

    @classmethod
    def block_options(cls, config) -> BlockOptions:
        """The family switches for this config (subclasses override)."""
        bias = bool(getattr(config, "attention_bias", False))
        return BlockOptions(hidden_act=config.hidden_act, qkv_bias=bias, o_bias=bias,
                            mlp_bias=bool(getattr(config, "mlp_bias", False)))

    def __init__(self, config, prefix: str = ""):
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, self.block_options(config), prefix)
        tied = self.model.embed_tokens if getattr(config, "tie_word_embeddings", False) else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied)

    def stamp_layers_path(self) -> str | None:
        """The decoder layers run the same code whatever their index, so the compile may trace the first few and
        stamp out the rest (ember.graphs.layer_stamp): their list's path. None with a prefill-skipping tail, whose
        first layer runs on fewer tokens."""
        return "model.layers" if self.model.skip_start is None else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden [T, hidden] (a flat batch, no batch dim); given
        logits_indices [N] on a model with a KV-sharing tail, hidden [N, hidden] of those tokens."""
        if logits_indices is None:
            return self.model(input_ids, positions)
        return self.model(input_ids, positions, logits_indices)

    @property
    def skips_prefill(self) -> bool:
        """Whether `forward` can run its last layers on the logits tokens alone (given logits_indices)."""
        return getattr(self.model, "skip_start", None) is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        return self.lm_head(hidden)

    def compute_shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> this rank's [N, R] float32 logits of its vocabulary range (`lm_head.vocab_shard`),
        as `compute_logits` computes their columns, not gathered."""
        return self.lm_head.shard_logits(hidden)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama blocks with a sliding window on every layer when the config sets one."""
