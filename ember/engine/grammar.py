"""Grammars for structured output, on llguidance (imported on first use; `pip install 'ember[structured]'`).

A request's `StructuredOutputsParams` becomes an llguidance grammar. `check_grammar` checks it without a tokenizer
(a malformed schema, regex or grammar is a ValueError naming the problem) where the request arrives. The engine's
`GrammarCompiler` then compiles it against the model's vocabulary in a thread pool, once per distinct value
(`StructuredOutputsParams.key`), and keeps the result: a matcher in its start state, which each request copies.
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


class GrammarCompiler:
    """Compiles grammars against one vocabulary in a thread pool (llguidance drops the GIL while it builds one),
    once per distinct `StructuredOutputsParams.key`. `submit(params)` returns a Future of the matcher in its start
    state, or of the ValueError that refused the grammar; any thread may call it."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], max_workers: int = 2):
        self.vocab_size = vocab_size
        self._hf_tokenizer = hf_tokenizer
        self._eos = list(eos_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ember-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self.num_compiled = 0
        self.compile_s = 0.0          # seconds spent compiling, summed over the pool's threads
        self.tokenizer_s = 0.0        # the vocabulary's one-time conversion

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of `params`: cached, or compiling, or submitted now."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return future

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

    def _compile(self, params: StructuredOutputsParams):
        tokenizer = self._ll_tokenizer()
        start = time.perf_counter()
        grammar = grammar_text(params)
        matcher = llguidance().LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{_WHAT[params.kind]} cannot be compiled: {matcher.get_error().strip()}")
        elapsed = time.perf_counter() - start
        with self._lock:
            self.num_compiled += 1
            self.compile_s += elapsed
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
