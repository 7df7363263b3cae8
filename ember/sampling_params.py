"""`SamplingParams`: how to sample one request, frozen and validated when it is made."""

from __future__ import annotations

import dataclasses
import functools
import json as json_module
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


# the kinds of constraint, in the order vLLM's StructuredOutputsParams lists them
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's backend names that mean llguidance (ember's one grammar engine) or "let ember choose"
GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance")


def check_grammar_backend(name: str | None, where: str) -> None:
    """Refuse a grammar backend other than llguidance (vLLM's "guidance"), naming it."""
    if name is not None and name not in GRAMMAR_BACKENDS:
        raise ValueError(f"{where} {name!r} is not available: ember's structured output runs on llguidance; use "
                         f"{where}='guidance' or 'auto' (or leave it out)")


@dataclass(frozen=True, eq=False)
class StructuredOutputsParams:
    """What a request's output must match, as vLLM's `StructuredOutputsParams`: exactly one of a JSON schema (`json`,
    a dict or its JSON text), any JSON object (`json_object=True`), a regular expression (`regex`), one of a list of
    strings (`choice`) or a grammar (`grammar`: Lark, or GBNF/EBNF rules written `name ::= ...`).

    JSON is written with fixed separators unless `disable_any_whitespace=False` (then any whitespace, or
    `whitespace_pattern`, may go between tokens, which lets a model loop on whitespace; vLLM's default is False).
    The engine compiles it with llguidance (`pip install 'ember[structured]'`) once per distinct value."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False      # vLLM's: ember never falls back to another engine, so either value holds

    def __post_init__(self):
        put = functools.partial(object.__setattr__, self)
        set_kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(f"structured_outputs sets {set_kinds or 'none'} of {list(STRUCTURED_KINDS)}; set exactly "
                             f"one")
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise TypeError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"structured_outputs.{name} must be a non-empty str, got {value!r}")
        if self.json is not None:
            put("json", _json_schema(self.json))
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, (str, bytes)) or not isinstance(choice, (list, tuple)) or not choice:
                raise TypeError(f"structured_outputs.choice must be a non-empty list of str, got {choice!r}")
            bad = [c for c in choice if not isinstance(c, str) or not c]
            if bad:
                raise TypeError(f"structured_outputs.choice entries must be non-empty strings, got {bad[0]!r}")
            put("choice", tuple(choice))
        # what makes two of them compile to the same grammar: the engine's cache key
        kind = set_kinds[0]
        value = getattr(self, kind)
        text = json_module.dumps(value, sort_keys=True) if kind in ("json", "choice") else str(value)
        put("_key", (kind, text, self.disable_any_whitespace, self.disable_additional_properties,
                     self.whitespace_pattern))

    @property
    def kind(self) -> str:
        """Which constraint is set: one of `STRUCTURED_KINDS`."""
        return self._key[0]

    @property
    def key(self) -> tuple:
        """A hashable value equal for two params that compile to the same grammar."""
        return self._key

    def __eq__(self, other) -> bool:
        return isinstance(other, StructuredOutputsParams) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)


def _json_schema(value) -> dict:
    """A JSON schema given as a dict or as JSON text, as a dict (ValueError naming what is wrong)."""
    if isinstance(value, str):
        try:
            value = json_module.loads(value)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
    if isinstance(value, bool):
        value = {} if value else {"not": {}}
    if not isinstance(value, dict):
        raise TypeError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), got "
                        f"{type(value).__name__} {value!r}")
    try:
        json_module.dumps(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"structured_outputs.json must hold JSON values only: {exc}") from None
    return value


@dataclass(frozen=True, eq=False)
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older spelling of `StructuredOutputsParams` (`SamplingParams(guided_decoding=...)`), with its
    `backend`: None, 'auto', 'guidance' or 'llguidance'."""
    backend: str | None = None

    def __post_init__(self):
        check_grammar_backend(self.backend, "backend")
        super().__post_init__()


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
    # the output must match a JSON schema, regex, choice or grammar (vLLM's `guided_decoding=` is accepted too)
    structured_outputs: StructuredOutputsParams | None = None

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
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise TypeError(f"structured_outputs must be a StructuredOutputsParams (from ember.sampling_params), got "
                            f"{type(so).__name__} {so!r}")
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
    if "guided_decoding" in kwargs:      # vLLM's older name for structured_outputs
        guided = kwargs.pop("guided_decoding")
        if kwargs.get("structured_outputs") is not None and guided is not None:
            raise ValueError("give structured_outputs or its older name guided_decoding, not both")
        if guided is not None:
            kwargs["structured_outputs"] = guided
    for name in kwargs:
        if name not in _FIELD_NAMES:
            raise unknown_argument_error("SamplingParams()", name, _FIELD_NAMES, SAMPLING_HINTS)
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _init_naming_unknown_arguments
