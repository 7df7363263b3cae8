"""Structured output's host work in batches: a grammar that many requests share is compiled again into independent
lanes and its requests are dealt to them in turns; a step's bitmask and its token advance, done in llguidance's
thread pool with the rows grouped by lane, equal one matcher per request compiled on its own, filled and advanced
one row at a time (a byte-level BPE vocabulary of 512 tokens)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ember import StructuredOutputsParams
from ember.engine.request import RequestStatus
from tests.helpers.tiny_tokenizer import save_bpe_tokenizer

pytest.importorskip("llguidance")

from ember.engine.grammar import LANE_REQUESTS, GrammarCompiler, grammar_text, llguidance  # noqa: E402
from ember.engine.structured_output import PARALLEL_MIN_ROWS, StructuredOutputs  # noqa: E402

VOCAB = 512
EOS = 2
SCHEMA = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["k", "n", "tags"], "additionalProperties": False}
REGEX = r"[a-z]{2,6}-[0-9]{2}"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    path = tmp_path_factory.mktemp("bpe_lanes")
    save_bpe_tokenizer(path, VOCAB)
    return AutoTokenizer.from_pretrained(str(path))


def test_a_shared_grammar_is_dealt_to_its_lanes_in_turns(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, (EOS,), max_workers=2, max_lanes=3)
    params = StructuredOutputsParams(regex=REGEX)
    futures = [compiler.submit(params) for _ in range(3 * LANE_REQUESTS + 1)]
    matchers = [f.result(timeout=60) for f in futures]
    for i, matcher in enumerate(matchers):      # request i copies lane (i // LANE_REQUESTS) % 3
        assert matcher is matchers[(i // LANE_REQUESTS) % 3 * LANE_REQUESTS]
    assert len({id(m) for m in matchers}) == 3
    other = compiler.submit(StructuredOutputsParams(choice=["yes", "no"])).result(timeout=60)
    assert other not in matchers
    assert (compiler.num_compiled, compiler.num_lanes) == (2, 2)
    compiler.close()


def test_a_grammar_whose_compile_failed_opens_no_lanes(tokenizer, monkeypatch):
    compiler = GrammarCompiler(tokenizer, VOCAB, (EOS,), max_workers=2, max_lanes=4)

    def failing(params, lane):
        raise ValueError(f"lane {lane} cannot be compiled")

    monkeypatch.setattr(compiler, "_compile", failing)
    params = StructuredOutputsParams(regex="x+")
    first = compiler.submit(params)
    assert "lane 0" in str(first.exception(timeout=60))
    assert all(compiler.submit(params) is first for _ in range(3 * LANE_REQUESTS))
    compiler.close()


class _Request:
    def __init__(self, i: int, params: StructuredOutputsParams):
        self.request_id = f"r{i}"
        self.status = RequestStatus.RUNNING
        self.sampling_params = SimpleNamespace(structured_outputs=params)
        self.grammar = None


def _allowed(bitmask_row: torch.Tensor) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:VOCAB])


def test_batched_fill_and_advance_by_lane_equal_one_matcher_a_row(tokenizer):
    llg = llguidance()
    structured = StructuredOutputs(tokenizer, VOCAB, (EOS,), threads=3)
    kinds = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
             StructuredOutputsParams(json=SCHEMA)]
    requests = [_Request(i, kinds[i % 3]) for i in range(24)]
    for req in requests:
        structured.attach(req)
    for req in requests:
        req.grammar.future.result(timeout=60)
        assert req.grammar.ready
    schema_lanes = {req.grammar.lane for req in requests if req.sampling_params.structured_outputs.kind == "json"}
    assert len(schema_lanes) == 3           # 16 requests of the schema, 4 a lane in turns over 3 lanes
    # the reference: each request's own matcher, compiled alone, advanced one row at a time
    ll_tokenizer = structured.compiler._ll_tokenizer()
    reference = [llg.LLMatcher(ll_tokenizer, grammar_text(r.sampling_params.structured_outputs), log_level=0)
                 for r in requests]
    # batch rows: a row without a grammar after every third constrained one
    scheduled, grammar_rows = [], []
    for i, req in enumerate(requests):
        grammar_rows.append(len(scheduled))
        scheduled.append(SimpleNamespace(request=req))
        if i % 3 == 2:
            scheduled.append(SimpleNamespace(request=SimpleNamespace(status=RequestStatus.RUNNING, grammar=None)))
    out = SimpleNamespace(step=SimpleNamespace(grammar_rows=tuple(grammar_rows)), scheduled=scheduled)
    words = -(-VOCAB // 32)
    rng = random.Random(0)
    num_refused = 0
    for step in range(40):
        bitmask = torch.zeros((len(requests) + 2, words), dtype=torch.int32)
        assert structured.fill(out, bitmask) == len(requests)
        expected = torch.zeros_like(bitmask)
        for j, (req, matcher) in enumerate(zip(requests, reference)):
            if req.grammar.error is None:
                llg.torch.fill_next_token_bitmask(matcher, expected, j)
            else:
                expected[j] = -1
        assert torch.equal(bitmask, expected), f"step {step}"
        sampled = np.full(len(scheduled), 7, dtype=np.int64)     # rows without a grammar hold any token
        for j, req in enumerate(requests):
            allowed = _allowed(bitmask[j])
            token = int(allowed[rng.randrange(len(allowed))])
            if step % 9 == 4 and j == step % len(requests):    # now and then a token the grammar refuses
                token = int(next(t for t in range(VOCAB) if t not in set(allowed.tolist())))
            sampled[grammar_rows[j]] = token
        refused_before = [req.grammar.error is not None for req in requests]
        structured.advance(out, sampled)
        for j, (req, matcher) in enumerate(zip(requests, reference)):
            if refused_before[j]:
                continue
            accepted = matcher.consume_token(int(sampled[grammar_rows[j]]))
            assert (req.grammar.error is None) == accepted, f"step {step} row {j}"
            num_refused += not accepted
    assert len(requests) >= PARALLEL_MIN_ROWS and num_refused >= 3
    assert any(req.grammar.matcher.is_stopped() for req in requests)     # some reached the end of their grammar
    structured.close()
