"""The incremental detokenizer's stop strings against a from-scratch reference, on a toy tokenizer: the shown text
only grows, an occurrence is honoured only if it ends once min_tokens is reached, and the final text is the text
up to the honoured stop (or through it with include_stop_str_in_output)."""

import random

import pytest

from ember.engine.detokenizer import IncrementalDetokenizer

PIECES = ["a", "b", "ab", "ba", "c", "abc", " ", "bb"]


class ToyTokenizer:
    """Token i is PIECES[i]; decoding joins the pieces."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(PIECES[i] for i in ids)


def _reference(ids, stops, min_tokens, include):
    """(text, stop) the way vLLM finishes: the first token, from min_tokens on, whose text completes a stop."""
    text = ""
    for n, token in enumerate(ids, start=1):
        start, text = len(text), text + PIECES[token]
        if n < min_tokens:
            continue
        found = [(text.find(s, max(0, start - len(s) + 1)), k, s) for k, s in enumerate(stops)]
        found = [f for f in found if f[0] != -1]
        if found:    # the earliest; of two at the same place, the one listed first
            i, _, s = min(found)
            return (text[:i + len(s)] if include else text[:i]), s, n
    return text, None, len(ids)


@pytest.mark.parametrize("seed", range(300))
def test_stop_strings_against_reference(seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(PIECES)) for _ in range(rng.randint(1, 30))]
    stops = tuple({"".join(rng.choice("abc ") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))})
    min_tokens, include = rng.randint(0, 10), rng.random() < 0.3
    detok = IncrementalDetokenizer(ToyTokenizer(), [0], stop=stops, include_stop_str_in_output=include)
    shown, stop, n = [], None, 0
    for n, token in enumerate(ids, start=1):
        stop = detok.add(token, check_stop=n >= min_tokens)
        shown.append(detok.output_text(finished=stop is not None or n == len(ids)))
        if stop is not None:
            break
    assert all(b.startswith(a) for a, b in zip(shown, shown[1:])), shown
    assert (shown[-1], stop, n) == _reference(ids, stops, min_tokens, include)


def test_holds_back_only_a_possible_stop_start():
    detok = IncrementalDetokenizer(ToyTokenizer(), [0], stop=("abc",))
    detok.add(1)                      # "b": no stop starts with it
    assert detok.output_text(False) == "b"
    detok.add(2)                      # "bab": "ab" may grow into "abc"
    assert detok.output_text(False) == "b"
    detok.add(1)                      # "babb": it did not
    assert detok.output_text(False) == "babb"
    assert detok.add(5) == "abc" and detok.output_text(True) == "babb"


def test_stop_token_text_left_out():
    detok = IncrementalDetokenizer(ToyTokenizer(), [0])
    detok.add(4)
    assert detok.add(2, add_text=False) is None and detok.output_text(True) == "c"


class ByteTokenizer:
    """Token i is the byte i: a multi-byte character spans tokens, as with byte-level BPE."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("seed", range(50))
def test_deferred_decoding_equals_token_by_token(seed):
    """Without stop strings tokens wait and are decoded together when the text is read; the text is the same as
    reading it after every token, also when a read falls inside a multi-byte character."""
    rng = random.Random(seed)
    text = "".join(rng.choice(["a", " ", "é", "€", "𝄞", "ok"]) for _ in range(rng.randint(1, 25)))
    ids = list(text.encode("utf-8"))
    every = IncrementalDetokenizer(ByteTokenizer(), [32])
    deferred = IncrementalDetokenizer(ByteTokenizer(), [32])
    for i, token in enumerate(ids):
        every.add(token)
        every.output_text(False)
        deferred.add(token)
        if rng.random() < 0.2:          # an occasional read part-way
            assert deferred.output_text(False) == every.output_text(False)
    assert deferred.output_text(True) == every.output_text(True) == text
