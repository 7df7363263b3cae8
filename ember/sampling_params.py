"""`SamplingParams`: how to sample one request, frozen and validated when it is made."""

from __future__ import annotations

import dataclasses
import functools
import numbers
import operator
from dataclasses import dataclass

from ember.compat import SAMPLING_HINTS, unknown_argument_error

MAX_LOGPROBS = 20
# Below this a positive temperature samples greedily, as in vLLM: dividing logits by it overflows float32.
MIN_TEMPERATURE = 1e-5
FLOAT32_MAX = 3.4028234663852886e38

_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
_OPTIONAL_INT_FIELDS = ("seed", "max_tokens", "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")


def as_int(name: str, value) -> int:
    """`value` as a Python int; numpy and torch integers count, floats and bools do not (TypeError naming `name`)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")


def _as_float(name: str, value) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request; mirrors vLLM's `SamplingParams`. temperature 0 means greedy, and so does any
    temperature below `MIN_TEMPERATURE` (it is stored as 0). `n` completions are sampled from one prompt, which is
    prefilled once; with a `seed`, completion i samples with seed `(seed + i) % 2**63`."""
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
    prompt_logprobs: int | None = None     # logprobs of the prompt tokens, with this many top tokens each
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        self._normalize_types()
        self._validate()

    def _normalize_types(self) -> None:
        """Check each field's type (TypeError naming the field) and store plain Python values, so that the object
        stays hashable and immutable and nothing of a wrong type reaches a step."""
        def put(name, value):
            object.__setattr__(self, name, value)

        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_INT_FIELDS:
                continue
            put(name, as_int(name, value))
        for name in _FLOAT_FIELDS:
            put(name, _as_float(name, getattr(self, name)))
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)):
            for s in stop:
                if not isinstance(s, str):
                    raise TypeError(f"stop must be a str or a list of str, got an entry {type(s).__name__} {s!r}")
        else:
            raise TypeError(f"stop must be a str or a list of str, got {type(stop).__name__} {stop!r}")
        put("stop", tuple(stop))
        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        elif isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise TypeError(f"stop_token_ids must be a list of int, got {type(ids).__name__} {ids!r}")
        put("stop_token_ids", tuple(as_int("stop_token_ids entry", t) for t in ids))
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            put("temperature", 0.0)

    def _validate(self) -> None:
        def bad(msg):
            raise ValueError(msg)
        if self.n < 1:
            bad(f"n {self.n} must be at least 1 (the number of completions to sample for each prompt)")
        if not 0.0 <= self.temperature <= FLOAT32_MAX:
            bad(f"temperature {self.temperature} must be a finite number in [0, {FLOAT32_MAX:.4g}] (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p {self.top_p} must be in (0, 1]")
        if self.top_k < -1 or self.top_k == 0:
            bad(f"top_k {self.top_k} must be -1 (disabled) or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p {self.min_p} must be in [0, 1]")
        if not 0.0 < self.repetition_penalty <= FLOAT32_MAX:
            bad(f"repetition_penalty {self.repetition_penalty} must be a finite number > 0 (1 disables it)")
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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                bad(f"{name} {value} must be in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            bad(f"seed {self.seed} must be in [0, 2**63)")
        if any(not s for s in self.stop):
            bad(f"stop {self.stop!r} must be non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            bad(f"stop_token_ids {self.stop_token_ids!r} must be non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams))
_dataclass_init = SamplingParams.__init__


@functools.wraps(_dataclass_init)
def _init_naming_unknown_arguments(self, *args, **kwargs):
    # vLLM scripts pass arguments ember lacks (best_of, logit_bias, ...): say which, and what to use instead
    for name in kwargs:
        if name not in _FIELD_NAMES:
            raise unknown_argument_error("SamplingParams()", name, _FIELD_NAMES, SAMPLING_HINTS)
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _init_naming_unknown_arguments
