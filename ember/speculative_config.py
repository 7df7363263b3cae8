"""`SpeculativeConfig`: how the engine speculates (vLLM's `speculative_config` dict, resolved once)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

METHODS = ("ngram",)
# the batch size past which the n-gram proposer stops proposing (see docs/spec_decode.md for why this default)
DEFAULT_DISABLE_BY_BATCH_SIZE = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """An n-gram proposer: the last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) are looked up
    among the request's earlier tokens, and up to `num_speculative_tokens` tokens that followed are proposed; a
    step with more than `disable_by_batch_size` running requests proposes nothing."""
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self):
        if self.method == "draft_model":
            raise ValueError("speculative method 'draft_model' is not supported yet: ember's runner holds one "
                             "model; use {'method': 'ngram', ...}")
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not known; use one of {METHODS}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config {name} {v!r} must be an integer of at least 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min {self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max {self.prompt_lookup_max}")
        if self.num_speculative_tokens > 16:
            raise ValueError(f"speculative_config num_speculative_tokens {self.num_speculative_tokens} exceeds 16; "
                             f"past a few tokens the acceptance of a whole run falls off")

    @classmethod
    def from_dict(cls, spec: "Mapping[str, object] | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """The config of a `speculative_config` dict (None stays None); an unknown key is refused by name."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, Mapping):
            raise TypeError(f"speculative_config must be a dict, got {type(spec).__name__} {spec!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config key {unknown[0]!r} is not known; use {sorted(known)}")
        if "method" not in spec:
            raise ValueError(f"speculative_config needs a 'method' (one of {METHODS}), got {dict(spec)!r}")
        return cls(**spec)
