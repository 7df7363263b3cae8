"""`SpeculativeConfig`: how the engine speculates (vLLM's `speculative_config` dict, resolved once)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

METHODS = ("ngram", "draft_model")
# the batch size past which the n-gram proposer stops proposing (see docs/spec_decode.md for why this default)
DEFAULT_DISABLE_BY_BATCH_SIZE = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """Method "ngram": the last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) are looked up
    among the request's earlier tokens, and up to `num_speculative_tokens` tokens that followed are proposed.
    Method "draft_model": a smaller model of the same vocabulary (`model`: a folder, or with load_format "dummy" a
    bundled config name) proposes them greedily. A step with more than `disable_by_batch_size` running requests
    proposes nothing."""
    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not known; use one of {METHODS}")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative method 'draft_model' needs 'model' (a folder or a bundled config name), "
                             f"got {self.model!r}")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f"speculative_config model {self.model!r} is for method 'draft_model'; the n-gram "
                             f"proposer runs no model")
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
        lookup = sorted(k for k in spec if k.startswith("prompt_lookup_"))
        if spec["method"] == "draft_model" and lookup:
            raise ValueError(f"speculative_config key {lookup[0]!r} is for method 'ngram'; a draft model looks "
                             f"nothing up")
        return cls(**spec)
