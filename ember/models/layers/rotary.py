"""Rotary position embedding (neox / rotate-half layout) with default, linear, llama3 and yarn frequency scaling.

The cos/sin table is computed once per model for every position up to the model's limit and indexed by the
step's positions; it is a non-persistent buffer created on the real device after weight loading.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeParameters:
    """The rope settings of an HF config, read from `rope_parameters` (transformers 5) or `rope_scaling` (4.x)."""
    rope_type: str
    theta: float
    rotary_dim: int
    max_position: int
    scaling: tuple[tuple[str, object], ...] = ()

    def get(self, key: str, default=None):
        value = dict(self.scaling).get(key)
        return default if value is None else value


LAYER_TYPES = ("full_attention", "sliding_attention")


def has_rope_per_layer_type(config) -> bool:
    """Whether the config gives each layer type its own rope settings (Gemma 3: a local and a global base)."""
    params = getattr(config, "rope_parameters", None) or {}
    return any(t in params for t in LAYER_TYPES) or getattr(config, "rope_local_base_freq", None) is not None


def rope_parameters_from_config(config, head_size: int, layer_type: str | None = None) -> RopeParameters:
    """Read rope settings from either config layout; raise ValueError for rope types ember does not implement.

    With `layer_type` ("full_attention" / "sliding_attention"), read that type's settings from a per-layer-type
    `rope_parameters` (transformers 5), or from `rope_theta` / `rope_local_base_freq` / `rope_scaling`, where the
    scaling applies to global layers only (the transformers 4.x layout of Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    per_type = any(t in params for t in LAYER_TYPES)
    if per_type:
        if layer_type is None:
            raise ValueError(f"the config has rope parameters per layer type {sorted(params)}; name the layer type")
        if layer_type not in params:
            raise ValueError(f"no rope parameters for layer type {layer_type!r}; the config has {sorted(params)}")
        params = dict(params[layer_type] or {})
    elif layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None) is not None:
        params = {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    theta = 10000.0 if theta is None else float(theta)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
    max_position = int(config.max_position_embeddings)
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings",
                          getattr(config, "original_max_position_embeddings", None) or max_position)
    if rope_type == "yarn":
        # yarn extends the context to original * factor; make the table cover it
        factor = params.get("factor") or max_position / params["original_max_position_embeddings"]
        params["factor"] = factor
        max_position = max(max_position, int(params["original_max_position_embeddings"] * factor))
    scaling = tuple(sorted((k, v) for k, v in params.items()
                           if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")))
    return RopeParameters(rope_type, theta, int(head_size * partial), max_position, scaling)


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))   # [dim / 2]


def _llama3_inv_freq(p: RopeParameters) -> torch.Tensor:
    inv_freq = _default_inv_freq(p.theta, p.rotary_dim)
    factor, low, high = p.get("factor"), p.get("low_freq_factor"), p.get("high_freq_factor")
    old_len = p.get("original_max_position_embeddings")
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed by `factor`, short ones kept, and the band between interpolated smoothly
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(p: RopeParameters) -> tuple[torch.Tensor, float]:
    dim, theta, factor = p.rotary_dim, p.theta, p.get("factor")
    original = p.get("original_max_position_embeddings")
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast", 32), p.get("beta_slow", 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp   # 1: keep the original frequency, 0: interpolate by `factor`
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def compute_inv_freq(p: RopeParameters) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] float32 on CPU, cos/sin multiplier) for the given settings."""
    if p.rope_type == "default":
        return _default_inv_freq(p.theta, p.rotary_dim), 1.0
    if p.rope_type == "linear":
        return _default_inv_freq(p.theta, p.rotary_dim) / p.get("factor"), 1.0
    if p.rope_type == "llama3":
        return _llama3_inv_freq(p), 1.0
    return _yarn_inv_freq(p)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, rotary_dim / 2]: rotate the first rotary_dim channels in rotate-half layout."""
    rotary_dim = cos.shape[-1] * 2
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if rest.shape[-1] == 0:
        return rotated
    return torch.cat((rotated, rest), dim=-1)


class RotaryEmbedding(nn.Module):
    """Owns the [max_position, rotary_dim] cos|sin table; `forward(positions)` gathers the step's rows once."""

    def __init__(self, params: RopeParameters):
        super().__init__()
        self.params = params
        self.rotary_dim = params.rotary_dim
        self.max_position = params.max_position
        self.register_buffer("cos_sin_cache", None, persistent=False)   # [max_position, rotary_dim] float32

    def init_buffers(self, device: torch.device) -> None:
        """Build the table on `device` (after weights are loaded, so it is never built on meta)."""
        inv_freq, attention_factor = compute_inv_freq(self.params)
        positions = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)                   # [max_position, rotary_dim / 2]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor   # [max_position, rotary_dim]
        self.cos_sin_cache = cache.to(device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, rotary_dim / 2] float32."""
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        return cos_sin.chunk(2, dim=-1)

    def extra_repr(self) -> str:
        return f"type={self.params.rope_type}, rotary_dim={self.rotary_dim}, max_position={self.max_position}"
