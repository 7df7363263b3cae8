"""Incremental detokenization and stop-string matching, per request, on the host."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text without decoding the whole list each step.

    Decodes a small window (from `prefix_offset`) twice, before and after the new tokens, and emits the
    difference, holding back text that ends in an incomplete UTF-8 sequence.

    The output tokens live in `output_ids`: the caller's list when it passes one (it appends each token there,
    then calls `add` only for a token that may end the request or whose text is needed at once), else this
    detokenizer's own (`add` appends). Without stop strings nothing needs the text until an output is built, so
    tokens wait there and are decoded together, in one window, when the text is read: a batch run decodes each
    request once, at its end.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = (), include_stop_str_in_output: bool = False,
                 output_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.token_ids: list[int] = list(prompt_token_ids[-6:])   # a few prompt tokens give the first output context
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""
        self._owns_output = output_ids is None
        self.output_ids: list[int] = [] if output_ids is None else output_ids
        self.num_taken = 0               # output tokens in the text (or left out of it) so far; the rest wait
        self._new_start = 0              # where the text the last emit added begins

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int, add_text: bool = True, check_stop: bool = True) -> str | None:
        """Take one more token (appending it, unless the caller owns `output_ids` and has); returns the stop
        string if the text now contains one (the text is cut before it, or after it with
        include_stop_str_in_output). `add_text=False` leaves the token's text out (a stop token);
        `check_stop=False` looks for no stop string (min_tokens not reached yet)."""
        if self._owns_output:
            self.output_ids.append(token_id)
        if self.tokenizer is None:
            return None
        if not add_text:
            self._flush(len(self.output_ids) - 1)
            self.num_taken = len(self.output_ids)
            return None
        if not self.stop:
            return None
        self._flush(len(self.output_ids) - 1)
        self.num_taken = len(self.output_ids)
        if self._emit([token_id], keep=True):
            return self._check_stop(self._new_start) if check_stop else None
        return None

    def _flush(self, end: int) -> None:
        """Decode the waiting tokens before `end`: in one window when that ends on a whole character, else one by
        one (as they came, so that the text equals what adding each at once would have given)."""
        pending = self.output_ids[self.num_taken:end]
        if not pending:
            return
        self.num_taken = end
        if len(pending) > 1 and self._emit(pending, keep=False):
            return
        for token_id in pending:
            self._emit([token_id], keep=True)

    def _emit(self, token_ids: list[int], keep: bool) -> bool:
        """Append tokens and emit the text they add; returns whether any was emitted. With `keep=False` tokens
        whose text is not complete yet are taken back off."""
        n = len(self.token_ids)
        self.token_ids.extend(token_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._new_start = len(self.text)
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return True
        if not keep:
            del self.token_ids[n:]
        return False

    def _check_stop(self, new_start: int) -> str | None:
        if not self.stop:
            return None
        # only matches that end in the new text: one that ended earlier, before min_tokens, is never honoured
        best = None
        for s in self.stop:
            i = self.text.find(s, max(0, new_start - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        return s

    def output_text(self, finished: bool) -> str:
        """The text to show now. While unfinished, an end that could still grow into a stop string is held back
        (it would be cut if it did), so that the text shown only ever grows."""
        if self.num_taken < len(self.output_ids) and self.tokenizer is not None:
            self._flush(len(self.output_ids))
        if finished or not self.stop or self.include_stop:
            return self.text
        return self.text[:len(self.text) - self._stop_prefix_len()]

    def _stop_prefix_len(self) -> int:
        """Length of the longest end of the text that is the start of some stop string."""
        text = self.text
        for n in range(min(self.max_stop_len - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
