"""`SamplingParams`: how to sample one request, frozen and validated when it is made."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request; mirrors vLLM's `SamplingParams`. temperature 0 means greedy."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        # normalise containers so the object stays hashable and immutable
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        def bad(msg):
            raise ValueError(msg)
        if self.n != 1:
            bad(f"n={self.n} is not supported; ember returns one completion per prompt (n=1)")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad(f"temperature {self.temperature} must be a finite number >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p {self.top_p} must be in (0, 1]")
        if self.top_k < -1 or self.top_k == 0:
            bad(f"top_k {self.top_k} must be -1 (disabled) or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p {self.min_p} must be in [0, 1]")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad(f"repetition_penalty {self.repetition_penalty} must be > 0 (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                bad(f"{name} {v} must be in [-2, 2]")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens {self.max_tokens} must be at least 1")
        if self.min_tokens < 0:
            bad(f"min_tokens {self.min_tokens} must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens {self.min_tokens} must not exceed max_tokens {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad(f"logprobs {self.logprobs} must be in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            bad(f"seed {self.seed} must be in [0, 2**63)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad(f"stop {self.stop!r} must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad(f"stop_token_ids {self.stop_token_ids!r} must be non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
