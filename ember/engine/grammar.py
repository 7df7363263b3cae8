"""Grammars for structured output, on llguidance (imported on first use; `pip install 'ember[structured]'`).

A request's `StructuredOutputsParams` becomes an llguidance grammar. `check_grammar` checks it without a tokenizer
(a malformed schema, regex or grammar is a ValueError naming the problem) where the request arrives. The engine's
`GrammarCompiler` then compiles it against the model's vocabulary in a thread pool, once per distinct value
(`StructuredOutputsParams.key`), and keeps the result: matchers in their start state, which requests copy.

A copy of a matcher (llguidance's `deep_copy`) shares the original's lexer, and the lock around it, with every other
copy: the masks and tokens of all the requests copied from one matcher are computed one at a time, however many
threads the step gives them. So a grammar that many requests share is compiled again into independent lanes (each
its own lexer and lock, about one compile's time each, in the pool), and its requests are dealt to them in turns.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from ember.sampling_params import StructuredOutputsParams

logger = logging.getLogger("ember")

MAX_CACHED_GRAMMARS = 1024     # distinct compiled grammars kept (least recently used go first)
LANE_REQUESTS = 4              # requests of one grammar dealt to a lane before the next lane (up to max_lanes)
# how an error names what failed to compile
_WHAT = {"json": "the JSON schema", "json_object": "the JSON object grammar", "regex": "the regex",
         "choice": "the choice", "grammar": "the grammar"}


@functools.cache
def llguidance():
    """The llguidance module, or a ValueError saying how to install it."""
    try:
        import llguidance as module
        import llguidance.hf  # noqa: F401 - the tokenizer bridge
        import llguidance.torch  # noqa: F401 - the bitmask helpers
    except ImportError:
        raise ValueError("structured output needs the llguidance package: pip install 'ember[structured]' (or "
                         "pip install llguidance)") from None
    return module


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) that `params` describe; nothing is checked yet."""
    llg = llguidance()
    matcher = llg.LLMatcher
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else {"type": "object"}
        if params.disable_additional_properties:
            schema = _closed_objects(schema)
        options = {"whitespace_flexible": not params.disable_any_whitespace or params.whitespace_pattern is not None}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        return matcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return matcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    # Lark as it is; GBNF (`root ::= ...`, vLLM's EBNF) converted to Lark first
    return llg.grammar_from("grammar", params.grammar)


def _closed_objects(schema):
    """`schema` with additionalProperties false on every object schema that does not set it (vLLM's
    disable_additional_properties, and OpenAI's strict mode)."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def _check(params: StructuredOutputsParams) -> str:
    """'' for a grammar llguidance accepts, else its error message."""
    grammar = grammar_text(params)
    failed, messages = llguidance().LLMatcher.validate_grammar_with_warnings(grammar, None)
    return messages[0] if failed else ""


def check_grammar(params: StructuredOutputsParams) -> None:
    """Raise ValueError naming the problem if llguidance refuses the grammar (no tokenizer needed; any thread)."""
    error = _check(params)
    if error:
        raise ValueError(f"{_WHAT[params.kind]} cannot be compiled: {error.strip()}")


class _Lanes:
    """One distinct grammar's compiles: lane 0 (the compile that may fail) and the lanes opened since."""
    __slots__ = ("futures", "num_requests")

    def __init__(self, first: Future):
        self.futures = [first]
        self.num_requests = 0


class GrammarCompiler:
    """Compiles grammars against one vocabulary in a thread pool (llguidance drops the GIL while it builds one),
    once per distinct `StructuredOutputsParams.key`, and again into up to `max_lanes` independent lanes for a grammar
    that many requests share (`LANE_REQUESTS` requests a lane, in turns). `submit(params)` returns a Future of the
    matcher in its start state that the next request of `params` copies, or of the ValueError that refused the
    grammar; any thread may call it."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], max_workers: int = 2,
                 max_lanes: int = 1):
        if max_lanes < 1:
            raise ValueError(f"max_lanes is {max_lanes}; a grammar needs at least one lane")
        self.vocab_size = vocab_size
        self.max_lanes = max_lanes
        self._hf_tokenizer = hf_tokenizer
        self._eos = list(eos_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ember-grammar")
        self._cache: OrderedDict[tuple, _Lanes] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self.num_compiled = 0         # distinct grammars compiled (lane 0 of each)
        self.compile_s = 0.0          # seconds spent compiling them, summed over the pool's threads
        self.num_lanes = 0            # further lanes compiled
        self.lanes_s = 0.0            # seconds spent compiling those
        self.tokenizer_s = 0.0        # the vocabulary's one-time conversion

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of `params` for its next request: the lane its turn falls on, cached, or compiling,
        or submitted now (lane 0, where a failed compile is found, stands for every lane once it has failed)."""
        key = params.key
        with self._lock:
            lanes = self._cache.get(key)
            if lanes is None:
                lanes = self._cache[key] = _Lanes(self._pool.submit(self._compile, params, 0))
                if len(self._cache) > MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
            turn = lanes.num_requests // LANE_REQUESTS % self.max_lanes
            lanes.num_requests += 1
            first = lanes.futures[0]
            if turn == 0 or (first.done() and first.exception() is not None):
                return first
            if turn == len(lanes.futures):      # lanes open in order
                lanes.futures.append(self._pool.submit(self._compile, params, turn))
            return lanes.futures[turn]

    def _ll_tokenizer(self):
        """llguidance's view of the model's vocabulary, built once (about a second for 50k tokens)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                start = time.perf_counter()
                llg = llguidance()
                # EOS ids the tokenizer itself holds (a model's config may name ids past a borrowed tokenizer's)
                eos = [t for t in self._eos if t < len(self._hf_tokenizer)]
                try:
                    self._tokenizer = llg.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                            eos_token=eos or None)
                except (TypeError, ValueError, AttributeError) as exc:
                    raise ValueError(f"structured output needs a tokenizer llguidance can read (a fast, "
                                     f"`tokenizers` one): {exc}") from None
                self.tokenizer_s = time.perf_counter() - start
            return self._tokenizer

    def _compile(self, params: StructuredOutputsParams, lane: int):
        tokenizer = self._ll_tokenizer()
        start = time.perf_counter()
        grammar = grammar_text(params)
        matcher = llguidance().LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{_WHAT[params.kind]} cannot be compiled: {matcher.get_error().strip()}")
        elapsed = time.perf_counter() - start
        with self._lock:
            if lane == 0:
                self.num_compiled += 1
                self.compile_s += elapsed
            else:
                self.num_lanes += 1
                self.lanes_s += elapsed
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
